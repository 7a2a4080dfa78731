"""custom_fwd / custom_bwd: custom autograd Functions whose backward runs under the forward's policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ampkit.precision.regions import autocast
from ampkit.precision.state import current_policy


def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    device_type: str,
    cast_inputs: torch.dtype | None = None,
) -> Callable[..., Any]:
    """Decorate an ``autograd.Function.forward`` for ampkit.autocast regions.

    torch.amp.custom_fwd plus the ampkit policy: the forward's policy is
    remembered so ``custom_bwd`` runs the backward under the same policy and
    autocast state, also when the backward runs after the region exited.

    Args:
        fwd: the ``forward`` staticmethod (omitted when used as ``@custom_fwd(device_type=...)``).
        device_type: ``"cpu"`` or ``"cuda"``.
        cast_inputs: if set, floating inputs are cast to it and the forward runs
            with autocast off (torch's semantics).

    Returns:
        The wrapped forward.
    """
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    torch_fwd = torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        # The policy, where the forward runs under autocast: with cast_inputs it runs with autocast off (torch's rule)
        used = cast_inputs is None and torch.is_autocast_enabled(device_type)
        ctx._ampkit_policy = current_policy(device_type) if used else None
        return torch_fwd(ctx, *args, **kwargs)

    return forward


def custom_bwd(bwd: Callable[..., Any] | None = None, *, device_type: str) -> Callable[..., Any]:
    """Decorate the matching ``backward``: it runs under its forward's policy.

    torch.amp.custom_bwd restores torch.autocast's state of the forward; this also re-enters the
    forward's ampkit region, so an edited policy applies in the backward too, which runs after the
    region has exited.

    Args:
        bwd: the ``backward`` staticmethod (omitted when used as ``@custom_bwd(device_type=...)``).
        device_type: ``"cpu"`` or ``"cuda"``, as given to ``custom_fwd``.

    Returns:
        The wrapped backward.
    """
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def under_policy(ctx: Any, *grads: Any) -> Any:
        policy = getattr(ctx, "_ampkit_policy", None)
        if policy is None:
            return bwd(ctx, *grads)
        # Inside torch's restored autocast state (the forward's), the forward's policy entered again: the
        # backward usually runs after its region has closed (its per-module overrides apply to forwards only).
        with autocast(policy.ops_only):
            return bwd(ctx, *grads)

    return torch.amp.custom_bwd(under_policy, device_type=device_type)
