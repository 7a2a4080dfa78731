"""The torch.compile privates ampkit uses (dynamo, inductor, AOTAutograd), one wrapper each, as in ``_torch.py``,
and the public marks that keep the rest of ampkit off them (``mark``, ``inline_only``).

Each says the torch versions it was checked on and what ampkit does where it is missing; ``_torch.missing()``
checks every one of them, so a torch release that moves one fails ``tests/test_torch_shim.py``.

Nothing here imports torch's compiler at import: ``torch.compiler.disable`` and its kin import dynamo (the larger
part of ampkit's start: benchmarks/bench_startup.py), which code that never compiles does not need.
``on_dynamo_import`` runs ampkit's marks (which functions dynamo must not trace, which it takes as constants or graph
ops) the moment ``torch._dynamo`` is imported, by ``torch.compile`` or anyone, through a ``sys.meta_path`` finder:
before dynamo can trace anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit._torch import _module, at_least, fallback_once, is_compiling

# ---------------------------------------------------------------------------
# Marks applied when dynamo is imported

_DYNAMO = "torch._dynamo"
_lock = threading.RLock()
_waiting: list[Callable[[], None]] = []


def on_dynamo_import(mark: Callable[[], None]) -> None:
    """Call ``mark`` now if dynamo is imported, else right after ``torch._dynamo`` is (before any trace)."""
    with _lock:
        if _DYNAMO not in sys.modules:
            if not _waiting:
                sys.meta_path.insert(0, _DynamoFinder())
            _waiting.append(mark)
            return
    mark()


def _run_marks() -> None:
    with _lock:
        marks = list(_waiting)
        _waiting.clear()
    for mark in marks:
        mark()


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders do, and runs the waiting marks once it has executed; it leaves
    ``sys.meta_path`` then (a spec asked for and never executed, ``importlib.util.find_spec``, keeps it there)."""

    def __init__(self) -> None:
        self.finding = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO or getattr(self.finding, "now", False):
            return None
        self.finding.now = True  # the other finders find the spec
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding.now = False
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenMark(spec.loader, self)
        return spec


class _ThenMark(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _DynamoFinder) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        _run_marks()

    def __getattr__(self, name: str) -> Any:  # get_source, is_package... as the real loader answers
        return getattr(self.loader, name)


def mark(namespace: Any, name: str, decorator: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``name`` in ``namespace`` (a module's ``globals()``, or a class) by ``decorator`` applied to it
    (``torch.compiler.disable``, ``assume_constant_result``...) the moment dynamo is imported; until then it stays
    as written, which nothing can trace. Callers look it up at call time, as a global or an attribute."""
    if isinstance(namespace, dict):
        on_dynamo_import(lambda: namespace.__setitem__(name, decorator(namespace[name])))
    else:
        on_dynamo_import(lambda: setattr(namespace, name, decorator(namespace.__dict__[name])))


def compiled_original(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile(module)`` wrapper holds (``OptimizedModule._orig_mod``, 2.0-2.15.0), else
    ``module`` itself: module names are the model's own."""
    if _DYNAMO not in sys.modules:
        return module  # no torch.compile wrapper without dynamo
    wrapper = getattr(_module("torch._dynamo.eval_frame"), "OptimizedModule", ())
    return module._orig_mod if isinstance(module, wrapper) else module  # type: ignore[return-value]


def inline_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``fn`` that dynamo never compiles as a frame of its own (``torch.compiler.disable``) and traces
    as ``fn``, inline, wherever a trace meets the stand-in as a value (``torch.compiler.substitute_in_graph``, with
    ``fn`` as its polyfill): a global hook, read from torch's table of hooks. Imports dynamo."""
    stand_in = torch.compiler.disable(fn)
    torch.compiler.substitute_in_graph(stand_in)(fn)
    return stand_in


def _translator() -> Any:
    """dynamo's translator of the frame it compiles in this thread, else None (``InstructionTranslator.current_tx``,
    2.1-2.15.0)."""
    translator = getattr(_module("torch._dynamo.symbolic_convert"), "InstructionTranslator", None)
    return translator.current_tx() if translator is not None and is_compiling() else None


def _tracer() -> Any:
    """The output graph dynamo is building in this thread, else None."""
    return getattr(_translator(), "output", None)


def trace_ends_in_a_graph() -> bool:
    """Whether dynamo's cleanup hooks run because its graph is complete (``OutputGraph.compile_and_call_fx_graph``
    calls them, 2.1-2.15.0), not because the trace stopped part-way."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "compile_and_call_fx_graph":
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None


def on_trace_end(fn: Callable[[], None]) -> None:
    """Call ``fn`` when dynamo's trace in progress ends, finished or stopped part-way (``OutputGraph.
    add_cleanup_hook``, 2.1-2.15.0, dynamo's own way to close its context managers); outside a trace, never."""
    if (tracer := _tracer()) is not None:
        tracer.add_cleanup_hook(fn)


def graph_op_with_side_effects(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` as a node of dynamo's graph, kept though nothing uses its result (``torch.fx.node.has_side_effect``,
    2.1-2.15.0), marked when dynamo is imported. Missing: ``can_trace_module_regions()`` says False, and the
    function is never traced."""

    def apply() -> None:
        keep = getattr(torch.fx.node, "has_side_effect", None)
        if keep is not None:
            keep(fn)
        torch.compiler.allow_in_graph(fn)  # marks ``fn`` itself (by id)

    on_dynamo_import(apply)
    return fn


def trace_backward_without_autocast() -> None:
    """AOTAutograd traces the backward of the graph dynamo is building with autocast off, until the trace ends
    (``torch._functorch.config.backward_pass_autocast``, 2.5-2.15.0; its default traces it under the forward's)."""
    config: Any = _module("torch._functorch.config")
    if _tracer() is None or not hasattr(config, "backward_pass_autocast"):
        return
    before, config.backward_pass_autocast = config.backward_pass_autocast, "off"
    on_trace_end(lambda: setattr(config, "backward_pass_autocast", before))


def can_trace_module_regions() -> bool:
    """Whether this torch has what per-module overrides need to be traced into a graph (above). Missing:
    their hooks run eagerly, a graph break at every module call while such a policy is open (said once)."""
    # and a dynamo that takes a module as a constant argument of ``assume_constant_result`` (2.13 on; 2.11 raises
    # AsPythonConstantNotImplementedError at the first overridden module it traces)
    found = (at_least(2, 13)
             and getattr(getattr(_module("torch._dynamo.symbolic_convert"), "InstructionTranslator", None),
                         "current_tx", None) is not None
             and hasattr(getattr(_module("torch._dynamo.output_graph"), "OutputGraph", None), "add_cleanup_hook")
             and hasattr(_module("torch._functorch.config"), "backward_pass_autocast")
             and hasattr(torch.fx.node, "has_side_effect"))
    if not found:
        fallback_once("dynamo's InstructionTranslator.current_tx / OutputGraph.add_cleanup_hook / AOTAutograd's "
                      "backward_pass_autocast / modules as constants (2.13 on)", "per-module overrides break compiled "
                      "graphs at every module call")
    return found
