"""Block-scaled formats against references written here from the specs (OCP MX v1.0 section 5-6; NVFP4 as
Transformer Engine documents it): every E2M1 and E4M3 code point, E8M0 scales, and bit-for-bit blocks of
random, subnormal, overflowing, all-zero and NaN values; torchao's casts checked against the same reference."""

from __future__ import annotations

import math

import pytest
import torch

from ampkit import fake_quantize
from ampkit.formats.block_scaled import quantize_mx, quantize_nvfp4, round_e2m1

# -- the reference: code tables decoded from the bit layouts, rounding by search --------------------------


def decode_e4m3(code: int) -> float:
    sign, exponent, mantissa = code >> 7, (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan  # E4M3 (fn): no infinities, one NaN pattern per sign
    value = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -value if sign else value


def decode_e5m2(code: int) -> float:
    sign, exponent, mantissa = code >> 7, (code >> 2) & 0x1F, code & 0x3
    if exponent == 0x1F:
        value = math.inf if mantissa == 0 else math.nan
    else:
        value = mantissa / 4 * 2.0**-14 if exponent == 0 else (1 + mantissa / 4) * 2.0 ** (exponent - 15)
    return -value if sign else value


def decode_e2m1(code: int) -> float:
    sign, exponent, mantissa = code >> 3, (code >> 1) & 0x3, code & 0x1
    value = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -value if sign else value


def decode_e8m0(code: int) -> float:
    return math.nan if code == 0xFF else 2.0 ** (code - 127)


def positive_codes(decode, bits: int) -> list[tuple[float, int]]:  # noqa: ANN001
    """(value, code) of every finite non-negative code point, ascending."""
    half = 1 << (bits - 1)
    return sorted((decode(c), c) for c in range(half) if math.isfinite(decode(c)))


E4M3_CODES, E5M2_CODES, E2M1_CODES = positive_codes(decode_e4m3, 8), positive_codes(decode_e5m2, 8), \
    positive_codes(decode_e2m1, 4)
CODES = {"e4m3": E4M3_CODES, "e5m2": E5M2_CODES, "e2m1": E2M1_CODES}


def round_nearest_even(v: float, codes: list[tuple[float, int]]) -> float:
    """roundTiesToEven onto the code points, saturating at the largest finite one (what the specs ask of a
    conversion into an MX element type)."""
    if math.isnan(v):
        return math.nan
    magnitude = min(abs(v), codes[-1][0])
    best = min(codes, key=lambda vc: (abs(vc[0] - magnitude), vc[1] & 1))  # a tie: the even code
    return math.copysign(best[0], v)


def reference_mx(block: list[float], element: str, mode: str = "floor") -> list[float]:
    """OCP MX v1.0 6.3: X = 2**(floor(log2(amax)) - emax_elem), P = quantize(V / X); decoded P * X."""
    codes = CODES[element]
    largest = codes[-1][0]
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return [math.nan] * len(block)  # the NaN scale
    amax = max(abs(v) for v in block)
    if amax == 0:
        exponent = -127
    elif mode == "floor":
        emax = math.frexp(largest)[1] - 1
        exponent = math.frexp(amax)[1] - 1 - emax
    else:  # the least e with amax <= largest * 2**e
        exponent = math.ceil(math.log2(amax / largest))
        while largest * 2.0 ** (exponent - 1) >= amax:
            exponent -= 1
        while largest * 2.0**exponent < amax:
            exponent += 1
    exponent = max(-127, min(127, exponent))
    return [round_nearest_even(v / 2.0**exponent, codes) * 2.0**exponent for v in block]


def f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).item()


def reference_nvfp4(values: list[float]) -> list[float]:
    """NVFP4 (Transformer Engine): s = 448 * 6 / amax; block scale e4m3((amax_b / 6) * s); elements
    e2m1(v * (s / scale)); decoded q * scale / s. Every step rounded to float32, in that order; ampkit's one
    departure: s and s / scale are clamped to float32's largest (where amax < ~8e-36 Transformer Engine's s
    overflows to inf, every zero decodes to 0 x inf = NaN and every other value to 0)."""
    finite = [abs(v) for v in values if math.isfinite(v)]
    amax = max(finite, default=0.0)
    largest = float(torch.finfo(torch.float32).max)
    s = min(f32(f32(448.0 * 6.0) / amax), largest) if amax > 0 else 1.0
    out = []
    for start in range(0, len(values), 16):
        block = values[start:start + 16]
        if not all(math.isfinite(v) for v in block):
            out += [math.nan] * len(block)
            continue
        scale = round_nearest_even(f32(f32(max(abs(v) for v in block) / 6.0) * s), E4M3_CODES)
        factor = min(f32(s / scale), largest) if scale > 0 else 0.0
        out += [f32(f32(round_nearest_even(f32(v * factor), E2M1_CODES) * scale) / s) for v in block]
    return out


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def blocks_of_every_kind(n: int, seed: int = 0) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    kinds = [
        torch.randn(n, generator=g),  # ordinary
        torch.randn(n, generator=g) * 1e-39,  # float32 subnormals
        torch.randn(n, generator=g) * 3e38,  # near float32's largest
        torch.randn(n, generator=g) * torch.logspace(-20, 20, n),  # a wide range inside one block
        torch.zeros(n),
        torch.cat([torch.randn(n - 1, generator=g), torch.tensor([math.nan])]),
        torch.cat([torch.tensor([math.inf]), torch.randn(n - 1, generator=g)]),
        torch.full((n,), 447.9) * torch.tensor([1.0, -1.0]).repeat(n // 2),
    ]
    return [k.tolist() for k in kinds]


# -- the code points ------------------------------------------------------------------------------------


def test_every_e2m1_code_point_round_trips_and_the_grid_is_the_specs() -> None:
    assert [v for v, _ in E2M1_CODES] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    values = torch.tensor([decode_e2m1(c) for c in range(16)])
    assert torch.equal(round_e2m1(values), values)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.25, -5.0])
    expected = [round_nearest_even(v, E2M1_CODES) for v in midpoints.tolist()]
    assert round_e2m1(midpoints).tolist() == expected == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0]


def test_every_e4m3_and_e5m2_code_point_round_trips_through_mxfp8() -> None:
    for element, decode in (("e4m3", decode_e4m3), ("e5m2", decode_e5m2)):
        values = [decode(c) for c in range(256) if math.isfinite(decode(c))]
        for start in range(0, len(values), 32):
            block = values[start:start + 32]
            block += [0.0] * (32 - len(block))
            block[0] = max(CODES[element])[0]  # the largest: the scale is 2**0, every code is exact
            got = quantize_mx(torch.tensor([block]), element).values[0].tolist()
            assert same(got, block), element


def test_a_sweep_of_e8m0_scales_round_trips() -> None:
    for code in range(0, 255):
        scale = decode_e8m0(code)
        block = torch.tensor([[1.0] + [0.5] * 31], dtype=torch.float64) * scale * 448
        q = quantize_mx(block.float(), "e4m3")
        if math.isfinite(float(block.float()[0, 0])) and float(block.float()[0, 0]) != 0:
            expected = reference_mx(block.float()[0].tolist(), "e4m3")
            assert same(q.values[0].tolist(), expected), code
    assert math.isnan(decode_e8m0(0xFF))


# -- whole blocks, bit for bit ---------------------------------------------------------------------------


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mx_blocks_match_the_spec_reference_bit_for_bit(element: str, mode: str) -> None:
    for block in blocks_of_every_kind(32):
        got = quantize_mx(torch.tensor([block]), element, mode=mode).values[0].tolist()
        assert same(got, reference_mx(block, element, mode)), block[:3]


def test_floor_saturates_and_rceil_does_not() -> None:
    block = torch.tensor([[500.0] + [1.0] * 31])  # floor(log2 500) = 8: scale 1, 500 saturates to 448
    floor, rceil = quantize_mx(block, "e4m3", mode="floor"), quantize_mx(block, "e4m3", mode="rceil")
    assert floor.values[0, 0] == 448.0 and floor.block_saturated.all()
    assert rceil.values[0, 0] == 512.0 and not rceil.block_saturated.any()  # scale 2: 250 -> 256


def test_nvfp4_matches_the_reference_bit_for_bit() -> None:
    for values in blocks_of_every_kind(64, seed=3):
        got = quantize_nvfp4(torch.tensor(values)).values.tolist()
        assert same(got, reference_nvfp4(values)), values[:3]


def test_nvfp4_tiles_are_16_by_16_and_a_tensor_and_its_transpose_quantize_alike() -> None:
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    w[3, 5] = 200.0  # one large value: only its tile's scale grows
    tiled = quantize_nvfp4(w, tile=16)
    assert torch.equal(quantize_nvfp4(w.T.contiguous(), tile=16).values, tiled.values.T)
    assert tiled.scales.shape == (2, 3)
    tile = w[:16, :16].flatten().tolist()  # the tile alone, as a 256-element block under the tensor scale
    amax = w.abs().max().item()
    s = f32(2688.0 / amax)
    scale = round_nearest_even(f32(f32(max(abs(v) for v in tile) / 6.0) * s), E4M3_CODES)
    assert tiled.scales[0, 0].item() == scale
    assert tiled.values[16:, 16:].abs().max() < tiled.values[:16, :16].abs().max()


def test_fake_quantize_takes_any_axis_and_a_ragged_last_block() -> None:
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(2))
    along_rows = fake_quantize(x, "mxfp8", axis=0)  # blocks of 32 down each column; the last holds 8
    expected = [reference_mx(x[:32, 0].tolist(), "e4m3"), reference_mx(x[32:, 0].tolist() + [0.0] * 24, "e4m3")[:8]]
    assert same(along_rows[:, 0].tolist(), expected[0] + expected[1])
    with pytest.raises(ValueError, match=r"format='mxfp6' is not a block-scaled format: choose one of"):
        fake_quantize(x, "mxfp6")
    with pytest.raises(ValueError, match="only NVFP4 takes tiles"):
        fake_quantize(x, "mxfp8", tile=16)
    with pytest.raises(ValueError, match="applies to the MX formats"):
        fake_quantize(x, "nvfp4", scale_mode="rceil")


# -- torchao's casts, against the same reference ---------------------------------------------------------


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_torchao_to_mx_agrees_with_the_reference_on_ordinary_blocks(element: str) -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}[element]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-3, 3, 8)[:, None]
    tensor = mx.MXTensor.to_mx(x, dtype, block_size=32)
    got = tensor.dequantize(torch.float32)
    expected = [v for row in x.tolist() for start in (0, 32) for v in reference_mx(row[start:start + 32], element)]
    assert same(got.flatten().tolist(), expected)


def test_torchao_to_nvfp4_agrees_with_the_reference_within_its_decoding_rounding() -> None:
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, generator=g) * torch.logspace(-2, 2, 4)[:, None]
    scale = nvfp4.per_tensor_amax_to_scale(x.abs().max())
    got = nvfp4.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32).flatten()
    expected = torch.tensor(reference_nvfp4(x.flatten().tolist()))
    # The same elements and block scales: torchao decodes with a multiply by amax / 2688 where the reference
    # divides by 2688 / amax, a float32 rounding apart (at most one unit in the last place).
    ulp = torch.finfo(torch.float32).eps * expected.abs()
    assert ((got - expected).abs() <= ulp).all()  # a different element or scale would be a grid step apart


@pytest.mark.parametrize("largest", [1e-37, 3e-38, 8e-36, torch.finfo(torch.float32).tiny])
def test_nvfp4_of_a_tiny_tensor_stays_finite_and_keeps_its_zeros(largest: float) -> None:
    """Issue 40: below an amax of about 8e-36 the per-tensor scale overflowed to inf and every zero decoded to NaN
    (0 x inf): in NVFP4 training one tiny output gradient made every weight-gradient value NaN."""
    x = torch.zeros(2, 32)
    x[0, 3], x[1, 20] = largest, -largest / 2
    q = quantize_nvfp4(x)
    assert torch.isfinite(q.values).all() and torch.equal(q.values[x == 0], torch.zeros(62))
    assert 0.5 * largest <= q.values[0, 3].item() <= 1.5 * largest


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4", "nvfp4"])
def test_a_scalar_is_a_block_of_one_and_an_empty_tensor_has_nothing_to_scale(format: str) -> None:
    """On main, a 0-d tensor raised IndexError and an empty one a reshape RuntimeError."""
    value = torch.tensor(1.3)
    assert torch.equal(fake_quantize(value, format), fake_quantize(value.reshape(1), format).reshape(()))
    assert fake_quantize(value, format).shape == ()
    for empty in (torch.empty(0, 32), torch.empty(4, 0)):
        got = fake_quantize(empty, format)
        assert got.shape == empty.shape and got.dtype == torch.float32


def test_a_tensor_that_is_not_floating_or_an_axis_it_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"takes a floating tensor, not Tensor of torch.int64: pass x.float\(\)"):
        fake_quantize(torch.arange(32))
    with pytest.raises(ValueError, match=r"axis=2 is not a dimension of x \(shape \(4, 32\)\)"):
        fake_quantize(torch.randn(4, 32), axis=2)


# -- Transformer Engine's NVFP4 quantizer, step for step (issue 68's second item) -----------------------------------

_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _te_e2m1(v: torch.Tensor) -> torch.Tensor:
    """E2M1 as Transformer Engine's reference bins a scaled value: each grid point takes the values nearer to it
    than to its neighbours, a tie going to the even code (0.25 to 0, 0.75 to 1, 1.25 to 1, 1.75 to 2, 2.5 to 2, 3.5
    to 4, 5 to 4)."""
    a, code = v.abs(), torch.zeros(v.shape, dtype=torch.long)
    for i, (edge, tie_down) in enumerate([(0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True),
                                          (3.5, False), (5.0, True)]):
        code = torch.where(a > edge if tie_down else a >= edge, i + 1, code)
    return torch.copysign(_E2M1_GRID[code], v)


def _te_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, block scales) of 1x16 blocks as Transformer Engine's reference NVFP4 quantizer computes them
    (transformer_engine/pytorch/custom_recipes/quantization_nvfp4.py, ``_quantize_blockwise_reference``, whose
    numbers its CUDA kernels match exactly; its steps written out here): s = 448 * 6 / amax (float32's largest at
    most; 1 for an all-zero tensor); a block's scale is its amax times (s * (1/6)), clamped to 448 and cast to
    E4M3 (round to nearest: a scale below half of E4M3's smallest subnormal becomes 0); the elements are the block
    times 1 / (scale * (1/s)) (float32's largest at most), clamped to 6 and binned onto E2M1."""
    x = x.float().reshape(-1, 16)
    largest = torch.finfo(torch.float32).max
    s = torch.clamp(448.0 * 6.0 / x.abs().max(), max=largest)
    s = torch.where(s == 0, torch.ones_like(s), s)
    one_sixth = 1.0 / torch.tensor(6.0)
    scale = torch.clamp(x.abs().amax(-1, keepdim=True) * (s * one_sixth), max=largest)
    scale = torch.clamp(scale, -448.0, 448.0).to(torch.float8_e4m3fn).float()
    factor = torch.clamp(1.0 / (scale * (1.0 / s)), max=largest)
    return _te_e2m1(torch.clamp(x * factor, -6.0, 6.0)), scale


def _nvfp4_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "random": torch.randn(256, 256, generator=g),
        "eight decades": torch.randn(256, 256, generator=g) * torch.logspace(-4, 4, 256)[:, None],
        "tiny": torch.randn(64, 64, generator=g) * 1e-30,
        "huge": torch.randn(64, 64, generator=g) * 1e30,
        "on the grid's ties": (torch.randint(0, 13, (64, 64), generator=g).float() * 0.25 - 1.5)
        * torch.randint(1, 8, (64, 1), generator=g).float(),
        "bfloat16 values": torch.randn(128, 128, generator=g).bfloat16().float(),
    }


@pytest.mark.parametrize("case", list(_nvfp4_inputs()))
def test_the_nvfp4_cast_is_transformer_engines_value_for_value(case: str) -> None:
    """Every block scale and every element of a block with a nonzero scale equal to Transformer Engine's (a zero
    scale decodes the block to zero there whatever its elements: here too). Before, the elements' factor was
    s / scale, one rounding from Transformer Engine's 1 / (scale * (1/s)): on bfloat16 values 0.08% of the elements
    landed on the other side of a tie (3.5 against 3.4999998)."""
    x = _nvfp4_inputs()[case]
    q = quantize_nvfp4(x)
    elements, scales = _te_nvfp4(x)
    assert torch.equal(q.scales.reshape(-1, 1), scales)
    nonzero = scales.expand_as(elements) > 0
    assert torch.equal(q.elements.reshape(-1, 16)[nonzero], elements[nonzero])
    assert torch.equal(q.values.reshape(-1, 16)[~nonzero], torch.zeros(int((~nonzero).sum())))


def test_nvfp4_against_torchao_differs_only_where_a_block_scale_is_below_e4m3s_smallest_normal() -> None:
    """torchao clamps a block scale to at least E4M3's smallest normal, 2**-6 (``E4M3_EPS``); Transformer Engine and
    ampkit round it onto E4M3's subnormals and flush a block whose scale is below half the smallest (docs/block-
    scaled.md). Everywhere else the two casts agree to a float32 rounding of the decode."""
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = _nvfp4_inputs()["eight decades"]
    q = quantize_nvfp4(x)
    theirs = nvfp4.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=nvfp4.per_tensor_amax_to_scale(x.abs().max()))
    theirs = theirs.dequantize(torch.float32).reshape(-1, 16)
    ours = q.values.reshape(-1, 16)
    apart = (ours - theirs).abs() > 2 * torch.finfo(torch.float32).eps * theirs.abs()  # two roundings of a decode
    subnormal = q.scales.reshape(-1, 1).expand_as(ours) < 2.0**-6
    assert apart.any() and not (apart & ~subnormal).any()  # every disagreement in a block of a subnormal scale
    flushed = (q.scales.reshape(-1, 1) == 0).expand_as(ours) & (x.reshape(-1, 16) != 0)
    assert (ours[flushed] == 0).all() and (theirs[flushed] != 0).any()  # flushed here, kept at 2**-6 by torchao


def _te_mx(x: torch.Tensor, element: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, scales) of 32-value blocks as Transformer Engine computes MX scales, which round up: MXFP8 as its
    kernels do (the block's amax times float32's 1/448, rounded up to a power of two: ``float_to_e8m0(amax *
    max_norm_rcp)``), MXFP4 as its reference quantizer does (``cast_to_e8``: 2**ceil(log2(amax / 6)), clamped to
    2**-127..2**127); the elements the block times the scale's reciprocal, E4M3 saturating at 448, E2M1 binned."""
    x = x.float().reshape(-1, 32)
    amax = x.abs().amax(-1, keepdim=True)
    if element == "e4m3":
        mantissa, exponent = torch.frexp(amax * (1.0 / torch.tensor(448.0)))  # m in [0.5, 1): 2**e rounds it up
        e = torch.where(mantissa == 0.5, exponent - 1, exponent).float()
        e = torch.where(amax == 0, torch.full_like(e, -127.0), e).clamp(-127, 127)
    else:
        e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scale = torch.exp2(e)
    scaled = x * (1.0 / scale)
    if element == "e4m3":
        return torch.clamp(scaled, -448.0, 448.0).to(torch.float8_e4m3fn).float(), scale
    return _te_e2m1(torch.clamp(scaled, -6.0, 6.0)), scale


def _mx_inputs() -> dict[str, torch.Tensor]:
    """``_nvfp4_inputs``'s and blocks whose amax is a scale boundary (448 or 6 times 2**k) or one float32 step
    either side of it, k from -100 to 100."""
    edges = torch.tensor([top * 2.0**k for top in (448.0, 6.0) for k in range(-100, 101, 7)])
    steps = torch.cat([edges, torch.nextafter(edges, torch.zeros(())), torch.nextafter(edges, edges * 2)])
    g = torch.Generator().manual_seed(1)
    boundary = torch.rand(len(steps), 32, generator=g) * steps[:, None]
    boundary[:, 5] = steps
    return {**{k: v.reshape(-1, 32) for k, v in _nvfp4_inputs().items()}, "scale boundaries": boundary}


def _one_step_above_a_power_of_two(q: torch.Tensor) -> torch.Tensor:
    mantissa, _ = torch.frexp(q)
    return mantissa == torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))


@pytest.mark.parametrize("element", ["e4m3", "e2m1"])
def test_mx_rceil_is_transformer_engines_value_for_value(element: str) -> None:
    """``scale_mode="rceil"`` (Transformer Engine's and torchao's option, its scale rounded up) gives Transformer
    Engine's scales and elements on every input. At the scale boundaries MXFP8's are its kernels' (the quotient
    rounded up exactly); Transformer Engine's MXFP4 reference takes log2 in float32, which rounds a quotient one
    float32 step above 2**k (k + 1.7e-7) to k where |k| >= 2: there it is a binade lower and the block's largest
    element saturates by that step (docs/block-scaled.md); every other block agrees."""
    for case, x in _mx_inputs().items():
        q = quantize_mx(x, element, mode="rceil")
        elements, scales = _te_mx(x, element)
        kept = torch.ones(len(x), dtype=torch.bool)
        if element == "e2m1":
            kept = ~_one_step_above_a_power_of_two(x.abs().amax(-1) / 6.0)
            assert case != "scale boundaries" or (~kept).sum() >= 25  # what the exception covers, present
        assert torch.equal(q.scales[kept].reshape(-1, 1), scales[kept]), case
        assert torch.equal(q.elements.reshape(-1, 32)[kept], elements[kept]), case


@pytest.mark.parametrize("element", ["e4m3", "e2m1"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mx_casts_agree_with_torchaos_value_for_value(element: str, mode: str) -> None:
    """Both scale modes, every value of every input; for MXFP4's RCEIL torchao too takes log2 in float32 (the test
    above says what that does at a scale boundary)."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    dtype = {"e4m3": torch.float8_e4m3fn, "e2m1": torch.float4_e2m1fn_x2}[element]
    scaling = {"floor": config.ScaleCalculationMode.FLOOR, "rceil": config.ScaleCalculationMode.RCEIL}[mode]
    for case, x in _mx_inputs().items():
        theirs = mx.MXTensor.to_mx(x, dtype, block_size=32, scaling_mode=scaling).dequantize(torch.float32)
        ours = quantize_mx(x, element, mode=mode).values
        kept = torch.ones(len(x), dtype=torch.bool)
        if (element, mode) == ("e2m1", "rceil"):
            kept = ~_one_step_above_a_power_of_two(x.abs().amax(-1) / 6.0)
        assert torch.equal(ours[kept], theirs[kept]), case
