"""Pure scaling math against torch's own kernels."""

from __future__ import annotations

import pytest
import torch

from ampkit.scaling import rules as scaling
from ampkit.scaling.rules import ScaleRule, ScaleState

INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, INF, -INF, NAN])
def test_unscale_and_check(dtype: torch.dtype, bad: float | None) -> None:
    grads = [torch.tensor([2.0, 4.0], dtype=dtype), torch.tensor([8.0], dtype=dtype)]
    if bad is not None:
        grads[1][0] = bad
    found = scaling.unscale_and_check_(grads, 0.5)
    assert set(found) == {torch.device("cpu")}
    assert (found[torch.device("cpu")].item() > 0) == (bad is not None)
    assert grads[0].tolist() == [1.0, 2.0]


def test_unscale_keeps_subnormal_float16_values() -> None:
    # 2**-20 is subnormal in float16 (< 2**-14) but representable: it must survive unscaling by 1.
    grads = [torch.tensor([2.0**-20], dtype=torch.float16)]
    scaling.unscale_and_check_(grads, 1.0)
    assert grads[0].item() == 2.0**-20


def test_unscale_groups_mixed_dtypes() -> None:
    grads = [torch.ones(3), torch.ones(3, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16)]
    found = scaling.unscale_and_check_(grads, 0.25)
    assert found[torch.device("cpu")].item() == 0
    assert all(g.float().eq(0.25).all() for g in grads)


def test_next_scale_backoff_growth_and_bounds() -> None:
    rule = ScaleRule(growth_interval=3, min_scale=1.0, max_scale=8.0)
    state = ScaleState(4.0, 0, 1)
    state = scaling.next_scale(state, True, rule)
    assert state == ScaleState(2.0, 0, 1)
    for _ in range(2):
        state = scaling.next_scale(state, False, rule)
    assert state.scale == 2.0 and state.growth_tracker == 2
    state = scaling.next_scale(state, False, rule)
    assert state == ScaleState(4.0, 0, 1)
    for _ in range(6):
        state = scaling.next_scale(state, False, rule)
    assert state.scale == 8.0  # capped at max_scale
    for _ in range(10):
        state = scaling.next_scale(state, True, rule)
    assert state.scale == 1.0  # floored at min_scale, never zero


def test_hysteresis_backs_off_after_n_overflows() -> None:
    rule = ScaleRule(hysteresis=3, growth_interval=100)
    state = ScaleState(1024.0, 0, 3)
    scales = []
    for _ in range(6):
        state = scaling.next_scale(state, True, rule)
        scales.append(state.scale)
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0]


def test_next_scale_matches_torch_amp_update_scale() -> None:
    rule = ScaleRule(growth_interval=2)
    pattern = [False, False, True, False, True, True, False, False, False, False]
    state = ScaleState(2.0**16)
    scale, tracker = torch.full((1,), 2.0**16), torch.zeros(1, dtype=torch.int32)
    for overflow in pattern:
        state = scaling.next_scale(state, overflow, rule)
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(overflow)), 2.0, 0.5, 2)
        assert (state.scale, state.growth_tracker) == (scale.item(), tracker.item())


@pytest.mark.parametrize(
    "kwargs, match",
    [({"growth_factor": 0.5}, "growth_factor=0.5"), ({"backoff_factor": 0.0}, "backoff_factor=0.0"),
     ({"hysteresis": 0}, "hysteresis=0"), ({"min_scale": 0.0}, "min_scale=0.0")],
)
def test_bad_rule_constants(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScaleRule(**kwargs)
