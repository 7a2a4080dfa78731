"""Tables, figures and files of a comparison. ``write_all`` writes the files all or none."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from rich import box
from rich.table import Table

from ampkit.experiment.comparison import PLAN_FIELDS, Comparison
from ampkit.experiment.config import WARMUP_STEPS, RunResult
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
    caption = ("memory in MiB; B/param: weights, gradients, masters and optimizer states kept between steps, in bytes "
               "per parameter; below each figure, its ratio to float32")
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

        per_parameter = f"{run.state_bytes / run.parameters:.1f}{r('state_bytes')}" if run.parameters else "-"
        row = [
            re.sub(r" (fp32-|native|compiled|\S+-states)", r"\n\1", run.label),  # narrow: wraps at each option
            f"{run.ms_per_step:.1f}{r('ms_per_step')}" + (f"\n+{run.compile_s:.0f} s" if run.compile_s is not None else ""),
            f"{run.peak_memory_bytes / MIB:.0f}M{r('peak_memory_bytes')}",
            f"{run.saved_for_backward_bytes / MIB:.1f}M{r('saved_for_backward_bytes')}",
            per_parameter,
            "-" if run.final_train_loss is None else f"{run.final_train_loss:.3f}",
            "-" if run.test_accuracy is None else f"{100 * run.test_accuracy:.1f}%",
        ]
        if scaled:
            row.append(f"{run.skipped_steps}" + ("" if run.final_loss_scale is None else f"\n({run.final_loss_scale:g})"))
        if run.guard is not None:
            row[0] += f"\nguard: {len(run.guard['events'])}"
        out.add_row(*row)
    return out


def guard_lines(comparison: Comparison) -> list[str]:
    """A line per guard event of every run: the run, the step, the signal, where, what the guard did."""
    return [f"{run.label}: step {e['step'] + 1} {e['signal']}, {e['where']}: {e['action']}"
            for run in comparison.runs if run.guard is not None for e in run.guard["events"]]


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
    """Training loss per step of every run, overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    shown = [run for run in comparison.runs if not run.probe]  # a probe's few steps say nothing of convergence
    marked = False  # the guard's events: one legend entry for all
    for index, run in enumerate(shown):
        # a style of its own per run, drawn thinner on top: two runs with equal losses both stay visible
        ax.plot(range(1, len(run.losses) + 1), run.losses, label=run.label, linewidth=2.2 - 1.4 * index / len(shown),
                linestyle=("-", "--", "-.", ":")[index % 4], alpha=0.9)
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
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 5, not 5x10^0
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    divisor = comparison.config.get("loss_divisor", 1)
    divided = f" (trained on the loss / {divisor:g})" if divisor != 1 else ""
    ax.set_title(f"{comparison.config['model']} on {comparison.config['data']}: loss per step{divided}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write_summary(comparison: Comparison, path: Path) -> None:
    """Time and memory per run as bars, with the float32 baseline marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [run.label for run in comparison.runs]
    panels = [
        ("ms per step", [run.ms_per_step for run in comparison.runs]),
        ("memory added (MiB)", [run.peak_memory_bytes / MIB for run in comparison.runs]),  # the table's name
        ("saved for backward (MiB)", [run.saved_for_backward_bytes / MIB for run in comparison.runs]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4), dpi=120)
    for ax, (name, values) in zip(axes, panels):
        bars = ax.bar(labels, values, color=["#888888"] + ["#3b75af"] * (len(values) - 1))
        ax.axhline(values[0], color="black", linestyle="--", linewidth=1, label="fp32")
        for bar, value in zip(bars, values):
            ratio = value / values[0] if values[0] else math.nan
            ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                        fontsize=8)
        ax.set_title(name)
        ax.tick_params(axis="x", labelrotation=25, labelsize=7)
    axes[0].legend(loc="lower left")
    fig.suptitle(f"{comparison.config['model']} on {comparison.config['data']}, {comparison.machine['device_name']}",
                 fontsize=9)
    fig.tight_layout()
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
    for run in comparison.runs:
        if run.guard is not None:
            title = f"ampkit guard, {run.label}: {len(run.guard['events'])} event(s)"
            writers[out / f"guard-{_slug(run.label)}.png"] = functools.partial(plot_timeline, run.guard, title=title)
    publish_new(writers)
    return list(writers)
