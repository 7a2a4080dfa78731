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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ampkit.experiment.config import (
    RunConfig,
    RunResult,
)
from ampkit.experiment.process import RunProcess
from ampkit.experiment.seeds import Verdict, check_seeds, pooled, verdict
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
    seeds: list[int] = dataclasses.field(default_factory=list)  # the seeds every setting trained with (a probe: one)
    # Per run of ``runs``, its setting's result per seed, in ``seeds``' order; ``runs`` pools them (seeds.pooled)
    seed_runs: list[list[RunResult]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:  # a record of one seed, as comparisons before seeds were
        if not self.seeds:
            self.seeds = [self.config.get("seed", 0)]

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

    def each_seed(self, run: RunResult) -> list[RunResult]:
        """``run``'s setting's results, one per seed (``[run]`` for a comparison of one seed)."""
        for pooled_run, per_seed in zip(self.runs, self.seed_runs):
            if pooled_run is run:
                return per_seed
        return [run]

    def verdicts(self) -> list[Verdict]:
        """Per trained mixed setting, whether it matches float32 within seed noise (``seeds.verdict``); none with
        one seed."""
        found = (verdict(run.label, self.each_seed(self.baseline), self.each_seed(run)) for run in self.runs[1:])
        return [v for v in found if v is not None]

    def to_dict(self) -> dict[str, Any]:
        runs = []
        for run in self.runs:
            entry = dataclasses.asdict(run)
            entry["ratio_to_fp32"] = {field: self.ratio(run, field) for field in RATIO_FIELDS}
            if self.unplanned(run) is not None:
                entry["ratio_to_unplanned"] = {field: self.plan_ratio(run, field) for field in PLAN_FIELDS}
            if len(self.each_seed(run)) > 1:  # the pooled figures above; every seed's own here
                entry["seed_runs"] = [dataclasses.asdict(r) for r in self.each_seed(run)]
            runs.append(entry)
        record = {
            "version": 2, "created": self.created, "machine": self.machine, "config": self.config,
            "estimated_s": self.estimated_s, "wall_s": self.wall_s, "revised_s": self.revised_s,
            "seeds": self.seeds, "runs": runs,
            "verdicts": [dict(label=v.label, matches=v.matches, sentence=v.sentence()) for v in self.verdicts()],
        }
        non_finite: list[str] = []
        record = strict_json(record, "", non_finite)
        record["non_finite"] = non_finite
        return record


def compare(
    configs: list[RunConfig], progress: Progress | None = None, estimated_s: float | None = None,
    revise: Callable[[float], None] | None = None, evaluation_s: float = 0.0, shown: set[str] | None = None,
    seeds: int = 1,
) -> Comparison:
    """Run every configuration in its own subprocess, steps interleaved, and collect the results.

    The processes start together (their start-up overlaps); then round by round each
    run takes one training step while the others wait, in alternating order (A B C,
    C B A, ...), so all runs are timed under the same machine conditions; then they
    evaluate, one after another. With ``seeds`` above 1 the settings train again with each next seed
    (``configs``' seed, then one more each time), the runs of one seed interleaved as above, one seed after
    another (a probe, timed only, runs with the first); ``runs`` pools each setting's seeds and ``seed_runs``
    keeps each.

    Args:
        configs: from ``plan()``; the first is the float32 baseline.
        progress: called as ``progress(label, step, total_steps, loss)`` after each step; with several seeds the
            label ends in `` seed N``.
        estimated_s: the plan's estimate (``estimate(configs).seeds_s(configs, seeds)``), kept in the record.
        revise: called once, after ``REVISE_AFTER`` steps of every run beyond its first, with the total wall time
            estimated again from the runs themselves: the time so far, each run's remaining steps at the median of
            its own, and ``evaluation_s`` (the plan's estimate of the evaluations of one seed's runs), and each
            later seed's runs at the same figures. Kept as ``revised_s``.
        evaluation_s: see ``revise``.
        shown: the warnings printed already (``process.warning_key`` of each): the runs' copies are left out.
        seeds: how many seeds every setting trains with (1 to ``seeds.MAX_SEEDS``; default 1).

    Raises:
        RuntimeError: a run failed (its error output is in the message); the others are stopped.
        ValueError: ``seeds`` out of range.
    """
    check_seeds(seeds)
    start = time.perf_counter()
    first_seed = configs[0].seed
    seed_list = [first_seed + i for i in range(seeds)]
    shown = set(shown or ())  # the warnings printed so far: each is printed once
    found: dict[str, float] = {}

    def revised(total_s: float, repeat_s: float) -> None:
        found["revised_s"] = total_s + (seeds - 1) * repeat_s
        if revise is not None:
            revise(found["revised_s"])

    per_seed: list[list[RunResult]] = []
    for seed in seed_list:
        group = [dataclasses.replace(c, seed=seed) for c in configs if seed == first_seed or not c.probe]
        tell = progress if seeds == 1 or progress is None else (
            lambda label, step, total, loss, seed=seed: progress(f"{label} seed {seed}", step, total, loss))
        per_seed.append(_run_together(group, tell, evaluation_s, shown, revised if seed == first_seed else None,
                                      finished=list(zip(seed_list, per_seed))))
    seed_runs = [[results[index] for results in per_seed if index < len(results)] for index in range(len(configs))]
    return Comparison(
        runs=[pooled(results, seed_list) for results in seed_runs],
        config=_shared_config(configs) | {"seeds": seed_list},
        machine=machine_summary(configs[0].device),
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        estimated_s=estimated_s,
        wall_s=time.perf_counter() - start,
        revised_s=found.get("revised_s"),
        seeds=seed_list,
        seed_runs=seed_runs,
    )


def _run_together(configs: list[RunConfig], progress: Progress | None, evaluation_s: float, shown: set[str],
                  revise: Callable[[float, float], None] | None,
                  finished: list[tuple[int, list[RunResult]]]) -> list[RunResult]:
    """One seed's runs, stepped in turn (``compare``); ``revise(total_s, repeat_s)`` is told the estimate made
    again after ``REVISE_AFTER`` rounds, and the part of it that another seed repeats (all but a probe's);
    ``finished``: the earlier seeds' results, kept in the partial record of an interrupt."""
    start = time.perf_counter()
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
                if round_ == REVISE_AFTER and revise is not None:
                    remaining = {index: statistics.median(times) * (host.config.steps - host.steps_done)
                                 for index, (host, times) in enumerate(zip(hosts, step_s.values()))
                                 if times and host.training}
                    total_s = time.perf_counter() - start + evaluation_s + sum(remaining.values())
                    probe_s = sum(sum(step_s[index]) + remaining.get(index, 0.0)
                                  for index, host in enumerate(hosts) if host.config.probe)
                    revise(total_s, total_s - probe_s)
                    revise = None
            runs = []
            for host in hosts:  # one at a time: evaluating together oversubscribes the cores (measured slower)
                host.finish()
                runs.append(host.result(shown))
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or a host's SIGTERM handler: keep what ran
            interrupt.partial = partial_record(configs, hosts, finished)  # type: ignore[attr-defined]
            raise
    return runs


def _shared_config(configs: list[RunConfig]) -> dict[str, Any]:
    first = dataclasses.asdict(configs[0])
    shared = {k: v for k, v in first.items() if k not in ("precision", "opt_level", "compute", "probe", "grad_accum",
                                                             "states")}
    shared["settings"] = [c.label for c in configs]
    return shared


def partial_record(configs: list[RunConfig], hosts: list[RunProcess],
                   finished: Sequence[tuple[int, list[RunResult]]] = ()) -> dict[str, Any]:
    """What an interrupted comparison had done: each run's label, seed and losses so far, the runs of the seeds
    ``finished`` before it first (strict JSON, marked ``incomplete``)."""
    runs = [{"label": r.label, "seed": seed, "steps_done": len(r.losses), "steps": r.steps, "losses": r.losses}
            for seed, results in finished for r in results]
    runs += [{"label": h.config.label, "seed": h.config.seed, "steps_done": h.steps_done, "steps": h.config.steps,
              "losses": h.losses} for h in hosts]
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
