"""torch.compile inside ampkit regions: a policy torch.compile cannot see runs compiled code eagerly.

torch.compile guards on torch.autocast's state, not on ampkit's: a graph traced under one policy and
found in dynamo's cache would run under any other with the first one's dtypes, silently (a function
compiled under the default policy, then called under ``with_ops(deny=["mm"])``, returned bfloat16 from
the mm). Until ampkit's policies enter the compiled graph (issue 23), every region whose policy differs
from torch.autocast's (edited lists, float32 compute, module overrides: what needs ampkit's dispatcher
kernels or hooks) sets torch.compiler's stance to ``"force_eager"`` while it is open: compiled functions
called inside run as plain Python, through ampkit's kernels, with the region's dtypes. The default policy
with ``compute="native"`` is torch.autocast itself and stays compiled.

The stance is process-wide (torch keeps one): while such a region is open in one thread, compiled code
in other threads runs eagerly too: slower, never wrong. Regions count, so the last one to close restores
the stance that was there before the first.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_lock = threading.Lock()
_open = 0
_stance: Any = None  # torch's set_stance object while regions hold it: its exit restores the earlier stance


def hold_eager() -> None:
    """Make compiled code run eagerly until the matching ``release_eager`` (counted, thread-safe)."""
    global _open, _stance
    with _lock:
        if _open == 0:
            _stance = torch.compiler.set_stance("force_eager")
        _open += 1


def release_eager() -> None:
    """Undo one ``hold_eager``; the last one restores the stance that was there before."""
    global _open, _stance
    with _lock:
        _open -= 1
        if _open == 0 and _stance is not None:
            _stance.__exit__(None, None, None)
            _stance = None


def eager_held() -> bool:
    """Whether ampkit regions hold compiled code to eager execution now."""
    return _open > 0
