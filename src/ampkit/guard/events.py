"""What ``Guard`` records: an event per thing it saw and what it did, the error that stops a run it cannot cure, and
the record as data, as files and as a checkpoint's state (``Record``, the guard's base class)."""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from pathlib import Path
from typing import Any

from ampkit.files import atomic_write
from ampkit.guard import layers


class GuardStopped(RuntimeError):
    """The guard refused ``max_refused`` steps in a row: nothing it did cured the cause. ``events`` holds them."""

    def __init__(self, message: str, events: list[GuardEvent]) -> None:
        super().__init__(message)
        self.events = events


@dataclasses.dataclass(frozen=True)
class GuardEvent:
    """One thing the guard saw, and what it did.

    Attributes:
        step: the guard's step count when it happened (0 for the first ``step`` call).
        signal: ``"nonfinite-loss"``, ``"nonfinite-gradient"``, ``"loss-spike"``, ``"repeated-skips"``,
            ``"layer-saturation"``, ``"layer-underflow"``, ``"layer-near-overflow"``, ``"layer-returned"`` (a raised
            layer back in its format after its quiet window) or ``"suspect-machine"``.
        where: the batch or the module and op the trouble came from, or the figures of a spike, in words.
        action: ``"skipped"``, ``"restored step N"`` (or ``"restored <checkpoint>"``), ``"raised to float32 and
            skipped"`` (a non-finite loss or gradient), ``"raised to 16 bits"`` or ``"raised to float32"`` (a layer's
            signal: its gradients are finite, the step is taken), ``"returned to <format>"``, or ``"recorded"`` (the
            step taken: the scaler skips on its own, or a layer's signal under ``"skip"`` or ``"restore"``).
        loss: the step's loss (None where not finite).
        layer: the module named, where one is (the one raised, under ``"raise"``).
    """

    step: int
    signal: str
    where: str
    action: str
    loss: float | None
    layer: str | None = None


class Record:
    """The guard's record (``Guard`` sets these attributes): every step's loss, the events, the sampled figures, the
    raised layers, the transient faults and the counters a resumed run goes on from."""

    losses: list[float | None]
    events: list[GuardEvent]
    samples: list[tuple[int, dict[str, tuple[float, float, float]]]]
    transients: list[int]
    sample_every: int
    limits: dict[str, float]
    watch: layers.LayerWatch
    raises: Any
    _recent: deque[float]
    _good_steps: int
    _skips_in_a_row: int
    _refused_in_a_row: int

    @property
    def step_count(self) -> int:
        """Steps the guard has seen (taken or not)."""
        return len(self.losses)

    @property
    def raised(self) -> dict[str, str]:
        """The layers raised now: name -> ``"float32"`` or ``"16 bits"``, in the order raised."""
        return self.raises.raised  # type: ignore[no-any-return]

    def timeline(self) -> dict[str, Any]:
        """What the guard saw, as plain data (strict JSON: a non-finite loss is None): every step's loss, the
        events, the layers raised, and each sample's figures by layer, with the limits and each layer's kind."""
        samples = [{"step": step,
                    "layers": {name: dict(zip(layers.FIGURES, figures)) for name, figures in found.items()}}
                   for step, found in self.samples]
        return {"version": 2, "steps": self.step_count, "sample_every": self.sample_every, "limits": self.limits,
                "kinds": dict(self.watch.kinds), "losses": list(self.losses),
                "events": [dataclasses.asdict(e) for e in self.events], "raised": dict(self.raised), "samples": samples}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as this one: the timeline (``timeline()``), the raised layers with their
        windows, the transient faults and the counters (``save_checkpoint(path, guard=guard, ...)``)."""
        return {"timeline": self.timeline(), "raises": self.raises.state_dict(), "transients": list(self.transients),
                "recent": list(self._recent), "counters": [self._good_steps, self._skips_in_a_row,
                                                           self._refused_in_a_row]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state_dict()``'s: the same layers raised (the model's layers raised or returned to match),
        the same timeline."""
        timeline = state["timeline"]
        self.raises.load_state_dict(state["raises"])
        self.losses = list(timeline["losses"])
        self.events = [GuardEvent(**event) for event in timeline["events"]]
        self.samples = [(sample["step"], {name: tuple(figures[f] for f in layers.FIGURES)  # type: ignore[misc]
                                          for name, figures in sample["layers"].items()})
                        for sample in timeline["samples"]]
        self.transients, self._recent = list(state["transients"]), deque(state["recent"], maxlen=self._recent.maxlen)
        self._good_steps, self._skips_in_a_row, self._refused_in_a_row = state["counters"]

    def write_timeline(self, path: str | Path) -> Path:
        """``timeline()`` as strict JSON, written atomically."""
        text = json.dumps(self.timeline(), indent=1, allow_nan=False)
        atomic_write(Path(path), lambda tmp: tmp.write_text(text + "\n"))
        return Path(path)

    def write_plot(self, path: str | Path, title: str = "") -> Path:
        """The loss with the events marked, and the sampled layers' figures over the steps (``plot.py``; PNG)."""
        from ampkit.guard.plot import plot_timeline

        timeline = self.timeline()
        atomic_write(Path(path), lambda tmp: plot_timeline(timeline, tmp, title))
        return Path(path)
