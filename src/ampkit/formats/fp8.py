"""FP8 training: E4M3 / E5M2 linears with current or delayed per-tensor scaling.

FP8 has so little range (E4M3: +-448, E5M2: +-57344) that every tensor is multiplied by a scale
before the cast, as a loss scale does for a whole backward pass (Micikevicius et al., 2022,
"FP8 Formats for Deep Learning"). Two recipes choose the scale:
- **current** scaling: from the tensor's own amax, each time (torchao's ``Float8Linear``; per
  tensor or per row). One extra reduction over the tensor before every cast.
- **delayed** scaling (Transformer Engine's): from a history of the amaxes seen in earlier steps,
  ``scale = fp8_max / amax / 2**margin`` with ``amax = max(history)`` or the most recent entry.
  torchao 0.18 has none; it is written here. The current tensor's amax enters the history after its
  cast, so a sudden outlier saturates once and widens the scale for the next steps.
Formats: ``"e4m3"`` everywhere, or ``"hybrid"``: E4M3 forward (inputs, weights), E5M2 for the
gradients, whose range matters more than their precision.

Where FP8 matmuls exist (CUDA compute capability >= 8.9) the GEMMs run natively through
torch's public ``F.scaled_mm``; elsewhere they are emulated: float32 matmuls on the FP8-rounded values with
the scales applied, which gives FP8's numerics on any CPU.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ampkit.formats.recipes import (
    E4M3,
    E5M2,
    GRAD,
    INPUT,
    SMALLEST_SUBNORMAL,
    STATE_VERSION,
    WEIGHT,
    Fp8Recipe,
    check_recipe,
    features,
    is_conv1d,
    linear_layers,
    refuse_converted,
    unconverted_linears,
)
from ampkit.formats.torchao import convert_current
from ampkit.modes import without_autocast


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int, previous: torch.Tensor) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` (Transformer Engine's formula); ``previous`` where amax is 0 or not finite."""
    scale = (fp8_max(dtype) / amax.double() / 2.0**margin).float()
    return torch.where((amax > 0) & torch.isfinite(amax), scale, previous)


def history_amax(history: torch.Tensor, algo: str) -> torch.Tensor:
    """The amax a delayed scale is computed from: the history's max, or its most recent entry (index 0)."""
    return history.amax(dim=-1) if algo == "max" else history[..., 0]


def roll_in(history: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The history with ``amax`` as its most recent entry (index 0) and the oldest dropped."""
    return torch.cat([amax.reshape(1), history[:-1]])


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` cast to ``dtype``, saturated at its largest finite value."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


@dataclasses.dataclass(frozen=True)
class CastNumerics:
    """What one FP8 cast of a tensor does to its values.

    Attributes:
        format: ``"E4M3"`` or ``"E5M2"``.
        amax: the tensor's largest magnitude.
        scale: the scale of the cast (given, or current scaling's ``fp8_max / amax``).
        overflow: fraction of the nonzero values clamped at the format's largest value.
        underflow: fraction of the nonzero values flushed to zero.
    """

    format: str
    amax: float
    scale: float
    overflow: float
    underflow: float


def cast_fractions(a: torch.Tensor, scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(clamped, flushed): the fractions of the nonzero magnitudes ``a`` that ``scaled`` (``a`` times the scale) puts
    past ``dtype``'s largest value and at or below half its smallest subnormal (a tie rounds to the even 0); float64,
    on the device, no host read (the guard reads it with the step's other figures)."""
    nonzero = (a > 0).sum().clamp(min=1)
    tiny = SMALLEST_SUBNORMAL[dtype] / 2
    return torch.stack([(scaled > fp8_max(dtype)).sum().double() / nonzero,
                        ((a > 0) & (scaled <= tiny)).sum().double() / nonzero])


def cast_numerics(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> CastNumerics:
    """How casting ``x`` to ``dtype`` with ``scale`` (None: from ``x``'s own amax) fares. One sync."""
    a = x.detach().abs().float().flatten()
    amax = a.amax() if a.numel() else torch.zeros((), device=a.device)
    if scale is None:
        scale = scale_from_amax(amax, dtype, 0, torch.ones((), device=a.device))
    figures = torch.cat([torch.stack([amax.double(), torch.as_tensor(scale, device=a.device).double().reshape(())]),
                         cast_fractions(a, a * scale, dtype)]).tolist()
    return CastNumerics({E4M3: "E4M3", E5M2: "E5M2"}[dtype], *figures)


def native_fp8(device: torch.device) -> bool:
    """Whether ``device`` has FP8 matmuls: CUDA compute capability >= 8.9. (``F.scaled_mm``'s CPU kernel, torch
    2.13 and later, serves the tests: ``tests/test_fp8.py`` checks the native call against emulation with it.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, native: bool) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b)`` for 2-D FP8 ``a`` (m x k) and ``b`` (k x n).

    Native: torch's public ``F.scaled_mm`` with one scale per tensor (it wants ``b`` column-major and the
    decoding scales, the inverse of ampkit's). Emulated: a float32 matmul on the dequantized values.
    """
    if native:
        return _native_mm(a.contiguous(), b.t().contiguous().t(), scale_a.reciprocal(), scale_b.reciprocal(),
                          out_dtype)
    return (dequantize(a, scale_a) @ dequantize(b, scale_b)).to(out_dtype)


# One node of dynamo's graph, which AOTAutograd traces through: torch 2.11's dynamo refuses the ATen op
# ``_scaled_mm_v2`` that F.scaled_mm calls (a graph break at every FP8 GEMM; an error with fullgraph=True).
@torch.compiler.allow_in_graph
def _native_mm(a: torch.Tensor, b: torch.Tensor, decode_a: torch.Tensor, decode_b: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    tensor_wise = F.ScalingType.TensorWise
    return F.scaled_mm(a, b, decode_a, tensor_wise, decode_b, tensor_wise, output_dtype=out_dtype)



# -- delayed scaling ------------------------------------------------------------------------------

def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


# A copy AOTAutograd cannot see through. Compiled, a plain clone of the scale buffer that the forward then
# updates in place was saved for backward as the buffer itself, read after the update: wrong input
# gradients, silently, on every step whose scales changed (torch 2.13, aot_eager and inductor; a buffer
# cloned, mutated and its clone used in backward reproduces it without ampkit). An opaque op's output is a
# tensor of its own.
_snapshot = torch.library.custom_op("ampkit::fp8_scale_snapshot", _copy, mutates_args=())
_snapshot.register_fake(lambda t: torch.empty_like(t))


class _DelayedFp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, module: Fp8Linear) -> torch.Tensor:
        recipe, scale = module.recipe, _snapshot(module.scale)  # this step's scales, from earlier steps' amaxes
        x2 = x.reshape(-1, x.shape[-1])
        xq = quantize(x2, scale[INPUT], recipe.dtype(INPUT))
        wq = quantize(weight, scale[WEIGHT], recipe.dtype(WEIGHT))
        module.record_(INPUT, x2)
        module.record_(WEIGHT, weight)
        native = native_fp8(x.device)
        # The output in the dtype a linear would return here: under autocast (an ampkit region), its 16-bit
        # dtype, as torchao's and Transformer Engine's FP8 linears do; a float32 output after a float32 norm
        # would double the bytes every op after it saves.
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        out = scaled_mm(xq, scale[INPUT], wq.t(), scale[WEIGHT], out_dtype, native)
        ctx.save_for_backward(xq, wq, scale)  # the FP8 weight copy counts in saved-for-backward: it is stored
        ctx.module, ctx.native, ctx.x_dtype, ctx.w_dtype = module, native, x.dtype, weight.dtype
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @without_autocast  # compiled, the backward is traced under the forward's autocast state
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xq, wq, scale = ctx.saved_tensors
        module: Fp8Linear = ctx.module
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gq = quantize(g2, scale[GRAD], module.recipe.dtype(GRAD))
        module.record_(GRAD, g2)
        grad_x = scaled_mm(gq, scale[GRAD], wq, scale[WEIGHT], ctx.x_dtype, ctx.native)
        grad_w = scaled_mm(gq.t(), scale[GRAD], xq, scale[INPUT], ctx.w_dtype, ctx.native)
        return grad_x.reshape(*grad_out.shape[:-1], wq.shape[1]), grad_w, None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` training in FP8 with delayed scaling.

    Buffers (in ``state_dict``, so a resume is exact): ``amax_history`` (3 x history length: input,
    weight, gradient; index 0 the most recent) and ``scale`` (3). ``get_extra_state`` adds the
    version and the recipe. The bias is added in the output's dtype, outside FP8.
    """

    amax_history: torch.Tensor
    scale: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Fp8Recipe = Fp8Recipe(), process_group: Any = None, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.transposed = False
        self._init_fp8_state(recipe, process_group)

    @classmethod
    def from_linear(cls, linear: nn.Module, recipe: Fp8Recipe, process_group: Any = None) -> Fp8Linear:
        """Convert in place of ``linear`` (an ``nn.Linear`` or transformers' ``Conv1D``, whose weight stays in its
        transposed layout, so its checkpoints still load), keeping its Parameter objects (optimizers hold them)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = features(linear)
        new.weight, new.bias = linear.weight, linear.bias  # type: ignore[assignment]  # its Parameters
        new.transposed = is_conv1d(linear)
        new._init_fp8_state(recipe, process_group)
        return new

    def _init_fp8_state(self, recipe: Fp8Recipe, process_group: Any) -> None:
        self.recipe, self.process_group = recipe, process_group
        device = self.weight.device
        self.register_buffer("amax_history", torch.zeros(3, recipe.amax_history_len, device=device))
        self.register_buffer("scale", torch.ones(3, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _DelayedFp8Matmul.apply(x, self.weight.t() if self.transposed else self.weight, self)
        return out + self.bias.to(out.dtype) if self.bias is not None else out

    @torch.no_grad()
    def record_(self, role: int, tensor: torch.Tensor) -> None:
        """Roll ``tensor``'s amax into the history of ``role`` and recompute its scale for the next step.

        Only while training: an evaluation pass leaves the scales as they are. Under
        ``process_group`` the amax is the maximum over the ranks, so every rank uses the same scale.
        A non-finite amax is not rolled in (the step it came from is one a loss scaler or the guard skips): the
        scale's formula keeps the previous scale for a non-finite amax, so one in the history held the scale until
        it rolled out (a float16 overflow before an FP8 linear froze its scale for 8 steps of 2 micro-batches).
        """
        if not self.training:
            return
        amax = tensor.detach().abs().amax().float()
        if self.process_group is not None:  # in place on a tensor of its own: torch.compile traces it into its graph
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
        history = self.amax_history[role]
        self.amax_history[role] = torch.where(torch.isfinite(amax), roll_in(history, amax), history)
        self.scale[role] = scale_from_amax(history_amax(self.amax_history[role], self.recipe.amax_compute_algo),
                                           self.recipe.dtype(role), self.recipe.margin, self.scale[role])

    def get_extra_state(self) -> torch.Tensor:
        """The version and the recipe, as the bytes of their JSON in a uint8 tensor: a state dict of tensors only
        is what safetensors (transformers' ``save_pretrained``) writes; a dict there failed the save."""
        text = json.dumps({"version": STATE_VERSION, "recipe": dataclasses.asdict(self.recipe)})
        return torch.tensor(list(text.encode()), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor | dict[str, Any]) -> None:
        _check_state(state, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}" + (", transposed" if self.transposed else "")


def _check_state(state: Any, recipe: Fp8Recipe) -> None:
    """Refuse an FP8 layer's saved state of another version or recipe (RuntimeError). The state is
    ``get_extra_state``'s tensor, or the dict earlier versions saved."""
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        try:
            state = json.loads(bytes(state.tolist()).decode())
        except ValueError:
            pass  # refused below, shown as it came
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise RuntimeError(f"Cannot load Fp8Linear state {state!r}: this ampkit reads version {STATE_VERSION}.")
    saved = Fp8Recipe(**state["recipe"])
    if saved != recipe:
        raise RuntimeError(f"The checkpoint's FP8 recipe {saved} differs from this model's {recipe}: "
                           "convert the model with the checkpoint's recipe before loading.")


def _check_states_first(model: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """A load-state-dict pre-hook of the converted model: every FP8 layer's saved state is checked before any
    module loads (each layer's own check ran after the layers before it, and its own weights, were overwritten)."""
    for name, module in model.named_modules():
        key = f"{prefix}{name}{'.' if name else ''}_extra_state"
        if isinstance(module, Fp8Linear) and key in state_dict:
            _check_state(state_dict[key], module.recipe)


# -- the module swap --------------------------------------------------------------------------

def eligible(model: nn.Module, keep: tuple[str, ...] = (), include: tuple[str, ...] = ()) -> dict[str, str]:
    """Every ``nn.Linear`` and ``Conv1D`` of ``model`` by qualified name (``recipes.linear_layers``), with
    ``"fp8"`` or the reason it stays; and every other linear-like layer, with why it stays
    (``recipes.unconverted_linears``).

    Kept by default: the first and the last linear (the input embedding-like projection and the
    output head are the most range-sensitive), and linears whose dimensions are not multiples of
    16 (FP8 GEMMs need them). ``keep`` patterns (fnmatch on the name) keep more; ``include``
    patterns convert a first or last linear anyway (dimensions still must fit).
    """
    layers = linear_layers(model)
    decisions = {}
    for index, (name, linear) in enumerate(layers):
        forced = any(fnmatch.fnmatchcase(name, p) for p in include)
        in_features, out_features = features(linear)
        if in_features % 16 or out_features % 16:
            decisions[name] = f"kept: {in_features}x{out_features} is not a multiple of 16"
        elif any(fnmatch.fnmatchcase(name, p) for p in keep):
            decisions[name] = "kept: named in keep="
        elif index in (0, len(layers) - 1) and not forced:
            decisions[name] = "kept: the first linear" if index == 0 else "kept: the last linear"
        else:
            decisions[name] = "fp8"
    return {**decisions, **unconverted_linears(model)}


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | None = None, *, keep: tuple[str, ...] | list[str] = (),
                   include: tuple[str, ...] | list[str] = (), emulate: bool | None = None,
                   process_group: Any = None) -> dict[str, str]:
    """Convert ``model``'s eligible linears (``nn.Linear`` and transformers' ``Conv1D``) to FP8 training, in place.

    Args:
        model: a model on its device (its parameters are kept, so an optimizer built on them works).
        recipe: ``Fp8Recipe()`` by default: delayed scaling, hybrid formats.
        keep: name patterns (fnmatch) of linears kept in 16/32 bits.
        include: name patterns of linears converted although first or last.
        emulate: None picks native FP8 GEMMs on CUDA compute capability >= 8.9, emulation elsewhere.
            Delayed scaling decides per call from the device; current scaling passes it to torchao.
        process_group: delayed scaling: reduce amaxes over it (the data-parallel group) so every rank
            uses the same scales. torchao's current scaling needs none (weights are equal on all ranks,
            activations are scaled per rank, as torchao does).

    Returns:
        ``eligible(...)``: each linear's name with ``"fp8"`` or the reason it was kept.

    Raises:
        ValueError: a pattern in ``keep`` or ``include`` matches no linear (a typo would silently
            convert or keep the wrong layers), or the model has FP8 or block-scaled layers already.
        ImportError: current scaling without torchao (``pip install ampkit[fp8]``).
    """
    recipe = recipe or Fp8Recipe()
    converted = fp8_layers(model)
    if converted:
        raise ValueError(f"The model trains in FP8 already ({', '.join(converted[:3])}{' ...' if len(converted) > 3 else ''}): "
                         "convert_to_fp8 converts a model once (a second call would reset its amax histories and "
                         "scales). To try another recipe, convert a fresh copy of the float32 model.")
    check_recipe(recipe, Fp8Recipe)
    refuse_converted(model, "convert_to_fp8")  # block-scaled layers: once replaced by FP8 ones, silently
    keep, include = tuple(keep), tuple(include)
    names = [name for name, _ in linear_layers(model)]
    for pattern in keep + include:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ValueError(f"The pattern {pattern!r} matches no linear of the model; its linears are {names[:12]}"
                             f"{' ...' if len(names) > 12 else ''}.")
    decisions = eligible(model, keep, include)
    if recipe.scaling == "current":  # torchao's float8 swaps nn.Linear layers alone
        decisions |= {name: "kept: torchao's current scaling converts nn.Linear layers only (scaling='delayed' "
                            "converts a Conv1D)"
                      for name, m in linear_layers(model) if is_conv1d(m) and decisions[name] == "fp8"}
    chosen = {name for name, decision in decisions.items() if decision == "fp8"}
    if recipe.scaling == "current":
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        convert_current(model, recipe, chosen, not native_fp8(device) if emulate is None else emulate)
    else:
        for name in chosen:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, child, Fp8Linear.from_linear(getattr(owner, child), recipe, process_group))
        model.register_load_state_dict_pre_hook(_check_states_first)
    return decisions




def fp8_layers(model: nn.Module) -> list[str]:
    """Names of the modules training in FP8 (ampkit's delayed-scaling linears and torchao's)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, Fp8Linear) or type(m).__name__ == "Float8Linear"]
