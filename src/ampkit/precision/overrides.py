"""Per-module overrides: forward wrappers on the matching modules of the region's model.

A region whose policy has module overrides knows its model: the module whose forward it decorates
(``@ampkit.autocast(policy)`` on a ``forward``, ``initialize(model, policy=...)``) or the one it is given
(``ampkit.autocast(policy, model=model)``); names are qualified names relative to it. On entry the region
finds the matching modules and sets each one's ``forward`` to a wrapper (an instance attribute, over the
class's forward or the instance's own); on exit it puts back what was there. Nothing global is installed: a
module of another model, or of this one outside the region, runs as it always does.

The wrappers are shared by the threads (a module's attribute is): each reads the calling thread's innermost
region and overrides only where that region installed it, else it calls the module's own forward. A wrapper
runs eagerly, never traced (``torch.compiler.disable``, not recursive): under ``torch.compile`` a graph ends
before each overridden module's call, and the module's own forward runs inside its override's region, compiled as a
graph of its own where dynamo compiles it (torch's own ``nn`` modules it compiles only inlined: they run eagerly;
docs/compile.md lists the graphs). One wrapper object per module, kept while the module lives, so a compiled
model's guards on its modules' attributes hold from one region to the next.

A module's attribute set while another thread compiles that model fails dynamo's check of the guards it just
built ("Guard failed on the same frame it was created", an AssertionError in the compiling thread). So a
wrapper is set and taken off only while no thread compiles: ``torch.compiler.is_compiling()``, one flag for the
process from torch 2.13 on, true in every thread while one compiles. torch 2.11 tells other threads nothing, and
no public lock orders an attribute's write against a compile: there the race stays (docs/compile.md).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit import _torch
from ampkit.precision import compiling
from ampkit.precision.kernels import cast_tree, caster
from ampkit.precision.policy import Policy
from ampkit.precision.state import Region, state, warn_once

Matches = dict[int, tuple[nn.Module, torch.dtype]]  # id(module) -> (module, the dtype its override runs it in)

_ABSENT = object()  # a module without a forward of its own (the class's runs)
_lock = threading.Lock()
_installed: dict[int, list[Any]] = {}  # id(module) -> [module, regions using it, its own forward or _ABSENT]
_wrappers: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()
_by_id: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()  # a wrapper's module, by its id


def override_for(name: str, module: nn.Module, policy: Policy) -> torch.dtype | None:
    """The dtype the last of ``policy``'s overrides that matches ``module`` (by ``name`` or type) runs it in."""
    found = None
    for override in policy.overrides:
        pattern = override.pattern
        if isinstance(pattern, str) and fnmatch.fnmatchcase(name, pattern):
            found = override.dtype
        elif isinstance(pattern, type) and isinstance(module, pattern):
            found = override.dtype
    return found


def pattern_name(override: Any) -> str:
    """An override's pattern as written: ``'lm_head'``, ``nn.LayerNorm``'s ``LayerNorm``."""
    pattern = override.pattern
    return repr(pattern) if isinstance(pattern, str) else pattern.__name__


def matches(model: nn.Module, policy: Policy, *, root: bool = True) -> Matches:
    """``model``'s modules that ``policy``'s overrides match (``model`` itself only with ``root``), names relative
    to it. A name pattern that matches no module is said once (a misspelt name, or a ``torch.compile`` wrapper given
    as the model: its names start with ``_orig_mod.``; give the model itself)."""
    found: Matches = {}
    names: list[str] = []
    for name, module in model.named_modules():
        names.append(name)
        dtype = override_for(name, module, policy) if root or module is not model else None
        if dtype is not None:
            found[id(module)] = (module, dtype)
    for override in policy.overrides:
        pattern = override.pattern
        if isinstance(pattern, str) and not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            shown = ", ".join(repr(n) for n in names[1:9]) + (", ..." if len(names) > 9 else "")
            warn_once(f"override-unmatched:{type(model).__qualname__}:{pattern}",
                      f"ampkit: the module override {pattern!r} matches no module of the region's "
                      f"{type(model).__name__} (its modules: {shown}): check the name, and give the model itself, "
                      "not its torch.compile wrapper (whose names start with '_orig_mod.').")
    return found


@contextlib.contextmanager
def _between_compiles() -> Iterator[None]:
    """Hold the wrappers' lock while no other thread compiles (waiting for one that does): their writes then
    happen between compiles, as dynamo's guards need. The calling thread's own trace does not wait for itself."""
    while True:
        while torch.compiler.is_compiling() and not _torch.is_compiling():
            time.sleep(0.001)
        with _lock:
            if not torch.compiler.is_compiling() or _torch.is_compiling():
                yield
                return


def install(found: Matches) -> None:
    """Set each found module's forward to its wrapper (counted: regions in several threads may share one)."""
    with _between_compiles():
        for module, _ in found.values():
            entry = _installed.get(id(module))
            if entry is not None:
                entry[1] += 1
                continue
            own = module.__dict__.get("forward", _ABSENT)
            module.forward = _wrapper(module)  # type: ignore[method-assign]
            _installed[id(module)] = [module, 1, own]


def uninstall(found: Matches) -> None:
    """Put back each found module's own forward after the last region using its wrapper, unless someone replaced
    the wrapper since (theirs stays)."""
    with _between_compiles():
        for module, _ in found.values():
            entry = _installed[id(module)]
            entry[1] -= 1
            if entry[1]:
                continue
            del _installed[id(module)]
            if module.__dict__.get("forward") is not _wrappers.get(module):
                continue
            if entry[2] is _ABSENT:
                del module.__dict__["forward"]
            else:
                module.forward = entry[2]  # type: ignore[method-assign]


def _wrapper(module: nn.Module) -> Callable[..., Any]:
    """The one forward wrapper of ``module``: ``_forward`` bound to its id (the module holds the wrapper, which holds
    it only so: a weak reference, torch 2.11's dynamo passed on as the module itself at a graph break)."""
    found = _wrappers.get(module)
    if found is None:
        _by_id[id(module)] = module
        _wrappers[module] = found = functools.partial(_forward, id(module))
    return found


def _forward(key: int, *args: Any, **kwargs: Any) -> Any:
    return _overridden(key, *args, **kwargs)


# Never traced: a graph ends before an overridden module's call, and its own forward compiles inside the region
# (the one frame under ``_overridden`` that torch.compile compiles).
@functools.partial(torch.compiler.disable, recursive=False)
def _overridden(key: int, *args: Any, **kwargs: Any) -> Any:
    """Run a module's own forward, inside its override's region where the calling thread's innermost region
    installed the override. Under torch.compile only the forward itself compiles (a frame of its own)."""
    forward, opened = _open(key, args, kwargs)
    if opened is None:
        return forward(*args, **kwargs)
    try:
        return forward(*opened[0], **opened[1])
    finally:
        _close(opened[2], opened[3])


@torch.compiler.disable
def _open(key: int, args: tuple, kwargs: dict[str, Any]) -> tuple[Callable[..., Any], Any]:
    """The module's own forward and, where its override applies, its (args, kwargs) as the region casts them and
    the region opened (torch.autocast's state, the guard); else None."""
    module = _by_id[key]  # alive: it calls its own wrapper
    entry = _installed.get(id(module))
    own = entry[2] if entry is not None and entry[0] is module else module.__dict__.get("forward", _ABSENT)
    forward = type(module).forward.__get__(module) if own is _ABSENT or own is _wrappers.get(module) else own
    top = state.stack[-1] if state.stack else None
    override = top.modules.get(id(module)) if top is not None and top.modules else None
    if override is None or override[0] is not module:
        return forward, None
    policy = top.policy  # type: ignore[union-attr]
    assert policy is not None
    if override[1] == torch.float32:
        ctx, pushed, guard = torch.autocast(policy.device_type, enabled=False), None, None
        cast = caster(policy.device_type, torch.float32)
        args, kwargs = cast_tree(args, cast), cast_tree(kwargs, cast)
    else:  # torch.autocast's state does not change: the policy's guard does (compiling.py)
        ctx = torch.autocast(policy.device_type, dtype=policy.dtype)
        pushed = top.resolved.all_low  # type: ignore[union-attr]
        guard = compiling.enter(compiling.guard_for(pushed))
    ctx.__enter__()
    state.stack.append(Region(policy.device_type, pushed, ctx, guard))
    return forward, (args, kwargs, ctx, guard)


@torch.compiler.disable
def _close(ctx: torch.autocast, guard: Any) -> None:
    state.stack.pop()
    if guard is not None:
        guard.__exit__(None, None, None)
    ctx.__exit__(None, None, None)

