"""Shared test parameters and skip marks (gpu, distributed, slow)."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LOW_DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
