"""What the guard reads each step, as one host read, agreed over the ranks of a sharded or data-parallel run.

Every rank must take the same action: a rank skipping a step the others take leaves FSDP2's shards (or DDP's
replicas) out of step. So the figures a verdict rests on are reduced before anything is judged: the loss (the mean
over the ranks: a non-finite loss on one rank is non-finite in the sum), the gradients' sum (of each rank's local
shards), which ranks' batches hold an inf or a NaN, and on a sampled step each layer's figures (their maximum over
the ranks). One all-reduce a step (two on a sampled one); without a group, none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ampkit import _trees
from ampkit.shards import local_shard


def nonfinite_batch(batch: Any) -> int | None:
    """The index of the first floating tensor of ``batch`` (through containers) holding an inf or a NaN, else None."""
    leaves = [t for t in _trees.leaves(batch) if isinstance(t, torch.Tensor)]
    for index, tensor in enumerate(leaves):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return index
    return None


def gradient_sum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of the gradients of ``params`` in float32, each summed where it lies (this rank's shard of an FSDP2
    gradient: no collective per tensor, no float32 copy of a 16-bit one); inf or NaN where any value is."""
    grads = [local_shard(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum()


class Agreement:
    """The reductions of one guard: over ``group``'s ranks, or none (``group`` None)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    def verdict(self, loss: torch.Tensor, grads: torch.Tensor | None, batch: Any) -> tuple[float, float, list[int]]:
        """(the loss's mean over the ranks, the gradients' sum over them, the ranks whose batch is not finite);
        one host read. ``grads`` None: not checked (0)."""
        device = loss.device
        flags = torch.zeros(self.world, device=device, dtype=torch.float64)
        if self.group is not None and nonfinite_batch(batch) is not None:
            flags[self.rank] = 1.0
        figures = torch.cat([torch.stack([loss.detach().double().reshape(()),
                                          grads.to(device).double() if grads is not None
                                          else torch.zeros((), device=device, dtype=torch.float64)]), flags])
        if self.group is not None:
            dist.all_reduce(figures, group=self.group)
        total, gradient, *ranks = figures.tolist()
        return total / self.world, gradient, [r for r, bad in enumerate(ranks) if bad]

    def layers(self, sampled: tuple[list[str], torch.Tensor | None]) -> dict[str, tuple[float, float, float]]:
        """Each layer's figures (``LayerWatch.take``: sorted names, a row each), their maximum over the ranks (every
        rank samples the same layers); one host read."""
        names, table = sampled
        if table is None:
            return {}
        if self.group is not None:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        return {name: tuple(v) for name, v in zip(names, table.tolist())}  # type: ignore[misc]
