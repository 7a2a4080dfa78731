"""What ``Guard`` records: an event per thing it saw and what it did, and the error that stops a run it cannot
cure."""

from __future__ import annotations

import dataclasses


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
