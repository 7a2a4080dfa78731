"""Distributed mixed precision: 16-bit gradient compression (compression.py), the DDP hook,
DistributedOptimizer for models not wrapped in DDP (optimizer.py), and FSDP2 at ampkit's opt levels
(fsdp.py, units.py) with sharded checkpoints (sharded_checkpoint.py).

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
from ampkit.distributed.fsdp import Sharding, fully_shard, precompute_fp8_scales, prepare_optimizer, sharding
from ampkit.distributed.launch import init_from_env
from ampkit.distributed.optimizer import DistributedOptimizer
from ampkit.distributed.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

__all__ = [
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "HookState",
    "ReductionOverflowWarning",
    "Sharding",
    "check_compression",
    "compression_hook",
    "fully_shard",
    "init_from_env",
    "load_sharded_checkpoint",
    "precompute_fp8_scales",
    "predivide",
    "prepare_optimizer",
    "reduce_",
    "save_sharded_checkpoint",
    "sharding",
]
