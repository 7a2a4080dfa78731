"""How allow-list ops compute: natively in 16 bits, or in float32 on 16-bit values.

A mixed precision policy decides two things that torch.autocast ties together:
the 16-bit format values are *rounded to and stored in*, and the arithmetic
its GEMMs and convolutions *compute* in. Tensor cores and CPUs with AVX-512
BF16 compute 16-bit GEMMs natively and fast. A CPU without them (AVX2 only)
emulates them in software, many times slower than float32 (as
``ampkit.measure()`` finds; never assumed). There ampkit computes those
ops in float32 on the 16-bit values and rounds the result back to 16 bits,
forward and backward:

- memory is a native run's: autograd saves the 16-bit tensors (less where a linear
  reads a GELU's output: it recomputes that instead of saving it, see ``gelu_recompute.py``);
- the numerics are a tensor core's (16-bit inputs, float32 accumulation,
  output rounded once), so the same mode emulates GPU numerics on any CPU,
  float16 overflow to inf and subnormals included;
- elementwise ops stay in 16 bits, where halving the bytes makes them faster.

Which ops a policy computes so, ``precision/decide.py`` decides; the generic path (any op on float32 copies,
its backward recomputed) is ``generic.py``; linear, convolutions and attention take ``fast_paths.py``; a linear
after a GELU recomputes its input (``gelu_recompute.py``); ``weights.py`` tells memory accounting which saved
tensors are weights. Every one stands on public mechanisms: autograd Functions and ``torch.library`` custom ops
(``single_ops.py``). ``run_in_float32`` below is the one entry point the autocast kernels call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampkit.float32_compute.fast_paths import FAST
from ampkit.float32_compute.generic import run_generic


def run_in_float32(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` with its GEMMs and convolutions computed in float32.

    16-bit inputs stay 16-bit (autograd saves them as they are); the op, forward and backward, computes on
    float32 copies and rounds its output to the dtype the native kernel would return.
    """
    fast = FAST.get(fn)
    if fast is not None:
        result = fast(*args, **kwargs)
        if result is not NotImplemented:
            return result
    return run_generic(fn, args, kwargs)
