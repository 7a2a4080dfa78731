"""The float32-vs-mixed-precision comparison behind `ampkit compare`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit.experiment.config import (
    RunConfig,
    RunResult,
)
from ampkit.experiment.process import RunProcess
from ampkit.files import strict_json, writable_directory
from ampkit.hardware.advice import machine_summary

RESULT_FILES = ("results.json", "curves.png", "summary.png")
# Figures compared against float32, and whether lower is better.
RATIO_FIELDS = {
    "ms_per_step": True,
    "samples_per_s": False,
    "peak_memory_bytes": True,
    "saved_for_backward_bytes": True,
    "final_train_loss": True,
    "test_accuracy": False,
}


# The runs' own steps after which the estimate is made again from them (each run's first step, which warms up, aside).
REVISE_AFTER = 5

# What a recompute plan changes, compared against the same setting without the plan.
PLAN_FIELDS = ("ms_per_step", "peak_memory_bytes", "saved_for_backward_bytes")

Progress = Callable[[str, int, int, float], None]


@dataclasses.dataclass
class Comparison:
    """Results of one comparison: float32 first, then each mixed setting."""

    runs: list[RunResult]
    config: dict[str, Any]
    machine: dict[str, Any]
    created: str
    estimated_s: float | None = None  # the plan's estimate of the total wall time
    wall_s: float | None = None  # the total wall time, measured
    revised_s: float | None = None  # the estimate again, from the runs' own first steps (``REVISE_AFTER``)

    @property
    def baseline(self) -> RunResult:
        return self.runs[0]

    def ratio(self, run: RunResult, field: str) -> float | None:
        """``run``'s figure divided by float32's (None where either is missing or float32's is 0)."""
        value, base = getattr(run, field), getattr(self.baseline, field)
        if value is None or not base or base is None:
            return None
        return value / base

    def unplanned(self, run: RunResult) -> RunResult | None:
        """The same setting without ``run``'s recompute plan (None for a run without a plan, or if absent)."""
        if " recompute-" not in run.label:
            return None
        label = re.sub(r" recompute-\S+", "", run.label)
        return next((other for other in self.runs if other.label == label), None)

    def plan_ratio(self, run: RunResult, field: str) -> float | None:
        """A planned run's figure over the same setting's without the plan (None where either is missing)."""
        base = self.unplanned(run)
        value, reference = getattr(run, field), getattr(base, field) if base is not None else None
        return value / reference if value is not None and reference else None

    def to_dict(self) -> dict[str, Any]:
        runs = []
        for run in self.runs:
            entry = dataclasses.asdict(run)
            entry["ratio_to_fp32"] = {field: self.ratio(run, field) for field in RATIO_FIELDS}
            if self.unplanned(run) is not None:
                entry["ratio_to_unplanned"] = {field: self.plan_ratio(run, field) for field in PLAN_FIELDS}
            runs.append(entry)
        record = {
            "version": 2, "created": self.created, "machine": self.machine, "config": self.config,
            "estimated_s": self.estimated_s, "wall_s": self.wall_s, "revised_s": self.revised_s, "runs": runs,
        }
        non_finite: list[str] = []
        record = strict_json(record, "", non_finite)
        record["non_finite"] = non_finite
        return record


def compare(
    configs: list[RunConfig], progress: Progress | None = None, estimated_s: float | None = None,
    revise: Callable[[float], None] | None = None, evaluation_s: float = 0.0, shown: set[str] | None = None,
) -> Comparison:
    """Run every configuration in its own subprocess, steps interleaved, and collect the results.

    The processes start together (their start-up overlaps); then round by round each
    run takes one training step while the others wait, in alternating order (A B C,
    C B A, ...), so all runs are timed under the same machine conditions; then they
    evaluate, one after another.

    Args:
        configs: from ``plan()``; the first is the float32 baseline.
        progress: called as ``progress(label, step, total_steps, loss)`` after each step.
        estimated_s: the plan's estimate (``estimate(configs).total_s``), kept in the record.
        revise: called once, after ``REVISE_AFTER`` steps of every run beyond its first, with the total wall time
            estimated again from the runs themselves: the time so far, each run's remaining steps at the median of
            its own, and ``evaluation_s`` (the plan's estimate of the evaluations). Kept as ``revised_s``.
        evaluation_s: see ``revise``.
        shown: the warnings printed already (``process.warning_key`` of each): the runs' copies are left out.

    Raises:
        RuntimeError: a run failed (its error output is in the message); the others are stopped.
    """
    start = time.perf_counter()
    revised_s = None
    with contextlib.ExitStack() as stack:
        hosts = [stack.enter_context(RunProcess(config)) for config in configs]
        step_s: dict[int, list[float]] = {i: [] for i in range(len(hosts))}  # each run's timed steps, first aside
        try:
            for round_ in range(max(config.steps for config in configs)):
                for index in range(len(hosts)) if round_ % 2 == 0 else reversed(range(len(hosts))):
                    host = hosts[index]
                    if host.training:
                        began = time.perf_counter()
                        step, loss = host.step()
                        if round_ > 0:
                            step_s[index].append(time.perf_counter() - began)
                        if progress is not None:
                            progress(host.config.label, step, host.config.steps, loss)
                if round_ == REVISE_AFTER and revised_s is None:
                    revised_s = time.perf_counter() - start + evaluation_s + sum(
                        statistics.median(times) * (host.config.steps - host.steps_done)
                        for host, times in zip(hosts, step_s.values()) if times and host.training)
                    if revise is not None:
                        revise(revised_s)
            runs = []
            shown = set(shown or ())  # the warnings printed so far: each is printed once
            for host in hosts:  # one at a time: evaluating together oversubscribes the cores (measured slower)
                host.finish()
                runs.append(host.result(shown))
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or a host's SIGTERM handler: keep what ran
            interrupt.partial = partial_record(configs, hosts)  # type: ignore[attr-defined]
            raise
    return Comparison(
        runs=runs,
        config=_shared_config(configs),
        machine=machine_summary(configs[0].device),
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        estimated_s=estimated_s,
        wall_s=time.perf_counter() - start,
        revised_s=revised_s,
    )


def _shared_config(configs: list[RunConfig]) -> dict[str, Any]:
    first = dataclasses.asdict(configs[0])
    shared = {k: v for k, v in first.items() if k not in ("precision", "opt_level", "compute", "probe", "grad_accum",
                                                             "states")}
    shared["settings"] = [c.label for c in configs]
    return shared


def partial_record(configs: list[RunConfig], hosts: list[RunProcess]) -> dict[str, Any]:
    """What an interrupted comparison had done: each run's label and losses so far
    (strict JSON, marked ``incomplete``)."""
    runs = [{"label": h.config.label, "steps_done": h.steps_done, "steps": h.config.steps, "losses": h.losses}
            for h in hosts]
    record = {"version": 2, "incomplete": True, "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "config": _shared_config(configs), "runs": runs}
    non_finite: list[str] = []
    record = strict_json(record, "", non_finite)
    record["non_finite"] = non_finite
    return record


def default_out_dir() -> Path:
    return Path("ampkit-runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def check_out_dir(out: Path) -> None:
    """Refuse an output directory that already holds results (never overwrite silently)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out='{out}' is a file, not a directory.")
    # Where it would be created: said now, not after the plan's timings (nothing is created here)
    ancestor = next(path for path in (out.absolute(), *out.absolute().parents) if path.exists())
    if not ancestor.is_dir():
        raise ValueError(f"out='{out}' cannot hold results: {ancestor} is a file. Pass a directory you can write to.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"out='{out}' cannot hold results: {ancestor} is not writable. Pass a directory you can "
                         "write to.")
    clashes = [name for name in RESULT_FILES if (out / name).exists()]
    if clashes:
        raise ValueError(
            f"{out} already holds {', '.join(clashes)}; ampkit never overwrites results. "
            "Pass another out=DIR, or move those files away."
        )


def reserve_out_dir(out: Path | None) -> Path:
    """Create the output directory before any training, so a bad location fails at once.

    ``None`` reserves a new ``ampkit-runs/<timestamp>`` directory, created exclusively
    (``-2``, ``-3``... when another comparison took that second's name). A given
    directory may exist if it holds no results; it must be writable.

    Raises:
        ValueError: the location is a file, holds results, or cannot be created or written.
    """
    if out is None:
        base = default_out_dir()
        for attempt in range(1, 1000):
            candidate = base if attempt == 1 else base.with_name(f"{base.name}-{attempt}")
            try:
                candidate.mkdir(parents=True)
                return candidate
            except FileExistsError:
                continue
            except OSError as error:
                raise ValueError(f"Cannot create {candidate}: {error.strerror}. Pass out=DIR.") from error
        raise ValueError(f"{base}-2 to -999 exist already; pass out=DIR.")
    check_out_dir(out)
    writable_directory(out)
    return out
