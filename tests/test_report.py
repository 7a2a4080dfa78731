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
