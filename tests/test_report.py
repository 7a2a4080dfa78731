"""What ``ampkit compare`` draws (``experiment/report.py``): looked at, then held by these checks."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest

from ampkit.experiment import report
from ampkit.experiment.comparison import Comparison
from ampkit.experiment.config import RunResult

matplotlib.use("Agg")


def _run(label: str, losses: list[float]) -> RunResult:
    return RunResult(label, "bf16", "O1", [], False, 10.0, 100.0, 2**20, 2**19, losses[-1], 0.5, 0, None,
                     len(losses), losses, 1.0)


def _comparison() -> Comparison:
    same = [5.0 / (1 + step) ** 0.3 for step in range(50)]
    runs = [_run("fp32", [v * 1.01 for v in same]), _run("bf16 O1", same), _run("bf16 O2", list(same))]
    return Comparison(runs, {"model": "gpt", "data": "text"}, {"device_name": "a CPU"}, "now")


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """Each figure ``report`` saves, kept for a look at its parts."""
    from matplotlib.figure import Figure

    saved: list = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: saved.append(self))
    return saved


def test_runs_with_equal_losses_stay_visible_and_the_log_axis_reads_plain_numbers(figures: list,
                                                                                    tmp_path: Path) -> None:
    """On main, bf16 O1's line lay hidden under O2's when their losses were equal (one style, one width), and the
    GPT plot's axis read "5x10^0"."""
    report.write_curves(_comparison(), tmp_path / "curves.png")
    (ax,) = figures[0].axes
    styles = [(line.get_linestyle(), line.get_linewidth()) for line in ax.get_lines()]
    assert len(styles) == 3 and len(set(styles)) == 3
    figures[0].canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels(minor=True) + ax.get_yticklabels()]
    assert any(labels) and not any("10^" in t or "times" in t for t in labels)


def test_the_summary_names_memory_as_the_table_does(figures: list, tmp_path: Path) -> None:
    """On main, summary.png said "peak memory" where the table and the docs say "memory added"."""
    report.write_summary(_comparison(), tmp_path / "summary.png")
    titles = [ax.get_title() for ax in figures[0].axes]
    assert "memory added (MiB)" in titles and not any("peak" in t for t in titles)


def test_a_comparison_with_loss_scaling_and_a_guard_fits_80_columns() -> None:
    """Was: the skipped-steps and loss-scale columns of an fp16 run made the table 88 columns wide; rich cut its
    right-hand columns ("skipp…") and the caption at 80."""
    from rich.console import Console

    comparison = _comparison()
    comparison.config.update(batch_size=32, steps=400)
    comparison.machine.update(device_name="AMD EPYC", torch="2.13.0+cpu")
    fp16 = _run("fp16 O1 fp32-compute", [4.0, 3.0])
    fp16.float32_compute, fp16.final_loss_scale, fp16.skipped_steps = ["matmul"], 65536.0, 3
    fp16.guard = {"events": [{"step": 1}], "raised": {}}
    comparison.runs.append(fp16)
    console = Console(width=80, record=True)
    console.print(report.table(comparison))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "(65536)" in text and "guard: 1" in text and "skipped (scale): the steps the loss scaler skipped" in " ".join(
        text.split())


def _timed(label: str, precision: str, ms: float, float32_compute: list[str] | None = None) -> RunResult:
    return RunResult(label, precision, "O1", float32_compute or [], False, ms, 100.0, 2**20, 2**19, 1.0, 0.5, 0, None,
                     10, [1.0] * 10, 1.0)


def test_a_native_run_slower_than_float32_though_its_gemms_are_faster_is_explained() -> None:
    """The first GPU run (an H200) showed every mixed run of `compare`'s small models slower than float32, with
    GEMMs measured 12x faster and nothing said why: a reader took mixed precision for broken."""
    runs = [_timed("fp32", "fp32", 10.0), _timed("bf16 O1", "bf16", 13.1), _timed("fp16 O1", "fp16", 9.0),
            _timed("bf16 O1 fp32-compute", "bf16", 14.0, ["matmul"]), _timed("fp8 O1", "fp8", 30.0)]
    comparison = Comparison(runs, {"model": "gpt", "data": "text"}, {"device_name": "a GPU"}, "now")
    line = report.slower_line(comparison, {"bf16": 12.4, "fp16": 12.0, "fp8": 20.0})
    assert line is not None and line.startswith("Slower than float32 (step time: bf16 O1 1.31x) though this model's "
                                                "GEMMs run faster in 16 bits here (bf16 12.4x)")
    # where native kernels are slower than float32 (a CPU without native bf16), the plan has said so: no line
    assert report.slower_line(comparison, {"bf16": 0.03, "fp16": 0.6}) is None
    # GEMMs a little faster (a CPU with native bf16, 1.1x): casts outweighing them is no surprise, no line
    assert report.slower_line(comparison, {"bf16": 1.1, "fp16": 1.1}) is None


# -- Read at a glance (issue 70): every picture rendered, its texts' boxes checked ---------------------------------

def _overlapping_texts(fig: object) -> list[tuple[str, str]]:
    """The pairs of texts of ``fig`` whose drawn boxes overlap (tick labels in view, titles, axis labels,
    annotations, the figure's own texts, legends as one box each), by their text."""
    from matplotlib.text import Text

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # a canvas again: the figure was closed once saved
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes: list[tuple[str, object]] = []
    legend_texts: set[int] = set()
    for ax in fig.axes:  # type: ignore[attr-defined]
        legend = ax.get_legend()
        if legend is not None:
            boxes.append(("legend of " + ax.get_title(), legend.get_window_extent(renderer)))
            legend_texts |= {id(t) for t in legend.get_texts()}
        inside = ax.get_window_extent(renderer).expanded(1.6, 1.6)
        for label in [*ax.get_xticklabels(which="both"), *ax.get_yticklabels(which="both")]:
            box = label.get_window_extent(renderer)
            if label.get_visible() and label.get_text() and inside.contains(*box.p0) and inside.contains(*box.p1):
                boxes.append((label.get_text(), box))
    for text in fig.findobj(Text):  # type: ignore[attr-defined]
        if (text.get_visible() and text.get_text().strip() and id(text) not in legend_texts
                and text not in [t for ax in fig.axes for t in ax.get_xticklabels(which="both")  # type: ignore[attr-defined]
                                 + ax.get_yticklabels(which="both")]):
            boxes.append((text.get_text(), text.get_window_extent(renderer)))
    shrunk = [(name, box.shrunk(0.96, 0.9)) for name, box in boxes]  # touching edges are no overlap
    return [(a, b) for i, (a, box_a) in enumerate(shrunk) for b, box_b in shrunk[i + 1:] if box_a.overlaps(box_b)]


def _with_probe() -> Comparison:
    """The README's main job as an AVX2 CPU drew it: float32 330 ms, the mixed runs 350-365 ms, a native probe
    41x float32 (13,650 ms); each run's memory by part, O2's masters making it the largest at batch 64."""
    mib = 2**20
    kept = {"weights": 2.6 * mib, "gradients": 2.6 * mib, "masters": 0, "optimizer states": 5.1 * mib}
    o2 = {"weights": 1.3 * mib, "gradients": 2.6 * mib, "masters": 2.6 * mib, "optimizer states": 5.1 * mib}
    runs = []
    for label, ms, parts, saved, probe in (("fp32", 330.0, kept, 0.45, False),
                                            ("bf16 O1 fp32-compute", 365.0, kept, 0.24, False),
                                            ("bf16 O2 fp32-compute", 350.0, o2, 0.24, False),
                                            ("bf16 O1 native probe", 13650.0, {}, 0.24, True)):
        run = _run(label, [5.0 / (1 + step) ** 0.3 for step in range(50)])
        run.ms_per_step, run.probe, run.saved_for_backward_bytes = ms, probe, int(saved * mib)
        run.state_parts = {k: int(v) for k, v in parts.items()}
        run.state_bytes, run.peak_memory_bytes = sum(run.state_parts.values()), 15 * mib
        runs.append(run)
    return Comparison(runs, {"model": "resnet18", "data": "digits", "batch_size": 64}, {"device_name": "AMD EPYC"},
                      "now")


def test_the_step_time_panel_is_scaled_to_the_compared_runs_and_a_probe_runs_off_it_with_its_figure(
        figures: list, tmp_path: Path) -> None:
    """On main the probe's 13,650 ms set the axis: the three runs compared were slivers under 3% of it."""
    report.write_summary(_with_probe(), tmp_path / "summary.png")
    time_ax = figures[0].axes[0]
    top = time_ax.get_ylim()[1]
    heights = [bar.get_height() for bar in time_ax.patches]
    assert all(h >= 0.5 * top for h in heights[:3])  # float32 and the mixed runs, readable against each other
    assert heights[3] == pytest.approx(top)  # the probe's bar runs off the axis...
    assert any("13,650 ms" in t.get_text() and "41.4x" in t.get_text() for t in time_ax.texts)  # ...with its figure
    assert _overlapping_texts(figures[0]) == []


def test_a_ratio_on_float32s_dashed_line_is_not_struck_through(figures: list, tmp_path: Path) -> None:
    """The default compare on a native-bf16 CPU drew float32's 1.00x and bf16 O1's 0.99x memory ratios on float32's
    dashed line, which ran through their figures."""
    report.write_summary(_with_probe(), tmp_path / "summary.png")
    for ax in figures[0].axes:
        (line,) = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        level, span = line.get_ydata()[0], ax.get_ylim()[1]
        on_line = [t for t in ax.texts if t.get_text().endswith("x") and abs(t.xy[1] - level) < 0.1 * span]
        assert on_line  # float32's own ratio at least
        for text in on_line:
            ground = text.get_bbox_patch()
            assert ground is not None and tuple(ground.get_facecolor()) == (1.0, 1.0, 1.0, 1.0), text.get_text()


def test_the_memory_panel_stacks_each_runs_parts_and_says_from_which_batch_o2_saves(figures: list,
                                                                                     tmp_path: Path) -> None:
    comparison = _with_probe()
    report.write_summary(comparison, tmp_path / "summary.png")
    memory_ax = figures[0].axes[1]
    assert [t.get_text() for t in memory_ax.get_legend().get_texts()] == [
        "weights", "gradients", "masters", "optimizer states", "saved activations", "the rest"]
    assert len(memory_ax.patches) == 3 * 6  # three trained runs (not the probe), six parts each
    # the masters' 2.6 MiB less the 1.3 MiB that halving the weights saved, against 0.21 MiB fewer saved
    # activations per 64 samples: from batch 397 on
    assert report.crossover_batches(comparison) == {"bf16 O2 fp32-compute": 397}
    line = report.crossover_line(comparison)
    assert line is not None and "from batch 397 bf16 O2 fp32-compute's total falls below float32's" in line
    assert any("from batch 397" in t.get_text().replace("\n", " ") for t in figures[0].texts)


def test_a_loss_over_two_decades_labels_its_log_axis_without_overlaps(figures: list, tmp_path: Path) -> None:
    """On main every minor tick had a label: 0.9 0.8 0.7 ... and 0.09 0.08 ... printed over each other."""
    import math

    comparison = _comparison()
    for index, run in enumerate(comparison.runs):
        run.losses = [2.4 * math.exp(-step / 9) + 0.02 * (1 + index / 10) for step in range(60)]
    report.write_curves(comparison, tmp_path / "curves.png")
    assert _overlapping_texts(figures[0]) == []
    labels = [t.get_text() for t in figures[0].axes[0].get_yticklabels(which="both") if t.get_text()]
    assert {"0.1", "1"} <= set(labels)  # the decades still read


def test_the_guard_timeline_reads_without_overlaps(figures: list, tmp_path: Path) -> None:
    from ampkit.guard.plot import plot_timeline

    steps = 40
    timeline = {"losses": [3.0 / (1 + s) ** 0.5 if s != 12 else None for s in range(steps)], "raised": {},
                "events": [{"step": 12, "signal": "nonfinite-loss", "layer": "blocks.0.mlp.0"}], "sample_every": 4,
                "limits": {"saturation": 0.01, "underflow": 0.05, "amax": 65504.0}, "kinds": {},
                "samples": [{"step": s, "layers": {f"blocks.{i}.mlp.0": {"saturation": 1e-4 * (i + 1) * (s + 1),
                                                                         "underflow": 1e-3 * (s + 1), "amax": 1.0}
                                                   for i in range(4)}} for s in range(0, steps, 4)]}
    plot_timeline(timeline, tmp_path / "guard.png")
    assert _overlapping_texts(figures[0]) == []


def test_the_crossover_batch_is_where_a_measured_o2_run_first_keeps_less_than_float32() -> None:
    """The batch estimated from two runs at batch 64 (the MLP on the digits), checked by measuring both at it and
    one sample below: what each keeps between steps and saves for backward, from the tensors."""
    from ampkit.experiment.config import RunConfig
    from ampkit.experiment.training import execute

    def totals(batch: int) -> tuple[list[RunResult], list[int]]:
        runs = [execute(RunConfig(model="mlp", steps=1, batch_size=batch)),
                execute(RunConfig(model="mlp", steps=1, batch_size=batch, precision="bf16", opt_level="O2",
                                  compute="native"))]
        return runs, [run.state_bytes + run.saved_for_backward_bytes for run in runs]

    runs, at_64 = totals(64)
    assert at_64[1] > at_64[0]  # at this size O2's masters outweigh what its 16-bit activations save
    comparison = Comparison(runs, {"model": "mlp", "data": "digits", "batch_size": 64}, {"device_name": "a CPU"},
                            "now")
    (batch,) = report.crossover_batches(comparison).values()
    assert batch is not None and 64 < batch < 1437  # the digits' training set
    fp32, o2 = totals(batch)[1]
    assert o2 < fp32
    fp32, o2 = totals(batch - 1)[1]
    assert o2 >= fp32


def test_inspects_histogram_reads_without_overlaps(figures: list, tmp_path: Path) -> None:
    import torch
    from torch import nn

    from ampkit.diagnostics.numerics import inspect_numerics, write_histogram

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    write_histogram(inspect_numerics(model, torch.randn(8, 16), torch.randint(0, 4, (8,))), tmp_path / "h.png")
    assert _overlapping_texts(figures[0]) == []
