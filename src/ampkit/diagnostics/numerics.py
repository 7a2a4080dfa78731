"""Numerics inspection: which layer overflows, which values underflow, where the first inf/NaN appears.

``inspect_numerics`` runs one float32 forward and backward with hooks and
reports, per module, how its activations and activation gradients would fare
in float16 and bfloat16 (``find_nonfinite``, in ``nonfinite.py``, names the first
module and op whose output is inf/NaN).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit.files import atomic_write
from ampkit.diagnostics.block_numerics import BlockLayerNumerics, block_trouble, measure_block_linear
from ampkit.diagnostics.fp8_numerics import Fp8LayerNumerics, fp8_trouble, measure_fp8_linear
from ampkit.formats.fp8 import Fp8Linear, Fp8Recipe
from ampkit.formats.recipes import BlockScaledRecipe
from ampkit.precision.policy import Policy
from ampkit.precision.regions import autocast

FP16_MAX = torch.finfo(torch.float16).max  # 65504
FP16_MIN_NORMAL = 2.0**-14  # below: subnormal, fewer significant bits
FP16_MIN_SUBNORMAL = 2.0**-24  # below half of it: flushed to zero
BF16_MAX = torch.finfo(torch.bfloat16).max
BF16_MIN_NORMAL = torch.finfo(torch.bfloat16).tiny
BF16_MIN_SUBNORMAL = 2.0**-133


@dataclasses.dataclass(frozen=True)
class RangeStats:
    """How the values of one tensor (or many) would fare in 16 bits.

    Fractions are of the nonzero values.
    """

    max_abs: float
    fp16_overflow: float  # |x| > 65504
    fp16_subnormal: float  # 2^-24 <= |x| < 2^-14
    fp16_zero: float  # |x| < 2^-24: flushed to zero
    bf16_overflow: float
    bf16_subnormal: float
    bf16_zero: float

    @classmethod
    def of(cls, values: torch.Tensor) -> RangeStats:
        return range_stats(values)[0]


_EXP_OFFSET = 160  # float32 exponents span -148..128


def _exp_sum(hist: list[float], low: int, high: int) -> float:
    """Values with frexp exponent e in [low, high], i.e. |x| in [2^(low-1), 2^high)."""
    return sum(hist[max(low, -_EXP_OFFSET) + _EXP_OFFSET : high + _EXP_OFFSET + 1])


def range_stats(values: torch.Tensor) -> tuple[RangeStats, list[float]]:
    """RangeStats of ``values`` and the histogram of their binary exponents.

    A few passes over the tensor and one sync: the exponent histogram (``torch.frexp``
    then ``bincount``) answers every power-of-two threshold at once; only the two
    overflow limits, which are not powers of two, are compared directly.
    ``hist[e + 160]`` counts the nonzero finite values with 2^(e-1) <= |x| < 2^e.
    """
    a = values.detach().abs().flatten()
    if a.dtype != torch.float32:
        a = a.float()
    if a.numel() == 0:
        return RangeStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), [0.0] * (2 * _EXP_OFFSET + 1)
    exponents = torch.frexp(a).exponent.clamp_(-_EXP_OFFSET, _EXP_OFFSET).add_(_EXP_OFFSET)
    hist = torch.bincount(exponents.long(), minlength=2 * _EXP_OFFSET + 1).double()
    zero = (a == 0).sum()
    nonfinite = (~torch.isfinite(a)).sum()  # frexp puts 0, inf and NaN at exponent 0
    summary = torch.stack([a.max().double(), zero.double(), nonfinite.double(),
                           (a > FP16_MAX).sum().double(), (a > BF16_MAX).sum().double()])
    numbers = torch.cat([hist, summary]).tolist()  # the one sync
    hist_list, (max_abs, zeros, nonfinites, over16, overbf16) = numbers[:-5], numbers[-5:]
    hist_list[_EXP_OFFSET] -= zeros + nonfinites
    nonzero = a.numel() - zeros
    if nonzero == 0:
        return RangeStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), hist_list
    stats = RangeStats(
        max_abs=max_abs,
        fp16_overflow=over16 / nonzero,
        fp16_subnormal=_exp_sum(hist_list, -23, -14) / nonzero,  # 2^-24 <= |x| < 2^-14
        fp16_zero=_exp_sum(hist_list, -_EXP_OFFSET, -24) / nonzero,  # |x| < 2^-24
        bf16_overflow=overbf16 / nonzero,
        bf16_subnormal=_exp_sum(hist_list, -132, -126) / nonzero,  # 2^-133 <= |x| < 2^-126
        bf16_zero=_exp_sum(hist_list, -_EXP_OFFSET, -133) / nonzero,
    )
    return stats, hist_list


@dataclasses.dataclass(frozen=True)
class ModuleNumerics:
    """One module's activations (outputs) and activation gradients."""

    name: str
    type: str
    activation: RangeStats
    gradient: RangeStats | None  # None where no gradient flowed
    fp8: Fp8LayerNumerics | None = None  # linears, with fp8=: how FP8 casts their input, weight and gradient
    block: BlockLayerNumerics | None = None  # linears, with block_scaled=: how the recipe casts them


@dataclasses.dataclass(frozen=True)
class NumericsReport:
    """Per-module figures and what to do about them.

    Attributes:
        modules: in forward order.
        keep_float32: modules whose activations overflow float16.
        recommended_loss_scale: a power of two that keeps the largest activation
            gradient under 65504 / 2 while lifting as many small ones as it can
            above 2^-24 (None without gradients).
        prefer_bf16: True when float16 overflows somewhere that bfloat16 does not.
        log2_grad_hist: counts of log2|activation gradient| per integer bin, for the figure.
        fp8_keep: with ``fp8=``, linears of which FP8 clamps or flushes to zero more than 1% of
            the inputs, weight or output gradient: keep them out (``convert_to_fp8(keep=...)``).
        block_keep: with ``block_scaled=``, linears of which the recipe flushes more than 15% of the weight.
    """

    modules: list[ModuleNumerics]
    keep_float32: list[str]
    recommended_loss_scale: float | None
    fp16_zero_before_scaling: float
    fp16_zero_after_scaling: float
    prefer_bf16: bool
    reasons: list[str]
    log2_grad_hist: dict[int, int]
    fp8_keep: list[str] = dataclasses.field(default_factory=list)
    block_keep: list[str] = dataclasses.field(default_factory=list)


def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return first_tensor(list(value.values()))
    return None


def output_tensor(output: Any) -> torch.Tensor:
    tensor = first_tensor(output)
    if tensor is None:
        raise ValueError(f"The model returned {type(output).__name__} with no floating tensor; pass loss_fn=.")
    return tensor


def policy_region(model: nn.Module, policy: Policy | torch.autocast | None) -> contextlib.AbstractContextManager:
    """Under ``policy`` (an ampkit policy, or a plain ``torch.autocast`` as the loop opened it), or in float32
    (autocast off on the model's device) without one."""
    if isinstance(policy, torch.autocast):
        return policy
    if policy is not None:
        return autocast(policy, model=model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.autocast(device.type, enabled=False)


@contextlib.contextmanager
def probing(model: nn.Module, handles: list[Any]) -> Iterator[None]:
    """Leave the model as it was found: probe hooks removed, gradients untouched."""
    saved_grads = {p: p.grad for p in model.parameters()}
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for p, grad in saved_grads.items():
            p.grad = grad


def default_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    if target is None:
        return output.float().pow(2).mean()
    if output.dim() > 2 and not target.is_floating_point():  # (batch, seq, vocab) logits
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))
    if not target.is_floating_point():
        return nn.functional.cross_entropy(output.float(), target)
    return nn.functional.mse_loss(output.float(), target)


def inspect_numerics(
    model: nn.Module,
    inputs: Any,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    policy: Policy | None = None,
    fp8: Fp8Recipe | None = None,
    block_scaled: BlockScaledRecipe | None = None,
) -> NumericsReport:
    """One forward and backward in float32 (or under ``policy``) with per-module hooks.

    Args:
        model: the model; its gradients are left as they were.
        inputs: a tensor or a tuple of positional inputs.
        target: passed to ``loss_fn`` (default: cross-entropy for integer targets,
            MSE for float targets, mean square of the output without a target).
        loss_fn: ``loss_fn(output, target) -> loss``.
        policy: run the pass under this policy instead of float32.
        fp8: also measure, for each ``nn.Linear``, how FP8 casts its input and weight (E4M3) and its
            output gradient (the recipe's gradient format): amax, the scale (an ``Fp8Linear``'s delayed
            scales as they stand, or current scaling's ``fp8_max / amax``), the fractions clamped and
            flushed to zero; ``fp8_keep`` names the linears that lose more than 1%. The model's amax
            histories and scales are left as they were.
        block_scaled: also measure, for each linear, how this ``BlockScaledRecipe`` casts its input,
            weight (along the input features) and output gradient (along the output features): the
            fraction of blocks with a saturated element, of nonzero elements flushed to zero, the blocks'
            dynamic range; ``block_keep`` names the linears whose weight it flushes more than 15% of.

    Returns:
        A NumericsReport. Syncs with the device once per module.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"inspect_numerics needs a model with trainable parameters; this {type(model).__name__} has "
                         "none, so there are no gradients to inspect.")
    loss_fn = loss_fn or default_loss
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    names = {module: name or "(model)" for name, module in model.named_modules()}
    activations: dict[str, RangeStats] = {}
    gradients: dict[str, RangeStats] = {}
    grad_hist = [0.0] * (2 * _EXP_OFFSET + 1)
    order: list[nn.Module] = []
    fp8_found: dict[str, dict[str, Any]] = {}  # fp8=: per linear, its casts' numerics
    block_found: dict[str, dict[str, Any]] = {}  # block_scaled=: the same
    fp8_saved = {m: (m.amax_history.clone(), m.scale.clone()) for m in model.modules() if isinstance(m, Fp8Linear)}
    # A container returns its last child's output: the same tensor is measured once
    # and its gradient hook registered once, for every module that returned it.
    measured: dict[int, tuple[torch.Tensor, RangeStats, list[str]]] = {}

    def forward_hook(module: nn.Module, module_inputs: Any, output: Any) -> None:
        tensor = first_tensor(output)
        if tensor is None:
            return
        name = names[module]
        if fp8 is not None and isinstance(module, nn.Linear) and isinstance(first_tensor(module_inputs), torch.Tensor):
            measure_fp8_linear(module, module_inputs[0], tensor, fp8, fp8_saved, fp8_found.setdefault(name, {}))
        if block_scaled is not None and isinstance(module, nn.Linear) and torch.is_tensor(first_tensor(module_inputs)):
            measure_block_linear(module, module_inputs[0], tensor, block_scaled, block_found.setdefault(name, {}))
        order.append(module)
        if id(tensor) in measured and measured[id(tensor)][0] is tensor:
            activations[name] = measured[id(tensor)][1]
            measured[id(tensor)][2].append(name)
            return
        stats = range_stats(tensor)[0]
        activations[name] = stats
        sharing = [name]
        measured[id(tensor)] = (tensor, stats, sharing)
        if tensor.requires_grad:
            def grad_hook(grad: torch.Tensor, sharing: list[str] = sharing) -> None:
                grad_stats, hist = range_stats(grad)
                for i, count in enumerate(hist):
                    grad_hist[i] += count
                for shared_name in sharing:
                    gradients[shared_name] = grad_stats
            tensor.register_hook(grad_hook)

    handles = [m.register_forward_hook(forward_hook) for m in model.modules()]
    with probing(model, handles):
        with policy_region(model, policy):
            loss = loss_fn(output_tensor(model(*args)), target)
        loss.backward()

    once = {names[m]: type(m).__name__ for m in order}  # forward order; a module called twice shows once
    for module, (history, scale) in fp8_saved.items():  # inspecting is not training: the scales stay
        module.amax_history.copy_(history)
        module.scale.copy_(scale)
    modules = [ModuleNumerics(name, kind, activations[name], gradients.get(name),
                              Fp8LayerNumerics(**fp8_found[name]) if name in fp8_found else None,
                              BlockLayerNumerics(**block_found[name]) if name in block_found else None)
               for name, kind in once.items()]
    report = _recommend(modules, grad_hist)
    if fp8 is not None:
        report.fp8_keep[:], fp8_reasons = fp8_trouble({m.name: m.fp8 for m in modules if m.fp8})
        report.reasons.extend(fp8_reasons)
    if block_scaled is not None:
        report.block_keep[:], block_reasons = block_trouble({m.name: m.block for m in modules if m.block})
        report.reasons.extend(block_reasons)
    return report


def _recommend(modules: list[ModuleNumerics], grad_hist: list[float]) -> NumericsReport:
    # Already inf/NaN in float32: no precision setting helps, and float32 is no refuge.
    broken = [m.name for m in modules if not math.isfinite(m.activation.max_abs)]
    keep = [m.name for m in modules if m.activation.fp16_overflow > 0 and m.name not in broken]
    reasons = [
        f"{broken[0]}: activations are already inf/NaN in this float32 pass ({len(broken)} module(s) in all); "
        "no precision setting fixes that: find the first op with ampkit.find_nonfinite(model, inputs) (an "
        "inf/NaN weight or input, or a float32 overflow)"
    ] if broken else []
    reasons += [f"{name}: activations exceed float16's 65504; keep it in float32" for name in keep]
    scale = None
    zero_before = zero_after = 0.0
    # log2 bins: frexp exponent e holds 2^(e-1) <= |g| < 2^e, so floor(log2 |g|) = e - 1.
    hist = {i - _EXP_OFFSET - 1: int(c) for i, c in enumerate(grad_hist) if c}
    total = sum(hist.values())
    largest = max((m.gradient.max_abs for m in modules if m.gradient is not None), default=0.0)
    if total and 0 < largest < math.inf:
        # The largest power of two that keeps the largest gradient under half of 65504
        # (headroom for growth during training), but never below 1.
        shift = max(0, math.floor(math.log2(FP16_MAX / 2 / largest)))
        scale = float(2**shift)
        zero_before = sum(c for b, c in hist.items() if b < -24) / total
        zero_after = sum(c for b, c in hist.items() if b + shift < -24) / total
        reasons.append(
            f"loss scale 2^{shift} = {scale:g}: largest activation gradient {largest:.3g} stays under 32752; values "
            f"flushed to zero in float16 go from {100 * zero_before:.2f}% to {100 * zero_after:.2f}%"
        )
    fp16_trouble = bool(keep) or zero_after > 0.01
    bf16_trouble = any(m.activation.bf16_overflow > 0 for m in modules)
    prefer_bf16 = fp16_trouble and not bf16_trouble
    if prefer_bf16:
        reasons.append("bfloat16 has float32's range: it avoids these overflows/underflows without loss scaling")
    return NumericsReport(modules, keep, scale, zero_before, zero_after, prefer_bf16, reasons, hist)


def write_histogram(report: NumericsReport, path: Any) -> None:
    """The log2|activation gradient| histogram with float16's representable range marked
    (the figure of Micikevicius et al., 2018, that shows why loss scaling is needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=120)
    if report.log2_grad_hist:
        bins = sorted(report.log2_grad_hist)
        total = sum(report.log2_grad_hist.values())
        ax.bar(bins, [100 * report.log2_grad_hist[b] / total for b in bins], width=0.9, color="#3b75af")
    ax.axvspan(-24, -14, color="#f0c000", alpha=0.25, label="fp16 subnormal")
    ax.axvline(-24, color="red", linestyle="--", label="2^-24: below, fp16 flushes to 0")
    ax.axvline(math.log2(FP16_MAX), color="black", linestyle="--", label="fp16 max 65504")
    if report.recommended_loss_scale:
        shift = math.log2(report.recommended_loss_scale)
        ax.axvline(-24 - shift, color="green", linestyle=":", label=f"2^-24 / loss scale 2^{shift:.0f}: lifted above")
    ax.set_xlabel("log2 |activation gradient|")
    ax.set_ylabel("% of values")
    ax.set_title("Activation gradients against float16's range")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
