"""The guard's picture, drawn from its timeline (``Guard.timeline()``, or a run's in ``ampkit compare``'s results)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ampkit.guard.layers import FIGURES


def plot_timeline(timeline: dict[str, Any], path: Path, title: str = "") -> None:
    """Two panels, PNG, to ``path``: the loss per step (a gap where it was not finite) with each event marked
    at its step and labelled by its signal and layer; below, each sampled layer's worst figure (saturation,
    underflow, or a 16-bit one's largest value) as a multiple of its limit, over the steps, for the six layers that
    came nearest their limits (1.0: the limit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, events, raised = timeline["losses"], timeline["events"], timeline["raised"]
    fig, (ax, below) = plt.subplots(2, 1, figsize=(7, 6), dpi=120, sharex=True, height_ratios=(3, 2))
    # steps counted from 1, as compare's progress and curves count them (the timeline's from 0)
    ax.plot(range(1, len(losses) + 1), [math.nan if v is None else v for v in losses], linewidth=1.2, label="loss")
    for index, event in enumerate(events):
        ax.axvline(event["step"] + 1, color="tab:red", alpha=0.5, linestyle="--", label="events" if index == 0 else None)
        label = event["signal"] + (f": {event['layer']}" if event["layer"] else "")
        ax.annotate(label, (event["step"] + 1, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    va="top", ha="right", color="tab:red")
    ax.set_ylabel("training loss")
    ax.set_title(title or f"ampkit guard: {len(events)} event(s) in {len(losses)} steps")
    ax.legend()
    ax.grid(alpha=0.3)
    worst: dict[str, list[tuple[int, float]]] = {}
    for sample in timeline["samples"]:
        for name, figures in sample["layers"].items():
            usable = [figures[k] / timeline["limits"][k] for k in FIGURES
                      if k != "amax" or timeline["kinds"].get(name) == "16-bit"]
            worst.setdefault(name, []).append((sample["step"] + 1, max(usable)))
    nearest = sorted(worst, key=lambda n: -max(v for _, v in worst[n]))[:6]
    for name in nearest:
        steps, values = zip(*worst[name])
        below.plot(steps, [max(v, 1e-6) for v in values], marker=".", linewidth=1,
                   label=name + (f" (raised to {raised[name]})" if name in raised else ""))
    below.axhline(1.0, color="tab:red", linewidth=0.8, linestyle=":", label="limit")
    below.set_yscale("log")
    below.set_ylabel("worst figure / its limit")
    every = timeline["sample_every"]
    below.set_xlabel(f"step (layers sampled every {every})" if every else "step (layers not sampled)")
    if nearest:
        below.legend(fontsize=7)
    below.grid(alpha=0.3)
    from matplotlib.ticker import FuncFormatter

    below.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 0.01, not 10^-2
    fig.tight_layout(h_pad=2.0)  # the panels' edge ticks (the loss's lowest, the figures' highest) apart
    fig.savefig(path, format="png")
    plt.close(fig)
