"""Starting the process group from torchrun's environment.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialize the default process group from torchrun's environment.

    Args:
        backend: ``"nccl"`` or ``"gloo"`` (default: NCCL with CUDA, gloo otherwise).
        timeout_s: how long a collective may wait for the other ranks (default 300 s).

    Returns:
        (rank, world_size).
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
