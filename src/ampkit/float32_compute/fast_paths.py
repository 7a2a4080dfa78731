"""Fast paths: the ops that carry most of a network's arithmetic, as explicit autograd Functions.

The generic path (``generic.py``) costs a millisecond or more of Python per op and step (a
dispatch mode, a nested graph, its replay); these compute the same kernels on the same
values for a fraction of that: linear, convolutions and CPU flash attention. Inside a selectively
recomputed block, and while torch.compile traces, each forward runs as one custom op (``single_ops.py``),
the same expression.

Attention calls CPU's flash kernel and its backward by their private names (``_torch.flash_attention_cpu``), a
loan kept by measurement (``benchmarks/bench_attention_route.py``, BENCHMARKS.md): the public
``F.scaled_dot_product_attention`` runs the same kernel on float32 copies, but its backward is reachable only
through autograd, which then saves the float32 copies of q, k, v and the output (several times the bytes this
path saves, undoing what float32 compute keeps 16-bit), or, saving the 16-bit tensors, runs the forward again in
the backward (at the benchmark's larger size, well over the 5% of the attention's time issue 69 allows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ampkit import _torch
from ampkit.float32_compute import single_ops
from ampkit.float32_compute.gelu_recompute import gelu_input
from ampkit.float32_compute.generic import Upcasts
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
    """``scaled_dot_product_attention`` through CPU's flash kernel in float32 on 16-bit q, k,
    v: what the generic path runs (the same kernel on the same float32 copies, its output
    rounded, backward reading that rounded output), without a dispatch mode and a nested
    graph. Saves what the native kernel saves: q, k, v, the 16-bit output and the float32
    log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,  # type: ignore[override]
                scale: float | None) -> torch.Tensor:
        out, logsumexp = single_ops.flash_attention(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        q, k, v, out, logsumexp = ctx.saved_tensors
        up = Upcasts()
        grads = _torch.flash_attention_cpu_backward(
            grad.float(), up(q), up(k), up(v), out.float(), logsumexp, 0.0, ctx.is_causal, scale=ctx.scale
        )
        return (*_rounded(grads, q.dtype, ctx.needs_input_grad[:3]), None, None)


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


_FLASH = SDPBackend.FLASH_ATTENTION.value


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Any:
    # The case the flash kernel serves on the CPU, as torch itself would pick it for these 16-bit
    # inputs; masks (converted by torch before the kernel), dropout (its random draws) and
    # grouped-query attention take the generic path, as do leading dims that broadcast.
    if (attn_mask is not None or dropout_p or enable_gqa or not q.is_cpu or not _same_low_dtype(q, k, v)
            or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        return NotImplemented
    # The kernel takes (batch, heads, tokens, width) only, and from torch 2.14.1 on torch picks it for 3-D inputs
    # too (2.13 picked MATH there; ampkit then passed them on as they came, and raised): any shape sdpa accepts,
    # (tokens, width), (batch, tokens, width) or more leading dims, is asked about and run as a batch of one-head
    # attentions, a view where the strides allow, the same arithmetic per (batch, head).
    q4, k4, v4 = (t if t.dim() == 4 else t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
    if _torch.fused_sdp_choice(q4, k4, v4, is_causal, scale) != _FLASH:
        return NotImplemented
    out = _Attention.apply(q4, k4, v4, is_causal, scale)
    return out if q.dim() == 4 else out.reshape(*q.shape[:-1], v.shape[-1])


FAST: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.scaled_dot_product_attention.default: _attention,
    torch.ops.aten.linear.default: _linear,
    torch.ops.aten.conv1d.default: _convnd(1),
    torch.ops.aten.conv2d.default: _convnd(2),
    torch.ops.aten.conv3d.default: _convnd(3),
    torch.ops.aten.convolution.default: _convolution,
}
