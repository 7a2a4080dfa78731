"""A training run that watches its own numerics: ``Guard`` takes the optimizer step and refuses the bad ones.

The failures that cost mixed precision users the most are the ones nothing closes the loop on: a NaN batch or an
overflow poisons the weights, a loss spike hours in, a NaN-poisoned checkpoint saved and resumed from. torch's
GradScaler skips a step and says nothing of where; ``detect_anomaly`` is backward-only and slow. The guard sits
where the step is taken:

- **watches**, each step: the loss (finite? a spike over ``spike_factor`` times its running median, or beyond
  ``spike_sigmas`` standard deviations of its last
  ``window`` values?), the gradients (finite? one summing pass and one host read, where no loss scaler checks
  them), and the scaler's skipped steps in a row;
- **attributes** a non-finite loss or gradient: the batch itself (a NaN in the inputs), else a replay of the batch
  on a copy of the model (``find_nonfinite``; over ranks, each rank's batch on the live model: ``replay.py``) names
  the first module and op whose output is not finite (in the backward, the module whose gradient was being
  computed). The replay runs under the region the step's forward
  ran in, as a hook on the model noted it: an ampkit policy, or the loop's own ``torch.autocast`` (a replay in
  float32 reproduced no float16 overflow, and every later step was skipped unexplained). Where the replay does not
  reproduce it, a layer the step's own sampled figures name is the cause;
- **samples**, every ``sample_every`` steps, each narrow layer's saturation, underflow and largest value on the
  step's own forward (``layers.py``); a layer past ``saturation``, ``underflow`` or ``near_overflow`` is a signal;
- **acts** by its ``action``: ``"skip"`` the step, ``"restore"`` the last good state it keeps in memory (the
  model's and the optimizer's, every ``keep_every`` good steps) and skip, or ``"raise"`` the named layer's precision
  (FP8 and block-scaled to 16 bits, 16 bits to float32: ``layers.raise_layer``) and skip; the batch is named either
  way. A layer's signal leaves the step's gradients finite: the step is taken (skipping cannot cure a layer), the
  layer raised under ``"raise"``, the event recorded under the others;
- **tells numerics from the machine**: the replay is a re-run of the step from its state (the weights before the
  optimizer's step, the same batch, the same region); a fault it does not reproduce, and no sampled figure explains,
  is transient (a bit flip: the step is skipped, the event says so), and ``suspect_after`` of them in a run make a
  ``"suspect-machine"`` event;
- **stops** a run whose steps it keeps refusing: ``max_refused`` refused steps in a row (each skipped, restored or
  raised for; nothing it did cured the cause) raise ``GuardStopped`` with those events, instead of an endless run of
  skipped steps that trains nothing;
- **records** each event (step, signal, where, action) in ``events``, ``write_timeline`` (JSON) and
  ``write_plot`` (the loss with the events marked, and the sampled layers' figures over time).

``ampkit.save_checkpoint`` refuses a state holding an inf or a NaN, with or without a guard.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit.files import atomic_write
from ampkit.guard import layers, ranks
from ampkit.guard.events import GuardEvent, GuardStopped, Record
from ampkit.guard.raises import Raises
from ampkit.guard.replay import NOT_REPRODUCED, OVER_RANKS, Replay, by_figures, split
from ampkit.guard.settings import check_settings
from ampkit.optim.states import snapshot
from ampkit.shards import shard_group


class Guard(Record):
    """Take the optimizer step only when the step's loss and gradients are sound; name what was not.

    Args:
        model: the model being trained (after ``initialize`` or ``fully_shard``).
        optimizer: its optimizer (as ``initialize`` returned it).
        scaler: an ampkit loss scaler (its ``step`` says whether it skipped), or None. torch's GradScaler does not
            say, and is refused.
        action: ``"skip"`` (default: drop the step), ``"restore"`` (put back the last good state, then skip) or
            ``"raise"`` (raise the named layer's precision, then skip: at O1 a layer computes in float32, at O2 from
            its float32 masters, at O3 on float32 copies of its 16-bit weights, its output rounded back; an FP8 or
            block-scaled linear becomes a 16-bit one).
        loss_fn: ``loss_fn(output, batch_target) -> loss`` for the replay that attributes a non-finite value
            (default: ``find_nonfinite``'s: cross-entropy for integer targets, mean square error for floating ones).
        spike_sigmas: a finite loss above the mean of the last ``window`` losses by more than this many of their
            standard deviations is a spike (default 6; ``math.inf``: never).
        spike_factor: a finite loss over this many times the median of the last ``window`` losses is a spike too
            (default 10; ``math.inf``: never). It catches a spike in a noisy run whose spread
            widens the standard deviations' band past it.
        window: the losses a spike is measured against (default 50; spikes are looked for once it is half full).
        keep_every: good steps between the states kept for ``"restore"`` (default 50); the kept copy of the model's
            and the optimizer's state takes their memory once more.
        replay: ``replay(model, batch) -> loss``: how the replay that attributes a non-finite value computes the loss of
            a whole batch on the model's copy (default None: ``loss_fn(model(inputs), target)``). The Lightning
            callback passes the module's ``training_step``: a LightningModule need not have a ``forward``.
        checkpoint: for ``"restore"``, a file the loop writes with ``ampkit.save_checkpoint(path, model=...,
            optimizer=...)``: the state put back is the last one saved there (nothing kept in memory); None (default):
            the copy kept every ``keep_every`` steps. Where no file is there yet, the bad step is only skipped.
        max_skips: the scaler's skipped steps in a row that make an event (default 5).
        max_refused: the guard's own refused steps in a row that stop the run with ``GuardStopped`` (default 10).
        quiet_window: steps a raised layer runs quiet (no raise of it) before it returns to its format (default 200;
            None: never); a layer raised again after a return waits twice its last window (bounded flapping: a long
            run does not drift to float32 layer by layer, nor back and forth).
        suspect_after: transient faults (a non-finite step that its re-run from the same state, the replay, does not
            reproduce: a bit flip, not the numerics) that make a ``"suspect-machine"`` event (default 3).
        sample_every: steps between samples of the layers' figures (default 10; 0: never), and the step after a
            non-finite one that nothing named (where the replay names no layer, the figures name it). The
            step's own forward is measured, so the steps between cost a Python call per watched module
            (benchmarks/bench_guard.py).
        saturation: a sampled layer clamping (or, in 16 bits, not keeping finite) more than this fraction of its
            values is a signal (default 0.01).
        underflow: a sampled FP8 layer flushing more than this share of its input channels' square sums to zero
            (their mean), a block-scaled one more than this fraction of its input's nonzero values, or a float16 one
            with more of its output below float16's smallest normal (default 0.05).
        near_overflow: a sampled 16-bit layer's largest output above this fraction of its format's largest value
            is a signal (default 0.5: a doubling from overflow).
        process_group: with torch.distributed, the ranks that must take the same action (``ranks.py``: the loss,
            the gradients, the batches and the layers' figures are reduced over them before a verdict): found on an
            FSDP2 model's parameters; under DDP pass ``torch.distributed.group.WORLD``. None without one.

    Raises:
        ValueError: an unknown action, a bad number, torch's GradScaler, an optimizer over other tensors, a
            ``checkpoint`` that is a folder or in a folder that does not exist, ``"raise"`` where torchao all-gathers
            an FSDP2 model's weights in FP8, a process group without torch.distributed.

    Example:
        >>> guard = ampkit.Guard(model, optimizer, scaler)
        >>> for x, y in loader:
        ...     optimizer.zero_grad(set_to_none=True)
        ...     loss = loss_fn(model(x), y)
        ...     scaler.scale(loss).backward()
        ...     guard.step(loss, batch=(x, y))  # instead of scaler.step(optimizer); scaler.update()
    """

    # ampkit.load_checkpoint restores the guard before the model: its raises change the model's layers (the state
    # dict of an FP8 linear raised to 16 bits has no FP8 scales)
    restores_structure = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, action: str = "skip",
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, spike_sigmas: float = 6.0,
                 window: int = 50, keep_every: int = 50, max_skips: int = 5, sample_every: int = 10,
                 saturation: float = 0.01, underflow: float = 0.05, near_overflow: float = 0.5,
                 process_group: Any = None, checkpoint: str | Path | None = None, max_refused: int = 10,
                 replay: Callable[[nn.Module, Any], torch.Tensor] | None = None, suspect_after: int = 3,
                 quiet_window: int | None = 200, spike_factor: float = 10.0) -> None:
        sharded = check_settings(model, optimizer, scaler, action, checkpoint, process_group, dict(
            spike_sigmas=spike_sigmas, spike_factor=spike_factor, window=window, keep_every=keep_every, max_skips=max_skips,
            sample_every=sample_every, max_refused=max_refused, suspect_after=suspect_after,
            quiet_window=1 if quiet_window is None else quiet_window, saturation=saturation, underflow=underflow,
            near_overflow=near_overflow))
        self.model, self.optimizer, self.scaler, self.action = model, optimizer, scaler, action
        self.spike_sigmas, self.spike_factor = spike_sigmas, spike_factor
        self.keep_every, self.max_skips = keep_every, max_skips
        self.max_refused, self.suspect_after = max_refused, suspect_after
        self.transients: list[int] = []  # the steps of the transient faults
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.sample_every, self.limits = sample_every, {"saturation": saturation, "underflow": underflow,
                                                        "amax": near_overflow}
        self.losses: list[float | None] = []  # every step's loss, None where not finite
        self.events: list[GuardEvent] = []
        self.samples: list[tuple[int, dict[str, tuple[float, float, float]]]] = []  # (step, figures by layer)
        self.watch = layers.LayerWatch(model)
        self.attribution = Replay(model, self.watch, loss_fn, replay)
        # the run's 16-bit dtype, as the replay noted the last training forward's region
        self.raises = Raises(model, self.watch, quiet_window, getattr(optimizer, "master_of", None),
                             self.attribution.sixteen)
        self.watch.sampling = sample_every > 0
        self.agreement = ranks.Agreement(process_group if process_group is not None
                                         else shard_group(sharded) if sharded is not None else None)
        self._params = list(model.parameters())
        self._recent: deque[float] = deque(maxlen=window)
        self._kept: tuple[int, dict[str, Any]] | None = None  # (step, state) for "restore"
        self._good_steps = 0
        self._skips_in_a_row = 0
        self._refused_in_a_row = 0
        self._batches: list[Any] = [None]  # the last checked step's micro-batches

    def step(self, loss: torch.Tensor, batch: Any = None, batches: list[Any] | None = None) -> bool:
        """Check this step's loss, gradients and (on a sampled step) layers, after ``backward``; then take the
        optimizer step (through the scaler, with its ``update``) or refuse it.

        Args:
            loss: the step's loss, unscaled (the guard reads it: one host sync).
            batch: the step's ``(inputs, target)`` or inputs, to name a non-finite one and to replay it.
            batches: instead of ``batch``, each micro-batch of a step that accumulates gradients over several: each
                is looked at, and replayed in turn until one reproduces the fault.

        Returns:
            True when the optimizer stepped.
        """
        if not self.check(loss, batch, batches=batches):
            return False
        scale = self.scaler.get_scale() if self.scaler is not None else None
        if self.scaler is not None:
            took = bool(self.scaler.step(self.optimizer))
            self.scaler.update()
        else:
            self.optimizer.step()
            took = True
        self.taken(took, scale)
        return took

    def check(self, loss: torch.Tensor, batch: Any = None, gradients: bool | None = None,
              batches: list[Any] | None = None) -> bool:
        """``step``'s first half, for a loop that steps the optimizer itself (the Lightning callback): judge the
        step and act on a bad one (its gradients set to None, so that torch's optimizers step none of them).

        Args:
            gradients: whether to check the gradients are finite; None (default): where no enabled loss scaler of
                the guard's checks them. A loop whose own scaler checks them passes False.
            batch: as ``step``'s.
            batches: as ``step``'s.

        Returns:
            True where the step may be taken; then call ``taken`` after it.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            given = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
            raise ValueError(f"Guard.step takes the step's loss as a one-element tensor (before .item()), got "
                             f"{given}: pass the reduced loss the backward ran from, unscaled.")
        if batches is not None and (batch is not None or not isinstance(batches, (list, tuple))):
            raise ValueError(f"batches={type(batches).__name__} with batch={type(batch).__name__}: pass the step's "
                             "micro-batches as one list, batches=[...], and no batch= (or one batch=, no batches).")
        micro_batches = self._batches = list(batches) if batches is not None else [batch]
        step = self.step_count
        if gradients is None:
            gradients = self.scaler is None or not getattr(self.scaler, "enabled", True)
        grads = ranks.gradient_sum(self._params) if gradients else None
        value, gradient, bad_batches = self.agreement.verdict(loss, grads, micro_batches)  # one host read
        finite = math.isfinite(value)
        self.losses.append(value if finite else None)
        sampled = self.agreement.layers(self.watch.take()) if self.watch.sampling else {}
        sampled = {name: sampled[name] for name in self.watch.kinds if name in sampled}  # the model's order
        self.watch.sampling = self.sample_every > 0 and (step + 1) % self.sample_every == 0
        if sampled:
            self.samples.append((step, sampled))
        layer_problem = layers.worst(sampled, self.watch.kinds, self.limits) if sampled else None
        problem: tuple[str, str, str | None] | None
        if not (finite and math.isfinite(gradient)):
            where, layer = by_figures(*self._attribute(micro_batches, bad_batches), layer_problem)
            if where == NOT_REPRODUCED:  # the step re-run from its state is sound: not the numerics
                self.transients.append(step)
                where = f"transient: {where} (the run's transient fault {len(self.transients)})"
            if layer is None and self.sample_every > 0:  # nothing named it: the next step's figures are read
                self.watch.sampling = True
            problem = ("nonfinite-loss" if not finite else "nonfinite-gradient", where, layer)
        else:
            problem = self._spike(value, micro_batches, layer_problem)
        if problem is None and layer_problem is not None:
            # finite gradients: the step is taken (skipping cannot cure a layer)
            signal, where, name = layer_problem
            action = self.raises.raise_(name, step) if self.action == "raise" else "recorded"
            self._record(step, signal, where, name, action, value)
        if problem is not None:
            self._act(step, *problem, value if finite else None)
            self._suspect(step)
            self._refused_in_a_row += 1
            if self._refused_in_a_row >= self.max_refused:
                self._stop()
            return False
        self._refused_in_a_row = 0
        for layer, where, action in self.raises.return_quiet(step):
            self._record(step, "layer-returned", where, layer, action, value)
        return True

    def _suspect(self, step: int) -> None:
        """The ``"suspect-machine"`` event, at the step whose transient fault is the run's ``suspect_after``-th."""
        if self.transients[-1:] == [step] and len(self.transients) == self.suspect_after:
            self._record(step, "suspect-machine", f"{len(self.transients)} transient faults (steps "
                         f"{', '.join(map(str, self.transients))}): a re-run of each step from its state was sound; "
                         "check the machine (memory errors, an overheating device)", None, "recorded", None)

    def _stop(self) -> None:
        """Raise ``GuardStopped`` with the refused steps' events."""
        refused = self.events[-self._refused_in_a_row:]
        lines = "\n".join(f"  step {e.step}: {e.signal} at {e.where}; {e.action}" for e in refused[-5:])
        raise GuardStopped(
            f"The guard refused {len(refused)} steps in a row (steps {refused[0].step} to {refused[-1].step}; "
            f"max_refused={self.max_refused}): nothing it did cured the cause, and the run trained nothing since. The "
            f"last of them:\n{lines}\nFind the first bad op with ampkit.find_nonfinite(model, inputs) on one of these "
            "batches; keep the layer it names in float32 (a policy's override, or initialize's keep_float32), lower "
            "the learning rate, or check the data. guard.events holds every event (write_timeline writes them).",
            refused)

    def taken(self, took: bool = True, scale: float | None = None) -> None:
        """``step``'s second half: whether the optimizer stepped after a ``check`` that allowed it (False: a loss
        scaler skipped it), and the loss scale its backward ran at. The first of skips in a row is re-run from the
        step's state (``Replay.scaler_skip``): an overflow a lower scale cures is the scaler's (no event); one the
        re-run does not reproduce at that scale, a bit flip the scaler took for an overflow, is transient; one that
        overflows unscaled is the layer's, acted on as a non-finite gradient."""
        step, value = self.step_count - 1, self.losses[-1]
        assert value is not None, "taken() follows a check() that allowed the step"
        found = None
        if not took and not self._skips_in_a_row and scale is not None and split(self._batches[0])[0] is not None:
            found = self.attribution.scaler_skip(self._batches, scale, self.agreement.group)
            self._drop_gradients()  # the skipped step's (over ranks, the re-run's)
        if found is not None:
            where, layer = found
            if where == NOT_REPRODUCED:
                self.transients.append(step)
                where = f"transient: {where} at loss scale {scale:g} (the run's transient fault {len(self.transients)})"
            self._act(step, "nonfinite-gradient", where, layer, value)
            self._suspect(step)
        self._skips_in_a_row = 0 if took else self._skips_in_a_row + 1
        if self._skips_in_a_row == self.max_skips:
            now = f" (scale now {self.scaler.get_scale():g})" if self.scaler is not None else ""
            self._record(step, "repeated-skips", f"the loss scaler skipped {self.max_skips} steps in a row{now}",
                         None, "recorded", value)
        if not took:
            return
        self._recent.append(value)
        self._good_steps += 1
        if self.action == "restore" and self.checkpoint is None and (self._kept is None
                                                                     or self._good_steps % self.keep_every == 0):
            self._kept = (step, {"model": snapshot(self.model.state_dict()),
                                 "optimizer": snapshot(self.optimizer.state_dict())})

    def _spike(self, value: float, batches: list[Any], layer_problem: tuple[str, str, str] | None
               ) -> tuple[str, str, str | None] | None:
        """A loss spike's signal, figures and source (a replay in float32: the precision's, and from which module,
        or not; over ranks, where it is not replayed, the step's sampled figures), or None."""
        if len(self._recent) >= self._recent.maxlen // 2:  # type: ignore[operator]
            mean, spread = statistics.fmean(self._recent), statistics.pstdev(self._recent)
            median = statistics.median(self._recent)
            band = mean + self.spike_sigmas * max(spread, 1e-3 * abs(mean))  # a flat loss: 0.1% is no spike
            # a loss at or below zero has no multiple to exceed: the band alone decides
            factor = self.spike_factor * median if median > 0 else math.inf
            limit = min(band, factor)
            if value <= limit:
                return None
            # over ranks a spike is not replayed (its float32 replay copies the model: FSDP2 refuses a copy)
            source, layer = (self.attribution.spike(batches, limit) if self.agreement.group is None
                             else by_figures(OVER_RANKS, None, layer_problem))
            return "loss-spike", (f"loss {value:.4g} against {mean:.4g} +- {spread:.2g} (median {median:.4g}) "
                                  f"over the last {len(self._recent)} steps; {source}"), layer
        return None

    def _attribute(self, batches: list[Any], bad_batches: list[int]) -> tuple[str, str | None]:
        """Where a non-finite value came from, in words, and the module to raise (None: the batch, or unknown)."""
        if bad_batches:  # the verdict's flags, over ranks
            return f"the batch of rank {', '.join(map(str, bad_batches))}: a tensor holding an inf or a NaN", None
        return self.attribution.attribute(batches, group=self.agreement.group)

    def _drop_gradients(self) -> None:
        for param in (p for group in self.optimizer.param_groups for p in group["params"]):
            param.grad = None  # nothing of this step reaches a later one
        self.model.zero_grad(set_to_none=True)

    def _act(self, step: int, signal: str, where: str, layer: str | None, loss: float | None) -> None:
        self._drop_gradients()
        action = "skipped"
        if self.action == "restore" and self.checkpoint is not None:
            if self.checkpoint.exists():
                from ampkit.checkpoint import load_checkpoint

                load_checkpoint(self.checkpoint, model=self.model, optimizer=self.optimizer)
                action = f"restored {self.checkpoint}"
            else:
                action = f"skipped (no checkpoint at {self.checkpoint} yet)"
        elif self.action == "restore" and self._kept is not None:
            kept_step, state = self._kept
            self.model.load_state_dict(snapshot(state["model"]))
            self.optimizer.load_state_dict(snapshot(state["optimizer"]))
            action = f"restored step {kept_step}"
        elif self.action == "raise" and layer is not None:
            action = self.raises.raise_(layer, step) + " and skipped"
        self._record(step, signal, where, layer, action, loss)

    def _record(self, step: int, signal: str, where: str, layer: str | None, action: str,
                loss: float | None) -> None:
        self.events.append(GuardEvent(step, signal, where, action, loss, layer))

    def close(self) -> None:
        """Take the guard's hooks off the model and its layers (the guard's ``step`` samples no layer after it)."""
        self.attribution.close()
        self.watch.remove()
        self.watch.sampling = False
        self.sample_every = 0
