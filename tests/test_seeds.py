"""A comparison over several seeds (``experiment/seeds.py``, ``compare(seeds=N)``, ``ampkit compare --seeds``): each
setting's seeds pooled, every seed kept, and a verdict that tells seed noise from a real difference."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import matplotlib
import pytest

from ampkit.cli.main import main
from ampkit.experiment import report
from ampkit.experiment.comparison import Comparison, compare
from ampkit.experiment.config import RunResult
from ampkit.experiment.seeds import half_range, pooled, verdict
from ampkit.experiment.settings import plan

matplotlib.use("Agg")


def _run(label: str, loss: float, accuracy: float, ms: float = 10.0, losses: list[float] | None = None,
         probe: bool = False) -> RunResult:
    return RunResult(label, "bf16", "O1", [], probe, ms, 1000 / ms, 2**20, 2**19, loss, accuracy, 0, None, 3,
                     losses or [2.0, 1.0, loss], 1.0)


FP32 = [_run("fp32", loss, accuracy) for loss, accuracy in ((0.30, 0.95), (0.32, 0.96), (0.34, 0.94))]


@pytest.mark.parametrize("losses, accuracies, within, worse", [
    ((0.29, 0.31, 0.33), (0.95, 0.95, 0.96), True, False),  # inside float32's range
    ((0.36, 0.37, 0.38), (0.93, 0.93, 0.93), True, False),  # outside the range, inside its widening (0.26-0.38)
    ((0.40, 0.41, 0.42), (0.95, 0.95, 0.95), False, True),  # a higher loss than seed noise reaches
    ((0.20, 0.21, 0.22), (0.95, 0.95, 0.95), False, False),  # a lower one: outside, and better
])
def test_a_setting_matches_float32_where_its_mean_is_inside_float32s_range_widened_by_its_spread(
        losses: tuple[float, ...], accuracies: tuple[float, ...], within: bool, worse: bool) -> None:
    runs = [_run("bf16 O1", loss, accuracy) for loss, accuracy in zip(losses, accuracies)]
    found = verdict("bf16 O1", FP32, runs)
    assert found is not None
    loss = next(f for f in found.figures if f.field == "final_train_loss")
    assert loss.band == pytest.approx((0.26, 0.38))
    assert (loss.within, loss.worse, found.matches) == (within, worse, within)
    sentence = found.sentence()
    assert ("matches float32 within seed noise" in sentence) == within
    assert ("worse than" in sentence) == worse and ("better than" in sentence) == (not within and not worse)


def test_one_seed_a_probe_or_a_divergence_has_no_match() -> None:
    assert verdict("bf16 O1", FP32[:1], [_run("bf16 O1", 0.3, 0.95)]) is None  # one seed: no spread to judge by
    assert verdict("bf16 O1 probe", FP32, [_run("p", 0.3, 0.95, probe=True)] * 3) is None
    diverged = [dataclasses.replace(_run("bf16 O1", 0.3, 0.95), diverged="non-finite loss at step 3")] * 3
    found = verdict("bf16 O1", FP32, diverged)
    assert found is not None and not found.matches and "diverged" in found.sentence()


def test_a_settings_seeds_pool_into_medians_of_times_and_means_of_figures() -> None:
    runs = [_run("bf16 O1", 0.3, 0.9, ms=10.0, losses=[2.0, 1.0]), _run("bf16 O1", 0.6, 0.8, ms=50.0,
                                                                        losses=[4.0, 3.0, 0.6]),
            _run("bf16 O1", 0.9, 0.7, ms=20.0, losses=[3.0, 2.0, 0.9])]
    one = pooled(runs, [0, 1, 2])
    assert one.ms_per_step == 20.0  # the median: one slow seed does not move it
    assert one.final_train_loss == pytest.approx(0.6) and one.test_accuracy == pytest.approx(0.8)
    assert one.losses == [3.0, 2.0]  # the steps every seed took
    assert half_range(runs, "final_train_loss") == pytest.approx(0.3) and half_range(runs[:1], "ms_per_step") is None


@pytest.fixture(scope="module")
def planted() -> Comparison:
    """The digits' MLP, float32 against bf16 O1 and a planted regression (bf16 O2 at 10 times the learning rate),
    over 3 seeds."""
    configs = plan(model="mlp", precisions=["bf16"], opt_levels=["O1"], steps=44, probe=False)
    configs.append(dataclasses.replace(configs[1], opt_level="O2", lr=configs[1].lr * 10))
    return compare(configs, seeds=3)


def test_a_planted_regression_is_called_out_as_outside_seed_noise(planted: Comparison) -> None:
    o1, o2 = planted.verdicts()  # labelled "bf16 O1" or, where bf16 computes in float32 here, "bf16 O1 fp32-compute"
    assert o1.label.startswith("bf16 O1") and o2.label.startswith("bf16 O2"), (o1.label, o2.label)
    assert o1.matches, o1.sentence()
    assert not o2.matches, o2.sentence()
    assert "outside float32's seed noise over 3 seeds" in o2.sentence()


def test_results_json_holds_every_seed_and_the_curves_draw_each_settings_band(planted: Comparison, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    record = planted.to_dict()
    assert record["seeds"] == [0, 1, 2] and record["config"]["seeds"] == [0, 1, 2]
    for entry in record["runs"]:
        losses = [tuple(seed["losses"]) for seed in entry["seed_runs"]]
        assert len(losses) == 3 and len(set(losses)) == 3  # three trainings, each its own
        assert entry["final_train_loss"] == pytest.approx(sum(s["final_train_loss"] for s in entry["seed_runs"]) / 3)
    assert [v["matches"] for v in record["verdicts"]] == [True, False]
    from matplotlib.figure import Figure

    saved: list = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: saved.append(self))
    report.write_curves(planted, tmp_path / "curves.png")
    (ax,) = saved[0].axes
    bands = ax.collections
    assert len(bands) == 3  # one per setting
    for band, run in zip(bands, planted.runs):
        lows = [min(seed.losses[i] for seed in planted.each_seed(run)) for i in range(len(run.losses))]
        assert min(band.get_paths()[0].vertices[:, 1]) == pytest.approx(min(lows))
    text = "\n".join(str(cell) for column in report.table(planted).columns for cell in column._cells)
    assert text.count("±") == 6 and "3 seeds" in report.table(planted).title


def test_compare_seeds_3_on_the_gpt_prints_bands_and_a_verdict_per_setting(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["compare", "--model", "gpt", "--steps", "24", "--seeds", "3", "--no-probe", "--quiet",
                 "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "with each of 3 seeds (0 to 2)" in printed
    for label in ("bf16 O1", "bf16 O2"):  # " fp32-compute" after it where bf16 computes in float32 on this machine
        assert re.search(rf"{label}( fp32-compute)? (matches float32 within seed noise|is outside float32's seed "
                         "noise) over 3 seeds", printed), printed
    record = json.loads((out / "results.json").read_text())
    assert [len(run["seed_runs"]) for run in record["runs"]] == [3, 3, 3]
    assert all(math.isfinite(seed["final_train_loss"]) for run in record["runs"] for seed in run["seed_runs"])


def test_one_seed_says_what_three_would_cost_and_a_bad_count_is_refused(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--model", "mlp", "--precision", "bf16", "--opt-level", "O1", "--steps", "3", "--no-probe",
            "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert "--seeds 3 (about" in " ".join(capsys.readouterr().out.split())
    for bad in ("0", "21"):
        assert main([*argv, "--seeds", bad, "--out", str(tmp_path / bad)]) == 2
        assert f"seeds={bad} is invalid: use an integer from 1 to 20" in capsys.readouterr().err
        assert not (tmp_path / bad).exists()
