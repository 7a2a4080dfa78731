"""One training run of a comparison, and the subprocess that hosts it.

Each run executes in its own Python process (``python -m ampkit.experiment.run``)
so its peak memory is its own; it reports progress and its result as JSON lines
on stdout. Runs start from the same seed, hence the same initial weights, and
draw the same batches in the same order.

The runs of a comparison step in lockstep: each process waits for a ``step``
line on stdin before every training step and a ``finish`` line before its
evaluation, so the parent can interleave the runs' steps (one process computes
at a time) and every run meets the machine's fast and slow moments alike, as a
benchmark that alternates its variants does. Timings of separate processes run
one after the other differed by 10-20% on a shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from ampkit import compute as compute_mod
from ampkit.adaptive_scaler import AdaptiveLossScaler
from ampkit.compute import ComputeModeWarning
from ampkit.experiment import data as data_mod
from ampkit.experiment.models import build
from ampkit import hardware
from ampkit.fp8 import Fp8Recipe, convert_to_fp8
from ampkit.hardware import SlowPrecisionWarning
from ampkit.master import initialize
from ampkit.memory import measured_state_bytes, saved_bytes_of_step
from ampkit.policy import resolve_dtype
from ampkit.scaler import DynamicLossScaler, StaticLossScaler

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8-current")
LOSS_SCALES = ("auto", "none", "static", "dynamic", "adaptive")
STATIC_SCALE = 2.0**10  # the static setting's loss scale (Micikevicius et al. used 8 to 32768 per task)
# FP8 recipes of the fp8 settings: delayed scaling (ampkit's own) and current scaling (torchao), both
# E4M3 forward and E5M2 gradients; everything else runs at the 16-bit dtype the hardware recommends.
FP8_RECIPES = {"fp8": Fp8Recipe(), "fp8-current": Fp8Recipe(scaling="current")}


def low_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """The 16-bit dtype of a mixed setting; for the fp8 settings, the one the rest of the model runs in."""
    if precision in FP8_RECIPES:
        return hardware.recommend_dtype(device)
    return resolve_dtype(precision)
CONTEXT = 64  # bytes per text window (the GPT's context)
WARMUP_STEPS = 2
PROBE_WARMUP_STEPS = 1
PRECISE_BN_BATCHES = 8
ZERO_GRAD_EVERY = 10  # steps between counts of zero gradient values


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run: a model on data in one precision setting."""

    model: str = "resnet18"
    data: str = "digits"
    precision: str = "fp32"  # one of PRECISIONS
    opt_level: str = "O0"  # O0 for fp32; O1/O2/O3 for 16-bit
    batch_size: int = 64
    steps: int = 44
    lr: float = 2e-3
    device: str = "cpu"
    seed: int = 0
    compute: str = "auto"  # how 16-bit GEMMs compute: auto, native or float32 (Policy.compute)
    probe: bool = False  # a few timed steps only: no evaluation, no accuracy
    loss_scale: str = "auto"  # one of LOSS_SCALES; auto: dynamic for float16, none otherwise
    update: str = "plain"  # O3's update rule (ampkit.pure16): plain, kahan or stochastic
    # The training loss is divided by this (and AdamW's eps with it, so float32 trains as with 1): each gradient
    # value then sits where a loss_divisor-times larger batch's mean puts it (see ``plan``).
    loss_divisor: float = 1.0

    @property
    def scaling(self) -> str:
        """The loss scaling this run uses (``auto`` resolved): none, static, dynamic or adaptive."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "dynamic" if self.precision == "fp16" else "none"

    @property
    def float32_compute(self) -> list[str]:
        """The op classes this run computes in float32 on 16-bit values (resolved here)."""
        if self.precision == "fp32":
            return []
        device_type = torch.device(self.device).type
        return sorted(compute_mod.float32_classes(device_type, low_dtype(self.precision, self.device), self.compute))

    @property
    def label(self) -> str:
        """``fp32``, ``bf16 O1``; ``bf16 O1 fp32-compute`` where GEMMs compute in float32;
        ``bf16 O1 native probe`` for a probe; the fp8 settings name their recipe
        (``fp8-delayed-hybrid O1``)."""
        if self.precision == "fp32":
            return "fp32"
        recipe = FP8_RECIPES.get(self.precision)
        name = f"fp8-{recipe.scaling}-{recipe.format}" if recipe is not None else self.precision
        label = f"{name} {self.opt_level}"
        classes = self.float32_compute
        if classes:
            label += " fp32-compute" if len(classes) == len(compute_mod.GEMM_OPS) else f" fp32-{classes[0]}"
        elif self.compute == "native" and self.probe:
            label += " native"
        if self.loss_scale != "auto":
            label += f" {self.loss_scale}-scaling" if self.loss_scale != "none" else " no-scaling"
        if self.update != "plain":
            label += f" {self.update}"
        return label + (" probe" if self.probe else "")


@dataclasses.dataclass
class RunResult:
    """What one run measured. Times in ms, memory in bytes."""

    label: str
    precision: str
    opt_level: str
    float32_compute: list[str]  # op classes computed in float32 on 16-bit values ([] = native)
    probe: bool  # a speed probe: no accuracy, loss or evaluation
    ms_per_step: float  # median over the steps after warm-up
    samples_per_s: float
    # What training added to memory. CUDA: max_memory_allocated; CPU: peak resident
    # memory during training minus the resident memory before the model was built.
    peak_memory_bytes: int
    saved_for_backward_bytes: int  # activation memory of one step, exact on any device
    final_train_loss: float | None  # mean of the last final_steps(steps) steps (None for a probe)
    test_accuracy: float | None  # images: class accuracy; text: next-byte accuracy (None for a probe)
    skipped_steps: int
    final_loss_scale: float | None  # None without loss scaling (adaptive: the global scale)
    steps: int
    losses: list[float]
    wall_s: float
    diverged: str | None = None  # why training stopped early (a non-finite loss), else None
    state_bytes: int = 0  # weights, gradients, masters and optimizer states after training (measured)
    parameters: int = 0  # the model's parameters (a tied weight once)
    zero_grad_fraction: float | None = None  # of gradient values exactly zero, mean over sampled steps


def execute(
    config: RunConfig,
    progress: Callable[[int, float, bool], None] = lambda i, loss, stop: None,
    wait: Callable[[str], None] = lambda phase: None,
) -> RunResult:
    """Train and evaluate one configuration in this process.

    A run without loss scaling whose loss becomes inf/NaN stops there (a diverged
    run: too high a learning rate, or a model that overflows even in float32), with
    its diagnosis in ``RunResult.diverged``; it is not evaluated.

    Args:
        progress: called as ``progress(step, loss, stop)`` after each step; ``stop`` says
            the run ends there.
        wait: called as ``wait("step")`` before each step and ``wait("finish")``
            before evaluating; a host that interleaves several runs blocks there.
    """
    start = time.perf_counter()
    device = torch.device(config.device)
    dataset = data_mod.load(config.data)
    baseline = memory_baseline(device)
    torch.manual_seed(config.seed)
    model = build(config.model, **dataset.model_kwargs(CONTEXT)).to(device)
    # AdamW's update is unchanged when its gradients and eps shrink by one factor (up to float32 rounding)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                                         eps=1e-8 / config.loss_divisor)
    dtype = low_dtype(config.precision, device) if config.precision != "fp32" else torch.float32
    if config.precision in FP8_RECIPES:
        convert_to_fp8(model, FP8_RECIPES[config.precision])  # before initialize: O2 casts the rest
    if config.precision != "fp32":
        model, optimizer = initialize(  # type: ignore[assignment]
            model, optimizer, config.opt_level, dtype, compute=config.compute, update=config.update
        )
    scaler = make_scaler(config.scaling, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config.steps))

    def batch(index: torch.Tensor, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        xs = dataset.train_x if split == "train" else dataset.test_x
        ys = dataset.train_y if split == "train" else dataset.test_y
        if dataset.kind == "text":
            x, y = data_mod.windows(xs, index, CONTEXT)
        else:
            x, y = xs[index], ys[index]
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    plan = data_mod.batches(dataset, config.batch_size, config.steps, config.seed, CONTEXT)
    losses: list[float] = []
    times: list[float] = []
    saved = 0
    diverged = None
    zeros: list[float] = []
    model.train()
    for i, index in enumerate(plan):
        x, y = batch(index)
        wait("step")
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            loss, saved = saved_bytes_of_step(model, lambda: loss_of(x, y))
        else:
            loss = loss_of(x, y)
        scaler.scale(loss / config.loss_divisor if config.loss_divisor != 1 else loss).backward()
        counting_s = 0.0
        if i % ZERO_GRAD_EVERY == 0:  # a measurement, not training: its time is not the step's
            c0 = time.perf_counter()
            zeros.append(zero_fraction(model))
            counting_s = time.perf_counter() - c0
        if scaler.step(optimizer):
            scheduler.step()
        scaler.update()
        loss_value = loss.item()  # syncs, so the step's time is complete
        times.append(time.perf_counter() - t0 - counting_s)
        losses.append(loss_value)
        if not math.isfinite(loss_value) and not scaler.enabled:
            diverged = (f"the loss became {loss_value} at step {i + 1} with no loss scaling to skip the step "
                        f"(lr {config.lr:g}): lower --lr, or look for the overflowing layer with `ampkit inspect`")
        progress(i + 1, loss_value, diverged is not None)
        if diverged:
            break

    peak = peak_memory(device, baseline)
    wait("finish")
    accuracy = None
    if not config.probe and diverged is None:
        recalibrate_batchnorm(model, [batch(index)[0] for index in plan[-PRECISE_BN_BATCHES:]])
        accuracy = evaluate(model, dataset, batch)
    median_s = statistics.median(times[PROBE_WARMUP_STEPS if config.probe else WARMUP_STEPS :] or times)
    stats = scaler.stats
    return RunResult(
        label=config.label,
        precision=config.precision,
        opt_level=config.opt_level,
        float32_compute=config.float32_compute,
        probe=config.probe,
        ms_per_step=median_s * 1e3,
        samples_per_s=config.batch_size / median_s,
        peak_memory_bytes=peak,
        saved_for_backward_bytes=saved,
        final_train_loss=None if config.probe or diverged else statistics.fmean(losses[-final_steps(len(losses)):]),
        test_accuracy=accuracy,
        skipped_steps=stats.skipped,
        final_loss_scale=stats.scale if scaler.enabled else None,
        steps=len(losses),
        losses=losses,
        wall_s=time.perf_counter() - start,
        diverged=diverged,
        state_bytes=measured_state_bytes(model, optimizer),
        parameters=sum(p.numel() for p in model.parameters()),
        zero_grad_fraction=statistics.fmean(zeros) if zeros else None,
    )


def lr_factor(step: int, steps: int) -> float:
    """The learning-rate schedule of every run, as a factor of ``lr``: cosine decay from 1 to 0.1
    over the run. At a constant high rate, the GPT's final loss moved by several percent from one
    seed (or one rounding) to the next, which drowned the numerics under study; a linear warm-up
    (5% of the steps) left one seed on the unigram plateau (loss 3.1) for all 400 steps."""
    progress = min(1.0, step / max(1, steps))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def final_steps(steps: int) -> int:
    """How many last steps the final train loss averages: 5, or a tenth of a longer run (one
    batch's loss is noisy; all runs see the same batches)."""
    return max(5, steps // 10)


def make_scaler(scaling: str, model: nn.Module) -> DynamicLossScaler:
    """The loss scaler of a run's scaling setting (a disabled one for ``none``)."""
    if scaling == "static":
        return StaticLossScaler(STATIC_SCALE)
    if scaling == "adaptive":
        return AdaptiveLossScaler(model)
    return DynamicLossScaler(enabled=scaling == "dynamic")


@torch.no_grad()
def zero_fraction(model: nn.Module) -> float:
    """The fraction of the model's gradient values that are exactly zero (flushed, or never reached)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = sum(g.numel() for g in grads)
    if not total:
        return 0.0
    return torch.stack([(g == 0).sum() for g in grads]).sum().item() / total  # one sync, not one per tensor


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, inputs: list[torch.Tensor]) -> None:
    """Recompute BatchNorm statistics as plain averages over ``inputs`` (precise BN).

    A few dozen steps are too few for BatchNorm's running averages (momentum 0.1)
    to catch up with weights that still move fast, and evaluation suffers; this is
    Detectron2's PreciseBN. Models without BatchNorm are left alone.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # cumulative average
    model.train()
    for x in inputs:
        model(x)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum


@torch.no_grad()
def evaluate(model: nn.Module, dataset: data_mod.Dataset, batch: Callable[..., Any]) -> float:
    model.eval()
    correct = total = 0
    if dataset.kind == "text":
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, len(dataset.test_x) - CONTEXT - 1, (64,), generator=g)
        indices = list(starts.split(16))
    else:
        indices = list(torch.arange(len(dataset.test_y)).split(256))
    for index in indices:
        x, y = batch(index, "test")
        correct += int((model(x).argmax(-1) == y).sum())
        total += y.numel()
    model.train()
    return correct / total


_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_baseline(device: torch.device) -> int:
    """Start measuring training's memory; returns the baseline to pass to ``peak_memory``.

    CUDA: resets the peak statistics (baseline 0: the allocator counts tensors only).
    CPU: the resident memory now (torch, data and Python are already loaded), after
    resetting the kernel's peak-RSS mark where Linux allows it (``/proc/self/clear_refs``).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return 0
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM, the peak RSS
    except OSError:
        pass
    rss = _status_kib("VmRSS")
    return rss * 1024 if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory(device: torch.device, baseline: int) -> int:
    """What training added at its peak, above ``memory_baseline``'s figure."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = _status_kib("VmHWM")
    peak_bytes = peak * 1024 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(peak_bytes - baseline, 0)


class RunFailed(RuntimeError):
    """A run's process failed. ``str()`` gives the run, the exit code and the last line of
    its error output; ``log`` keeps all of it."""

    def __init__(self, label: str, code: int, log: str) -> None:
        last = next((line.strip() for line in reversed(log.splitlines()) if line.strip()), "no error output")
        super().__init__(f"The {label} run failed (exit code {code}): {last}")
        self.label, self.code, self.log = label, code, log


class RunProcess:
    """One run in its own Python process, stepped by its host (see the module docstring).

    Use as a context manager: the process starts on entry and is killed on exit if it
    is still running (another run failed, or the host was interrupted).

    Raises (from ``step`` and ``result``):
        RuntimeError: the run failed; the message carries its error output.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.steps_done = 0
        self.losses: list[float] = []  # per step, as reported
        self.stopped = False  # the run ended its training early (it diverged)
        # stderr goes to a file, not a pipe: a chatty run must not block on a full pipe
        # while the host reads its stdout.
        self._errors = tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ampkit.experiment.run", json.dumps(dataclasses.asdict(config))],
            env={**os.environ, "AMPKIT_HOST_PID": str(os.getpid())},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            text=True,
        )

    def __enter__(self) -> RunProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._errors.close()

    def step(self) -> tuple[int, float]:
        """Let the run take one training step; returns (step number, loss)."""
        self._write("step")
        message = self._read("step")
        self.steps_done += 1
        self.stopped = bool(message.get("stop"))
        loss = float(message["loss"])  # "nan" / "inf" arrive as strings: strict JSON
        self.losses.append(loss)
        return message["step"], loss

    @property
    def training(self) -> bool:
        """Whether the run has steps left to take."""
        return not self.stopped and self.steps_done < self.config.steps

    def finish(self) -> None:
        """Let the run evaluate (after its last step); ``result`` collects what it found."""
        self._write("finish")

    def result(self) -> RunResult:
        """The run's result, once the process has evaluated and exited."""
        message = self._read("result")
        if self._process.wait() != 0:
            self._fail()
        self._errors.seek(0)
        warnings_text = self._errors.read()
        if warnings_text.strip():
            print(warnings_text, file=sys.stderr, end="")  # the run's warnings, shown once
        return RunResult(**message["result"])

    def _write(self, command: str) -> None:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(command + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            self._fail()

    def _read(self, expect: str) -> dict[str, Any]:
        """Read the run's stdout up to a JSON message with key ``expect``; pass other lines on."""
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:  # something the model's own code printed
                message = None
            if isinstance(message, dict) and expect in message:
                return message
            print(line, file=sys.stderr, end="")
        self._fail()

    def _fail(self) -> NoReturn:
        code = self._process.wait()
        self._errors.seek(0)
        raise RunFailed(self.config.label, code, self._errors.read())


def _die_with_the_parent() -> None:
    """Ask Linux to end this process when its parent dies (a run must not outlive its host).

    The host passes its pid in ``AMPKIT_HOST_PID``: if it died before this call (importing
    torch takes seconds), the request came too late and the run ends now.
    """
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the host closes our stdin when it goes, which ends us at the next step
    host = os.environ.get("AMPKIT_HOST_PID")
    if host is not None and os.getppid() != int(host):
        raise SystemExit("ampkit.experiment.run: the host process is gone")


def _main(argv: list[str]) -> int:
    _die_with_the_parent()
    config = RunConfig(**json.loads(argv[0]))
    # The parent states these once; each run would repeat them.
    warnings.filterwarnings("ignore", category=SlowPrecisionWarning)
    warnings.filterwarnings("ignore", category=ComputeModeWarning)

    def report(step: int, loss: float, stop: bool) -> None:
        print(json.dumps({"step": step, "loss": loss if math.isfinite(loss) else str(loss), "stop": stop}), flush=True)

    def wait(phase: str) -> None:
        command = sys.stdin.readline().strip()
        if command != phase:  # the host went away (end of input) or lost count
            raise SystemExit(f"ampkit.experiment.run: expected {phase!r} on stdin, got {command!r}")

    result = execute(config, report, wait)
    print(json.dumps({"result": dataclasses.asdict(result)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
