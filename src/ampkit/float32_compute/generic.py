"""The generic float32-compute path: any op, on float32 copies, its backward recomputed.

An allow-list op with ``float32`` compute and no fast path (``fast_paths.py``) runs inside ``Float32Compute``, an
autograd Function: its forward calls the op on float32 copies of the 16-bit inputs and rounds each floating output
to the inputs' dtype, as the native kernel would return it; it saves the 16-bit inputs, as a native op saves its
inputs, through ``save_for_backward`` (so others' saved-tensor hooks, activation checkpointing's and offloading's,
pack them as any other). Its backward runs the op again on float32 copies, under autograd, and takes the gradients
from that graph, rounded to the inputs' dtypes: backward GEMMs compute in float32 too, although
``loss.backward()`` runs outside the autocast region. The random state of the forward is restored for the
recompute (attention's dropout draws the same mask).

Public mechanisms only (issue 71's third rule): an earlier design ran the op's decomposition under a dispatch mode
below autograd that upcast each GEMM kernel's inputs, kept that nested graph and replayed it; it needed torch's
private dispatch-mode module and saved-tensor layouts. The cost of this one is the op's forward run again in the
backward (benchmarks/bench_attention_route.py measures it for attention) and, in a composite op (``einsum``, an
LSTM cell), its elementwise steps computed in float32 too, not only its GEMMs (docs/compute-modes.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit import _torch, _torch_tensors, _trees
from ampkit.modes import LOW_DTYPES, without_autocast

_PLAIN = (torch.Tensor, nn.Parameter)


class Upcasts:
    """float32 copies of 16-bit tensors, memoized per storage: a weight or gradient that
    several GEMMs read (a linear's backward reads its output gradient twice; attention's
    q, k and v are views of one projection's output) is converted once. One instance
    serves one forward or backward; float32 tensors pass through."""

    def __init__(self) -> None:
        self._memo: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in LOW_DTYPES:
            return t
        if _torch.is_compiling():
            return t.float()  # traced tensors have no storage to share; the compiler fuses the conversions
        storage = t.untyped_storage()
        if storage.nbytes() > 4 * max(t.numel() * t.element_size(), 1) or storage.nbytes() % t.element_size():
            return t.float()  # a small view of a big storage: convert just the view
        key = (storage.data_ptr(), _torch_tensors.version(t), t.dtype)
        whole = self._memo.get(key)
        if whole is None:
            whole = self._memo[key] = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage).float()
        return whole.as_strided(t.shape, t.stride(), t.storage_offset())


def _floating_dtypes(flat: list[Any]) -> set[torch.dtype]:
    return {t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()}


def _call(fn: Callable[..., Any], spec: Any, flat: list[Any]) -> tuple[list[Any], Any]:
    """``fn`` on the call ``flat`` unflattens to: (its output's leaves, their tree)."""
    args, kwargs = _trees.unflatten(flat, spec)
    return _trees.flatten(fn(*args, **kwargs))


def _upcast_all(flat: list[Any]) -> list[Any]:
    up = Upcasts()
    return [up(t) if isinstance(t, torch.Tensor) else t for t in flat]


def run_generic(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` computed in float32 on its 16-bit tensors, each floating output rounded to their
    dtype. Inputs of several floating dtypes run natively (torch refuses a bfloat16 x float32 GEMM in its own
    words), as do calls with no 16-bit tensor and tensor subclasses (torchao's FP8 tensors compute by their own
    rules)."""
    flat, spec = _trees.flatten((args, kwargs))
    dtypes = _floating_dtypes(flat)
    if (len(dtypes) != 1 or not dtypes <= set(LOW_DTYPES)
            or any(isinstance(t, torch.Tensor) and type(t) not in _PLAIN for t in flat)):
        return fn(*args, **kwargs)
    (dtype,) = dtypes
    grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat)
    if not grad:
        leaves, tree = _call(fn, spec, _upcast_all(flat))
        return _trees.unflatten(_rounded(leaves, dtype), tree)
    out_tree: list[Any] = []
    outs = Float32Compute.apply(fn, spec, dtype, out_tree, *flat)
    return _trees.unflatten(list(outs), out_tree[0])


def _rounded(leaves: list[Any], dtype: torch.dtype) -> list[Any]:
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in leaves]


_SAVED = object()  # in the flattened call a backward keeps: a tensor's place, filled from the saved tensors


class Float32Compute(torch.autograd.Function):
    """``fn`` in float32 on the 16-bit tensors of the flattened call ``flat``; its backward runs it again in
    float32, under autograd (the module's docstring). ``out_tree`` receives the outputs' tree."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], spec: Any, dtype: torch.dtype, out_tree: list[Any],  # type: ignore[override]
                *flat: Any) -> Any:
        devices = {t.device for t in flat if isinstance(t, torch.Tensor)}
        ctx.cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        ctx.rng = torch.get_rng_state(), [torch.cuda.get_rng_state(i) for i in ctx.cuda]
        leaves, tree = _call(fn, spec, _upcast_all(list(flat)))
        out_tree.append(tree)
        ctx.fn, ctx.spec = fn, spec
        ctx.flat = [_SAVED if isinstance(t, torch.Tensor) else t for t in flat]
        ctx.save_for_backward(*(t for t in flat if isinstance(t, torch.Tensor)))
        ctx.set_materialize_grads(False)  # outputs nobody used get None, not zeros to multiply
        rounded = _rounded(leaves, dtype)
        ctx.mark_non_differentiable(*(t for t in rounded if isinstance(t, torch.Tensor) and not t.is_floating_point()))
        return tuple(rounded)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, *grads: Any) -> Any:
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if t is _SAVED else t for t in ctx.flat]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        copies = [t.detach().float().requires_grad_(i in wanted) if isinstance(t, torch.Tensor) and t.dtype in
                  LOW_DTYPES else t for i, t in enumerate(inputs)]
        with torch.random.fork_rng(devices=ctx.cuda), torch.enable_grad():
            torch.set_rng_state(ctx.rng[0])
            for index, state in zip(ctx.cuda, ctx.rng[1]):
                torch.cuda.set_rng_state(state, index)
            outs, _ = _call(ctx.fn, ctx.spec, copies)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and isinstance(o, torch.Tensor)
                 and o.requires_grad]
        found: dict[int, torch.Tensor | None] = {}
        if pairs and wanted:
            grads_in = torch.autograd.grad([o for o, _ in pairs], [copies[i] for i in wanted],
                                           [g.to(o.dtype) for o, g in pairs], allow_unused=True)
            found = {i: None if g is None else g.to(inputs[i].dtype) for i, g in zip(wanted, grads_in)}
        return (None, None, None, None, *(found.get(i) for i in range(len(inputs))))
