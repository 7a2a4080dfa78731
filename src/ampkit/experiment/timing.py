"""A timed training step: what the plan's estimate and ``--size auto`` time (``cost.py``, ``sizing.py``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for ``device``'s queue (nothing on a CPU): a timing covers the work, not its launch."""
    return functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else lambda: None


def timed_step(forward: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, sync: Callable[[], None], micro_batches: int = 1,
                check: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits) -> tuple[float, float]:
    """One training step (cross-entropy on ``check(forward(x))``, a backward per micro-batch, as the runs do);
    returns its time and its forwards' (what the whole batch's forward costs, as evaluation runs it)."""
    t0 = time.perf_counter()
    forward_s = 0.0
    optimizer.zero_grad(set_to_none=True)
    for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        f0 = time.perf_counter()
        logits = check(forward(xm))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ym.reshape(-1)) / micro_batches
        sync()
        forward_s += time.perf_counter() - f0
        loss.backward()
    optimizer.step()
    sync()
    return time.perf_counter() - t0, forward_s
