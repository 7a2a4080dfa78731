"""The calling thread's open ampkit regions: what every autocast kernel and hook reads.

torch's dispatcher has no per-thread kernel table, so ampkit's kernels are process-wide
and decide per call from this thread-local stack (innermost last).
"""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ampkit.precision.policy import Policy, Resolved


class Region(NamedTuple):
    """One open region (an ampkit.autocast, or a module override inside one)."""

    device_type: str
    resolved: Resolved | None  # its policy, resolved (decide.py); None where a float32 override turns autocast off
    ctx: torch.autocast
    guard: Any = None  # the torch function mode torch.compile guards this region's policy by (compiling.py)
    model: nn.Module | None = None  # the module whose modules its overrides match
    modules: Any = None  # overrides.Matches: the modules its overrides run in another dtype, with their forward wrapped

    @property
    def policy(self) -> Policy | None:
        """The region's policy; None where autocast is off."""
        policy = self.resolved.policy if self.resolved is not None else None
        return policy if policy is not None and policy.enabled else None


class ThreadState(threading.local):
    """Per thread: the open regions and the weight-cast cache."""

    def __init__(self) -> None:
        # Innermost last.
        self.stack: list[Region] = []
        # Leaf float32 tensor id -> (tensor, cast copy), dropped when the outermost region exits.
        self.weight_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


state = ThreadState()
_warned: set[str] = set()


# ampkit's and torch's own files: a warning points past them, at the line of the user's that led to it.
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(str(m.__file__))) + os.sep for m in (torch, sys.modules["ampkit"]))


def user_stacklevel() -> int:
    """The ``stacklevel`` at which a ``warnings.warn`` in the calling function names the first frame outside
    ampkit and torch: the user's ``ampkit.initialize(...)`` or ``model(x)``, not ampkit's file."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(key: str, message: str | Callable[[], str | None], category: type[Warning] = UserWarning) -> None:
    """Warn ``message`` the first time ``key`` is seen in this process, at the user's line. A callable ``message``
    is asked then only (None: nothing to say): regions are built every step, and their notes' texts read measurements
    (asked at every build, that was most of an empty region's time: ``benchmarks/bench_region_cost.py``)."""
    if key not in _warned:
        _warned.add(key)
        text = message() if callable(message) else message
        if text is not None:
            warnings.warn(text, category, stacklevel=user_stacklevel())


def current_region(device_type: str) -> Region | None:
    """The innermost region for ``device_type`` where it is in force; None outside any, inside a disabled one, or
    where a plain torch.autocast opened inside it has changed torch.autocast's state for the device (turned it
    off, or to another dtype): there torch's own behaviour, as without ampkit.

    A plain torch.autocast with the region's own dtype leaves the region in force, as torch's own nesting rule
    leaves an outer torch.autocast's behaviour under an inner one with the same settings. It changes nothing that
    torch.compile guards (torch.autocast's enabled flags and dtypes, the mode stack), so a rule that told the two
    apart (the nesting depth did, until issue 38) gave compiled code the other case's dtypes.
    """
    for region in reversed(state.stack):
        if region.device_type == device_type:
            policy = region.policy
            if (policy is None or not torch.is_autocast_enabled(device_type)
                    or torch.get_autocast_dtype(device_type) is not policy.dtype):
                return None
            return region
    return None


def current_policy(device_type: str) -> Policy | None:
    """The calling thread's innermost enabled ampkit policy for ``device_type``, if any."""
    region = current_region(device_type)
    return region.policy if region is not None else None


def weight_cache_size() -> int:
    """How many cast weights this thread's open region caches (0 outside a region)."""
    return len(state.weight_cache)
