"""ampkit: mixed precision training for PyTorch.

Names are imported on first use (PEP 562): ``import ampkit`` loads neither torch nor ampkit's modules, so
``ampkit --help`` and a script's start stay fast; ``ampkit.autocast`` imports what it needs when first read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name (``__all__``, in the groups the API reference shows) and the module it lives in.
_WHERE: dict[str, str] = {
    # Casting
    "Policy": "ampkit.precision.policy",
    "ModuleOverride": "ampkit.precision.policy",
    "autocast": "ampkit.precision.regions",
    "custom_fwd": "ampkit.precision.custom_functions",
    "custom_bwd": "ampkit.precision.custom_functions",
    "checkpoint_context_fn": "ampkit.precision.checkpointing",
    "SlowPrecisionWarning": "ampkit.hardware.flags",
    "ComputeModeWarning": "ampkit.modes",
    "recommend_dtype": "ampkit.hardware.advice",
    # Loss scaling and master weights
    "DynamicLossScaler": "ampkit.scaling.scaler",
    "StaticLossScaler": "ampkit.scaling.scaler",
    "AdaptiveLossScaler": "ampkit.scaling.adaptive",
    "LayerScaleStats": "ampkit.scaling.adaptive",
    "ScalerStats": "ampkit.scaling.state_dicts",
    "NonFiniteError": "ampkit.scaling.scaler",
    "MasterWeightOptimizer": "ampkit.optim.master",
    "pure16_optimizer": "ampkit.optim.pure16",
    "StochasticRoundingOptimizer": "ampkit.optim.pure16",
    "stochastic_round": "ampkit.optim.pure16",
    "initialize": "ampkit.optim.levels",
    "save_checkpoint": "ampkit.checkpoint",
    "load_checkpoint": "ampkit.checkpoint",
    "Guard": "ampkit.guard",
    "GuardEvent": "ampkit.guard",
    "GuardStopped": "ampkit.guard",
    # FP8 and block-scaled formats
    "Fp8Recipe": "ampkit.formats.recipes",
    "convert_to_fp8": "ampkit.formats.fp8",
    "BlockScaledRecipe": "ampkit.formats.recipes",
    "BlockScaledLinear": "ampkit.formats.block_linear",
    "convert_to_block_scaled": "ampkit.formats.block_linear",
    "fake_quantize": "ampkit.formats.block_scaled",
    # Measurement
    "inspect_numerics": "ampkit.diagnostics.numerics",
    "find_nonfinite": "ampkit.diagnostics.nonfinite",
    "estimate_memory": "ampkit.diagnostics.memory",
    "measured_state_bytes": "ampkit.diagnostics.memory",
    "check_alignment": "ampkit.diagnostics.alignment",
    "pad_vocab": "ampkit.diagnostics.alignment",
    "recommend": "ampkit.hardware.advice",
    "measure": "ampkit.hardware.throughput",
    # Planning
    "plan_recompute": "ampkit.planning.recompute",
    "RecomputePlan": "ampkit.planning.recompute",
    "tune": "ampkit.planning.tune",
    "PrecisionPlan": "ampkit.planning.precision_plan",
    "LayerChoice": "ampkit.planning.precision_plan",
}

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly (``as``: re-exported)
    from ampkit.hardware.advice import recommend_dtype as recommend_dtype
    from ampkit.hardware.flags import SlowPrecisionWarning as SlowPrecisionWarning
    from ampkit.modes import ComputeModeWarning as ComputeModeWarning
    from ampkit.precision.checkpointing import checkpoint_context_fn as checkpoint_context_fn
    from ampkit.precision.custom_functions import custom_bwd as custom_bwd, custom_fwd as custom_fwd
    from ampkit.precision.policy import ModuleOverride as ModuleOverride, Policy as Policy
    from ampkit.precision.regions import autocast as autocast
    from ampkit.checkpoint import load_checkpoint as load_checkpoint, save_checkpoint as save_checkpoint
    from ampkit.guard import Guard as Guard, GuardEvent as GuardEvent, GuardStopped as GuardStopped
    from ampkit.optim.levels import initialize as initialize
    from ampkit.optim.master import MasterWeightOptimizer as MasterWeightOptimizer
    from ampkit.optim.pure16 import StochasticRoundingOptimizer as StochasticRoundingOptimizer
    from ampkit.optim.pure16 import pure16_optimizer as pure16_optimizer, stochastic_round as stochastic_round
    from ampkit.scaling.adaptive import AdaptiveLossScaler as AdaptiveLossScaler, LayerScaleStats as LayerScaleStats
    from ampkit.scaling.scaler import (
        DynamicLossScaler as DynamicLossScaler, NonFiniteError as NonFiniteError, StaticLossScaler as StaticLossScaler,
    )
    from ampkit.scaling.state_dicts import ScalerStats as ScalerStats
    from ampkit.formats.block_linear import (
        BlockScaledLinear as BlockScaledLinear, convert_to_block_scaled as convert_to_block_scaled,
    )
    from ampkit.formats.block_scaled import fake_quantize as fake_quantize
    from ampkit.formats.fp8 import convert_to_fp8 as convert_to_fp8
    from ampkit.formats.recipes import BlockScaledRecipe as BlockScaledRecipe, Fp8Recipe as Fp8Recipe
    from ampkit.diagnostics.alignment import check_alignment as check_alignment, pad_vocab as pad_vocab
    from ampkit.diagnostics.memory import (
        estimate_memory as estimate_memory, measured_state_bytes as measured_state_bytes,
    )
    from ampkit.diagnostics.nonfinite import find_nonfinite as find_nonfinite
    from ampkit.diagnostics.numerics import inspect_numerics as inspect_numerics
    from ampkit.hardware.advice import recommend as recommend
    from ampkit.hardware.throughput import measure as measure
    from ampkit.planning.precision_plan import LayerChoice as LayerChoice, PrecisionPlan as PrecisionPlan
    from ampkit.planning.recompute import RecomputePlan as RecomputePlan, plan_recompute as plan_recompute
    from ampkit.planning.tune import tune as tune


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

__all__ = list(_WHERE)
