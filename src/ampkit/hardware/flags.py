"""What the hardware says it supports: CPU flags, model names, tensor-core generations.

Flags explain a measurement (``throughput.py``) but do not predict it: torch's kernels,
oneDNN's dispatch and the thread count matter too.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch


class SlowPrecisionWarning(UserWarning):
    """Native 16-bit kernels were chosen where this hardware runs them slower than float32."""


# The CPU flags that make 16-bit arithmetic native (``native_support``): they key the throughput cache.
SIXTEEN_BIT_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"})


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


@functools.cache  # read on every region's creation (through measure's key): /proc/cpuinfo once
def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "amx_tile")




def native_support(device: torch.device | str, dtype: torch.dtype) -> str:
    """Why ``dtype`` arithmetic is native or emulated on ``device``, from flags or compute capability."""
    device = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        needed = (8, 0) if dtype == torch.bfloat16 else (7, 0)
        if (major, minor) >= needed:
            return f"{name} tensor cores (compute capability {major}.{minor})"
        return f"no {name} tensor cores (compute capability {major}.{minor} < {needed[0]}.{needed[1]})"
    if dtype == torch.bfloat16:
        found = sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())  # in SIXTEEN_BIT_FLAGS
        if found or _arm_has("bf16"):
            return f"native ({', '.join(found) or 'Arm bf16'})"
        return "software-emulated (no avx512_bf16 / amx_bf16)"
    found = sorted({"avx512_fp16", "amx_fp16"} & cpu_flags())
    if found or _arm_has("fphp"):
        return f"native ({', '.join(found) or 'Arm fphp'})"
    return "software-emulated (no avx512_fp16 / amx_fp16)"
