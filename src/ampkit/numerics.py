"""Numerics inspection: which layer overflows, which values underflow, where the first inf/NaN appears.

``inspect_numerics`` runs one float32 forward and backward with hooks and
reports, per module, how its activations and activation gradients would fare
in float16 and bfloat16. ``find_nonfinite`` runs under a policy and names the
first module and op whose output is inf/NaN.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampkit.autocast import autocast
from ampkit.policy import Policy

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
        a = values.detach().float().abs().flatten()
        a = a[a > 0]
        if a.numel() == 0:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        n = a.numel()

        def frac(mask: torch.Tensor) -> float:
            return mask.sum().item() / n

        return cls(
            max_abs=a.max().item(),
            fp16_overflow=frac(a > FP16_MAX),
            fp16_subnormal=frac((a >= FP16_MIN_SUBNORMAL) & (a < FP16_MIN_NORMAL)),
            fp16_zero=frac(a < FP16_MIN_SUBNORMAL),
            bf16_overflow=frac(a > BF16_MAX),
            bf16_subnormal=frac((a >= BF16_MIN_SUBNORMAL) & (a < BF16_MIN_NORMAL)),
            bf16_zero=frac(a < BF16_MIN_SUBNORMAL),
        )


@dataclasses.dataclass(frozen=True)
class ModuleNumerics:
    """One module's activations (outputs) and activation gradients."""

    name: str
    type: str
    activation: RangeStats
    gradient: RangeStats | None  # None where no gradient flowed


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
    """

    modules: list[ModuleNumerics]
    keep_float32: list[str]
    recommended_loss_scale: float | None
    fp16_zero_before_scaling: float
    fp16_zero_after_scaling: float
    prefer_bf16: bool
    reasons: list[str]
    log2_grad_hist: dict[int, int]


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_tensor(list(value.values()))
    return None


def _default_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
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
) -> NumericsReport:
    """One forward and backward in float32 (or under ``policy``) with per-module hooks.

    Args:
        model: the model; its gradients are left as they were.
        inputs: a tensor or a tuple of positional inputs.
        target: passed to ``loss_fn`` (default: cross-entropy for integer targets,
            MSE for float targets, mean square of the output without a target).
        loss_fn: ``loss_fn(output, target) -> loss``.
        policy: run the pass under this policy instead of float32.

    Returns:
        A NumericsReport. Syncs with the device once per module.
    """
    loss_fn = loss_fn or _default_loss
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    names = {module: name or "(model)" for name, module in model.named_modules()}
    activations: dict[str, RangeStats] = {}
    gradients: dict[str, RangeStats] = {}
    grad_values: list[torch.Tensor] = []
    order: list[nn.Module] = []

    def forward_hook(module: nn.Module, _: Any, output: Any) -> None:
        tensor = _first_tensor(output)
        if tensor is None:
            return
        name = names[module]
        order.append(module)
        activations[name] = RangeStats.of(tensor)
        if tensor.requires_grad:
            def grad_hook(grad: torch.Tensor, name: str = name) -> None:
                gradients[name] = RangeStats.of(grad)
                grad_values.append(grad.detach().float().flatten())
            tensor.register_hook(grad_hook)

    saved_grads = {p: p.grad for p in model.parameters()}
    handles = [m.register_forward_hook(forward_hook) for m in model.modules()]
    try:
        with autocast(policy) if policy is not None else torch.autocast("cpu", enabled=False):
            output = model(*args)
            loss = loss_fn(_first_tensor(output), target)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        for p, grad in saved_grads.items():
            p.grad = grad

    once = {names[m]: type(m).__name__ for m in order}  # forward order; a module called twice shows once
    modules = [ModuleNumerics(name, kind, activations[name], gradients.get(name)) for name, kind in once.items()]
    return _recommend(modules, torch.cat(grad_values) if grad_values else None)


def _recommend(modules: list[ModuleNumerics], grads: torch.Tensor | None) -> NumericsReport:
    keep = [m.name for m in modules if m.activation.fp16_overflow > 0]
    reasons = [f"{name}: activations exceed float16's 65504; keep it in float32" for name in keep]
    scale = None
    zero_before = zero_after = 0.0
    hist: dict[int, int] = {}
    if grads is not None:
        nonzero = grads.abs()[grads != 0]
        if nonzero.numel():
            largest = nonzero.max().item()
            # The largest power of two that keeps the largest gradient under half of 65504
            # (headroom for growth during training), but never below 1.
            scale = float(2 ** max(0, math.floor(math.log2(FP16_MAX / 2 / largest)))) if largest > 0 else 1.0
            zero_before = (nonzero < FP16_MIN_SUBNORMAL).float().mean().item()
            zero_after = (nonzero * scale < FP16_MIN_SUBNORMAL).float().mean().item()
            bins = torch.floor(torch.log2(nonzero)).long()
            values, counts = torch.unique(bins, return_counts=True)
            hist = {int(v): int(c) for v, c in zip(values, counts)}
            reasons.append(
                f"loss scale 2^{math.log2(scale):.0f} = {scale:g}: largest activation gradient {largest:.3g} stays under 32752; values "
                f"flushed to zero in float16 go from {100 * zero_before:.2f}% to {100 * zero_after:.2f}%"
            )
    fp16_trouble = bool(keep) or zero_after > 0.01
    bf16_trouble = any(m.activation.bf16_overflow > 0 for m in modules)
    prefer_bf16 = fp16_trouble and not bf16_trouble
    if prefer_bf16:
        reasons.append("bfloat16 has float32's range: it avoids these overflows/underflows without loss scaling")
    return NumericsReport(modules, keep, scale, zero_before, zero_after, prefer_bf16, reasons, hist)


@dataclasses.dataclass(frozen=True)
class NonFiniteFinding:
    """Where the first inf/NaN appeared."""

    module: str  # innermost module running at the time
    op: str  # the ATen op whose output was non-finite
    phase: str  # "forward" or "backward"
    input_ranges: list[tuple[float, float] | None]  # (min, max) of each tensor input
    finite_inputs: bool  # False: a weight, buffer or model input was already inf/NaN


class _FirstNonFinite(TorchDispatchMode):
    def __init__(self, current_module: Callable[[], str], phase: Callable[[], str]) -> None:
        super().__init__()
        self.current_module, self.phase = current_module, phase
        self.finding: NonFiniteFinding | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.finding is None:
            tensor = _first_tensor(out)
            inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                ranges = [
                    (t.float().min().item(), t.float().max().item()) if t.is_floating_point() and t.numel() else None
                    for t in inputs
                ]
                finite_inputs = all(bool(torch.isfinite(t).all()) for t in inputs if t.is_floating_point())
                self.finding = NonFiniteFinding(self.current_module(), str(func.overloadpacket.__name__),
                                                self.phase(), ranges, finite_inputs)
        return out


def find_nonfinite(
    model: nn.Module,
    inputs: Any,
    policy: Policy | None = None,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    backward: bool = True,
) -> NonFiniteFinding | None:
    """Run the forward (and backward) under ``policy``; name the first op that makes inf/NaN.

    The first op in execution order whose output is non-finite is where the trouble
    starts: either it overflowed on finite inputs (``finite_inputs``), or it read a
    weight, buffer or model input that already held inf/NaN.

    Returns:
        A NonFiniteFinding, or None when everything stayed finite.

    Note:
        Checks every op's output on the device: slow, for debugging only.
    """
    loss_fn = loss_fn or _default_loss
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    names = {module: name or "(model)" for name, module in model.named_modules()}
    stack: list[str] = []
    phase = ["forward"]

    def enter(module: nn.Module, _: Any) -> None:
        stack.append(names[module])

    def leave(module: nn.Module, _: Any, __: Any) -> None:
        stack.pop()

    pre = [m.register_forward_pre_hook(enter) for m in model.modules()]
    post = [m.register_forward_hook(leave, always_call=True) for m in model.modules()]
    mode = _FirstNonFinite(lambda: stack[-1] if stack else "(model)", lambda: phase[0])
    saved_grads = {p: p.grad for p in model.parameters()}
    try:
        with mode:
            with autocast(policy) if policy is not None else torch.autocast("cpu", enabled=False):
                output = model(*args)
                loss = loss_fn(_first_tensor(output), target)
            if backward and mode.finding is None and loss.requires_grad:
                phase[0] = "backward"
                loss.backward()
    finally:
        for handle in pre + post:
            handle.remove()
        for p, grad in saved_grads.items():
            p.grad = grad
    return mode.finding


def write_histogram(report: NumericsReport, path: Any) -> None:
    """The log2|activation gradient| histogram with float16's representable range marked
    (the figure of Micikevicius et al., 2018, that shows why loss scaling is needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ampkit.experiment.report import atomic_write

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
