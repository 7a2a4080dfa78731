"""Python kernels at the Autocast dispatch key, for the ops a policy handles unlike torch.

torch.autocast does the casting in C++ at the Autocast dispatch key. ampkit enters
torch.autocast and, for the ops where the policy differs from torch's own lists
(``Policy.edits``) or computes in float32 (``ampkit.float32_compute``), registers Python
kernels at that key with ``torch.library``. So the default policy with native compute
costs exactly what torch.autocast costs (no Python per op), and an edited policy pays a
few microseconds only on the ops it moved.

The dispatcher has no per-thread table, so the registrations are process-wide; they live
only while a region needs them. The first region that needs an op registers it (one
``torch.library.Library`` per region entry), and when the last open region closes every
registration goes (the Library objects are released; their finalizers give the ops back to
torch): outside ampkit's regions, torch runs its own kernels, as in a process that never ran
one (issue 38; ``tests/test_autocast.py`` checks the dispatch, ``benchmarks/bench_after_regions.py``
the time, and what registering and releasing costs: well under a millisecond for an edit of a few ops,
about one for float32 compute's 37, its 36 GEMM-class ops and ``gelu``), paid at each outermost region's entry
(what that is in a small model's training step: ``benchmarks/bench_region_cost.py``).
A segment checkpointed with ``checkpoint_context_fn`` inside a region counts as open until torch drops it: its
recompute re-enters the region in the backward (``checkpointing.py``).
While registered, each kernel reads the calling thread's innermost ampkit region
(``state.py``) and, in a thread without one, does what torch.autocast would.

The release waits while another thread runs: a thread that has looked a kernel up and waits for the GIL to run it
crashes if the kernel is released meanwhile (torch's ``SafePyObject`` assertion, in every run of the race tests in
``tests/test_autocast.py`` that released regardless), and a plain torch.autocast in any thread may be that one. No
public call pins a registered kernel, so the main thread releases where every other thread waits in the standard
library (a lock, a condition, an event, a queue, an idle executor's worker: tqdm's monitor, a DataLoader's pin-memory
thread, the compile threads inductor leaves alive), read from their frames while the releasing thread holds the GIL
with forced hand-overs off: such a thread has looked up no kernel, and must take the GIL to run the Python that
would. Beside a thread that runs, the kernels stay until a region closes where none does, doing what torch's would.

Why not a torch function mode (thread-local, which would need no registration; issue 71's first rule lets
either carry an edit, chosen by measurement): a mode sees Python-level calls, and ``nn.functional``'s Python
composites (``multi_head_attention_forward``, ``mse_loss``) run their inner calls with the mode popped, so an
edited ``linear`` would miss the attention's projections; the Autocast key sees every ATen op, as torch.autocast
does, and lies above autograd, so the casts are differentiated. Measured (``benchmarks/bench_policy_mechanism.py``:
the GPT's eager training step under an edit moving ``add``, ``layer_norm`` and ``gelu``, its record in
BENCHMARKS.md): the kernels' step and a prototype mode's are equal, within the rounds' spread, to the same edit
written by hand under torch.autocast. Same cost, so the kernels stay, for the composites.
"""

from __future__ import annotations

import functools
import inspect
import selectors
import sys
import threading
import types
import warnings
from collections.abc import Callable
from concurrent.futures import thread as futures_thread
from typing import Any

import torch

from ampkit import _torch
from ampkit.float32_compute import run_in_float32
from ampkit.float32_compute.gelu_recompute import recording
from ampkit.precision import op_lists
from ampkit.precision.op_lists import ALLOW, DENY, INFER
from ampkit.precision.policy import autocast_ops, torch_category
from ampkit.precision.state import current_region, state, warn_once

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


def cast_tree(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return cast(value)
    if isinstance(value, (list, tuple)):
        return type(value)(cast_tree(v, cast) for v in value)
    if isinstance(value, dict):
        return {k: cast_tree(v, cast) for k, v in value.items()}
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


def caster(device_type: str, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Cast eligible tensors to ``dtype``; 16-bit casts of weights are cached per region."""
    cache_weights = dtype is not torch.float32

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype is dtype or not _eligible(t, device_type):
            return t
        # Weights: cast once per region (a thread without an ampkit region, which reaches
        # these kernels through plain torch.autocast, has no region to drop a cache with).
        # Not under no_grad / inference_mode: that cast has no autograd link, and a later
        # call with grad would reuse it and leave the weight without a gradient.
        if cache_weights and state.stack and t.is_leaf and t.requires_grad and torch.is_grad_enabled():
            hit = state.weight_cache.get(id(t))
            if hit is None or hit[0] is not t:
                hit = (t, t.to(dtype))
                state.weight_cache[id(t)] = hit
            return hit[1]
        return t.to(dtype)

    return cast


def _composite(overload: _torch.OpOverload) -> bool:
    """Whether torch defines ``overload`` by other ops (a CompositeImplicitAutograd kernel). A TorchScript-only
    overload (einsum.sublist), which the dispatcher does not know, is not."""
    try:
        return overload.has_kernel_for_dispatch_key("CompositeImplicitAutograd")
    except RuntimeError:
        return False


def _make_kernel(device_type: str, op: str, overload: _torch.OpOverload) -> Callable[..., Any]:
    banned_message = op_lists.BANNED[device_type].get(op)
    casters = {dtype: caster(device_type, dtype) for dtype in (torch.float32, torch.float16, torch.bfloat16)}
    torch_default = torch_category(device_type, op)
    torch_default = DENY if torch_default == "banned" else torch_default
    # An op in none of torch's lists that torch defines by other ops (einsum, chain_matmul, lstm_cell on the CPU) is
    # not cast by torch.autocast: its parts are (einsum's bmm). Run whole in float32, it would compute and return
    # float32 on a float32 model's inputs; decomposed here where the policy lists it nowhere either, each part is
    # cast and computed as the policy says. (An op torch lists, such as linear, keeps its own kernel and fast path,
    # also where a 16-bit model's policy lists nothing.)
    decomposes = torch_default is None and _composite(overload)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        region = current_region(device_type)  # None below a plain torch.autocast that changed the dtype
        if region is not None:
            category = region.policy.category(op)  # type: ignore[union-attr]
            in_float32 = op in region.resolved.float32_ops  # type: ignore[union-attr]
        else:  # a thread using plain torch.autocast, or a region that treats this op as torch does
            category, in_float32 = torch_default, False
        if category is None and decomposes:
            return overload.decompose(*args, **kwargs)
        if category == ALLOW:
            cast: Callable[[torch.Tensor], torch.Tensor] | None = casters[torch.get_autocast_dtype(device_type)]
        elif category == DENY:
            if banned_message:
                warn_once(f"banned:{op}", banned_message)
            cast = casters[torch.float32]
        elif category == INFER:
            widest = _widest((args, kwargs), device_type)
            cast = casters[widest] if widest is not None else None
        else:
            cast = None
        # Dispatch below the Autocast key, as torch's own autocast kernels do: disabling autocast is excluding that
        # key from this thread's dispatch (the dispatcher's guard, by torch's public name, and cheaper). It was
        # enabled on entry: the dispatcher reaches this kernel only then.
        torch.set_autocast_enabled(device_type, False)
        try:
            if cast is not None:
                args = cast_tree(args, cast)
                if kwargs:
                    kwargs = cast_tree(kwargs, cast)
            if in_float32:
                return run_in_float32(overload, *args, **kwargs)
            return overload(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(device_type, True)

    return kernel


class _Registry:
    """The torch.library registrations open regions need: counts per (device, op); what a region needs and is not
    registered yet is registered on its entry (one Library), and everything goes when no region needs any."""

    def __init__(self) -> None:
        # Re-entrant: a checkpointed segment's release runs when the garbage collector frees it, which may be while
        # this thread is inside an acquire (_depth > 0): such a release only counts, and drops nothing.
        self._lock = threading.RLock()
        self._depth = 0
        self._counts: dict[tuple[str, str], int] = {}
        self._libs: list[torch.library.Library] = []
        self._registered: set[tuple[str, str]] = set()

    def acquire(self, device_type: str, ops: frozenset[str]) -> None:
        with self._lock:
            self._depth += 1
            try:
                missing = sorted(op for op in ops if (device_type, op) not in self._registered)
                if missing:
                    self._libs.append(self._register(device_type, missing))
                    self._registered.update((device_type, op) for op in missing)
                for op in ops:
                    self._counts[(device_type, op)] = self._counts.get((device_type, op), 0) + 1
            finally:
                self._depth -= 1

    def release(self, device_type: str, ops: frozenset[str]) -> None:
        with self._lock:
            for op in ops:
                key = (device_type, op)
                self._counts[key] -= 1
                if not self._counts[key]:
                    del self._counts[key]
            # No open region needs a kernel: torch's own come back, unless another thread may be running one (below).
            if self._counts or self._depth:
                return
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1e3)  # no forced hand-over of the GIL between the check and the release
            try:
                if _alone():
                    self._libs.clear()
                    self._registered.clear()
            finally:
                sys.setswitchinterval(interval)

    def active(self) -> set[tuple[str, str]]:
        """(device_type, op) pairs whose ampkit kernels an open region needs now."""
        with self._lock:
            return set(self._counts)

    def registered(self) -> set[tuple[str, str]]:
        """(device_type, op) pairs that hold ampkit kernels now (those of every open region, and possibly of regions
        that closed while others stayed open)."""
        with self._lock:
            return set(self._registered)

    @staticmethod
    def _register(device_type: str, ops: list[str]) -> torch.library.Library:
        autocast_ops(device_type)  # read torch's own autocast kernels before ampkit adds one
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            # torch warns (once per process) that a kernel is overridden: that is the point.
            warnings.simplefilter("ignore")
            for op in ops:
                for qualified, kernel in _kernels(device_type, op):
                    lib.impl(qualified, kernel, op_lists.autocast_key(device_type))
        return lib


# Where a thread waits in the standard library: on a lock or a condition (events, queues, joins), on file descriptors
# (selectors: sockets, pipes, multiprocessing queues), or, idle, for its executor's next work item (concurrent.futures'
# worker loop, such as the pool of compile threads inductor leaves alive after a compile: ``_executor_waits``).
_WAITS = frozenset(wait.__code__ for wait in (
    threading.Condition.wait, threading.Thread.join, getattr(threading.Thread, "_wait_for_tstate_lock", None),
    *(vars(kind)["select"] for kind in vars(selectors).values()
      if isinstance(kind, type) and kind is not selectors.BaseSelector and "select" in vars(kind))) if wait)
_KERNEL_CODES: set[types.CodeType] = set()  # the code of ampkit's kernels (``_kernels``)


@functools.cache
def _executor_waits() -> frozenset[tuple[types.CodeType, int]]:
    """(code, line) where concurrent.futures' worker waits for work (read from its source once). Python's own private
    names, here and in ``_WAITS`` and ``_alone``: where a release of Python changes them, such threads count as running
    and the kernels stay, as beside any thread that runs."""
    worker = getattr(futures_thread, "_worker", None)
    try:
        lines, first = inspect.getsourcelines(worker)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return frozenset()
    return frozenset((worker.__code__, first + i) for i, line in enumerate(lines)  # type: ignore[union-attr]
                     if "work_queue.get(block=True)" in line)


def _waiting(frame: types.FrameType | None) -> bool:
    """Whether a thread whose innermost frame is ``frame`` waits in the standard library, no ampkit kernel on its
    stack: it has looked up no kernel, and before it can it must run Python, which needs the GIL the releasing thread
    holds (a thread inside a torch op, which drops the GIL, has the frame that called the op innermost)."""
    if frame is None or not (frame.f_code in _WAITS or (frame.f_code, frame.f_lineno) in _executor_waits()):
        return False
    while frame is not None:
        if frame.f_code in _KERNEL_CODES:
            return False
        frame = frame.f_back
    return True


def _alone() -> bool:
    """Whether the calling thread is the main one and every other thread with Python frames waits (``_waiting``): a
    thread that runs, which a plain torch.autocast may have led into a kernel, keeps the kernels. Only the main thread
    releases: a thread of torch's with no Python frame at the moment, such as an autograd device thread, is unseen."""
    me = threading.get_ident()
    if me != threading.main_thread().ident:
        return False
    _executor_waits()  # read before the frames are: reading a source file may hand the GIL over
    return all(ident == me or _waiting(frame) for ident, frame in sys._current_frames().items())


@functools.cache
def _kernels(device_type: str, op: str) -> tuple[tuple[str, Callable[..., Any]], ...]:
    """``op``'s overloads to register, each with its kernel (made once: regions register them again and again)."""
    packet = getattr(torch.ops.aten, op)
    found = []
    for name in packet.overloads():
        overload = getattr(packet, name)
        if _torch.is_mutable(overload):  # out= and in-place variants keep their dtypes
            continue
        kernel = _make_kernel(device_type, op, overload)
        _KERNEL_CODES.add(kernel.__code__)
        if op == "gelu":  # notes what its output was computed from, for a float32-computed linear reading it
            kernel = recording(kernel)
            _KERNEL_CODES.add(kernel.__code__)
        found.append((op if name == "default" else f"{op}.{name}", kernel))
    return tuple(found)


registry = _Registry()

