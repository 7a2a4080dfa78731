"""A comparison over several seeds: each setting's runs pooled into one result, and whether a mixed setting
matches float32 within seed noise.

One seed says how one initialisation and one order of batches trained; two settings a few tenths of a percent
apart may differ by no more than two seeds of the same setting do. The rule here is the plain one a reader can
check in the table: a mixed setting matches float32 on a figure (final train loss, test accuracy) where its mean
over the seeds lies inside float32's range over the same seeds widened on each side by that range's width: outside
it, the mean is further from float32's seeds than they are from each other, a difference beyond seed noise, in
the direction the sentence names.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from ampkit.experiment.config import RunResult

# The figures a verdict reads, and whether lower is better
VERDICT_FIELDS = {"final_train_loss": True, "test_accuracy": False}
MAX_SEEDS = 20  # each seed repeats every run: more is a long wait, not a sharper verdict


def check_seeds(seeds: int) -> None:
    """Refuse a seed count that is not an integer from 1 to ``MAX_SEEDS``."""
    if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= MAX_SEEDS:
        raise ValueError(f"seeds={seeds!r} is invalid: use an integer from 1 to {MAX_SEEDS} (3 gives a verdict "
                         "across seeds; 1 trains each setting once).")


def pooled(results: Sequence[RunResult], seeds: Sequence[int]) -> RunResult:
    """One setting's result over its seeds (``results[i]`` trained with ``seeds[i]``): step times, memory and
    compile times their median; the final train loss, test accuracy and zero-gradient fraction their mean (None
    where a seed has none); the loss curve the mean per step over the steps every seed took; skipped steps the
    most any seed skipped; a divergence named with its seed. The guard's timeline is the first seed's (every
    seed's is in the record)."""
    if len(results) == 1:
        return results[0]
    first = results[0]

    def median(field: str) -> float:
        return statistics.median(getattr(r, field) for r in results)

    def mean(field: str) -> float | None:
        values = [getattr(r, field) for r in results]
        return None if any(v is None for v in values) else statistics.fmean(values)

    steps = min(len(r.losses) for r in results)
    compile_s = [r.compile_s for r in results if r.compile_s is not None]
    diverged = [f"seed {seed}: {r.diverged}" for r, seed in zip(results, seeds) if r.diverged]
    return dataclasses.replace(
        first,
        ms_per_step=median("ms_per_step"), samples_per_s=median("samples_per_s"),
        peak_memory_bytes=int(median("peak_memory_bytes")),
        saved_for_backward_bytes=int(median("saved_for_backward_bytes")), state_bytes=int(median("state_bytes")),
        final_train_loss=mean("final_train_loss"), test_accuracy=mean("test_accuracy"),
        zero_grad_fraction=mean("zero_grad_fraction"), skipped_steps=max(r.skipped_steps for r in results),
        losses=[statistics.fmean(r.losses[i] for r in results) for i in range(steps)],
        wall_s=sum(r.wall_s for r in results), diverged="; ".join(diverged) or None,
        compile_s=statistics.median(compile_s) if compile_s else None,
    )


@dataclasses.dataclass(frozen=True)
class FigureVerdict:
    """One figure of a mixed setting against float32's over the same seeds.

    Attributes:
        field: ``final_train_loss`` or ``test_accuracy``.
        mean: the setting's mean over its seeds.
        low, high: float32's range over the seeds.
        band: float32's range widened on each side by its width: where seed noise reaches.
        within: the mean lies inside ``band``.
        worse: outside the band on the worse side (a higher loss, a lower accuracy).
    """

    field: str
    mean: float
    low: float
    high: float
    band: tuple[float, float]
    within: bool
    worse: bool


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a mixed setting trains as float32 does, within seed noise (``figures``: one per figure both have)."""

    label: str
    seeds: int
    figures: list[FigureVerdict]
    diverged: bool = False

    @property
    def matches(self) -> bool:
        return not self.diverged and all(f.within for f in self.figures)

    def sentence(self) -> str:
        """The verdict in a sentence, its figures and float32's band beside them."""
        if self.diverged:
            return f"{self.label} diverged (in at least one of {self.seeds} seeds): it does not train as float32 does."
        parts = [_figure_text(f) for f in self.figures]
        if self.matches:
            return f"{self.label} matches float32 within seed noise over {self.seeds} seeds: {'; '.join(parts)}."
        return f"{self.label} is outside float32's seed noise over {self.seeds} seeds: {'; '.join(parts)}."


def _figure_text(figure: FigureVerdict) -> str:
    name, percent = {"final_train_loss": ("train loss", False), "test_accuracy": ("test accuracy", True)}[figure.field]

    def show(value: float) -> str:
        return f"{100 * value:.1f}%" if percent else f"{value:.4g}"

    where = "inside" if figure.within else ("worse than" if figure.worse else "better than")
    return (f"{name} {show(figure.mean)}, {where} float32's {show(figure.low)} to {show(figure.high)} widened by its "
            f"spread to {show(figure.band[0])} to {show(figure.band[1])}")


def verdict(label: str, baseline: Sequence[RunResult], runs: Sequence[RunResult]) -> Verdict | None:
    """``runs`` (a mixed setting's, one per seed) against ``baseline`` (float32's, the same seeds); None with
    fewer than two seeds (one seed has no spread to judge by) or for a probe (it trains a few steps only)."""
    if len(runs) < 2 or len(baseline) < 2 or any(r.probe for r in runs):
        return None
    if any(r.diverged for r in runs):
        return Verdict(label, len(runs), [], diverged=True)
    figures = []
    for field, lower_is_better in VERDICT_FIELDS.items():
        ours = [getattr(r, field) for r in runs]
        theirs = [getattr(r, field) for r in baseline]
        if any(v is None or not math.isfinite(v) for v in ours + theirs):
            continue
        low, high = min(theirs), max(theirs)
        # widened, but not past what the figure can be: a loss below 0, an accuracy above 1
        band = (max(low - (high - low), 0.0 if low >= 0 else -math.inf), high + (high - low))
        if field == "test_accuracy":
            band = (band[0], min(band[1], 1.0))
        mean = statistics.fmean(ours)
        within = band[0] <= mean <= band[1]
        worse = not within and (mean > band[1]) == lower_is_better
        figures.append(FigureVerdict(field, mean, low, high, band, within, worse))
    return Verdict(label, len(runs), figures)


def half_range(runs: Sequence[RunResult], field: str) -> float | None:
    """Half the spread of ``field`` over a setting's seeds (what the table writes as ``±``); None with one seed or a
    missing value."""
    values = [getattr(r, field) for r in runs]
    if len(values) < 2 or any(v is None for v in values):
        return None
    return (max(values) - min(values)) / 2
