"""How fast this CPU / GPU runs 16-bit kernels against float32: measured, cached per machine.

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
processes only ever add time), within about a second on the first call; the
spread of its repeats (the median's excess over the best) is its noise. The
result is cached in ``files.cache_dir()`` under a key of device name, the CPU's
16-bit flags, the kernels torch and oneDNN are allowed (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``: bf16 GEMMs capped below AVX-512 BF16 ran 3x slower than
float32 on a CPU where they otherwise ran 4x faster), torch version and thread
count, so later processes read it instead.
``recommend()`` and the ``auto`` compute mode decide from these figures, and
never on a difference inside the noise: there the device's flags decide (a CPU
whose flags say native bf16 keeps native bf16 unless float32 is faster beyond
the noise). A measurement whose repeats disagree beyond ``BUSY_NOISE`` (the
machine was busy) is taken again, twice at most; still busy, it serves this
process and is not cached, with a warning, so one busy moment does not decide
for every later run. ``ampkit env`` shows the figures, their age and noise;
``ampkit env --remeasure`` measures again.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ampkit import files
from ampkit.hardware.flags import SIXTEEN_BIT_FLAGS, cpu_flags, cpu_model_name, native_support

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
BUSY_NOISE = 1.0  # a median twice the best time: other processes took the machine during the measurement
_ATTEMPTS = 2

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
        noise: op class -> the spread of its repeats: the median's excess over the best time, the largest over
            the dtypes (0.05: 5%).
        native_flags: dtype name -> whether the device's flags say its arithmetic is native (``flags``).
    """

    key: str
    device: str
    device_name: str
    time_us: dict[str, dict[str, float]]
    shapes: dict[str, list[int]]
    measured_at: str
    seconds: float
    noise: dict[str, float] = dataclasses.field(default_factory=dict)
    native_flags: dict[str, bool] = dataclasses.field(default_factory=dict)

    def speedup(self, op_class: str, dtype: torch.dtype | str) -> float:
        """float32's time over ``dtype``'s for ``op_class``: above 1 the 16-bit kernel is faster."""
        name = _dtype_name(dtype)
        times = self.time_us[op_class]
        return times["float32"] / times[name]

    def native_is_faster(self, op_class: str, dtype: torch.dtype | str) -> bool:
        """Whether ``dtype``'s own kernels beat float32 for ``op_class`` here; where the two differ by less than
        the measurement's noise, what the device's flags say (native or emulated)."""
        speedup, margin = self.speedup(op_class, dtype), self.noise.get(op_class, 0.0)
        if 1 / (1 + margin) <= speedup <= 1 + margin:
            return self.native_flags.get(_dtype_name(dtype), speedup >= 1.0)
        return speedup >= 1.0

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
    found = sorted(SIXTEEN_BIT_FLAGS & cpu_flags()) or ["no 16-bit flags"]
    kernels = f"{torch.backends.cpu.get_cpu_capability()} kernels"
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if onednn_cap:
        kernels += f", oneDNN up to {onednn_cap}"
    return device, name, (f"{name} | {' '.join(found)} | {kernels} | torch {torch.__version__} | "
                          f"{torch.get_num_threads()} threads")


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
    for _ in range(_ATTEMPTS):
        measured = _measure(device, name, key)
        if max(measured.noise.values(), default=0.0) <= BUSY_NOISE:
            break
    _memo[key] = measured
    if max(measured.noise.values(), default=0.0) > BUSY_NOISE:
        warnings.warn(f"ampkit timed this machine's 16-bit kernels while it was busy ({_attempts_text(measured)}): "
                      "the figures serve this process only and are not cached; a quieter moment will record "
                      "them (or run `ampkit env --remeasure`).", RuntimeWarning, stacklevel=2)
    else:
        _write_cache(measured)
    return measured


def _attempts_text(measured: Throughput) -> str:
    worst = max(measured.noise, key=measured.noise.__getitem__)
    return f"{_ATTEMPTS} tries; {worst}'s repeats spread {measured.noise[worst]:.0%}, over {BUSY_NOISE:.0%}"


def cache_path() -> Path:
    return files.cache_dir() / f"throughput-v{CACHE_VERSION}.json"


def _read_cache() -> dict[str, Throughput]:
    try:
        raw = json.loads(cache_path().read_text())
        entries = raw["entries"] if raw.get("version") == CACHE_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # missing or unreadable: measure again
    if not isinstance(entries, dict):
        return {}  # a damaged file (entries a list, say): measure again, and the next write replaces it
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
    noise: dict[str, float] = {}
    with torch.no_grad():
        for op, calls in _workloads(device).items():
            for fn in calls.values():
                once(fn)  # warm-up: primitive creation, caches
            best[op] = {dtype: float("inf") for dtype in calls}
            repeats: dict[str, list[float]] = {dtype: [] for dtype in calls}
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
                    repeats[dtype].append(seconds)
            noise[op] = max(statistics.median(times) / min(times) - 1 for times in repeats.values())
    return Throughput(
        key=key,
        device=str(device),
        device_name=name,
        time_us={op: {d: s * 1e6 for d, s in times.items()} for op, times in best.items()},
        shapes={op: list(shape) for op, shape in SHAPES[device.type].items()},
        measured_at=datetime.datetime.now().isoformat(timespec="seconds"),
        seconds=time.perf_counter() - start,
        noise=noise,
        native_flags={name: native_support(device, dtype).startswith(("native", "bfloat16 tensor", "float16 tensor"))
                      for name, dtype in DTYPES.items() if dtype != torch.float32},
    )
