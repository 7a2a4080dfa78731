"""What this CPU / GPU supports for mixed precision."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# Measured with benchmarks/bench_autocast.py (512x512 matmul, median of 7) on the
# project's 2-core AVX-512 CPU with avx512_bf16 and no avx512_fp16:
# float32 1.6 ms, bfloat16 0.68 ms, float16 114 ms.
CPU_FP16_SLOWDOWN_NOTE = "about 70x slower than float32 (a 512x512 matmul: 114 ms vs 1.6 ms on a 2-core AVX-512 CPU)"


class SlowPrecisionWarning(UserWarning):
    """The chosen precision is likely slower than float32 on this hardware."""


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


def machine_summary(device: torch.device | str = "cpu") -> dict[str, object]:
    """Plain facts about this machine for result files: versions, device, 16-bit support."""
    import os

    device = torch.device(device)
    summary: dict[str, object] = {
        "torch": torch.__version__,
        "cpu": cpu_model_name(),
        "cpu_cores": os.cpu_count(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "cpu_native_fp16": cpu_has_native_fp16(),
        "device": device.type,
        "device_name": cpu_model_name(),
    }
    if device.type == "cuda":
        summary["device_name"] = torch.cuda.get_device_name(device)
        summary["cuda"] = torch.version.cuda
        summary["compute_capability"] = "%d.%d" % torch.cuda.get_device_capability(device)
    return summary
