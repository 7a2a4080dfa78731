"""Shared test parameters, skip marks (gpu, distributed, slow) and hardware fakes."""

from __future__ import annotations

import os
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# A private hardware cache for the whole run (subprocesses inherit it): the suite
# measures this machine once, as a user's first call would, and never touches the
# user's own cache.
os.environ["AMPKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="ampkit-test-cache-")
# hypothesis keeps its caches (constants, unicode tables) in ./.hypothesis unless told: the test command writes only
# in temporary folders (.ci/run checks the checkout). Read when hypothesis first stores something, after this.
os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = tempfile.mkdtemp(prefix="ampkit-test-hypothesis-")

import heartbeat  # noqa: E402
from ampkit.hardware import throughput  # noqa: E402



def pytest_configure(config: pytest.Config) -> None:
    heartbeat.register(config)  # a line while collection or a test runs long (tests/heartbeat.py)


_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def requires_cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test `gpu` (select them with `-m gpu`) and skip it where CUDA is absent."""
    return pytest.mark.gpu(_no_cuda(test))


# One device parametrization for every test that runs on both: the CUDA case is marked `gpu`
# (selected with `-m gpu`) and skips where CUDA is absent. Use: @pytest.mark.parametrize("device", DEVICES).
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, _no_cuda])]
AUTOCAST_DTYPES = {"cpu": torch.bfloat16, "cuda": torch.float16}  # torch.autocast's default dtype per device
LOW_DTYPES = [torch.bfloat16, torch.float16]


def fake_throughput(speedups: dict[str, float], device: str = "cpu") -> throughput.Throughput:
    """A measurement of a machine whose native 16-bit kernels run at ``speedups`` (op class ->
    speed over float32's, for both 16-bit dtypes); unnamed classes run at 1x."""
    _, name, key = throughput.device_key(device)
    times = {
        op: {"float32": 100.0, "bfloat16": 100.0 / speedups.get(op, 1.0), "float16": 100.0 / speedups.get(op, 1.0)}
        for op in throughput.OP_CLASSES
    }
    shapes = {op: list(shape) for op, shape in throughput.SHAPES[torch.device(device).type].items()}
    return throughput.Throughput(key, device, name, times, shapes, "2026-01-01T00:00:00", 0.0)


@pytest.fixture
def fake_machine(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., None]:
    """``fake_machine(speedups)``: this process and the subprocesses it starts see a machine
    whose native 16-bit kernels run at ``speedups`` (a hardware cache written for them)."""

    def install(speedups: dict[str, float]) -> None:
        monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        monkeypatch.setattr(throughput, "_memo", {})
        throughput._write_cache(fake_throughput(speedups))

    return install


# User model factories for `--model user_models:NAME`: good ones, and each mistake a user makes.
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

    def exits(num_classes):
        import sys
        sys.exit(0)

    def batch_mean(num_classes):  # one row of scores for the whole batch
        return nn.Sequential(nn.Flatten(0), nn.Linear(784 * 8, num_classes))

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
    """A folder holding user_models.py, on sys.path and PYTHONPATH (runs are subprocesses), as the cwd."""
    (tmp_path / "user_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return tmp_path



@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture()
def one_rank():  # type: ignore[no-untyped-def]
    """A gloo process group of this process alone, for fully_shard on a 1-rank mesh; destroyed after."""
    import socket
    import warnings

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's and DCP's notes on a 1-rank group
        yield
    dist.destroy_process_group()
