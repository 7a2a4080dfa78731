"""The examples run and learn."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import ampkit

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


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
@pytest.mark.distributed
def test_train_fsdp_example_shards_half_the_weights_and_its_checkpoint_loads_in_one_process(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    import ampkit
    from ampkit.distributed import load_sharded_checkpoint
    from ampkit.experiment.models import GPT
    from multiprocess import free_port

    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(EXAMPLES / "train_fsdp.py"), "--steps", "4", "--batch-size", "4", "--context", "32", "--json",
         "--reduce-dtype", "bf16", "--checkpoint", str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    model = GPT(vocab_size=256, context=32)
    total = sum(p.numel() for p in model.parameters())
    assert summary["world_size"] == 2 and summary["reduce_dtype"] == "torch.bfloat16"
    assert abs(summary["parameters_per_rank"] - total / 2) <= 0.01 * total  # each rank holds half
    assert summary["bytes_sent_per_rank"] > 0 and summary["final_loss"] < summary["first_loss"]
    optimizer = torch.optim.AdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    extra = load_sharded_checkpoint(tmp_path / "ck", model, optimizer, scaler=ampkit.DynamicLossScaler())
    assert extra == {"step": 4}
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the trained weights arrived


@pytest.mark.slow  # two Trainer runs of 20 steps: about 12 s here
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_trainer_example_trains_a_llama_at_o2_within_2_percent_of_float32(tmp_path: Path, dtype: str) -> None:
    """transformers' Trainer, given the model and optimizer ampkit.initialize returns (issue 39's recipe); float16
    with ampkit's loss scaler installed in the Trainer's Accelerator."""
    losses = _load("trainer_llama").main(["--opt-level", "O2", "--dtype", dtype, "--steps", "20", "--out",
                                          str(tmp_path)])
    ours = losses[f"{dtype} O2"]
    assert len(ours) == len(losses["fp32"]) == 4 and ours[-1] < ours[0] - 1.0  # it learns
    assert abs(ours[-1] - losses["fp32"][-1]) <= 0.02 * losses["fp32"][-1]


def test_the_trainer_skips_overflowed_float16_steps_and_their_schedule_steps(tmp_path: Path) -> None:
    """A scale that overflows float16 at first: the Trainer's steps are skipped (their learning-rate steps too)
    until the scale fits, then it trains; the Trainer's Accelerator holds ampkit's scaler, so its checkpoints
    keep it."""
    example = _load("trainer_llama")
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**20)
    losses, trainer = example.train(example.llama(), "O2", 10, str(tmp_path), torch.float16, scaler)
    assert trainer.accelerator.scaler is scaler
    assert 0 < scaler.stats.skipped < 10 and scaler.stats.steps == 10 - scaler.stats.skipped
    assert trainer.lr_scheduler.last_epoch == scaler.stats.steps  # the schedule moved on taken steps only
    assert losses[-1] < losses[0]


def test_trainer_example_at_o1(tmp_path: Path) -> None:
    losses = _load("trainer_llama").main(["--opt-level", "O1", "--steps", "5", "--out", str(tmp_path)])
    assert abs(losses["bf16 O1"][-1] - losses["fp32"][-1]) <= 0.02 * losses["fp32"][-1]
