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
