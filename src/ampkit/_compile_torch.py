"""The public marks that keep torch.compile off ampkit's own code (``mark``), applied when dynamo is imported.

ampkit uses none of dynamo's private names: its regions open eagerly (``torch.compiler.disable``), per-module
overrides are forward wrappers that end a graph before the module's call (``precision/overrides.py``), and
policies are guarded by torch function modes (``precision/compiling.py``).

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


# ---------------------------------------------------------------------------
# Marks applied when dynamo is imported

_DYNAMO = "torch._dynamo"
_lock = threading.RLock()
_waiting: list[Callable[[], None]] = []


def dynamo_imported() -> bool:
    """Whether ``torch._dynamo`` is imported (by torch.compile, or anyone): code that never compiles does not."""
    return _DYNAMO in sys.modules


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
