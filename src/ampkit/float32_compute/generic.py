"""The generic float32-compute path: any op, through a dispatch mode and a nested graph.

An allow-list op with ``float32`` compute runs inside ``Float32Compute`` (an autograd
Function) under ``UpcastGemms`` (a TorchDispatchMode below autograd): the op's own
decomposition is recorded in a nested graph whose GEMM/convolution kernels
(``BACKEND_OPS``) receive the 16-bit tensors, compute on float32 copies and round their
outputs to the dtype the native kernel would return. The Function's backward replays that
graph under the same mode, so backward GEMMs compute in float32 too, although
``loss.backward()`` runs outside the autocast region.

Inside a non-reentrant activation checkpoint (``checkpointed_segment``) the nested graph is not kept: its
backward is a graph task of its own, and torch recomputes a checkpointed segment once per graph task that
unpacks a tensor saved in it, so each such op's backward recomputed the whole segment again (and a selective
policy's recompute context, entered a second time, raised). There the Function saves its inputs as any op does
and builds the nested graph again in its backward: one op's forward, not the segment's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit import _torch, _torch_tensors
from ampkit._torch import TorchDispatchMode, disable_current_modes, pytree
from ampkit.float32_compute.weights import is_weight, remember_weight_alias
from ampkit.modes import LOW_DTYPES, without_autocast

# Kernels below autograd that do the arithmetic of those ops, forward and backward
# (names as TorchDispatchMode sees them: torch.ops.aten.<name>). CUDA's flash and
# cuDNN attention kernels take no float32 inputs, so they are not here: attention that
# torch routes to them stays native (fast where they exist: on tensor-core GPUs).
BACKEND_OPS = frozenset(
    """
    mm bmm addmm baddbmm addbmm _addmm_activation addmv addr mv dot vdot
    convolution convolution_backward _convolution mkldnn_rnn_layer mkldnn_rnn_layer_backward
    _scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention_for_cpu_backward
    _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
    _native_multi_head_attention _thnn_fused_lstm_cell _thnn_fused_gru_cell
    """.split()
)
# Of those, the ones whose floating inputs must share one dtype (torch refuses a
# bfloat16 x float32 GEMM); attention's backward also takes a float32 logsumexp.
ONE_DTYPE_OPS = frozenset(
    "mm bmm addmm baddbmm addbmm _addmm_activation addmv addr mv dot vdot convolution convolution_backward "
    "_convolution".split()
)


# ---------------------------------------------------------------------------
# The dispatch mode: GEMM kernels on 16-bit tensors compute in float32


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``fn`` over the tensors of an op's argument (a tensor, or a list/tuple of them);
    a lighter pytree.tree_map for the arguments ATen kernels take."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(fn, v) for v in value)
    return value


def _float_dtypes(value: Any, found: set[torch.dtype]) -> set[torch.dtype]:
    """The floating dtypes among an op's argument's tensors, added to ``found``."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            found.add(value.dtype)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _float_dtypes(v, found)
    return found


_handled: dict[_torch.OpOverload, bool] = {}
_out_dtypes: dict[tuple, tuple[torch.dtype | None, ...]] = {}


def _is_backend_op(func: _torch.OpOverload) -> bool:
    found = _handled.get(func)
    if found is None:
        found = _handled[func] = func.overloadpacket.__name__ in BACKEND_OPS and not _torch.is_mutable(func)
    return found


def _native_out_dtypes(func: _torch.OpOverload, args: tuple, kwargs: dict) -> tuple[torch.dtype | None, ...]:
    """The dtypes of ``func``'s outputs when run natively, found once per input-dtype
    signature on meta tensors (no arithmetic)."""
    leaves = pytree.tree_leaves((args, kwargs))
    key = (func, tuple(t.dtype if isinstance(t, torch.Tensor) else type(t) for t in leaves))
    found = _out_dtypes.get(key)
    if found is None:
        def to_meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        meta_args = _map_tensors(to_meta, args)
        meta_kwargs = {k: _map_tensors(to_meta, v) for k, v in kwargs.items()}
        with disable_current_modes():  # modes below ours need not see this dry run
            out = func(*meta_args, **meta_kwargs)
        found = tuple(t.dtype if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(out))
        _out_dtypes[key] = found
    return found


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


class UpcastGemms(TorchDispatchMode):
    """Run BACKEND_OPS that receive 16-bit tensors on float32 copies (``Upcasts``) and
    round their outputs to the dtypes the native kernel returns; every other op runs
    untouched. One instance serves one nested forward or backward."""

    def __init__(self) -> None:
        super().__init__()
        self._upcast = Upcasts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not _is_backend_op(func) or any(
                isinstance(t, torch.Tensor) and type(t) not in _PLAIN for t in pytree.tree_leaves((args, kwargs))):
            # A tensor subclass (torchao's FP8 tensors, for one) computes by its own rules: leave it alone.
            return func(*args, **kwargs)
        dtypes = _float_dtypes((args, list(kwargs.values())), set())
        low = dtypes & set(LOW_DTYPES)
        # Mixed dtypes that torch refuses run natively, so the error is torch's own.
        mixed = len(dtypes) > 1 and (len(low) > 1 or func.overloadpacket.__name__ in ONE_DTYPE_OPS)
        if not low or mixed:
            return func(*args, **kwargs)
        try:
            out_dtypes: tuple[torch.dtype | None, ...] | None = _native_out_dtypes(func, args, kwargs)
        except NotImplementedError:  # no meta kernel (torch 2.11's aten::_convolution): read off the float32 run
            out_dtypes = None
        with disable_current_modes():  # the conversions are ours: modes below see the float32 kernel
            args = _map_tensors(self._upcast, args)
            kwargs = {k: _map_tensors(self._upcast, v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        flat, spec = pytree.tree_flatten(out)
        if out_dtypes is None:  # inputs of one 16-bit dtype: its floating outputs in that dtype, as natively
            (only,) = low
            out_dtypes = tuple(only if isinstance(t, torch.Tensor) and t.is_floating_point() else None for t in flat)
        rounded = [
            t.to(dtype) if isinstance(t, torch.Tensor) and dtype is not None and t.dtype != dtype else t
            for t, dtype in zip(flat, out_dtypes)
        ]
        return pytree.tree_unflatten(rounded, spec)


_SAVED = object()  # in a checkpointed segment's flat call: a tensor's place, filled from the saved tensors
_segments = threading.local()  # .depth: the non-reentrant checkpointed segments this thread runs in


@contextlib.contextmanager
def checkpointed_segment() -> Iterator[None]:
    """Mark the enclosed code as a non-reentrant checkpointed segment, in its forward and in its recompute
    alike (``precision/checkpointing.py`` enters it around the segment's function): ``Float32Compute`` then
    keeps no nested graph (the module's docstring says why)."""
    _segments.depth = getattr(_segments, "depth", 0) + 1
    try:
        yield
    finally:
        _segments.depth -= 1


def _drop(t: torch.Tensor) -> Any:
    return None


def _dropped(packed: Any) -> torch.Tensor:
    raise AssertionError("a checkpointed segment's nested graph is dropped at its forward, never run backward")


def _nested(fn: Callable[[list[Any]], Any], flat: tuple[Any, ...]) -> tuple[list[Any], Any]:
    """``fn`` on detached aliases of ``flat``'s tensors, under ``UpcastGemms`` with grad: (the aliases, the
    outputs, whose graph is the nested one)."""
    inputs = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in flat]
    for outer, inner in zip(flat, inputs):
        if isinstance(outer, torch.Tensor) and is_weight(outer):
            remember_weight_alias(inner)
    with torch.enable_grad(), UpcastGemms():
        return inputs, fn(inputs)


class Float32Compute(torch.autograd.Function):
    """``fn`` on float32-computing kernels; its backward replays the nested graph
    under the same mode. Inputs are the flattened call (tensors and constants)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[list[Any]], Any], *flat: Any) -> Any:  # type: ignore[override]
        if getattr(_segments, "depth", 0):
            # The graph goes with this call; saved-tensor hooks (the checkpoint's) see only the inputs saved here.
            with torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
                inputs, outs = _nested(fn, flat)
            ctx.save_for_backward(*(t for t in flat if isinstance(t, torch.Tensor)))
            ctx.fn, ctx.flat = fn, [_SAVED if isinstance(t, torch.Tensor) else t for t in flat]
            ctx.inputs = ctx.outputs = None
        else:
            inputs, outs = _nested(fn, flat)
            ctx.fn, ctx.inputs, ctx.outputs = None, inputs, outs
        ctx.set_materialize_grads(False)  # outputs nobody used get None, not zeros to multiply
        detached = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in outs)
        ctx.mark_non_differentiable(
            *(d for t, d in zip(outs, detached) if isinstance(t, torch.Tensor) and t.grad_fn is None)
        )
        return detached

    @staticmethod
    @torch.autograd.function.once_differentiable
    @without_autocast
    def backward(ctx: Any, *grads: Any) -> Any:
        if ctx.fn is not None:  # a checkpointed segment's (once: the saved tensors go with the first backward)
            saved = iter(ctx.saved_tensors)
            ctx.inputs, ctx.outputs = _nested(ctx.fn, tuple(next(saved) if t is _SAVED else t for t in ctx.flat))
            ctx.fn = ctx.flat = None
        if ctx.outputs is None:
            raise RuntimeError(
                "Trying to backward through a float32-compute op a second time: these ops support one "
                "backward per forward (their nested graph is freed by the first, as a native op's saved "
                "tensors are). For retain_graph=True or double backward, use Policy(compute='native')."
            )
        pairs = [
            (o, g) for o, g in zip(ctx.outputs, grads)
            if g is not None and isinstance(o, torch.Tensor) and o.grad_fn is not None
        ]
        wanted = [i for i, t in enumerate(ctx.inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        found: dict[int, torch.Tensor | None] = {}
        if pairs and wanted:
            with UpcastGemms():
                grads_in = torch.autograd.grad(
                    [o for o, _ in pairs], [ctx.inputs[i] for i in wanted], [g for _, g in pairs], allow_unused=True
                )
            found = dict(zip(wanted, grads_in))
        count = len(ctx.inputs)
        ctx.inputs = ctx.outputs = None  # the nested graph and its saved tensors go now
        return (None, *(found.get(i) for i in range(count)))
