"""Bad input to `ampkit compare` gets one line naming the value and the fix, and loses nothing.

The repros of the issue "Bad input gets a clear error and nothing is lost", as a table.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit import DynamicLossScaler, NonFiniteError
from ampkit.cli.main import main
from ampkit.cli import compare as compare_cmd
from ampkit.experiment import comparison

C = ["--model", "mlp", "--precision", "fp32", "--steps", "2", "--batch-size", "8", "--quiet"]

MODELS = textwrap.dedent("""
    import torch
    from torch import nn

    def raises(**kwargs):
        raise RuntimeError("factory exploded")

    def not_a_module(**kwargs):
        return 3

    def no_parameters(**kwargs):
        return nn.Identity()

    def no_kwargs():
        return nn.Linear(784, 10)

    class Pair(nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.fc = nn.Linear(784, num_classes)

        def forward(self, x):
            return self.fc(x.flatten(1)), x

    def tuple_output(num_classes):
        return Pair(num_classes)

    def too_few_outputs(num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 3))

    class Named(nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.fc = nn.Linear(784, num_classes)

        def forward(self, x):
            return {"logits": self.fc(x.flatten(1))}

    def dict_output(num_classes):
        return Named(num_classes)

    class TinyLM(nn.Module):
        def __init__(self, vocab_size, context):
            super().__init__()
            self.embed, self.head = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)

        def forward(self, idx):
            return self.head(self.embed(idx))

    def tiny_lm(vocab_size, context):
        return TinyLM(vocab_size, context)

    class FailsOnCall(nn.Module):  # its forward number `fail_on` raises (each process builds its own)
        def __init__(self, num_classes, fail_on):
            super().__init__()
            self.fc, self.calls, self.fail_on = nn.Linear(784, num_classes), 0, fail_on

        def forward(self, x):
            self.calls += 1
            if self.calls == self.fail_on:
                raise RuntimeError(f"forward {self.calls} fails")
            return self.fc(x.flatten(1))

    def late_failure(num_classes):  # fine for the plan's warm-up and 3 timed steps, fails in the run's 7th step
        return FailsOnCall(num_classes, fail_on=7)

    def timed_failure(num_classes):  # fails in the plan's first timed step
        return FailsOnCall(num_classes, fail_on=2)
""")


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "user_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return tmp_path


@pytest.mark.parametrize("batch", ["-4", "2000"])
def test_batch_sizes_that_looped_forever_now_fail_at_once(batch: str, tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "ampkit.cli.main", "compare", *C, "--batch-size", batch,
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    expected = {"-4": "--batch-size -4 is invalid: use an integer >= 1",
                "2000": "--batch-size 2000 is larger than the digits training set (1437 samples)"}[batch]
    assert done.returncode == 2 and expected in done.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size 0 is invalid"),  # was batch 64, silently
        (["--epochs", "0"], "--epochs 0 is invalid"),
        (["--lr", "0"], "--lr 0.0 is invalid: use a finite learning rate > 0"),  # was lr 0.002, silently
        (["--lr", "nan"], "--lr nan is invalid"),
        (["--lr", "-1"], "--lr -1.0 is invalid"),
        (["--precision", "bf16", "bf16"], "--precision bf16 bf16: bf16 named more than once"),  # ran every setting twice
        (["--seed", str(2**64)], "--seed 18446744073709551616 is out of range"),
        (["--model", "gpt", "--data", "digits"], "--model gpt and --data digits do not fit"),
        (["--model", "mlp", "--data", "text"], "--model mlp and --data text do not fit"),
    ],
)
def test_bad_values_exit_2_with_one_line(argv: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = [a for a in C if a not in ("--steps", "2")] if "--epochs" in argv else C
    assert main(["compare", *args, *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing half-written


@pytest.mark.parametrize(
    "factory, message",
    [
        ("raises", "Model factory 'user_models:raises' raised RuntimeError: factory exploded (called as "
                   "user_models:raises(num_classes=10)"),
        ("not_a_module", "returned a int, not a torch.nn.Module"),
        ("no_parameters", "has no parameters: there is nothing to train"),
        ("no_kwargs", "raised TypeError: no_kwargs() got an unexpected keyword argument 'num_classes'"),
        ("tuple_output", "returned a tuple; ampkit compare needs one tensor of class scores"),
        ("too_few_outputs", "returned 3 scores per sample; the data has 10 classes"),
        ("dict_output", "returned a dict; ampkit compare needs one tensor of class scores"),
        ("timed_failure", "The model from 'user_models:timed_failure' failed on a batch of digits "
                          "(inputs (8, 1, 28, 28), torch.float32): RuntimeError: forward 2 fails"),
    ],
)
def test_user_model_mistakes_exit_2_with_one_line(factory: str, message: str, models: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", *C, "--model", f"user_models:{factory}", "--out", str(models / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (models / "run").exists()


def test_a_run_that_fails_midway_is_one_line_and_its_log_is_kept(models: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = models / "run"
    assert main(["compare", *C, "--steps", "8", "--model", "user_models:late_failure", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ampkit compare: The fp32 run failed (exit code 1): RuntimeError: forward 7 fails")
    log = out / "fp32-error.log"
    assert str(log) in err and "Traceback" in log.read_text()


@pytest.mark.parametrize("bad_out", ["/proc/ampkit-x", "a_file/sub", "a_file"])
def test_an_unusable_output_location_fails_before_training(bad_out: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("a_file").write_text("not a directory")
    monkeypatch.setattr(compare_cmd, "compare", lambda *a, **k: pytest.fail("trained before checking --out"))
    assert main(["compare", *C, "--out", bad_out]) == 2
    err = capsys.readouterr().err
    assert f"--out {bad_out}" in err and "Traceback" not in err


def test_two_comparisons_in_the_same_second_get_two_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(comparison, "default_out_dir", lambda: Path("ampkit-runs") / "20261130-120000")
    first, second = comparison.reserve_out_dir(None), comparison.reserve_out_dir(None)
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name == "20261130-120000-2"


def test_a_diverging_run_ends_with_a_diagnosis_strict_json_and_exit_1(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["compare", *C, "--steps", "4", "--lr", "1e30", "--out", str(out), "--json"]) == 1
    captured = capsys.readouterr()
    printed = json.loads(captured.out, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    saved = json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert printed == saved
    run = saved["runs"][0]
    assert run["diverged"].startswith("the loss became nan at step") and run["test_accuracy"] is None
    assert any(path.startswith("runs[0].losses[") for path in saved["non_finite"])
    assert "ampkit compare: the fp32 run diverged: the loss became nan" in captured.err


def test_result_files_are_readable_by_others(tmp_path: Path) -> None:
    assert main(["compare", *C, "--out", str(tmp_path / "run")]) == 0
    for name in ("results.json", "curves.png", "summary.png"):
        assert stat.S_IMODE((tmp_path / "run" / name).stat().st_mode) == 0o644  # was 0600 (mkstemp)


def test_interrupt_exits_130_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(compare_cmd, "compare", interrupted)
    assert main(["compare", *C, "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip() == "ampkit compare: interrupted; results already written are kept."


def test_a_run_dies_with_its_host() -> None:
    """The run process asks Linux for SIGTERM when its parent dies (PR_SET_PDEATHSIG)."""
    import subprocess

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    script = textwrap.dedent("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "from ampkit.experiment.process import _die_with_the_parent; import time; _die_with_the_parent(); "
            "print('ready', flush=True); time.sleep(60)"],
            env={**os.environ, "AMPKIT_HOST_PID": str(os.getpid())}, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    host = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(host.stdout.readline())  # type: ignore[union-attr]
    host.kill()  # as SIGKILL would: no cleanup of its own
    host.wait(timeout=30)
    import time

    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):  # dead, waiting to be reaped by whoever adopted it
            return
        time.sleep(0.1)
    pytest.fail(f"the run process {pid} outlived its host by 10 s")


# -- the loss scalers ------------------------------------------------------------------



def _nan_steps(scaler: DynamicLossScaler, steps: int) -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        scaler.scale(model(torch.randn(4, 2)).sum() * float("nan")).backward()
        scaler.step(optimizer)
        scaler.update()


def test_a_scale_that_cannot_back_off_still_ends_in_non_finite_error() -> None:
    # backoff_factor=1.0 kept the scale: 50 NaN-loss steps were skipped without a word
    with pytest.raises(NonFiniteError, match=r"cannot go lower \(65536: backoff_factor=1.0 keeps it\).*The loss itself is nan"):
        _nan_steps(DynamicLossScaler(backoff_factor=1.0, max_min_scale_overflows=5), 50)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_min_scale_overflows": 0}, "max_min_scale_overflows=0 is invalid: use an integer >= 1"),
        ({"max_min_scale_overflows": -1}, "max_min_scale_overflows=-1 is invalid"),
        ({"max_scale": float("nan")}, "max_scale=nan is invalid: use a finite number > 0"),  # named min_scale before
        ({"init_scale": float("inf")}, r"init_scale=inf is outside \[min_scale, max_scale\]"),
        ({"backoff_factor": 0.0}, r"backoff_factor=0.0 is invalid: use a number in \(0, 1\]"),
        ({"growth_interval": 0}, "growth_interval=0 is invalid: use an integer >= 1"),
    ],
)
def test_scaler_constants_out_of_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)


@pytest.mark.parametrize("new_scale", [float("nan"), float("inf"), 0.0, -4.0])
def test_update_with_an_impossible_scale_is_refused(new_scale: float) -> None:
    scaler = DynamicLossScaler()
    with pytest.raises(ValueError, match=rf"new_scale={new_scale!r} is outside \[min_scale, max_scale\]"):
        scaler.update(new_scale=new_scale)
    assert scaler.get_scale() == 2.0**16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"scale": float("nan")}, "scale=nan is outside"),
        ({"scale": 0.0}, "scale=0.0 is outside"),
        ({"scale": -1.0}, "scale=-1.0 is outside"),
        ({"hysteresis": -2}, "hysteresis=-2 is invalid"),
        ({"hysteresis_left": 0}, "hysteresis_left=0 is invalid"),
        ({"steps": "x"}, "steps='x' is invalid"),  # had already changed the scale and growth factor
        ({"version": "1"}, "version '1' is not 1"),  # said "version 1 is not 1"
    ],
)
def test_a_bad_scaler_state_is_refused_and_changes_nothing(change: dict, message: str) -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, growth_factor=4.0)
    before = scaler.state_dict()
    bad = {**DynamicLossScaler(init_scale=8.0, growth_factor=3.0).state_dict(), **change}
    with pytest.raises(RuntimeError, match=message):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


def test_loading_none_names_what_to_pass() -> None:
    with pytest.raises(RuntimeError, match="Cannot load loss scaler state from a NoneType"):
        DynamicLossScaler().load_state_dict(None)  # type: ignore[arg-type]


# -- master weights, opt levels and the measurement API --------------------------------


def test_initialize_twice_is_refused() -> None:
    # the second call wrapped masters of masters: training silently stopped changing the weights
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ampkit.initialize(model, optimizer, "O2", torch.bfloat16)
    with pytest.raises(ValueError, match="The model was initialized at O2 already; call ampkit.initialize once"):
        ampkit.initialize(model, optimizer, "O2", torch.bfloat16)
    with pytest.raises(ValueError, match="already keeps master weights"):
        ampkit.MasterWeightOptimizer(optimizer)  # the inner optimizer, wrapped again


def test_master_weight_optimizer_takes_an_optimizer() -> None:
    with pytest.raises(ValueError, match="MasterWeightOptimizer takes a torch.optim.Optimizer, got Linear"):
        ampkit.MasterWeightOptimizer(nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "state, message",
    [
        (None, "Cannot load None into MasterWeightOptimizer"),
        ({"version": 1, "master_params": []}, r"misses \['optimizer'\]"),  # was KeyError
        ({"version": 99, "optimizer": {}, "master_params": []}, "version 99 is not 1"),  # was accepted
    ],
)
def test_master_weight_state_mistakes_are_named(state: object, message: str) -> None:
    model = nn.Linear(2, 2)
    optimizer = ampkit.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=message):
        optimizer.load_state_dict(state)  # type: ignore[arg-type]


def test_a_failed_master_weight_load_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    optimizer = ampkit.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    other = ampkit.MasterWeightOptimizer(torch.optim.SGD(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).parameters(),
                                                         lr=0.5))
    before = [m.clone() for m in optimizer.master_params]
    with pytest.raises(RuntimeError, match=r"Master weight 2 in the checkpoint is \(2, 2\), this model's \(3, 2\)"):
        optimizer.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, optimizer.master_params))  # master 0 was replaced before
    assert optimizer.param_groups[0]["lr"] == 0.1  # and the inner lr


@pytest.mark.parametrize("multiple", [2.5, 0, -8, True])
def test_alignment_multiples_must_be_positive_integers(multiple: object) -> None:
    with pytest.raises(ValueError, match=rf"multiple={multiple!r} is invalid: use a positive integer"):
        ampkit.check_alignment(nn.Linear(3, 3), multiple=multiple)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is invalid: use a positive integer"):
        ampkit.pad_vocab(nn.Linear(3, 3), multiple=multiple)  # type: ignore[arg-type]  # was ZeroDivisionError


def test_frozen_parameters_still_take_weight_memory() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    model[0].requires_grad_(False)
    estimate = ampkit.estimate_memory(model, torch.randn(2, 10), "O2", optimizer="adamw")
    assert estimate.parameters == 220 and estimate.float32.weights == 4 * 220  # was 4 * 110
    assert estimate.float32.gradients == 4 * 110 and estimate.mixed.master_weights == 4 * 110
    assert estimate.mixed.weights == 2 * 220


def test_exit_without_enter_and_non_string_op_names() -> None:
    with pytest.raises(RuntimeError, match=r"__exit__\(\) without __enter__\(\)"):
        ampkit.autocast(ampkit.Policy.default("cpu", compute="native")).__exit__(None, None, None)
    with pytest.raises(ValueError, match="deny= takes op names \\(strings\\), got None"):
        ampkit.Policy.default("cpu").with_ops(deny=[None])  # type: ignore[list-item]


@pytest.mark.parametrize("batch", ["0", "-1", "100000"])
def test_inspect_batch_sizes_are_checked(batch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0 used 32, -1 used train_x[:-1], a huge value claimed a batch it did not use
    assert main(["inspect", "--model", "mlp", "--batch-size", batch, "--out", str(tmp_path)]) == 2
    assert f"--batch-size {batch} is invalid: use 1 to 1437" in capsys.readouterr().err


def test_inspect_memory_estimate_counts_the_batch_not_the_dataset(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "mlp", "--batch-size", "8", "--out", str(tmp_path), "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    # 8 digits are 8 x 784 float32 inputs: 25 KB, not the 4.4 MiB of the whole training set
    assert memory["float32"]["activations"] < 64 * 1024


def _mnist(directory: Path, images_shape: tuple[int, int], top_label: int) -> None:
    import struct

    for split, n in (("train", 12), ("t10k", 5)):
        images = torch.randint(0, 256, (n, *images_shape), dtype=torch.uint8)
        labels = torch.randint(0, top_label + 1, (n,), dtype=torch.uint8)
        labels[0] = top_label
        (directory / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, *images_shape) + bytes(images.flatten().tolist()))
        (directory / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + bytes(labels.tolist()))


@pytest.mark.parametrize(
    "shape, top_label, message",
    [((10, 10), 9, "MNIST train images in .* are 10x10, not 28x28"),
     ((28, 28), 11, "MNIST train labels in .* go up to 11; MNIST has classes 0-9")],
)
def test_foreign_mnist_files_are_named_even_with_steps(shape: tuple[int, int], top_label: int, message: str,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    _mnist(tmp_path, shape, top_label)
    argv = ["compare", *C, "--batch-size", "4", "--data", f"mnist:{tmp_path}", "--out", str(tmp_path / "run")]
    assert main(argv) == 2  # was a 41-line traceback with --steps
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_inspecting_a_model_without_parameters_is_named() -> None:
    with pytest.raises(ValueError, match="needs a model with trainable parameters; this Sequential has none"):
        ampkit.inspect_numerics(nn.Sequential(), torch.randn(2, 3))


def test_sigterm_stops_compare_in_one_line_and_keeps_the_steps_taken(tmp_path: Path) -> None:
    import signal
    import subprocess
    import time

    process = subprocess.Popen(
        [sys.executable, "-m", "ampkit.cli.main", "compare", *C, "--steps", "5000", "--out", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not (tmp_path / "run").exists():  # reserved just before training starts
        time.sleep(0.2)
    time.sleep(8)  # the runs start and take their first steps
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == "ampkit compare: terminated; results already written are kept."
    kept = json.loads((tmp_path / "run" / "results.json").read_text())  # the steps taken, not thrown away
    assert kept["incomplete"] and kept["runs"][0]["label"] == "fp32"
    assert 0 < kept["runs"][0]["steps_done"] == len(kept["runs"][0]["losses"]) < 5000


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_inspect_says_when_float32_itself_is_broken(bad: float) -> None:
    # a NaN model got no reason; an inf one got "keep it in float32", where it is inf already
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].bias[0] = bad
    report = ampkit.inspect_numerics(model, torch.randn(3, 4))
    assert report.reasons[0].startswith("2: activations are already inf/NaN in this float32 pass")
    assert "2" not in report.keep_float32


def test_inspect_takes_a_custom_text_model_as_compare_does(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "user_models:tiny_lm", "--data", "text", "--batch-size", "2",
                 "--out", str(models / "inspect"), "--json"]) == 0  # was refused: "text goes with gpt only"
    assert json.loads(capsys.readouterr().out)["numerics"]["modules"][0]["name"] == "embed"


@pytest.mark.parametrize(
    "damage, message",
    [("empty", r"train-labels-idx1-ubyte is truncated: 0 bytes, not even a header"),
     ("gzip", r"train-images-idx3-ubyte.gz is not valid gzip")],
)
def test_corrupt_mnist_files_are_named_with_steps(damage: str, message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import re

    _mnist(tmp_path, (28, 28), 9)
    if damage == "empty":
        (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"")
    else:
        (tmp_path / "train-images-idx3-ubyte").unlink()
        (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8bnot gzip")
    argv = ["compare", *C, "--batch-size", "4", "--data", f"mnist:{tmp_path}", "--out", str(tmp_path / "run")]
    assert main(argv) == 2  # with --steps, a 41-line traceback before
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err and err.count("\n") == 1
