"""Shared test parameters and skip marks (gpu, distributed, slow)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def requires_cuda(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test `gpu` (select them with `-m gpu`) and skip it where CUDA is absent."""
    return pytest.mark.gpu(_no_cuda(test))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LOW_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
