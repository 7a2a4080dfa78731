"""The vocabulary of mixed precision: the 16-bit dtypes and the compute modes.

This module imports nothing of ampkit (a leaf: every other module may use it).
"""

from __future__ import annotations

import torch

LOW_DTYPES = (torch.float16, torch.bfloat16)
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

# How GEMMs and convolutions on 16-bit values compute (see ampkit.float32_compute).
COMPUTE_MODES = ("auto", "native", "float32")


class ComputeModeWarning(UserWarning):
    """Says, once per device, dtype and mode, that GEMMs compute in float32 on 16-bit values."""


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the 16-bit torch dtype named by ``dtype``.

    Raises:
        ValueError: ``dtype`` is not float16 or bfloat16.
    """
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if dtype in LOW_DTYPES:
        return dtype  # type: ignore[return-value]
    raise ValueError(
        f"Unsupported mixed precision dtype: {dtype!r}. Choose torch.float16 ('fp16') or "
        "torch.bfloat16 ('bf16'); float32 is what mixed precision falls back to, not a "
        "compute dtype to choose."
    )


def check_compute(compute: str) -> str:
    """Return ``compute`` if it is a compute mode, else raise ValueError."""
    if compute not in COMPUTE_MODES:
        raise ValueError(
            f"Unknown compute mode: {compute!r}. Choose one of {list(COMPUTE_MODES)}: 'native' runs 16-bit "
            "kernels, 'float32' computes GEMMs and convolutions in float32 on the 16-bit values, 'auto' "
            "picks per op class what the measured hardware runs faster."
        )
    return compute
