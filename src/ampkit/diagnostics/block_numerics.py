"""How a block-scaled recipe casts each linear's operands: for ``inspect_numerics(..., block_scaled=recipe)``.

Per linear and operand (the input and the weight along the input features, as the forward GEMM quantizes
them; the output gradient along the output features, as the input-gradient GEMM does), the fraction of
blocks with a saturated element, the fraction of nonzero elements flushed to zero, and the blocks'
dynamic range (largest over smallest nonzero magnitude), as Transformer Engine's debug tools report them.
A linear whose weight the recipe flushes more than ``BLOCK_FLUSH_TROUBLE`` of is named, with the way out:
the weight is what the format holds all run long. Inputs and gradients are reported, not judged: a 4-bit
format flushes their near-zero values by its nature (GELU's small negative outputs, sparse gradients).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ampkit.formats.block_linear import quantize_operand
from ampkit.formats.block_scaled import Quantized
from ampkit.formats.recipes import BlockScaledRecipe

# A 4-bit format flushes a few percent of a Gaussian or uniform weight (values under a 16th to a 24th of
# their block's largest); more than this is a block whose range one scale cannot hold (an outlier row in
# a 16x16 weight tile flushes the tile's 15 other rows).
BLOCK_FLUSH_TROUBLE = 0.15


@dataclasses.dataclass(frozen=True)
class BlockCastNumerics:
    """One operand's block-scaled cast.

    Attributes:
        format: the recipe's label.
        saturated_blocks: fraction of blocks with an element clamped at the element type's largest value.
        flushed: fraction of the nonzero elements that decode to zero.
        range_median: the median block's largest over smallest nonzero magnitude.
        range_max: the widest block's.
    """

    format: str
    saturated_blocks: float
    flushed: float
    range_median: float
    range_max: float


@dataclasses.dataclass(frozen=True)
class BlockLayerNumerics:
    """How a block-scaled recipe casts one linear's input, weight and output gradient."""

    input: BlockCastNumerics
    weight: BlockCastNumerics
    gradient: BlockCastNumerics | None


def block_cast_numerics(x: torch.Tensor, q: Quantized, label: str) -> BlockCastNumerics:
    """``BlockCastNumerics`` of ``x`` quantized as ``q``."""
    nonzero = int((x != 0).sum())
    ranges = q.block_range.flatten().float()
    return BlockCastNumerics(label, float(q.block_saturated.float().mean()),
                             float(q.flushed.sum()) / nonzero if nonzero else 0.0,
                             float(ranges.median()), float(ranges.max()))


def measure_block_linear(module: nn.Linear, x: torch.Tensor, output: torch.Tensor, recipe: BlockScaledRecipe,
                         found: dict[str, Any]) -> None:
    """How ``recipe`` casts ``module``'s input and weight now, and its output gradient when backward reaches it."""
    label = recipe.label
    with torch.no_grad():
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        weight = module.weight.detach().float()
        tiles = recipe.format == "nvfp4" and bool(recipe.weight_tiles)
        found.update(input=block_cast_numerics(x2, quantize_operand(x2, recipe), label),
                     weight=block_cast_numerics(weight, quantize_operand(weight, recipe, tiles=tiles), label),
                     gradient=None)
    if output.requires_grad:
        def grad_hook(grad: torch.Tensor) -> None:
            g2 = grad.detach().reshape(-1, grad.shape[-1]).float()
            found["gradient"] = block_cast_numerics(g2, quantize_operand(g2, recipe), label)
        output.register_hook(grad_hook)


def block_trouble(layers: dict[str, BlockLayerNumerics]) -> tuple[list[str], list[str]]:
    """The linears whose weight the recipe flushes more than BLOCK_FLUSH_TROUBLE of, with a reason each."""
    keep, reasons = [], []
    for name, layer in layers.items():
        cast = layer.weight
        if cast.flushed <= BLOCK_FLUSH_TROUBLE:
            continue
        keep.append(name)
        reasons.append(f"{name}: {100 * cast.flushed:.1f}% of its weight flush to zero in {cast.format} "
                       f"({100 * cast.saturated_blocks:.1f}% of its blocks saturate an element; block range median "
                       f"{cast.range_median:.3g}, widest {cast.range_max:.3g}: a few values far larger than the rest "
                       f"share their blocks' scale); keep it in 16 bits: BlockScaledRecipe(keep=({name!r},))")
    return keep, reasons
