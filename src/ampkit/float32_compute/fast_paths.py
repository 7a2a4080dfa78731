"""Fast paths: the ops that carry most of a network's arithmetic, as explicit autograd Functions.

The generic path (``generic.py``) runs an op's forward again in its backward; these compute the backward's
GEMMs directly from the saved 16-bit tensors: linear and convolutions. Inside a selectively recomputed block, and
while torch.compile traces, each forward runs as one custom op (``single_ops.py``), the same expression.

Attention runs torch's public attention on float32 copies (``single_ops.attention``), and its backward that
forward again under autograd (``single_ops.attention_grads``): torch's attention backward kernels are private
(issue 71's third rule takes public ops only). The cost of the recompute,
against the private kernels ampkit called before, is measured by ``benchmarks/bench_attention_route.py``
(BENCHMARKS.md); what is saved is the 16-bit q, k and v, less than a native kernel saves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ampkit.float32_compute import single_ops
from ampkit.float32_compute.gelu_recompute import gelu_input
from ampkit.modes import LOW_DTYPES, without_autocast


def _rounded(grads: Sequence[torch.Tensor], dtype: torch.dtype, wanted: Sequence[bool]) -> list[torch.Tensor | None]:
    """A float32 kernel's input gradients rounded to the inputs' 16-bit ``dtype``; None where not wanted."""
    return [g.to(dtype) if want else None for g, want in zip(grads, wanted)]


class _Linear(torch.autograd.Function):
    """``F.linear`` in float32 on 16-bit ``x``, ``w`` (and ``b``), each GEMM's result rounded
    once, as torch's own linear (addmm) and its backward (two mm, a sum) are.

    A GELU output ``x`` is not saved: its backward recomputes it from the GELU's input,
    which autograd keeps anyway (a transformer MLP then saves one hidden-size tensor, not two:
    ``gelu_recompute.py``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        gelu = gelu_input(x)
        ctx.gelu = None if gelu is None else gelu[1]
        ctx.save_for_backward(x if gelu is None else gelu[0], w)
        return single_ops.linear(x, w, b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        if ctx.gelu is not None:
            x = F.gelu(x, approximate=ctx.gelu)
        grad32 = grad.float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad32, w.float()).to(x.dtype)
        flat = grad32.reshape(-1, grad32.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = (flat.t() @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = flat.sum(0).to(w.dtype)
        return grad_x, grad_w, grad_b


class _Convolution(torch.autograd.Function):
    """``aten.convolution`` in float32 on 16-bit tensors; backward through
    ``aten.convolution_backward``, each result rounded once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *params: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.params, ctx.bias_sizes = params, None if b is None else list(b.shape)
        return single_ops.convolution(x, w, b, *params)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        mask = list(ctx.needs_input_grad[:3])
        grads = torch.ops.aten.convolution_backward(
            grad.float(), x.float(), w.float(), ctx.bias_sizes, *ctx.params, mask
        )
        return (*_rounded(grads, x.dtype, mask), *(None for _ in ctx.params))


class _Attention(torch.autograd.Function):
    """``single_ops.attention`` in eager code, its backward ``single_ops.attention_grads``: an autograd Function
    costs less Python per call than a custom op's registered gradient, which a trace needs (``single_ops.single()``)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,  # type: ignore[override]
                is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, attn_mask)
        ctx.options = is_causal, scale, enable_gqa
        return single_ops.attention(q, k, v, attn_mask, is_causal, scale, enable_gqa)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v, attn_mask = ctx.saved_tensors
        return (*single_ops.attention_grads(grad, q, k, v, attn_mask, *ctx.options), None, None, None, None)


def _same_low_dtype(*tensors: torch.Tensor | None) -> bool:
    dtypes = {t.dtype for t in tensors if t is not None}
    return len(dtypes) == 1 and dtypes.pop() in LOW_DTYPES


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> Any:
    if not _same_low_dtype(x, w, b):
        return NotImplemented
    return _Linear.apply(x, w, b)


def _convnd(dims: int) -> Callable[..., Any]:
    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, stride: Any = 1, padding: Any = 0,
             dilation: Any = 1, groups: int = 1) -> Any:
        if not _same_low_dtype(x, w, b) or isinstance(padding, str) or x.dim() != dims + 2:
            return NotImplemented  # unbatched input, padding="same": the generic path

        def expand(v: Any) -> list[int]:
            return [v] * dims if isinstance(v, int) else list(v)

        params = (expand(stride), expand(padding), expand(dilation), False, [0] * dims, groups)
        return _Convolution.apply(x, w, b, *params)

    return conv


def _convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *params: Any) -> Any:
    if not _same_low_dtype(x, w, b):
        return NotImplemented
    return _Convolution.apply(x, w, b, *params)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Any:
    # Any shape torch's attention takes, on any device, torch choosing the float32 kernel. Dropout (its random
    # draws, which the backward's recompute must repeat), a mask that wants a gradient and leading dims that
    # broadcast take the generic path.
    if (dropout_p or not _same_low_dtype(q, k, v) or k.shape[:-2] != v.shape[:-2]
            or (q.shape[:-2] != k.shape[:-2] and not enable_gqa)
            or attn_mask is not None and (attn_mask.requires_grad or attn_mask.dtype not in (torch.bool, q.dtype))):
        return NotImplemented
    if single_ops.single():
        return single_ops.attention(q, k, v, attn_mask, is_causal, scale, enable_gqa)  # its gradient registered
    return _Attention.apply(q, k, v, attn_mask, is_causal, scale, enable_gqa)


FAST: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.scaled_dot_product_attention.default: _attention,
    torch.ops.aten.linear.default: _linear,
    torch.ops.aten.conv1d.default: _convnd(1),
    torch.ops.aten.conv2d.default: _convnd(2),
    torch.ops.aten.conv3d.default: _convnd(3),
    torch.ops.aten.convolution.default: _convolution,
}
