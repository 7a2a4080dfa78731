"""ampkit: mixed precision training for PyTorch.

Names are imported on first use (PEP 562): ``import ampkit`` loads neither torch nor ampkit's modules, so
``ampkit --help`` and a script's start stay fast; ``ampkit.autocast`` imports what it needs when first read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Where each public name lives, in the groups of ``__all__``.
_WHERE: dict[str, str] = {
    # Casting
    "recommend_dtype": "ampkit.hardware.advice",
    "SlowPrecisionWarning": "ampkit.hardware.flags",
    "ComputeModeWarning": "ampkit.modes",
    "custom_bwd": "ampkit.precision.custom_functions",
    "custom_fwd": "ampkit.precision.custom_functions",
    "ModuleOverride": "ampkit.precision.policy",
    "Policy": "ampkit.precision.policy",
    "autocast": "ampkit.precision.regions",
    # Loss scaling and master weights
    "load_checkpoint": "ampkit.checkpoint",
    "save_checkpoint": "ampkit.checkpoint",
    "initialize": "ampkit.optim.levels",
    "MasterWeightOptimizer": "ampkit.optim.master",
    "StochasticRoundingOptimizer": "ampkit.optim.pure16",
    "pure16_optimizer": "ampkit.optim.pure16",
    "stochastic_round": "ampkit.optim.pure16",
    "AdaptiveLossScaler": "ampkit.scaling.adaptive",
    "LayerScaleStats": "ampkit.scaling.adaptive",
    "DynamicLossScaler": "ampkit.scaling.scaler",
    "NonFiniteError": "ampkit.scaling.scaler",
    "StaticLossScaler": "ampkit.scaling.scaler",
    "ScalerStats": "ampkit.scaling.state_dicts",
    # FP8 and block-scaled formats
    "BlockScaledLinear": "ampkit.formats.block_linear",
    "convert_to_block_scaled": "ampkit.formats.block_linear",
    "fake_quantize": "ampkit.formats.block_scaled",
    "convert_to_fp8": "ampkit.formats.fp8",
    "BlockScaledRecipe": "ampkit.formats.recipes",
    "Fp8Recipe": "ampkit.formats.recipes",
    # Measurement
    "check_alignment": "ampkit.diagnostics.alignment",
    "pad_vocab": "ampkit.diagnostics.alignment",
    "estimate_memory": "ampkit.diagnostics.memory",
    "measured_state_bytes": "ampkit.diagnostics.memory",
    "find_nonfinite": "ampkit.diagnostics.nonfinite",
    "inspect_numerics": "ampkit.diagnostics.numerics",
    "recommend": "ampkit.hardware.advice",
    "measure": "ampkit.hardware.throughput",
    # Planning
    "LayerChoice": "ampkit.planning.precision_plan",
    "PrecisionPlan": "ampkit.planning.precision_plan",
    "RecomputePlan": "ampkit.planning.recompute",
    "plan_recompute": "ampkit.planning.recompute",
    "tune": "ampkit.planning.tune",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from ampkit.hardware.advice import recommend_dtype
    from ampkit.hardware.flags import SlowPrecisionWarning
    from ampkit.modes import ComputeModeWarning
    from ampkit.precision.custom_functions import custom_bwd, custom_fwd
    from ampkit.precision.policy import ModuleOverride, Policy
    from ampkit.precision.regions import autocast
    from ampkit.checkpoint import load_checkpoint, save_checkpoint
    from ampkit.optim.levels import initialize
    from ampkit.optim.master import MasterWeightOptimizer
    from ampkit.optim.pure16 import StochasticRoundingOptimizer, pure16_optimizer, stochastic_round
    from ampkit.scaling.adaptive import AdaptiveLossScaler, LayerScaleStats
    from ampkit.scaling.scaler import DynamicLossScaler, NonFiniteError, StaticLossScaler
    from ampkit.scaling.state_dicts import ScalerStats
    from ampkit.formats.block_linear import BlockScaledLinear, convert_to_block_scaled
    from ampkit.formats.block_scaled import fake_quantize
    from ampkit.formats.fp8 import convert_to_fp8
    from ampkit.formats.recipes import BlockScaledRecipe, Fp8Recipe
    from ampkit.diagnostics.alignment import check_alignment, pad_vocab
    from ampkit.diagnostics.memory import estimate_memory, measured_state_bytes
    from ampkit.diagnostics.nonfinite import find_nonfinite
    from ampkit.diagnostics.numerics import inspect_numerics
    from ampkit.hardware.advice import recommend
    from ampkit.hardware.throughput import measure
    from ampkit.planning.precision_plan import LayerChoice, PrecisionPlan
    from ampkit.planning.recompute import RecomputePlan, plan_recompute
    from ampkit.planning.tune import tune


def __getattr__(name: str) -> Any:
    """A public name, or a subpackage (``ampkit.distributed``; ``ampkit.memory``, the README's name before the
    subpackages, is ``ampkit.diagnostics.memory``), imported on first use and kept."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name == "memory":
        value = importlib.import_module("ampkit.diagnostics.memory")
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])

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
