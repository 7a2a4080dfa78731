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
activation bytes (the GPT of ``ampkit compare``, inductor and aot_eager alike). The
conversions inside an opaque op cannot be merged, so the 16-bit tensors are what is saved. The cost is the
fusion inductor did of those conversions (BENCHMARKS.md, "torch.compile under every kind of policy").
Elsewhere the same functions run as plain ops. The fast paths call ``linear``, ``convolution`` and
``attention`` here either way: one expression each. Attention's op carries its gradient (``attention_grads``,
its forward run again under autograd: torch's attention backward kernels are private), so a trace takes it whole.
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
from ampkit.modes import without_autocast

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


@without_autocast
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
               scale: float | None, enable_gqa: bool) -> torch.Tensor:
    up = Upcasts()  # q, k and v are often views of one tensor: one conversion
    out = F.scaled_dot_product_attention(up(q), up(k), up(v), attn_mask=_mask(attn_mask), is_causal=is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
    return out.to(q.dtype)


def _attention_contiguous(*args: Any) -> torch.Tensor:
    # The layout the fake kernel gives, whichever kernel torch picked (CPU's flash returns (batch, tokens, heads)).
    return _attention(*args).contiguous()


def _mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A boolean mask as it is; a 16-bit additive one in float32, as the float32 attention adds it."""
    return mask if mask is None or mask.dtype == torch.bool else mask.float()


@without_autocast
def attention_grads(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                    enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``attention`` for q, k and v, rounded to their dtype: its forward run again in float32
    under autograd (torch's attention backward kernels are private, and the forward saved the 16-bit q, k and v
    only; ``benchmarks/bench_attention_route.py`` times what this costs)."""
    up = Upcasts()
    q32, k32, v32 = (up(t).detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=_mask(attn_mask), is_causal=is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
    grads = torch.autograd.grad(out, (q32, k32, v32), grad.float())
    return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)


# The same as custom ops (the names planning/selective.py classifies), each calling the plain one.
_linear_op = torch.library.custom_op("ampkit::linear_in_float32", _linear, mutates_args=())
_convolution_op = torch.library.custom_op("ampkit::convolution_in_float32", _convolution, mutates_args=())
# Attention's op has its gradient registered (``attention_grads``): the fast path calls it with grad on.
_attention_op = torch.library.custom_op("ampkit::attention_in_float32", _attention_contiguous, mutates_args=(),
                                        schema="(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, "
                                               "float? scale, bool enable_gqa) -> Tensor")


def single() -> bool:
    """One op each: inside a selectively recomputed block, and while torch.compile traces."""
    return active() or _torch.is_compiling()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in float32 on 16-bit tensors, rounded to ``x``'s dtype: one op where ``single()``."""
    return (_linear_op if single() else _linear)(x, w, b)


def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *params: Any) -> torch.Tensor:
    """``aten.convolution`` in float32 on 16-bit tensors, rounded: one op where ``single()``."""
    return (_convolution_op if single() else _convolution)(x, w, b, *params)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
              scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """Attention in float32 on 16-bit q, k, v, rounded to q's dtype: one op, with its gradient, where
    ``single()``; else without a graph (the fast path's autograd Function holds it)."""
    return (_attention_op if single() else _attention)(q, k, v, attn_mask, is_causal, scale, enable_gqa)


@_linear_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@_convolution_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: list[int], padding: list[int],
      dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> torch.Tensor:
    return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
      scale: float | None, enable_gqa: bool) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _save_attention_inputs(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, attn_mask, *ctx.options = inputs
    ctx.save_for_backward(q, k, v, attn_mask)


def _attention_grads(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    q, k, v, attn_mask = ctx.saved_tensors
    return (*attention_grads(grad, q, k, v, attn_mask, *ctx.options), None, None, None, None)


_attention_op.register_autograd(_attention_grads, setup_context=_save_attention_inputs)
