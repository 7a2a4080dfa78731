"""Hardware report and recommendations."""

from __future__ import annotations

import pytest
import torch

from ampkit import hardware
from conftest import requires_cuda


def test_report_reads_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    report = hardware.report()
    assert report.cpu_features["avx512_bf16"] and not report.cpu_features["avx512_fp16"]
    assert report.cpu_native_bf16 and not report.cpu_native_fp16
    assert report.torch_version == torch.__version__


def test_recommend_on_a_cpu_without_fp16_warns_about_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    advice = hardware.recommend("cpu", batch_size=4)
    assert advice.dtype == torch.bfloat16 and advice.opt_level == "O2" and not advice.loss_scaling
    assert any("float16 on this CPU is emulated" in w for w in advice.warnings)
    assert any("batch size 4 is small" in w for w in advice.warnings)


def test_recommend_on_a_cpu_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    assert any("no native bfloat16" in w for w in hardware.recommend("cpu").warnings)


@pytest.mark.parametrize("capability, dtype", [((7, 0), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_recommended_dtype_by_compute_capability(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                                 dtype: torch.dtype) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert hardware.recommend_dtype("cuda") == dtype


@requires_cuda
def test_report_lists_the_gpus() -> None:
    report = hardware.report()
    assert report.gpus and report.gpus[0].fp16_tensor_cores == (torch.cuda.get_device_capability(0) >= (7, 0))
