"""Tables, figures and files of a comparison. ``write_all`` writes the files all or none."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from ampkit.diagnostics.memory import STATE_PARTS
from ampkit.experiment.comparison import PLAN_FIELDS, Comparison
from ampkit.experiment.config import WARMUP_STEPS, RunResult
from ampkit.experiment.seeds import half_range
from ampkit.files import publish_new
from ampkit.guard.plot import plot_timeline

MIB = 2**20


def write_json(comparison: Comparison, path: Path) -> None:
    """results.json's text to ``path`` (``write_all`` makes the three files atomic together)."""
    text = json.dumps(comparison.to_dict(), indent=2, allow_nan=False)  # inf/NaN are null, listed in non_finite
    path.write_text(text + "\n")


def _ratio(value: float | None) -> str:
    return "" if value is None or math.isnan(value) else f"\n{value:.2f}x"


def table(comparison: Comparison) -> Table:
    """The comparison as a rich table; each figure has its ratio to float32 below it,
    so the table fits an 80-column terminal."""
    machine = comparison.machine
    config = comparison.config
    micro = f" in {config['micro_batches']} micro-batches" if config.get("micro_batches", 1) != 1 else ""
    title = (
        f"ampkit compare: {config['model']} on {config['data']}, batch {config['batch_size']}{micro}, "
        f"{config['steps']} steps, {machine['device_name']} (torch {machine['torch']})"
    )
    if config.get("loss_divisor", 1) != 1:
        title += f", training loss divided by {config['loss_divisor']:g}"
    if config.get("size", "small") != "small":
        title += f", size {config['size']}"
    seeds = len(comparison.seeds)
    if seeds > 1:
        title += f", {seeds} seeds"
    caption = ("memory in MiB; B/param: weights, gradients, masters and optimizer states kept between steps, in bytes "
               "per parameter; below each figure, its ratio to float32")
    if seeds > 1:
        caption += (f"; over {seeds} seeds: ms/step and memory their median, train loss and test acc their mean with "
                    "half their range (±) below")
    if any(run.float32_compute for run in comparison.runs):
        caption += "; fp32-compute: GEMMs and convolutions computed in float32 on 16-bit values"
    if any(" fp32-grads" in run.label for run in comparison.runs):
        caption += "; fp32-grads: the 16-bit weights' gradients accumulate in float32"
    if any("-states" in run.label for run in comparison.runs):
        caption += "; 8bit-states (bf16, 4bit, fp8): AdamW's moments kept in that format"
    if any(run.final_loss_scale is not None for run in comparison.runs):
        caption += "; skipped (scale): the steps the loss scaler skipped, its final scale below"
    if any(run.probe for run in comparison.runs):
        caption += "; probe: a few steps, timed only"
    if any(not run.probe and run.steps <= WARMUP_STEPS for run in comparison.runs):
        caption += f"; ms/step includes warm-up: no step after the first {WARMUP_STEPS} was timed (run more steps)"
    if any(comparison.unplanned(run) is not None for run in comparison.runs):
        caption += "; (Nx): a recompute run's figure over the same setting's without its plan"
    compiled = any(run.compile_s is not None for run in comparison.runs)
    if compiled:
        caption += "; compiled: torch.compile (inductor); +N s: its first step, which compiles, not in ms/step"
    guarded = any(run.guard is not None for run in comparison.runs)
    if guarded:
        caption += "; guard: N: the events ampkit.Guard saw in the run (listed below the table; guard-*.png)"
    out = Table(title=title, box=box.SIMPLE_HEAD, caption=caption, pad_edge=False)
    scaled = any(run.final_loss_scale is not None for run in comparison.runs)
    # Headers on two lines and figures above their ratios, so the table fits an 80-column terminal.
    # samples/s (in results.json) makes way for the bytes per parameter: ms/step says the speed already
    headers = ["run", "ms/step", "memory\nadded", "saved for\nbackward", "B/param", "train\nloss", "test\nacc"]
    headers += ["skipped\n(scale)"] if scaled else []  # one column for both: the table fits 80 columns
    for header in headers:
        if header == "run":
            out.add_column(header, min_width=len("fp32-compute"))
        else:
            out.add_column(header, justify="right")
    for run in comparison.runs:
        def r(field: str, run: RunResult = run) -> str:
            """The figure's ratio to float32 below it, and a planned run's to its unplanned setting below that."""
            text = _ratio(comparison.ratio(run, field)) if run is not comparison.baseline else ""
            planned = comparison.plan_ratio(run, field) if field in PLAN_FIELDS else None
            return text + (f"\n({planned:.2f}x)" if planned is not None else "")

        def spread(field: str, scale: float = 1.0, run: RunResult = run) -> str:
            """Half the range of the figure over the seeds, below it (nothing with one seed)."""
            half = half_range(comparison.each_seed(run), field)
            return "" if half is None else f"\n±{scale * half:.{1 if scale != 1 else 3}f}"

        per_parameter = f"{run.state_bytes / run.parameters:.1f}{r('state_bytes')}" if run.parameters else "-"
        row = [
            re.sub(r" (fp32-|native|compiled|\S+-states)", r"\n\1", run.label),  # narrow: wraps at each option
            f"{run.ms_per_step:.1f}{r('ms_per_step')}" + (f"\n+{run.compile_s:.0f} s" if run.compile_s is not None else ""),
            f"{run.peak_memory_bytes / MIB:.0f}M{r('peak_memory_bytes')}",
            f"{run.saved_for_backward_bytes / MIB:.1f}M{r('saved_for_backward_bytes')}",
            per_parameter,
            "-" if run.final_train_loss is None else f"{run.final_train_loss:.3f}{spread('final_train_loss')}",
            "-" if run.test_accuracy is None else f"{100 * run.test_accuracy:.1f}%{spread('test_accuracy', 100)}",
        ]
        if scaled:
            row.append(f"{run.skipped_steps}" + ("" if run.final_loss_scale is None else f"\n({run.final_loss_scale:g})"))
        if run.guard is not None:
            row[0] += f"\nguard: {sum(len(one.guard['events']) for one in comparison.each_seed(run) if one.guard)}"
        out.add_row(*row)
    return out


def guard_lines(comparison: Comparison) -> list[str]:
    """A line per guard event of every run (of every seed): the run, the step, the signal, where, what the guard
    did."""
    several = len(comparison.seeds) > 1
    return [f"{one.label}{f' seed {seed}' if several else ''}: step {e['step'] + 1} {e['signal']}, {e['where']}: "
            f"{e['action']}" for run in comparison.runs
            for seed, one in zip(comparison.seeds, comparison.each_seed(run))
            if one.guard is not None for e in one.guard["events"]]


def verdict_lines(comparison: Comparison) -> list[str]:
    """A sentence per trained mixed setting: whether it matches float32 within seed noise (none with one seed)."""
    return [v.sentence() for v in comparison.verdicts()]


# GEMMs this much faster in 16 bits make a slower step a surprise worth a line (a GPU's tensor cores); a CPU's
# native bf16, a little faster than float32, does not
CLEARLY_FASTER = 1.5


def slower_line(comparison: Comparison, native_speedup: dict[str, float]) -> str | None:
    """A line naming the 16-bit runs with native kernels whose step is slower than float32's although this model's
    GEMMs run clearly faster in 16 bits here (``native_speedup``: the plan's figure, float32's GEMM time over native
    16-bit's), and why: what a short step on a GPU shows, where each op's launch, not its arithmetic, sets the
    time. None where there is no such run."""
    slower, speedups = [], {}
    for run in comparison.runs[1:]:
        speedup, ratio = native_speedup.get(run.precision), comparison.ratio(run, "ms_per_step")
        if run.precision in ("fp16", "bf16") and not run.float32_compute and speedup and speedup >= CLEARLY_FASTER \
                and ratio is not None and ratio > 1:
            slower.append(f"{run.label} {ratio:.2f}x")
            speedups[run.precision] = f"{run.precision} {speedup:.3g}x"
    if not slower:
        return None
    return (f"Slower than float32 (step time: {', '.join(slower)}) though this model's GEMMs run faster in 16 bits here "
            f"({', '.join(speedups.values())}): a step this short is set by its per-op work (casts and element-wise "
            "ops, and on a GPU each kernel's launch), which mixed precision adds to, not by its arithmetic; a larger "
            "batch or model shows the arithmetic's gain.")


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-")


def write_curves(comparison: Comparison, path: Path) -> None:
    """Training loss per step of every run, overlaid; over several seeds each setting's mean, in a band from its
    lowest to its highest seed at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter, LogFormatter

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    shown = [run for run in comparison.runs if not run.probe]  # a probe's few steps say nothing of convergence
    marked = False  # the guard's events: one legend entry for all
    for index, run in enumerate(shown):
        # a style of its own per run, drawn thinner on top: two runs with equal losses both stay visible
        line, = ax.plot(range(1, len(run.losses) + 1), run.losses, label=run.label, alpha=0.9,
                        linewidth=2.2 - 1.4 * index / len(shown), linestyle=("-", "--", "-.", ":")[index % 4])
        if len(each := comparison.each_seed(run)) > 1:
            low, high = seed_band(each)
            ax.fill_between(range(1, len(low) + 1), low, high, color=line.get_color(), alpha=0.18, linewidth=0)
        for event in run.guard["events"] if run.guard is not None else []:  # at the last finite loss before it
            step = event["step"] + 1  # the timeline counts from 0, the curves from 1
            finite = [v for v in run.losses[:step] if math.isfinite(v)]
            at = (step, finite[-1] if finite else 1.0)
            ax.plot(*at, marker="x", color="tab:red", markersize=9, markeredgewidth=2,
                    label=None if marked else "guard event")
            ax.annotate(f"{event['signal']}\n{event['layer'] or ''}", at, fontsize=6, color="tab:red",
                        xytext=(4, 4), textcoords="offset points")
            marked = True
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 5, not 5x10^0
    # Minor ticks labelled only where a decade or less is shown, and then 2-5-ish ones (every minor label of a
    # wider span, 0.9 0.8 0.7 ... 0.09 0.08 ..., printed over each other)
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1.0, 0.4)))
    divisor = comparison.config.get("loss_divisor", 1)
    divided = f" (trained on the loss / {divisor:g})" if divisor != 1 else ""
    seeds = len(comparison.seeds)
    over = f", mean of {seeds} seeds in the band of their lowest and highest" if seeds > 1 else ""
    ax.set_title(f"{comparison.config['model']} on {comparison.config['data']}: loss per step{divided}{over}",
                 fontsize=10 if seeds > 1 else None)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def seed_band(runs: list[RunResult]) -> tuple[list[float], list[float]]:
    """The lowest and the highest loss of a setting's seeds at each step they all took (non-finite losses aside)."""
    steps = min(len(r.losses) for r in runs)
    at = [[r.losses[i] for r in runs if math.isfinite(r.losses[i])] or [math.nan] for i in range(steps)]
    return [min(values) for values in at], [max(values) for values in at]


# The parts of a run's memory the summary stacks, bottom up: what it keeps between steps (measured from its tensors,
# diagnostics.memory.STATE_PARTS), its saved activations, and the rest of the measured peak
PARTS = (*STATE_PARTS, "saved activations", "the rest")
PART_COLORS = ("#4c72b0", "#dd8452", "#937860", "#8172b3", "#55a868", "#cccccc")


def memory_parts(run: RunResult) -> dict[str, float]:
    """``run``'s memory by part (``PARTS``), in bytes: what it keeps between steps, by part (a record without the
    parts: their sum, as weights), the activations one step saves for backward, and the rest of what training
    added (the measured peak less those two; none where they exceed it: the peak is the process's, measured)."""
    kept = dict(run.state_parts) if run.state_parts else {"weights": run.state_bytes}
    parts = {name: float(kept.get(name, 0)) for name in STATE_PARTS} | {
        "saved activations": float(run.saved_for_backward_bytes)}
    parts["the rest"] = max(float(run.peak_memory_bytes) - sum(parts.values()), 0.0)
    return parts


def crossover_batches(comparison: Comparison) -> dict[str, int | None]:
    """For each trained mixed run that keeps more between steps than float32 (its masters, say), the batch from
    which its total, what it keeps and the activations it saves, is below float32's (None: never, its activations
    being no smaller). What training keeps does not grow with the batch; the saved activations grow in proportion,
    so the batch is estimated from the two runs' bytes at this one."""
    base, batch = comparison.baseline, comparison.config.get("batch_size")
    found: dict[str, int | None] = {}
    if not base.state_bytes or not batch:
        return found
    for run in comparison.runs[1:]:
        extra = run.state_bytes - base.state_bytes
        if run.probe or not run.state_bytes or extra <= 0:
            continue
        saved_less = (base.saved_for_backward_bytes - run.saved_for_backward_bytes) / batch  # per sample
        found[run.label] = math.floor(extra / saved_less) + 1 if saved_less > 0 else None
    return found


def crossover_line(comparison: Comparison) -> str | None:
    """``crossover_batches`` in a sentence, with why: at this batch what training keeps between steps outweighs the
    activations 16 bits halve. None where no run keeps more than float32."""
    found = crossover_batches(comparison)
    if not found:
        return None
    base = comparison.baseline
    batches = ", ".join(f"from batch {n} {label}'s" if n is not None else f"never {label}'s (its activations are no "
                        "smaller)" for label, n in found.items())
    return (f"Memory: at batch {comparison.config['batch_size']} what training keeps between steps (weights, "
            f"gradients, masters, optimizer states: {base.state_bytes / MIB:.1f} MiB in float32) outweighs the saved "
            f"activations 16 bits halve ({base.saved_for_backward_bytes / MIB:.1f} MiB); only the activations grow "
            f"with the batch, and {batches} total falls below float32's (estimated from these runs' bytes).")


# A ratio over its bar sits on float32's dashed line when the two are close: a white ground keeps it legible.
_ON_THE_LINE = dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none")


def summary_figure(comparison: Comparison) -> Any:
    """The summary's figure: step time of the compared runs on an axis scaled to them (a probe's bar, timed only,
    runs off it with its figure written on it), and each run's memory stacked by part (``memory_parts``), with
    ``crossover_line`` under it."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, labels = comparison.runs, [re.sub(r" (fp32-|native|compiled|probe|\S+-states)", r"\n\1", run.label)
                                     for run in comparison.runs]
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    times = [run.ms_per_step for run in runs]
    top = 1.3 * max(t for t, run in zip(times, runs) if not run.probe)
    colors = ["#888888"] + ["#3b75af"] * (len(runs) - 1)
    bars = time_ax.bar(labels, [min(t, top) for t in times], color=colors,
                       hatch=[("//" if run.probe else "") for run in runs])
    time_ax.axhline(times[0], color="black", linestyle="--", linewidth=1, label="fp32")
    for bar, run, value in zip(bars, runs, times):
        clipped = value > top
        text = (f"{value:,.0f} ms\n{value / times[0]:.1f}x, off the axis" if clipped
                else f"{value / times[0]:.2f}x")
        time_ax.annotate(text, (bar.get_x() + bar.get_width() / 2, min(value, top)), ha="center",
                         va="top" if clipped else "bottom", fontsize=7, xytext=(0, -3 if clipped else 1),
                         textcoords="offset points", color="white" if clipped else "black",
                         bbox=None if clipped else _ON_THE_LINE)
    time_ax.set_ylim(0, top)
    time_ax.set_title("ms per step" + (" (a hatched probe runs off the axis)" if any(t > top for t in times) else ""))
    time_ax.legend(loc="upper left", fontsize=8)
    trained = [index for index, run in enumerate(runs) if not run.probe]  # a probe's memory says nothing
    bottom = [0.0] * len(trained)
    parts = [memory_parts(runs[index]) for index in trained]
    for name, color in zip(PARTS, PART_COLORS):
        heights = [p[name] / MIB for p in parts]
        if any(heights):
            memory_ax.bar([labels[index] for index in trained], heights, bottom=bottom, color=color, label=name)
            bottom = [b + h for b, h in zip(bottom, heights)]
    memory_ax.axhline(bottom[0], color="black", linestyle="--", linewidth=1)
    for index, total in enumerate(bottom):
        memory_ax.annotate(f"{total / bottom[0]:.2f}x" if bottom[0] else "", (index, total), ha="center",
                           va="bottom", fontsize=7, bbox=_ON_THE_LINE)
    memory_ax.set_ylim(0, 1.45 * max(bottom))  # room for the legend above the bars
    memory_ax.set_title("memory added (MiB)")
    memory_ax.legend(loc="upper left", fontsize=7, ncol=3)
    for ax in (time_ax, memory_ax):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{comparison.config['model']} on {comparison.config['data']}, {comparison.machine['device_name']}",
                 fontsize=9)
    line = crossover_line(comparison)
    fig.tight_layout(rect=(0, 0.12 if line else 0, 1, 1))
    if line:
        fig.text(0.01, 0.01, textwrap.fill(line, 170), fontsize=7, va="bottom")
    return fig


def write_summary(comparison: Comparison, path: Path) -> None:
    """Time and memory per run as bars, with the float32 baseline marked (``summary_figure``)."""
    import matplotlib.pyplot as plt

    fig = summary_figure(comparison)
    fig.savefig(path, format="png")
    plt.close(fig)


def write_all(comparison: Comparison, out: Path) -> list[Path]:
    """results.json, curves.png, summary.png and a guard-<run>.png per guarded run in ``out``, all or none, never
    over a file that appeared there meanwhile (``files.publish_new``); returns their paths.

    Raises:
        FileExistsError: one of them exists in ``out`` (named): nothing was written.
        OSError: a write failed (a full disk): nothing was written.
    """
    writers: dict[Path, Callable[[Path], object]] = {
        out / "results.json": lambda tmp: write_json(comparison, tmp),
        out / "curves.png": lambda tmp: write_curves(comparison, tmp),
        out / "summary.png": lambda tmp: write_summary(comparison, tmp),
    }
    several = len(comparison.seeds) > 1
    for run in comparison.runs:
        for seed, one in zip(comparison.seeds, comparison.each_seed(run)):
            if one.guard is not None:
                name = f"{run.label} seed {seed}" if several else run.label
                title = f"ampkit guard, {name}: {len(one.guard['events'])} event(s)"
                writers[out / f"guard-{_slug(name)}.png"] = functools.partial(plot_timeline, one.guard, title=title)
    publish_new(writers)
    return list(writers)
