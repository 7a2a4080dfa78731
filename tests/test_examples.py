"""The examples run and learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_train_example_learns_the_digits(level: str) -> None:
    accuracy = _load("train").main(["--opt-level", level, "--epochs", "2"])
    assert accuracy > 0.93


def test_train_example_fp16_with_loss_scaling(capsys: pytest.CaptureFixture[str]) -> None:
    accuracy = _load("train").main(["--opt-level", "O2", "--dtype", "fp16", "--epochs", "1"])
    assert accuracy > 0.8
    assert "skipped steps" in capsys.readouterr().out


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
@pytest.mark.distributed
def test_train_ddp_example_under_torchrun_halves_the_bytes() -> None:
    import json
    import subprocess
    import sys

    from multiprocess import free_port

    sent = {}
    for compression in ("none", "fp16"):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
             str(EXAMPLES / "train_ddp.py"), "--steps", "3", "--batch-size", "8", "--json",
             "--compression", compression],
            capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary["world_size"] == 2 and summary["overflows"] == 0
        sent[compression] = summary["bytes_sent_per_rank"]
    assert sent["fp16"] * 2 == sent["none"]
