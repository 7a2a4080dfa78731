"""float32_departure: a batch's loss under a precision region and in float32, and the module whose output departs
from its float32 output most beyond its input's departure.

A loss spike that float32 does not reproduce on the same batch and weights is the precision's: somewhere a 16-bit
op lost what float32 keeps. Errors carry downstream (every module after the culprit departs as much), so the
culprit is the module whose output's relative error most exceeds its input's: where the departure starts. A spike
float32 reproduces is the batch's or the update's, not the precision's.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.diagnostics.numerics import default_loss, first_tensor, output_tensor, policy_region, probing
from ampkit.precision.policy import Policy


@dataclasses.dataclass(frozen=True)
class Departure:
    """A batch under a region against float32.

    Attributes:
        loss: the loss under the region.
        float32_loss: the same batch's loss in float32 (the same weights).
        module: the module whose output departs from float32's most beyond its input's departure (None: no module
            departs beyond its input).
        jump: that module's output's relative error less its input's.
    """

    loss: float
    float32_loss: float
    module: str | None
    jump: float


def float32_departure(model: nn.Module, inputs: Any, region: Policy | torch.autocast | None,
                      target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                      run: Callable[[nn.Module, Any], torch.Tensor] | None = None) -> Departure:
    """Run ``inputs`` through copies of ``model`` under ``region`` and in float32; compare each module's output.

    Args:
        model: a model whose weights are float32 (O1, or a float32 model under the loop's torch.autocast): the
            float32 run uses the same values. Its forward as ``initialize`` wrapped it is unwrapped in the float32
            copy (the region is what is compared).
        inputs, target, loss_fn, run: as ``find_nonfinite`` takes them.
        region: the ampkit policy, or the ``torch.autocast``, the step ran under.

    Raises:
        ValueError: a weight that is not float32 (a 16-bit model has no float32 run of the same values).
    """
    if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("float32_departure compares a float32 model's run under a region with its float32 run; this "
                         "model holds 16-bit weights (O2, O3), whose float32 run is of other values.")
    loss, outputs = _run(copy.deepcopy(model), inputs, region, target, loss_fn, run)
    high = copy.deepcopy(model)
    vars(high).pop("forward", None)  # initialize's wrapper holds its region: the float32 copy runs its class's forward
    float32_loss, references = _run(high, inputs, None, target, loss_fn, run)
    module, jump = None, 0.0
    for name, (given, made) in outputs.items():
        if name not in references:
            continue
        reference_in, reference_out = references[name]
        entered = _relative(given, reference_in) if given is not None and reference_in is not None else 0.0
        rise = _relative(made, reference_out) - entered
        if rise > jump:
            module, jump = name, rise
    return Departure(loss, float32_loss, module, jump)


def _run(model: nn.Module, inputs: Any, region: Policy | torch.autocast | None, target: Any,
         loss_fn: Callable[[Any, Any], torch.Tensor] | None, run: Callable[[nn.Module, Any], torch.Tensor] | None,
         ) -> tuple[float, dict[str, tuple[torch.Tensor | None, torch.Tensor]]]:
    """The loss, and each named module's first input and output (float32 copies) at its first call."""
    seen: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def keep(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            made = first_tensor(output)
            if name not in seen and made is not None:
                given = first_tensor(args)
                kept = given.detach().float().clone() if given is not None else None
                seen[name] = (kept, made.detach().float().clone())
        return hook

    handles = [module.register_forward_hook(keep(name)) for name, module in model.named_modules() if name]
    with probing(model, handles), torch.no_grad(), policy_region(model, region):
        if run is not None:
            loss = run(model, inputs)
        else:
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            loss = (loss_fn or default_loss)(output_tensor(model(*args)), target)
    return float(loss), seen


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``value``'s relative error against ``reference`` (norms; 0 where they differ in shape)."""
    if value.shape != reference.shape:
        return 0.0
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))
