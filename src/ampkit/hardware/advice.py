"""What to use here, and why: the report, the recommendation, the warnings.

Every figure comes from ``throughput.measure()``; the flags (``flags.py``) only explain it.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ampkit.hardware import flags, throughput
from ampkit.hardware.throughput import OP_CLASSES, Throughput


def slow_native_message(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """What to tell someone who runs native ``dtype`` kernels where they are measured slower
    than float32 (None where they are not)."""
    measured = throughput.measure(device)
    slow = [c for c in ("matmul", "conv") if not measured.native_is_faster(c, dtype)]
    if not slow:
        return None
    name = str(dtype).removeprefix("torch.")
    speeds = ", ".join(f"{c} at {measured.speedup(c, dtype):.3g}x" for c in slow)
    return (
        f"native {name} kernels run {speeds} float32's speed on {measured.device_name} (measured; "
        f"{flags.native_support(device, dtype)}). compute='auto' or 'float32' keeps {name} tensors and computes "
        "GEMMs and convolutions in float32 on them, at about float32's speed."
    )


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
    """What this machine supports for mixed precision: flags, and measured speed.

    ``measured`` holds one Throughput per measured device (the CPU, and the current
    GPU where there is one).
    """

    torch_version: str
    cuda_version: str | None
    cpu: str
    cpu_cores: int | None
    cpu_capability: str  # torch's SIMD level (AVX2, AVX512, ...)
    cpu_features: dict[str, bool]
    cpu_native_bf16: bool
    cpu_native_fp16: bool
    gpus: list[GPUInfo]
    measured: list[Throughput]


def report(measured: bool = True) -> HardwareReport:
    """torch/CUDA versions, each GPU's tensor-core support, the CPU's 16-bit features and,
    with ``measured`` (default), the measured 16-bit speed of the CPU and the current GPU."""
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            cc = (props.major, props.minor)
            gpus.append(GPUInfo(index, props.name, f"{cc[0]}.{cc[1]}", props.total_memory, cc >= (7, 0),
                                cc >= (8, 0), cc >= (8, 9)))
    present = flags.cpu_flags()
    devices = ["cpu"] + (["cuda"] if gpus else [])
    return HardwareReport(
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        cpu=flags.cpu_model_name(),
        cpu_cores=os.cpu_count(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_features={name: name in present for name in flags.CPU_FEATURES},
        cpu_native_bf16=flags.cpu_has_native_bf16(),
        cpu_native_fp16=flags.cpu_has_native_fp16(),
        gpus=gpus,
        measured=[throughput.measure(d) for d in devices] if measured else [],
    )


def recommend_dtype(device: torch.device | str) -> torch.dtype:
    """The 16-bit dtype to use on ``device``.

    bfloat16 on CPUs (float16 there is emulated unless the CPU has native
    float16) and on CUDA GPUs of compute capability >= 8.0; float16 on older
    GPUs, whose tensor cores have no bfloat16.

    Args:
        device: a ``torch.device`` or its name (``"cpu"``, ``"cuda:0"``).

    Returns:
        torch.bfloat16 or torch.float16.

    Examples:
        >>> dtype = ampkit.recommend_dtype("cpu")  # torch.bfloat16
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    return torch.bfloat16



@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What to use on a device, and why.

    Attributes:
        dtype: the 16-bit storage dtype.
        compute: ``"native"`` (16-bit kernels) or ``"float32"`` (float32 GEMMs on
            16-bit values), from the measured speeds; what ``compute="auto"`` picks.
        fastest: ``"float32"`` where no 16-bit setting is faster here, else the
            mixed setting (e.g. ``"bf16 native"``).
        speedups: op class -> native ``dtype``'s measured speed over float32's.
        fp8_native: whether FP8 matmuls run natively here (CUDA compute capability >= 8.9);
            elsewhere ``ampkit.convert_to_fp8`` emulates them (FP8 numerics, no FP8 speed).
    """

    device: str
    dtype: torch.dtype
    opt_level: str
    loss_scaling: bool
    compute: str
    fastest: str
    speedups: dict[str, float]
    reasons: list[str]
    warnings: list[str]
    fp8_native: bool = False


def recommend(device: torch.device | str | None = None, batch_size: int | None = None) -> Recommendation:
    """The dtype, compute mode, opt level and loss scaling for ``device`` (default: CUDA if
    present), decided from measured kernel speeds (``measure``) and explained by flags.

    Where native 16-bit GEMMs are slower than float32 (a CPU without avx512_bf16,
    say), float32 is the fastest choice and 16-bit storage with float32 compute is
    recommended for memory: activations take half the bytes at about float32's time.

    Args:
        device: the device to advise on (default: the current CUDA device if there is one, else the CPU).
        batch_size: the training batch, if known: small batches get a caution (per-op casts may outweigh
            faster matmuls).

    Returns:
        A ``Recommendation``: dtype, compute mode, opt level, loss scaling, the fastest setting, the
        measured speedups and the reasons (and cautions) behind them.

    Note:
        Reads ``measure(device)``: the first call on a machine times its kernels for about a second.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = recommend_dtype(device)
    name = str(dtype).removeprefix("torch.")
    measured = throughput.measure(device)
    speedups = {c: measured.speedup(c, dtype) for c in OP_CLASSES}
    gemms = ("matmul", "conv")
    native = all(measured.native_is_faster(c, dtype) for c in gemms)
    figures = f"matmul {speedups['matmul']:.3g}x, conv {speedups['conv']:.3g}x"
    reasons, cautions = [], []
    if native:
        reasons.append(f"native {name} kernels run at {figures} float32's speed here (measured on "
                       f"{measured.device_name}; {flags.native_support(device, dtype)})")
    else:
        reasons.append(f"for speed alone, float32: native {name} kernels run at only {figures} float32's speed "
                       f"here (measured on {measured.device_name}; {flags.native_support(device, dtype)})")
        reasons.append(f"for memory, {name} storage with float32 compute (compute='float32', what 'auto' picks "
                       f"here): activations and weights in {name} take half the bytes, GEMMs and convolutions "
                       "compute in float32 on them at about float32's step time")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major >= 8:
            reasons.append(f"compute capability {major}.{minor}: bfloat16 has float32's range, so no loss scaling "
                           "is needed")
        elif major >= 7:
            reasons.append(f"compute capability {major}.{minor}: float16 tensor cores but no bfloat16 ones: "
                           "float16 with dynamic loss scaling")
        else:
            cautions.append(f"compute capability {major}.{minor} has no tensor cores: mixed precision saves "
                            "memory but its native kernels are not faster")
    elif dtype != torch.float16:
        fp16 = slow_native_message(device, torch.float16)
        if fp16:
            cautions.append(f"float16 (only to study its numerics): {fp16}")
    if batch_size is not None and batch_size < 16:
        cautions.append(f"batch size {batch_size} is small: per-op casts may outweigh the faster matmuls")
    opt_level = "O2" if dtype == torch.bfloat16 else "O1"
    reasons.append(
        "O2 (16-bit model, float32 master weights) skips per-op casts" if opt_level == "O2"
        else "O1 (autocast) keeps float32 weights, the safest start with float16"
    )
    fastest = f"{'bf16' if dtype == torch.bfloat16 else 'fp16'} native" if native else "float32"
    fp8_native = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    reasons.append("FP8: native matmuls (compute capability >= 8.9), ampkit.convert_to_fp8 uses F.scaled_mm"
                   if fp8_native else "FP8: no FP8 matmuls here; ampkit.convert_to_fp8 emulates them (FP8's "
                   "numerics at float32 GEMM speed plus the casts, to try a recipe, not to train faster)")
    # Block-scaled tensor cores (MXFP8, MXFP4, NVFP4) arrive with compute capability 10.0 (Blackwell). ampkit
    # has no such device to test a native kernel on, so it claims none: the recipes emulate everywhere.
    reasons.append("MXFP8 / MXFP4 / NVFP4: native block-scaled GEMMs need compute capability 10.0 (Blackwell); "
                   "ampkit.convert_to_block_scaled emulates them here and everywhere (no native kernel is tested; "
                   "BlockScaledRecipe(gemm=...) plugs one in)")
    return Recommendation(device.type, dtype, opt_level, dtype == torch.float16, "native" if native else "float32",
                          fastest, speedups, reasons, cautions, fp8_native)


def machine_summary(device: torch.device | str = "cpu") -> dict[str, object]:
    """Plain facts about this machine for result files: versions, device, 16-bit support,
    and the measured speed of native 16-bit kernels against float32."""
    device = torch.device(device)
    hw = report(measured=False)
    measured = throughput.measure(device)
    summary: dict[str, object] = {
        "torch": hw.torch_version,
        "cpu": hw.cpu,
        "cpu_cores": hw.cpu_cores,
        "cpu_native_bf16": hw.cpu_native_bf16,
        "cpu_native_fp16": hw.cpu_native_fp16,
        "device": device.type,
        "device_name": hw.cpu,
        "threads": torch.get_num_threads(),
        "measured_speedup": {
            op: {d: round(measured.speedup(op, d), 4) for d in ("bfloat16", "float16")} for op in OP_CLASSES
        },
    }
    if device.type == "cuda":
        gpu = hw.gpus[device.index or 0]
        summary.update(device_name=gpu.name, cuda=hw.cuda_version, compute_capability=gpu.compute_capability)
    return summary
