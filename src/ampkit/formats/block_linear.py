"""Block-scaled training: linears whose every GEMM computes on block-quantized operands (emulated).

``BlockScaledLinear`` quantizes, per GEMM, both operands along that GEMM's reduction dimension, as
block-scaled tensor cores require:

- output ``y = x W^T``: x and W in blocks along the input features;
- input gradient ``dx = g W``: g and W^T in blocks along the output features (NVFP4 with weight tiles:
  the 16x16-tiled weight, the same in both GEMMs);
- weight gradient ``dW = g^T x``: g^T and x^T in blocks along the tokens (NVFP4: after a random
  Hadamard transform of both along the tokens, which leaves ``g^T x`` unchanged in exact arithmetic and
  spreads outliers over 16 values; NVFP4's gradients round stochastically).

MXFP4's recipe (Tseng et al., arXiv 2502.20586) transforms both backward GEMMs' operands (64x64, along each
GEMM's reduction dimension) and rounds all four stochastically, blocks at 3/4 of their scale; with
``quantize_forward=False`` the forward is the model's own 16-bit linear.

Each GEMM runs in float32 on the decoded values (``recipe.gemm`` plugs in a native kernel instead), so the
numerics are the format's on any machine, at emulation's cost. Bias, activations and everything outside
the linears stay in the dtype the rest of the model runs in.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit import _torch
from ampkit.formats.block_scaled import MX_ELEMENTS, Draws, Quantized, counter_draws, quantize_mx, quantize_nvfp4
from ampkit.formats.recipes import (
    BlockScaledRecipe,
    check_recipe,
    features,
    is_conv1d,
    linear_layers,
    refuse_converted,
    unconverted_linears,
)
from ampkit.modes import without_autocast


def random_hadamard(seed: int, size: int = 16) -> torch.Tensor:
    """A ``size`` x ``size`` (a power of two; 16 by default) orthogonal random Hadamard transform: Sylvester's
    Hadamard matrix / sqrt(size), columns signed at random (fixed by ``seed``)."""
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return h * signs / size**0.5


def _hadamard_rows(t: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """``transform`` applied to each block of its size's rows of 2-D ``t`` (zero rows pad the last block)."""
    n = transform.shape[0]
    padded = torch.nn.functional.pad(t, (0, 0, 0, (-t.shape[0]) % n))
    blocks = padded.reshape(-1, n, t.shape[1])
    return torch.matmul(transform.to(t.device), blocks).reshape(-1, t.shape[1])


def _hadamard_columns(t: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """``transform`` applied to each block of its size's columns of 2-D ``t`` (zero columns pad the last block:
    two operands transformed alike keep their product, ``(a H^T)(b H^T)^T = a b^T``)."""
    n = transform.shape[0]
    padded = torch.nn.functional.pad(t, (0, (-t.shape[1]) % n))
    return (padded.reshape(t.shape[0], -1, n) @ transform.to(t.device).T).reshape(t.shape[0], -1)


def quantize_operand(t: torch.Tensor, recipe: BlockScaledRecipe, generator: torch.Generator | Draws | None = None,
                     stochastic: bool = False, tiles: bool = False) -> Quantized:
    """A GEMM operand in ``recipe``'s format, in blocks along its last axis (16x16 tiles with ``tiles``)."""
    if recipe.format == "nvfp4":
        return quantize_nvfp4(t, -1, 16 if tiles else None, generator, stochastic, recipe.four_over_six)
    element = recipe.element if recipe.format == "mxfp8" else MX_ELEMENTS[recipe.format]
    return quantize_mx(t, element, -1, recipe.block, recipe.scale_mode, generator, stochastic)


def _operand_values(t: torch.Tensor, format: str, element: str, block: int, mode: str, tiles: bool,
                    stochastic: bool, draws: torch.Tensor | None, four_over_six: bool,
                    transposed: bool = False) -> torch.Tensor:
    """``quantize_operand``'s decoded values of ``t`` in float32 (of ``t.T`` with ``transposed``), all an emulated
    GEMM reads: what ``torch.compile`` fuses, the conversion and the transposition's copy with the cast. ``draws``:
    stochastic rounding's draws for the operand's blocks (``_draw_values``), flat."""
    t = t.float().T if transposed else t.float()
    generator = (lambda shape: draws.reshape(shape)) if draws is not None else None
    if format == "nvfp4":
        return quantize_nvfp4(t, -1, 16 if tiles else None, generator, stochastic, four_over_six).values
    return quantize_mx(t, element, -1, block, mode, generator, stochastic).values


def _draw_values(seed: torch.Tensor, step: torch.Tensor, stream: int, count: int) -> torch.Tensor:
    """``count`` of ``counter_draws``' draws. The seed is a tensor, so that one graph serves every layer (an integer
    would be a constant of each). A graph of its own: fused into the cast's, inductor hashed 16 elements per block
    in a loop over the blocks, and the NVFP4 cast with stochastic rounding took about three times as long as in
    two graphs (the same draws; a 2048x256 operand on an AVX-512 CPU)."""
    return counter_draws(seed, step, stream)(torch.Size([count]))  # type: ignore[arg-type]


# torch.compile of a copy of the two functions above per configuration, built at the first use (it imports dynamo).
# Dynamo keeps its graphs per code object and stops compiling one at 8 of them (its recompile limit), running the
# function eagerly from then on: with every format, tiling and rounding graphs of one code object, twice over for the
# forward's autocast state and O2's loss mode, the comparison of MXFP8 and NVFP4 at O1 and O2 in one process reached
# it and its later casts ran eagerly, several times slower. A copy per configuration, called with autocast off (the
# casts compute in float32 either way), holds at most two (the mode stack in a forward and in a backward).
_compiled: dict[tuple[Any, ...], Any] = {}


def _call(function: Callable[..., torch.Tensor], configuration: tuple[Any, ...], *args: Any) -> torch.Tensor:
    """``function(*args)`` through the ``torch.compile`` (dynamic shapes) of its copy for ``configuration`` (the
    arguments a graph takes as constants); the eager function once torch.compile failed here."""
    key = (function.__name__, *configuration)
    if key not in _compiled:
        twin = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__)
        _compiled[key] = torch.compile(twin, dynamic=True)
    compiled = _compiled[key]
    if compiled is None:
        return function(*args)
    try:
        with torch.autocast(args[0].device.type, enabled=False):
            return compiled(*args)
    except Exception as error:  # noqa: BLE001 - a compiler missing or failing here: the eager cast is the same
        _compiled[key] = None
        _torch.fallback_once("a working torch.compile for block-scaled casts",
                             f"they run eagerly, several times slower ({type(error).__name__}: {str(error)[:200]})")
        return function(*args)


def operand_values(t: torch.Tensor, recipe: BlockScaledRecipe, seed: int = 0, step: torch.Tensor | None = None,
                   stream: int = 0, stochastic: bool = False, tiles: bool = False,
                   transposed: bool = False) -> torch.Tensor:
    """A GEMM operand, 2-D ``t`` (``t.T`` with ``transposed``) in any floating dtype, quantized along its last axis in
    ``recipe``'s format and decoded in float32 (see ``quantize_operand``); through ``torch.compile`` where
    ``recipe.compiled_casts`` and the caller is not traced itself (a compiled model's trace takes the plain
    functions), one compiled copy per configuration, dtype and transposition (each at most two graphs)."""
    element = recipe.element if recipe.format == "mxfp8" else MX_ELEMENTS.get(recipe.format, "e2m1")
    eager = not recipe.compiled_casts or torch.compiler.is_compiling()
    if transposed and recipe.format == "mxfp4":  # inductor's MXFP4 cast of a transposed read took about twice a copy
        t, transposed = t.T.contiguous(), False  # and the cast (a 2048x128 bf16 operand): this one copies first
    draws = None
    if stochastic and step is not None:
        rows, cols = t.shape[::-1] if transposed else t.shape
        block = recipe.block
        count = (-(-rows // 16) * 16 if tiles else rows) * -(-cols // block) * block  # the padded blocks' elements
        seed_tensor = torch.tensor(seed, dtype=torch.int64, device=t.device)
        draws = (_draw_values(seed_tensor, step, stream, count) if eager
                 else _call(_draw_values, (stream,), seed_tensor, step, stream, count))
    constants = (recipe.format, element, recipe.block, recipe.scale_mode, tiles, stochastic)
    args = (t.detach(), *constants, draws, recipe.four_over_six, transposed)
    if eager:
        return _operand_values(*args)
    return _call(_operand_values, (*constants, recipe.four_over_six, draws is None, t.dtype, transposed), *args)


def _gemm(a: Quantized, b: Quantized, recipe: BlockScaledRecipe) -> torch.Tensor:
    """``a @ b.T`` of two operands quantized along their last axis."""
    if recipe.gemm is not None:
        return recipe.gemm(a, b)  # type: ignore[operator]
    return a.values @ b.values.T


class _BlockScaledMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: BlockScaledLinear,
                step: torch.Tensor | None) -> torch.Tensor:
        recipe = module.recipe
        x2 = x.reshape(-1, x.shape[-1])
        tiles = bool(recipe.format == "nvfp4" and recipe.weight_tiles)
        dtype = x.dtype
        if not recipe.quantize_forward:  # the model's own linear: 16-bit operands (autocast's, else x's), float32 sums
            if torch.is_autocast_enabled(x.device.type):
                dtype = torch.get_autocast_dtype(x.device.type)
            out = x2.to(dtype).float() @ weight.to(dtype).float().T
            ctx.tiled = None
        elif recipe.gemm is not None:  # a native kernel takes the quantized operands themselves
            w = quantize_operand(weight.float(), recipe, tiles=tiles)
            out = _gemm(quantize_operand(x2.float(), recipe), w, recipe)
            ctx.tiled = w.values if tiles else None
        else:  # the casts convert to float32 themselves (fused, where compiled)
            w_values = operand_values(weight, recipe, tiles=tiles)
            out = operand_values(x2, recipe) @ w_values.T
            ctx.tiled = w_values if tiles else None
        ctx.save_for_backward(x, weight, step)
        ctx.module = module
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(dtype)

    @staticmethod
    @without_autocast  # float32 GEMMs, also where torch.compile traces this under the forward's autocast state
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight, step = ctx.saved_tensors
        module = ctx.module
        recipe = module.recipe
        x2, g2 = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        stochastic = step is not None
        if recipe.gemm is not None:
            return _native_backward(ctx, x, weight, x2.float(), g2.float(), step)
        seed, transform = module.seed, module.transform
        every = recipe.format == "mxfp4"  # MXFP4's recipe rounds all four operands (NVFP4's: the gradient's)
        # Input gradient: reduction over the output features; MXFP4's recipe transforms along it too (Tseng et al.,
        # arXiv 2502.20586; amazon-science/mxfp4-llm). The tiled weight's transpose is its tiles'.
        g = g2
        if every and recipe.hadamard:
            g, wt = _hadamard_columns(g2.float(), transform), _hadamard_columns(weight.float().T, transform)
            wt = operand_values(wt, recipe, seed, step, 2, stochastic)
        elif ctx.tiled is not None:
            wt = ctx.tiled.T
        else:
            wt = operand_values(weight, recipe, seed, step, 2, stochastic and every, transposed=True)
        grad_x = operand_values(g, recipe, seed, step, 0, stochastic) @ wt.T
        # Weight gradient: reduction over the tokens, the operands transposed inside their casts.
        if recipe.hadamard:
            g2, x2 = _hadamard_rows(g2.float(), transform), _hadamard_rows(x2.float(), transform)
        grad_w = (operand_values(g2, recipe, seed, step, 1, stochastic, transposed=True)
                  @ operand_values(x2, recipe, seed, step, 3, stochastic and every, transposed=True).T)
        return grad_x.reshape(x.shape).to(x.dtype), grad_w.to(weight.dtype), None, None


def _native_backward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, g2: torch.Tensor,
                     step: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    """The backward with ``recipe.gemm``: its kernel takes the quantized operands themselves."""
    module = ctx.module
    recipe = module.recipe
    stochastic = step is not None
    draws_x, draws_w = ((counter_draws(module.seed, step, 0), counter_draws(module.seed, step, 1)) if step is not None
                        else (None, None))
    tiles = bool(recipe.format == "nvfp4" and recipe.weight_tiles)
    w = quantize_operand(weight.float(), recipe, tiles=tiles)
    wt = _transposed(w) if tiles else quantize_operand(weight.float().T, recipe)
    grad_x = _gemm(quantize_operand(g2, recipe, draws_x, stochastic), wt, recipe)
    if recipe.format == "nvfp4" and recipe.hadamard:
        g2, x2 = _hadamard_rows(g2, module.transform), _hadamard_rows(x2, module.transform)
    grad_w = _gemm(quantize_operand(g2.T.contiguous(), recipe, draws_w, stochastic),
                   quantize_operand(x2.T.contiguous(), recipe), recipe)
    return grad_x.reshape(x.shape).to(x.dtype), grad_w.to(weight.dtype), None, None


def _transposed(q: Quantized) -> Quantized:
    """A 16x16-tiled operand's transpose: the same tiles, so the same quantized values, transposed."""
    return dataclasses.replace(q, values=q.values.T, elements=q.elements.T, flushed=q.flushed.T)


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1


# The count as an op AOTAutograd's partitioner never recomputes (it recomputes builtin pointwise ops in backward):
# as ``draws_step + 1``, the backward recomputed it from the buffer after the forward's update and drew the next
# step's numbers (torch 2.13; a saved copy of the buffer taken before an in-place ``add_`` was the buffer itself).
_next_count = torch.library.custom_op("ampkit::next_draws_count", _plus_one, mutates_args=())
_next_count.register_fake(lambda t: torch.empty_like(t))


@torch.compiler.disable
def _apply_eagerly(x: torch.Tensor, weight: torch.Tensor, module: BlockScaledLinear,
                   step: torch.Tensor | None) -> torch.Tensor:
    _torch.fallback_once("a dynamo that traces a block-scaled linear's backward as eager runs it (2.13 on)",
                         "block-scaled linears run eagerly inside compiled models, a graph break at each")
    return _BlockScaledMatmul.apply(x, weight, module, step)



# dynamo before 2.13 traced this Function's backward into gradients far from eager's (2.11, also with
# backend="eager"; tests/test_compiling.py): there each call inside a compiled model runs eagerly, a graph break,
# and says so once.
_TRACED = _torch.at_least(2, 13)


class BlockScaledLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs compute on block-scaled operands (see the module docstring).

    Args:
        in_features: as ``nn.Linear``'s.
        out_features: as ``nn.Linear``'s.
        bias: as ``nn.Linear``'s.
        recipe: the ``BlockScaledRecipe`` (default: MXFP8).
        seed: stochastic rounding's seed (default 0): NVFP4's and MXFP4's draws are hashed from it and the layer's
            count of training forwards (``block_scaled.counter_draws``), the same eagerly and compiled.
        device: as ``nn.Linear``'s.
        dtype: as ``nn.Linear``'s.
    """

    draws_step: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: BlockScaledRecipe = BlockScaledRecipe(), seed: int = 0, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.transposed = False
        self._init_recipe(recipe, seed)

    @classmethod
    def from_linear(cls, linear: nn.Module, recipe: BlockScaledRecipe, seed: int = 0) -> BlockScaledLinear:
        """A block-scaled linear on ``linear``'s own Parameters (optimizers built on them keep working); of an
        ``nn.Linear`` or transformers' ``Conv1D``, whose weight stays in its transposed layout."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = features(linear)
        # the same Parameters: optimizers keep them
        new.weight, new.bias = linear.weight, linear.bias  # type: ignore[assignment]
        new.transposed = is_conv1d(linear)
        new._init_recipe(recipe, seed)
        return new

    def _init_recipe(self, recipe: BlockScaledRecipe, seed: int) -> None:
        self.recipe, self.seed = recipe, seed
        self.transform = random_hadamard(recipe.hadamard_seed, recipe.hadamard_size)
        # Training forwards so far: which draws this step's stochastic rounding takes (not saved with the model).
        self.register_buffer("draws_step", torch.zeros((), dtype=torch.int64, device=self.weight.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = None
        if self.recipe.stochastic_gradients and torch.is_grad_enabled():
            step = _next_count(self.draws_step)  # this forward's count, then the buffer's
            self.draws_step.copy_(step)
        weight = self.weight.t() if self.transposed else self.weight
        if not _TRACED and _torch.is_compiling():
            out = _apply_eagerly(x, weight, self, step)
        else:
            out = _BlockScaledMatmul.apply(x, weight, self, step)
        return out + self.bias.to(out.dtype) if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.label}" + (", transposed" if self.transposed else "")


def eligible_block_scaled(model: nn.Module, recipe: BlockScaledRecipe) -> dict[str, str]:
    """Each ``nn.Linear``'s and ``Conv1D``'s name (``recipes.linear_layers``) and what conversion does with it:
    ``"block-scaled"``, or why it is kept; and every other linear-like layer, with why it stays
    (``recipes.unconverted_linears``)."""
    linears = linear_layers(model)
    first_last = {linears[0][0], linears[-1][0]} if recipe.keep_first_last and linears else set()
    decisions = {}
    for name, linear in linears:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in recipe.keep):
            decisions[name] = "kept: matches keep="
        elif name in first_last:
            decisions[name] = "kept: the first or last linear (keep_first_last)"
        elif any(n % recipe.block for n in features(linear)):
            decisions[name] = (f"kept: {'x'.join(map(str, features(linear)))} is not a multiple of the "
                               f"{recipe.block}-element blocks")
        else:
            decisions[name] = "block-scaled"
    return {**decisions, **unconverted_linears(model)}


def convert_to_block_scaled(model: nn.Module, recipe: BlockScaledRecipe | None = None, seed: int = 0) -> dict[str, str]:
    """Swap the model's ``nn.Linear`` and ``Conv1D`` layers for ``BlockScaledLinear`` (in place; the parameters
    stay).

    Args:
        model: the model (float32, before ``ampkit.initialize``: the rest then runs at the opt level).
        recipe: a ``BlockScaledRecipe`` (default MXFP8).
        seed: the stochastic rounding's seed (each layer gets ``seed + its index``).

    Returns:
        Each linear's name and what was done: ``"block-scaled"`` or ``"kept: <why>"``.

    Raises:
        ValueError: no linear can be block-scaled (the reasons are named), or some are in a narrow format
            already (FP8 or block-scaled: named).
    """
    recipe = recipe or BlockScaledRecipe()
    check_recipe(recipe, BlockScaledRecipe)
    refuse_converted(model, "convert_to_block_scaled")
    decisions = eligible_block_scaled(model, recipe)
    if "block-scaled" not in decisions.values():
        raise ValueError(f"No linear of {type(model).__name__} can take {recipe.label}: "
                         f"{ {k: v for k, v in list(decisions.items())[:4]} }.")
    for index, (name, decision) in enumerate(decisions.items()):
        if decision == "block-scaled":
            owner_name, _, child = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, child, BlockScaledLinear.from_linear(getattr(owner, child), recipe, seed + index))
    return decisions

