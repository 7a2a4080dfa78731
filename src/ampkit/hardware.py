"""What this CPU / GPU supports for mixed precision: measured, cached, explained by flags.

Whether 16-bit arithmetic pays is a property of the machine, not of the dtype:
on a CPU with AVX-512 BF16 a bfloat16 matmul runs faster than float32, on an
AVX2-only CPU tens of times slower (BENCHMARKS.md has both machines' records,
generated). CPU flags and compute capabilities explain
such figures but do not predict them (torch's kernels, oneDNN's dispatch and the
thread count matter too), so ``measure()`` times the op classes that decide a
mixed precision step:

- ``matmul``: a square GEMM; ``conv``: a 3x3 convolution (the allow list's work);
- ``elementwise``: an add (memory-bound: what 16-bit storage speeds up);
- ``cast``: float32 to the 16-bit dtype, against a float32 copy (the price of
  computing GEMMs in float32 on 16-bit values).

Each class runs in every dtype in alternation and keeps its best time (other
processes only ever add time), within about a second on the first call. The
result is cached in ``files.cache_dir()`` under a key of device name, torch
version and thread count, so later processes read it instead. ``recommend()``
and the ``auto`` compute mode decide from these figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ampkit import files


class SlowPrecisionWarning(UserWarning):
    """Native 16-bit kernels were chosen where this hardware runs them slower than float32."""


# ---------------------------------------------------------------------------
# Flags: what the hardware says it supports (the explanation of a measurement)

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
        found = sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())
        if found or _arm_has("bf16"):
            return f"native ({', '.join(found) or 'Arm bf16'})"
        return "software-emulated (no avx512_bf16 / amx_bf16)"
    found = sorted({"avx512_fp16", "amx_fp16"} & cpu_flags())
    if found or _arm_has("fphp"):
        return f"native ({', '.join(found) or 'Arm fphp'})"
    return "software-emulated (no avx512_fp16 / amx_fp16)"


# ---------------------------------------------------------------------------
# Measured throughput

CACHE_VERSION = 1
OP_CLASSES = ("matmul", "conv", "elementwise", "cast")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Shapes per device type: big enough to measure the arithmetic rather than the call
# overhead, small enough that a 16-bit kernel emulated in software still takes only tens
# of milliseconds.
SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    "cpu": {"matmul": (256,), "conv": (4, 64, 16, 16), "elementwise": (1 << 21,), "cast": (1 << 21,)},
    "cuda": {"matmul": (4096,), "conv": (32, 256, 32, 32), "elementwise": (1 << 26,), "cast": (1 << 26,)},
}
_BUDGET_S = 0.12  # per op class and dtype, after the warm-up call
_MAX_REPEATS = 7

_memo: dict[str, Throughput] = {}


@dataclasses.dataclass(frozen=True)
class Throughput:
    """How fast 16-bit kernels run against float32 on one device, as measured.

    Attributes:
        key: the cache key: device name, torch version, thread count.
        device: ``"cpu"`` or ``"cuda:N"``.
        device_name: the CPU model or GPU name.
        time_us: op class -> dtype name -> best time per call in microseconds.
        shapes: op class -> the shape timed.
        measured_at: when (ISO 8601, local time).
        seconds: how long the measurement took.
    """

    key: str
    device: str
    device_name: str
    time_us: dict[str, dict[str, float]]
    shapes: dict[str, list[int]]
    measured_at: str
    seconds: float

    def speedup(self, op_class: str, dtype: torch.dtype | str) -> float:
        """float32's time over ``dtype``'s for ``op_class``: above 1 the 16-bit kernel is faster."""
        name = _dtype_name(dtype)
        times = self.time_us[op_class]
        return times["float32"] / times[name]

    def native_is_faster(self, op_class: str, dtype: torch.dtype | str) -> bool:
        """Whether ``dtype``'s own kernels beat float32 for ``op_class`` here."""
        return self.speedup(op_class, dtype) >= 1.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Throughput:
        """Rebuild from ``to_dict()``; raises KeyError / TypeError / ValueError on a malformed dict."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(data) != fields:
            raise KeyError(f"fields {sorted(data)} are not {sorted(fields)}")
        measured = cls(**data)
        for op in OP_CLASSES:
            for dtype in DTYPES:
                if not measured.time_us[op][dtype] > 0:
                    raise ValueError(f"time of {op} {dtype} is {measured.time_us[op][dtype]}")
        return measured


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"No measurement for dtype {dtype!r}: measured are {list(DTYPES)}.")
    return name


def device_key(device: torch.device | str) -> tuple[torch.device, str, str]:
    """(device, its name, the cache key) for ``device``; CUDA without an index means the current GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        name = torch.cuda.get_device_name(device)
        key = f"{name} | torch {torch.__version__} | CUDA {torch.version.cuda}"
        return device, name, key
    if device.type != "cpu":
        raise ValueError(f"Cannot measure device {str(device)!r}: choose 'cpu' or 'cuda'.")
    name = cpu_model_name()
    return device, name, f"{name} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def measure(device: torch.device | str = "cpu", refresh: bool = False) -> Throughput:
    """The measured 16-bit vs float32 throughput of ``device``, from the cache when it has it.

    Args:
        device: ``"cpu"`` (default) or a CUDA device.
        refresh: measure again even if the cache has this machine.

    Returns:
        Throughput; its ``key`` names what the cache entry is valid for.

    Note:
        The first call on a machine runs 16-bit kernels for about a second (on a
        CUDA device it synchronizes). A cache the user cannot write is warned about
        once; the figures then last for this process only.
    """
    device, name, key = device_key(device)
    if not refresh:
        if key in _memo:
            return _memo[key]
        cached = _read_cache().get(key)
        if cached is not None:
            _memo[key] = cached
            return cached
    measured = _measure(device, name, key)
    _memo[key] = measured
    _write_cache(measured)
    return measured


def cache_path() -> Path:
    return files.cache_dir() / f"throughput-v{CACHE_VERSION}.json"


def _read_cache() -> dict[str, Throughput]:
    try:
        raw = json.loads(cache_path().read_text())
        entries = raw["entries"] if raw.get("version") == CACHE_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # missing or unreadable: measure again
    found = {}
    for key, entry in entries.items():
        try:
            found[key] = Throughput.from_dict(entry)
        except (KeyError, TypeError, ValueError):
            continue
    return found


def _write_cache(measured: Throughput) -> None:
    entries = {key: value.to_dict() for key, value in _read_cache().items()}
    entries[measured.key] = measured.to_dict()
    text = json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=2)
    try:
        files.atomic_write(cache_path(), lambda tmp: tmp.write_text(text + "\n"))
    except OSError as error:
        warnings.warn(
            f"Cannot write ampkit's hardware cache {cache_path()}: {error}. The measurement is kept for this "
            "process only; set AMPKIT_CACHE_DIR to a writable directory.",
            RuntimeWarning,
            stacklevel=3,
        )


def _workloads(device: torch.device) -> dict[str, dict[str, Callable[[], object]]]:
    """op class -> dtype name -> a call to time."""
    shapes = SHAPES[device.type]
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    n = shapes["matmul"][0]
    a, b = randn(n, n), randn(n, n)
    x = randn(*shapes["conv"])
    w = randn(x.shape[1], x.shape[1], 3, 3)
    u, v = randn(*shapes["elementwise"]), randn(*shapes["elementwise"])
    c = randn(*shapes["cast"])
    calls: dict[str, dict[str, Callable[[], object]]] = {op: {} for op in OP_CLASSES}
    for name, dtype in DTYPES.items():
        a16, b16, x16, w16, u16, v16 = (t.to(dtype) for t in (a, b, x, w, u, v))
        calls["matmul"][name] = functools.partial(torch.mm, a16, b16)
        calls["conv"][name] = functools.partial(F.conv2d, x16, w16, padding=1)
        calls["elementwise"][name] = functools.partial(torch.add, u16, v16)
        # float32 "cast" is a copy: the ratio is what rounding costs over moving the bytes.
        calls["cast"][name] = c.clone if dtype == torch.float32 else functools.partial(c.to, dtype)
    return calls


def _measure(device: torch.device, name: str, key: str) -> Throughput:
    start = time.perf_counter()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def once(fn: Callable[[], object]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    best: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for op, calls in _workloads(device).items():
            for fn in calls.values():
                once(fn)  # warm-up: primitive creation, caches
            best[op] = {dtype: float("inf") for dtype in calls}
            spent = dict.fromkeys(calls, 0.0)
            for _ in range(_MAX_REPEATS):
                # In alternation, so a busy moment of the machine hits every dtype alike.
                pending = [d for d in calls if spent[d] < _BUDGET_S]
                if not pending:
                    break
                for dtype in pending:
                    seconds = once(calls[dtype])
                    spent[dtype] += seconds
                    best[op][dtype] = min(best[op][dtype], seconds)
    return Throughput(
        key=key,
        device=str(device),
        device_name=name,
        time_us={op: {d: s * 1e6 for d, s in times.items()} for op, times in best.items()},
        shapes={op: list(shape) for op, shape in SHAPES[device.type].items()},
        measured_at=datetime.datetime.now().isoformat(timespec="seconds"),
        seconds=time.perf_counter() - start,
    )


def slow_native_message(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """What to tell someone who runs native ``dtype`` kernels where they are measured slower
    than float32 (None where they are not)."""
    measured = measure(device)
    slow = [c for c in ("matmul", "conv") if not measured.native_is_faster(c, dtype)]
    if not slow:
        return None
    name = str(dtype).removeprefix("torch.")
    speeds = ", ".join(f"{c} at {measured.speedup(c, dtype):.3g}x" for c in slow)
    return (
        f"native {name} kernels run {speeds} float32's speed on {measured.device_name} (measured; "
        f"{native_support(device, dtype)}). compute='auto' or 'float32' keeps {name} tensors and computes "
        "GEMMs and convolutions in float32 on them, at about float32's speed."
    )


# ---------------------------------------------------------------------------
# The report and the recommendation

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
    flags = cpu_flags()
    devices = ["cpu"] + (["cuda"] if gpus else [])
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
        measured=[measure(d) for d in devices] if measured else [],
    )


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
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = recommend_dtype(device)
    name = str(dtype).removeprefix("torch.")
    measured = measure(device)
    speedups = {c: measured.speedup(c, dtype) for c in OP_CLASSES}
    gemms = ("matmul", "conv")
    native = all(measured.native_is_faster(c, dtype) for c in gemms)
    figures = f"matmul {speedups['matmul']:.3g}x, conv {speedups['conv']:.3g}x"
    reasons, cautions = [], []
    if native:
        reasons.append(f"native {name} kernels run at {figures} float32's speed here (measured on "
                       f"{measured.device_name}; {native_support(device, dtype)})")
    else:
        reasons.append(f"for speed alone, float32: native {name} kernels run at only {figures} float32's speed "
                       f"here (measured on {measured.device_name}; {native_support(device, dtype)})")
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
    reasons.append("FP8: native matmuls (compute capability >= 8.9), ampkit.convert_to_fp8 uses torch._scaled_mm"
                   if fp8_native else "FP8: no FP8 matmuls here; ampkit.convert_to_fp8 emulates them (FP8's "
                   "numerics at float32 GEMM speed plus the casts, to try a recipe, not to train faster)")
    return Recommendation(device.type, dtype, opt_level, dtype == torch.float16, "native" if native else "float32",
                          fastest, speedups, reasons, cautions, fp8_native)


def machine_summary(device: torch.device | str = "cpu") -> dict[str, object]:
    """Plain facts about this machine for result files: versions, device, 16-bit support,
    and the measured speed of native 16-bit kernels against float32."""
    device = torch.device(device)
    hw = report(measured=False)
    measured = measure(device)
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
