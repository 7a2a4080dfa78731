"""The `ampkit` console script: parsing, output and exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    done = subprocess.run(
        [sys.executable, "-m", "ampkit.cli.main", "ops"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "conv2d" in done.stdout
