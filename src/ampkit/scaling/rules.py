"""Loss-scaling math: unscale-and-check, and the next-scale rule.

Small functions of tensors and plain numbers with no globals; the scaler
classes in ``scaler.py`` hold the state and sequence the calls. Of ampkit this
module imports only the torch shim (``ampkit._torch``, for GradScaler's fused unscale) and
``ampkit.shards`` (an FSDP2 gradient is checked on this rank's shard).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from ampkit import _torch, _torch_tensors
from ampkit.shards import local_shard


def unscale_and_check_(grads: Iterable[torch.Tensor], inv_scale: float) -> dict[torch.device, torch.Tensor]:
    """Multiply ``grads`` by ``inv_scale`` in place and look for inf/NaN.

    Uses torch's fused multi-tensor kernel, one launch per (device, dtype)
    group; float32, float16 and bfloat16 gradients alike (torch's GradScaler
    refuses float16 gradients; the kernel itself handles them). A sparse
    gradient's values are unscaled where they are, coalesced or not (a float16
    one should be coalesced first, so that duplicate indices that overflow only
    once added up are seen: the scaler does that).

    Args:
        grads: gradient tensors, on any devices and floating dtypes.
        inv_scale: the reciprocal of the loss scale.

    Returns:
        A one-element float32 tensor per device, > 0 where a non-finite value
        was found. Nothing is synced with the device.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        grad = local_shard(grad)  # an FSDP2 gradient: this rank's shard, checked here, agreed on by the scaler
        if grad.is_sparse:
            grad = _torch_tensors.sparse_values(grad)
        groups[(grad.device, grad.dtype)].append(grad)
    found: dict[torch.device, torch.Tensor] = {}
    inv: dict[torch.device, torch.Tensor] = {}
    for (device, _), tensors in groups.items():
        if device not in found:
            found[device] = torch.zeros(1, dtype=torch.float32, device=device)
            inv[device] = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        _torch.amp_unscale_(tensors, found[device], inv[device])
    return found


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """The constants of dynamic loss scaling.

    Args:
        growth_factor: scale multiplier after ``growth_interval`` clean steps.
        backoff_factor: scale multiplier on back-off.
        growth_interval: clean steps in a row before growing.
        hysteresis: overflowing steps tolerated (since the last back-off or growth)
            before backing off; 1 backs off on every overflow, as torch's GradScaler.
        min_scale / max_scale: bounds of the scale.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        def finite(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        def integer(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        # In order, each check evaluated only once the ones before passed (min_scale is compared with a
        # max_scale already known to be a number).
        checks: list[tuple[Callable[[], bool], str, str]] = [
            (lambda: finite(self.growth_factor) and self.growth_factor >= 1.0, "growth_factor",
             "a finite number >= 1.0"),
            (lambda: finite(self.backoff_factor) and 0.0 < self.backoff_factor <= 1.0, "backoff_factor",
             "a number in (0, 1]"),
            (lambda: integer(self.growth_interval) and self.growth_interval >= 1, "growth_interval", "an integer >= 1"),
            (lambda: integer(self.hysteresis) and self.hysteresis >= 1, "hysteresis", "an integer >= 1"),
            (lambda: finite(self.max_scale) and self.max_scale > 0, "max_scale", "a finite number > 0"),
            (lambda: finite(self.min_scale) and 0.0 < self.min_scale <= self.max_scale, "min_scale",
             "a finite number in (0, max_scale]"),
        ]
        for ok, name, valid in checks:
            if not ok():
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use {valid}.")


@dataclasses.dataclass(frozen=True)
class ScaleState:
    """Where dynamic scaling stands: the scale and its two counters."""

    scale: float
    growth_tracker: int = 0  # clean steps since the last change
    hysteresis_left: int = 1  # overflows still tolerated before a back-off


def next_scale(state: ScaleState, found_inf: bool, rule: ScaleRule) -> ScaleState:
    """The scale state after one step that did (``found_inf``) or did not overflow.

    Equals torch's ``_amp_update_scale_`` when ``hysteresis == 1`` and the bounds
    are not reached: overflow -> scale * backoff_factor and tracker reset; a
    clean step -> tracker + 1, and at ``growth_interval`` scale * growth_factor.
    """
    if found_inf:
        if state.hysteresis_left > 1:
            return dataclasses.replace(state, growth_tracker=0, hysteresis_left=state.hysteresis_left - 1)
        scale = max(state.scale * rule.backoff_factor, rule.min_scale)
        return ScaleState(scale, 0, rule.hysteresis)
    tracker = state.growth_tracker + 1
    if tracker >= rule.growth_interval:
        return ScaleState(min(state.scale * rule.growth_factor, rule.max_scale), 0, rule.hysteresis)
    return dataclasses.replace(state, growth_tracker=tracker)


def total(found: list[torch.Tensor]) -> torch.Tensor:
    """Sum one-element tensors on the first one's device (a device copy: no host sync)."""
    if not found:
        return torch.zeros(())
    device = found[0].device
    return torch.stack([f.to(device).reshape(()) for f in found]).sum()
