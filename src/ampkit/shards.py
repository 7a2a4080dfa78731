"""FSDP2 shards as plain tensors: what elementwise code (unscaling, inf/NaN checks, optimizer updates,
byte counts) works on when a model's parameters and gradients are DTensors.

An elementwise operation on a sharded tensor is the same operation on each rank's local shard; doing it
there keeps DTensor's dispatch (and its implicit replication of one-element tensors) out of the way.
"""

from __future__ import annotations

import torch


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 parameter, gradient or optimizer state)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor (same storage: writes go through), else ``t``."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def shard_group(t: torch.Tensor) -> object | None:
    """The process group a DTensor is sharded over (its mesh's; the default group for a mesh of more than
    one dimension); None for a plain tensor."""
    if not is_sharded(t):
        return None
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return mesh.get_group() if mesh.ndim == 1 else torch.distributed.group.WORLD
