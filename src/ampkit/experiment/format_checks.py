"""The checks ``plan`` makes of a comparison's narrow formats before anything runs: a model with a linear FP8 or a
block-scaled recipe can take, torchao where a setting needs it, a precision plan made for this model (at the
comparison's size: ``experiment/sizing.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ampkit.experiment import data as data_mod
from ampkit.experiment.config import BLOCK_RECIPES, CONTEXT
from ampkit.experiment.models import build
from ampkit.experiment.sizing import model_kwargs
from ampkit.formats.block_linear import eligible_block_scaled
from ampkit.formats.fp8 import eligible
from ampkit.planning.precision_plan import PrecisionPlan, fingerprint


def _built(model: str, data: str, size: str) -> nn.Module:
    """``model`` as the comparison's runs build it: fitted to ``data``, at ``size``."""
    return build(model, **data_mod.load(data).model_kwargs(CONTEXT), **model_kwargs(model, size))


def check_fp8(model: str, data: str, size: str, precisions: list[str]) -> None:
    """Refuse an fp8 setting before training when the model has no linear FP8 can take, or torchao is missing."""
    if "fp8-current" in precisions:
        try:
            import torchao.float8  # noqa: F401
        except ImportError as error:
            raise ValueError("precisions=['fp8-current'] runs on torchao's float8 training, which is not installed: "
                             "pip install 'ampkit[fp8]', or use precisions=['fp8'] (delayed scaling, ampkit's own).") \
                from error
    decisions = eligible(_built(model, data, size))
    if "fp8" not in decisions.values():
        found = "; ".join(f"{name}: {why}" for name, why in decisions.items()) or "it has no nn.Linear"
        raise ValueError(f"precisions={[precisions[0]]!r}: {model} has no linear FP8 can take ({found}). FP8 keeps the "
                         "first and last linears and those whose dimensions are not multiples of 16 in 16 bits; "
                         "try model='gpt' or 'mlp'.")


def check_block_scaled(model: str, data: str, size: str, precision: str) -> None:
    """Refuse a block-scaled setting before training when the model has no linear its recipe can take."""
    recipe = BLOCK_RECIPES[precision]
    decisions = eligible_block_scaled(_built(model, data, size), recipe)
    if "block-scaled" not in decisions.values():
        found = "; ".join(f"{name}: {why}" for name, why in decisions.items()) or "it has no nn.Linear"
        raise ValueError(f"precisions={[precision]!r}: {model} has no linear {recipe.label} can take ({found}); "
                         "try model='gpt'.")


def check_plan(model: str, data: str, size: str, path: str, opt_levels: Sequence[str] | None) -> PrecisionPlan:
    """The plan at ``path``, made for ``model`` (its linears' fingerprint), O1 in ``opt_levels``; else why not."""
    if opt_levels is not None and "O1" not in opt_levels:
        raise ValueError(f"precision_plan with opt_levels={list(opt_levels)!r}: the tuned run trains at O1, as tune "
                         "measured it. Add 'O1' to the opt levels (--opt-level O1 ...), or leave them out.")
    tuned = PrecisionPlan.load(path)
    built = _built(model, data, size)
    if fingerprint(built) != tuned.fingerprint:
        raise ValueError(f"precision_plan={str(path)!r} was made for another model ({tuned.model}); model={model!r} "
                         f"has other linears: make a plan for it with `ampkit tune --model {model}`.")
    return tuned


def lowest(tuned: PrecisionPlan) -> str:
    """The narrowest format the plan lowers a linear to (or tried, where it lowered none)."""
    used = set(tuned.lowered().values()) or {f for layer in tuned.layers for f in layer.loss_change}
    return min(used or {"fp8"}, key=lambda f: (f not in ("mxfp4", "nvfp4"), f))
