"""What this CPU / GPU supports for mixed precision."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

# Measured with benchmarks/bench_autocast.py (512x512 matmul, median of 7) on the
# project's 2-core AVX-512 CPU with avx512_bf16 and no avx512_fp16, over five runs:
# float32 1.5-2.0 ms, bfloat16 0.8-1.1 ms, float16 97-119 ms (54x to 68x float32).
CPU_FP16_SLOWDOWN_NOTE = (
    "50-70x slower than float32 (a 512x512 matmul: 97-119 ms against 1.5-2.0 ms on a 2-core AVX-512 CPU)"
)


class SlowPrecisionWarning(UserWarning):
    """The chosen precision is likely slower than float32 on this hardware."""


def slow_fp16_message() -> str:
    """What to tell someone who asks for float16 on a CPU without float16 arithmetic."""
    return (
        "float16 on a CPU without native float16 arithmetic (no avx512_fp16 / amx_fp16): matmuls run "
        f"{CPU_FP16_SLOWDOWN_NOTE}. Use torch.bfloat16 (`--precision bf16` in ampkit compare); "
        "float16 here is only useful to study its numerics."
    )


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bfloat16 natively (AVX-512 BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) or _arm_has("bf16")


def cpu_has_native_fp16() -> bool:
    """True when the CPU computes float16 natively (AVX-512 FP16, AMX-FP16, Arm fphp)."""
    return bool({"avx512_fp16", "amx_fp16"} & cpu_flags()) or _arm_has("fphp")


def _arm_has(flag: str) -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith(("NEON", "SVE")) and flag in cpu_flags()


def recommend_dtype(device: torch.device | str) -> torch.dtype:
    """The 16-bit dtype to use on ``device``.

    bfloat16 on CPUs (float16 there is emulated unless the CPU has native
    float16) and on CUDA GPUs of compute capability >= 8.0; float16 on older
    GPUs, whose tensor cores have no bfloat16.
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    return torch.bfloat16


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "amx_tile")


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    """One CUDA device and what its tensor cores compute."""

    index: int
    name: str
    compute_capability: str
    memory_bytes: int
    fp16_tensor_cores: bool  # >= 7.0 (Volta)
    bf16_tensor_cores: bool  # >= 8.0 (Ampere)
    fp8_tensor_cores: bool  # >= 8.9 (Ada, Hopper)


@dataclasses.dataclass(frozen=True)
class HardwareReport:
    """What this machine supports for mixed precision."""

    torch_version: str
    cuda_version: str | None
    cpu: str
    cpu_cores: int | None
    cpu_capability: str  # torch's SIMD level (AVX2, AVX512, ...)
    cpu_features: dict[str, bool]
    cpu_native_bf16: bool
    cpu_native_fp16: bool
    gpus: list[GPUInfo]


def report() -> HardwareReport:
    """torch/CUDA versions, each GPU's tensor-core support, the CPU's 16-bit features."""
    import os

    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            cc = (props.major, props.minor)
            gpus.append(GPUInfo(index, props.name, f"{cc[0]}.{cc[1]}", props.total_memory, cc >= (7, 0),
                                cc >= (8, 0), cc >= (8, 9)))
    flags = cpu_flags()
    return HardwareReport(
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        cpu=cpu_model_name(),
        cpu_cores=os.cpu_count(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_features={name: name in flags for name in CPU_FEATURES},
        cpu_native_bf16=cpu_has_native_bf16(),
        cpu_native_fp16=cpu_has_native_fp16(),
        gpus=gpus,
    )


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What to use on a device, and why."""

    device: str
    dtype: torch.dtype
    opt_level: str
    loss_scaling: bool
    reasons: list[str]
    warnings: list[str]


def recommend(device: torch.device | str | None = None, batch_size: int | None = None) -> Recommendation:
    """The dtype, opt level and loss scaling to use on ``device`` (default: CUDA if present).

    Warns (in ``warnings``) where mixed precision is likely slower: float16 on a CPU
    without float16 arithmetic, a GPU without tensor cores, very small batches.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = recommend_dtype(device)
    reasons, cautions = [], []
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        if major >= 8:
            reasons.append(f"{name} (compute capability {major}.{minor}) has bfloat16 tensor cores: bfloat16 has "
                           "float32's range, so no loss scaling is needed")
        elif major >= 7:
            reasons.append(f"{name} (compute capability {major}.{minor}) has float16 tensor cores but no "
                           "bfloat16 ones: float16 with dynamic loss scaling")
        else:
            cautions.append(f"{name} (compute capability {major}.{minor}) has no tensor cores: mixed precision "
                            "saves memory but is likely slower than float32 (P100: +20% time, -30% memory)")
    else:
        if cpu_has_native_bf16():
            reasons.append("this CPU computes bfloat16 natively (avx512_bf16 / amx_bf16): bfloat16 matmuls are "
                           "about 2x float32")
        else:
            cautions.append("this CPU has no native bfloat16: mixed precision saves memory but may be slower")
        if not cpu_has_native_fp16():
            cautions.append(f"float16 on this CPU is emulated: {slow_fp16_message()}")
    if batch_size is not None and batch_size < 16:
        cautions.append(f"batch size {batch_size} is small: per-op casts may outweigh the faster matmuls")
    opt_level = "O2" if dtype == torch.bfloat16 else "O1"
    reasons.append(
        "O2 (16-bit model, float32 master weights) skips per-op casts" if opt_level == "O2"
        else "O1 (autocast) keeps float32 weights, the safest start with float16"
    )
    return Recommendation(device.type, dtype, opt_level, dtype == torch.float16, reasons, cautions)


def machine_summary(device: torch.device | str = "cpu") -> dict[str, object]:
    """Plain facts about this machine for result files: versions, device, 16-bit support."""
    device = torch.device(device)
    hw = report()
    summary: dict[str, object] = {
        "torch": hw.torch_version,
        "cpu": hw.cpu,
        "cpu_cores": hw.cpu_cores,
        "cpu_native_bf16": hw.cpu_native_bf16,
        "cpu_native_fp16": hw.cpu_native_fp16,
        "device": device.type,
        "device_name": hw.cpu,
    }
    if device.type == "cuda":
        gpu = hw.gpus[device.index or 0]
        summary.update(device_name=gpu.name, cuda=hw.cuda_version, compute_capability=gpu.compute_capability)
    return summary
