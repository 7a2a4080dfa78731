"""Selective recompute: a block recomputed in backward but for its GEMMs and attention, whose outputs it keeps.

Recomputing a whole block repeats its most expensive ops. torch's selective activation checkpointing
(``create_selective_checkpoint_contexts``: a policy per ATen op, inside ``torch.utils.checkpoint``) keeps
the outputs of the ops a policy names and recomputes the rest. ampkit's policy keeps the GEMMs (matmuls,
linears, convolutions) and attention, and recomputes the elementwise, normalization and conversion ops:
cheap to run again, and under mixed precision the ones whose saved tensors are many (float32 inputs of
norms and losses, the 16-bit copies autocast makes for each GEMM). Under float32 compute the fast paths
run as one op each inside such a block (``float32_compute/single_ops.py``), so what is kept is the GEMM's
16-bit output, not its float32 one.

The kept outputs are held by the checkpoint, not through autograd's saved-tensor hooks, where ampkit's
memory accounting counts saved tensors: a dispatch mode inside torch's caching one sees each kept op's output
and hands it to that accounting's observers (``diagnostics.memory.observing_kept``; ``saved_bytes_of_step`` is
the planner's measurement). torch hands the policy that output only from 2.13 on (``ctx.op_output``): this works
on 2.11 too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from ampkit._torch import TorchDispatchMode, is_compiling
from ampkit.diagnostics.memory import kept_observers
from ampkit.float32_compute import single_ops

KEPT = ("gemm", "attention")  # the op classes a selectively recomputed block keeps the outputs of
_GEMM_NAMES = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "_convolution", "_scaled_mm",
               "_scaled_mm_v2")
_ATTENTION_NAMES = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def _overloads(namespace: Any, names: tuple[str, ...]) -> frozenset[Any]:
    packets = [getattr(namespace, name) for name in names if hasattr(namespace, name)]
    return frozenset(getattr(p, o) for p in packets for o in p.overloads())


_CLASSES = {
    **dict.fromkeys(_overloads(torch.ops.aten, _GEMM_NAMES), "gemm"),
    **dict.fromkeys(_overloads(torch.ops.ampkit, ("linear_in_float32", "convolution_in_float32")), "gemm"),
    **dict.fromkeys(_overloads(torch.ops.aten, _ATTENTION_NAMES), "attention"),
    **dict.fromkeys(_overloads(torch.ops.ampkit, ("attention_in_float32",)), "attention"),
}
def op_class(op: Any) -> str:
    """``"gemm"``, ``"attention"`` or ``"other"`` (elementwise, normalization, conversions, views)."""
    return _CLASSES.get(op, "other")


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors among an op's outputs."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor)]


def _policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op_class(op) in KEPT else CheckpointPolicy.PREFER_RECOMPUTE


class _KeptObserver(TorchDispatchMode):
    """Entered inside torch's caching mode, so it sees each op first and its output last: hands the outputs
    of the ops the policy keeps to this thread's observers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if op_class(func) in KEPT:
            for tensor in tensors(out):
                for observe in kept_observers():
                    observe(tensor)
        return out


@contextlib.contextmanager
def _with_single_ops(mode: Any, observed: bool = False) -> Iterator[None]:
    with single_ops.single_ops(), mode, _KeptObserver() if observed else contextlib.nullcontext():
        yield


def contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """``context_fn`` for ``torch.utils.checkpoint``: the forward's and the recompute's contexts (the forward
    observed only while someone counts the kept bytes: the observer costs a Python call per op)."""
    forward, recompute = create_selective_checkpoint_contexts(_policy)
    if is_compiling():  # dynamo calls this while it traces, and takes torch's two modes alone (fullgraph included)
        return forward, recompute
    return _with_single_ops(forward, observed=bool(kept_observers())), _with_single_ops(recompute)


class OpRecorder(TorchDispatchMode):
    """Records the output storages of each GEMM and attention op, for the block ``where()`` names: what a
    selective recompute of that block would keep (the planner's measurement)."""

    def __init__(self, where: Callable[[], str | None]) -> None:
        super().__init__()
        self.where = where
        self.kept: dict[str, dict[int, int]] = {}  # block -> storage -> bytes
        self._held: list[torch.Tensor] = []  # as the checkpoint would: no freed output's address is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        block = self.where()
        if block is not None and op_class(func) in KEPT:
            storages = self.kept.setdefault(block, {})
            for t in tensors(out):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                self._held.append(t)
        return out
