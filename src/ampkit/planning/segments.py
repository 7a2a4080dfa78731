"""Installing a recompute plan: torch.utils.checkpoint (non-reentrant) around each segment.

A segment of one block wraps its forward (recomputing all of it, or all but its GEMMs and attention:
``selective.py``); a segment of consecutive nn.Sequential children runs them all
from the first one's forward (the others pass their input on). A recompute sees the buffers its forward saw
and leaves them as the forward left them (FP8 delayed scales, batch-norm running statistics), and runs under
the forward's ampkit policy (``precision/checkpointing.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ampkit import _torch
from ampkit.planning.selective import contexts as selective_contexts
from ampkit.precision.checkpointing import checkpoint_context_fn


@contextlib.contextmanager
def _snapshot(modules: list[nn.Module], snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """At the forward: the buffers' values it starts from, kept for the recomputes."""
    with torch.no_grad():
        snapshot[:] = [(b, b.clone()) for module in modules for b in module.buffers()]
    yield


@contextlib.contextmanager
def _buffers_as(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """At a recompute: the buffers hold ``snapshot``'s values inside, the forward's results again after."""
    with torch.no_grad():
        now = [b.clone() for b, _ in snapshot]
        for b, value in snapshot:
            b.copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for (b, _), value in zip(snapshot, now):
                b.copy_(value)


@contextlib.contextmanager
def _both(outer: contextlib.AbstractContextManager[Any], inner: contextlib.AbstractContextManager[Any]
          ) -> Iterator[None]:
    with outer, inner:
        yield


def _context_fn(modules: list[nn.Module], selective: bool) -> Callable[[], tuple[Any, Any]]:
    """A segment's ``context_fn``: its recomputes run under the forward's ampkit regions, selectively or whole
    (``checkpoint_context_fn``), and see the buffers the forward saw, leaving them as the forward left them: an
    FP8 layer's delayed scales (its forward records an amax and moves them on), a batch norm's running statistics
    (updated once). The buffers' copies run outside the context_fn's dispatch modes (torch's selective
    checkpointing's): bookkeeping, not ops a selective recompute replays."""
    inner = functools.partial(checkpoint_context_fn, selective_contexts if selective else None)

    def context_fn() -> tuple[Any, Any]:
        if _torch.is_compiling():
            # Traced, the segment is a graph whose recompute AOTAutograd replays from the forward's own inputs, the
            # buffers' values then included; torch.compile takes the two dispatch modes alone.
            return inner()
        forward, recompute = inner()
        snapshot: list[tuple[torch.Tensor, torch.Tensor]] = []
        return _both(_snapshot(modules, snapshot), forward), _both(_buffers_as(snapshot), recompute)

    return context_fn


def checkpoint_module(module: nn.Module, selective: bool = False) -> None:
    """Recompute ``module``'s forward in backward; ``selective``: but for its GEMMs and attention, whose
    outputs it keeps (``selective.py``)."""
    original = module.forward
    context_fn = _context_fn([module], selective)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, context_fn=context_fn,
                                                 **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def checkpoint_run(modules: dict[str, nn.Module], segment: tuple[str, ...]) -> None:
    """Recompute consecutive children of an nn.Sequential as one: the first runs them all, the rest pass."""
    parts = [modules[name] for name in segment]
    originals = [m.forward for m in parts]
    context_fn = _context_fn(parts, selective=False)

    def run_all(x: Any) -> Any:
        for forward in originals:
            x = forward(x)
        return x

    def first(x: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(run_all, x, use_reentrant=False, context_fn=context_fn)

    parts[0].forward = first  # type: ignore[method-assign]
    for m in parts[1:]:
        m.forward = _passing  # type: ignore[method-assign]


def _passing(x: Any) -> Any:
    """A block whose work its segment's first block did."""
    return x


def install(model: nn.Module, segments: Sequence[tuple[str, ...]], selective: Collection[str]) -> None:
    """Each segment recomputed (one block: ``checkpoint_module``, ``selective`` ones but for their GEMMs and
    attention; several: ``checkpoint_run``)."""
    modules = dict(model.named_modules())
    for segment in segments:
        if len(segment) == 1:
            checkpoint_module(modules[segment[0]], selective=segment[0] in selective)
        else:
            checkpoint_run(modules, segment)


@contextlib.contextmanager
def installed(model: nn.Module, segments: Sequence[tuple[str, ...]], selective: Collection[str]) -> Iterator[None]:
    """The segments installed for the enclosed code; each module's own ``forward`` back after."""
    modules = dict(model.named_modules())
    own = {name: modules[name].__dict__.get("forward") for segment in segments for name in segment}
    install(model, segments, selective)
    try:
        yield
    finally:
        for name, forward in own.items():
            if forward is None:
                del modules[name].forward
            else:
                modules[name].forward = forward

