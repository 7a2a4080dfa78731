"""Per-module overrides: global module hooks that open a region per matching module.

Installed by the first region with overrides, removed after the last, unless torch.compile has traced them
(then kept for the process: ``install_hooks``); outside such a region they return at once.

Under torch.compile the hooks are traced, not run: which modules match is a constant of the trace
(the policy is guarded, ``compiling.py``), the float32 cast of a module's inputs is traced as any
cast, and the region itself is opened and closed by two ops that dynamo puts in the graph
(``_enter_traced`` / ``_exit_traced``). Those run wherever the graph is run as Python: in dynamo's
own pass over the code, in AOTAutograd's passes over the graph (so the Autocast kernels, torch's and
ampkit's, see the module's region, as dynamo's own ``_enter_autocast`` works), and with the
``eager`` backend at every call; inductor's compiled code holds only the casts they led to. A trace
that stops part-way (a graph break, a restart) closes what it opened through dynamo's cleanup hooks.
Once dynamo is imported the hooks are registered as stand-ins it traces inline and never compiles as frames of
their own (``_compile_torch.inline_only``).
One thing differs from eager: AOTAutograd traces the backward under the forward's autocast state,
which would cast a float32 module's backward GEMMs to 16 bits; a graph with a float32 module traces
its backward with autocast off, as eager runs ``loss.backward()`` outside the region.
"""

from __future__ import annotations

import fnmatch
import threading
import weakref
from typing import Any

import torch
from torch import nn

from ampkit import _compile_torch
from ampkit.precision import compiling
from ampkit.precision.kernels import cast_tree, caster
from ampkit.precision.policy import Policy
from ampkit.precision.state import Region, state

_module_names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_hooks_lock = threading.Lock()
_hook_handles: list[Any] = []
_hooks_count = 0  # the open regions that need the hooks
_traceable = False  # whether torch.compile can trace the hooks (_compile_torch.can_trace_module_regions), once imported
_traced = False  # whether a trace has gone through them (then dynamo's graphs guard on them: they stay)


def _override_for(module: nn.Module, policy: Policy) -> torch.dtype | None:
    name = _module_names.get(module, "")
    found = None
    for override in policy.overrides:
        pattern = override.pattern
        if isinstance(pattern, str) and fnmatch.fnmatchcase(name, pattern):
            found = override.dtype
        elif isinstance(pattern, type) and isinstance(module, pattern):
            found = override.dtype
    return found


def name_modules(root: nn.Module) -> None:
    """Record qualified names relative to ``root``, the first module seen of its tree (the model itself
    where ``root`` is its ``torch.compile`` wrapper)."""
    root = _compile_torch.compiled_original(root)
    if root not in _module_names:
        for name, sub in root.named_modules():
            _module_names[sub] = name


# dynamo's trace of the hooks folds is_dynamo_compiling() to True; run for real they take the eager path (in any
# thread: torch.compiler.is_compiling() is true in every thread while one compiles, from 2.13 on). Run for real in a
# thread without a region (where the hooks stay after a trace) they return before the eager path's disabled wrapper:
# a module call outside regions costs the two hooks' own calls alone (benchmarks/bench_module_hooks.py).
def _pre_hook(module: nn.Module, args: tuple) -> tuple | None:
    compiling = torch.compiler.is_dynamo_compiling()
    if compiling and _traceable:
        return _traced_pre_hook(module, args)
    if not (compiling or state.stack):  # the thread-local stack is read only where nothing traces
        return None
    return _eager_pre_hook(module, args)


def _post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    compiling = torch.compiler.is_dynamo_compiling()
    if compiling and _traceable:
        if _leaves_at_trace(module):
            _exit_traced()
    elif compiling or state.module_stack:
        _eager_post_hook(module)


def _eager_pre_hook(module: nn.Module, args: tuple) -> tuple | None:
    top = state.stack[-1] if state.stack else None
    if top is None or top.policy is None or not top.policy.overrides:
        return None
    policy = top.policy
    name_modules(module)
    dtype = _override_for(module, policy)
    if dtype is None:
        return None
    if dtype == torch.float32:
        ctx = torch.autocast(policy.device_type, enabled=False)
        pushed = None
        # Positional inputs only: torch's global pre-hooks do not see keyword arguments.
        args = cast_tree(args, caster(policy.device_type, torch.float32))
    else:
        ctx = torch.autocast(policy.device_type, dtype=policy.dtype)
        pushed = policy.all_low
    ctx.__enter__()
    guard = None
    if pushed is not None:  # torch.autocast's state does not change: the policy's guard does (compiling.py)
        guard = compiling.enter(compiling.guard_for(pushed, top.float32_ops))
    state.stack.append(Region(policy.device_type, pushed, ctx, top.float32_ops, guard))
    state.module_stack.append((module, ctx))
    return args


def _eager_post_hook(module: nn.Module) -> None:
    if state.module_stack and state.module_stack[-1][0] is module:
        _, ctx = state.module_stack.pop()
        region = state.stack.pop()
        if region.guard is not None:
            region.guard.__exit__(None, None, None)
        ctx.__exit__(None, None, None)


# ---------------------------------------------------------------------------
# While torch.compile traces

_FLOAT32, _LOW = 1, 2  # what a module's override opens: a float32 region, or the policy's 16-bit dtype for all


def _enters_at_trace(module: nn.Module) -> tuple[str, int]:
    """(device type, _FLOAT32 or _LOW) where ``module`` opens an override region, else ("", 0)."""
    global _traced
    _traced = True  # run for real at each trace (a constant of it), in the thread that traces
    top = state.stack[-1] if state.stack else None
    if top is None or top.policy is None or not top.policy.overrides:
        return "", 0
    name_modules(module)
    dtype = _override_for(module, top.policy)
    if dtype is None:
        return "", 0
    state.traced_modules.append(module)
    _compile_torch.on_trace_end(lambda: _forget(state.traced_modules, module))
    return top.policy.device_type, _FLOAT32 if dtype == torch.float32 else _LOW


def _leaves_at_trace(module: nn.Module) -> bool:
    if state.traced_modules and state.traced_modules[-1] is module:
        state.traced_modules.pop()
        return True
    return False


def _traced_pre_hook(module: nn.Module, args: tuple) -> tuple | None:
    device_type, kind = _enters_at_trace(module)
    if not kind:
        return None
    if kind == _FLOAT32:
        args = cast_tree(args, caster(device_type, torch.float32))
    _enter_traced(kind)
    return args


@_compile_torch.graph_op_with_side_effects
def _enter_traced(kind: int) -> None:
    """Open ``kind``'s region inside the innermost one, as ``_pre_hook`` does (no mode to guard by: nothing
    is compiled inside a graph)."""
    top = state.stack[-1]
    policy = top.policy
    assert policy is not None
    if kind == _FLOAT32:
        ctx, pushed = torch.autocast(policy.device_type, enabled=False), None
        _compile_torch.trace_backward_without_autocast()
    else:
        ctx, pushed = torch.autocast(policy.device_type, dtype=policy.dtype), policy.all_low
    ctx.__enter__()
    region = Region(policy.device_type, pushed, ctx, top.float32_ops)
    state.stack.append(region)
    _compile_torch.on_trace_end(lambda: _close_from(region))


def _close_from(region: Region) -> None:
    """Close ``region`` and every region opened after it, where a trace stopped before closing them (a restart:
    dynamo traces again, breaking its graph before the module's call)."""
    if not any(r is region for r in state.stack):
        return
    while True:
        closing = state.stack.pop()
        closing.ctx.__exit__(None, None, None)
        if closing is region:
            break
    if _compile_torch.trace_ends_in_a_graph():  # a graph with the region open: its rest would run without it
        raise RuntimeError(
            "ampkit: torch.compile ended a graph inside a module that a per-module override of the policy "
            "matches, so the rest of the module would run outside its override. A graph break inside a module "
            "that dynamo inlines ends the graph before the module's call unless dynamo's nested_graph_breaks setting "
            "is on: turn it off, or remove the graph break from the module (TORCH_LOGS=graph_breaks names it).")


@_compile_torch.graph_op_with_side_effects
def _exit_traced() -> None:
    state.stack.pop().ctx.__exit__(None, None, None)


def _forget(stack: list, item: object) -> None:
    while item in stack:
        stack.pop()


# The eager hooks are never compiled as frames (called from a trace only where it cannot trace the hooks); the policy
# is guarded by its mode's type, the module by dynamo, so which modules match is a constant of the trace. Marked when
# dynamo is imported.
for _name in ("_eager_pre_hook", "_eager_post_hook"):
    _compile_torch.mark(globals(), _name, torch.compiler.disable)
for _name in ("_enters_at_trace", "_leaves_at_trace"):
    _compile_torch.mark(globals(), _name, torch.compiler.assume_constant_result)


# What ``install_hooks`` registers: the hooks themselves until dynamo is imported, then stand-ins that dynamo never
# compiles as frames of their own and traces as the hooks, inline (``_compile_torch.inline_only``). Where dynamo breaks
# a graph at a module's call, the call runs eagerly: compiled as frames of their own, the hooks made a graph end with
# the module's region open.
_registered: tuple[Any, Any] = (_pre_hook, _post_hook)


def _on_dynamo_import() -> None:
    global _traceable, _registered
    _traceable = _compile_torch.can_trace_module_regions()
    with _hooks_lock:
        _registered = (_compile_torch.inline_only(_pre_hook), _compile_torch.inline_only(_post_hook))
        if _hook_handles:  # installed before dynamo was imported: the stand-ins take their places
            _remove_hooks()
            _add_hooks()


_compile_torch.on_dynamo_import(_on_dynamo_import)


def _add_hooks() -> None:
    from torch.nn.modules import module as module_mod

    _hook_handles.append(module_mod.register_module_forward_pre_hook(_registered[0]))
    _hook_handles.append(module_mod.register_module_forward_hook(_registered[1], always_call=True))


def _remove_hooks() -> None:
    while _hook_handles:
        _hook_handles.pop().remove()


def install_hooks() -> None:
    """Install the two global hooks at the first region with overrides; once dynamo has traced them, they stay.

    Removed after each region and installed again at the next, they were new hooks to dynamo every time (it guards
    the hooks' keys in torch's table, and each registration takes a new one): a model compiled under an override
    policy failed that guard and compiled again at every step, to its recompile limit, then ran eagerly. Outside
    an override region they return at once, but every module call in the process then takes ``nn.Module``'s path
    for hooks and calls both (``benchmarks/bench_module_hooks.py``), in this process only after a compiled call
    traced them (issue 38 asks for a per-region mechanism). Where no trace went through them (eager code), they go
    with the last region that needs them. Where dynamo cannot trace them (torch 2.11) they break every compiled
    graph at each module call, override region or not: there they go with the last region that needs them
    (``release_hooks``), as they do in a process that has not imported dynamo (nothing compiles there).
    """
    global _hooks_count
    with _hooks_lock:
        if not _hook_handles:
            _add_hooks()
        _hooks_count += 1


def release_hooks() -> None:
    """Where no trace went through the hooks, remove them after the last region that needs them, unless a thread
    compiles now (dynamo guards on the global hooks it traced: one removed between its trace and its guards fails that
    thread's compile with a ``KeyError``; left, the next region's release removes them)."""
    global _hooks_count
    with _hooks_lock:
        _hooks_count -= 1
        if _hooks_count == 0 and not (_traceable and _traced) and not torch.compiler.is_compiling():  # any thread's
            _remove_hooks()
