"""`ampkit compare` end to end on tiny configurations, and its data loaders."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from ampkit.cli.main import main
from conftest import DEVICES
from ampkit.experiment import comparison, config, cost, data, report, settings
from ampkit.experiment.models import GPT, load_factory
from ampkit.experiment.config import RunConfig
from ampkit.experiment.training import execute

RUN_FIELDS = {f.name for f in dataclasses.fields(config.RunResult)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[comparison.Comparison, Path]:
    configs = settings.plan(model="resnet18", steps=3, batch_size=8)
    result = comparison.compare(configs)
    out = tmp_path_factory.mktemp("tiny")
    report.write_all(result, out)
    return result, out


@pytest.mark.parametrize(
    "speedups, labels",
    [
        # an AVX2-only CPU: float32 compute, and a native probe so the speed column stays honest
        ({"matmul": 0.013, "conv": 0.05}, ["fp32", "bf16 O1 fp32-compute", "bf16 O2 fp32-compute",
                                           "bf16 O1 native probe"]),
        ({"matmul": 2.0, "conv": 1.8}, ["fp32", "bf16 O1", "bf16 O2"]),  # AVX-512 BF16
        ({"matmul": 2.0, "conv": 0.5}, ["fp32", "bf16 O1 fp32-conv", "bf16 O2 fp32-conv", "bf16 O1 native probe"]),
    ],
)
def test_default_plan_follows_the_measured_hardware(fake_machine, speedups: dict[str, float],  # type: ignore[no-untyped-def]
                                                    labels: list[str]) -> None:
    fake_machine(speedups)
    configs = settings.plan()
    assert [c.label for c in configs] == labels
    runs = [c for c in configs if not c.probe]
    assert {c.steps for c in runs} == {2 * (1437 // 64)}  # two epochs of the digits train split
    assert len({dataclasses.replace(c, precision="", opt_level="") for c in runs}) == 1
    for probe in (c for c in configs if c.probe):
        assert probe.compute == "native" and probe.steps == settings.PROBE_STEPS and not probe.float32_compute


def test_forced_compute_modes_multiply_the_settings_without_a_probe(fake_machine) -> None:  # type: ignore[no-untyped-def]
    fake_machine({"matmul": 0.013, "conv": 0.05})
    configs = settings.plan(opt_levels=["O2"], computes=["native", "float32"], steps=2)
    assert [c.label for c in configs] == ["fp32", "bf16 O2", "bf16 O2 fp32-compute"]
    with pytest.raises(ValueError, match=r"Unknown compute mode 'fp8'. Choose from \['auto', 'native', 'float32'\]"):
        settings.plan(computes=["fp8"])


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
def test_results_json_has_every_field(tiny: tuple[comparison.Comparison, Path]) -> None:
    result, out = tiny
    saved = json.loads((out / "results.json").read_text())
    assert [run["label"] for run in saved["runs"]] == saved["config"]["settings"]
    assert saved["runs"][0]["label"] == "fp32" and {r["label"][:7] for r in saved["runs"][1:3]} == {"bf16 O1", "bf16 O2"}
    for run in saved["runs"]:
        assert RUN_FIELDS | {"ratio_to_fp32"} <= set(run)
        assert set(run["ratio_to_fp32"]) == set(comparison.RATIO_FIELDS)
        steps = settings.PROBE_STEPS if run["probe"] else 3
        assert run["steps"] == steps and len(run["losses"]) == steps and run["ms_per_step"] > 0
        assert ("fp32-" in run["label"]) == bool(run["float32_compute"])
        if run["probe"]:
            assert run["test_accuracy"] is None and run["ratio_to_fp32"]["test_accuracy"] is None
        else:
            assert 0 <= run["test_accuracy"] <= 1
    assert {"torch", "device_name", "cpu_native_bf16", "cpu_native_fp16", "measured_speedup"} <= set(saved["machine"])
    assert saved["runs"][0]["ratio_to_fp32"]["ms_per_step"] == 1.0
    assert saved["wall_s"] > 0


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
def test_each_warning_the_runs_print_is_shown_once() -> None:
    """On torch 2.11 (the GPU image's) every run of a comparison printed the shim's TorchVersionWarning and
    torchao's import noise: five runs, five copies. A warning another run printed is left out."""
    from ampkit.experiment.process import new_warnings

    version = "/a/overrides.py:226: TorchVersionWarning: torch 2.11.0 lacks it\n  _traceable = check()\n"
    noise = "Failed to load a library\n"
    other = "/b/training.py:9: UserWarning: only this run's\n  warn()\n"
    shown: set[str] = set()
    assert new_warnings(noise + version, shown) == noise + version
    assert new_warnings(noise + version + other + version, shown) == other
    assert new_warnings(version, shown) == ""
    # the host printed its own copy (raised elsewhere, printed as "warning: ..."): the runs' copies are left out
    import warnings

    from ampkit._torch import TorchVersionWarning
    from ampkit.experiment.process import warning_key

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("torch 2.11.0 lacks it", TorchVersionWarning)
    host = {warning_key(warning) for warning in caught}
    assert new_warnings(noise + version.replace("/a/overrides.py:226", "/a/_compile_torch.py:190"), host) == noise


def test_runs_step_in_lockstep_in_alternating_order() -> None:
    configs = [RunConfig(model="mlp", steps=3, batch_size=8),
               RunConfig(model="mlp", steps=3, batch_size=8, precision="bf16", opt_level="O2")]
    seen: list[tuple[str, int]] = []
    result = comparison.compare(configs, lambda label, step, total, loss: seen.append((label, step)))
    a, b = configs[0].label, configs[1].label
    assert seen == [(a, 1), (b, 1), (b, 2), (a, 2), (a, 3), (b, 3)]
    assert [run.label for run in result.runs] == [a, b] and all(run.steps == 3 for run in result.runs)


@pytest.mark.slow  # three comparisons of processes: 25 s here
def test_the_estimate_is_made_again_from_the_runs_own_first_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """After REVISE_AFTER steps of each run beyond its first: the time so far, each run's remaining steps at the
    median of its own (a slow step of one run moves nothing), and the evaluations. A run slowed by 0.2 s a step
    from its third step on: the revision counts its remaining steps at that pace, the plan could not."""
    import time

    from ampkit.experiment.process import RunProcess

    real_step = RunProcess.step

    def slowed(self: RunProcess) -> tuple[int, float]:
        if self.config.precision == "bf16" and self.steps_done >= 2:
            time.sleep(0.2)
        return real_step(self)

    monkeypatch.setattr(RunProcess, "step", slowed)
    steps = comparison.REVISE_AFTER + 11
    configs = [RunConfig(model="mlp", steps=steps, batch_size=8),
               RunConfig(model="mlp", steps=steps, batch_size=8, precision="bf16", opt_level="O2")]
    told: list[float] = []
    result = comparison.compare(configs, revise=told.append, evaluation_s=1.5)
    assert told == [result.revised_s]
    assert result.revised_s > 1.5 + 0.2 * (steps - comparison.REVISE_AFTER - 1)  # the slow run's remaining steps
    assert result.revised_s == pytest.approx(result.wall_s + 1.5, rel=0.5)  # the evaluations here are quick
    assert result.to_dict()["revised_s"] == result.revised_s
    short = comparison.compare([RunConfig(model="mlp", steps=comparison.REVISE_AFTER, batch_size=8)])
    assert short.revised_s is None  # too few steps to revise from


@pytest.mark.parametrize("device", DEVICES)
def test_peak_memory_counts_what_training_adds_not_torch_itself(device: str) -> None:
    """The memory column: peak resident memory on the CPU, torch.cuda.max_memory_allocated on CUDA,
    each above what was held before (a tensor already on the GPU is not training's)."""
    from ampkit.experiment.training import memory_baseline, peak_memory

    where = torch.device(device)
    held = torch.ones(16 * 2**20 // 4, device=where)  # there before the baseline: not counted
    baseline = memory_baseline(where)
    block = torch.ones(64 * 2**20 // 4, device=where)  # 64 MiB, touched
    added = peak_memory(where, baseline)
    del block
    assert 64 * 2**20 <= added < 96 * 2**20
    assert peak_memory(where, memory_baseline(where)) < 32 * 2**20  # a new baseline forgets the old peak
    del held


def test_the_estimate_costs_each_mixed_run_at_its_own_setting_s_step(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every run was costed at float32's step (or the kernels' throughput): a block-scaled GPT comparison said
    72 s and took 618 s. Each setting's own step is timed now (here replaced by known times)."""
    configs = settings.plan(model="mlp", precisions=["bf16"], opt_levels=["O1", "O2"],
                            steps=4, batch_size=8, probe=False)
    steps = {"bf16 O1 auto plain": 0.1, "bf16 O2 auto plain": 0.7}
    monkeypatch.setattr(cost, "_setting_stepper", lambda c, *args: lambda: (steps[cost._setting(c)], 0.0))
    estimate = cost.estimate(configs)
    assert estimate.setting_step_s == steps
    assert estimate.run_s[2] == pytest.approx(7 * estimate.run_s[1])  # the same steps and evaluation, 7x the step


def test_a_busy_moment_during_planning_does_not_decide_the_estimate(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Planned while other work took the cores for a moment, a comparison was estimated at 819 s and took 225 s: one
    slow timed step (a single step per mixed setting) set every run's cost. Each timing is now a median of steps
    taken in turn (here 3); one of each is 9x slower than the others."""
    configs = settings.plan(model="mlp", precisions=["bf16"], opt_levels=["O1"], steps=4, batch_size=8, probe=False)
    times = iter([0.5, 0.3,  # the warm-up steps: float32's, then bf16 O1's own model's
                  0.1, 0.9,  # then 3 rounds of a step each, in turn: float32, bf16 O1 (busy)
                  0.2, 0.9,  # bf16 O1, float32 (busy)
                  0.1, 0.2])  # float32, bf16 O1
    monkeypatch.setattr(cost, "ESTIMATE_STEPS", 3)
    monkeypatch.setattr(cost, "timed_step", lambda *args: (next(times), 0.01))
    estimate = cost.estimate(configs)
    assert next(times, None) is None  # every step above was timed, none more
    assert estimate.float32_step_s == 0.1
    assert estimate.setting_step_s == {"bf16 O1 auto plain": 0.2}
    assert estimate.run_s[1] == pytest.approx(2 * estimate.run_s[0])  # the same steps and evaluation, at 0.2 / 0.1


def test_the_estimate_counts_a_settings_slow_first_step_in_each_of_its_runs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 68: a block-scaled run's first step compiles its casts (4 to 11 s), which the estimate left out:
    compare's bf16 / MXFP8 / NVFP4 comparison took 1.4x its estimate. A setting's warm-up step beyond float32's first
    (at the setting's ratio) is counted once in each of its runs; here the bf16 O1 setting's first step is made 2 s
    slower, a step under the 5 s that marks a setting whose every step is slow."""
    real = cost._setting_stepper

    def slow_first(config, *args):  # type: ignore[no-untyped-def]
        stepper, calls = real(config, *args), []

        def step() -> tuple[float, float]:
            taken, forward = stepper()
            calls.append(1)
            return (taken + 2.0 if len(calls) == 1 and config.opt_level == "O1" else taken), forward

        return step

    monkeypatch.setattr(cost, "_setting_stepper", slow_first)
    configs = settings.plan(model="mlp", precisions=["bf16"], opt_levels=["O1", "O2"], computes=["native"], steps=4,
                            batch_size=8)
    estimate = cost.estimate(configs)
    assert estimate.first_extra_s["bf16 O1 native plain"] == pytest.approx(2.0, abs=0.5)
    assert estimate.first_extra_s["bf16 O2 native plain"] < 0.5
    o1, o2 = estimate.run_s[1:]
    assert o1 - o2 == pytest.approx(2.0, abs=0.5)


def test_estimate_scales_a_measured_float32_step(fake_machine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake_machine({"matmul": 0.05, "conv": 0.05})
    monkeypatch.setattr(cost, "_process_age_s", lambda: 3.0)  # this test process's import time, say
    monkeypatch.setattr(cost.os, "cpu_count", lambda: 2)
    configs = settings.plan(model="mlp", steps=4, batch_size=8)
    estimate = cost.estimate(configs)
    assert len(estimate.run_s) == len(configs) == 4 and estimate.float32_step_s > 0
    # the 4 runs start at once on 2 cores: each does what this process did before its first step (at most its CPU time)
    assert estimate.startup_s == pytest.approx(3.0 * 4 / 2)
    assert cost.estimate(configs[:1]).startup_s == pytest.approx(3.0)  # one run: no wait for a core
    assert estimate.native_speedup == {"bf16": pytest.approx(0.05)}
    fp32, probe = estimate.run_s[0], estimate.run_s[-1]
    # the report: results.json and two pictures of 4 runs, timed on stand-ins (a fraction of a second here)
    assert 0 < estimate.report_s < 10
    assert estimate.total_s == pytest.approx(estimate.startup_s + sum(estimate.run_s) + estimate.report_s)
    assert estimate.seeds_s(configs, 3) == pytest.approx(estimate.total_s + 2 * (estimate.startup_s + sum(
        estimate.run_s[:-1])))  # each seed starts and trains its runs again, the probe and the report once
    # the probe: its own native steps, timed here (not the 20x the measured kernels predict), no evaluation
    assert set(estimate.setting_step_s) == {"bf16 O1 auto plain", "bf16 O2 auto plain", "bf16 O1 native plain"}
    # each run's first step as much slower as float32's warm-up step here (none, where it was not slower: a CPU and
    # torch whose first step costs no more, as torch 2.11's CUDA build on an AVX-512 CPU measured)
    first = max(estimate.first_step_s - estimate.float32_step_s, 0.0)
    native = estimate.setting_step_s["bf16 O1 native plain"]
    assert probe == pytest.approx((settings.PROBE_STEPS + first / estimate.float32_step_s) * native
                                  + estimate.first_extra_s["bf16 O1 native plain"])
    # its 4 steps, then evaluation: the test set (360 digits, batch 8) and precise BN's batches, each a timed forward
    assert 0 < estimate.float32_forward_s < estimate.float32_step_s
    evaluation = (360 / 8 + config.PRECISE_BN_BATCHES) * estimate.float32_forward_s
    assert fp32 == pytest.approx(4 * estimate.float32_step_s + first + evaluation)


def test_runs_evaluate_one_after_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluations run in turn, as the steps do: together they would share the cores."""
    calls: list[tuple[str, str]] = []

    class FakeRun:
        def __init__(self, config: RunConfig) -> None:
            self.config, self.training = config, False

        def __enter__(self) -> FakeRun:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def finish(self) -> None:
            calls.append(("finish", self.config.label))

        def result(self, shown: set[str]) -> str:
            calls.append(("result", self.config.label))
            return self.config.label

    monkeypatch.setattr(comparison, "RunProcess", FakeRun)
    monkeypatch.setattr(comparison, "machine_summary", lambda device: {})
    configs = settings.plan(model="mlp", precisions=["fp32", "bf16"], computes=["float32"], steps=1)
    labels = [c.label for c in configs]
    assert comparison.compare(configs).runs == labels
    assert calls == [(call, label) for label in labels for call in ("finish", "result")]


def test_mixed_runs_save_fewer_bytes_for_backward(tiny: tuple[comparison.Comparison, Path]) -> None:
    result, _ = tiny
    fp32 = result.baseline.saved_for_backward_bytes
    assert fp32 > 0
    for run in result.runs[1:]:
        assert run.saved_for_backward_bytes < fp32


def test_pictures_are_valid_pngs(tiny: tuple[comparison.Comparison, Path]) -> None:
    _, out = tiny
    for name in ("curves.png", "summary.png"):
        raw = (out / name).read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 400
    assert not list(out.glob(".*"))  # no temporary files left behind


def test_same_seed_gives_the_same_float32_numbers() -> None:
    config = RunConfig(model="mlp", steps=4, batch_size=16)
    first, second = execute(config), execute(config)
    assert first.losses == second.losses
    assert first.test_accuracy == second.test_accuracy
    other = execute(dataclasses.replace(config, seed=1))
    assert other.losses != first.losses


def test_gpt_on_stdlib_text_runs() -> None:
    result = execute(RunConfig(model="gpt", data="text", steps=2, batch_size=2, precision="bf16", opt_level="O2"))
    assert result.losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.15)
    assert 0.0 <= result.test_accuracy <= 1.0


def test_fp16_run_reports_scaling() -> None:
    result = execute(RunConfig(model="mlp", steps=3, batch_size=8, precision="fp16", opt_level="O2"))
    # No growth within 3 steps (growth_interval 2000): every skipped step halved the scale once.
    assert result.final_loss_scale == 2.0**16 / 2**result.skipped_steps
    assert all(math.isfinite(loss) for loss in result.losses)


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
def test_console_script_json(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ampkit.cli.main", "compare", "--model", "mlp", "--steps", "3", "--batch-size", "8",
         "--out", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads((tmp_path / "run" / "results.json").read_text())
    assert "Plan: fp32, bf16 O1" in done.stderr and "Estimated" in done.stderr
    assert printed["estimated_s"] > 0


def test_existing_results_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results.json").write_text("{}")
    assert main(["compare", "--steps", "1", "--out", str(tmp_path)]) == 2
    assert "already holds results.json; ampkit never overwrites results" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == "{}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cuda"], "CUDA is not available here"),
        (["--device", "tpu"], "Unknown device 'tpu'"),
        (["--model", "vgg"], r"Unknown model 'vgg'. Choose one of \['gpt', 'gpt-outlier', 'gpt-overflow', 'mlp', 'resnet18'\]"),
        (["--data", "cifar"], "Unknown data 'cifar'. Choose one of"),
        (["--model", "nosuchmodule:make"], "Cannot load model factory 'nosuchmodule:make'"),
    ],
)
def test_bad_choices_exit_2_with_a_message(argv: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("CUDA is available here")
    assert main(["compare", "--out", str(tmp_path / "x"), *argv]) == 2
    assert message.replace("\\", "") in capsys.readouterr().err or pytest.fail(message)


def test_resnet18_stems() -> None:
    from ampkit.experiment.models import ResNet18

    x = torch.randn(2, 1, 28, 28)
    standard, small = ResNet18(), ResNet18(stem="small")
    assert standard(x).shape == small(x).shape == (2, 10)
    assert standard.pool(standard.conv1(x)).shape[-2:] == (7, 7)  # the paper's stem: 4x down before stage 1
    assert small.pool(small.conv1(x)).shape[-2:] == (28, 28)
    with pytest.raises(ValueError, match="Unknown ResNet-18 stem 'cifar'. Choose 'standard' or 'small'"):
        ResNet18(stem="cifar")


def test_user_model_factory_by_path() -> None:
    factory = load_factory("ampkit.experiment.models:MLP")
    assert factory(num_classes=10)(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert load_factory("gpt") is GPT


def test_forcing_slow_native_fp16_warns_with_the_measured_slowdown(fake_machine) -> None:  # type: ignore[no-untyped-def]
    from ampkit import SlowPrecisionWarning

    fake_machine({"matmul": 0.016, "conv": 0.05})
    with pytest.warns(SlowPrecisionWarning, match=r"native float16 kernels run matmul at 0.016x, conv at 0.05x"):
        settings.plan(precisions=["fp16"], computes=["native"], steps=1)


# -- MNIST IDX files -------------------------------------------------------------------


def _write_idx(path: Path, magic: int, array: torch.Tensor, gz: bool = False) -> None:
    header = struct.pack(">II", magic, array.shape[0])
    if magic == 2051:
        header += struct.pack(">II", *array.shape[1:])
    raw = header + bytes(array.to(torch.uint8).flatten().tolist())
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


@pytest.fixture
def mnist_dir(tmp_path: Path) -> Path:
    for split, n in (("train", 12), ("t10k", 5)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte", 2051, torch.randint(0, 256, (n, 28, 28)), gz=True)
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte", 2049, torch.randint(0, 10, (n,)))
    return tmp_path


def test_mnist_loads_gzipped_and_plain_files(mnist_dir: Path) -> None:
    dataset = data.load(f"mnist:{mnist_dir}")
    assert dataset.train_x.shape == (12, 1, 28, 28) and dataset.test_y.shape == (5,)


def test_mnist_missing_file(mnist_dir: Path) -> None:
    (mnist_dir / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte \(or t10k-labels-idx1-ubyte.gz\) is missing"):
        data.load(f"mnist:{mnist_dir}")


def test_mnist_truncated_file(mnist_dir: Path) -> None:
    path = mnist_dir / "train-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte has 17 bytes, its header promises 20: truncated"):
        data.load(f"mnist:{mnist_dir}")


def test_mnist_wrong_magic(mnist_dir: Path) -> None:
    _write_idx(mnist_dir / "train-labels-idx1-ubyte", 2051, torch.zeros(12, 1, 1))
    with pytest.raises(ValueError, match="has magic number 2051, expected 2049"):
        data.load(f"mnist:{mnist_dir}")


def test_mnist_corrupt_gzip(mnist_dir: Path) -> None:
    (mnist_dir / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8bnot gzip at all")
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz is not valid gzip"):
        data.load(f"mnist:{mnist_dir}")


def test_mnist_count_mismatch(mnist_dir: Path) -> None:
    _write_idx(mnist_dir / "t10k-labels-idx1-ubyte", 2049, torch.zeros(4))
    with pytest.raises(ValueError, match="MNIST test split: 5 images but 4 labels"):
        data.load(f"mnist:{mnist_dir}")


def test_mnist_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MNIST directory .*nope does not exist"):
        data.load(f"mnist:{tmp_path / 'nope'}")


def test_digits_split_is_fixed() -> None:
    a, b = data.load("digits"), data.load("digits")
    assert torch.equal(a.test_y, b.test_y) and a.train_x.shape == (1437, 1, 28, 28)


def test_a_failing_run_reports_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_models.py").write_text(
        "import sys\nprint('hello from the factory')\n"
        "def make(**kwargs):\n    sys.stderr.write('x' * 200_000)\n    raise RuntimeError('factory exploded')\n"
    )
    monkeypatch.chdir(tmp_path)  # the run's process imports the factory from its working directory
    with pytest.raises(RuntimeError, match=r"(?s)The fp32 run failed \(exit code 1\).*factory exploded"):
        comparison.compare([RunConfig(model="broken_models:make", steps=1)])


@pytest.mark.parametrize("precision", ["fp8", "fp8-current"])
def test_fp8_settings_train_the_mlp_with_fp8_linears(precision: str) -> None:
    if precision == "fp8-current":
        pytest.importorskip("torchao.float8")
    configs = settings.plan(model="mlp", precisions=[precision], opt_levels=["O2"], steps=2, batch_size=8,
                              probe=False)
    name = {"fp8": "fp8-delayed-hybrid", "fp8-current": "fp8-current-hybrid"}[precision]
    # compute auto: float32 for the op classes whose 16-bit kernels this machine measured slower (both, one, none)
    classes = configs[1].float32_compute
    option = "" if not classes else " fp32-compute" if len(classes) == 2 else f" fp32-{classes[0]}"
    assert [c.label for c in configs] == ["fp32", f"{name} O2{option}"]
    result = execute(configs[1])
    assert result.precision == precision and all(math.isfinite(loss) for loss in result.losses)


def test_fp8_is_refused_before_training_for_a_model_without_an_eligible_linear() -> None:
    with pytest.raises(ValueError, match=r"precisions=\['fp8'\]: resnet18 has no linear FP8 can take \(fc: kept: 512x10 "
                                         r"is not a multiple of 16\)"):
        settings.plan(model="resnet18", precisions=["fp8"])


def test_loss_scalings_and_o3_updates_multiply_the_settings_with_labels_saying_so() -> None:
    configs = settings.plan(model="mlp", precisions=["fp16"], opt_levels=["O1"], steps=2, batch_size=8,
                              loss_scales=["none", "static", "adaptive"], computes=["float32"])
    assert [c.label for c in configs] == ["fp32", "fp16 O1 fp32-compute no-scaling", "fp16 O1 fp32-compute "
                                          "static-scaling", "fp16 O1 fp32-compute adaptive-scaling"]
    configs = settings.plan(model="mlp", precisions=["bf16"], opt_levels=["O2", "O3"], updates=["plain", "kahan"],
                              steps=2, computes=["float32"])
    assert [c.label for c in configs][1:] == ["bf16 O2 fp32-compute", "bf16 O3 fp32-compute",
                                              "bf16 O3 fp32-compute kahan"]
    with pytest.raises(ValueError, match=r"updates=\['kahan'\] applies to O3 runs only: add opt_levels=\['O3'\]"):
        settings.plan(model="mlp", updates=["kahan"])
    # fp16 at O3 with torch's or torch-optimi's AdamW: float16 moments, the default eps 0 there (initialize refuses)
    with pytest.raises(ValueError, match=r"precisions=\['bf16', 'fp16'\] with opt_levels=\['O3'\] and "
                                         r"updates=\['kahan', 'plain'\]: fp16 at O3 keeps the runs' AdamW moments"):
        settings.plan(model="mlp", precisions=["bf16", "fp16"], opt_levels=["O3"], updates=["plain", "kahan"])
    assert [c.label for c in settings.plan(model="mlp", precisions=["fp16"], opt_levels=["O3"],
                                           updates=["stochastic"], computes=["float32"])][1:] == [
        "fp16 O3 fp32-compute stochastic"]
    with pytest.raises(ValueError, match=r"Unknown loss scaling 'global'. Choose from \['auto', 'none'"):
        settings.plan(model="mlp", loss_scales=["global"])
    configs = settings.plan(model="mlp", precisions=["bf16", "fp16"], opt_levels=["O1"], computes=["float32"],
                              loss_scales=["none", "dynamic"])  # bf16 needs no scaling: it runs once
    assert [c.label for c in configs][1:] == ["bf16 O1 fp32-compute", "fp16 O1 fp32-compute no-scaling",
                                              "fp16 O1 fp32-compute dynamic-scaling"]
    with pytest.raises(ValueError, match=r"loss_scales=\['dynamic'\] applies to fp16 runs only: add precisions=\['fp16'\]"):
        settings.plan(model="mlp", precisions=["bf16"], loss_scales=["dynamic"])


def test_loss_divisor_leaves_float32_training_as_it_was_and_makes_float16_need_loss_scaling() -> None:
    common = dict(model="mlp", steps=4, batch_size=8)
    plain = execute(RunConfig(**common))
    divided = execute(settings.plan(**common, precisions=["fp32"], loss_divisor=2**12)[0])
    # AdamW's eps is divided too, and a power of two divides exactly: the same run, bit for bit, reported undivided
    assert divided.losses == plain.losses and divided.final_train_loss == plain.final_train_loss
    fp16 = dict(common, precision="fp16", opt_level="O1", compute="float32", loss_divisor=2.0**16)
    unscaled = execute(RunConfig(**fp16, loss_scale="none"))
    scaled = execute(RunConfig(**fp16, loss_scale="dynamic"))
    # A fifth of the MLP's gradient values are zero in any precision (ReLUs that are off, constant pixels);
    # 2**16 times smaller, most of the others fall below float16's range too, unless the loss is scaled.
    zero = plain.zero_grad_fraction
    assert 0.1 < zero < 0.3
    assert unscaled.zero_grad_fraction > zero + 0.4
    assert scaled.zero_grad_fraction == pytest.approx(zero, abs=1e-3) and scaled.skipped_steps == 0


@pytest.mark.parametrize("divisor", [0, -4, 0.5, 1e20, 2.0**16 + 1, math.inf, math.nan])
def test_loss_divisor_must_be_from_1_to_65536(divisor: float) -> None:
    """1e20 was accepted on main: float32 trained to a loss of 1e16 and compare exited 0."""
    expected = rf"loss_divisor={re.escape(str(divisor))} is invalid: use a number from 1 to 65536 \(a batch up to"
    with pytest.raises(ValueError, match=expected + r" that many times larger\), e.g. loss_divisor=16"):
        settings.plan(model="mlp", loss_divisor=divisor)


@pytest.mark.parametrize("loss_scale, update", [("none", "plain"), ("adaptive", "plain"), ("auto", "kahan")])
def test_numerics_settings_train_and_report_state_bytes_and_zero_gradients(loss_scale: str, update: str) -> None:
    precision, level = ("bf16", "O3") if update != "plain" else ("fp16", "O2")
    config = RunConfig(model="mlp", steps=3, batch_size=8, precision=precision, opt_level=level, compute="float32",
                       loss_scale=loss_scale, update=update)
    result = execute(config)
    assert all(math.isfinite(loss) for loss in result.losses)
    assert (result.final_loss_scale is None) == (config.scaling == "none")  # auto: none for bf16
    assert 0.0 <= result.zero_grad_fraction < 0.5
    # AdamW: O2 keeps 16-bit weights, float32 gradients (the masters' own), float32 masters and moments (18 bytes
    # in all); O3 with Kahan 16-bit weights and gradients, 16-bit moments and a 16-bit compensation buffer (10).
    assert result.state_bytes / result.parameters == pytest.approx(18 if level == "O2" else 10, abs=0.1)


def test_learning_rate_schedule_decays_to_a_tenth() -> None:
    from ampkit.experiment.training import lr_factor

    factors = [lr_factor(step, 400) for step in range(401)]
    assert factors[0] == 1.0 and factors[200] == pytest.approx(0.55)
    assert all(a > b for a, b in zip(factors, factors[1:]))
    assert factors[-1] == pytest.approx(0.1)
    assert lr_factor(0, 1) == 1.0  # a one-step run trains at lr


def test_evaluation_of_a_model_with_inf_or_nan_outputs_reports_no_accuracy() -> None:
    from torch import nn

    from ampkit.experiment.training import evaluate

    dataset = data.load("digits")
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

    def batch(index: torch.Tensor, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        return dataset.test_x[index], dataset.test_y[index]

    assert evaluate(model, dataset, batch) is not None
    with torch.no_grad():
        model[1].bias[3] = float("nan")
    assert evaluate(model, dataset, batch) is None  # was: an accuracy from the argmax of NaN scores


def test_epochs_and_steps_together_are_refused() -> None:  # the CLI's parser refuses them as exclusive
    with pytest.raises(ValueError, match="epochs=1 and steps=3 both set the run's length: give one of them"):
        settings.plan(model="mlp", epochs=1, steps=3)


def test_an_out_under_a_file_is_refused_before_the_plan_times_anything(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Was: `--out results.json/run` passed the flag checks, the plan timed its steps, and only then did creating the
    directory fail."""
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["compare", "--steps", "1", "--out", str(tmp_path / "notes.txt" / "run")]) == 2
    err = capsys.readouterr().err
    assert f"cannot hold results: {tmp_path / 'notes.txt'} is a file" in err and "planning:" not in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_compile_reduce_overhead_compiles_every_run_with_cuda_graphs_and_the_estimate_counts_their_recording(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--compile reduce-overhead (issue 67: the host-overhead remedy users have): every run compiled with
    torch.compile's mode="reduce-overhead" (the probe stays eager), and the plan's compile estimate takes the steps
    that record the CUDA graphs as the compile's (here torch.compile is a stand-in: what is asked of it is checked)."""
    configs = settings.plan(model="mlp", steps=3, batch_size=8, compile="reduce-overhead", probe=True)
    assert [(c.compiled, c.compile_mode) for c in configs] == [(True, "reduce-overhead")] * 3 + [(False, "default")]
    asked: list[str] = []

    def stand_in(model: torch.nn.Module, mode: str = "default") -> torch.nn.Module:
        asked.append(mode)
        return model

    monkeypatch.setattr(torch, "compile", stand_in)
    execute(configs[1])
    assert asked == ["reduce-overhead"]
    timed: list[int] = []
    real = cost.timed_step
    monkeypatch.setattr(cost, "timed_step", lambda *args, **kwargs: timed.append(1) or real(*args, **kwargs))
    cost.estimate(configs[:1])
    plain = len(timed)
    timed.clear()
    cost.estimate([dataclasses.replace(configs[0], compile_mode="default")])
    assert asked[1:] == ["reduce-overhead", "default"] and plain - len(timed) == cost.CUDA_GRAPH_STEPS - 1


def test_the_nvfp4_ablation_settings_each_remove_one_part_of_the_recipe_and_plain_removes_all() -> None:
    """compare's NVFP4 settings (the ablation of benchmarks/bench_block_quality.py): the recipe has its four parts,
    each ``nvfp4-no-X`` lacks exactly its own, ``nvfp4-plain`` every one."""
    from ampkit.experiment.config import BLOCK_RECIPES, PRECISIONS

    parts = {"tiles": "weight_tiles", "sr": "stochastic_gradients", "hadamard": "hadamard", "kept": "keep_first_last"}

    def on(name: str) -> set[str]:
        return {part for part, field in parts.items() if getattr(BLOCK_RECIPES[name], field)}

    assert on("nvfp4") == set(parts) and on("nvfp4-plain") == set()
    for part in parts:
        assert on(f"nvfp4-no-{part}") == set(parts) - {part} and f"nvfp4-no-{part}" in PRECISIONS
    assert "nvfp4-plain" in PRECISIONS and BLOCK_RECIPES["nvfp4-plain"].format == "nvfp4"


def test_block_scaled_formats_without_opt_levels_run_at_o1_alone_and_at_both_when_asked() -> None:
    """Issue 68: ``compare --precision bf16 mxfp8 nvfp4`` ran seven runs, its emulated formats at O1 and O2 (272 s
    on a 2-core machine, the issue's bound 240): the block-scaled formats run at O1 alone unless levels are given."""
    def labels(**kwargs: Any) -> list[str]:
        configs = settings.plan(model="gpt", precisions=["bf16", "mxfp8", "nvfp4"], computes=["native"], steps=2,
                                **kwargs)
        return [c.label for c in configs]

    assert labels() == ["fp32", "bf16 O1", "bf16 O2", "mxfp8-rceil O1", "nvfp4 O1"]
    assert labels(opt_levels=["O1", "O2"]) == ["fp32", "bf16 O1", "bf16 O2", "mxfp8-rceil O1", "mxfp8-rceil O2",
                                               "nvfp4 O1", "nvfp4 O2"]
