"""Activation checkpointing inside a region recomputes under the region's policy.

torch.utils.checkpoint recomputes a segment during backward, after the region has
exited; it restores torch.autocast's state but cannot know ampkit's.

Why not the public route. ``checkpoint(fn, use_reentrant=False, context_fn=...)`` runs a
recompute context a caller passes, but it reaches only the callers who pass it, not a checkpoint inside a model's own code (a
``gradient_checkpointing`` flag), and ``use_reentrant=True`` refuses ``context_fn``
(``tests/test_checkpointing.py`` shows both). So ampkit wraps the segment function where
torch hands it over, in both modes: ``_torch.checkpoint_entry_points``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ampkit import _torch
from ampkit.precision import op_lists
from ampkit.precision.kernels import kernel_ops, registry
from ampkit.precision.policy import Policy
from ampkit.precision.state import current_policy, current_region, warn_once

# Activation checkpointing

# Enters a region for a policy and the model its overrides name: ampkit.autocast, handed over by regions.py (which
# imports this module, so it cannot be imported here).
EnterRegion = Callable[..., contextlib.AbstractContextManager[Any]]

_lock = threading.Lock()
_count = 0  # the open regions that need the replacements
_installed: tuple[Any, Any] | None = None  # (torch's, ampkit's) entry points while replaced


def _reentering(fn: Callable[..., Any], enter: EnterRegion) -> Callable[..., Any]:
    """``fn``, re-entering the calling thread's ampkit regions in force at the forward when it runs outside them
    (a recompute in a backward after the region closed)."""
    regions = [region for region in map(current_region, op_lists.DEVICE_TYPES) if region is not None]
    policies = [region.policy for region in regions if region.policy is not None]
    if not policies:  # no region, or one under a plain torch.autocast of its own: torch's own recompute is right
        return fn
    models = [region.model for region in regions if region.policy is not None]

    @functools.wraps(fn)
    def recompute(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for policy, model in zip(policies, models):
                # In the forward, and in a backward inside the region, the policy is in force already.
                if current_policy(policy.device_type) is not policy:
                    stack.enter_context(enter(policy, model=model))
            return fn(*args, **kwargs)

    if not torch.compiler.is_dynamo_compiling():
        # The recompute re-enters the region in the backward, after the forward's region closed: the region's
        # dispatcher kernels stay registered until torch drops the segment (with its graph), not released and
        # registered again per segment (with float32 compute's 37 ops, a backward of small blocks took far longer).
        for policy, region in zip(policies, regions):
            ops = kernel_ops(policy, region.float32_ops)
            registry.acquire(policy.device_type, ops)
            weakref.finalize(recompute, registry.release, policy.device_type, ops)
    return recompute


@functools.cache  # one class per process: torch's entry points and ``enter`` are the same at every region
def _replacements(original: Any, generator: Any, enter: EnterRegion) -> tuple[Any, Any]:
    def without_reentrant(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
        yield from generator(_reentering(fn, enter), *args, **kwargs)

    class CheckpointFunction(original):  # type: ignore[misc, valid-type]
        @staticmethod
        def forward(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            return original.forward(ctx, _reentering(run_function, enter), preserve_rng_state, *args)

    return CheckpointFunction, without_reentrant


def acquire(enter: EnterRegion) -> None:
    """Make torch.utils.checkpoint (both modes) recompute under the policy of its forward, re-entered with
    ``enter(policy)``, while a region that needs it is open (``release`` undoes it after the last one).

    Wraps the segment function where torch's checkpoint hands it over: the reentrant ``CheckpointFunction`` and
    the non-reentrant generator, both looked up at call time, so ``from torch.utils.checkpoint import checkpoint``
    is covered too. The wrapped function is taken at the forward, inside the region, so a recompute in the
    backward, after the region exited, still re-enters it.
    """
    global _count, _installed
    with _lock:
        _count += 1
        if _count > 1:
            return
        found = _torch.checkpoint_entry_points()
        if found is None:
            warn_once("checkpoint", f"ampkit cannot hook torch.utils.checkpoint of torch {torch.__version__}: "
                      "checkpointed segments inside an edited or float32-compute region recompute without "
                      "its policy.")
            return
        ours = _replacements(*found, enter)
        _torch.replace_checkpoint_entry_points(*ours)
        _installed = (found, ours)


def release() -> None:
    """Put torch's entry points back after the last region that needed them, each unless someone else replaced ours
    since (theirs stays)."""
    global _count, _installed
    with _lock:
        _count -= 1
        if _count or _installed is None:
            return
        torch_own, ours = _installed
        _installed = None
        now = _torch.checkpoint_entry_points() or ours
        _torch.replace_checkpoint_entry_points(*(own if current is mine else current
                                                 for own, current, mine in zip(torch_own, now, ours)))
