"""One training run of a comparison: build, train, time, measure, evaluate (``execute``).
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampkit.diagnostics.memory import measured_state_parts, saved_bytes_of_step
from ampkit.experiment import data as data_mod
from ampkit.experiment.config import (
    CONTEXT,
    BLOCK_RECIPES,
    FP8_RECIPES,
    PRECISE_BN_BATCHES,
    PROBE_WARMUP_STEPS,
    STATIC_SCALE,
    WARMUP_STEPS,
    ZERO_GRAD_EVERY,
    RunConfig,
    RunResult,
    low_dtype,
)
from ampkit.experiment.models import build
from ampkit.experiment.sizing import model_kwargs
from ampkit.formats.block_linear import convert_to_block_scaled
from ampkit.planning.precision_plan import PrecisionPlan
from ampkit.planning.recompute import plan_recompute
from ampkit.formats.fp8 import convert_to_fp8
from ampkit.guard import Guard
from ampkit.modes import OPT_LEVELS
from ampkit.optim.kept import BATCH_NORMS
from ampkit.optim.levels import initialize
from ampkit.scaling.adaptive import AdaptiveLossScaler
from ampkit.scaling.scaler import DynamicLossScaler, StaticLossScaler


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
        wait: called as ``wait("step")`` before each step (a planned run's first, before its recompute
            planning) and ``wait("finish")`` before evaluating; a host that interleaves several runs blocks there.
    """
    start = time.perf_counter()
    device = torch.device(config.device)
    dataset = data_mod.load(config.data)
    baseline = memory_baseline(device)
    model, optimizer = prepare(config, dataset, device)
    scaler = make_scaler(config.scaling, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config.steps))

    def batch(index: torch.Tensor, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        x, y = data_mod.pair(dataset, index, CONTEXT, split)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = forward(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    plan = data_mod.batches(dataset, config.batch_size, config.steps, config.seed, CONTEXT)
    budget = config.activation_budget
    planned = budget is not None
    if budget is not None:  # planned on the first batch, in the run's precision
        x0, y0 = batch(plan[0])
        # Inside the host's first step of this run, while the other runs wait: planners measuring beside each other
        # oversubscribe the cores (many times slower, as evaluating together was).
        wait("step")
        plan_recompute(model, x0, budget, loss_fn=lambda logits: F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), y0.reshape(-1))).apply(model)
    forward = torch.compile(model, mode=config.compile_mode) if config.compiled else model  # after every conversion
    guard = make_guard(model, optimizer, scaler) if config.guard else None
    losses: list[float] = []
    times: list[float] = []
    saved = 0
    diverged = None
    zeros: list[float] = []
    model.train()
    for i, index in enumerate(plan):
        x, y = batch(index)
        if i or not planned:
            wait("step")
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)
        for m, (xm, ym) in enumerate(zip(x.chunk(config.micro_batches), y.chunk(config.micro_batches))):
            if i == 0 and m == 0:  # one micro-batch's activations: what a step holds at once
                part, saved = saved_bytes_of_step(model, lambda: loss_of(xm, ym))
            else:
                part = loss_of(xm, ym)
            part = part / config.micro_batches  # equal micro-batches: their mean is the batch's mean loss
            scaler.scale(part / config.loss_divisor if config.loss_divisor != 1 else part).backward()
            loss = loss + part.detach()
        counting_s = 0.0
        if i % ZERO_GRAD_EVERY == 0:  # a measurement, not training: its time is not the step's
            c0 = time.perf_counter()
            zeros.append(zero_fraction(model))
            counting_s = time.perf_counter() - c0
        if guard is not None:
            took = guard.step(loss, batch=(x, y))  # the scaler's step and update, where the step is sound
        else:
            took = scaler.step(optimizer)
            scaler.update()
        if took:
            scheduler.step()
        loss_value = loss.item()  # syncs, so the step's time is complete
        times.append(time.perf_counter() - t0 - counting_s)
        losses.append(loss_value)
        if not math.isfinite(loss_value) and not scaler.enabled and guard is None:  # a guard skips the step
            diverged = (f"the loss became {loss_value} at step {i + 1} with no loss scaling to skip the step "
                        f"(lr={config.lr:g}): lower the learning rate, or look for the overflowing layer with `ampkit inspect`")
        progress(i + 1, loss_value, diverged is not None)
        if diverged:
            break

    peak = peak_memory(device, baseline)
    wait("finish")
    accuracy = None
    if not config.probe and diverged is None:
        recalibrate_batchnorm(model, [batch(index)[0] for index in plan[-PRECISE_BN_BATCHES:]])
        accuracy = evaluate(model, dataset, batch)
        if accuracy is None:  # reported as a divergence: exit 1 and the reason, never a made-up accuracy
            skipped = scaler.stats.skipped
            diverged = "the model's outputs are inf/NaN in evaluation, so no accuracy is reported" + (
                f" (all {skipped} steps were skipped: every scaled gradient overflowed)" if skipped == len(times) else "")
    median_s = statistics.median(times[PROBE_WARMUP_STEPS if config.probe else WARMUP_STEPS :] or times)
    stats = scaler.stats
    parts = measured_state_parts(model, optimizer)
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
        state_bytes=sum(parts.values()),
        state_parts=parts,
        parameters=sum(p.numel() for p in model.parameters()),
        zero_grad_fraction=statistics.fmean(zeros) if zeros else None,
        compile_s=times[0] if config.compiled and times else None,
        guard=guard.timeline() if guard is not None else None,
    )


def make_guard(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: DynamicLossScaler) -> Guard:
    """The run's guard: it raises a failing layer's precision in a mixed run (O1 to O3, FP8 and block-scaled
    layers); a float32 run's bad steps it skips."""
    action = "raise" if OPT_LEVELS[getattr(model, "_ampkit_opt_level", "O0")].mixed else "skip"
    return Guard(model, optimizer, scaler, action=action, loss_fn=lambda logits, y: F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))


def prepare(config: RunConfig, dataset: data_mod.Dataset, device: torch.device,
            lr: float | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The run's model and optimizer, set up in its precision (seeded; FP8 or block-scaled linears, then
    ``initialize`` at its opt level); ``lr`` overrides the run's (the estimate times steps at 0)."""
    torch.manual_seed(config.seed)
    model = build(config.model, **dataset.model_kwargs(CONTEXT), **model_kwargs(config.model, config.size)).to(device)
    # AdamW's update is unchanged when its gradients and eps shrink by one factor (up to float32 rounding)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr if lr is None else lr,
                                                         eps=1e-8 / config.loss_divisor)
    if config.precision in FP8_RECIPES:
        convert_to_fp8(model, FP8_RECIPES[config.precision])  # before initialize: O2 casts the rest
    if config.precision in BLOCK_RECIPES:
        convert_to_block_scaled(model, BLOCK_RECIPES[config.precision], seed=config.seed)
    if config.precision_plan is not None:
        PrecisionPlan.load(config.precision_plan).apply(model)
    if config.precision != "fp32":
        model, optimizer = initialize(  # type: ignore[assignment]
            model, optimizer, config.opt_level, low_dtype(config.precision, device), compute=config.compute,
            update=config.update, grad_dtype=config.grad_accum, states=config.states)
    return model, optimizer


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
    norms = [m for m in model.modules() if isinstance(m, BATCH_NORMS)]
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
def evaluate(model: nn.Module, dataset: data_mod.Dataset, batch: Callable[..., Any]) -> float | None:
    """The test accuracy; None where the model's outputs are inf/NaN (an argmax of NaN is no accuracy)."""
    model.eval()
    correct = total = 0
    if dataset.kind == "text":
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, len(dataset.test_x) - CONTEXT - 1, (64,), generator=g)
        indices = list(starts.split(16))
    else:
        indices = list(torch.arange(len(dataset.test_y)).split(256))
    try:
        for index in indices:
            x, y = batch(index, "test")
            out = model(x)
            if not bool(torch.isfinite(out).all()):
                return None
            correct += int((out.argmax(-1) == y).sum())
            total += y.numel()
    finally:
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

    CUDA: resets the peak statistics; the baseline is what tensors hold already (the allocator
    counts tensors only).
    CPU: the resident memory now (torch, data and Python are already loaded), after
    resetting the kernel's peak-RSS mark where Linux allows it (``/proc/self/clear_refs``).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
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
        return max(int(torch.cuda.max_memory_allocated(device)) - baseline, 0)
    peak = _status_kib("VmHWM")
    peak_bytes = peak * 1024 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(peak_bytes - baseline, 0)
