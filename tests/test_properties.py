"""Property-based sweeps (hypothesis) of the classes of bad input: whatever arguments `ampkit compare`
gets, it exits 0, 1, 2, 130 or 143, with no traceback, and leaves complete results or none; whatever
state dict a scaler or an optimizer is handed, it loads it or refuses with a RuntimeError and
keeps its state. The training itself is replaced by a fake that returns (or interrupts) at once, so the
sweep covers parsing, planning, the output directory and the writing of results in seconds."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ampkit
from ampkit.cli import compare as compare_cmd
from ampkit.cli.main import main
from ampkit.experiment import comparison
from ampkit.experiment.comparison import Comparison
from ampkit.hardware.advice import machine_summary
from ampkit.experiment.config import RunResult
from ampkit.experiment.cost import Estimate

# database=None: no example database in the checkout (the test command writes only in temporary folders)
EXAMPLES = settings(max_examples=int(__import__("os").environ.get("AMPKIT_PROPERTY_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=list(HealthCheck), database=None)
EXIT_CODES = {0, 1, 2, 130, 143}

some = st.sampled_from
PRECISION = some(["fp32", "bf16", "fp16", "fp8", "fp8-current", "fp64", ""])
OPTIONS: dict[str, Any] = {
    "--model": some(["mlp", "gpt", "resnet18", "nosuch", "nosuch_module:f", "math:pi", ""]),
    "--data": some(["digits", "text", "synthetic", "mnist:/nonexistent", "nosuch", ""]),
    "--precision": st.lists(PRECISION, min_size=1, max_size=3),
    "--opt-level": st.lists(some(["O0", "O1", "O2", "O3", "O4"]), min_size=1, max_size=2),
    "--batch-size": some(["-1", "0", "1", "2", "8", "100000", "x"]),
    "--steps": some(["-1", "0", "1", "3", "1e3"]),
    "--epochs": some(["0", "1", "2"]),
    "--lr": some(["0.001", "0", "-1", "nan", "inf", "1e9", "abc"]),
    "--seed": some(["0", "-1", str(2**64), "1.5"]),
    "--compute": st.lists(some(["auto", "native", "float32", "fast"]), min_size=1, max_size=2),
    "--loss-scale": st.lists(some(["auto", "none", "static", "dynamic", "adaptive", "huge"]), min_size=1, max_size=2),
    "--update": st.lists(some(["plain", "kahan", "stochastic", "magic"]), min_size=1, max_size=2),
    "--loss-divisor": some(["1", "16", "0", "-2", "nan"]),
    "--device": some(["cpu", "cuda", "tpu", "cuda:7"]),
}


@st.composite
def compare_arguments(draw: st.DrawFn) -> list[str]:
    argv: list[str] = []
    for flag in draw(st.lists(some(sorted(OPTIONS)), unique=True, max_size=5)):
        value = draw(OPTIONS[flag])
        argv += [flag, *(value if isinstance(value, list) else [value])]
    if "--steps" not in argv and "--epochs" not in argv:
        argv += ["--steps", "2"]
    return argv


def _fake_estimate(configs: list[Any], progress: Any = None) -> Estimate:
    return Estimate(0.01, 0.005, 0.1, [0.01] * len(configs), {})


def _fake_compare(outcome: str) -> Any:
    def compare(configs: list[Any], **kwargs: Any) -> Comparison:
        if outcome == "interrupt":
            raise KeyboardInterrupt
        runs = [RunResult(label=c.label, precision=c.precision, opt_level=c.opt_level, float32_compute=[],
                          probe=c.probe, ms_per_step=1.0, samples_per_s=1.0, peak_memory_bytes=1,
                          saved_for_backward_bytes=1, final_train_loss=math.nan if i else 1.0,
                          test_accuracy=None if c.probe else 0.5, skipped_steps=0, final_loss_scale=None,
                          steps=c.steps, losses=[2.0, math.inf][: c.steps], wall_s=0.1,
                          diverged="the loss became inf" if outcome == "diverged" and i else None)
                for i, c in enumerate(configs)]
        return Comparison(runs, comparison._shared_config(configs), machine_summary("cpu"), "2026-12-01T00:00:00")

    return compare


@EXAMPLES
@given(argv=compare_arguments(), out=some(["fresh", "", "a_file", "existing_results"]),
       outcome=some(["ok", "diverged", "interrupt"]))
def test_compare_exits_with_a_known_code_no_traceback_and_whole_results(argv: list[str], out: str,
                                                                         outcome: str) -> None:
    _compare_holds(argv, out, outcome)


@pytest.mark.parametrize("outcome, code", [("ok", 0), ("diverged", 1), ("interrupt", 130)])
def test_the_sweeps_property_is_met_by_valid_arguments_with_each_outcome(outcome: str, code: int) -> None:
    # the property alone would also hold for a CLI that refused everything: valid arguments must get through
    assert _compare_holds(["--model", "mlp", "--precision", "fp32", "bf16", "--steps", "2"], "fresh", outcome) == code


def _compare_holds(argv: list[str], out: str, outcome: str) -> int:
    """Run ``ampkit compare`` (training faked) and check the property; returns the exit code."""
    work = Path(tempfile.mkdtemp(prefix="ampkit-property-"))
    try:
        target = work / "run"
        if out == "a_file":
            target.write_text("a file")
        elif out == "existing_results":
            target.mkdir()
            (target / "results.json").write_text("{}")
        full = ["compare", *argv, "--quiet", "--out", "" if out == "" else str(target)]
        err = io.StringIO()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            patch.setattr(compare_cmd, "estimate", _fake_estimate)
            patch.setattr(compare_cmd, "compare", _fake_compare(outcome))
            patch.chdir(work)
            try:
                code = main(full)
            except SystemExit as exit_:  # argparse's own refusals
                code = int(exit_.code or 0)
        assert code in EXIT_CODES, (full, err.getvalue()[-2000:])
        assert "Traceback" not in err.getvalue(), (full, err.getvalue()[-2000:])
        written = target / "results.json" if out != "existing_results" else None
        if code in (0, 1) and written is not None and written.exists():  # complete, strict JSON
            record = json.loads(written.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
            assert record["runs"] and {"curves.png", "summary.png"} <= {p.name for p in target.iterdir()}
        if code == 2:
            assert written is None or not written.exists()  # refused: nothing written
        if out == "existing_results":
            assert (target / "results.json").read_text() == "{}"  # never overwritten
        if code in (0, 1) and out == "fresh":
            assert written is not None and written.exists()  # a finished comparison left its results
        return code
    finally:
        shutil.rmtree(work, ignore_errors=True)


SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=3))


@EXAMPLES
@given(changes=st.dictionaries(st.sampled_from(sorted(ampkit.DynamicLossScaler().state_dict()) + ["extra", "_growth_tracker"]),
                               SCALAR, max_size=4),
       drop=st.lists(st.sampled_from(sorted(ampkit.DynamicLossScaler().state_dict())), max_size=2))
def test_a_scaler_loads_a_state_or_refuses_it_and_keeps_its_own(changes: dict[str, Any], drop: list[str]) -> None:
    good = ampkit.DynamicLossScaler(init_scale=2.0**10).state_dict()
    state = {k: v for k, v in {**good, **changes}.items() if k not in drop}
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**12)
    before = scaler.state_dict()
    try:
        scaler.load_state_dict(state)
    except RuntimeError:  # STYLE.md: a foreign or damaged state dict is a RuntimeError, naming what is wrong
        assert scaler.state_dict() == before  # refused: nothing changed
    else:
        assert scaler.state_dict()["scale"] == float(state["scale"])


@EXAMPLES
@given(shapes=st.lists(st.sampled_from([(4, 4), (4,), (2, 2), (3,), ()]), max_size=3),
       version=st.sampled_from([1, 2, None]), drop=st.sampled_from([None, "optimizer", "master_params"]))
def test_master_weights_load_a_state_or_refuse_it_and_keep_their_own(shapes: list[tuple[int, ...]], version: Any,
                                                                     drop: str | None) -> None:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    optimizer = ampkit.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    state = optimizer.state_dict()
    state["master_params"] = [torch.full(shape, 7.0) for shape in shapes]
    if version is not None:
        state["version"] = version
    if drop:
        state.pop(drop)
    before = [m.clone() for m in optimizer.master_params]
    try:
        optimizer.load_state_dict(state)
    except RuntimeError:
        assert all(torch.equal(a, b) for a, b in zip(optimizer.master_params, before))
    else:
        assert all(torch.equal(m, torch.full_like(m, 7.0)) for m in optimizer.master_params)


@EXAMPLES
@given(content=st.binary(max_size=256))
def test_a_damaged_checkpoint_is_refused_with_a_runtime_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ckpt.pt"
        path.write_bytes(content)
        model = nn.Linear(2, 2)
        weight = model.weight.detach().clone()
        with pytest.raises(RuntimeError):
            ampkit.load_checkpoint(path, model=model)
        assert torch.equal(model.weight, weight)
