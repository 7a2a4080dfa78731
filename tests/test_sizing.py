"""`ampkit compare --size` (``experiment/sizing.py``): a size that fits the device, chosen from measured rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ampkit.cli.main import main
from ampkit.experiment import sizing
from ampkit.experiment.settings import plan

GIB = 2**30
# A GPT's sizes as counted here (FLOPs of a float32 step's GEMMs; a float32 run's bytes), rounded
GPT = [sizing.Rung("small", {"matmul": 5.2e9}, int(0.04 * GIB)),
       sizing.Rung("medium", {"matmul": 3.1e11}, int(0.74 * GIB)),
       sizing.Rung("large", {"matmul": 5.0e12}, int(5.8 * GIB))]


def test_a_device_whose_gemms_are_fast_grows_the_size_until_float32s_step_is_arithmetic_bound() -> None:
    # a GPU: 50 TFLOP/s float32 GEMMs, a 9 ms small step nearly all per-op work
    chosen = sizing.choose(GPT, step_s=0.009, rates={"matmul": 5e13}, free_bytes=78 * GIB, processes=5, steps=400)
    assert chosen.name == "large" and "arithmetic-bound" in chosen.why
    assert "at large an estimated 100 ms (92%)" in chosen.why


def test_a_device_whose_gemms_are_slow_keeps_the_small_size() -> None:
    # a 2-core CPU: 170 GFLOP/s, the small step 70% GEMMs; a medium run would take minutes
    chosen = sizing.choose(GPT, step_s=0.044, rates={"matmul": 1.7e11}, free_bytes=20 * GIB, processes=3, steps=400)
    assert chosen.name == "small" and "30.6 ms of a 44 ms step" in chosen.why


def test_the_size_is_bounded_by_the_free_memory_of_the_runs_together() -> None:
    chosen = sizing.choose(GPT, step_s=0.009, rates={"matmul": 5e13}, free_bytes=24 * GIB, processes=5, steps=400)
    assert chosen.name == "medium" and "the largest that fits" in chosen.why  # large: 5 runs of 5.8 GiB, x1.5


def test_a_sizes_flops_are_counted_from_its_step() -> None:
    counted = sizing.rung("mlp", "digits", "small", torch.device("cpu"))
    batch, weights = 64, 784 * 512 + 512 * 512 + 512 * 10
    # forward and weight gradients 2 FLOPs per multiply-add each; input gradients for all but the first layer
    assert counted.flops == {"matmul": 6 * batch * weights - 2 * batch * 784 * 512}
    assert sizing.rung("mlp", "digits", "medium", torch.device("cpu")).flops["matmul"] > 30 * counted.flops["matmul"]


def test_plan_sizes_the_model_and_batch_and_a_users_model_keeps_its_own() -> None:
    small, large = plan(model="gpt", size="small")[0], plan(model="gpt", size="large")[0]
    assert (small.batch_size, large.batch_size, small.steps, large.steps) == (32, 128, 400, 400)
    images = plan(model="resnet18", size="large")[0]
    assert (images.batch_size, images.steps) == (1024, 44)  # the small size's steps at a larger batch
    with pytest.raises(ValueError, match="size='large' sets a built-in model's width"):
        plan(model="ampkit.experiment.models:MLP", size="large")
    with pytest.raises(ValueError, match=r"Unknown size 'huge'. Choose one of \['auto', 'small', 'medium', 'large'\]"):
        plan(model="gpt", size="huge")


def test_compare_at_a_size_trains_that_model_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--model", "mlp", "--precision", "bf16", "--opt-level", "O1", "--steps", "3", "--no-probe",
            "--quiet"]
    assert main([*argv, "--size", "medium", "--out", str(tmp_path / "medium")]) == 0
    assert main([*argv, "--out", str(tmp_path / "small")]) == 0
    medium, small = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("medium", "small"))
    assert medium["config"]["size"] == "medium" and medium["config"]["batch_size"] == 256
    assert medium["runs"][0]["parameters"] == 784 * 2048 + 2048 + 2048 * 2048 + 2048 + 2048 * 10 + 10
    assert small["runs"][0]["parameters"] == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert "size medium" in " ".join(capsys.readouterr().out.split())


def test_auto_sizes_the_model_from_what_it_measures_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto's wiring: the small step and the GEMM rates it measures (given here: a GPU's, then a CPU's), the GPT's
    sizes counted from their steps, the free memory (given too); a model of your own keeps its own."""
    sizing.auto.cache_clear()
    monkeypatch.setattr(sizing, "_available_cpu_bytes", lambda: 78 * GIB)  # this CPU stands in for an 80 GB GPU
    monkeypatch.setattr(sizing, "_float32_step_s", lambda *args: 0.009)
    monkeypatch.setattr(sizing, "measured_rates", lambda device: {"matmul": 5e13})
    chosen = sizing.auto("gpt", "text", torch.device("cpu"), 3, 400)
    assert chosen.name == "large" and "of a 9 ms step here" in chosen.why
    sizing.auto.cache_clear()
    monkeypatch.setattr(sizing, "_float32_step_s", lambda *args: 0.044)
    monkeypatch.setattr(sizing, "measured_rates", lambda device: {"matmul": 1.7e11})
    assert sizing.auto("gpt", "text", torch.device("cpu"), 3, 400).name == "small"
    assert sizing.auto("ampkit.experiment.models:MLP", "digits", torch.device("cpu"), 3, 44).name == "small"
    sizing.auto.cache_clear()
