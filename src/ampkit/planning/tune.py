"""``ampkit.tune``: each linear's format chosen from its measured sensitivity and cost.

Which layers may train in FP8 or a block-scaled format is chosen by hand elsewhere (Transformer Engine's
per-layer YAML, the NVFP4 report's kept layers) or by shape alone (torchao's float8 filter, from H100 speed
data, blind to accuracy). The failure it misses is LLM.int8()'s: one input channel hundreds of times larger
than the rest sets a per-tensor scale that flushes everything else to zero. tune measures instead:

1. The reference: the model in the base 16-bit format (an ampkit region) on the tuning batches: losses,
   gradients, saved-for-backward bytes, step time; and each candidate linear's input, for its cast figures
   (saturation and underflow in each format, and the channel that sets the scale).
2. Each candidate linear alone lowered to each format (swapped in on its own Parameters, a warm-up pass,
   then the measured pass): the loss's relative change, the gradients' relative L2 change, and what it saves,
   both measured (so an emulated format costs what emulation costs here): milliseconds per step (the
   layer's own forward and backward, against the 16-bit layer's) and saved-for-backward bytes; the
   objective (``"time"`` or ``"memory"``) says which one the choice maximises.
3. Layers lowered in order of saving per unit of loss change while the summed loss changes stay within
   ``tolerance``; then the combined plan checked once on held-out batches, and the last layers backed off
   while its loss change exceeds the tolerance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampkit.diagnostics.memory import saved_bytes_of_step
from ampkit.formats.block_scaled import fake_quantize
from ampkit.formats.fp8 import E4M3, cast_numerics, native_fp8
from ampkit.formats.recipes import BlockScaledRecipe, features, linear_layers, refuse_converted, unconverted_linears
from ampkit.planning.measure import untouched
from ampkit.planning.precision_plan import (BASES, LOWER, LayerChoice, PrecisionPlan, block_of, fingerprint,
                                           lower_linear)
from ampkit.modes import resolve_dtype
from ampkit.precision.policy import Policy
from ampkit.precision.regions import autocast

OBJECTIVES = ("time", "memory")
UNITS = {"time": "ms", "memory": "bytes"}  # what each objective's saving counts
OUTLIER_RATIO = 100.0  # a channel this many times the median channel's largest magnitude sets the scale


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


@dataclasses.dataclass
class _Run:
    losses: list[float]
    gradients: list[torch.Tensor]  # per batch, every parameter's gradient flattened into one vector
    saved_bytes: int  # saved-for-backward of the first batch


def _check(model: nn.Module, batches: Sequence[Any], formats: Sequence[str], tolerance: float, objective: str,
           gradient_tolerance: float) -> tuple[list[str], str]:
    """The lowered formats and the base; ValueError naming the value and the fix for anything else."""
    listed = isinstance(formats, (str, Iterable))
    shown = formats  # None, a number: named as given
    formats = list(formats) if listed and not isinstance(formats, str) else [formats]  # type: ignore[list-item]
    unknown = [f for f in formats if f not in LOWER and f not in BASES]
    if unknown or not formats:
        raise ValueError(f"formats={formats if listed else shown!r}: {unknown[0] if unknown else 'nothing'} is not a "
                         f"format; choose lowered formats from {list(LOWER)} and one 16-bit base from {list(BASES)}, "
                         "e.g. ('fp8', 'bf16').")
    bases = [f for f in formats if f in BASES]
    lows = [f for f in formats if f in LOWER]
    if len(bases) != 1 or not lows:
        raise ValueError(f"formats={formats!r} needs exactly one 16-bit base ({list(BASES)}) and at least one "
                         f"format to lower to ({list(LOWER)}), e.g. ('fp8', 'bf16').")
    for name, value, example in (("tolerance", tolerance, "0.01 for 1% of the loss"),
                                 ("gradient_tolerance", gradient_tolerance, "0.1 for 10% of the gradients")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
            raise ValueError(f"{name}={value!r} is invalid: the relative change the plan may cost, a number > 0 "
                             f"({example}).")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is invalid: choose one of {list(OBJECTIVES)}.")
    if len(batches) < 2 or not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        raise ValueError(f"batches: {len(batches)} given; tune needs at least 2 (input, target) pairs: some to "
                         "measure on and one held out to check the combined plan.")
    empty = [i for i, (x, _) in enumerate(batches) if isinstance(x, torch.Tensor) and x.numel() == 0]
    if empty:
        raise ValueError(f"batches {empty[:5]} hold no samples (an input of shape {tuple(batches[empty[0]][0].shape)}):"
                         " tune measures each layer's input on every batch; pass batches of at least one sample.")
    refuse_converted(model, "tune")  # its converted linears were left out of the plan, silently
    if not linear_layers(model):
        raise ValueError(f"{type(model).__name__} has no nn.Linear or Conv1D layer: tune chooses formats for "
                         "linears.")
    return lows, bases[0]


def _candidates(model: nn.Module, lows: list[str], include: Sequence[str]) -> tuple[dict[str, list[str]],
                                                                                     dict[str, str]]:
    """The candidate linears and the formats each fits; the reasons the others are not candidates."""
    linears = linear_layers(model)
    unknown = [p for p in include if p not in dict(linears)]
    if unknown:
        raise ValueError(f"include={list(include)!r}: {unknown[0]!r} is not a linear of the model; its linears are "
                         f"{[n for n, _ in linears][:12]}.")
    candidates, reasons = {}, {}
    for index, (name, linear) in enumerate(linears):
        in_features, out_features = features(linear)
        fits = [f for f in lows if in_features % block_of(f) == 0 and out_features % block_of(f) == 0]
        if index in (0, len(linears) - 1) and name not in include:
            reasons[name] = "not a candidate: the " + ("first" if index == 0 else "last") + " linear (include= it)"
        elif not fits:
            reasons[name] = (f"not a candidate: {in_features}x{out_features} is not a multiple of "
                             f"{sorted({block_of(f) for f in lows})}")
        else:
            candidates[name] = fits
    return candidates, reasons


@contextlib.contextmanager
def _swapped(model: nn.Module, formats: dict[str, str]) -> Iterator[None]:
    """The named linears lowered (on their own Parameters) inside; the originals back after."""
    originals = {name: model.get_submodule(name) for name in formats}
    for name, format in formats.items():
        model.set_submodule(name, lower_linear(originals[name], format))  # type: ignore[arg-type]
    try:
        yield
    finally:
        for name, original in originals.items():
            model.set_submodule(name, original)


def _run(model: nn.Module, batches: Sequence[Any], loss_fn: Callable[..., torch.Tensor], policy: Policy,
         warm_up: bool) -> _Run:
    """Losses, gradients (without touching ``.grad``) and the first batch's saved bytes."""
    params = [p for p in model.parameters() if p.requires_grad]
    run = _Run([], [], 0)
    for measured in ([False] if warm_up else []) + [True]:
        for i, (x, y) in enumerate(batches):
            with autocast(policy, model=model):
                if measured and i == 0:
                    loss, run.saved_bytes = saved_bytes_of_step(model, lambda: loss_fn(model(x), y))
                else:
                    loss = loss_fn(model(x), y)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            if not measured:
                continue
            run.losses.append(loss.item())
            run.gradients.append(torch.cat([(g if g is not None else torch.zeros_like(p)).float().flatten()
                                            for g, p in zip(grads, params)]))
    return run


def _layer_ms(variants: dict[str, nn.Module], x: torch.Tensor, policy: Policy, repeats: int = 7) -> dict[str, float]:
    """Each variant of one linear: its forward and backward on ``x`` in the region (ms), the variants timed in
    alternation, medians (a whole model's step would bury one layer's difference in its noise)."""
    def step(module: nn.Module) -> float:
        inputs = x.detach().requires_grad_()
        started = time.perf_counter()
        with autocast(policy.ops_only):  # one linear: the model's module names are not its own
            out = module(inputs)
        torch.autograd.grad(out, [inputs, *module.parameters()], torch.ones_like(out), allow_unused=True)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        return (time.perf_counter() - started) * 1e3

    runs: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats + 1):
        for name in (list(variants) if repeat % 2 else list(reversed(variants))):
            runs[name].append(step(variants[name]))
    return {name: statistics.median(times[1:]) for name, times in runs.items()}  # the first warms up


def _loss_change(run: _Run, reference: _Run) -> float:
    """The mean relative change of the loss, batch by batch."""
    return statistics.fmean(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run.losses, reference.losses))


def _inputs(model: nn.Module, names: list[str], batch: Any, policy: Policy) -> dict[str, torch.Tensor]:
    """Each named linear's input on one batch, in the region's precision."""
    seen: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_pre_hook(
        lambda m, args, name=name: seen.setdefault(name, args[0].detach())) for name in names]
    try:
        with torch.no_grad(), autocast(policy, model=model):
            model(batch[0])
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _cast_figures(x: torch.Tensor, format: str) -> tuple[float | None, float]:
    """(saturation, underflow) of ``x``'s nonzero values in ``format`` (FP8: E4M3 with current scaling)."""
    recipe = LOWER[format]
    if not isinstance(recipe, BlockScaledRecipe):
        numerics = cast_numerics(x, None, E4M3)
        return numerics.overflow, numerics.underflow
    nonzero = x != 0
    values = fake_quantize(x.float(), recipe.format, scale_mode=recipe.scale_mode, four_over_six=recipe.four_over_six)
    return None, ((values == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)


def _outlier(x: torch.Tensor) -> str | None:
    """The input channel that sets a per-tensor scale, where it is OUTLIER_RATIO or more the median's."""
    channels = x.detach().abs().float().reshape(-1, x.shape[-1]).amax(0)
    median = channels.median().item()
    top = int(channels.argmax())
    ratio = channels[top].item() / median if median > 0 else math.inf
    return f"channel {top}: {ratio:.1e}x the median channel" if ratio >= OUTLIER_RATIO else None


def tune(model: nn.Module, batches: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None = None,
         formats: Sequence[str] = ("fp8", "bf16"), tolerance: float = 0.01, objective: str = "time",
         include: Sequence[str] = (), gradient_tolerance: float = 0.1,
         progress: Callable[[str], None] | None = None) -> PrecisionPlan:
    """Choose each linear's format from measured sensitivity and cost.

    Args:
        model: the model as built (float32, before ``initialize``, FP8 or block-scaled conversion).
        batches: at least 2 ``(input, target)`` pairs, a list or any iterable (read once, then kept): the last
            quarter (at least one) is held out to check the combined plan, the rest measure each layer.
        loss_fn: ``loss_fn(output, target) -> loss`` (default: cross-entropy over the last dimension).
        formats: formats to lower linears to (``"fp8"``, ``"mxfp8"``, ``"mxfp4"``, ``"mxfp4-recipe"``, ``"nvfp4"``,
            ``"nvfp4-4over6"``)
            and the 16-bit base the rest trains in (``"bf16"`` or ``"fp16"``).
        tolerance: the relative loss change the plan may cost (0.01: 1%).
        objective: ``"time"`` (milliseconds per step saved) or ``"memory"`` (saved-for-backward bytes).
        include: linears that are candidates although first or last.
        gradient_tolerance: the relative L2 change of the model's gradients one layer lowered alone may
            cause (default 0.1). At initialisation every layer's effect on the loss is small (a block's
            output is small against the residual stream) while its effect on the gradients is not: FP8
            changes them by a percent or two for an ordinary layer of the GPT, by more than half for one whose
            input a 10^6x channel flushes (BENCHMARKS.md, the tune table). A layer over it is kept whatever its
            loss change.
        progress: called with a line for each layer and format as it is measured (default None).

    Returns:
        A ``PrecisionPlan``: ``plan.apply(model)`` converts the chosen linears; ``plan.save(path)``.

    Raises:
        ValueError: an unknown format, no base or no lowered format, tolerance <= 0, an unknown objective,
            fewer than 2 batches, a model without linears or with converted ones (FP8, block-scaled), an
            ``include`` that names no linear.
    """
    started = time.perf_counter()
    if not isinstance(batches, Sequence):  # a generator or a DataLoader: read once (the layers re-use each batch)
        try:
            batches = list(batches)
        except TypeError:
            raise ValueError(f"batches={type(batches).__name__} is not a sequence of (input, target) pairs: pass a "
                             "list of them, e.g. [next(iter(loader)) for _ in range(8)].") from None
    lows, base = _check(model, batches, formats, tolerance, objective, gradient_tolerance)
    loss_fn = loss_fn or _cross_entropy
    device = next(model.parameters()).device
    policy = Policy.default(device.type, resolve_dtype(base))
    held = max(1, len(batches) // 4)
    tuning, held_out = list(batches[:-held]), list(batches[-held:])
    candidates, reasons = _candidates(model, lows, include)
    if skipped := unconverted_linears(model):
        warnings.warn(f"tune chooses formats for nn.Linear and Conv1D layers only and leaves {len(skipped)} other linear-like "
                      f"layer(s) as they are: {next(iter(skipped.values())).removeprefix('kept: ')}; "
                      f"{list(skipped)[:6]}{' ...' if len(skipped) > 6 else ''}.", stacklevel=2)
    evidence: dict[tuple[str, str], dict[str, Any]] = {}
    with untouched(model):
        reference = _run(model, tuning, loss_fn, policy, warm_up=False)  # 16 bits: nothing to warm up
        inputs = _inputs(model, list(candidates), tuning[0], policy)
        for name, fits in candidates.items():
            linear = model.get_submodule(name)
            ms = _layer_ms({base: linear, **{f: lower_linear(linear, f) for f in fits}}, inputs[name], policy)
            for format in fits:
                with _swapped(model, {name: format}):
                    run = _run(model, tuning, loss_fn, policy, warm_up=True)
                saturation, underflow = _cast_figures(inputs[name], format)
                evidence[name, format] = {
                    "loss_change": _loss_change(run, reference),
                    "gradient_change": statistics.fmean(((g - r).norm() / r.norm().clamp(min=1e-30)).item()
                                                        for g, r in zip(run.gradients, reference.gradients)),
                    "saturation": saturation, "underflow": underflow,
                    "saving_ms": ms[base] - ms[format], "saving_bytes": reference.saved_bytes - run.saved_bytes}
                evidence[name, format]["saving"] = evidence[name, format][f"saving_{UNITS[objective]}"]
                if progress is not None:
                    found = evidence[name, format]
                    progress(f"{name} in {format}: loss {found['loss_change']:+.3%}, saves "
                             f"{found['saving_ms']:.3g} ms and {found['saving_bytes']:,} bytes "
                             f"({time.perf_counter() - started:.0f} s)")
        chosen, order, why = _choose(evidence, tolerance, gradient_tolerance)
        held_reference = _run(model, held_out, loss_fn, policy, warm_up=False)

        def held_out_change(names: list[str]) -> float:
            with _swapped(model, {name: chosen[name] for name in names}):
                return _loss_change(_run(model, held_out, loss_fn, policy, warm_up=True), held_reference)

        measured, backed_off = _back_off(order, held_out_change, tolerance)
        for name, change in backed_off:
            why[name] = (f"kept: backed off, the combined plan changed the held-out loss {change:.2%} (tolerance "
                         f"{tolerance:.2%})")
            del chosen[name]
        order = order[:len(order) - len(backed_off)]
    layers = []
    for name, m in linear_layers(model):
        tried = {f: e for (n, f), e in evidence.items() if n == name}
        outlier = _outlier(inputs[name]) if name in inputs else None
        reason = reasons.get(name) or why[name]
        if outlier and name not in chosen:  # the evidence, in the words of the failure
            reason += f"; {outlier} sets the per-tensor scale: " + ", ".join(
                f"{e['underflow']:.1%} of the input flushes to zero in {f}" for f, e in tried.items())
        figures = {key: {f: e[key] for f, e in tried.items()} for key in (
            "loss_change", "gradient_change", "saturation", "underflow", "saving", "saving_ms", "saving_bytes")}
        layers.append(LayerChoice(name, features(m), chosen.get(name, base), reason,
                                  outlier=outlier, **figures))

    def total(key: str) -> float:  # over the chosen layers
        return sum(evidence[n, chosen[n]][key] for n in order)

    emulated = any(isinstance(LOWER[f], BlockScaledRecipe) or not native_fp8(device) for f in lows)
    return PrecisionPlan(type(model).__name__, fingerprint(model), base, objective, float(tolerance), tuple(layers),
                         total("loss_change"), measured, tuple(name for name, _ in backed_off), total("saving"),
                         emulated, time.perf_counter() - started, total("saving_ms"), total("saving_bytes"))


def _back_off(order: list[str], change: Callable[[list[str]], float],
              tolerance: float) -> tuple[float, list[tuple[str, float]]]:
    """The combined plan's measured loss change, with the last-chosen layers put back while it exceeds
    ``tolerance``: (the change of what remains, 0 for nothing; the layers backed off, each with the change
    that backed it off)."""
    kept = list(order)
    backed: list[tuple[str, float]] = []
    while kept:
        measured = change(kept)
        if measured <= tolerance:
            return measured, backed
        backed.append((kept.pop(), measured))
    return 0.0, backed


def _choose(evidence: dict[tuple[str, str], dict[str, Any]], tolerance: float,
            gradient_tolerance: float) -> tuple[dict[str, str], list[str], dict[str, str]]:
    """Lower layers by saving per unit of sensitivity (the larger of the loss change and the gradient change,
    each over its tolerance) while the summed loss changes stay within ``tolerance``; a layer whose gradient
    change exceeds ``gradient_tolerance`` is not lowered. Returns the chosen formats, the order they were
    chosen in, and every layer's why."""
    def sensitivity(e: dict[str, Any]) -> float:
        return max(e["loss_change"] / tolerance, e["gradient_change"] / gradient_tolerance, 1e-9)

    ranked = sorted(((e["saving"] / sensitivity(e), n, f) for (n, f), e in evidence.items()
                     if e["saving"] > 0 and e["gradient_change"] <= gradient_tolerance), reverse=True)
    chosen: dict[str, str] = {}
    order: list[str] = []
    spent = 0.0
    for _, name, format in ranked:
        change = evidence[name, format]["loss_change"]
        if name not in chosen and spent + change <= tolerance:
            chosen[name], spent = format, spent + change
            order.append(name)
    why = {}
    for name in {n for n, _ in evidence}:
        if name in chosen:
            e = evidence[name, chosen[name]]
            why[name] = f"lowered: loss {e['loss_change']:+.3%} alone, saves {e['saving']:.3g}"
            continue
        tried = {f: e for (n, f), e in evidence.items() if n == name}
        if all(e["saving"] <= 0 for e in tried.values()):
            why[name] = "kept: lowering saves nothing here (" + ", ".join(
                f"{f} {e['saving']:+.3g}" for f, e in tried.items()) + ")"
        elif all(e["loss_change"] > tolerance or e["gradient_change"] > gradient_tolerance for e in tried.values()):
            why[name] = "kept: too sensitive (" + ", ".join(
                f"{f} alone changes the loss {e['loss_change']:.2%}, the gradients {e['gradient_change']:.1%}"
                for f, e in tried.items()) + f"; tolerances {tolerance:.2%}, {gradient_tolerance:.0%})"
        else:
            why[name] = "kept: the tolerance went to layers that save more per unit of loss change"
    return chosen, order, why
