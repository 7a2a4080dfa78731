"""Distributed mixed precision: 16-bit gradient compression (compression.py), the DDP hook, and
DistributedOptimizer for models not wrapped in DDP (optimizer.py).

Imported on use (``import ampkit.distributed``): it needs torch.distributed.
"""

from __future__ import annotations

from ampkit.distributed.compression import (
    Compression,
    Compressor,
    HookState,
    ReductionOverflowWarning,
    check_compression,
    compression_hook,
    predivide,
    reduce_,
)
from ampkit.distributed.launch import init_from_env
from ampkit.distributed.optimizer import DistributedOptimizer

__all__ = [
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "HookState",
    "ReductionOverflowWarning",
    "check_compression",
    "compression_hook",
    "init_from_env",
    "predivide",
    "reduce_",
]
