"""Block-scaled linears: each GEMM quantizes its operands along its own reduction dimension (checked against
fake_quantize, itself checked against the specs), NVFP4's recipe parts, the conversion's decisions, the
instruments of inspect_numerics, and the compare settings."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from torch import nn

import ampkit
from ampkit import BlockScaledRecipe, fake_quantize
from ampkit.formats.block_linear import BlockScaledLinear, convert_to_block_scaled, random_hadamard
from ampkit.formats.block_scaled import _hash32, counter_draws, quantize_mx, quantize_nvfp4, round_e2m1


def _layer(recipe: BlockScaledRecipe, seed: int = 0) -> tuple[BlockScaledLinear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 64, generator=g))
    x = torch.randn(48, 64, generator=g, requires_grad=True)
    return BlockScaledLinear.from_linear(linear, recipe), x, torch.randn(48, 32, generator=g)


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4"])
def test_each_gemm_quantizes_along_its_own_reduction_dimension(format: str) -> None:
    layer, x, g = _layer(BlockScaledRecipe(format))
    fmt = {"mxfp8": "mxfp8", "mxfp4": "mxfp4"}[format]
    out = layer(x)
    out.backward(g)
    w = layer.weight.detach()
    assert torch.equal(out, fake_quantize(x.detach(), fmt) @ fake_quantize(w, fmt).T)  # along the input features
    assert torch.equal(x.grad, fake_quantize(g, fmt) @ fake_quantize(w, fmt, axis=0))  # along the output features
    expected_w = fake_quantize(g, fmt, axis=0).T @ fake_quantize(x.detach(), fmt, axis=0)  # along the tokens
    assert torch.equal(layer.weight.grad, expected_w)
    assert not torch.equal(fake_quantize(w, fmt), fake_quantize(w, fmt, axis=0))  # a tensor and its transpose differ


def test_nvfp4_uses_one_tiled_weight_for_both_gemms_and_a_hadamard_transform_for_the_weight_gradient() -> None:
    recipe = BlockScaledRecipe("nvfp4", stochastic_gradients=False)
    layer, x, g = _layer(recipe)
    out = layer(x)
    out.backward(g)
    w = layer.weight.detach()
    tiled = fake_quantize(w, "nvfp4", tile=16)
    assert torch.equal(out, fake_quantize(x.detach(), "nvfp4") @ tiled.T)
    assert torch.equal(x.grad, fake_quantize(g, "nvfp4") @ tiled)
    t = random_hadamard(recipe.hadamard_seed)
    assert torch.allclose(t @ t.T, torch.eye(16), atol=1e-6)  # orthogonal: g^T x is unchanged before quantizing

    def along_tokens(a: torch.Tensor) -> torch.Tensor:
        rotated = torch.matmul(t, a.reshape(-1, 16, a.shape[1])).reshape(-1, a.shape[1])
        return fake_quantize(rotated.T.contiguous(), "nvfp4")

    assert torch.equal(layer.weight.grad, along_tokens(g) @ along_tokens(x.detach()).T)
    exact = g.T @ x.detach()
    plain = BlockScaledRecipe("nvfp4", stochastic_gradients=False, hadamard=False)
    layer2, x2, g2 = _layer(plain)
    layer2(x2).backward(g2)
    assert not torch.equal(layer2.weight.grad, layer.weight.grad)
    assert (layer.weight.grad - exact).norm() / exact.norm() < 0.3


def test_stochastic_rounding_is_unbiased_and_reproducible() -> None:
    value = torch.full((200_000,), 2.3)  # between 2 and 3 on E2M1's grid
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    rounded = round_e2m1(value, g1, stochastic=True)
    assert set(rounded.unique().tolist()) == {2.0, 3.0}
    assert rounded.mean().item() == pytest.approx(2.3, abs=0.01)
    assert torch.equal(rounded, round_e2m1(value, g2, stochastic=True))
    assert round_e2m1(value).unique().tolist() == [2.0]  # nearest: biased


def _lowbias32(x: int) -> int:
    """The hash from its published formula (C. Wellons, hash-prospector), in Python's exact integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_counter_hash_is_lowbias32_bit_for_bit_up_to_the_largest_32_bit_value() -> None:
    """The tensor version multiplies in 16-bit halves (a plain int64 product of two 32-bit values overflows)."""
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF,
              *torch.randint(0, 2**32, (1000,), generator=torch.Generator().manual_seed(0)).tolist()]
    assert _hash32(torch.tensor(values, dtype=torch.int64)).tolist() == [_lowbias32(v) for v in values]


def test_counter_draws_are_uniform_reproducible_and_new_for_each_step_stream_and_seed() -> None:
    n = 200_000
    draws = counter_draws(0, torch.tensor(0), 0)((n,))
    assert draws.dtype == torch.float32 and 0 <= draws.min().item() and draws.max().item() < 1
    assert draws.mean().item() == pytest.approx(0.5, abs=0.005)
    assert draws.var().item() == pytest.approx(1 / 12, abs=0.002)
    counts = torch.histc(draws, bins=16, min=0.0, max=1.0)
    assert ((counts - n / 16).abs() < 0.03 * n / 16).all()
    assert torch.equal(draws, counter_draws(0, torch.tensor(0), 0)((n,)))
    for other in (counter_draws(0, torch.tensor(1), 0), counter_draws(0, torch.tensor(0), 1),
                  counter_draws(1, torch.tensor(0), 0)):
        assert abs(torch.corrcoef(torch.stack([draws, other((n,))]))[0, 1].item()) < 0.01


def test_stochastic_rounding_on_counter_draws_is_unbiased() -> None:
    value = torch.full((200_000,), 2.3)
    rounded = round_e2m1(value, counter_draws(3, torch.tensor(7), 0), stochastic=True)
    assert set(rounded.unique().tolist()) == {2.0, 3.0}
    assert rounded.mean().item() == pytest.approx(2.3, abs=0.01)


def test_nvfp4_draws_advance_with_each_training_forward_and_repeat_from_the_seed() -> None:
    """Two steps on one input round the gradients differently; a fresh layer of the same seed repeats them.
    The count is not part of the state dict (as the generator before it was not)."""
    def two_steps(layer: BlockScaledLinear, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        grads = []
        for _ in range(2):
            layer.weight.grad = None
            layer(x).backward(g)
            grads.append(layer.weight.grad.clone())
        return grads

    recipe = BlockScaledRecipe("nvfp4")
    first = two_steps(*_layer(recipe))
    assert not torch.equal(first[0], first[1])
    again = two_steps(*_layer(recipe))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    layer, x, _ = _layer(recipe)
    with torch.no_grad():
        layer(x)
    assert layer.draws_step.item() == 0 and "draws_step" not in layer.state_dict()


def test_conversion_keeps_first_last_named_and_ragged_linears_with_the_reason() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(40, 32),
                          nn.Linear(32, 16))
    decisions = convert_to_block_scaled(model, BlockScaledRecipe("nvfp4", keep=("3",)))
    assert decisions == {"0": "kept: the first or last linear (keep_first_last)", "2": "block-scaled",
                         "3": "kept: matches keep=", "4": "kept: 40x32 is not a multiple of the 16-element blocks",
                         "5": "kept: the first or last linear (keep_first_last)"}
    assert isinstance(model[2], BlockScaledLinear) and type(model[0]) is nn.Linear
    mx = convert_to_block_scaled(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)), BlockScaledRecipe("mxfp8"))
    assert set(mx.values()) == {"block-scaled"}  # MX keeps no first and last by default
    with pytest.raises(ValueError, match="No linear of Sequential can take mxfp8-floor"):
        convert_to_block_scaled(nn.Sequential(nn.Linear(10, 3)), BlockScaledRecipe())


@pytest.mark.parametrize("kwargs, message", [
    ({"format": "mxfp6"}, r"format='mxfp6'\) is invalid: choose one of \['mxfp8', 'mxfp4', 'nvfp4'\]"),
    ({"format": "mxfp4", "element": "e5m2"}, "'e4m3' or 'e5m2', for mxfp8"),
    ({"format": "nvfp4", "scale_mode": "rceil"}, "NVFP4's scales are E4M3 values"),
    ({"format": "mxfp8", "hadamard": True}, r"hadamard=True\) is part of the nvfp4 and mxfp4 recipes"),
    ({"format": "mxfp4", "weight_tiles": True}, r"weight_tiles=True\) is part of the nvfp4 recipe"),
    ({"format": "mxfp4", "hadamard": True, "gemm": print}, "with hadamard: the 16-bit forward and MXFP4's recipe"),
    ({"quantize_forward": False, "gemm": print}, "with quantize_forward=False: the 16-bit forward"),
    ({"quantize_forward": 0}, r"quantize_forward=0\) is not a bool"),
    ({"format": "nvfp4", "weight_tiles": "yes"}, "is not a bool"),
    ({"keep": "lm_head"}, "must be a tuple of name patterns"),
    ({"gemm": 3}, "is not callable"),
])
def test_bad_recipes_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockScaledRecipe(**kwargs)


def test_a_native_gemm_plugs_in_and_sees_both_operands_quantized() -> None:
    seen = []

    def gemm(a, b):  # noqa: ANN001, ANN202
        seen.append((a.scales.shape, b.scales.shape))
        return a.values @ b.values.T

    layer, x, g = _layer(BlockScaledRecipe("mxfp8", gemm=gemm))
    layer(x).backward(g)
    assert seen == [((48, 2), (32, 2)), ((48, 1), (64, 1)), ((32, 2), (64, 2))]  # fprop, dgrad, wgrad


def test_inspect_numerics_names_the_outlier_layer_under_nvfp4_with_its_saturated_blocks() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())])
    with torch.no_grad():
        model[2].weight[5] *= 1000.0  # one weight row 1000x the rest
    report = ampkit.inspect_numerics(model, torch.randn(64, 64), block_scaled=BlockScaledRecipe("nvfp4"))
    assert report.block_keep == ["2"]
    reason = next(r for r in report.reasons if r.startswith("2:"))
    outlier = next(m for m in report.modules if m.name == "2").block
    assert f"{100 * outlier.weight.saturated_blocks:.1f}% of its blocks saturate an element" in reason
    assert "flush to zero in nvfp4" in reason and "BlockScaledRecipe(keep=('2',))" in reason
    ordinary = next(m for m in report.modules if m.name == "4").block
    assert outlier.weight.flushed > 3 * ordinary.weight.flushed
    assert outlier.weight.range_max > 100 * ordinary.weight.range_median
    assert ordinary.gradient is not None and 0 <= ordinary.gradient.flushed < 1
    assert math.isfinite(ordinary.input.range_median)


def test_compare_labels_each_block_scaled_run_with_its_recipe_and_refuses_a_model_without_linears() -> None:
    from ampkit.experiment.config import RunConfig
    from ampkit.experiment.settings import plan

    assert RunConfig(model="gpt", data="text", precision="nvfp4", opt_level="O1").label.startswith("nvfp4 O1")
    assert RunConfig(model="gpt", data="text", precision="mxfp8", opt_level="O2").label.startswith("mxfp8-rceil O2")
    with pytest.raises(ValueError, match=r"precisions=\['mxfp4'\]: resnet18 has no linear mxfp4-floor can take"):
        plan(model="resnet18", data="digits", precisions=["mxfp4"])


def test_a_gpt_trains_a_few_steps_in_each_format_with_finite_losses() -> None:
    from ampkit.experiment.config import RunConfig
    from ampkit.experiment.training import execute

    for precision in ("mxfp8", "mxfp4", "mxfp4-recipe", "nvfp4", "nvfp4-4over6"):
        result = execute(RunConfig(model="gpt", data="text", precision=precision, opt_level="O1", steps=4,
                                   batch_size=4))
        assert all(math.isfinite(loss) for loss in result.losses), precision


def _mx_dithered_reference(x: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Tseng et al.'s stochastically rounded MXFP4 (amazon-science/mxfp4-llm, microxcaling's ``dither_scale``),
    written out from its formula: per block of 32, e = floor(log2(amax)) - 2 (E2M1's largest exponent), the block
    as 3 x / 2**(e+2), each value rounded up to the next E2M1 grid value with probability its distance from the one
    below over their gap (``draws`` < that), then x 2**(e+2) / 3."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks, u = x.reshape(-1, 32), draws.reshape(-1, 32)
    e = torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True))) - 2
    a = 3 * blocks / 2 ** (e + 2)
    below = grid[torch.searchsorted(grid, a.abs(), right=True) - 1]
    above = grid[torch.clamp(torch.searchsorted(grid, a.abs(), right=True), max=7)]
    gap = torch.where(above > below, above - below, torch.ones_like(below))
    rounded = torch.where(u < (a.abs() - below) / gap, above, below)
    return (torch.copysign(rounded, a) * 2 ** (e + 2) / 3).reshape(x.shape)


def test_mxfp4_stochastic_rounding_is_tseng_et_al_s_dithered_rounding_and_unbiased_where_floor_clips() -> None:
    """The MXFP4 recipe's stochastic rounding scales each block by 3/4 first: the spec's FLOOR scale maps a
    block's largest value up to 8, past E2M1's 6, where rounding clips (biased). Bit for bit against the formula
    written out above on the same draws; over 4,000 draws a block whose largest value FLOOR clips (7.9 x its
    scale) decodes to its own values on average, where rounding at the unscaled block's scale falls short."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-3, 3, 64)
    draws = torch.rand(8, 64, generator=g)
    got = quantize_mx(x, "e2m1", generator=lambda shape: draws.reshape(shape), stochastic=True).values
    assert torch.equal(got, _mx_dithered_reference(x, draws))
    block = torch.linspace(-1.0, 7.9, 32)  # amax 7.9: FLOOR's scale is 1, its 7.9 past E2M1's 6
    draws = torch.rand(4000, 32, generator=g)
    dithered = quantize_mx(block.expand(4000, 32), "e2m1", generator=lambda shape: draws.reshape(shape),
                           stochastic=True).values.mean(0)
    assert (dithered - block).abs().max() < 0.1
    clipped = round_e2m1(block.expand(4000, 32), lambda shape: draws.reshape(shape), stochastic=True).mean(0)
    assert block[-1] - clipped[-1] > 1.5  # 7.9 rounded at the unscaled block's scale: 6, always


def test_the_mxfp4_recipe_computes_the_forward_in_16_bits_and_an_unbiased_mxfp4_backward() -> None:
    """``compare``'s ``mxfp4-recipe`` (Tseng et al.): the forward is the model's own 16-bit linear (bfloat16
    operands, float32 sums); each backward GEMM's operands go through the 64x64 random Hadamard transform along
    its reduction dimension (a transform of both that leaves their product: with it alone, each gradient equals
    the plain MXFP4 GEMM of the transformed operands) and round stochastically, so over 200 steps the gradients
    average to the exact ones (within 2%) though each one is further from them (over 10%) than nearest
    rounding's."""
    from ampkit.formats.block_linear import _hadamard_columns, _hadamard_rows
    from ampkit.formats.recipes import MXFP4_RECIPE

    torch.manual_seed(0)
    linear, x = nn.Linear(128, 96), torch.randn(48, 128, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        out = BlockScaledLinear.from_linear(linear, MXFP4_RECIPE)(x)
    x16, w16 = x.detach().bfloat16().float(), linear.weight.detach().bfloat16().float()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ((x16 @ w16.T).bfloat16() + linear.bias.bfloat16()))
    g = torch.randn(48, 96)
    exact = torch.autograd.grad(linear(x), (x, linear.weight), g)

    def grads(recipe: BlockScaledRecipe) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(BlockScaledLinear.from_linear(linear, recipe)(x), (x, linear.weight), g)

    rotated = dataclasses.replace(MXFP4_RECIPE, stochastic_gradients=False)
    t, mx = random_hadamard(0, 64), (lambda a: quantize_mx(a, "e2m1").values)
    w = linear.weight.detach()
    assert torch.equal(grads(rotated)[0], mx(_hadamard_columns(g, t)) @ mx(_hadamard_columns(w.T, t)).T)
    assert torch.equal(grads(rotated)[1], mx(_hadamard_rows(g, t).T) @ mx(_hadamard_rows(x.detach(), t).T).T)
    layer = BlockScaledLinear.from_linear(linear, MXFP4_RECIPE)
    total = [torch.zeros_like(e) for e in exact]
    for step in range(200):
        each = torch.autograd.grad(layer(x), (x, linear.weight), g)
        total = [a + b for a, b in zip(total, each)]
        if step == 0:
            assert all((a - e).norm() / e.norm() > 0.1 for a, e in zip(each, exact))
    assert all((a / 200 - e).norm() / e.norm() < 0.02 for a, e in zip(total, exact))


def test_compiled_casts_of_many_formats_stay_compiled() -> None:
    """Five formats' casts in one process, each in a forward (autocast on, a torch function mode entered, as O2's
    loss mode is) and a backward (neither): dynamo compiles every one and never reaches its recompile limit, after
    which it ran the casts eagerly, several times slower (it did with one code object for all: 14 graphs)."""
    from torch.overrides import TorchFunctionMode

    from ampkit.formats.block_linear import operand_values

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    said: list[str] = []
    dynamo_log, handler = logging.getLogger("torch._dynamo"), Said(logging.WARNING)  # torch's loggers propagate not
    x, step = torch.randn(64, 128), torch.tensor(1)
    recipes = [BlockScaledRecipe("mxfp8"), BlockScaledRecipe("mxfp8", "e4m3", "rceil"), BlockScaledRecipe("mxfp4"),
               BlockScaledRecipe("nvfp4"), BlockScaledRecipe("nvfp4", four_over_six=True)]
    dynamo_log.addHandler(handler)
    try:
        for recipe in recipes:
            with torch.autocast("cpu", torch.bfloat16), Passing():
                forward = operand_values(x, recipe, tiles=recipe.format == "nvfp4")
            backward = operand_values(x, recipe, 0, step, 0, stochastic=recipe.format == "nvfp4")
            eager = dataclasses.replace(recipe, compiled_casts=False)
            assert torch.equal(forward, operand_values(x, eager, tiles=recipe.format == "nvfp4"))
            assert torch.equal(backward, operand_values(x, eager, 0, step, 0, stochastic=recipe.format == "nvfp4"))
    finally:
        dynamo_log.removeHandler(handler)
    assert not [message for message in said if "recompile" in message], said


@pytest.mark.parametrize("recipe", [BlockScaledRecipe("mxfp8"), BlockScaledRecipe("mxfp8", "e5m2", "rceil"),
                                    BlockScaledRecipe("mxfp4"), BlockScaledRecipe("mxfp4", stochastic_gradients=True),
                                    BlockScaledRecipe("nvfp4"),
                                    BlockScaledRecipe("nvfp4", four_over_six=True)], ids=lambda r: r.label)
def test_compiled_casts_give_the_eager_values_bit_for_bit(recipe: BlockScaledRecipe) -> None:
    """``compiled_casts`` (the default) fuses the quantization through torch.compile: every operand an emulated GEMM
    reads (NVFP4's tiles and stochastically rounded gradients included) is the eager cast's, bit for bit, on
    random, eight-decade, tiny, huge and bfloat16 values of several shapes (one graph: dynamic shapes). A bfloat16
    operand and a transposed one (``transposed=True``, the backward's: converted and transposed inside the compiled
    cast) give the float32 copy's and the transposed copy's values."""
    from ampkit.formats.block_linear import operand_values

    g = torch.Generator().manual_seed(0)
    eager = dataclasses.replace(recipe, compiled_casts=False)
    step = torch.tensor(3)
    for x in (torch.randn(64, 256, generator=g), torch.randn(48, 96, generator=g) * torch.logspace(-4, 4, 96),
              torch.randn(32, 64, generator=g) * 1e-30, torch.randn(32, 64, generator=g) * 1e30,
              torch.randn(40, 128, generator=g).bfloat16(), torch.randn(16, 32, generator=g).T):
        variants = [dict()]
        if recipe.format == "nvfp4":
            variants += [dict(tiles=True), dict(seed=5, step=step, stream=1, stochastic=True),
                         dict(seed=5, step=step, stream=0, stochastic=True, tiles=True)]
        elif recipe.stochastic_gradients:  # MXFP4's recipe: blocks at 3/4 of their scale, rounded stochastically
            variants += [dict(seed=5, step=step, stream=3, stochastic=True)]
        for kwargs in variants:
            assert torch.equal(operand_values(x, recipe, **kwargs), operand_values(x, eager, **kwargs)), kwargs
            assert torch.equal(operand_values(x, recipe, **kwargs), operand_values(x.float(), eager, **kwargs))
            if x.dtype == torch.bfloat16:  # a graph of its own per dtype and transposition: compiled once here
                transposed = operand_values(x.T.float().contiguous(), eager, **kwargs)
                assert torch.equal(operand_values(x, recipe, transposed=True, **kwargs), transposed), kwargs
                assert torch.equal(operand_values(x, eager, transposed=True, **kwargs), transposed), kwargs
            if kwargs.get("stochastic"):  # the draws of the cast itself (the native GEMM's backward takes them so)
                draws = counter_draws(5, step, kwargs["stream"])
                expected = (quantize_nvfp4(x, -1, 16 if kwargs.get("tiles") else None, draws, True,
                                           recipe.four_over_six).values if recipe.format == "nvfp4"
                            else quantize_mx(x, "e2m1", generator=draws, stochastic=True).values)
                assert torch.equal(operand_values(x, recipe, **kwargs), expected), kwargs

