"""Where a guarded step's non-finite value came from: a micro-batch holding one, else a replay of each micro-batch on
a copy of the model (``find_nonfinite``), under the region the step's forward ran in.

A forward pre-hook on the model and on its first child notes that region at each training forward: the innermost
ampkit policy in force (``initialize``'s, which wraps the forward, or a user's ``ampkit.autocast``), else
torch.autocast's dtype where the loop opened one (torch's AMP recipe, Lightning's and Accelerate's own precisions),
else float32. A replay in float32 reproduced no float16
overflow of a loop's own torch.autocast, and every later step was skipped unexplained.
"""

from __future__ import annotations

import contextlib
import copy
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampkit.guard import ranks
from ampkit.guard.layers import LayerWatch
from ampkit.precision.state import current_policy

NOT_REPRODUCED = "not reproduced by a replay of the batch"
OVER_RANKS = "not replayed: the run spans ranks"


def by_figures(where: str, layer: str | None, sampled: tuple[str, str, str] | None) -> tuple[str, str | None]:
    """``(where, layer)`` as the replay said; where it names no layer, not reproduced or not replayed (a run over
    ranks, a step without its batch), the step's ``sampled`` figures' worst layer (``layers.worst``), if any."""
    if layer is None and where.startswith((NOT_REPRODUCED, "not replayed")) and sampled is not None:
        return f"{sampled[1]} ({sampled[0]}; {where})", sampled[2]
    return where, layer


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
        # noted at the model's call (the loop's own region) and at its first child's, inside the forward (the region
        # initialize wraps the forward in)
        note = _region_noter(self.region, self.device_type)
        first = next(model.children(), None)
        self._hooks = [module.register_forward_pre_hook(note) for module in (model, first) if module is not None]
        # the random state each training forward began with, for the replay to draw dropout's masks as the step did:
        # at the model's call, or where a step's own code calls no forward (run: a training_step), its first child's
        self.random = _RandomStates(self.device_type)
        at = model if run is None or first is None else first
        self._hooks.append(at.register_forward_pre_hook(self.random.note))

    def sixteen(self) -> torch.dtype | None:
        """The 16-bit dtype of the region the last training forward ran in (None: float32, or none noted yet)."""
        region = self.region[0]
        dtype = region if isinstance(region, torch.dtype) else getattr(region, "dtype", None)
        return dtype if dtype in (torch.float16, torch.bfloat16) else None

    def attribute(self, batches: list[Any], scale: float = 1.0, group: Any = None) -> tuple[str, str | None]:
        """Where the step's non-finite value came from, in words, and the module to raise (None: a batch, or
        unknown): the first micro-batch holding an inf or a NaN, else the first op a replay finds, its loss multiplied
        by ``scale`` (the loss scale the step's backward ran at). Over ``group``'s ranks (a process group): each rank
        re-runs its own micro-batches on the live model (``_over_ranks``), every rank called alike."""
        if all(split(batch)[0] is None for batch in batches):
            return "unknown (pass the batch to Guard.step to replay it)", None
        if group is not None:
            return self._over_ranks(batches, scale, group)
        held = self._held(batches)
        if held is not None:
            return held
        states = self.random.last(len(batches))
        for i, batch in enumerate(batches):
            finding = self._replay(batch, scale, states[i])
            if finding is not None:
                return _finding(finding, i, len(batches))
        return NOT_REPRODUCED, None

    def scaler_skip(self, batches: list[Any], scale: float, group: Any = None) -> tuple[str, str | None] | None:
        """A step a loss scaler skipped, re-run at its ``scale``: None where the overflow is reproduced there and not
        unscaled (the scaler's own: a lower scale cures it); ``(NOT_REPRODUCED, None)`` where it is not reproduced
        (transient); else where it overflows unscaled, and the module to raise (no scale cures it). ``group``: as
        ``attribute``'s."""
        if self.attribute(batches, scale, group) == (NOT_REPRODUCED, None):
            return NOT_REPRODUCED, None
        where, layer = self.attribute(batches, 1.0, group)
        return None if where == NOT_REPRODUCED else (f"{where}, unscaled", layer)

    def _held(self, batches: list[Any]) -> tuple[str, None] | None:
        """The first micro-batch holding an inf or a NaN, in words; None where none does."""
        for i, batch in enumerate(batches):
            index = ranks.nonfinite_batch(batch if self.run is not None else split(batch))
            if index is not None:
                return f"{_micro_batch(i, len(batches))}: its tensor {index} holds an inf or a NaN", None
        return None

    def _over_ranks(self, batches: list[Any], scale: float, group: Any) -> tuple[str, str | None]:
        """``attribute`` over ranks. The model is not copied (FSDP2 refuses a copy): each rank re-runs every one of
        its micro-batches on the live model, forward and backward whatever it finds (FSDP2's all-gathers and
        reduce-scatters are collectives: every rank must run the same ones), from the gradients of none (the step is
        refused either way: its gradients are dropped after), its buffers as they were after it. Each rank's answer
        is gathered; the lowest rank whose micro-batch holds an inf or a NaN decides, else the lowest whose replay
        names a module to raise, else the lowest with any finding; none: not reproduced on any rank."""
        states = self.random.last(len(batches))
        for param in self.model.parameters():
            param.grad = None
        kept = [(buffer, buffer.detach().clone()) for buffer in self.model.buffers()]  # a norm's running figures
        try:
            findings = [self._replay(batch, scale, state, live=True) for batch, state in zip(batches, states)]
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)
        first = next(((i, f) for i, f in enumerate(findings) if f is not None), None)
        mine = self._held(batches) or (_finding(first[1], first[0], len(batches)) if first else (NOT_REPRODUCED, None))
        answers: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(answers, mine, group=group)
        held = [r for r, (where, _) in enumerate(answers) if where.startswith(("the batch", "micro-batch"))]
        named = [r for r, (_, layer) in enumerate(answers) if layer is not None]
        found = [r for r, (where, _) in enumerate(answers) if where != NOT_REPRODUCED]
        rank = next(iter(held or named or found), None)
        if rank is None:
            return NOT_REPRODUCED, None
        where, layer = answers[rank]
        return f"{where} on rank {rank}", layer

    def _replay(self, batch: Any, scale: float, state: Any, live: bool = False) -> Any:
        """``find_nonfinite`` on a copy of the model with ``batch``, under the region the step's forward ran in, its
        loss multiplied by ``scale``, from the random ``state`` its forward began with (None: the run's own).
        ``live``: on the model itself, the backward run whatever the forward found (``_over_ranks``)."""
        from ampkit.diagnostics.nonfinite import find_nonfinite
        from ampkit.diagnostics.numerics import default_loss

        sampling, self.watch.sampling = self.watch.sampling, False
        region = self.region[0]
        if isinstance(region, torch.dtype):  # the loop's own torch.autocast
            region = torch.autocast(self.device_type, dtype=region)
        try:
            # the replay's backward must not add into the run's gradients: a copy, or (live) the gradients dropped
            replica = self.model if live else copy.deepcopy(self.model)
            with self.random.restored(state):
                if self.run is not None:
                    run = self.run
                    return find_nonfinite(replica, batch, region, run=lambda model, batch: run(model, batch) * scale,
                                          collective=live)
                inputs, target = split(batch)
                loss_fn = self.loss_fn or default_loss
                return find_nonfinite(replica, inputs, region, target=target, collective=live,
                                      loss_fn=lambda output, target: loss_fn(output, target) * scale)
        finally:
            self.watch.sampling = sampling

    def spike(self, batches: list[Any], limit: float) -> tuple[str, str | None]:
        """Whether float32 reproduces a loss spike (a loss over ``limit``) on the step's micro-batches, in words, and
        the module to raise (None: float32 reproduces it, or nothing says): ``float32_departure`` of each micro-batch
        (the mean of their losses; the module of the one whose loss departs most)."""
        from ampkit.diagnostics.departure import float32_departure

        region = self.region[0]
        if region is None:
            return "the step ran in float32: not the precision's", None
        if any(split(batch)[0] is None for batch in batches) or not batches:
            return "not replayed (pass the batch to Guard.step)", None
        if isinstance(region, torch.dtype):  # the loop's own torch.autocast
            region = torch.autocast(self.device_type, dtype=region)
        def departure(batch: Any) -> Any:
            if self.run is not None:
                return float32_departure(self.model, batch, region, run=self.run)
            inputs, target = split(batch)
            return float32_departure(self.model, inputs, region, target, self.loss_fn)

        sampling, self.watch.sampling = self.watch.sampling, False
        try:
            found = [departure(batch) for batch in batches]
        except ValueError:  # 16-bit weights: no float32 run of the same values
            return "not replayed (16-bit weights, whose float32 run is of other values)", None
        finally:
            self.watch.sampling = sampling
        float32 = sum(d.float32_loss for d in found) / len(found)
        if float32 > limit:
            return (f"float32 gives {float32:.4g} on this batch too: the batch's or the update's, not the "
                    "precision's"), None
        worst = max(found, key=lambda d: d.loss - d.float32_loss)
        source = "" if worst.module is None else (f", from {worst.module} (its output departs from float32's by "
                                                  f"{worst.jump:.2g} more than its input)")
        return f"float32 gives {float32:.4g} on this batch: the precision's{source}", worst.module

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _region_noter(region: list[Any], device_type: str) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook that keeps in ``region[0]`` the region a training forward runs in (a closure, not a bound
    method: the replay's deep copy of the model copies its hooks). Compiled, dynamo traces it: the region is a
    constant of the graph (dynamo guards on the autocast state), the list's update a side effect it replays after the
    graph runs, with no graph break."""
    def note(module: nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation's region is not the step's
        policy = current_policy(device_type)
        region[0] = (policy if policy is not None else torch.get_autocast_dtype(device_type)
                     if torch.is_autocast_enabled(device_type) else None)
    return note


class _RandomStates:
    """The random state (the CPU's, and the device's) at the start of each training forward, the last 64 kept; not in
    compiled code (a replay of a compiled step draws its own masks). The replay's deep copy of the model copies this
    object with its hook (a bound method), so a replay notes into its copy, not here."""

    def __init__(self, device_type: str) -> None:
        self.device_type, self.states = device_type, deque[Any](maxlen=64)

    def note(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            device = torch.cuda.get_rng_state() if self.device_type == "cuda" else None
            self.states.append((torch.get_rng_state(), device))

    def last(self, count: int) -> list[Any]:
        """The states the last ``count`` training forwards began with (None each where fewer were noted)."""
        return list(self.states)[-count:] if len(self.states) >= count else [None] * count

    @contextlib.contextmanager
    def restored(self, state: Any) -> Iterator[None]:
        """Within: the random state is ``state`` (none noted: as it is); after, the run's own again, as if the replay
        drew nothing."""
        devices = [torch.cuda.current_device()] if self.device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if state is not None:
                torch.set_rng_state(state[0])
                if state[1] is not None:
                    torch.cuda.set_rng_state(state[1])
            yield


def _micro_batch(index: int, count: int) -> str:
    return "the batch" if count == 1 else f"micro-batch {index} of {count}"


def _finding(finding: Any, index: int, count: int) -> tuple[str, str | None]:
    """A replay's ``NonFiniteFinding`` of micro-batch ``index`` (of ``count``) in words, and the module to raise (None:
    its inputs were already non-finite, or no module ran it)."""
    upstream = "" if finding.finite_inputs else ", its inputs already non-finite"
    layer = finding.module if finding.finite_inputs and finding.module != "(model)" else None
    of = "" if count == 1 else f", {_micro_batch(index, count)}"
    return f"{finding.module} ({finding.op} in {finding.phase}{upstream}{of})", layer


def split(batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch given as a pair, or inputs alone."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None
