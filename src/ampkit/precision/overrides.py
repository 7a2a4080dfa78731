"""Per-module overrides: global module hooks that open a region per matching module.

Installed only while a region with overrides is open (counted, so nested and concurrent
regions share one pair of hooks).
"""

from __future__ import annotations

import fnmatch
import threading
import weakref
from typing import Any

import torch
from torch import nn

from ampkit import _torch
from ampkit.precision import compiling
from ampkit.precision.kernels import cast_tree, caster
from ampkit.precision.policy import Policy
from ampkit.precision.state import Region, state, torch_nesting

_module_names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_hooks_lock = threading.Lock()
_hooks_count = 0
_hook_handles: list[Any] = []


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
    root = _torch.compiled_original(root)
    if root not in _module_names:
        for name, sub in root.named_modules():
            _module_names[sub] = name


@torch.compiler.disable  # compiled code breaks its graph here while an override region is open (docs/compile.md)
def _pre_hook(module: nn.Module, args: tuple) -> tuple | None:
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
        guard = compiling.guard_for(pushed, top.float32_ops)()
        guard.__enter__()
    state.stack.append(Region(policy.device_type, pushed, ctx, top.float32_ops, torch_nesting(), guard))
    state.module_stack.append((module, ctx))
    return args


@torch.compiler.disable
def _post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    if state.module_stack and state.module_stack[-1][0] is module:
        _, ctx = state.module_stack.pop()
        region = state.stack.pop()
        if region.guard is not None:
            region.guard.__exit__(None, None, None)
        ctx.__exit__(None, None, None)


def acquire_hooks() -> None:
    global _hooks_count
    with _hooks_lock:
        if _hooks_count == 0:
            from torch.nn.modules import module as module_mod

            _hook_handles.append(module_mod.register_module_forward_pre_hook(_pre_hook))  # type: ignore[arg-type]
            _hook_handles.append(
                module_mod.register_module_forward_hook(_post_hook, always_call=True)
            )
        _hooks_count += 1


def release_hooks() -> None:
    global _hooks_count
    with _hooks_lock:
        _hooks_count -= 1
        if _hooks_count == 0:
            while _hook_handles:
                _hook_handles.pop().remove()
