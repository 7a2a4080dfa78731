"""Activation checkpointing inside a region: recomputed under the region's policy through torch's ``context_fn``.

torch.utils.checkpoint recomputes a segment during backward, usually after the region has closed; it restores
torch.autocast's state for the recompute but cannot know ampkit's. ``checkpoint_context_fn`` is the public route
(issue 71's rule 4): pass it to a non-reentrant checkpoint,

    checkpoint(block, x, use_reentrant=False, context_fn=ampkit.checkpoint_context_fn)

and the recompute re-enters the regions in force at the forward (their policies, the models their overrides name),
the regions' dispatcher kernels held until torch drops the segment. torch.utils.checkpoint itself is not wrapped.

A checkpoint without it inside a region whose policy differs from torch.autocast's recomputes under torch.autocast's
lists: where that changes a saved tensor's dtype (an edited op, a module override), torch's own check of the
recomputed tensors raises a ``CheckpointError`` at the backward; float32 compute's GEMMs recompute in native 16-bit
arithmetic (the same dtypes, other roundings). A reentrant checkpoint takes no ``context_fn`` (torch refuses it): the
same holds there without torch's check. docs/policies.md says so, with the fix.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from ampkit import _torch
from ampkit.precision import op_lists
from ampkit.precision.kernels import registry
from ampkit.precision.state import current_policy, current_region

ContextFn = Callable[[], tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]]


class _Recompute:
    """The recompute's context: the forward's regions, re-entered where they are not in force (a recompute in a
    backward after the region closed; in the forward, and in a backward inside the region, they are). Holds the
    regions' kernels until torch drops it with the segment."""

    def __init__(self, inner: contextlib.AbstractContextManager[Any]) -> None:
        from ampkit.precision.regions import autocast  # regions.py imports kernels.py, as this module does

        self.inner, self.enter = inner, autocast
        regions = [r for r in map(current_region, op_lists.DEVICE_TYPES) if r is not None and r.policy is not None]
        self.regions = [(r.policy, r.model) for r in regions]
        self.stack = contextlib.ExitStack()
        for region in regions:
            ops = region.resolved.kernel_ops  # type: ignore[union-attr]
            registry.acquire(region.device_type, ops)
            weakref.finalize(self, registry.release, region.device_type, ops)

    def __enter__(self) -> None:
        for policy, model in self.regions:
            if current_policy(policy.device_type) is not policy:  # type: ignore[union-attr]
                self.stack.enter_context(self.enter(policy, model=model))
        self.stack.enter_context(self.inner)

    def __exit__(self, *exc: Any) -> None:
        self.stack.__exit__(*exc)


def checkpoint_context_fn(
    context_fn: ContextFn | None = None,
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the segment recomputes
    under the ampkit regions in force at its forward (policies, per-module overrides, float32 compute).

    Args:
        context_fn: another ``context_fn`` to run inside (torch's selective checkpointing's, for one):
            ``functools.partial(ampkit.checkpoint_context_fn, selective)``.

    Returns:
        (the forward's context, the recompute's), as torch's ``context_fn`` returns them.

    Examples:
        >>> with ampkit.autocast(policy, model=model):
        ...     h = checkpoint(model.block, x, use_reentrant=False, context_fn=ampkit.checkpoint_context_fn)
    """
    if _torch.is_compiling():  # traced: the graph holds the forward's casts, which its recompute repeats
        return context_fn() if context_fn is not None else _recompute_everything()
    forward, recompute = context_fn() if context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    return forward, _Recompute(recompute)


def _recompute_everything() -> tuple[Any, Any]:
    """What torch.compile takes from a ``context_fn`` (two dispatch modes, torch's selective checkpointing's) for a
    plain checkpoint: every op recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)
