"""estimate(): how long a comparison will take, from float32 steps timed here.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from ampkit.experiment import data as data_mod
from ampkit.experiment.config import (
    CONTEXT,
    PRECISE_BN_BATCHES,
    RunConfig,
    RunResult,
    low_dtype,
)
from ampkit.experiment.models import ModelMistake, build, check_output
from ampkit.experiment.sizing import model_kwargs
from ampkit.experiment.timing import synchronizer, timed_step
from ampkit.hardware import throughput
from ampkit.precision.decide import GEMM_OPS

# Steps the plan times (after a warm-up step) of the float32 model and of each mixed setting's own: the median of
# five, as the runs report medians; a busy moment of the machine that hits one of them does not move it.
ESTIMATE_STEPS = 5
# Steps of a reduce-overhead compile that are not yet CUDA graph replays: its first (the compile, a warm-up run),
# then the recording (torch's cudagraph trees record a graph on a function's second and later warm calls)
CUDA_GRAPH_STEPS = 3
# A mixed setting's warm-up step slower than this is followed by a second: if that is as slow, it is the setting's
# step (native 16-bit kernels emulated in software); if not, the first compiled something (torchao's low-bit
# optimizers do), an extra each of the setting's runs pays once.
SLOW_SETTING_S = 5.0


@dataclasses.dataclass(frozen=True)
class Estimate:
    """How long a comparison will take, from float32 steps measured here.

    Attributes:
        float32_step_s: a float32 training step of the model with the runs' optimizer,
            timed here (the median of ``ESTIMATE_STEPS``: a busy moment of the machine that hit one of them
            does not decide the plan).
        float32_forward_s: the forward of those steps (median): what evaluation costs per batch.
        startup_s: starting the runs: each does what this process did before its first float32
            step (imports, the data, the model and its optimizer), all at once on the CPU's cores.
        run_s: per configuration, in plan order: its training steps and evaluation.
        native_speedup: per mixed precision, float32's time over native 16-bit's for
            this model's GEMMs (measured kernel speeds weighted by the model's FLOPs).
        compile_s: where runs are compiled, the float32 model's first compiled step here, less a step:
            what each compiled run is estimated to spend compiling (0 without compiled runs).
        setting_step_s: per mixed setting (precision, opt level, compute, update, gradient accumulation), a
            training step of its own model timed here (the median of ``ESTIMATE_STEPS``, taken in turn with the
            float32 model's, after a warm-up step); its runs are costed at it.
        first_step_s: the float32 warm-up step here; each run's first step is as much slower than the
            others (at its setting's ratio to float32).
        evaluation_s: the part of ``run_s`` that is evaluation, all runs together.
        report_s: writing the comparison's files.
        first_extra_s: per mixed setting, what each of its runs' first step costs beyond float32's first step at
            the setting's ratio (a compile: the block-scaled formats' casts), from its warm-up step here.
    """

    float32_step_s: float
    float32_forward_s: float
    startup_s: float
    run_s: list[float]
    native_speedup: dict[str, float]
    compile_s: float = 0.0
    setting_step_s: dict[str, float] = dataclasses.field(default_factory=dict)
    first_step_s: float = 0.0
    evaluation_s: float = 0.0  # the runs' evaluations, in ``run_s`` (``compare`` revises the rest from the runs)
    report_s: float = 0.0  # writing results.json and the pictures, timed on stand-ins of the runs' shape
    first_extra_s: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.startup_s + sum(self.run_s) + self.report_s

    def seeds_s(self, configs: Sequence[RunConfig], seeds: int) -> float:
        """The wall time of ``compare(configs, seeds=seeds)``: each seed starts its runs and trains them again, a
        probe once."""
        again = sum(s for s, config in zip(self.run_s, configs) if not config.probe)  # the report: once
        return self.total_s + (seeds - 1) * (self.startup_s + again)


def estimate(configs: list[RunConfig], progress: Callable[[str], None] | None = None) -> Estimate:
    """Estimate the wall time of ``compare(configs)``: time training steps of the float32 model and of each
    mixed setting's own model in this process, in turn as the runs take them (after a warm-up step each), then
    scale by steps, evaluation (at the same ratio to float32) and start-up.
    ``progress`` is called with a line before each timing after the first step (seconds each on a
    busy machine; a bad model or data fails before the first line).
    """
    say = progress or (lambda line: None)
    first = configs[0]
    device = torch.device(first.device)
    dataset = data_mod.load(first.data)
    torch.manual_seed(first.seed)
    model = build(first.model, **dataset.model_kwargs(CONTEXT), **model_kwargs(first.model, first.size)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the runs' optimizer; lr 0: this model is not trained
    # What each run repeats before its first step: starting Python, importing torch and ampkit (and torch's compiler,
    # which torch's optimizers import when built), loading the data, building the model and its optimizer. This
    # process has just done the same: its CPU time so far, at most its age (a long-lived notebook has spent its age on
    # other things).
    setup_s = min(_process_age_s(), time.process_time())
    x, y = (t.to(device) for t in data_mod.first_batch(dataset, first.batch_size, CONTEXT))
    sync = synchronizer(device)

    micro_shape = (len(y) // first.micro_batches,) + tuple(y.shape[1:])  # a micro-batch's targets (equal parts)

    def step(forward: Callable[[torch.Tensor], torch.Tensor] = model) -> tuple[float, float]:
        """One float32 training step, its output checked; returns its time and its forward's."""
        return timed_step(forward, optimizer, x, y, sync, first.micro_batches,
                           lambda out: check_output(first.model, out, dataset.num_classes, micro_shape))

    distinct: dict[str, RunConfig] = {}  # the first run of each mixed setting
    for config in configs:
        if config.precision != "fp32":
            distinct.setdefault(_setting(config), config)
    try:
        with FlopCounterMode(display=False) as flops:
            first_s = step()[0]  # also the warm-up: a run's first step is as slow (it also counts what it saves)
        setting_s, timed, first_extra_s, warm_ups = _time_in_turn(step, distinct, dataset, device, x, y, sync, say)
    except ModelMistake:
        raise
    except Exception as error:  # the user's model on this data (torch's own ValueErrors too): one line
        hint = ""
        if "Expected more than 1 value per channel" in str(error):
            hint = (f" (batch_size={first.batch_size}: batch norm needs at least 2 samples per channel in "
                    "training; use batch_size=2 or more)")
        raise ValueError(f"The model from {first.model!r} failed on a batch of {first.data} (inputs "
                         f"{tuple(x.shape)}, {x.dtype}): {type(error).__name__}: {error}{hint}") from error
    step_s, forward_s = (statistics.median(times) for times in zip(*timed))
    # Each setting's warm-up step beyond float32's first step at the setting's ratio: the block-scaled formats'
    # compile of their casts (uncounted, compare's bf16 / MXFP8 / NVFP4 comparison took well over its estimate).
    for key, warm_up_s in warm_ups.items():
        first_extra_s[key] = max(warm_up_s - first_s * setting_s[key] / step_s, 0.0)
    compile_s = 0.0
    compiled = [c for c in configs if c.compiled]
    if compiled:  # one compile of the float32 model, as the compiled runs will do theirs
        mode = compiled[0].compile_mode
        try:
            named = f", mode={mode!r}" if mode != "default" else ""
            say(f"planning: compiling the float32 model once (torch.compile{named})")
            forward = torch.compile(model, mode=mode)
            # reduce-overhead records its CUDA graphs in the steps after the first: those too are the compile's
            warm = CUDA_GRAPH_STEPS if mode == "reduce-overhead" else 1
            compile_s = max(sum(step(forward)[0] for _ in range(warm)) - warm * step_s, 0.0)
        except Exception as error:  # dynamo's and inductor's errors: one line, before any run starts
            raise ValueError(f"torch.compile failed on the model from {first.model!r}: {type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''}; run without --compile, or "
                             "make the model compile (dynamo's explain lists what breaks its graph).") from error
    share: dict[str, float] = {}  # op class -> its part of the step's GEMM arithmetic
    for op, count in flops.get_flop_counts().get("Global", {}).items():  # none: a model without GEMMs
        name = "conv" if "convolution" in str(op) else "matmul"
        share[name] = share.get(name, 0) + count
    total = sum(share.values()) or 1
    share = {c: n / total for c, n in share.items()}
    measured = throughput.measure(device)

    def time_factor(precision: str, native: Sequence[str]) -> float:
        """A step's time over float32's: native classes at their measured speed, the rest at float32's.
        A rough model: all of a step's time is taken as GEMM time."""
        dtype = low_dtype(precision, device)
        return sum(f / measured.speedup(c, dtype) if c in native else f for c, f in share.items()) or 1.0

    precisions = sorted({c.precision for c in configs if c.precision != "fp32"})
    speedups = {p: 1 / time_factor(p, list(GEMM_OPS)) for p in precisions}
    startup = setup_s * max(1.0, len(configs) / (os.cpu_count() or 1))  # the runs start at once, on every core
    n_eval = len(dataset.test_y) if dataset.kind == "image" else 64
    runs, evaluations = [], []
    for config in configs:
        factor = 1.0 if config.precision == "fp32" else setting_s[_setting(config)] / step_s
        train = (config.steps * step_s + max(first_s - step_s, 0.0)) * factor + (compile_s if config.compiled else 0.0)
        train += first_extra_s.get(_setting(config), 0.0)
        evaluation = 0.0 if config.probe else (n_eval / config.batch_size + PRECISE_BN_BATCHES) * forward_s * factor
        runs.append(train + evaluation)
        evaluations.append(evaluation)
    return Estimate(step_s, forward_s, startup, runs, speedups, compile_s, setting_s, first_s, sum(evaluations),
                    _report_s(configs), first_extra_s)


def _report_s(configs: list[RunConfig]) -> float:
    """Seconds to write a comparison's files (results.json, the curves, the summary), timed on stand-ins of
    ``configs``' runs and steps in a temporary folder: the second of two writes (the first pays matplotlib's imports
    and font cache, which the comparison's own write finds paid)."""
    from ampkit.experiment import report  # its figures import matplotlib: only here
    from ampkit.experiment.comparison import Comparison

    runs = [RunResult(c.label, c.precision, c.opt_level, [], c.probe, 1.0, 1.0, 2**20, 2**19, 1.0, 0.5, 0, None,
                      c.steps, [1.0 / (1 + step) for step in range(c.steps)], 1.0) for c in configs]
    stand_in = Comparison(runs, dataclasses.asdict(configs[0]), {"device_name": "-"}, "-")
    taken = []
    try:
        for _ in range(2):
            start = time.perf_counter()
            with tempfile.TemporaryDirectory() as folder:
                report.write_all(stand_in, Path(folder))
            taken.append(time.perf_counter() - start)
    except OSError:  # a full temporary disk: no figure for this part (the comparison's own write says what fails)
        return 0.0
    return taken[-1]


def _setting(config: RunConfig) -> str:
    """What sets a run's step time apart: its precision, opt level, compute mode, O3 update, gradient
    accumulation and optimizer states."""
    return f"{config.precision} {config.opt_level} {config.compute} {config.update}" + (
        f" {config.grad_accum}-grads" if config.grad_accum else "") + (
        f" {config.states}-states" if config.states else "")


def _time_in_turn(step: Callable[[], tuple[float, float]], distinct: dict[str, RunConfig], dataset: data_mod.Dataset,
                  device: torch.device, x: torch.Tensor, y: torch.Tensor, sync: Callable[[], None],
                  say: Callable[[str], None]) -> tuple[dict[str, float], list[tuple[float, float]], dict[str, float],
                                                     dict[str, float]]:
    """Each mixed setting's step time (after a warm-up step of its own model), float32's timed steps (time,
    forward), per setting whose first step was slow and its second not, the first step's extra time (a compile),
    and per other setting its warm-up step's time: ``ESTIMATE_STEPS`` rounds of a step each, in turn as the runs
    take their steps (each run's step follows the others', whose tensors then fill the caches), the order reversed
    every other round."""
    steppers: dict[str, Callable[[], tuple[float, float]]] = {"fp32": step}
    setting_s, first_extra_s, warm_ups = {}, {}, {}
    for key, config in distinct.items():
        say(f"planning: a first step of {config.label}")
        stepper = _setting_stepper(config, dataset, device, x, y, sync)
        warm_up_s = stepper()[0]
        if warm_up_s > SLOW_SETTING_S:  # a first step that compiles (torchao's low-bit optimizers), or slow steps
            second_s = stepper()[0]
            if second_s > SLOW_SETTING_S:  # native 16-bit kernels emulated in software: this is the step
                setting_s[key] = second_s
                continue
            first_extra_s[key] = warm_up_s - second_s  # each of the setting's runs pays it once
        else:
            warm_ups[key] = warm_up_s
        steppers[key] = stepper
    names = ["fp32", *(distinct[key].label for key in steppers if key != "fp32")]
    say(f"planning: timing {ESTIMATE_STEPS} steps of {', '.join(names)}, in turn")
    timed: dict[str, list[tuple[float, float]]] = {key: [] for key in steppers}
    for round_ in range(ESTIMATE_STEPS):
        for key in (list(steppers) if round_ % 2 == 0 else list(steppers)[::-1]):
            timed[key].append(steppers[key]())
    float32 = timed.pop("fp32")
    setting_s |= {key: statistics.median(t for t, _ in times) for key, times in timed.items()}
    return setting_s, float32, first_extra_s, warm_ups


def _setting_stepper(config: RunConfig, dataset: data_mod.Dataset, device: torch.device, x: torch.Tensor,
                     y: torch.Tensor, sync: Callable[[], None]) -> Callable[[], tuple[float, float]]:
    """A timed training step of ``config``'s own model (lr 0): each call takes one, returning its time and its
    forwards'."""
    from ampkit.experiment.training import prepare  # training imports the models and formats: only here

    model, optimizer = prepare(config, dataset, device, lr=0.0)
    return lambda: timed_step(model, optimizer, x, y, sync, config.micro_batches)


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
