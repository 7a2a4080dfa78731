"""Numerics inspection: planted overflows and NaNs are found where they were planted."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import matplotlib.image
import pytest
import torch
from torch import nn

import ampkit
from ampkit import Policy
from ampkit.diagnostics.nonfinite import find_nonfinite
from ampkit.diagnostics.numerics import RangeStats, inspect_numerics, write_histogram


def _planted_overflow() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[2].weight.mul_(1e5)  # pushes its activations past 65504
    return model


def test_range_stats_edge_values() -> None:
    values = torch.tensor([1e5, 1.0, 2.0**-20, 2.0**-26, 0.0, float("-inf")])
    stats = RangeStats.of(values)
    assert stats.max_abs == math.inf
    assert stats.fp16_overflow == pytest.approx(2 / 5)  # 1e5 and inf, of 5 nonzero values
    assert stats.fp16_subnormal == pytest.approx(1 / 5)  # 2^-20
    assert stats.fp16_zero == pytest.approx(1 / 5)  # 2^-26 < 2^-24
    assert stats.bf16_overflow == pytest.approx(1 / 5) and stats.bf16_zero == 0.0


def test_planted_overflow_is_named_and_bf16_recommended() -> None:
    report = inspect_numerics(_planted_overflow(), torch.randn(4, 8), torch.randint(0, 4, (4,)))
    assert [m.name for m in report.modules][:5] == ["0", "1", "2", "3", "4"]
    assert report.keep_float32[0] == "2"
    assert report.modules[2].activation.fp16_overflow > 0 and report.modules[0].activation.fp16_overflow == 0
    assert report.prefer_bf16
    assert any("2: activations exceed float16's 65504" in r for r in report.reasons)


def test_loss_scale_keeps_the_largest_gradient_under_half_of_fp16_max() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    report = inspect_numerics(model, torch.randn(16, 8) * 1e-3, torch.randn(16, 2) * 1e-6)
    scale = report.recommended_loss_scale
    largest = max(m.gradient.max_abs for m in report.modules if m.gradient is not None)
    assert scale is not None and math.log2(scale).is_integer()
    assert largest * scale <= 65504 / 2 < largest * scale * 2  # the largest power of two that fits
    assert report.fp16_zero_after_scaling <= report.fp16_zero_before_scaling


def test_inspection_leaves_gradients_alone() -> None:
    model = _planted_overflow()
    inspect_numerics(model, torch.randn(2, 8))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("compute", ["native", "float32"])
def test_find_nonfinite_names_the_overflowing_layer_under_fp16(compute: str) -> None:
    model, x = _planted_overflow(), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # native fp16 may be slow here; the tensors are tiny
        finding = find_nonfinite(model, x, Policy.default("cpu", torch.float16, compute=compute))
        assert find_nonfinite(model, x, Policy.default("cpu", torch.bfloat16, compute=compute)) is None  # range
    assert finding is not None
    assert (finding.module, finding.op, finding.phase, finding.finite_inputs) == ("2", "addmm", "forward", True)


def test_find_nonfinite_locates_a_planted_nan() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    with torch.no_grad():
        model[2][1].bias[0] = float("nan")
    finding = find_nonfinite(model, torch.randn(3, 8))
    assert finding is not None and finding.module == "2.1" and not finding.finite_inputs


def test_find_nonfinite_reads_through_an_fp8_linear() -> None:
    """An FP8 linear's casts make FP8 tensors, which torch's ``isfinite`` does not take: the guard's replay of an
    FP8 model with a bad value raised NotImplementedError. They are read in float32: the NaN planted after the FP8
    linear is found, named by its module."""
    from ampkit.formats.fp8 import Fp8Linear, Fp8Recipe

    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear.from_linear(nn.Linear(8, 8), Fp8Recipe()), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    finding = find_nonfinite(model, torch.randn(3, 8), Policy.default("cpu", torch.bfloat16, compute="native"))
    assert finding is not None and finding.module == "2" and not finding.finite_inputs


def test_histogram_png(tmp_path: Path) -> None:
    report = inspect_numerics(_planted_overflow(), torch.randn(4, 8), torch.randint(0, 4, (4,)))
    assert sum(report.log2_grad_hist.values()) > 0
    write_histogram(report, tmp_path / "h.png")
    assert matplotlib.image.imread(tmp_path / "h.png").shape[1] > 400


class _Spread(nn.Module):
    """Half the features scaled down by 1e-7: a range no single FP8 scale holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :32], x[:, 32:] * 1e-7], dim=1)


def _planted() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), _Spread(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def test_inspect_names_the_linear_fp8_would_lose_values_of() -> None:
    model = _planted()
    report = ampkit.inspect_numerics(model, torch.randn(16, 32), torch.randint(0, 10, (16,)),
                                     fp8=ampkit.Fp8Recipe())
    assert report.fp8_keep == ["2"]
    found = {m.name: m.fp8 for m in report.modules if m.fp8 is not None}
    assert sorted(found) == ["0", "2", "4"] and not any(f.delayed for f in found.values())
    planted = found["2"]
    assert planted.input.format == "E4M3" and planted.input.underflow == 0.5 and planted.input.overflow == 0.0
    assert planted.input.scale == pytest.approx(448.0 / planted.input.amax)  # current scaling's scale
    assert planted.gradient is not None and planted.gradient.format == "E5M2"
    assert found["0"].input.underflow == 0.0 and found["0"].weight.underflow == 0.0
    assert any(r.startswith("2: 50.0% of its inputs flush to zero in E4M3 (amax ") and
               "keep it out of FP8: convert_to_fp8(model, keep=['2'])" in r for r in report.reasons)
    plain = ampkit.inspect_numerics(model, torch.randn(16, 32), torch.randint(0, 10, (16,)))
    assert plain.fp8_keep == [] and all(m.fp8 is None for m in plain.modules)


def test_inspect_reports_a_delayed_scale_that_lags_and_leaves_it_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    ampkit.convert_to_fp8(model)
    model(torch.randn(16, 32) * 0.01).sum().backward()  # a step of small activations sets the delayed scales
    before = model[2].amax_history.clone(), model[2].scale.clone()
    report = ampkit.inspect_numerics(model, torch.randn(16, 32) * 100, torch.randint(0, 10, (16,)),
                                     fp8=ampkit.Fp8Recipe())
    cast = {m.name: m.fp8 for m in report.modules if m.fp8 is not None}["2"]
    assert cast.delayed and cast.input.scale == before[1][0].item() and cast.input.overflow > 0.5
    assert report.fp8_keep == ["2"] and any(
        r.startswith("2: ") and "are clamped at the largest value in E4M3" in r and "raise margin" in r
        for r in report.reasons)
    assert torch.equal(model[2].amax_history, before[0]) and torch.equal(model[2].scale, before[1])


def test_fp8_cast_numerics_follow_the_formats_ranges() -> None:
    from ampkit.formats.fp8 import cast_numerics
    from ampkit.formats.recipes import E4M3, E5M2

    values = torch.tensor([1000.0, 1.0, 2.0**-10, 2.0**-17])
    e4m3 = cast_numerics(values, torch.tensor(1.0), E4M3)
    assert (e4m3.overflow, e4m3.underflow) == (0.25, 0.5)  # 1000 clamps at 448; 2**-10 and below round to 0
    e5m2 = cast_numerics(values, torch.tensor(1.0), E5M2)
    assert (e5m2.overflow, e5m2.underflow) == (0.0, 0.25)  # 57344 holds 1000; only 2**-17 rounds to 0
    current = cast_numerics(values, None, E4M3)
    assert current.scale == pytest.approx(0.448) and current.overflow == 0.0


# -- bad input (moved from test_bad_input.py) ----------------------------------------


def test_inspecting_a_model_without_parameters_is_named() -> None:
    with pytest.raises(ValueError, match="needs a model with trainable parameters; this Sequential has none"):
        ampkit.inspect_numerics(nn.Sequential(), torch.randn(2, 3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_inspect_says_when_float32_itself_is_broken(bad: float) -> None:
    # a NaN model got no reason; an inf one got "keep it in float32", where it is inf already
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].bias[0] = bad
    report = ampkit.inspect_numerics(model, torch.randn(3, 4))
    assert report.reasons[0].startswith("2: activations are already inf/NaN in this float32 pass")
    assert "2" not in report.keep_float32


class _InfGradient(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient past float32's range: an inf made in the backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 1e39


class _Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class _InfInBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGradient.apply(x)


def test_a_backward_inf_is_named_by_its_module_whatever_ids_freed_outputs_leave() -> None:
    """Each module's output is marked with the module's name for the backward; a freed output's id, given to a later
    module's output, once counted that one as marked: its backward was named by the module after it (8 and 18 runs
    in 200)."""
    for _ in range(200):
        model = nn.Sequential(*[_Double() for _ in range(8)], _InfInBackward(), _Double())
        finding = ampkit.find_nonfinite(model, torch.randn(4, 4, requires_grad=True),
                                        loss_fn=lambda out, target: out.sum())
        assert finding is not None and (finding.module, finding.op, finding.phase) == ("8", "mul", "backward")
