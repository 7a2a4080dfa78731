"""torch.compile under ampkit policies: each policy a guard of its own, so no graph runs under another.

torch.compile guards a graph on torch.autocast's state (enabled, dtype), not on ampkit's: a graph traced
under one edited policy and found in dynamo's cache would run under any other with the first one's dtypes,
silently (a function compiled under the default policy, then called under ``with_ops(deny=["mm"])``,
returned bfloat16 from the mm). What dynamo does guard, besides the values the traced code reads, is the
calling thread's stack of torch function modes: the *type* of each mode on it
(``make_torch_function_mode_stack_guard`` in torch/_dynamo/guards.py). So a region whose policy differs
from torch.autocast's (edited lists, float32 compute, module overrides: what needs ampkit's dispatcher
kernels or hooks) pushes a mode whose type stands for that policy, one type per distinct policy and set of
float32-computed ops (``guard_for``). The mode passes every call through unchanged (no measurable cost in
a 2-layer GPT's eager step); it is there to be guarded on.

- A graph traced inside such a region runs only where the same policy is open: any other policy (or
  none, or the default policy, which pushes no mode) fails the guard and dynamo traces again, or finds the
  graph it traced for that policy before (switching back and forth costs one trace per policy).
- The default policy's one kernel, on CUDA, runs in float32 an op torch.autocast refuses (``op_lists.BANNED``,
  ``binary_cross_entropy``): no graph traced under torch.autocast holds that op (tracing it raises), so the
  default policy pushes no mode (``needs_guard``). The mode is not free in eager code where steps are short:
  each torch call pays for it, a ``Tensor.shape`` read included (measured on an H200, where every default CUDA
  region pushed one and small models' steps slowed against torch.autocast's). A graph traced under the default
  policy does run under plain torch.autocast, where that op eagerly raises.
- While tracing, ampkit's kernels at the Autocast dispatch key run as in eager code (AOTAutograd traces
  through the dispatcher), so the policy's casts and float32 GEMMs are written into the graph: inductor
  compiles them like any other op.
- On disk: AOTAutograd's cache keys an entry by dynamo's graph (the same under every policy: the casts
  come later, from the kernels) and torch.autocast's dtype, so it handed one edited policy's graph to
  another (measured: float32 from a bfloat16 mm). ``PolicyTag`` adds the open regions' policies, and a hash of the ampkit code that runs at the
  dispatcher, to both caches' keys through torch's public tag for them, ``torch.compiler.config.cache_key_tag``
  (around the user's own tag). It replaced a no-op inductor graph pass that carried the same key through
  inductor's private ``post_grad_custom_pre_pass``; that setting, like every torch.compile setting from
  torch 2.13 on, is a context variable, so a pass installed by one thread was missing from the others' keys.

The other mechanism considered, an ampkit backend that applies the policy as a pass over the FX graph
before inductor, would cover only the backends ampkit wraps (not ``torch.compile(model)`` as users write
it) and would re-implement in a graph pass what the Autocast kernels already do: measured here, the mode
adds nothing to the compiled step and reuses every kernel, so it was chosen.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import torch
from torch.overrides import BaseTorchFunctionMode

from ampkit.precision import op_lists
from ampkit.precision.policy import Resolved
from ampkit.precision.state import state


class PolicyGuard(BaseTorchFunctionMode):
    """A pass-through torch function mode; each subclass stands for one policy (``guard_for``). Its
    ``__torch_function__`` is torch's own pass-through, which dynamo inlines as torch's code, never as a frame of
    ampkit's (where compiled code breaks its graph, the eager calls between graphs go through it)."""

    key: str = ""


_lock = threading.Lock()
_guards: dict[Resolved, type[PolicyGuard]] = {}


def fingerprint(resolved: Resolved) -> str:
    """The same string for the same resolved policy in every process (sorted lists: a frozenset's order is not)."""
    policy = resolved.policy

    def pattern(p: object) -> str:
        return p if isinstance(p, str) else f"{p.__module__}.{p.__qualname__}"  # type: ignore[attr-defined]

    return json.dumps({
        "device_type": policy.device_type, "dtype": str(policy.dtype), "enabled": policy.enabled,
        "compute": policy.compute, "allow": sorted(policy.allow), "deny": sorted(policy.deny),
        "infer": sorted(policy.infer), "overrides": [[pattern(o.pattern), str(o.dtype)] for o in policy.overrides],
        "float32_ops": sorted(resolved.float32_ops),
    })


def needs_guard(resolved: Resolved) -> bool:
    """Whether a region of ``resolved`` pushes a guard mode: where it does what torch.autocast does not (module
    overrides, a kernel for an op torch.autocast runs) or what the default policy does not (an op torch.autocast
    refuses, run other than in float32)."""
    policy = resolved.policy
    if not policy.enabled:
        return False
    banned = op_lists.BANNED[policy.device_type]  # no set operation on its keys: torch 2.11's dynamo traces this
    return bool(policy.overrides) or any(op not in banned or op not in policy.deny for op in resolved.kernel_ops)


def guard_for(resolved: Resolved) -> type[PolicyGuard]:
    """The mode type that stands for ``resolved`` (one per resolved policy)."""
    with _lock:
        found = _guards.get(resolved)
        if found is None:
            found = type(f"PolicyGuard{len(_guards)}", (PolicyGuard,),
                         {"key": fingerprint(resolved), "__module__": __name__})
            _guards[resolved] = found
        return found


def open_guards() -> list[str]:
    """The keys of the calling thread's open policy guards, outermost first.

    Read from ampkit's region stack, not torch's mode stack: dynamo empties the latter while it compiles.
    """
    return [region.guard.key for region in state.stack if region.guard is not None]


def enter(guard_type: type[PolicyGuard]) -> PolicyGuard:
    """Open a mode of ``guard_type`` in the calling thread, with ampkit's tag among torch.compile's cache keys."""
    _tag_cache_keys()
    guard = guard_type()
    guard.__enter__()
    return guard


class PolicyTag(str):
    """torch.compile's cache-key tag (``torch.compiler.config.cache_key_tag``, the user's value as its own) that
    adds the calling thread's open policies where it is hashed: AOTAutograd's and inductor's caches pickle the
    tag into each key, in the thread that compiles, inside its regions. Without it, AOTAutograd's cache (keyed
    on dynamo's graph, the same under every policy, and on torch.autocast's dtype) handed one edited policy's
    compiled graph to another, on disk and in the same process. Outside ampkit's guarded regions it
    pickles as the user's tag alone: torch.autocast's graphs are keyed as in a process without ampkit.
    """

    def __reduce_ex__(self, protocol: Any) -> tuple[type, tuple[str]]:
        return str, (self.key(),)

    def key(self) -> str:
        guards = open_guards()
        if not guards:
            return str(self)
        return str(self) + " ampkit:" + hashlib.sha256("\n".join([_kernel_source_hash(), *guards]).encode()).hexdigest()

    def __copy__(self) -> PolicyTag:  # config snapshots keep it live
        return self

    def __deepcopy__(self, memo: Any) -> PolicyTag:
        return self


@functools.cache
def _kernel_source_hash() -> str:
    """A hash of the ampkit code that runs below dynamo, at the dispatcher (policies' kernels, float32 compute):
    the traced graph holds what it did, not the code, so a changed ampkit must not find its old graphs on disk
    (a fix to float32 compute's backward was invisible until the cache directory was emptied)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("precision/*.py"), *root.glob("float32_compute/*.py")]):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _tag_cache_keys() -> None:
    """Put a ``PolicyTag`` in the calling thread's torch.compile settings (per thread from torch 2.13 on: they are
    context variables), around the user's tag; again where the user has set another since."""
    config = torch.compiler.config
    tag = config.cache_key_tag
    if not isinstance(tag, PolicyTag):
        config.cache_key_tag = PolicyTag(tag)
