"""Bad input to `ampkit compare` gets one line naming the value and the fix, and loses nothing.

The repros of the issue "Bad input gets a clear error and nothing is lost", as a table.
"""

from __future__ import annotations

import json
import re
import stat
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ampkit.cli.main import main
from ampkit.cli import compare as compare_cmd
from ampkit.experiment import comparison
from ampkit.experiment.cost import ESTIMATE_STEPS

C = ["--model", "mlp", "--precision", "fp32", "--steps", "2", "--batch-size", "8", "--quiet"]


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
        # options the chosen settings would ignore (issue 25): refused, never dropped
        (["--model", "gpt", "--epochs", "3"], "--epochs 3 applies to image data; text runs (--model gpt) train for "
                                              "a number of steps"),  # was: 400 steps, the epochs ignored
        (["--opt-level", "O3", "--compute", "native", "--update", "kahan"],
         "--precision fp32 runs float32 alone, which ignores --opt-level O3, --compute native, --update kahan"),
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
        # issue 25: was exit 0 with no results and no message
        ("exits", "Model factory 'user_models:exits' called sys.exit(0)"),
        # issue 25: was torch's "Expected input batch_size ..." naming no model
        ("batch_mean", "The model from 'user_models:batch_mean' returned scores of shape (10,) for targets of "
                       "shape (8,): one row of 10 scores per target is needed"),
    ],
)
def test_user_model_mistakes_exit_2_with_one_line(factory: str, message: str, models: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", *C, "--model", f"user_models:{factory}", "--out", str(models / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (models / "run").exists()


@pytest.mark.parametrize("spec, message", [
    ("failing_import:build", "Cannot load model factory 'failing_import:build': importing failing_import raised "
                             "RuntimeError: no GPU here. Fix the module, then run again."),
    (".rel:build", "Model factory '.rel:build' names a relative module: give the module's full name"),
    (":build", "Model factory ':build' names no module: give the module's full name"),
])
def test_a_factory_module_that_raises_or_a_relative_name_exits_2_with_one_line(
        spec: str, message: str, models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On main, each printed a Python traceback."""
    (models / "failing_import.py").write_text('raise RuntimeError("no GPU here")\n')
    assert main(["compare", *C, "--model", spec, "--out", str(models / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["compare", "inspect"])
def test_an_out_path_too_long_for_the_file_system_exits_2_with_one_line(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On main, a 300-character --out gave an OSError traceback (File name too long)."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--out", str(tmp_path / ("x" * 300))])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be a directory here (File name too long): give a shorter path" in err and "Traceback" not in err


def test_a_run_of_only_warm_up_steps_says_its_time_includes_them_and_planning_says_what_it_times(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """On main, --steps 1 reported the warm-up step as the median step time with no note."""
    # native compute: the runs are named alike on every CPU (auto adds a float32-compute run where bf16 is slow)
    assert main(["compare", "--model", "mlp", "--precision", "bf16", "--opt-level", "O1", "--compute", "native",
                 "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())
    assert "ms/step includes warm-up: no step after the first 2 was timed (run more steps)" in out
    # planning says what it times (on a busy machine it was 26 s of silence before the plan)
    assert captured.err.startswith("ampkit compare: planning: a first step of bf16 O1\n"
                                   f"ampkit compare: planning: timing {ESTIMATE_STEPS} steps of fp32, bf16 O1, in turn\n")


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
    *planning, last = capsys.readouterr().err.strip().splitlines()
    assert last == "ampkit compare: interrupted; results already written are kept."  # one line of its own
    assert all(line.startswith("ampkit compare: planning: ") for line in planning)


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


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
def test_sigterm_stops_compare_in_one_line_and_keeps_the_steps_taken(tmp_path: Path) -> None:
    import signal
    import subprocess
    import threading

    process = subprocess.Popen(
        [sys.executable, "-m", "ampkit.cli.main", "compare", *(a for a in C if a != "--quiet"), "--steps", "5000",
         "--out", str(tmp_path / "run")],  # its progress lines say when the runs have stepped
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    stepped = threading.Event()  # a progress line with a step taken: the runs have started (a fixed 8 s wait was
    # too short on a busy machine, where a CUDA build of torch took longer to import in each run)

    def read() -> None:
        for line in process.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if re.search(r"fp32 step [1-9]", line):
                stepped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert stepped.wait(timeout=240), "".join(lines)[-2000:]
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    reader.join(timeout=60)
    err = "".join(lines)
    assert process.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1] == "ampkit compare: terminated; results already written are kept."
    kept = json.loads((tmp_path / "run" / "results.json").read_text())  # the steps taken, not thrown away
    assert kept["incomplete"] and kept["runs"][0]["label"] == "fp32"
    assert 0 < kept["runs"][0]["steps_done"] == len(kept["runs"][0]["losses"]) < 5000


@pytest.mark.parametrize(
    "damage, message",
    [("empty", r"train-labels-idx1-ubyte is truncated: 0 bytes, not even a header"),
     ("gzip", r"train-images-idx3-ubyte.gz is not valid gzip"),
     ("directory", r"train-images-idx3-ubyte is a directory: put the IDX file itself there")],  # a traceback on main
)
def test_corrupt_mnist_files_are_named_with_steps(damage: str, message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import re

    _mnist(tmp_path, (28, 28), 9)
    if damage == "empty":
        (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"")
    elif damage == "directory":
        (tmp_path / "train-images-idx3-ubyte").unlink()
        (tmp_path / "train-images-idx3-ubyte").mkdir()
    else:
        (tmp_path / "train-images-idx3-ubyte").unlink()
        (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8bnot gzip")
    argv = ["compare", *C, "--batch-size", "4", "--data", f"mnist:{tmp_path}", "--out", str(tmp_path / "run")]
    assert main(argv) == 2  # with --steps, a 41-line traceback before
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err and err.count("\n") == 1


def test_an_empty_out_is_refused_not_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["compare", *C, "--out", ""])  # was: results.json and both PNGs written into the current directory
    assert exit_.value.code == 2 and "argument --out: '' is empty: give a directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_user_module_with_a_syntax_error_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "broken_models.py").write_text("def model(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["compare", *C, "--model", "broken_models:model", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "broken_models has a syntax error at" in err and "broken_models.py:1" in err and "Traceback" not in err


def test_the_probe_of_an_o3_stochastic_comparison_takes_plain_updates(fake_machine) -> None:  # type: ignore[no-untyped-def]
    from ampkit.experiment.settings import plan

    fake_machine({"matmul": 0.05, "conv": 0.05})  # auto computes in float32 here: a native probe is added
    configs = plan(model="mlp", precisions=["fp16"], opt_levels=["O3"], updates=["stochastic"], steps=2)
    probe = configs[-1]
    assert probe.probe and probe.opt_level == "O1" and probe.update == "plain"  # was update='stochastic' at O1
    assert [c.update for c in configs[1:-1]] == ["stochastic"]


def test_batch_norm_on_one_sample_names_the_batch_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--model", "resnet18", "--precision", "fp32", "--steps", "2", "--batch-size", "1", "--quiet",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2  # was BatchNorm's message alone, without the flag that caused it
    err = capsys.readouterr().err
    assert "Expected more than 1 value per channel" in err and "(--batch-size 1: batch norm needs at least 2" in err


def _finished_comparison(tmp_path: Path) -> tuple[Path, list[str]]:
    return tmp_path / "run", ["compare", *C, "--out", str(tmp_path / "run")]


def test_a_results_file_that_appears_during_the_run_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, argv = _finished_comparison(tmp_path)
    real = compare_cmd.compare

    def compare_while_someone_writes(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(*args, **kwargs)
        (out / "results.json").write_text("someone else's\n")  # appears while the runs train
        return result

    monkeypatch.setattr(compare_cmd, "compare", compare_while_someone_writes)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    assert (out / "results.json").read_text() == "someone else's\n"  # was overwritten at the end
    assert not (out / "curves.png").exists()  # all or nothing in that directory
    err = capsys.readouterr().err
    assert "results.json appeared during the run and is kept as it is; these results are in ampkit-runs" in err
    elsewhere = next((tmp_path / "ampkit-runs").iterdir())
    assert sorted(p.name for p in elsewhere.iterdir()) == ["curves.png", "results.json", "summary.png"]


def test_a_full_disk_at_the_end_writes_nothing_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    from ampkit.experiment import report

    out, argv = _finished_comparison(tmp_path)

    def no_space(comparison, path):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write_summary", no_space)  # the last of the three files
    assert main(argv) == 1  # was a traceback, with results.json and curves.png written and summary.png missing
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ampkit compare: cannot write the results in {out}: No space left on device; "
                              "nothing was written.")
    assert list(out.iterdir()) == []  # no half set, no temporary files


def test_corrupt_and_constant_mnist_files_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gzip

    _mnist(tmp_path, (28, 28), 9)
    images = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    packed = bytearray(gzip.compress(images))
    packed[20:28] = bytes(b ^ 0xFF for b in packed[20:28])  # a corrupt deflate stream (was zlib.error)
    (tmp_path / "train-images-idx3-ubyte").unlink()
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(bytes(packed))
    argv = ["compare", *C, "--batch-size", "4", "--data", f"mnist:{tmp_path}", "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "train-images-idx3-ubyte.gz is not valid gzip" in err and "Traceback" not in err

    flat = tmp_path / "flat"
    flat.mkdir()
    _mnist(flat, (28, 28), 9)
    header = (flat / "train-images-idx3-ubyte").read_bytes()[:16]
    (flat / "train-images-idx3-ubyte").write_bytes(header + bytes(12 * 28 * 28))  # all-zero images
    argv = ["compare", *C, "--batch-size", "4", "--data", f"mnist:{flat}", "--out", str(flat / "run")]
    assert main(argv) == 2  # was: every input NaN, reported as "diverged: lower --lr"
    assert "The training images are constant (every value 0)" in capsys.readouterr().err



def test_progress_is_plain_lines_where_the_output_is_no_terminal(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """On main, `ampkit compare > log` printed nothing until the table (about 5 minutes for the default job)."""
    argv = [arg for arg in C if arg != "--quiet"]
    assert main(["compare", *argv, "--steps", "3", "--out", str(tmp_path / "run")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ampkit compare [")]
    assert lines and all(re.match(r"ampkit compare \[\d+ s\]: fp32 step \d/3 loss \d", line) for line in lines)
    assert "step 3/3" in lines[-1] and lines[-1].count("step 3/3") == len(lines[-1].split("; "))


def test_the_plan_says_the_kernels_speeds_once_not_again_in_warnings(fake_machine, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The default comparison on an AVX2 CPU said the measured bf16 speeds three times before training: a warning from
    the float32-compute region the estimate steps, one from its native probe's, and the plan's own line."""
    from ampkit.hardware import flags
    from ampkit.precision import state

    fake_machine({"matmul": 0.02, "conv": 0.03})  # native bf16 slow: float32-compute runs and a native probe
    monkeypatch.setattr(state, "_warned", set())  # the regions warn once a process: as in a fresh one
    assert main(["compare", "--model", "mlp", "--precision", "bf16", "--opt-level", "O1", "--steps", "2",
                 "--batch-size", "8", "--quiet", "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    said = " ".join((captured.out + captured.err).split())
    assert "bf16 O1 native probe" in said and said.count("float32's speed") == 1, said
    assert "native bf16 kernels here run at conv 0.03x, matmul 0.02x float32's speed" in said
    assert f": {flags.native_support('cpu', torch.bfloat16)}." in said  # why, as the warning said it
    assert "fp32-compute runs keep tensors in 16 bits and compute GEMMs and convolutions in float32." in said
    assert "warning:" not in captured.err, captured.err
    # Native runs alone: the warning's advice is news there, and stays
    monkeypatch.setattr(state, "_warned", set())
    assert main(["compare", "--model", "mlp", "--precision", "bf16", "--opt-level", "O1", "--compute", "native",
                 "--steps", "2", "--batch-size", "8", "--quiet", "--out", str(tmp_path / "native")]) == 0
    assert "warning: native bfloat16 kernels run matmul at 0.02x" in capsys.readouterr().err


def test_the_plan_names_the_dtype_whose_kernels_it_measured_once(fake_machine) -> None:  # type: ignore[no-untyped-def]
    """An FP8 setting's model runs in bf16 on a CPU: the plan said "native fp8 kernels here run at" bf16's speeds,
    and the same line again for bf16."""
    import io

    from rich.console import Console

    from ampkit.experiment.cost import Estimate
    from ampkit.experiment.settings import plan

    fake_machine({"matmul": 0.5, "conv": 0.25})
    configs = plan(model="mlp", precisions=["bf16", "fp8"], steps=2, computes=["native"], probe=False)
    assert {c.precision for c in configs} == {"fp32", "bf16", "fp8"}
    out = io.StringIO()
    compare_cmd.print_plan(Console(file=out, width=400), configs,
                           Estimate(0.01, 0.005, 0.1, [0.01] * len(configs), {"bf16": 0.4, "fp8": 0.4}))
    lines = [line for line in out.getvalue().splitlines() if "kernels here run at" in line]
    assert len(lines) == 1 and "native bf16 kernels here run at conv 0.25x, matmul 0.5x" in lines[0], out.getvalue()
