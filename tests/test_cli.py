"""The `ampkit` console script: parsing, output and exit codes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampkit.cli.main import main


def test_ops_prints_the_three_lists(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ops", "--device", "cuda", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "cuda, torch.bfloat16" in out
    for word in ("allow", "deny", "infer", "layer_norm", "scatter_add"):
        assert word in out


def test_ops_rejects_unknown_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["ops", "--device", "tpu"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    # This interpreter's console script first: a venv run by its path without being activated has another on PATH.
    beside = Path(sys.executable).parent / "ampkit"
    script = str(beside) if beside.exists() else shutil.which("ampkit")
    assert script is not None, "no ampkit console script beside this python or on PATH"
    done = subprocess.run([script, "ops"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "conv2d" in done.stdout


def test_env_prints_cpu_features_on_a_cpu_only_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "avx512_bf16=" in out and "Recommended on" in out
    assert "Measured on" in out and "matmul (256)" in out and "compute" in out


def test_env_json(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    assert main(["env", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert set(payload) == {"hardware", "recommendation"} and "cpu_features" in payload["hardware"]


def test_inspect_json_and_histogram(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import json

    assert main(["inspect", "--model", "mlp", "--batch-size", "8", "--out", str(tmp_path), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["numerics"]["modules"][0]["name"] == "net.0"
    assert payload["memory"]["mixed"]["master_weights"] > 0
    assert (tmp_path / "grad_histogram.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["inspect", "--model", "mlp", "--out", str(tmp_path)]) == 2  # never overwrites
    assert "exists; ampkit never overwrites" in capsys.readouterr().err


def test_inspect_table_with_nonfinite_search(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["inspect", "--model", "mlp", "--batch-size", "4", "--out", str(tmp_path),
                 "--find-nonfinite", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "Memory estimate" in out and "First inf/NaN under bf16 (compute: " in out and "): none" in out


def test_inspect_fp8_shows_each_linears_casts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "mlp", "--fp8", "--batch-size", "8", "--out", str(tmp_path / "i")]) == 0
    out = capsys.readouterr().out
    assert "FP8 casts per linear" in out
    rows = [line for line in out.splitlines() if "E5M2" in line]
    assert len(rows) == 3 and all("gradient" in row for row in rows)  # one output gradient per linear, hybrid


def test_inspect_block_scaled_shows_each_linears_casts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "mlp", "--block-scaled", "mxfp4", "--batch-size", "32", "--out",
                 str(tmp_path / "i")]) == 0
    out = capsys.readouterr().out
    assert "Block-scaled casts per linear" in out
    rows = [line for line in out.splitlines() if "mxfp4-floor" in line]
    assert len(rows) == 9 and sum("weight" in row for row in rows) == 3  # input, weight, gradient per linear


def test_library_errors_name_parameters_and_the_cli_shows_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from ampkit.cli.flags import as_flags
    from ampkit.experiment.settings import plan

    with pytest.raises(ValueError, match=r"^batch_size=0 is invalid"):
        plan(model="mlp", batch_size=0)
    assert main(["compare", "--model", "mlp", "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.startswith("ampkit compare: error: --batch-size 0 is invalid")
    assert as_flags("updates=['kahan', 'stochastic'] applies to O3 runs only: add opt_levels=['O3']") == (
        "--update kahan stochastic applies to O3 runs only: add --opt-level O3")
    assert as_flags("out='/tmp/run' cannot hold results. Pass out=DIR.") == (
        "--out /tmp/run cannot hold results. Pass --out DIR.")


# -- bad input (moved from test_bad_input.py) ----------------------------------------


@pytest.mark.parametrize("batch", ["0", "-1", "100000"])
def test_inspect_batch_sizes_are_checked(batch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 0 used 32, -1 used train_x[:-1], a huge value claimed a batch it did not use
    assert main(["inspect", "--model", "mlp", "--batch-size", batch, "--out", str(tmp_path / "out")]) == 2
    assert f"--batch-size {batch} is invalid: use 1 to 1437" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # a refused command leaves no folder (it left an empty one)


def test_a_refused_inspect_leaves_no_folder_in_the_default_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "--model", "hf:unknown"]) == 2
    assert "Unknown transformers architecture 'hf:unknown'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # was: ampkit-runs/inspect-<time>/, empty


def test_inspect_memory_estimate_counts_the_batch_not_the_dataset(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "mlp", "--batch-size", "8", "--out", str(tmp_path), "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    # 8 digits are 8 x 784 float32 inputs: 25 KB, not the 4.4 MiB of the whole training set
    assert memory["float32"]["activations"] < 64 * 1024


def test_inspect_takes_a_custom_text_model_as_compare_does(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--model", "user_models:tiny_lm", "--data", "text", "--batch-size", "2",
                 "--out", str(models / "inspect"), "--json"]) == 0  # was refused: "text goes with gpt only"
    assert json.loads(capsys.readouterr().out)["numerics"]["modules"][0]["name"] == "embed"


def test_inspect_json_is_strict_where_float32_itself_is_broken(tmp_path: Path, models: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (models / "nan_models.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def nan_mlp(num_classes=10):\n"
        "    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, num_classes))\n"
        "    with torch.no_grad():\n        model[3].bias[0] = float('nan')\n    return model\n")
    assert main(["inspect", "--model", "nan_models:nan_mlp", "--batch-size", "8", "--out", str(tmp_path),
                 "--json"]) == 0
    out = capsys.readouterr().out

    def refuse(constant: str) -> None:
        raise AssertionError(f"bare {constant} in --json output")

    payload = json.loads(out, parse_constant=refuse)  # was: bare NaN, which is not JSON
    assert payload["non_finite"] and all(": nan" in entry or ": inf" in entry for entry in payload["non_finite"])


def test_inspect_checks_its_out_and_the_model_before_the_work(tmp_path: Path, models: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a_file").write_text("not a directory")
    assert main(["inspect", "--model", "mlp", "--out", str(tmp_path / "a_file" / "sub")]) == 2
    assert "--out " in capsys.readouterr().err  # was: a failure only after all the work was done
    assert main(["inspect", "--model", "user_models:tuple_output", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err  # was AttributeError; compare refuses the same model cleanly
    assert "returned a tuple; ampkit compare needs one tensor of class scores" in err and "Traceback" not in err



def test_help_says_what_each_command_does_and_the_defaults_of_compares_settings(capsys) -> None:  # type: ignore[no-untyped-def]
    """On main, `inspect --help` and `env --help` gave no description, and `compare --help` showed no help or
    default for --batch-size, --epochs, --steps, --lr and --seed."""
    texts = {}
    for command in ("compare", "inspect", "env"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        texts[command] = " ".join(capsys.readouterr().out.split())
    assert "value ranges" in texts["inspect"] and "measured speed of its 16-bit kernels" in texts["env"]
    for flag, default in (("--batch-size", "64 for images"), ("--epochs", "2 for images"),
                          ("--steps", "400 for gpt"), ("--lr", "0.002 for images"), ("--seed", "0")):
        assert re.search(rf"{flag} \S+ (?:(?! --).)*?\(default:? {default}", texts["compare"]), flag


@pytest.mark.parametrize("model", ["resnet18", "hf:llama"])
def test_inspect_reads_whole_at_80_columns_and_advises_no_padding_without_a_gpu(capsys, monkeypatch,  # type: ignore[no-untyped-def]
                                                                                  tmp_path, model: str) -> None:
    """On main, at 80 columns module names were cut ("layers.0.shor..."), and a CPU-only machine was told to pad
    dimensions for tensor cores it does not have. Later a transformers model's longer names cut every figure
    ("0…"), and the memory table cut its headers and wrapped its totals on any model."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["inspect", "--model", model, "--batch-size", "8", "--out", str(tmp_path / "inspect")]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    assert re.search(r" setting +weights +gradients +weights +states +activations +total", out)
    assert re.search(r"\n float32( +\d+\.\d){6} *\n", out)  # one line a setting, a figure a column
    names = []  # each row's name, a name folded onto more lines joined again; every row's six figures whole
    rows = re.split(r"\n *\n", re.split(r"─+ *\n", out, maxsplit=1)[1], maxsplit=1)[0]  # from the rule to a blank line
    for line in rows.splitlines():
        name, *figures = line.split()
        if figures:
            assert len(figures) == 6 and all(re.fullmatch(r"-|[\d.e+-]+%?", f) for f in figures), line
            names.append(name)
        else:
            names[-1] += name
    assert ("layers.0.shortcut" if model == "resnet18" else "model.model.layers.1.post_attention_layernorm") in names
    if not torch.cuda.is_available():
        words = " ".join(out.split())
        assert "this machine has none, so nothing to change here" in words and "-> pad to" not in words


def test_a_warning_is_a_line_of_the_commands_own(fake_machine, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`ampkit inspect` printed Python's form: ``/path/bin/ampkit:8: ComputeModeWarning: ...`` and
    ``sys.exit(main())`` under it."""
    import warnings

    from ampkit.precision import state

    fake_machine({"matmul": 0.02, "conv": 0.03})  # bf16 slow here: the region computes in float32, and says so
    monkeypatch.setattr(state, "_warned", set())  # the regions warn once a process: as in a fresh one
    shown = warnings.showwarning
    assert main(["inspect", "--model", "mlp", "--batch-size", "8", "--out", str(tmp_path), "--json"]) == 0
    err = capsys.readouterr().err
    assert "warning: ampkit computes conv and matmul in float32 on bfloat16 values" in err, err
    assert "ComputeModeWarning" not in err and "sys.exit" not in err
    assert warnings.showwarning is shown  # put back after the command
