"""Block-scaled formats, exact to their specifications: MXFP8, MXFP4 (OCP Microscaling Formats v1.0)
and NVFP4 (as Transformer Engine documents it). Pure functions of tensors: quantize, dequantize, and the
statistics of a cast.

- **MX** (OCP MX v1.0, section 6.3): blocks of 32 consecutive elements along one axis share an E8M0 scale
  ``X = 2**e`` (E8M0: exponents -127..127, 0xFF = NaN). FLOOR, the spec's rule: ``e = floor(log2(amax)) -
  emax_elem`` (emax_elem: the exponent of the element type's largest normal, E4M3 8, E5M2 15, E2M1 2), so
  values between the largest power of two and amax may pass the element type's maximum and saturate to it.
  RCEIL (Transformer Engine's, torchao's): ``e = ceil(log2(amax / max_elem))``: no element saturates, at
  up to one binade less precision. The elements ``V / X`` are rounded to nearest, ties to even, and
  saturated to +-max_elem (E4M3 448, E5M2 57344, E2M1 6). A block holding NaN or +-Inf gets the NaN scale and
  decodes to NaN (E4M3 and E2M1 have no Inf); an all-zero block gets the smallest scale, 2**-127.
- **NVFP4**: blocks of 16 share an E4M3 scale, under a float32 per-tensor scale ``s = 448 * 6 / amax``
  (amax over the tensor's finite values; 1 when it is 0): a block's scale is ``e4m3((amax_block / 6) * s)``
  (nearest even, saturated at 448), its elements ``e2m1(v * (s / scale))``, decoded as ``q * scale / s``
  (float32 operations in that order, as Transformer Engine's kernels). A block whose
  scale rounds to 0 decodes to 0; a block holding NaN or +-Inf decodes to NaN. ``tile=16`` makes 16x16
  blocks of a 2-D tensor (the NVFP4 training recipe's weights: a weight and its transpose quantize alike).
  ``four_over_six`` (Four Over Six, arXiv 2512.02010): E2M1 has no value between 4 and 6, so a block's values
  at 67-100% of its amax lose most; each block is quantized twice, its amax to 6 and (a scale 1.5x larger) to 4,
  and keeps the one whose decoded values are nearer its own in squared error (a tie keeps 6). ``s`` is then
  ``256 * 6 / amax``, so that a block scale times 1.5 stays within E4M3 (as the paper's reference quantizer).

Elements are E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) or torch's float8 dtypes (torch's casts
round to nearest even; ampkit clamps first, so they saturate as the specs say). Everything runs in
float32 on any device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ampkit.formats.recipes import E4M3, E5M2

E2M1_MAX, E4M3_MAX, E5M2_MAX = 6.0, 448.0, 57344.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# The element types: (largest normal, the exponent of the largest normal's power of two, torch dtype or None).
ELEMENTS = {"e4m3": (E4M3_MAX, 8, E4M3), "e5m2": (E5M2_MAX, 15, E5M2), "e2m1": (E2M1_MAX, 2, None)}


# The code below reads the constants above through element_type(), never as module floats:
# under torch.compile(dynamic=True) dynamo makes every float it reads from a module a symbolic input, and one read
# inside a block-scaled layer's autograd.Function was reused by the next layer's, where dynamo failed an assertion
# ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer"; torch 2.11-2.15).
@torch.compiler.assume_constant_result
def element_type(name: str) -> tuple[float, int, torch.dtype | None]:
    """``ELEMENTS[name]``, a constant to torch.compile."""
    return ELEMENTS[name]



SCALE_MODES = ("floor", "rceil")
# Four Over Six's block scales stay at or below 256 before the 1.5x that scales a block to 4 (384 <= E4M3's 448).
FOUR_OVER_SIX_SCALE_MAX = 256.0
E8M0_MIN, E8M0_MAX = -127, 127


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A block-scaled tensor: its decoded values, its elements and block scales, and how the cast went.

    Attributes:
        values: the decoded float32 values (elements times scales), shaped as the input.
        elements: the elements, shaped as the input, as float32 values of the element type's grid.
        scales: one float32 per block (MX: a power of two, or NaN; NVFP4: an E4M3 value), blocks in the
            input's order with the blocks' axis last.
        tensor_scale: NVFP4's per-tensor float32 scale ``s`` (1.0 for MX).
        block_saturated: a bool per block: one of its scaled values passed the element type's maximum.
        block_range: a float per block: its largest over its smallest nonzero magnitude (1.0 for a block
            of zeros), as Transformer Engine's debug tools report it.
        flushed: a bool per element: nonzero, decoded as zero.
    """

    values: torch.Tensor
    elements: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    block_saturated: torch.Tensor
    block_range: torch.Tensor
    flushed: torch.Tensor


def _block_range(blocks: torch.Tensor) -> torch.Tensor:
    magnitude = blocks.abs()
    largest = magnitude.amax(-1)
    smallest = torch.where(magnitude > 0, magnitude, torch.full_like(magnitude, math.inf)).amin(-1)
    return torch.where(largest > 0, largest / smallest, torch.ones_like(largest))


# Uniform [0, 1) float32 draws of a shape: stochastic rounding's source of randomness, beside a torch.Generator.
Draws = Callable[[torch.Size], torch.Tensor]
_MASK = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32), exactly and without int64 overflow (which inductor's
    C++ would leave undefined): the product in two 16-bit halves of ``c``."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons, hash-prospector): a 32-bit integer hash, on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_draws(seed: int, counter: torch.Tensor, stream: int) -> Draws:
    """Uniform [0, 1) draws hashed from (``seed``, ``counter``, ``stream``, each element's index): a pure function
    of tensors, so torch.compile traces it (it cannot trace a draw from a ``torch.Generator``) and a compiled
    step draws exactly what the eager step draws. ``counter`` is an int64 scalar tensor (a layer's step count);
    ``stream`` (0 to 7) tells apart the draws of one step. 24-bit draws, exact in float32."""
    def draws(shape: torch.Size) -> torch.Tensor:
        key = _hash32((_hash32((counter * 8 + stream) & _MASK) + (seed & _MASK)) & _MASK)
        index = torch.arange(math.prod(shape), dtype=torch.int64, device=counter.device)
        bits = _hash32(_hash32((index + key) & _MASK) ^ key)
        return ((bits >> 8).to(torch.float32) * 2.0 ** -24).reshape(shape)

    return draws


def round_e2m1(x: torch.Tensor, generator: torch.Generator | Draws | None = None,
               stochastic: bool = False) -> torch.Tensor:
    """Round float32 ``x`` to E2M1: to nearest, ties to even (or stochastically, unbiased), saturated at +-6.

    Args:
        x: float32 values.
        generator: stochastic rounding's random draws: a ``torch.Generator``, or ``Draws`` (``counter_draws``).
        stochastic: round up with probability (x - lower) / (upper - lower) instead of to nearest.

    Returns:
        float32 values of the E2M1 grid; NaN stays NaN.
    """
    # E2M1's grid is evenly spaced within each binade: steps of 0.5 below 2, 1 from 2 to 4, 2 from 4 to 6, so
    # rounding is a division by the step (exact: a power of two), torch's round (ties to even: the even multiple is
    # the even code) and a multiplication back; no search of the grid (bucketize cost more than the GEMM).
    magnitude = x.abs().clamp(max=element_type("e2m1")[0])
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    steps = magnitude / step
    if stochastic:
        lower = torch.floor(steps)
        draw = (generator(x.shape).to(x.device) if callable(generator)
                else torch.rand(x.shape, generator=generator, device=x.device))
        rounded = (lower + (draw < steps - lower).float()) * step  # up with probability (|x| - lower) / step
    else:
        rounded = torch.round(steps) * step
    return torch.where(torch.isnan(x), x, torch.copysign(rounded, x))


def round_element(x: torch.Tensor, element: str, generator: torch.Generator | Draws | None = None,
                  stochastic: bool = False) -> torch.Tensor:
    """``x`` (float32, already scaled) on ``element``'s grid, saturated at its maximum: nearest even, or
    stochastic rounding for E2M1. Returns float32 values."""
    largest, _, dtype = element_type(element)
    if dtype is None:
        return round_e2m1(x, generator, stochastic)
    if stochastic:
        raise ValueError(f"stochastic rounding is implemented for E2M1 elements, not {element}.")
    return x.clamp(-largest, largest).to(dtype).float()  # clamp keeps NaN; torch's cast is nearest even


def _blocks(x: torch.Tensor, axis: int, block: int) -> tuple[torch.Tensor, int]:
    """``x`` as (..., blocks, block) along ``axis`` (zero-padded to a whole block), and the pad."""
    moved = x.float().movedim(axis, -1)
    pad = (-moved.shape[-1]) % block
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    # contiguous: a GEMM's operand blocked along its first axis (the weight gradient's tokens) is otherwise a strided
    # view, and every elementwise op and reduction after it ran several times slower
    return moved.reshape(*moved.shape[:-1], -1, block).contiguous(), pad


def _unblocks(blocks: torch.Tensor, pad: int, axis: int) -> torch.Tensor:
    flat = blocks.reshape(*blocks.shape[:-2], -1)
    if pad:
        flat = flat[..., :-pad]
    return flat.movedim(-1, axis)


def mx_scale_exponent(amax: torch.Tensor, element: str, mode: str) -> torch.Tensor:
    """The E8M0 exponent of blocks whose largest magnitude is ``amax`` (float32), clamped to -127..127;
    NaN where amax is NaN or Inf (the 0xFF scale)."""
    largest, emax, _ = element_type(element)
    if mode == "floor":
        _, exponent = torch.frexp(amax)  # amax = m * 2**k, m in [0.5, 1): floor(log2(amax)) = k - 1, exactly
        e = (exponent - 1 - emax).float()
    else:  # the float32 quotient amax / largest rounded up to a power of two, as Transformer Engine's MXFP8 kernels
        # do: the least e with amax <= largest * 2**e, exactly (for 448, 57344 and 6 a float32 step of amax moves
        # the quotient by more than half a step, so it never rounds onto 2**e from above it)
        mantissa, exponent = torch.frexp(amax / largest)  # mantissa in [0.5, 1)
        e = torch.where(mantissa == 0.5, exponent - 1, exponent).float()
    e = torch.where(amax == 0, torch.full_like(e, E8M0_MIN), e).clamp(E8M0_MIN, E8M0_MAX)
    return torch.where(torch.isfinite(amax), e, torch.full_like(e, math.nan))


def quantize_mx(x: torch.Tensor, element: str = "e4m3", axis: int = -1, block: int = 32, mode: str = "floor",
                generator: torch.Generator | Draws | None = None, stochastic: bool = False) -> Quantized:
    """MX-quantize ``x`` in blocks of ``block`` along ``axis`` (see the module docstring).

    Args:
        x: any floating tensor.
        element: ``"e4m3"``, ``"e5m2"`` (MXFP8) or ``"e2m1"`` (MXFP4).
        axis: the blocks' axis (a GEMM's reduction dimension).
        block: elements per block (the spec's 32).
        mode: ``"floor"`` (the spec's) or ``"rceil"``.
        generator: stochastic rounding's random draws (a ``torch.Generator`` or ``Draws``).
        stochastic: stochastic rounding of E2M1 elements, unbiased: each block scaled by 3/4 first (Tseng et al.,
            arXiv 2502.20586, its code's ``dither_scale``: the FLOOR scale maps a block's largest value up to 8,
            past E2M1's 6, where rounding clips), so its scale is ``2**e * 4/3``.

    Returns:
        ``Quantized``: ``.values`` are the decoded float32 values.
    """
    blocks, pad = _blocks(x, axis, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    amax = torch.where(torch.isnan(blocks).any(-1, keepdim=True), torch.full_like(amax, math.nan), amax)
    e = mx_scale_exponent(amax, element, mode)
    scaled = torch.ldexp(blocks, -torch.nan_to_num(e, nan=0.0))  # exact: a power of two
    scaled = torch.where(torch.isnan(e), torch.full_like(scaled, math.nan), scaled)
    if stochastic:  # 3/4 of the block: below 6 (FLOOR) or at most 4.5 (RCEIL), never clipped; as Tseng et al.'s
        # code computes it: 3 x / 2**(e+2), and back by x 2**(e+2) / 3
        scaled = torch.where(torch.isnan(e), scaled, 3 * torch.ldexp(blocks, -torch.nan_to_num(e, nan=0.0) - 2))
        elements = round_element(scaled, element, generator, stochastic)
        decoded, scale = elements * torch.exp2(e + 2) / 3, torch.exp2(e + 2) / 3
    else:
        elements = round_element(scaled, element, generator, stochastic)
        decoded, scale = elements * torch.exp2(e), torch.exp2(e)
    return Quantized(_unblocks(decoded, pad, axis), _unblocks(elements, pad, axis), scale.squeeze(-1),
                     torch.ones((), device=x.device), (scaled.abs() > element_type(element)[0]).any(-1),
                     _block_range(blocks), _unblocks((blocks != 0) & (decoded == 0), pad, axis))


def quantize_nvfp4(x: torch.Tensor, axis: int = -1, tile: int | None = None,
                   generator: torch.Generator | Draws | None = None, stochastic: bool = False,
                   four_over_six: bool = False) -> Quantized:
    """NVFP4-quantize ``x``: E2M1 elements in blocks of 16 along ``axis`` (or, with ``tile=16``, in 16x16
    tiles of a 2-D tensor), E4M3 block scales, a float32 per-tensor scale (see the module docstring).

    Args:
        x: any floating tensor (2-D with ``tile``).
        axis: the blocks' axis (ignored with ``tile``).
        tile: None (1-D blocks of 16) or 16 (16x16 tiles).
        generator: stochastic rounding's random draws (a ``torch.Generator`` or ``Draws``).
        stochastic: stochastic rounding of the elements (the recipe's gradients).
        four_over_six: each block scaled so that its largest magnitude maps to 6 or to 4, whichever decodes
            with the smaller squared error (Four Over Six, arXiv 2512.02010; see the module docstring).

    Returns:
        ``Quantized``.
    """
    x = x.float()
    finite = torch.isfinite(x)
    amax = torch.where(finite, x.abs(), torch.zeros_like(x)).amax()
    # Clamped to float32's largest: below an amax of about 8e-36 the quotient overflows to inf, and a block of
    # zeros then decoded to 0 x inf = NaN (one tiny output gradient made every weight-gradient value NaN).
    e2m1_max, e4m3_max = element_type("e2m1")[0], element_type("e4m3")[0]
    ceiling = FOUR_OVER_SIX_SCALE_MAX if four_over_six else e4m3_max  # block scales' largest before a 1.5x
    tensor_scale = torch.where(amax > 0, (ceiling * e2m1_max) / amax, torch.ones_like(amax)).clamp(
        max=torch.finfo(torch.float32).max)
    if tile is not None:
        if x.dim() != 2:
            raise ValueError(f"NVFP4 tiles need a 2-D tensor, got shape {tuple(x.shape)}.")
        rows, cols = x.shape
        padded = torch.nn.functional.pad(x, (0, (-cols) % tile, 0, (-rows) % tile))
        r, c = padded.shape
        blocks = padded.reshape(r // tile, tile, c // tile, tile).permute(0, 2, 1, 3).reshape(r // tile, c // tile,
                                                                                             tile * tile)
    else:
        blocks, pad = _blocks(x, axis, 16)
    bad = (~torch.isfinite(blocks)).any(-1, keepdim=True)
    block_amax = torch.where(torch.isfinite(blocks), blocks.abs(), torch.zeros_like(blocks)).amax(-1, keepdim=True)
    scale, scaled, elements = _nvfp4_blocks(blocks, block_amax, tensor_scale, 1.0, generator, stochastic)
    if four_over_six:  # the same blocks scaled to 4: where that decodes closer, it is the block's scale
        scale4, scaled4, elements4 = _nvfp4_blocks(blocks, block_amax, tensor_scale, 1.5, generator, stochastic)
        # the errors in the tensor scale's units (the block times s, at most 1536): in the input's own units a
        # huge block's squared error overflowed to inf and a tiny one's flushed to 0, a tie either way
        target = blocks * tensor_scale
        error6 = ((elements * scale - target) ** 2).sum(-1, keepdim=True)
        error4 = ((elements4 * scale4 - target) ** 2).sum(-1, keepdim=True)
        four = error4 < error6  # a tie keeps 6, as the paper's reference
        scale, scaled, elements = (torch.where(four, scale4, scale), torch.where(four, scaled4, scaled),
                                   torch.where(four, elements4, elements))
    elements = torch.where(bad, torch.full_like(elements, math.nan), elements)
    scale = torch.where(bad, torch.full_like(scale, math.nan), scale)
    decoded = elements * scale / tensor_scale
    saturated, spread = (scaled.abs() > e2m1_max).any(-1), _block_range(blocks)
    flushed = (blocks != 0) & (decoded == 0)
    if tile is not None:
        def untile(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(r // tile, c // tile, tile, tile).permute(0, 2, 1, 3).reshape(r, c)[:rows, :cols]

        return Quantized(untile(decoded), untile(elements), scale.squeeze(-1), tensor_scale, saturated, spread,
                         untile(flushed))
    return Quantized(_unblocks(decoded, pad, axis), _unblocks(elements, pad, axis), scale.squeeze(-1), tensor_scale,
                     saturated, spread, _unblocks(flushed, pad, axis))


def _nvfp4_blocks(blocks: torch.Tensor, block_amax: torch.Tensor, tensor_scale: torch.Tensor, expand: float,
                  generator: torch.Generator | Draws | None, stochastic: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 blocks' E4M3 scales (each block's amax to 6, or to 4 with ``expand`` 1.5), their scaled values and
    E2M1 elements."""
    e2m1_max, e4m3_max = element_type("e2m1")[0], element_type("e4m3")[0]
    # Transformer Engine's float32 operations, in its order (its reference quantizer, quantization_nvfp4.py, which
    # its kernels match bit for bit): the block scale is the block's amax times (s x 1/6); the elements' factor is
    # 1 / (scale x (1/s)). s / scale, one rounding apart, decided ties the other way: a bfloat16 input scaled to
    # 3.5 exactly with it and to 3.4999998 in Transformer Engine rounded to 4 instead of 3
    # (tests/test_block_scaled.py).
    scale = (block_amax * (tensor_scale * (1.0 / e2m1_max)) * expand).clamp(max=e4m3_max).to(E4M3).float()
    factor = torch.where(scale > 0, (1.0 / (scale * (1.0 / tensor_scale))).clamp(
        max=torch.finfo(torch.float32).max), torch.zeros_like(scale))  # finite: a zero times it stays zero
    scaled = blocks * factor
    return scale, scaled, round_e2m1(scaled, generator, stochastic)


def fake_quantize(x: torch.Tensor, format: str = "mxfp8", axis: int = -1, scale_mode: str = "floor",
                  tile: int | None = None, four_over_six: bool = False) -> torch.Tensor:
    """``x`` through a block-scaled format and back: the float32 values a GEMM on that format sees.

    Args:
        x: any floating tensor.
        format: ``"mxfp8"`` (E4M3 elements), ``"mxfp8-e5m2"``, ``"mxfp4"`` (E2M1) or ``"nvfp4"``.
        axis: the blocks' axis (a GEMM's reduction dimension; default the last).
        scale_mode: MX only: ``"floor"`` (default, the OCP spec's) or ``"rceil"`` (no element saturates).
        tile: NVFP4 only: 16 for 16x16 tiles of a 2-D tensor.
        four_over_six: NVFP4 only: each block scaled to 6 or to 4, whichever decodes nearer (Four Over Six).

    Returns:
        float32 values, shaped as ``x``.

    Raises:
        ValueError: an unknown format or scale mode, a tile or four_over_six with MX, a tile other than 16; ``x`` not a
            floating tensor, or ``axis`` not one of its dimensions.

    Example:
        >>> error = (ampkit.fake_quantize(w, "nvfp4") - w).abs().max()
    """
    check_block_format(format, scale_mode, tile, four_over_six)
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        raise ValueError(f"fake_quantize takes a floating tensor, not {type(x).__name__}"
                         f"{' of ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}: pass x.float().")
    if x.dim() == 0:  # one value: a block of one
        return fake_quantize(x.reshape(1), format, 0, scale_mode, tile, four_over_six).reshape(())
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis={axis} is not a dimension of x (shape {tuple(x.shape)}): pass -1 for the last, or "
                         f"0 to {x.dim() - 1}.")
    if x.numel() == 0:  # no block to scale
        return x.float().clone()
    if format == "nvfp4":
        return quantize_nvfp4(x, axis, tile, four_over_six=four_over_six).values
    return quantize_mx(x, MX_ELEMENTS[format], axis, mode=scale_mode).values


MX_ELEMENTS = {"mxfp8": "e4m3", "mxfp8-e5m2": "e5m2", "mxfp4": "e2m1"}


def check_block_format(format: str, scale_mode: str = "floor", tile: int | None = None,
                       four_over_six: bool = False) -> None:
    """Refuse an unknown format, scale mode, tile or scale choice (ValueError naming the choices)."""
    formats = [*MX_ELEMENTS, "nvfp4"]
    if format not in formats:
        raise ValueError(f"format={format!r} is not a block-scaled format: choose one of {formats}.")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r} is invalid: choose one of {list(SCALE_MODES)}.")
    if format == "nvfp4" and scale_mode != "floor":
        raise ValueError(f"scale_mode={scale_mode!r} applies to the MX formats: NVFP4's block scales are E4M3 "
                         "values, not powers of two. Drop scale_mode= for nvfp4.")
    if tile is not None and (format != "nvfp4" or tile != 16):
        raise ValueError(f"tile={tile!r}: only NVFP4 takes tiles, of 16 (16x16 blocks of a 2-D weight); pass "
                         "tile=None for 1-D blocks.")
    if not isinstance(four_over_six, bool) or (four_over_six and format != "nvfp4"):
        raise ValueError(f"four_over_six={four_over_six!r}: a bool, True for NVFP4 only (MX block scales are powers "
                         "of two, and Four Over Six chooses between two E4M3 scales); drop it for format="
                         f"{format!r}.")
