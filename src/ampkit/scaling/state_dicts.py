"""Loss scaler state: ScalerStats, and state dicts (the version, the checks before a load, GradScaler's translated).

Pure functions of dicts; ``DynamicLossScaler.load_state_dict`` calls ``checked_state``
before it changes anything, so a failed load leaves the scaler as it was.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ampkit.scaling.rules import ScaleRule

STATE_VERSION = 1
COUNTERS = ("growth_tracker", "hysteresis_left", "steps", "skipped", "overflows", "updates", "min_scale_overflows")


@dataclasses.dataclass(frozen=True)
class ScalerStats:
    """What a scaler has done so far.

    Attributes:
        steps: optimizer steps taken.
        skipped: steps skipped because a gradient was inf/NaN.
        overflows: updates that saw an overflow (a skipped step, or a tolerated one).
        scale: the current loss scale.
        history: the last 1000 updates as (update index, scale used, skipped).
        enabled: False for a disabled scaler (``enabled=False``, as for bfloat16): it steps every time, scales
            nothing, and its ``steps`` count the steps it passed through.
    """

    steps: int
    skipped: int
    overflows: int
    scale: float
    history: tuple[tuple[int, float, bool], ...]
    enabled: bool = True


def check_scale(scale: object, rule: ScaleRule, name: str) -> None:
    """A loss scale must be a finite number in [min_scale, max_scale]; ValueError otherwise."""
    ok = isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
    if not ok or not rule.min_scale <= scale <= rule.max_scale:  # type: ignore[operator]
        raise ValueError(
            f"{name}={scale!r} is outside [min_scale, max_scale] = [{rule.min_scale}, {rule.max_scale}]: "
            "use a finite scale in that range (or change the bounds)."
        )


# What a torch.amp.GradScaler state dict holds that ampkit reads, and its type.
_GRAD_SCALER_KEYS: dict[str, type] = {"scale": float, "_growth_tracker": int, "growth_factor": float,
                                      "backoff_factor": float, "growth_interval": int}


def from_grad_scaler(state: dict[str, Any], rule: ScaleRule) -> dict[str, Any]:
    """Translate a torch.amp.GradScaler state dict (counters start at 0).

    Raises:
        RuntimeError: a key GradScaler's state dicts have is missing, or not a number (named).
    """
    missing = sorted(set(_GRAD_SCALER_KEYS) - set(state))
    if missing:
        raise RuntimeError(f"Cannot load torch.amp.GradScaler state: missing keys {missing}. Pass the dict from "
                           "GradScaler.state_dict() as it is, or DynamicLossScaler.state_dict().")
    numbers: dict[str, float | int] = {}
    for key, kind in _GRAD_SCALER_KEYS.items():
        value = state[key]
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not whole):
            what = "a whole number" if kind is int else "a number"
            raise RuntimeError(f"Cannot load torch.amp.GradScaler state: {key}={value!r} is not {what}. Pass the "
                               "dict from GradScaler.state_dict() as it is.")
        numbers[key] = kind(value)  # ScaleRule and the counter checks that follow judge the values
    return {
        "version": STATE_VERSION,
        "scale": numbers["scale"],
        "growth_tracker": numbers["_growth_tracker"],
        "hysteresis_left": 1,
        **dataclasses.asdict(rule),
        "growth_factor": numbers["growth_factor"],
        "backoff_factor": numbers["backoff_factor"],
        "growth_interval": numbers["growth_interval"],
        "hysteresis": 1,
        "steps": 0,
        "skipped": 0,
        "overflows": 0,
        "updates": 0,
        "min_scale_overflows": 0,
    }


def checked_state(state_dict: Any, rule: ScaleRule, required: set[str]) -> tuple[ScaleRule, dict[str, Any]]:
    """The rule and the counters (and ``"scale"``) of a scaler state dict, checked.

    Accepts ``DynamicLossScaler.state_dict()`` and torch.amp.GradScaler's (translated with
    ``rule`` for what it lacks).

    Raises:
        RuntimeError: not a dict, missing keys (named), another version, or a bad value.
    """
    if "_growth_tracker" in state_dict and "version" not in state_dict:  # torch.amp.GradScaler
        state_dict = from_grad_scaler(state_dict, rule)
    missing = sorted(required - set(state_dict))
    if missing:
        raise RuntimeError(
            f"Cannot load loss scaler state: missing keys {missing}. Pass the dict from "
            "DynamicLossScaler.state_dict() or torch.amp.GradScaler.state_dict()."
        )
    if state_dict["version"] != STATE_VERSION:
        raise RuntimeError(
            f"Loss scaler state version {state_dict['version']!r} is not {STATE_VERSION!r}: this ampkit reads "
            f"version {STATE_VERSION} state dicts."
        )
    try:
        rule = ScaleRule(**{f.name: state_dict[f.name] for f in dataclasses.fields(ScaleRule)})
        check_scale(state_dict["scale"], rule, "scale")
        counters = {key: state_dict[key] for key in COUNTERS}
        for key, value in counters.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "hysteresis_left" else 0):
                raise ValueError(f"{key}={value!r} is invalid: use an integer >= "
                                 f"{1 if key == 'hysteresis_left' else 0}")
        if counters["hysteresis_left"] > rule.hysteresis:  # overflows still tolerated: at most the rule's
            raise ValueError(f"hysteresis_left={counters['hysteresis_left']} is more than hysteresis={rule.hysteresis}"
                             " allows")
        if counters["growth_tracker"] >= rule.growth_interval:  # the scale grows when it reaches the interval
            raise ValueError(f"growth_tracker={counters['growth_tracker']} is not below growth_interval="
                             f"{rule.growth_interval}")
    except ValueError as error:
        raise RuntimeError(f"Cannot load loss scaler state: {error}") from error
    return rule, {**counters, "scale": float(state_dict["scale"])}
