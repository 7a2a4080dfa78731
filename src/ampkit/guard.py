"""A training run that watches its own numerics: ``Guard`` takes the optimizer step and refuses the bad ones.

The failures that cost mixed precision users the most are the ones nothing closes the loop on: a NaN batch or an
overflow poisons the weights, a loss spike hours in, a NaN-poisoned checkpoint saved and resumed from. torch's
GradScaler skips a step and says nothing of where; ``detect_anomaly`` is backward-only and slow. The guard sits
where the step is taken:

- **watches**, each step: the loss (finite? a spike beyond ``spike_sigmas`` standard deviations of its last
  ``window`` values?), the gradients (finite? one summing pass and one host read, where no loss scaler checks
  them), and the scaler's skipped steps in a row;
- **attributes** a non-finite loss or gradient: the batch itself (a NaN in the inputs), else a replay of the batch
  on a copy of the model (``find_nonfinite``) names the first module and op whose output is not finite;
- **acts** by its ``action``: ``"skip"`` the step, or ``"restore"`` the last good state it keeps in memory (the
  model's and the optimizer's, every ``keep_every`` good steps) and skip; the batch is named either way;
- **records** each event (step, signal, where, action) in ``events``, ``write_timeline`` (JSON) and
  ``write_plot`` (the loss, the events marked).

``ampkit.save_checkpoint`` refuses a state holding an inf or a NaN, with or without a guard. Raising one layer's
precision as an action (an FP8 or MX linear to bf16, a bf16 one to float32) is not built yet.
"""

from __future__ import annotations

import copy
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

from ampkit._torch import pytree
from ampkit.files import atomic_write
from ampkit.optim.states import snapshot
from ampkit.shards import is_sharded

ACTIONS = ("skip", "restore")


@dataclasses.dataclass(frozen=True)
class GuardEvent:
    """One thing the guard saw, and what it did.

    Attributes:
        step: the guard's step count when it happened (0 for the first ``step`` call).
        signal: ``"nonfinite-loss"``, ``"nonfinite-gradient"``, ``"loss-spike"`` or ``"repeated-skips"``.
        where: the batch or the module and op the trouble came from, or the figures of a spike, in words.
        action: ``"skipped"``, ``"restored step N"`` or ``"recorded"`` (the scaler skips on its own).
        loss: the step's loss (None where not finite).
    """

    step: int
    signal: str
    where: str
    action: str
    loss: float | None


class Guard:
    """Take the optimizer step only when the step's loss and gradients are sound; name what was not.

    Args:
        model: the model being trained (after ``initialize`` or ``fully_shard``).
        optimizer: its optimizer (as ``initialize`` returned it).
        scaler: an ampkit loss scaler (its ``step`` says whether it skipped), or None. torch's GradScaler does not
            say, and is refused.
        action: ``"skip"`` (default: drop the step) or ``"restore"`` (put back the last good state, then skip).
        loss_fn: ``loss_fn(output, batch_target) -> loss`` for the replay that attributes a non-finite value
            (default: ``find_nonfinite``'s: cross-entropy for integer targets, mean square error for floating ones).
        spike_sigmas: a finite loss above the mean of the last ``window`` losses by more than this many of their
            standard deviations is a spike (default 6; ``math.inf``: never).
        window: the losses a spike is measured against (default 50; spikes are looked for once it is half full).
        keep_every: good steps between the states kept for ``"restore"`` (default 50); the kept copy of the model's
            and the optimizer's state takes their memory once more.
        max_skips: the scaler's skipped steps in a row that make an event (default 5).

    Raises:
        ValueError: an unknown action, a bad number, torch's GradScaler, an optimizer over other tensors, or an
            FSDP2 model (not yet: every rank would have to take the same action).

    Example:
        >>> guard = ampkit.Guard(model, optimizer, scaler)
        >>> for x, y in loader:
        ...     optimizer.zero_grad(set_to_none=True)
        ...     loss = loss_fn(model(x), y)
        ...     scaler.scale(loss).backward()
        ...     guard.step(loss, batch=(x, y))  # instead of scaler.step(optimizer); scaler.update()
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, action: str = "skip",
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, spike_sigmas: float = 6.0,
                 window: int = 50, keep_every: int = 50, max_skips: int = 5) -> None:
        if action not in ACTIONS:
            raise ValueError(f"Unknown action {action!r}. Choose one of {list(ACTIONS)}: 'skip' drops a bad step, "
                             "'restore' puts back the last good state the guard kept, then drops it.")
        if isinstance(scaler, torch.amp.GradScaler):
            raise ValueError("scaler=torch.amp.GradScaler does not say whether it skipped a step: pass an ampkit "
                             "loss scaler (ampkit.DynamicLossScaler, whose step returns False on a skip), or None.")
        if scaler is not None and not (callable(getattr(scaler, "step", None)) and callable(getattr(scaler, "update",
                                                                                                  None))):
            raise ValueError(f"scaler={type(scaler).__name__} has no step() and update(): pass an ampkit loss scaler "
                             "or None.")
        if not (isinstance(spike_sigmas, (int, float)) and spike_sigmas > 0):
            raise ValueError(f"spike_sigmas={spike_sigmas!r} is invalid: a number > 0 (math.inf: never a spike).")
        for name, value in (("window", window), ("keep_every", keep_every), ("max_skips", max_skips)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (4 if name == "window" else 1):
                raise ValueError(f"{name}={value!r} is invalid: an integer >= {4 if name == 'window' else 1}.")
        if any(is_sharded(p) for p in model.parameters()):
            raise ValueError("Guard does not take an FSDP2 model yet: each rank would judge its own loss and batch, "
                             "and a rank skipping a step the others take leaves the shards out of step. Guard the "
                             "unsharded model, or train without a guard (issue 43).")
        own = {id(p) for p in model.parameters()}  # an O2 optimizer's masters stand for its model's parameters
        stepped = getattr(optimizer, "model_params", None) or [p for g in optimizer.param_groups for p in g["params"]]
        if any(id(p) not in own for p in stepped):
            raise ValueError("The optimizer steps tensors that are not this model's parameters (or their masters): "
                             "pass the model and the optimizer initialize returned.")
        self.model, self.optimizer, self.scaler, self.action = model, optimizer, scaler, action
        self.loss_fn, self.spike_sigmas, self.keep_every, self.max_skips = loss_fn, spike_sigmas, keep_every, max_skips
        self.losses: list[float | None] = []  # every step's loss, None where not finite
        self.events: list[GuardEvent] = []
        self._recent: deque[float] = deque(maxlen=window)
        self._kept: tuple[int, dict[str, Any]] | None = None  # (step, state) for "restore"
        self._good_steps = 0
        self._skips_in_a_row = 0

    @property
    def step_count(self) -> int:
        """Steps the guard has seen (taken or not)."""
        return len(self.losses)

    def step(self, loss: torch.Tensor, batch: Any = None) -> bool:
        """Check this step's loss and gradients (after ``backward``), then take the optimizer step (through the
        scaler, with its ``update``) or refuse it.

        Args:
            loss: the step's loss, unscaled (the guard reads it: one host sync).
            batch: the step's ``(inputs, target)`` or inputs, to name a non-finite one and to replay it.

        Returns:
            True when the optimizer stepped.
        """
        step = self.step_count
        value = float(loss.detach().float())
        finite = math.isfinite(value)
        self.losses.append(value if finite else None)
        problem = self._problem(step, value, finite, batch)
        if problem is not None:
            signal, where = problem
            self._act(step, signal, where, value if finite else None)
            return False
        if self.scaler is not None:
            took = bool(self.scaler.step(self.optimizer))
            self.scaler.update()
            self._skips_in_a_row = 0 if took else self._skips_in_a_row + 1
            if self._skips_in_a_row == self.max_skips:
                self._record(step, "repeated-skips", f"the loss scaler skipped {self.max_skips} steps in a row "
                             f"(scale now {self.scaler.get_scale():g})", "recorded", value)
            if not took:
                return False
        else:
            self.optimizer.step()
        self._recent.append(value)
        self._good_steps += 1
        if self.action == "restore" and (self._kept is None or self._good_steps % self.keep_every == 0):
            self._kept = (step, {"model": snapshot(self.model.state_dict()),
                                 "optimizer": snapshot(self.optimizer.state_dict())})
        return True

    def _problem(self, step: int, value: float, finite: bool, batch: Any) -> tuple[str, str] | None:
        """The step's signal and where it came from, or None for a sound step."""
        if not finite:
            return "nonfinite-loss", self._attribute(batch)
        if self.scaler is None or not getattr(self.scaler, "enabled", True):  # a scaler checks its gradients itself
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]  # O2's masters get theirs later
            # each gradient summed in float32 where it lies (no float32 copy of a 16-bit one), then one host read
            if grads and not math.isfinite(float(torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum())):
                return "nonfinite-gradient", self._attribute(batch)
        if len(self._recent) >= self._recent.maxlen // 2:  # type: ignore[operator]
            mean, spread = statistics.fmean(self._recent), statistics.pstdev(self._recent)
            if value > mean + self.spike_sigmas * max(spread, 1e-3 * abs(mean)):  # a flat loss: 0.1% is no spike
                return "loss-spike", (f"loss {value:.4g} against {mean:.4g} +- {spread:.2g} over the last "
                                      f"{len(self._recent)} steps")
        return None

    def _attribute(self, batch: Any) -> str:
        """Where a non-finite value came from: the batch, or the first module and op of a replay."""
        from ampkit.diagnostics.nonfinite import find_nonfinite

        inputs, target = _split(batch)
        leaves = [t for t in pytree.tree_leaves((inputs, target)) if isinstance(t, torch.Tensor)]
        for index, tensor in enumerate(leaves):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"the batch: its tensor {index} holds an inf or a NaN"
        if inputs is None:
            return "unknown (pass the batch to Guard.step to replay it)"
        replica = copy.deepcopy(self.model)  # the replay's backward must not add into the run's gradients
        finding = find_nonfinite(replica, inputs, target=target, loss_fn=self.loss_fn)
        if finding is None:
            return "not reproduced by a replay of the batch"
        upstream = "" if finding.finite_inputs else ", its inputs already non-finite"
        return f"{finding.module} ({finding.op} in {finding.phase}{upstream})"

    def _act(self, step: int, signal: str, where: str, loss: float | None) -> None:
        for param in (p for group in self.optimizer.param_groups for p in group["params"]):
            param.grad = None  # nothing of this step reaches a later one
        self.model.zero_grad(set_to_none=True)
        action = "skipped"
        if self.action == "restore" and self._kept is not None:
            kept_step, state = self._kept
            self.model.load_state_dict(snapshot(state["model"]))
            self.optimizer.load_state_dict(snapshot(state["optimizer"]))
            action = f"restored step {kept_step}"
        self._record(step, signal, where, action, loss)

    def _record(self, step: int, signal: str, where: str, action: str, loss: float | None) -> None:
        self.events.append(GuardEvent(step, signal, where, action, loss))

    def write_timeline(self, path: str | Path) -> Path:
        """The events and every step's loss as strict JSON (a non-finite loss is null), written atomically."""
        text = json.dumps({"version": 1, "steps": self.step_count, "losses": self.losses,
                           "events": [dataclasses.asdict(e) for e in self.events]}, indent=1, allow_nan=False)
        atomic_write(Path(path), lambda tmp: tmp.write_text(text + "\n"))
        return Path(path)

    def write_plot(self, path: str | Path) -> Path:
        """The loss per step with each event marked at its step and labelled by its signal (PNG, atomically)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
        # a non-finite loss is a gap in the line, not a segment across it
        ax.plot(range(self.step_count), [math.nan if v is None else v for v in self.losses], linewidth=1.2,
                label="loss")
        for index, event in enumerate(self.events):
            ax.axvline(event.step, color="tab:red", alpha=0.5, linestyle="--",
                       label="events" if index == 0 else None)
            ax.annotate(event.signal, (event.step, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                        fontsize=7, va="top", ha="right", color="tab:red")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"ampkit guard: {len(self.events)} event(s) in {self.step_count} steps")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
        plt.close(fig)
        return Path(path)


def _split(batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch given as a pair, or inputs alone."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None

