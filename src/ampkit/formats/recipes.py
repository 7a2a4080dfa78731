"""The vocabulary of narrow formats: FP8 dtypes and roles, and the recipes that configure them.

Frozen dataclasses and constants (torchao's ``float8/config.py`` is the model). This
module imports nothing of ampkit.
"""

from __future__ import annotations

import dataclasses

import torch

STATE_VERSION = 1
FORMATS = ("e4m3", "hybrid")
SCALINGS = ("delayed", "current")
GRANULARITIES = ("tensor", "row")
AMAX_ALGOS = ("max", "most_recent")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALLEST_SUBNORMAL = {E4M3: 2.0**-9, E5M2: 2.0**-16}
MAX_MARGIN = 8  # binades of headroom a delayed scale may leave (Transformer Engine's recipes use 0)
INPUT, WEIGHT, GRAD = 0, 1, 2  # rows of a delayed-scaling module's amax history and scales


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How FP8 linears scale and which formats they use.

    Attributes:
        scaling: ``"delayed"`` (default: amax history, ampkit's own) or ``"current"`` (torchao).
        format: ``"hybrid"`` (default: E4M3 forward, E5M2 gradients) or ``"e4m3"`` (everywhere).
        granularity: ``"tensor"`` or ``"row"`` (one scale per row; current scaling only).
        amax_history_len: steps of amax kept per tensor (delayed scaling; default 16).
        amax_compute_algo: ``"max"`` of the history (default) or its ``"most_recent"`` entry.
        margin: the scale is divided by ``2**margin`` (headroom against growth; default 0).
        fsdp_all_gather: under FSDP2 (``ampkit.distributed.fully_shard``), all-gather the weights in
            FP8 (torchao's ``enable_fsdp_float8_all_gather``: a quarter of float32's bytes on the
            wire); current scaling only (default False: weights all-gather in their own dtype).
    """

    scaling: str = "delayed"
    format: str = "hybrid"
    granularity: str = "tensor"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    fsdp_all_gather: bool = False

    def __post_init__(self) -> None:
        for name, choices in (("scaling", SCALINGS), ("format", FORMATS), ("granularity", GRANULARITIES),
                              ("amax_compute_algo", AMAX_ALGOS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"Fp8Recipe({name}={getattr(self, name)!r}) is invalid: choose one of {list(choices)}.")
        # A margin leaves 2**margin of headroom below the format's largest value; past MAX_MARGIN binades most
        # of E4M3's ~18 binades are given up and small values flush to zero (margin=200 made every output NaN).
        for name, low, high in (("amax_history_len", 1, None), ("margin", 0, MAX_MARGIN)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                bounds = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
                raise ValueError(f"Fp8Recipe({name}={value!r}) is invalid: use {bounds}.")
        if not isinstance(self.fsdp_all_gather, bool):
            raise ValueError(f"Fp8Recipe(fsdp_all_gather={self.fsdp_all_gather!r}) is not a bool: pass True or False.")
        if self.fsdp_all_gather and (self.scaling, self.granularity) != ("current", "tensor"):
            raise ValueError(f"Fp8Recipe(fsdp_all_gather=True) needs scaling='current' and granularity='tensor' "
                             f"(got {self.scaling!r}, {self.granularity!r}): torchao all-gathers tensorwise FP8 "
                             "weights; ampkit's delayed scaling all-gathers weights in their own dtype.")
        if self.granularity == "row" and self.scaling == "delayed":
            raise ValueError("Fp8Recipe(granularity='row') needs scaling='current': delayed scaling keeps one amax "
                             "history per tensor (as Transformer Engine does).")

    def dtype(self, role: int) -> torch.dtype:
        """The FP8 dtype of ``INPUT``, ``WEIGHT`` or ``GRAD`` tensors."""
        return E5M2 if role == GRAD and self.format == "hybrid" else E4M3


BLOCK_FORMATS = ("mxfp8", "mxfp4", "nvfp4")
BLOCK_SIZES = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}


@dataclasses.dataclass(frozen=True)
class BlockScaledRecipe:
    """How block-scaled linears quantize each GEMM's operands (``ampkit.convert_to_block_scaled``).

    Every GEMM of forward and backward quantizes both operands along its own reduction dimension (the
    input features for the output, the output features for the input gradient, the tokens for the
    weight gradient), as block-scaled hardware requires: a tensor and its transpose are quantized apart.

    Attributes:
        format: ``"mxfp8"`` (default: E4M3 elements, 32-element blocks, E8M0 scales), ``"mxfp4"`` (E2M1,
            32, E8M0) or ``"nvfp4"`` (E2M1, 16, E4M3 scales under a float32 tensor scale).
        element: MXFP8's element type, ``"e4m3"`` (default) or ``"e5m2"``.
        scale_mode: MX formats: ``"floor"`` (default, the OCP spec's) or ``"rceil"`` (no element saturates).
        weight_tiles: NVFP4: 16x16 weight blocks (default: True for NVFP4; the MX formats have none), so
            that the forward and the input gradient see the same quantized weight.
        stochastic_gradients: stochastic rounding in the backward (default: True for NVFP4, False for MX). NVFP4:
            of the output gradients. MXFP4 (Tseng et al., arXiv 2502.20586): of both operands of both backward
            GEMMs, each block scaled by 3/4 first so that no element clips (the spec's FLOOR scale maps a block's
            largest value up to 8, past E2M1's 6), the decoded values scaled back.
        hadamard: a random Hadamard transform (random signs, fixed by ``hadamard_seed``, default 0) along the
            reduction dimension. NVFP4: 16x16, of the weight-gradient GEMM's operands (default: True). MXFP4:
            64x64 (Tseng et al.'s default block), of both backward GEMMs' operands (default: False).
        quantize_forward: the forward GEMM on block-scaled operands (default True); False computes it as the
            model's own linear (16-bit operands, float32 accumulation) and quantizes the backward alone (Tseng et
            al.'s MXFP4 recipe: BF16 forward, MXFP4 backward).
        four_over_six: NVFP4: each block scaled so that its amax maps to 6 or to 4, whichever decodes with the
            smaller squared error (Four Over Six, arXiv 2512.02010; default False, as Transformer Engine's recipe).
        keep: name patterns (``fnmatch``) of linears kept in 16 bits.
        keep_first_last: keep the model's first and last linears in 16 bits (default: True for NVFP4, as
            the NVFP4 pretraining recipe, False for MX).
        gemm: None (default: emulated, float32 GEMMs on the decoded values) or a native kernel
            ``gemm(a, b) -> a @ b.T`` taking two ``Quantized`` operands quantized along their last axis
            (Blackwell-class GPUs, compute capability 10.0; none is tested here).
        compiled_casts: emulated GEMMs quantize their operands through ``torch.compile`` (default True: the
            quantization's thirty-odd elementwise passes fused into a few; the same values, bit for bit; a
            one-time compile of several seconds per format). Where torch.compile cannot build them (no C++
            compiler), ampkit says so once and quantizes eagerly.
    """

    format: str = "mxfp8"
    element: str = "e4m3"
    scale_mode: str = "floor"
    weight_tiles: bool | None = None
    stochastic_gradients: bool | None = None
    hadamard: bool | None = None
    hadamard_seed: int = 0
    four_over_six: bool = False
    quantize_forward: bool = True
    keep: tuple[str, ...] = ()
    keep_first_last: bool | None = None
    gemm: object = dataclasses.field(default=None, compare=False)
    compiled_casts: bool = True

    def __post_init__(self) -> None:
        if self.format not in BLOCK_FORMATS:
            raise ValueError(f"BlockScaledRecipe(format={self.format!r}) is invalid: choose one of {list(BLOCK_FORMATS)}.")
        if self.element not in ("e4m3", "e5m2") or (self.format != "mxfp8" and self.element != "e4m3"):
            raise ValueError(f"BlockScaledRecipe(element={self.element!r}) is invalid: 'e4m3' or 'e5m2', for mxfp8 "
                             "(mxfp4 and nvfp4 have E2M1 elements).")
        if self.scale_mode not in ("floor", "rceil") or (self.format == "nvfp4" and self.scale_mode != "floor"):
            raise ValueError(f"BlockScaledRecipe(scale_mode={self.scale_mode!r}) is invalid: 'floor' or 'rceil', for "
                             "the MX formats (NVFP4's scales are E4M3 values, not powers of two).")
        parts = {"weight_tiles": ("nvfp4",), "stochastic_gradients": ("nvfp4", "mxfp4"),
                 "hadamard": ("nvfp4", "mxfp4")}
        for name in (*parts, "keep_first_last"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or value is None):
                raise ValueError(f"BlockScaledRecipe({name}={value!r}) is not a bool: pass True or False.")
            if value and self.format not in parts.get(name, BLOCK_FORMATS):
                raise ValueError(f"BlockScaledRecipe({name}=True) is part of the {' and '.join(parts[name])} "
                                 f"recipe{'s' if len(parts[name]) > 1 else ''}: drop it for format={self.format!r}.")
            if value is None:
                object.__setattr__(self, name, self.format == "nvfp4")
        if not isinstance(self.four_over_six, bool) or (self.four_over_six and self.format != "nvfp4"):
            raise ValueError(f"BlockScaledRecipe(four_over_six={self.four_over_six!r}) is a bool, True for NVFP4 "
                             f"only (MX block scales are powers of two): drop it for format={self.format!r}.")
        if isinstance(self.hadamard_seed, bool) or not isinstance(self.hadamard_seed, int):
            raise ValueError(f"BlockScaledRecipe(hadamard_seed={self.hadamard_seed!r}) is not an integer.")
        if isinstance(self.keep, str) or not all(isinstance(k, str) for k in self.keep):
            raise ValueError(f"BlockScaledRecipe(keep={self.keep!r}) must be a tuple of name patterns, e.g. "
                             "('lm_head', 'blocks.0.*').")
        if not isinstance(self.quantize_forward, bool):
            raise ValueError(f"BlockScaledRecipe(quantize_forward={self.quantize_forward!r}) is not a bool: pass True "
                             "or False.")
        if not isinstance(self.compiled_casts, bool):
            raise ValueError(f"BlockScaledRecipe(compiled_casts={self.compiled_casts!r}) is not a bool: pass True or "
                             "False.")
        if self.gemm is not None and not callable(self.gemm):
            raise ValueError(f"BlockScaledRecipe(gemm={self.gemm!r}) is not callable: pass a native kernel or None.")
        mxfp4 = self.format == "mxfp4"
        emulated = [name for name, on in (("quantize_forward=False", not self.quantize_forward),
                                          ("stochastic_gradients", mxfp4 and self.stochastic_gradients),
                                          ("hadamard", mxfp4 and self.hadamard)) if on]
        if self.gemm is not None and emulated:
            raise ValueError(f"BlockScaledRecipe(gemm=...) with {', '.join(emulated)}: the 16-bit forward and "
                             "MXFP4's recipe (3/4-scaled blocks, whose scales are no powers of two) are emulated "
                             "only: drop gemm, or those options.")
        object.__setattr__(self, "keep", tuple(self.keep))

    @property
    def block(self) -> int:
        """Elements per block: 32 (MX) or 16 (NVFP4)."""
        return BLOCK_SIZES[self.format]

    @property
    def hadamard_size(self) -> int:
        """The random Hadamard transform's size: 16 (NVFP4) or 64 (MXFP4, Tseng et al.'s default)."""
        return 16 if self.format == "nvfp4" else 64

    @property
    def label(self) -> str:
        """The recipe in a run's label: ``mxfp8-floor``, ``mxfp4-floor-sr-hadamard-fwd16``, ``nvfp4``,
        ``nvfp4-no-hadamard`` ..."""
        forward = "" if self.quantize_forward else "-fwd16"
        if self.format != "nvfp4":
            element = "" if self.element == "e4m3" else f"-{self.element}"
            on = "".join(f"-{name}" for name, part in (("sr", self.stochastic_gradients), ("hadamard", self.hadamard))
                         if part)
            return f"{self.format}{element}-{self.scale_mode}{on}{forward}"
        off = [name for name, on in (("tiles", self.weight_tiles), ("sr", self.stochastic_gradients),
                                     ("hadamard", self.hadamard), ("kept", self.keep_first_last)) if not on]
        return "nvfp4" + "".join(f"-no-{name}" for name in off) + ("-4over6" if self.four_over_six else "") + forward


# Tseng et al.'s MXFP4 recipe (arXiv 2502.20586): a 16-bit forward, an MXFP4 backward with the random Hadamard
# transform and stochastic rounding (compare's and tune's "mxfp4-recipe")
MXFP4_RECIPE = BlockScaledRecipe("mxfp4", stochastic_gradients=True, hadamard=True, quantize_forward=False)

CONVERTED_BY = ("ampkit.formats.", "torchao.")  # the modules whose linears are converted ones already


def is_conv1d(module: torch.nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): a linear that stores its weight transposed, (in, out), with
    ``nf`` output features. Told by its name and layout, so that ampkit never imports transformers."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1])


def linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers ampkit's formats convert, in model order: each plain ``nn.Linear`` and each ``Conv1D``.

    A subclass of ``nn.Linear`` is not one of them: it may compute otherwise (``MultiheadAttention`` never calls
    its ``out_proj``); ``unconverted_linears`` names it."""
    return [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear or is_conv1d(m)]


def features(layer: torch.nn.Module) -> tuple[int, int]:
    """A convertible layer's ``(in_features, out_features)``."""
    if is_conv1d(layer):
        return int(layer.weight.shape[0]), int(layer.weight.shape[1])  # type: ignore[union-attr, index]
    return layer.in_features, layer.out_features  # type: ignore[return-value]


def unconverted_linears(model: torch.nn.Module) -> dict[str, str]:
    """The model's linear-like layers that ampkit's formats leave (a leaf with a 2-D weight that is no embedding,
    no plain ``nn.Linear`` and no ``Conv1D``), each with why conversions keep it: they are named, never skipped
    silently."""
    lookups = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    convertible = {name for name, _ in linear_layers(model)}
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (name in convertible or isinstance(module, lookups) or next(module.children(), None)
                or not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2
                or type(module).__module__.startswith(CONVERTED_BY)):
            continue
        kind = "subclasses nn.Linear and may compute otherwise" if isinstance(module, torch.nn.Linear) else \
            "is linear-like (a 2-D weight) but no nn.Linear"
        found[name] = (f"kept: a {type(module).__name__} {kind}; ampkit converts plain nn.Linear and transformers' "
                       "Conv1D layers only")
    return found


def converted_layers(model: torch.nn.Module) -> dict[str, str]:
    """The model's linears in a narrow format already (ampkit's FP8 and block-scaled layers, torchao's): each
    name with its class. A conversion or ``tune`` refuses such a model: one format over another is not a plan."""
    return {name: type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m).__module__.startswith(CONVERTED_BY)}


def refuse_converted(model: torch.nn.Module, what: str) -> None:
    """ValueError naming the layers ``converted_layers`` finds, for ``what`` (``"convert_to_block_scaled"``), and for
    a model FSDP2 has sharded (its layers are FSDP2's own classes, holding shards: a conversion came out garbled)."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError(f"{what} takes the model before FSDP2 shards it, and this one is sharded (its parameters "
                             "are DTensors): apply it to the float32 model first, then ampkit.distributed.fully_shard "
                             "(which shards the converted layers as any other).")
    if found := converted_layers(model):
        named = ", ".join(f"{name} ({kind})" for name, kind in list(found.items())[:3])
        raise ValueError(f"{what} takes a model as built, and {len(found)} of this model's linears are converted "
                         f"already: {named}{' ...' if len(found) > 3 else ''}. Apply it to a fresh copy of the "
                         "float32 model (one narrow format over another would replace or skip them silently).")



def check_recipe(recipe: object, kind: type) -> None:
    """Refuse a ``recipe`` that is no ``kind`` (``Fp8Recipe``, ``BlockScaledRecipe``): a format's name passed as
    one was an AttributeError deep inside the conversion."""
    if not isinstance(recipe, kind):
        example = f"format={recipe!r}" if isinstance(recipe, str) else ""
        raise ValueError(f"recipe={recipe!r} is a {type(recipe).__name__}, not a {kind.__name__}: pass one, e.g. "
                         f"{kind.__name__}({example}), or None for the default.")
