"""autocast(policy): run a region in mixed precision as a Policy says.

How it works. torch.autocast does the casting in C++ at the Autocast dispatch
key. ampkit enters torch.autocast and, for the ops where the policy differs
from torch's own lists (``Policy.edits``), registers Python kernels at that key
with ``torch.library``. So the default policy with native compute costs exactly
what torch.autocast costs (no Python per op), and an edited policy pays a few
microseconds only on the ops it moved.

Where a policy computes GEMMs and convolutions in float32 on 16-bit values
(``Policy.compute``; see ``ampkit.compute``), those ops get kernels too: they
cast as the policy says, then run through ``compute.run_in_float32``.

The registrations are process-wide (the dispatcher has no per-thread table)
and stay for the life of the process once a region first needed them:
registering costs about 0.1-0.3 ms per op, too much to pay on every step, and
removing a kernel while another thread dispatches to it is not safe. Each
kernel reads the calling thread's innermost ampkit region and, in a thread
without one, does what torch.autocast would. Per-module overrides use global
module hooks, installed only while a region with overrides is open.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from ampkit import compute, hardware, op_lists
from ampkit.op_lists import ALLOW, DENY, INFER
from ampkit.policy import Policy

F = TypeVar("F", bound=Callable[..., Any])

_AUTOCAST_KEYS = {
    "cpu": torch._C.DispatchKey.AutocastCPU,
    "cuda": torch._C.DispatchKey.AutocastCUDA,
}


class _Region(NamedTuple):
    device_type: str
    policy: Policy | None  # None where autocast is off
    ctx: torch.autocast
    float32_ops: frozenset[str]  # ops computed in float32 on 16-bit values
    nesting: int  # torch.autocast's nesting level once this region's own torch.autocast is entered


def _torch_nesting() -> int:
    """How many torch.autocast contexts this thread has open (torch offers no plain getter)."""
    level = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return level - 1


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # Innermost last.
        self.stack: list[_Region] = []
        # Modules whose forward entered an override: (module, torch.autocast ctx).
        self.module_stack: list[tuple[nn.Module, torch.autocast]] = []
        # Leaf float32 tensor id -> (tensor, cast copy), dropped when the outermost region exits.
        self.weight_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


_state = _ThreadState()
_warned: set[str] = set()


def _warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=3)


def _current_region(device_type: str) -> _Region | None:
    """The innermost region for ``device_type``; None outside any, or inside a disabled one
    (where a plain torch.autocast opened within gets torch's own behaviour)."""
    for region in reversed(_state.stack):
        if region.device_type == device_type:
            return region if region.policy is not None else None
    return None


def current_policy(device_type: str) -> Policy | None:
    """The calling thread's innermost enabled ampkit policy for ``device_type``, if any."""
    region = _current_region(device_type)
    return region.policy if region is not None else None


def weight_cache_size() -> int:
    """How many cast weights this thread's open region caches (0 outside a region)."""
    return len(_state.weight_cache)


# ---------------------------------------------------------------------------
# Casting kernels for edited ops


def _eligible(t: object, device_type: str) -> bool:
    """torch's rule: floating tensors on the region's device, float64 excepted."""
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dtype is not torch.float64
        and (t.is_cuda if device_type == "cuda" else t.is_cpu)
    )


def _cast_tree(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return cast(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_tree(v, cast) for v in value)
    if isinstance(value, dict):
        return {k: _cast_tree(v, cast) for k, v in value.items()}
    return value


def _widest(values: Any, device_type: str) -> torch.dtype | None:
    """torch's promote rule: float32 if any input is float32 or two 16-bit types mix."""
    found: set[torch.dtype] = set()

    def visit(v: Any) -> None:
        if _eligible(v, device_type):
            found.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        elif isinstance(v, dict):
            visit(list(v.values()))

    visit(values)
    if not found:
        return None
    return found.pop() if len(found) == 1 else torch.float32


def _caster(device_type: str, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Cast eligible tensors to ``dtype``; 16-bit casts of weights are cached per region."""
    cache_weights = dtype is not torch.float32

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype is dtype or not _eligible(t, device_type):
            return t
        # Weights: cast once per region (a thread without an ampkit region, which reaches
        # these kernels through plain torch.autocast, has no region to drop a cache with).
        # Not under no_grad / inference_mode: that cast has no autograd link, and a later
        # call with grad would reuse it and leave the weight without a gradient.
        if cache_weights and _state.stack and t.is_leaf and t.requires_grad and torch.is_grad_enabled():
            hit = _state.weight_cache.get(id(t))
            if hit is None or hit[0] is not t:
                hit = (t, t.to(dtype))
                _state.weight_cache[id(t)] = hit
            return hit[1]
        return t.to(dtype)

    return cast


# torch.compile guards on torch.autocast's state, not on ampkit's policy: a graph traced under
# one edited policy would run under any other with the first one's dtypes. Refuse clearly.
_COMPILE_UNSUPPORTED = (
    "torch.compile cannot trace code under an edited or float32-compute ampkit policy, nor an ampkit.autocast "
    "region: the compiled graph would keep one policy's dtypes under any other. Run that code eagerly, or "
    "compile it and use torch.autocast around it (ampkit's default policy with compute='native' is "
    "torch.autocast)."
)


_SCRIPT_UNSUPPORTED = (
    "torch.jit.script cannot compile an ampkit.autocast region or a function decorated with one (TorchScript "
    "would keep none of the policy). Script the code inside the region and call it under ampkit.autocast from "
    "Python, or use torch.autocast in scripted code, as torch.jit.script supports it."
)


def _make_kernel(device_type: str, op: str, overload: torch._ops.OpOverload) -> Callable[..., Any]:
    keyset = torch._C.DispatchKeySet(_AUTOCAST_KEYS[device_type])
    banned_message = op_lists.BANNED[device_type].get(op)
    casters = {dtype: _caster(device_type, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    torch_category = op_lists.torch_category(device_type, op)
    torch_category = DENY if torch_category == "banned" else torch_category

    def kernel(*args: Any, **kwargs: Any) -> Any:
        region = _current_region(device_type)
        if region is not None and _torch_nesting() > region.nesting:
            region = None  # a plain torch.autocast opened inside the region: torch's own behaviour, as alone
        if region is not None:
            category = region.policy.category(op)  # type: ignore[union-attr]
            in_float32 = op in region.float32_ops
            if (in_float32 or category != torch_category) and torch.compiler.is_compiling():
                raise RuntimeError(_COMPILE_UNSUPPORTED)
        else:  # a thread using plain torch.autocast, or a region that treats this op as torch does
            category, in_float32 = torch_category, False
        if category == ALLOW:
            cast: Callable[[torch.Tensor], torch.Tensor] | None = casters[torch.get_autocast_dtype(device_type)]
        elif category == DENY:
            if banned_message:
                _warn_once(f"banned:{op}", banned_message)
            cast = casters[torch.float32]
        elif category == INFER:
            widest = _widest((args, kwargs), device_type)
            cast = casters[widest] if widest is not None else None
        else:
            cast = None
        with torch._C._ExcludeDispatchKeyGuard(keyset):
            if cast is not None:
                args = _cast_tree(args, cast)
                if kwargs:
                    kwargs = _cast_tree(kwargs, cast)
            if in_float32:
                return compute.run_in_float32(overload, *args, **kwargs)
            return overload(*args, **kwargs)

    return kernel


class _Registry:
    """torch.library registrations, one Library per (device, op), registered on first
    need and kept; counts say which are needed by an open region now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._libs: dict[tuple[str, str], torch.library.Library] = {}

    def acquire(self, device_type: str, ops: frozenset[str]) -> None:
        with self._lock:
            for op in ops:
                key = (device_type, op)
                if key not in self._libs:
                    self._libs[key] = self._register(device_type, op)
                self._counts[key] = self._counts.get(key, 0) + 1

    def release(self, device_type: str, ops: frozenset[str]) -> None:
        with self._lock:
            for op in ops:
                self._counts[(device_type, op)] -= 1

    def active(self) -> set[tuple[str, str]]:
        """(device_type, op) pairs whose ampkit kernels an open region needs now."""
        with self._lock:
            return {key for key, count in self._counts.items() if count}

    def registered(self) -> set[tuple[str, str]]:
        """(device_type, op) pairs that hold ampkit kernels (for the rest of the process)."""
        with self._lock:
            return set(self._libs)

    @staticmethod
    def _register(device_type: str, op: str) -> torch.library.Library:
        lib = torch.library.Library("aten", "IMPL")
        packet = getattr(torch.ops.aten, op)
        with warnings.catch_warnings():
            # torch warns (once per process) that a kernel is overridden: that is the point.
            warnings.simplefilter("ignore")
            for name in packet.overloads():
                overload = getattr(packet, name)
                if overload._schema.is_mutable:  # out= and in-place variants keep their dtypes
                    continue
                qualified = op if name == "default" else f"{op}.{name}"
                lib.impl(qualified, _make_kernel(device_type, op, overload), _AUTOCAST_KEYS[device_type].name)
        return lib


_registry = _Registry()


# ---------------------------------------------------------------------------
# Per-module overrides

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


def _name_modules(root: nn.Module) -> None:
    """Record qualified names relative to ``root``, the first module seen of its tree."""
    if root not in _module_names:
        for name, sub in root.named_modules():
            _module_names[sub] = name


def _pre_hook(module: nn.Module, args: tuple) -> tuple | None:
    top = _state.stack[-1] if _state.stack else None
    if top is None or top.policy is None or not top.policy.overrides:
        return None
    policy = top.policy
    _name_modules(module)
    dtype = _override_for(module, policy)
    if dtype is None:
        return None
    if dtype == torch.float32:
        ctx = torch.autocast(policy.device_type, enabled=False)
        pushed = None
        # Positional inputs only: torch's global pre-hooks do not see keyword arguments.
        args = _cast_tree(args, _caster(policy.device_type, torch.float32))
    else:
        ctx = torch.autocast(policy.device_type, dtype=policy.dtype)
        pushed = policy.all_low
    ctx.__enter__()
    _state.stack.append(_Region(policy.device_type, pushed, ctx, top.float32_ops, _torch_nesting()))
    _state.module_stack.append((module, ctx))
    return args


def _post_hook(module: nn.Module, args: tuple, output: Any) -> None:
    if _state.module_stack and _state.module_stack[-1][0] is module:
        _, ctx = _state.module_stack.pop()
        _state.stack.pop()
        ctx.__exit__(None, None, None)


def _acquire_hooks() -> None:
    global _hooks_count
    with _hooks_lock:
        if _hooks_count == 0:
            from torch.nn.modules import module as module_mod

            _hook_handles.append(module_mod.register_module_forward_pre_hook(_pre_hook))  # type: ignore[arg-type]
            _hook_handles.append(
                module_mod.register_module_forward_hook(_post_hook, always_call=True)
            )
        _hooks_count += 1


def _release_hooks() -> None:
    global _hooks_count
    with _hooks_lock:
        _hooks_count -= 1
        if _hooks_count == 0:
            while _hook_handles:
                _hook_handles.pop().remove()


def _kernel_ops(policy: Policy, float32_ops: frozenset[str]) -> frozenset[str]:
    """The ops that need ampkit kernels for ``policy``, its module overrides and its
    float32-computed ops."""
    ops = policy.edits | float32_ops
    if any(o.dtype != torch.float32 for o in policy.overrides):
        ops = ops | policy.all_low.edits
    return ops


# ---------------------------------------------------------------------------
# Activation checkpointing

_checkpoint_lock = threading.Lock()
_checkpoint_hooked = False


def _reentering(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, re-entering the calling thread's ampkit regions when it runs outside them.

    torch.utils.checkpoint recomputes a segment during backward, after the region has
    exited; it restores torch.autocast's state but cannot know ampkit's.
    """
    policies = [p for p in (current_policy(d) for d in _AUTOCAST_KEYS) if p is not None]
    if not policies:
        return fn

    @functools.wraps(fn)
    def recompute(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for policy in policies:
                if current_policy(policy.device_type) is not policy:  # in the forward, it still is
                    stack.enter_context(autocast(policy))
            return fn(*args, **kwargs)

    return recompute


def _hook_checkpoint() -> None:
    """Make torch.utils.checkpoint (both modes) recompute under the policy of its forward.

    Wraps the segment function where torch's checkpoint hands it over: the reentrant
    ``CheckpointFunction`` and the non-reentrant generator, both looked up at call time,
    so ``from torch.utils.checkpoint import checkpoint`` is covered too.
    """
    global _checkpoint_hooked
    with _checkpoint_lock:
        if _checkpoint_hooked:
            return
        _checkpoint_hooked = True
        from torch.utils import checkpoint as cp

        generator = getattr(cp, "_checkpoint_without_reentrant_generator", None)
        function = getattr(cp, "CheckpointFunction", None)
        if generator is None or function is None:
            _warn_once("checkpoint", f"ampkit cannot hook torch.utils.checkpoint of torch {torch.__version__}: "
                       "checkpointed segments inside an edited or float32-compute region recompute without "
                       "its policy.")
            return

        original: Any = function

        def without_reentrant(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return generator(_reentering(fn), *args, **kwargs)

        class CheckpointFunction(original):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
                return original.forward(ctx, _reentering(run_function), preserve_rng_state, *args)

        setattr(cp, "_checkpoint_without_reentrant_generator", without_reentrant)
        setattr(cp, "CheckpointFunction", CheckpointFunction)


# ---------------------------------------------------------------------------
# The public context manager


class autocast:  # noqa: N801 - named like torch.autocast, which it extends
    """Run a region (or a function) in mixed precision as ``policy`` says.

    Args:
        policy: the Policy; defaults to ``Policy.default()`` for the CPU.
        enabled: False (or a disabled policy) turns autocasting off inside the
            region, also inside an enclosing enabled region. Default True.

    Nestable, re-entrant and thread-safe: one instance can decorate a
    ``forward`` that runs in several threads at once. Casts of float32 weights
    are cached for the outermost region and dropped when it exits.

    Example:
        >>> policy = ampkit.Policy.default("cpu", torch.bfloat16)
        >>> with ampkit.autocast(policy):
        ...     loss = loss_fn(model(x), y)
        >>> loss.backward()  # outside the region, as with torch.autocast

    Note:
        An edited policy, or float32 compute, registers process-wide dispatcher
        kernels on entry of the first region that needs them (0.1-0.3 ms per op,
        once per process); they stay, and do what torch.autocast does in threads
        without an ampkit region. ``"auto"`` compute reads ``hardware.measure()``,
        which times this machine's kernels for about a second the first time it
        ever runs here (then it is cached on disk).
    """

    def __init__(self, policy: Policy | None = None, *, enabled: bool = True) -> None:
        policy = policy if policy is not None else Policy.default("cpu")
        if not isinstance(policy, Policy):
            raise ValueError(
                f"ampkit.autocast takes an ampkit.Policy, got {type(policy).__name__}: "
                "build one with ampkit.Policy.default(device_type, dtype)."
            )
        self.policy = policy if enabled else policy.disabled()
        self.float32_ops = compute.float32_ops(self.policy) if self.policy.enabled else frozenset()
        self._kernel_ops = _kernel_ops(self.policy, self.float32_ops) if self.policy.enabled else frozenset()
        self._hooks = bool(self.policy.enabled and self.policy.overrides)  # module overrides need the global hooks
        if self.float32_ops:
            key = f"compute:{self.policy.device_type}:{self.policy.dtype}:{self.policy.compute}"
            _warn_once(key, compute.describe(self.policy), compute.ComputeModeWarning)
        elif self.policy.enabled and self.policy.compute == "native":
            slow = hardware.slow_native_message(self.policy.device_type, self.policy.dtype)
            if slow:
                _warn_once(f"slow:{self.policy.device_type}:{self.policy.dtype}", slow, hardware.SlowPrecisionWarning)

    def __enter__(self) -> autocast:
        if torch.compiler.is_compiling():
            raise RuntimeError(_COMPILE_UNSUPPORTED)
        policy = self.policy
        if policy.enabled:
            ctx = torch.autocast(policy.device_type, dtype=policy.dtype)
        else:
            ctx = torch.autocast(policy.device_type, enabled=False)
        if self._hooks:
            _acquire_hooks()
        if self._kernel_ops:
            _registry.acquire(policy.device_type, self._kernel_ops)
            _hook_checkpoint()  # torch restores its own autocast state on recompute, not ampkit's
        ctx.__enter__()
        _state.stack.append(_Region(policy.device_type, policy if policy.enabled else None, ctx, self.float32_ops,
                                    _torch_nesting()))
        return self

    def __exit__(self, *exc: object) -> None:
        if not _state.stack:
            raise RuntimeError("ampkit.autocast.__exit__() without __enter__(): use `with ampkit.autocast(policy):`.")
        ctx = _state.stack.pop().ctx
        ctx.__exit__(*exc)
        if self._hooks:
            _release_hooks()
        if self._kernel_ops:
            _registry.release(self.policy.device_type, self._kernel_ops)
        if not _state.stack:
            _state.weight_cache.clear()

    def __call__(self, fn: F) -> F:
        # torch.compile runs a decorated function eagerly (a graph break) rather than trace
        # it: a traced graph would keep this policy's dtypes under any other.
        # torch.jit.script meeting `with ampkit.autocast(...)` fails here, showing these lines:
        @torch.compiler.disable
        @functools.wraps(fn)  # torch.jit.script cannot compile an ampkit region: use torch.autocast in scripted code
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.policy.overrides and args and isinstance(args[0], nn.Module):
                _name_modules(args[0])  # a decorated forward: names are relative to its module
            with self:
                return fn(*args, **kwargs)

        # torch.jit.script would compile the undecorated function (it follows __wrapped__) and
        # silently drop the policy; this attribute makes it refuse instead.
        setattr(wrapper, "__script_unsupported", _SCRIPT_UNSUPPORTED)
        return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------------
# Custom autograd functions


def custom_fwd(
    fwd: Callable[..., Any] | None = None,
    *,
    device_type: str,
    cast_inputs: torch.dtype | None = None,
) -> Callable[..., Any]:
    """Decorate an ``autograd.Function.forward`` for ampkit.autocast regions.

    torch.amp.custom_fwd plus the ampkit policy: the forward's policy is
    remembered so ``custom_bwd`` runs the backward under the same policy and
    autocast state, also when the backward runs after the region exited.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        cast_inputs: if set, floating inputs are cast to it and the forward runs
            with autocast off (torch's semantics).
    """
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    torch_fwd = torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)

    @functools.wraps(fwd)
    def forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        ctx._ampkit_policy = current_policy(device_type)
        return torch_fwd(ctx, *args, **kwargs)

    return forward


def custom_bwd(bwd: Callable[..., Any] | None = None, *, device_type: str) -> Callable[..., Any]:
    """Decorate the matching ``backward``: it runs under its forward's policy."""
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def under_policy(ctx: Any, *grads: Any) -> Any:
        policy = getattr(ctx, "_ampkit_policy", None)
        if policy is None or not ctx._fwd_used_autocast:
            return bwd(ctx, *grads)
        # Inside torch's restored autocast state, so that the region counts it as its own base
        # (a torch.autocast opened inside a region would otherwise take over, as a plain one does).
        with autocast(policy):
            return bwd(ctx, *grads)

    return torch.amp.custom_bwd(under_policy, device_type=device_type)
