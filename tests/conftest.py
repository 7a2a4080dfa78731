"""Shared test parameters, skip marks (gpu, distributed, slow) and hardware fakes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import pytest
import torch

# A private hardware cache for the whole run (subprocesses inherit it): the suite
# measures this machine once, as a user's first call would, and never touches the
# user's own cache.
os.environ["AMPKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="ampkit-test-cache-")

from ampkit.hardware import throughput  # noqa: E402

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def requires_cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test `gpu` (select them with `-m gpu`) and skip it where CUDA is absent."""
    return pytest.mark.gpu(_no_cuda(test))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
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


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
