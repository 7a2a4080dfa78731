"""The guard's watch on the layers that compute narrower than float32, and the one precision raise it makes.

**Watched**: FP8 linears (``Fp8Linear``: their input as cast with the delayed scale that forward used, once an
amax made it: the first forward's scale of 1 is no calibration),
block-scaled linears (their input as the recipe quantizes it) and every other leaf module with parameters
whose output is float16 or bfloat16 (under an autocast region, or a 16-bit model). Every ``sample_every``
steps, forward hooks measure the step's own forward (no extra pass; several forwards in a step, micro-batches,
keep the worst): three figures a layer, kept as tensors and read with one host sync at the guard's step.

- ``saturation``: FP8, the fraction of the input's nonzero values clamped at the format's largest; block-scaled,
  the fraction of blocks one of whose values passed the element type's largest; 16 bits, 1 where a value of the
  output is not finite (float16's overflow), else 0 (one pass over the output: its smallest and largest values).
- ``underflow``: FP8, the share of each input channel's square sum flushed to zero, their mean over the channels
  (``flushed_mass``: the smallest values flush first and carry little of the matmul); block-scaled, the fraction of
  the input's nonzero values flushed to zero; float16, the fraction of the output's nonzero values below its
  smallest normal (bfloat16 has float32's range: 0).
- ``amax``: the largest magnitude over the format's largest (16 bits: of the output; FP8: of the scaled input).

Between samples the hooks return at once (a Python call per watched module per forward).

**Raised** (``raise_layer``; ``lower_layer`` undoes it), in place: the module's forward is replaced, so the optimizer
keeps its Parameters and FSDP2 gathers into it. An FP8 linear (ampkit's, or torchao's ``Float8Linear``) or a
block-scaled one computes as a plain linear on its Parameters (the 16-bit format of the run's region or model); a
16-bit layer computes in float32: its forward runs with autocast off on float32 inputs (eagerly in a compiled model,
a graph break: see ``raise_layer``). Not a policy's per-module override: the guard does not own the region the model
runs in (``initialize``'s, a user's ``ampkit.autocast`` or a plain ``torch.autocast`` all take this), and the change
is one module's, as the layer that failed is one. A 16-bit layer of an O2 model has 16-bit weights whose float32 masters
the optimizer steps: raised, its weights take their masters' values in float32 (the optimizer goes on stepping
the masters and writes them back, now without rounding; the layer's float32 gradients are the masters' own), and
a return rounds them to 16 bits again. Without masters (O3, and FSDP2's 16-bit all-gathers) the layer computes on
float32 copies of its 16-bit weights (a torch function mode casts what its forward reads; autograd carries the
gradients back to the weights the optimizer steps) and its output is rounded to their dtype, which the rest of the
16-bit model takes: a raise cures what overflows inside the layer (its scores, a sum of squares), not an output
16 bits cannot hold.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ampkit import _trees
from ampkit.formats.block_linear import BlockScaledLinear, quantize_operand
from ampkit.formats.fp8 import Fp8Linear, cast_fractions, fp8_max
from ampkit.formats.recipes import INPUT, SMALLEST_SUBNORMAL
from ampkit.formats.torchao import is_float8_linear

SIXTEEN = (torch.float16, torch.bfloat16)
FIGURES = ("saturation", "underflow", "amax")


def kind(module: nn.Module) -> str:
    """How ``module`` is watched: ``"fp8"``, ``"block"``, ``"16-bit"`` (a leaf with parameters, an FP8 or
    block-scaled linear raised among them), or ``""``."""
    if isinstance(module, Fp8Linear) and _raised(module) is None:
        return "fp8"
    if isinstance(module, BlockScaledLinear) and _raised(module) is None:
        return "block"
    if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
        return "16-bit"
    return ""


def _nonzero(a: torch.Tensor) -> torch.Tensor:
    return (a > 0).sum().clamp(min=1)


def fp8_figures(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(saturation, underflow, amax) of ``x`` cast to FP8 ``dtype`` with ``scale``, as one float32 tensor: the
    fraction of its nonzero values clamped (``fp8.cast_fractions``, the diagnostics' own), and ``flushed_mass``."""
    a = x.detach().abs().float()
    scaled = a * scale
    largest = torch.nan_to_num(scaled.amax() / fp8_max(dtype), nan=1e30, posinf=1e30)  # finite, for strict JSON
    clamped = cast_fractions(a, scaled, dtype)[0].float()
    return torch.stack([clamped, flushed_mass(a, scaled, dtype), largest.float()])


def flushed_mass(a: torch.Tensor, scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mean over the input's channels (its last dimension) of the share of each channel's square sum that the
    cast flushes to zero. Not the share of values flushed, which the diagnostics report: a tensor's smallest values
    flush first and carry little of a matmul's result (a Llama's MLP input with a channel x 3e4 flushes half its
    values, this 0.01 to 0.02, and trains as without the channel); with a channel x 1e6 the others go (0.96)."""
    squares = a.reshape(-1, a.shape[-1]).square()
    lost = torch.where(scaled.reshape(squares.shape) <= SMALLEST_SUBNORMAL[dtype] / 2, squares, 0.0).sum(0)
    total = squares.sum(0)
    present = total > 0
    return (torch.where(present, lost / total.clamp(min=torch.finfo(torch.float32).tiny), 0.0).sum()
            / present.sum().clamp(min=1))


def block_figures(x: torch.Tensor, module: BlockScaledLinear) -> torch.Tensor:
    """(saturation, underflow, 0) of ``x`` quantized as ``module``'s recipe quantizes its input."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    q = quantize_operand(x, module.recipe)
    return torch.stack([q.block_saturated.float().mean(), q.flushed.sum() / _nonzero(x.abs()),
                        torch.zeros((), device=x.device)]).float()


def output_extremes(output: Any) -> list[tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Each 16-bit or float32 tensor of ``output``: (its dtype, smallest value, largest value, and for float16 the
    fraction of its nonzero values below the smallest normal). One pass over a tensor, two more for float16's
    underflow; the figures are made from them for every sampled layer at once (``extreme_rows``). A float32 output
    counts where it is not finite (under autocast a layer adding a float32 bias to its 16-bit product gives one:
    its overflow was missed when 16-bit outputs alone were read)."""
    found = []
    for out in _trees.leaves(output):
        if isinstance(out, torch.Tensor) and (out.dtype in SIXTEEN or out.dtype == torch.float32):
            low, high = torch.aminmax(out.detach())
            tiny = None
            if out.dtype == torch.float16:  # bfloat16 has float32's range: no underflow
                a = out.detach().abs()
                tiny = ((a > 0) & (a < torch.finfo(out.dtype).tiny)).sum() / _nonzero(a)
            found.append((out.dtype, low, high, tiny))
    return found


def extreme_rows(extremes: list[tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor | None]]
                 ) -> torch.Tensor:
    """(saturation, underflow, amax) of each tensor ``output_extremes`` read, one row each, in a few ops
    for all of them: ``saturation`` is 1 where a value is not finite (an inf or a NaN reaches the min or the max),
    else 0; ``amax`` the largest magnitude over the format's largest (1 where not finite)."""
    low = torch.stack([e[1].float() for e in extremes])
    high = torch.stack([e[2].float() for e in extremes])
    largest_normal = low.new_tensor([torch.finfo(e[0]).max for e in extremes])
    largest = torch.maximum(-low, high)
    tiny = torch.stack([e[3].float() if e[3] is not None else low.new_zeros(()) for e in extremes])
    return torch.stack([(~torch.isfinite(largest)).float(), tiny,
                        torch.nan_to_num(largest / largest_normal, nan=1.0, posinf=1.0)], 1)


def output_figures(output: Any) -> torch.Tensor | None:
    """(saturation, underflow, amax) of an output's 16-bit and float32 tensors, the worst of each, else None."""
    extremes = output_extremes(output)
    return extreme_rows(extremes).amax(0) if extremes else None


SIGNALS = {"saturation": ("layer-saturation", "values clamped or not finite"),
           "underflow": ("layer-underflow", "values flushed (FP8: their share of the square sum) or below the "
                         "smallest normal"),
           "amax": ("layer-near-overflow", "largest value over the format's largest")}


def worst(sampled: dict[str, tuple[float, float, float]], kinds: dict[str, str],
          limits: dict[str, float]) -> tuple[str, str, str] | None:
    """The sampled layer furthest past a limit (as a multiple of it): its signal, the figure in words, its name; or
    None. A largest value is a signal of 16-bit layers only (FP8's scale puts it at the format's largest)."""
    found: tuple[float, str, str, str] | None = None
    for name, figures in sampled.items():
        for figure, number in zip(FIGURES, figures):
            if (figure != "amax" or kinds.get(name) == "16-bit") and number > limits[figure]:
                if found is None or number / limits[figure] > found[0]:
                    signal, what = SIGNALS[figure]
                    found = (number / limits[figure], signal,
                             f"{name} ({kinds.get(name)}): {what} {number:.3g}, past {limits[figure]:g}", name)
    return None if found is None else found[1:]


class LayerWatch:
    """Forward hooks on a model's narrow layers; ``take`` gives each sampled step's figures, by layer name."""

    def __init__(self, model: nn.Module) -> None:
        self.sampling = False
        self._rows: list[tuple[str, torch.Tensor]] = []  # FP8 and block-scaled layers' figures, as measured
        self._extremes: list[tuple[str, tuple[torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor | None]]] = []
        self._handles: dict[str, list[Any]] = {}
        self.kinds: dict[str, str] = {}  # name -> kind(module)
        self._scales: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if name and kind(module):
                self.watch(name, module)

    def watch(self, name: str, module: nn.Module) -> None:
        """Hook ``module`` (again, after a raise replaced or rewrapped it) as ``name``."""
        for handle in self._handles.pop(name, []):
            handle.remove()
        self.kinds[name] = watched = kind(module)
        handles = [module.register_forward_hook(self._hook(name, watched))]
        if watched == "fp8":  # the forward updates its scale: the one it uses is read before
            handles.append(module.register_forward_pre_hook(self._scale_hook(name)))
        self._handles[name] = handles

    def remove(self) -> None:
        """Take every hook off (``Guard.close``)."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()

    def _active(self) -> bool:
        return self.sampling and torch.is_grad_enabled()  # training forwards only, not an evaluation's

    def _scale_hook(self, name: str) -> Any:
        def pre_hook(module: Fp8Linear, args: tuple) -> None:
            if self._active():
                # and whether an amax made it: before the first (a new layer, one returned with its history reset) the
                # delayed scale is 1, whose flushes say nothing of the layer (a Llama's MLP input: 17% at step 0)
                self._scales[name] = torch.stack([module.scale[INPUT], module.amax_history[INPUT].amax() > 0])
        return pre_hook

    def _hook(self, name: str, watched: str) -> Any:
        def hook(module: Any, args: tuple, output: Any) -> None:  # an Fp8Linear where "fp8", as kind() says
            if not self._active():
                return
            if watched == "fp8" and name in self._scales:
                scale, calibrated = self._scales.pop(name)
                figures = fp8_figures(args[0], scale, module.recipe.dtype(INPUT))
                self._rows.append((name, figures * torch.stack([calibrated, calibrated, torch.ones_like(calibrated)])))
            elif watched == "block":
                self._rows.append((name, block_figures(args[0], module)))
            else:  # the figures of all outputs are made at once, at take()
                self._extremes += [(name, found) for found in output_extremes(output)]
        return hook

    def take(self) -> tuple[list[str], torch.Tensor | None]:
        """The sampled step's figures: the layers' names, sorted (every rank stacks them alike: ``ranks.Agreement``
        reads them), and one float32 row each (a layer's worst over its outputs and calls); a clean slate after."""
        rows, extremes = self._rows, self._extremes
        self._rows, self._extremes = [], []
        self._scales.clear()
        names = [name for name, _ in rows] + [name for name, _ in extremes]
        if not names:
            return [], None
        parts = [torch.stack([row for _, row in rows])] if rows else []
        if extremes:
            outputs = extreme_rows([found for _, found in extremes])
            parts.append(outputs.to(parts[0].device) if parts else outputs)
        table = torch.cat(parts) if len(parts) > 1 else parts[0]
        unique = sorted(set(names))
        row_of = {name: row for row, name in enumerate(unique)}
        index = torch.tensor([row_of[name] for name in names], device=table.device)
        worst = table.new_zeros(len(unique), table.shape[1]).index_reduce_(0, index, table, "amax", include_self=False)
        return unique, worst


def _raised(module: nn.Module) -> str | None:
    """What ``raise_layer`` last made of ``module``: ``"16 bits"``, ``"float32"``, or None (not raised)."""
    forward = module.__dict__.get("forward")
    return getattr(getattr(forward, "__func__", None), "raised", None)


def _float32(value: Any) -> Any:
    return _trees.map_leaves(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in SIXTEEN else t, value)


def _narrow(module: nn.Module) -> bool:
    """An FP8 linear (ampkit's, or torchao's current scaling) or a block-scaled one."""
    return isinstance(module, (Fp8Linear, BlockScaledLinear)) or is_float8_linear(module)


def raised_to(module: nn.Module) -> str:
    """What ``raise_layer`` makes of ``module``: ``"16 bits"`` for FP8 and block-scaled linears not raised yet,
    else ``"float32"``."""
    return "16 bits" if _narrow(module) and _raised(module) is None else "float32"


def input_past(module: nn.Module, sixteen: torch.dtype | None) -> str | None:
    """Where an FP8 linear's recorded inputs (its amax history) passed half of float16's largest value (a doubling
    from overflow, as the guard's ``near_overflow``), in words, in a run whose 16-bit dtype ``sixteen`` is float16;
    else None (bfloat16, or float32: float32's range)."""
    if not isinstance(module, Fp8Linear) or sixteen is not torch.float16:
        return None
    amax = float(module.amax_history[INPUT].amax())
    largest = torch.finfo(sixteen).max
    return f"its input reached {amax:.3g}, past half float16's {largest:.0f}" if amax > largest / 2 else None


def format_of(module: nn.Module) -> str:
    """``module``'s format in words: ``"fp8"``, the block-scaled recipe's label, or ``"16 bits"``."""
    if isinstance(module, Fp8Linear) or is_float8_linear(module):
        return "fp8"
    return module.recipe.label if isinstance(module, BlockScaledLinear) else "16 bits"


MasterOf = Callable[[torch.Tensor], "torch.Tensor | None"]  # a parameter's float32 master (O2's optimizer), or None


def raise_layer(model: nn.Module, name: str, master_of: MasterOf | None = None) -> nn.Module:
    """Raise ``model``'s layer ``name`` one step (see the module's docstring), in place: the module's forward is
    replaced (FSDP2 gathers into the module it sharded, and the optimizer steps its Parameters); returns the module.
    A 16-bit weight takes its float32 master's values (``master_of``)."""
    module = model.get_submodule(name)
    forward = module.__dict__.get("forward")  # an instance's own forward (a wrapper, a raise), else its class's
    if raised_to(module) == "16 bits":
        def as_16_bit(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
            """The raised forward: a linear on its Parameters in the run's 16-bit format (a transformers ``Conv1D``'s
            weight kept in its transposed layout); a function per raise, carrying what ``lower_layer`` reads."""
            return F.linear(x, self.weight.t() if getattr(self, "transposed", False) else self.weight, self.bias)

        as_16_bit.raised, as_16_bit.before = "16 bits", forward  # type: ignore[attr-defined]
        module.forward = types.MethodType(as_16_bit, module)  # type: ignore[method-assign]
        return module
    # a module without parameters (an elementwise scale) computes in float32 on the model's device, its output float32
    device_type = next((p.device.type for p in itertools.chain(module.parameters(), model.parameters())), "cpu")

    def in_float32(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # 16-bit weights with no float32 master (O3; FSDP2's 16-bit all-gathers, read as the forward runs) compute as
        # float32 copies, and the output is rounded to their dtype, which the rest of the 16-bit model takes (O1's and
        # O2's float32 outputs go on to an autocast region or a layer kept in float32)
        sixteen = next((p.dtype for p in self.parameters() if p.dtype in SIXTEEN), None)
        run: Callable[..., Any]
        if forward is None:
            run = functools.partial(type(self).forward, self)
        elif getattr(forward, "__self__", None) is module:  # a raise before this one: bound to this module's copy
            run = types.MethodType(forward.__func__, self)  # too (the replay's deep copy ran the original's weights)
        else:
            run = forward
        with torch.autocast(device_type, enabled=False), _Float32Copies() if sixteen else contextlib.nullcontext():
            output = run(*_float32(args), **_float32(kwargs))
        if sixteen is None:
            return output
        return _trees.map_leaves(
            lambda t: t.to(sixteen) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, output)

    weights = _weights_in_float32(module, master_of)
    # A compiled model's raised layer runs eagerly, a graph break at it: a backward AOTAutograd traced would run under
    # the forward's outer autocast (16-bit GEMMs), and the float16 overflow it was raised for came back at every step
    # (a dynamic scaler skipped on, down to a scale of 1).
    run_eagerly = torch.compiler.disable(in_float32)
    run_eagerly.raised, run_eagerly.before = "float32", forward  # type: ignore[attr-defined]  # lower_layer's
    run_eagerly.weights = weights  # type: ignore[attr-defined]  # and their dtypes
    # bound to the module, so that a deep copy (the guard's replay) runs the copy's own forward
    module.forward = types.MethodType(run_eagerly, module)  # type: ignore[method-assign]
    return module


class _Float32Copies(TorchFunctionMode):
    """Every torch function called inside takes float32 copies of its 16-bit tensor arguments (an O3 layer's weights,
    read where its forward uses them); autograd carries their gradients back to the 16-bit tensors."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*_float32(args), **_float32(kwargs or {}))


@torch.no_grad()
def _weights_in_float32(module: nn.Module, master_of: MasterOf | None) -> list[tuple[nn.Parameter, torch.dtype]]:
    """Give ``module``'s 16-bit parameters their float32 masters' values (a copy: the optimizer writes the master
    back into it at each step); each with its dtype before, for ``lower_layer``."""
    changed = []
    for param in module.parameters():
        master = master_of(param) if master_of is not None and param.dtype in SIXTEEN else None
        if master is not None:
            changed.append((param, param.dtype))
            param.data = master.detach().clone()
    return changed


def lower_layer(model: nn.Module, name: str) -> nn.Module:
    """Undo every ``raise_layer(model, name)``: the module's forward is its own again, its 16-bit weights rounded from
    their masters' values (O2), an FP8 linear's amax history and scales fresh (those it had described the tensors of
    before its raise). Returns the module."""
    module = model.get_submodule(name)
    fp8 = module if isinstance(module, Fp8Linear) and _raised(module) is not None else None
    while (raised := _raised(module)) is not None:
        run = module.__dict__["forward"].__func__
        if raised == "float32":
            with torch.no_grad():
                for param, dtype in run.weights:  # rounded from their masters' values, as a step writes them back
                    param.data = param.data.to(dtype)
        if run.before is None:
            del module.forward
        else:
            module.forward = run.before  # type: ignore[method-assign]
    if fp8 is not None:
        with torch.no_grad():
            fp8.amax_history.zero_()
            fp8.scale.fill_(1.0)
    return module
