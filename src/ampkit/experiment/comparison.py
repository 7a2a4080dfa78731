"""The float32-vs-mixed-precision comparison behind `ampkit compare`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ampkit import compute as compute_mod
from ampkit import fp8 as fp8_mod
from ampkit import hardware
from ampkit.experiment import data as data_mod
from ampkit.experiment.models import build, check_output, load_factory
from ampkit.experiment.run import (
    CONTEXT, FP8_RECIPES, LOSS_SCALES, PRECISE_BN_BATCHES, PRECISIONS, RunConfig, RunProcess, RunResult, low_dtype,
)
from ampkit.pure16 import UPDATES
from ampkit.master import OPT_LEVELS

RESULT_FILES = ("results.json", "curves.png", "summary.png")
# Figures compared against float32, and whether lower is better.
RATIO_FIELDS = {
    "ms_per_step": True,
    "samples_per_s": False,
    "peak_memory_bytes": True,
    "saved_for_backward_bytes": True,
    "final_train_loss": True,
    "test_accuracy": False,
}
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt": {"data": "text", "batch_size": 32, "steps": 400, "lr": 6e-3},
}
IMAGE_DEFAULTS = {"data": "digits", "batch_size": 64, "epochs": 2, "lr": 2e-3}
ESTIMATE_STEPS = 3  # float32 steps the plan times (after a warm-up step): a median, as the runs report
PROBE_STEPS = 2  # one warm-up step, then one timed: native 16-bit steps can take tens of seconds

Progress = Callable[[str, int, int, float], None]


@dataclasses.dataclass
class Comparison:
    """Results of one comparison: float32 first, then each mixed setting."""

    runs: list[RunResult]
    config: dict[str, Any]
    machine: dict[str, Any]
    created: str
    estimated_s: float | None = None  # the plan's estimate of the total wall time
    wall_s: float | None = None  # the total wall time, measured

    @property
    def baseline(self) -> RunResult:
        return self.runs[0]

    def ratio(self, run: RunResult, field: str) -> float | None:
        """``run``'s figure divided by float32's (None where either is missing or float32's is 0)."""
        value, base = getattr(run, field), getattr(self.baseline, field)
        if value is None or not base or base is None:
            return None
        return value / base

    def to_dict(self) -> dict[str, Any]:
        runs = []
        for run in self.runs:
            entry = dataclasses.asdict(run)
            entry["ratio_to_fp32"] = {field: self.ratio(run, field) for field in RATIO_FIELDS}
            runs.append(entry)
        record = {
            "version": 2, "created": self.created, "machine": self.machine, "config": self.config,
            "estimated_s": self.estimated_s, "wall_s": self.wall_s, "runs": runs,
        }
        non_finite: list[str] = []
        record = _strict(record, "", non_finite)
        record["non_finite"] = non_finite
        return record


def _strict(value: Any, path: str, found: list[str]) -> Any:
    """``value`` with every inf/NaN float replaced by None, its path added to ``found``:
    strict JSON (JavaScript's JSON.parse and others reject bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        found.append(f"{path}: {value}")
        return None
    if isinstance(value, dict):
        return {k: _strict(v, f"{path}.{k}" if path else k, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value


def _check_choice(value: str, choices: Sequence[str], what: str) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {what} {value!r}. Choose from {list(choices)}.")


def default_settings(device: torch.device) -> list[tuple[str, str]]:
    """The mixed settings the hardware supports: (precision, opt level) pairs."""
    if device.type == "cuda":
        settings = [("fp16", "O1"), ("fp16", "O2")]
        if hardware.recommend_dtype(device) == torch.bfloat16:  # bf16 tensor cores: compute capability >= 8.0
            settings += [("bf16", "O1"), ("bf16", "O2")]
        return settings
    return [("bf16", "O1"), ("bf16", "O2")]


def check_device(device: str) -> torch.device:
    """Parse ``--device``. Raises ValueError for unknown devices and CUDA without CUDA."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"Unknown device {device!r}: choose 'cpu' or 'cuda' (or 'cuda:N').") from error
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"Unknown device {device!r}: choose 'cpu' or 'cuda' (or 'cuda:N').")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'no'}). Use --device cpu."
        )
    return parsed


def plan(
    model: str = "resnet18",
    data: str | None = None,
    precisions: Sequence[str] | None = None,
    opt_levels: Sequence[str] | None = None,
    batch_size: int | None = None,
    epochs: int | None = None,
    steps: int | None = None,
    lr: float | None = None,
    device: str = "cpu",
    seed: int = 0,
    computes: Sequence[str] | None = None,
    probe: bool | None = None,
    loss_scales: Sequence[str] | None = None,
    updates: Sequence[str] | None = None,
    loss_divisor: float = 1.0,
) -> list[RunConfig]:
    """The runs of a comparison: float32 first, then the mixed settings, then a probe.

    Unset options take the model's defaults (ResNet-18 and MLP: digits, batch 64,
    2 epochs, lr 2e-3; GPT: text, batch 32, 400 steps, lr 6e-3). ``precisions`` and
    ``opt_levels`` default to what the hardware supports (on a CPU: bf16 with O1
    and O2; on CUDA: fp16 with O1 and O2, and bf16 too from compute capability 8.0).
    ``computes`` (default ``["auto"]``: native where the measured 16-bit kernels
    beat float32, else float32 GEMMs on 16-bit values) multiplies the settings.

    ``loss_scales`` (default ``["auto"]``: dynamic for fp16, none for the others; or
    ``none``, ``static``, ``dynamic``, ``adaptive``) multiply the fp16 settings; bf16 and
    fp8 settings, whose 16-bit parts have float32's exponent range, run once without
    scaling. For O3 settings, ``updates`` (``plain``, ``kahan``, ``stochastic``; default
    ``["plain"]``) multiply the settings too.

    ``loss_divisor`` (default 1) divides every run's training loss, float32's too, and
    AdamW's eps with it, so float32 trains as without it. Each gradient value then sits
    where a ``loss_divisor``-times larger batch's mean puts it, as gradient accumulation
    over that many micro-batches divides each one's loss: the regime of large-batch
    training (GPT-2's ~2**19 tokens a step against the GPT workload's 2**11), where float16
    without loss scaling flushes gradients to zero. Reported losses are undivided.

    ``probe`` (default: where an ``auto`` setting computes in float32) adds a short
    run of the first mixed precision at O1 with native 16-bit kernels,
    ``PROBE_STEPS`` steps with no evaluation, so the table also says how fast
    native 16-bit compute is here.

    Raises:
        ValueError: unknown choices (listed in the message), or CUDA without CUDA.
    """
    parsed_device = check_device(device)
    load_factory(model)  # fail fast on an unknown model
    defaults = MODEL_DEFAULTS.get(model, IMAGE_DEFAULTS)
    data = data or defaults["data"]
    data_mod.check_spec(data)
    if model in MODEL_DEFAULTS and data != "text" or model in ("resnet18", "mlp") and data == "text":
        raise ValueError(f"--model {model} and --data {data} do not fit: text goes with gpt (or your own text "
                         "model), images with resnet18, mlp or your own image model.")
    for precision in precisions or ():
        _check_choice(precision, PRECISIONS, "precision")
    for level in opt_levels or ():
        _check_choice(level, OPT_LEVELS[1:], "opt level for a mixed run:")
    for compute in computes or ():
        _check_choice(compute, compute_mod.COMPUTE_MODES, "compute mode")
    for scaling in loss_scales or ():
        _check_choice(scaling, LOSS_SCALES, "loss scaling")
    for update in updates or ():
        _check_choice(update, UPDATES, "update")
    if updates and "O3" not in (opt_levels or ()):
        raise ValueError(f"--update {' '.join(updates)} applies to O3 runs only: add --opt-level O3 (pure 16-bit "
                         "weights; O1 and O2 keep float32 weights or masters, which take small updates as they are).")
    for name, values in (("--precision", precisions), ("--opt-level", opt_levels), ("--compute", computes),
                         ("--loss-scale", loss_scales), ("--update", updates)):
        repeated = sorted({v for v in values or () if list(values or ()).count(v) > 1})
        if repeated:
            raise ValueError(f"{name} names {', '.join(repeated)} more than once; name each setting once.")
    _check_positive_int(batch_size, "--batch-size")
    _check_positive_int(epochs, "--epochs")
    _check_positive_int(steps, "--steps")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr {lr} is invalid: use a finite learning rate > 0, e.g. --lr 0.002.")
    if not (isinstance(loss_divisor, (int, float)) and math.isfinite(loss_divisor) and loss_divisor > 0):
        raise ValueError(f"--loss-divisor {loss_divisor} is invalid: use a finite number > 0, e.g. --loss-divisor 16 "
                         "(gradients as a 16-times larger batch's), or 1 to train on the loss as it is.")
    if not 0 <= seed < 2**63:
        raise ValueError(f"--seed {seed} is out of range: use an integer in [0, 2**63).")
    if any(p in FP8_RECIPES for p in precisions or ()):
        _check_fp8(model, data, [p for p in precisions or () if p in FP8_RECIPES])
    if precisions is None and opt_levels is None:
        settings = default_settings(parsed_device)
    else:
        mixed = [p for p in (precisions or ("bf16" if parsed_device.type == "cpu" else "fp16",)) if p != "fp32"]
        settings = [(p, level) for p in mixed for level in (opt_levels or ("O1", "O2"))]
    if loss_scales and not any(p == "fp16" for p, _ in settings):
        raise ValueError(f"--loss-scale {' '.join(loss_scales)} applies to fp16 runs only: add --precision fp16 "
                         "(bf16 and fp8 keep float32's exponent range, so their runs take no loss scaling).")
    batch_size = defaults["batch_size"] if batch_size is None else batch_size
    if data != "text":
        train_size = _train_size(data)
        if batch_size > train_size:
            raise ValueError(
                f"--batch-size {batch_size} is larger than the {data} training set ({train_size} samples): "
                f"use at most {train_size}."
            )
    if steps is None:
        if data == "text":
            steps = defaults.get("steps", 30)
        else:
            steps = train_size // batch_size * (defaults.get("epochs", 2) if epochs is None else epochs)
    common: dict[str, Any] = dict(
        model=model,
        data=data,
        batch_size=batch_size,
        steps=steps,
        lr=defaults["lr"] if lr is None else lr,
        device=device,
        seed=seed,
        loss_divisor=float(loss_divisor),
    )
    configs = [RunConfig(precision="fp32", opt_level="O0", **common)]
    configs += [
        RunConfig(precision=p, opt_level=level, compute=c, loss_scale=scaling, update=update, **common)
        for p, level in settings
        for c in (computes or ("auto",))
        for scaling in ((loss_scales or ("auto",)) if p == "fp16" else ("auto",))
        for update in ((updates or ("plain",)) if level == "O3" else ("plain",))
    ]
    for precision in sorted({c.precision for c in configs if c.compute == "native"}):
        slow = hardware.slow_native_message(parsed_device, low_dtype(precision, parsed_device))
        if slow:
            warnings.warn(slow, hardware.SlowPrecisionWarning, stacklevel=2)
    auto_in_float32 = [c for c in configs[1:] if c.compute == "auto" and c.float32_compute]
    if probe or (probe is None and auto_in_float32):
        first = (auto_in_float32 or configs[1:])[0] if len(configs) > 1 else None
        if first is not None:
            configs.append(dataclasses.replace(first, opt_level="O1", compute="native", steps=PROBE_STEPS, probe=True))
    return configs


def _check_fp8(model: str, data: str, precisions: list[str]) -> None:
    """Refuse an fp8 setting before training when the model has no linear FP8 can take, or torchao is missing."""
    if "fp8-current" in precisions:
        try:
            import torchao.float8  # noqa: F401
        except ImportError as error:
            raise ValueError("--precision fp8-current runs on torchao's float8 training, which is not installed: "
                             "pip install 'ampkit[fp8]', or use --precision fp8 (delayed scaling, ampkit's own).") \
                from error
    dataset = data_mod.load(data)
    decisions = fp8_mod.eligible(build(model, **dataset.model_kwargs(CONTEXT)))
    if "fp8" not in decisions.values():
        found = "; ".join(f"{name}: {why}" for name, why in decisions.items()) or "it has no nn.Linear"
        raise ValueError(f"--precision {precisions[0]}: {model} has no linear FP8 can take ({found}). FP8 keeps the "
                         "first and last linears and those whose dimensions are not multiples of 16 in 16 bits; "
                         "try --model gpt or mlp.")


def _check_positive_int(value: int | None, name: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} {value} is invalid: use an integer >= 1 (or leave it out for the default).")


def _train_size(data: str) -> int:
    return len(data_mod.load(data).train_y)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """How long a comparison will take, from float32 steps measured here.

    Attributes:
        float32_step_s: a float32 training step of the model with the runs' optimizer,
            timed here (median of ``ESTIMATE_STEPS``).
        float32_forward_s: the forward of those steps (median): what evaluation costs per batch.
        startup_s: starting the runs: each imports what this process imported before
            the estimate (Python, torch, ampkit, the data), all at once on the CPU's cores.
        run_s: per configuration, in plan order: its training steps and evaluation.
        native_speedup: per mixed precision, float32's time over native 16-bit's for
            this model's GEMMs (measured kernel speeds weighted by the model's FLOPs).
    """

    float32_step_s: float
    float32_forward_s: float
    startup_s: float
    run_s: list[float]
    native_speedup: dict[str, float]

    @property
    def total_s(self) -> float:
        return self.startup_s + sum(self.run_s)


def estimate(configs: list[RunConfig]) -> Estimate:
    """Estimate the wall time of ``compare(configs)``: time float32 training steps of
    the model in this process (after one warm-up step), then scale by steps, evaluation,
    start-up and the measured speed of native 16-bit kernels where a run uses them.

    Runs that compute GEMMs in float32 are estimated at float32's step time.
    """
    # What each run repeats before its set-up: starting Python, importing torch and ampkit. This process's
    # CPU time so far, at most its age (a long-lived notebook has spent its age on other things).
    import_s = min(_process_age_s(), time.process_time())
    first = configs[0]
    device = torch.device(first.device)
    dataset = data_mod.load(first.data)
    torch.manual_seed(first.seed)
    model = build(first.model, **dataset.model_kwargs(CONTEXT)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the runs' optimizer; lr 0: this model is not trained
    index = torch.arange(first.batch_size) % len(dataset.train_x if dataset.kind == "text" else dataset.train_y)
    if dataset.kind == "text":
        x, y = data_mod.windows(dataset.train_x, index % (len(dataset.train_x) - CONTEXT - 1), CONTEXT)
    else:
        x, y = dataset.train_x[index], dataset.train_y[index]
    x, y = x.to(device), y.to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> tuple[float, float]:
        """One training step; returns its time and its forward's."""
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = check_output(first.model, model(x), dataset.num_classes)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        sync()
        forward_s = time.perf_counter() - t0
        loss.backward()
        optimizer.step()
        sync()
        return time.perf_counter() - t0, forward_s

    try:
        with FlopCounterMode(display=False) as flops:
            step()  # also the warm-up
        timed = [step() for _ in range(ESTIMATE_STEPS)]
    except ValueError:
        raise
    except Exception as error:  # the user's model on this data: say so in one line
        raise ValueError(f"The model from {first.model!r} failed on a batch of {first.data} (inputs "
                         f"{tuple(x.shape)}, {x.dtype}): {type(error).__name__}: {error}") from error
    step_s, forward_s = (statistics.median(times) for times in zip(*timed))
    share: dict[str, float] = {}  # op class -> its part of the step's GEMM arithmetic
    for op, count in flops.get_flop_counts()["Global"].items():
        name = "conv" if "convolution" in str(op) else "matmul"
        share[name] = share.get(name, 0) + count
    total = sum(share.values()) or 1
    share = {c: n / total for c, n in share.items()}
    measured = hardware.measure(device)

    def time_factor(precision: str, native: Sequence[str]) -> float:
        """A step's time over float32's: native classes at their measured speed, the rest at float32's.
        A rough model: all of a step's time is taken as GEMM time."""
        dtype = low_dtype(precision, device)
        return sum(f / measured.speedup(c, dtype) if c in native else f for c, f in share.items()) or 1.0

    precisions = sorted({c.precision for c in configs if c.precision != "fp32"})
    speedups = {p: 1 / time_factor(p, list(compute_mod.GEMM_OPS)) for p in precisions}
    startup = import_s * max(1.0, len(configs) / (os.cpu_count() or 1))
    n_eval = len(dataset.test_y) if dataset.kind == "image" else 64
    runs = []
    for config in configs:
        factor = 1.0
        if config.precision != "fp32":
            factor = time_factor(config.precision, [c for c in compute_mod.GEMM_OPS if c not in config.float32_compute])
        train = config.steps * step_s * factor
        evaluation = 0.0 if config.probe else (n_eval / config.batch_size + PRECISE_BN_BATCHES) * forward_s * factor
        runs.append(train + evaluation)
    return Estimate(step_s, forward_s, startup, runs, speedups)


def _process_age_s() -> float:
    """Seconds since this process started (Linux), else 0."""
    try:
        with open("/proc/self/stat") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            up_s = float(uptime.read().split()[0])
        return max(up_s - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def compare(
    configs: list[RunConfig], progress: Progress | None = None, estimated_s: float | None = None
) -> Comparison:
    """Run every configuration in its own subprocess, steps interleaved, and collect the results.

    The processes start together (their start-up overlaps); then round by round each
    run takes one training step while the others wait, in alternating order (A B C,
    C B A, ...), so all runs are timed under the same machine conditions; then they
    evaluate, one after another.

    Args:
        configs: from ``plan()``; the first is the float32 baseline.
        progress: called as ``progress(label, step, total_steps, loss)`` after each step.
        estimated_s: the plan's estimate (``estimate(configs).total_s``), kept in the record.

    Raises:
        RuntimeError: a run failed (its error output is in the message); the others are stopped.
    """
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        hosts = [stack.enter_context(RunProcess(config)) for config in configs]
        try:
            for round_ in range(max(config.steps for config in configs)):
                for host in hosts if round_ % 2 == 0 else reversed(hosts):
                    if host.training:
                        step, loss = host.step()
                        if progress is not None:
                            progress(host.config.label, step, host.config.steps, loss)
            runs = []
            for host in hosts:  # one at a time: evaluating together oversubscribes the cores (measured slower)
                host.finish()
                runs.append(host.result())
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or a host's SIGTERM handler: keep what ran
            interrupt.partial = partial_record(configs, hosts)  # type: ignore[attr-defined]
            raise
    return Comparison(
        runs=runs,
        config=_shared_config(configs),
        machine=hardware.machine_summary(configs[0].device),
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        estimated_s=estimated_s,
        wall_s=time.perf_counter() - start,
    )


def _shared_config(configs: list[RunConfig]) -> dict[str, Any]:
    first = dataclasses.asdict(configs[0])
    shared = {k: v for k, v in first.items() if k not in ("precision", "opt_level", "compute", "probe")}
    shared["settings"] = [c.label for c in configs]
    return shared


def partial_record(configs: list[RunConfig], hosts: list[RunProcess]) -> dict[str, Any]:
    """What an interrupted comparison had done: each run's label and losses so far
    (strict JSON, marked ``incomplete``)."""
    runs = [{"label": h.config.label, "steps_done": h.steps_done, "steps": h.config.steps, "losses": h.losses}
            for h in hosts]
    record = {"version": 2, "incomplete": True, "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "config": _shared_config(configs), "runs": runs}
    non_finite: list[str] = []
    record = _strict(record, "", non_finite)
    record["non_finite"] = non_finite
    return record


def default_out_dir() -> Path:
    return Path("ampkit-runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def check_out_dir(out: Path) -> None:
    """Refuse an output directory that already holds results (never overwrite silently)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory.")
    clashes = [name for name in RESULT_FILES if (out / name).exists()]
    if clashes:
        raise ValueError(
            f"{out} already holds {', '.join(clashes)}; ampkit never overwrites results. "
            "Pass another --out, or move those files away."
        )


def reserve_out_dir(out: Path | None) -> Path:
    """Create the output directory before any training, so a bad location fails at once.

    ``None`` reserves a new ``ampkit-runs/<timestamp>`` directory, created exclusively
    (``-2``, ``-3``... when another comparison took that second's name). A given
    directory may exist if it holds no results; it must be writable.

    Raises:
        ValueError: the location is a file, holds results, or cannot be created or written.
    """
    if out is None:
        base = default_out_dir()
        for attempt in range(1, 1000):
            candidate = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
            try:
                candidate.mkdir(parents=True)
                return candidate
            except FileExistsError:
                continue
            except OSError as error:
                raise ValueError(f"Cannot create {candidate}: {error.strerror}. Pass --out DIR.") from error
        raise ValueError(f"{base}-2 to -999 exist already; pass --out DIR.")
    check_out_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ValueError(
            f"--out {out} cannot hold results: {error.strerror or error}. Pass a directory you can write to."
        ) from error
    return out
