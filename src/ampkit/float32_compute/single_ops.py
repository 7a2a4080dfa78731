"""float32 compute's GEMMs and attention as one dispatcher op each, for selective recompute and torch.compile.

A fast-path forward (``fast_paths.py``) is several ATen ops: float32 copies of the 16-bit inputs, the
float32 GEMM, its result rounded to 16 bits. torch's selective activation checkpointing decides per
ATen op what to keep: keeping the GEMM's output would keep a float32 tensor, twice the bytes of the
16-bit one the model goes on with, and recomputing it recomputes the GEMM. Inside a selectively
recomputed block (``planning/selective.py`` turns ``single_ops`` on, in its forward and its recompute)
the fast paths call these custom ops instead, each the same expression as the fast path's, so the
checkpoint sees one GEMM whose output is the 16-bit tensor a native kernel returns.

While torch.compile traces they are single ops too. As plain ops, AOTAutograd's CSE merged the forward's
float32 conversion of each GEMM input with the backward's conversion of the same 16-bit tensor, and the
partitioner then saved that float32 copy for backward: compiled float32 compute saved about twice eager's
activation bytes (the GPT of ``ampkit compare``: 34.8 MiB against 17.7; inductor and aot_eager alike). The
conversions inside an opaque op cannot be merged, so the 16-bit tensors are what is saved. The cost is the
fusion inductor did of those conversions (BENCHMARKS.md, "torch.compile under every kind of policy").
Elsewhere the same functions run as plain ops. The fast paths call ``linear``, ``convolution`` and
``flash_attention`` here either way: one expression each.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ampkit import _torch
from ampkit.float32_compute.generic import Upcasts

_state = threading.local()


def active() -> bool:
    """Whether the fast paths run as single ops on this thread (inside a selectively recomputed block)."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def single_ops() -> Iterator[None]:
    """The fast paths run as single ops in here (re-entrant)."""
    before = active()
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: list[int], padding: list[int],
                 dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> torch.Tensor:
    out = torch.ops.aten.convolution(x.float(), w.float(), None if b is None else b.float(), stride, padding,
                                     dilation, transposed, output_padding, groups)
    return out.to(x.dtype)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                     scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    up = Upcasts()  # q, k and v are often views of one tensor: one conversion
    out, logsumexp = _torch.flash_attention_cpu(up(q), up(k), up(v), 0.0, is_causal, scale=scale)
    return out.to(q.dtype), logsumexp


# The same three as custom ops (the names planning/selective.py classifies), each calling the plain one.
_linear_op = torch.library.custom_op("ampkit::linear_in_float32", _linear, mutates_args=())
_convolution_op = torch.library.custom_op("ampkit::convolution_in_float32", _convolution, mutates_args=())
_flash_attention_op = torch.library.custom_op("ampkit::flash_attention_in_float32", _flash_attention,
                                              mutates_args=())


def _single() -> bool:
    """One op each: inside a selectively recomputed block, and while torch.compile traces."""
    return active() or _torch.is_compiling()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32 on 16-bit tensors, rounded to ``x``'s dtype: one op where ``_single()``."""
    return (_linear_op if _single() else _linear)(x, w, b)


def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *params: Any) -> torch.Tensor:
    """``aten.convolution`` in float32 on 16-bit tensors, rounded: one op where ``_single()``."""
    return (_convolution_op if _single() else _convolution)(x, w, b, *params)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention in float32 on 16-bit q, k, v: (the output rounded to q's dtype, the float32
    log-sum-exp); one op where ``_single()``."""
    return (_flash_attention_op if _single() else _flash_attention)(q, k, v, is_causal, scale)


@_linear_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@_convolution_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: list[int], padding: list[int],
      dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> torch.Tensor:
    return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@_flash_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
      scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    out, logsumexp = _torch.flash_attention_cpu(q.float(), k.float(), v.float(), 0.0, is_causal, scale=scale)
    return out.to(q.dtype), logsumexp
