"""ampkit: mixed precision training for PyTorch."""

from __future__ import annotations

# Casting
from ampkit.hardware.advice import recommend_dtype
from ampkit.hardware.flags import SlowPrecisionWarning
from ampkit.modes import ComputeModeWarning
from ampkit.precision.custom_functions import custom_bwd, custom_fwd
from ampkit.precision.policy import ModuleOverride, Policy
from ampkit.precision.regions import autocast

# Loss scaling and master weights
from ampkit.checkpoint import load_checkpoint, save_checkpoint
from ampkit.optim.levels import initialize
from ampkit.optim.master import MasterWeightOptimizer
from ampkit.optim.pure16 import StochasticRoundingOptimizer, pure16_optimizer, stochastic_round
from ampkit.scaling.adaptive import AdaptiveLossScaler, LayerScaleStats
from ampkit.scaling.scaler import DynamicLossScaler, NonFiniteError, StaticLossScaler
from ampkit.scaling.state_dicts import ScalerStats

# FP8 and block-scaled formats
from ampkit.formats.block_linear import BlockScaledLinear, convert_to_block_scaled
from ampkit.formats.block_scaled import fake_quantize
from ampkit.formats.fp8 import convert_to_fp8
from ampkit.formats.recipes import BlockScaledRecipe, Fp8Recipe

# Measurement
from ampkit.diagnostics.alignment import check_alignment, pad_vocab
from ampkit.diagnostics.memory import estimate_memory, measured_state_bytes
from ampkit.diagnostics.nonfinite import find_nonfinite
from ampkit.diagnostics.numerics import inspect_numerics
from ampkit.hardware.advice import recommend
from ampkit.hardware.throughput import measure

# Planning
from ampkit.planning.precision_plan import LayerChoice, PrecisionPlan
from ampkit.planning.recompute import RecomputePlan, plan_recompute
from ampkit.planning.tune import tune

# Distributed: ampkit.distributed (imported on use: it needs torch.distributed)

# Before the subpackages the README documented ``ampkit.memory.measured_state_bytes``: it keeps working.
from ampkit.diagnostics import memory  # noqa: E402, F401

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
    # FP8 and block-scaled formats
    "Fp8Recipe",
    "convert_to_fp8",
    "BlockScaledRecipe",
    "BlockScaledLinear",
    "convert_to_block_scaled",
    "fake_quantize",
    # Measurement
    "inspect_numerics",
    "find_nonfinite",
    "estimate_memory",
    "measured_state_bytes",
    "check_alignment",
    "pad_vocab",
    "recommend",
    "measure",
    # Planning
    "plan_recompute",
    "RecomputePlan",
    "tune",
    "PrecisionPlan",
    "LayerChoice",
]
