"""How FP8 casts each linear's tensors: for ``inspect_numerics(..., fp8=recipe)``.

Per linear: its input and weight (E4M3) and its output gradient (the recipe's gradient format), cast with
an ``Fp8Linear``'s delayed scales as they stand or with current scaling's; a linear that FP8 clamps or
flushes more than ``FP8_TROUBLE`` of is named, with the way out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ampkit.formats.fp8 import GRAD, INPUT, WEIGHT, CastNumerics, Fp8Linear, Fp8Recipe, cast_numerics

FP8_TROUBLE = 0.01  # a linear whose inputs, weight or output gradient FP8 clamps or flushes more of than this


@dataclasses.dataclass(frozen=True)
class Fp8LayerNumerics:
    """How FP8 casts one linear's tensors (``fp8.cast_numerics`` of each)."""

    delayed: bool  # an ampkit Fp8Linear: cast with its delayed scales; else with current scaling
    input: CastNumerics
    weight: CastNumerics
    gradient: CastNumerics | None  # of the linear's output


def measure_fp8_linear(module: nn.Linear, x: torch.Tensor, output: torch.Tensor, recipe: Fp8Recipe,
                        saved: dict[Fp8Linear, tuple[torch.Tensor, torch.Tensor]], found: dict[str, Any]) -> None:
    """How FP8 casts ``module``'s input and weight now, and its output gradient when backward reaches it."""
    # An Fp8Linear casts with its own recipe and the scales it had before this pass (its forward has
    # updated them since); any other linear as current scaling would (scale None: from the tensor).
    delayed = isinstance(module, Fp8Linear)
    scales, used = (saved[module][1], module.recipe) if isinstance(module, Fp8Linear) else (None, recipe)
    formats = {role: used.dtype(role) for role in (INPUT, WEIGHT, GRAD)}

    def scale(role: int) -> torch.Tensor | None:
        return scales[role] if scales is not None else None

    found.update(delayed=delayed, input=cast_numerics(x, scale(INPUT), formats[INPUT]),
                 weight=cast_numerics(module.weight, scale(WEIGHT), formats[WEIGHT]), gradient=None)
    if output.requires_grad:
        def grad_hook(grad: torch.Tensor) -> None:
            found["gradient"] = cast_numerics(grad, scale(GRAD), formats[GRAD])
        output.register_hook(grad_hook)


def fp8_trouble(layers: dict[str, Fp8LayerNumerics]) -> tuple[list[str], list[str]]:
    """The linears FP8 loses values of (more than FP8_TROUBLE clamped or flushed), with a reason each."""
    keep, reasons = [], []
    for name, layer in layers.items():
        casts = {"inputs": layer.input, "weight": layer.weight, "output gradients": layer.gradient}
        losses = {what: c for what, c in casts.items() if c is not None and c.overflow + c.underflow > FP8_TROUBLE}
        if not losses:
            continue
        keep.append(name)
        what, cast = max(losses.items(), key=lambda item: item[1].overflow + item[1].underflow)
        how = (f"{100 * cast.underflow:.1f}% of its {what} flush to zero" if cast.underflow >= cast.overflow
               else f"{100 * cast.overflow:.1f}% of its {what} are clamped at the largest value")
        why = ("the scale lags a growing amax: raise margin" if cast.overflow > cast.underflow
               else "their range is wider than one per-tensor scale holds")
        reasons.append(f"{name}: {how} in {cast.format} (amax {cast.amax:.3g}, scale {cast.scale:.3g}; {why}); "
                       f"keep it out of FP8: convert_to_fp8(model, keep=[{name!r}])")
    return keep, reasons
