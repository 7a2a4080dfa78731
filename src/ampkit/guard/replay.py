"""Where a guarded step's non-finite value came from: a micro-batch holding one, else a replay of each micro-batch on
a copy of the model (``find_nonfinite``), under the region the step's forward ran in.

A forward pre-hook on the model notes that region at each training forward: the innermost ampkit policy in force
(``initialize``'s, a user's ``ampkit.autocast``), else torch.autocast's dtype where the loop opened one (torch's AMP
recipe, Lightning's and Accelerate's own precisions), else float32. A replay in float32 reproduced no float16
overflow of a loop's own torch.autocast, and every later step was skipped unexplained.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.guard import ranks
from ampkit.guard.layers import LayerWatch
from ampkit.precision.state import current_policy

NOT_REPRODUCED = "not reproduced by a replay of the batch"


class Replay:
    """The guard's attribution of a non-finite step (see the module docstring).

    Args:
        model: the guarded model (the hook that notes the region goes on it).
        watch: the guard's layer watch, quiet during a replay (the copy's hooks are its own).
        loss_fn: ``loss_fn(output, target) -> loss``, or None (``find_nonfinite``'s default).
        run: ``run(model, batch) -> loss``, a whole batch's loss (a LightningModule's ``training_step``), or None:
            ``loss_fn(model(inputs), target)``.
    """

    def __init__(self, model: nn.Module, watch: LayerWatch, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 run: Callable[[nn.Module, Any], torch.Tensor] | None) -> None:
        self.model, self.watch, self.loss_fn, self.run = model, watch, loss_fn, run
        self.device_type = next((p.device.type for p in model.parameters()), "cpu")
        self.region: list[Any] = [None]  # an ampkit policy, a torch.autocast dtype, or None
        self._hook = model.register_forward_pre_hook(_region_noter(self.region, self.device_type))

    def attribute(self, batches: list[Any]) -> tuple[str, str | None]:
        """Where the step's non-finite value came from, in words, and the module to raise (None: a batch, or
        unknown): the first micro-batch holding an inf or a NaN, else the first op a replay finds."""
        what = (lambda i: "the batch") if len(batches) == 1 else (lambda i: f"micro-batch {i} of {len(batches)}")
        for i, batch in enumerate(batches):
            index = ranks.nonfinite_batch(batch if self.run is not None else split(batch))
            if index is not None:
                return f"{what(i)}: its tensor {index} holds an inf or a NaN", None
        if all(split(batch)[0] is None for batch in batches):
            return "unknown (pass the batch to Guard.step to replay it)", None
        for i, batch in enumerate(batches):
            finding = self._replay(batch)
            if finding is not None:
                upstream = "" if finding.finite_inputs else ", its inputs already non-finite"
                layer = finding.module if finding.finite_inputs and finding.module != "(model)" else None
                of = "" if len(batches) == 1 else f", {what(i)}"
                return f"{finding.module} ({finding.op} in {finding.phase}{upstream}{of})", layer
        return NOT_REPRODUCED, None

    def _replay(self, batch: Any) -> Any:
        """``find_nonfinite`` on a copy of the model with ``batch``, under the region the step's forward ran in."""
        from ampkit.diagnostics.nonfinite import find_nonfinite

        sampling, self.watch.sampling = self.watch.sampling, False
        region = self.region[0]
        if isinstance(region, torch.dtype):  # the loop's own torch.autocast
            region = torch.autocast(self.device_type, dtype=region)
        try:
            replica = copy.deepcopy(self.model)  # the replay's backward must not add into the run's gradients
            if self.run is None:
                inputs, target = split(batch)
                return find_nonfinite(replica, inputs, region, target=target, loss_fn=self.loss_fn)
            return find_nonfinite(replica, batch, region, run=self.run)
        finally:
            self.watch.sampling = sampling

    def close(self) -> None:
        self._hook.remove()


def _region_noter(region: list[Any], device_type: str) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook that keeps in ``region[0]`` the region a training forward runs in (a closure, not a bound
    method: the replay's deep copy of the model copies its hooks)."""
    def note(module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return  # compiled code keeps no Python state; an evaluation's region is not the step's
        policy = current_policy(device_type)
        region[0] = (policy if policy is not None else torch.get_autocast_dtype(device_type)
                     if torch.is_autocast_enabled(device_type) else None)
    return note


def split(batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch given as a pair, or inputs alone."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None
