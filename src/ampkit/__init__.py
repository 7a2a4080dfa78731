"""ampkit: mixed precision training for PyTorch."""

from __future__ import annotations

# Casting
from ampkit.autocast import autocast, custom_bwd, custom_fwd
from ampkit.compute import ComputeModeWarning
from ampkit.hardware import SlowPrecisionWarning, recommend_dtype
from ampkit.policy import ModuleOverride, Policy

# Loss scaling and master weights
from ampkit.master import MasterWeightOptimizer, initialize
from ampkit.scaler import DynamicLossScaler, NonFiniteError, ScalerStats, StaticLossScaler
from ampkit.adaptive_scaler import AdaptiveLossScaler, LayerScaleStats
from ampkit.pure16 import StochasticRoundingOptimizer, pure16_optimizer, stochastic_round
from ampkit.checkpoint import load_checkpoint, save_checkpoint

# FP8
from ampkit.fp8 import Fp8Recipe, convert_to_fp8

# Measurement
from ampkit.alignment import check_alignment, pad_vocab
from ampkit.hardware import measure, recommend
from ampkit.memory import estimate_memory
from ampkit.numerics import find_nonfinite, inspect_numerics

# Distributed: ampkit.distributed (imported on use: it needs torch.distributed)

__version__ = "0.1.0"

__all__ = [
    # Casting
    "Policy",
    "ModuleOverride",
    "autocast",
    "custom_fwd",
    "custom_bwd",
    "SlowPrecisionWarning",
    "ComputeModeWarning",
    "recommend_dtype",
    # Loss scaling and master weights
    "DynamicLossScaler",
    "StaticLossScaler",
    "AdaptiveLossScaler",
    "LayerScaleStats",
    "ScalerStats",
    "NonFiniteError",
    "MasterWeightOptimizer",
    "pure16_optimizer",
    "StochasticRoundingOptimizer",
    "stochastic_round",
    "initialize",
    "save_checkpoint",
    "load_checkpoint",
    # FP8
    "Fp8Recipe",
    "convert_to_fp8",
    # Measurement
    "inspect_numerics",
    "find_nonfinite",
    "estimate_memory",
    "check_alignment",
    "pad_vocab",
    "recommend",
    "measure",
]
