"""The bridge to torchao: FP8 current scaling through ``torchao.float8``.

torchao's tensorwise and rowwise recipes match what ``Fp8Recipe(scaling="current")``
asks for, so ampkit configures them instead of rewriting them; torchao is an optional
extra (``ampkit[fp8]``), imported on first use.
"""

from __future__ import annotations

import sys

from torch import nn

from ampkit.formats.recipes import E4M3, GRAD, Fp8Recipe
from ampkit.shards import local_shard


def convert_current(model: nn.Module, recipe: Fp8Recipe, chosen: set[str], emulate: bool) -> None:
    """Current scaling through torchao's ``convert_to_float8_training`` (its tensorwise / rowwise recipes)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.config import CastConfig, ScalingGranularity
    except ImportError as error:
        raise ImportError("Fp8Recipe(scaling='current') runs on torchao's float8 training: pip install "
                          "'ampkit[fp8]' (or torchao), or use scaling='delayed', which is ampkit's own.") from error
    granularity = ScalingGranularity.AXISWISE if recipe.granularity == "row" else ScalingGranularity.TENSORWISE
    forward, backward = CastConfig(scaling_granularity=granularity, target_dtype=E4M3), CastConfig(
        scaling_granularity=granularity, target_dtype=recipe.dtype(GRAD))
    config = Float8LinearConfig(cast_config_input=forward, cast_config_weight=forward,
                                cast_config_grad_output=backward, emulate=emulate,
                                enable_fsdp_float8_all_gather=recipe.fsdp_all_gather)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is torchao's ``Float8Linear`` (what ``convert_current`` made); False where torchao was never
    imported (no module can be one then)."""
    if "torchao.float8" not in sys.modules:
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def precompute_fsdp_scales(model: nn.Module) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp``: every FP8-all-gathered weight's scale in
    one all-reduce; nothing for a model without them (or without torchao)."""
    try:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    except ImportError:
        return  # no torchao: no FP8 all-gathers either
    precompute_float8_dynamic_scale_for_fsdp(model)


def fp8_gathered(model: nn.Module) -> list[str]:
    """The names of ``model``'s weights that torchao all-gathers in FP8 (``Fp8Recipe(fsdp_all_gather=True)``);
    none where torchao was never imported (no model can hold its weights then, and importing it costs seconds)."""
    if "torchao" not in sys.modules:
        return []
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [name for name, p in model.named_parameters()
            if isinstance(local_shard(p), WeightWithDynamicFloat8CastTensor)]  # an FSDP2 shard's, too


def check_fp8_gathers(model: nn.Module, level: str, pure16: bool) -> None:
    """Refuse O3 on a model whose weights torchao all-gathers in FP8: torchao casts float32 weights to FP8 at the
    all-gather and cannot hold them in 16 bits (FSDP2 asserts on the mixed dtypes; in one process AdamW's first step
    raises on them)."""
    names = fp8_gathered(model) if pure16 else []
    if names:
        raise ValueError(f"opt_level={level!r} stores 16-bit weights, but {len(names)} weight(s) ({names[0]}, ...) "
                         "are converted with Fp8Recipe(fsdp_all_gather=True), whose FP8 all-gather casts float32 "
                         "weights. Use opt_level='O2' (float32 masters, 16-bit compute, FP8 all-gathers), or convert "
                         "with fsdp_all_gather=False.")
