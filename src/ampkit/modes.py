"""The vocabulary of mixed precision: the 16-bit dtypes and the compute modes.

This module imports nothing of ampkit (a leaf: every other module may use it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_Backward = TypeVar("_Backward", bound=Callable[..., Any])

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


def without_autocast(backward: _Backward) -> _Backward:
    """Run a custom autograd Function's ``backward`` with autocast off on its gradients' device.

    Eager autograd runs a backward where ``.backward()`` is called, outside the region as a rule; torch.compile
    traces it under the forward's autocast state instead, which cast the float32 GEMMs of ampkit's emulations
    (float32 compute, block-scaled formats) to 16 bits: inductor then ran a native bfloat16 GEMM where eager
    runs a float32 one (1.6x slower a GPT step on a CPU without bf16 arithmetic). Off, both run what is written.
    """

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return backward(ctx, *grads)

    return run  # type: ignore[return-value]
