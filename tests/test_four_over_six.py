"""Four Over Six (arXiv 2512.02010): NVFP4 blocks scaled to 6 or to 4, whichever decodes nearer, against the
paper's reference quantizer written out from its formulas; and the option in the recipe, compare and tune."""

from __future__ import annotations

import pytest
import torch
from test_block_scaled import _nvfp4_inputs, _te_e2m1
from torch import nn

from ampkit.experiment.config import BLOCK_RECIPES, PRECISIONS
from ampkit.formats.block_linear import BlockScaledLinear
from ampkit.formats.block_scaled import fake_quantize, quantize_nvfp4
from ampkit.formats.recipes import BlockScaledRecipe
from ampkit.planning.precision_plan import LOWER


def _paper_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(elements, block scales, where 4 was chosen) of 1x16 blocks as the authors' reference quantizer computes them
    (mit-han-lab/fouroversix, quantize/reference.py, its steps written out): block scales at most 256 under the
    tensor scale, ``e4m3(amax_block * 256 / amax)`` for 6 and that times 1.5 for 4; elements ``e2m1(x * 6 * 256 /
    (amax * scale))``; decoded ``q * scale * amax / (6 * 256)``; 4 where its decoded block's squared error is
    strictly the smaller."""
    x = x.float().reshape(-1, 16)
    amax, block_amax = x.abs().max(), x.abs().amax(-1, keepdim=True)
    found = []
    for expand in (1.0, 1.5):
        scale = (block_amax * 256 / amax * expand).to(torch.float8_e4m3fn).float()
        q = _te_e2m1(torch.where(scale != 0, x * 6 * 256 / (amax * scale), 0.0).clamp(-6, 6))
        found.append((q, scale, ((q * scale * amax / (6 * 256) - x) ** 2).sum(-1, keepdim=True)))
    (q6, s6, error6), (q4, s4, error4) = found
    four = error4 < error6
    return torch.where(four, q4, q6), torch.where(four, s4, s6), four


@pytest.mark.parametrize("case", ["random", "eight decades", "on the grid's ties", "bfloat16 values"])
def test_four_over_six_is_the_papers_reference_value_for_value(case: str) -> None:
    x = _nvfp4_inputs()[case]
    q = quantize_nvfp4(x, four_over_six=True)
    elements, scales, four = _paper_reference(x)
    assert torch.equal(q.scales.reshape(-1, 1), scales)
    assert torch.equal(q.elements.reshape(-1, 16), elements)
    assert 0.2 < four.float().mean().item() < 0.8  # both scales chosen, neither always
    assert q.elements.abs().max().item() == 6.0


@pytest.mark.parametrize("case", ["tiny", "huge"])
def test_on_huge_and_tiny_tensors_the_choice_is_the_nearer_where_the_references_error_cannot_tell(case: str) -> None:
    """The reference measures the error in the input's units: at 1e30 every squared error overflows to inf, at
    1e-30 it flushes to 0, a tie that keeps 6 in every block. ampkit measures it in the tensor scale's units and
    chooses 4 where that decodes nearer (the decision checked in float64, scale-free)."""
    x = _nvfp4_inputs()[case]
    _, _, reference_four = _paper_reference(x)
    assert not reference_four.any()
    q = quantize_nvfp4(x, four_over_six=True)
    chose_four = q.elements.reshape(-1, 16).abs().amax(-1) <= 4.0
    assert 0.2 < chose_four.float().mean().item() < 0.8

    def error(values: torch.Tensor) -> torch.Tensor:
        scaled = (values.double() - x.double()) / x.double().abs().max()
        return (scaled.reshape(-1, 16) ** 2).sum(-1)

    always_six = _always(x, 1.0)
    assert bool((error(q.values) <= error(always_six)).all()) and bool((error(q.values) < error(always_six)).any())


def _always(x: torch.Tensor, expand: float) -> torch.Tensor:
    """Every block's amax to 6 (``expand`` 1.0) under the same 256 ceiling, decoded in float32."""
    x32 = x.float().reshape(-1, 16)
    s = 256 * 6 / x32.abs().max()
    scale = (x32.abs().amax(-1, keepdim=True) * (s * (1 / 6)) * expand).to(torch.float8_e4m3fn).float()
    return (_te_e2m1((x32 * (1 / (scale * (1 / s)))).clamp(-6, 6)) * scale / s).reshape(x.shape)


def test_four_over_six_is_never_farther_than_six_alone_and_nearer_on_ordinary_blocks() -> None:
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(3))
    chosen, six = quantize_nvfp4(x, four_over_six=True).values, _always(x, 1.0)
    per_block = lambda v: ((v - x).reshape(-1, 16) ** 2).sum(-1)  # noqa: E731
    assert bool((per_block(chosen) <= per_block(six) * (1 + 1e-6)).all())
    plain = quantize_nvfp4(x).values  # NVFP4 with its 448 ceiling
    assert ((chosen - x) ** 2).sum() < 0.9 * ((plain - x) ** 2).sum()  # the paper's point: a smaller error


def test_fake_quantize_and_the_recipe_take_it_for_nvfp4_only() -> None:
    x = torch.randn(32, 64)
    assert torch.equal(fake_quantize(x, "nvfp4", four_over_six=True), quantize_nvfp4(x, four_over_six=True).values)
    with pytest.raises(ValueError, match=r"four_over_six=True: a bool, True for NVFP4 only.*format='mxfp4'"):
        fake_quantize(x, "mxfp4", four_over_six=True)
    with pytest.raises(ValueError, match=r"four_over_six=True\) is a bool, True for NVFP4 only"):
        BlockScaledRecipe("mxfp8", four_over_six=True)
    with pytest.raises(ValueError, match=r"four_over_six='yes'\) is a bool"):
        BlockScaledRecipe("nvfp4", four_over_six="yes")  # type: ignore[arg-type]
    assert BlockScaledRecipe("nvfp4", four_over_six=True).label == "nvfp4-4over6"
    assert "nvfp4-4over6" in PRECISIONS and BLOCK_RECIPES["nvfp4-4over6"].four_over_six
    assert LOWER["nvfp4-4over6"].four_over_six  # ampkit.tune's formats


def test_a_block_scaled_linear_with_four_over_six_computes_on_its_casts() -> None:
    recipe = BlockScaledRecipe("nvfp4", four_over_six=True, stochastic_gradients=False, hadamard=False)
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    layer = BlockScaledLinear.from_linear(linear, recipe)
    x = torch.randn(48, 64, generator=g, requires_grad=True)
    out = layer(x)
    w = layer.weight.detach()
    assert torch.equal(out, fake_quantize(x.detach(), "nvfp4", four_over_six=True)
                       @ fake_quantize(w, "nvfp4", tile=16, four_over_six=True).T)
    out.backward(torch.randn(48, 32, generator=g))
    assert x.grad is not None and torch.isfinite(layer.weight.grad).all()
