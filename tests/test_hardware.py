"""Hardware: flags, the measured throughput and its cache, recommendations from measurements."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import pytest
import torch

from ampkit.hardware import advice, flags, throughput
from conftest import fake_throughput, requires_cuda


def test_report_reads_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    report = advice.report(measured=False)
    assert report.cpu_features["avx512_bf16"] and not report.cpu_features["avx512_fp16"]
    assert report.cpu_native_bf16 and not report.cpu_native_fp16
    assert report.torch_version == torch.__version__
    assert flags.native_support("cpu", torch.bfloat16) == "native (avx512_bf16)"
    assert flags.native_support("cpu", torch.float16).startswith("software-emulated (no avx512_fp16")


def test_measure_times_every_class_and_dtype_within_seconds() -> None:
    measured = throughput.measure("cpu", refresh=True)
    assert set(measured.time_us) == set(throughput.OP_CLASSES)
    for times in measured.time_us.values():
        assert set(times) == set(throughput.DTYPES) and all(t > 0 for t in times.values())
    assert measured.speedup("matmul", torch.float32) == 1.0
    assert measured.seconds < 10  # about a second on an idle 2-core CPU; generous for a loaded one
    assert f"{torch.get_num_threads()} threads" in measured.key and torch.__version__ in measured.key


def test_the_cache_is_read_by_the_next_process(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "_memo", {})
    stored = fake_throughput({"matmul": 0.5})
    throughput._write_cache(stored)
    monkeypatch.setattr(throughput, "_measure", lambda *a: pytest.fail("measured although cached"))
    assert throughput.measure("cpu") == stored
    saved = json.loads((tmp_path / "throughput-v1.json").read_text())
    assert saved["version"] == 1 and list(saved["entries"]) == [stored.key]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # written atomically


def test_a_corrupt_cache_is_measured_again(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "_memo", {})
    (tmp_path / "throughput-v1.json").write_text('{"version": 1, "entries": {"x": {"key": 3}}')  # truncated
    fresh = fake_throughput({"conv": 2.0})
    monkeypatch.setattr(throughput, "_measure", lambda *a: fresh)
    assert throughput.measure("cpu") == fresh
    assert json.loads((tmp_path / "throughput-v1.json").read_text())["entries"][fresh.key]["time_us"]


def test_another_thread_count_is_another_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    _, _, key = throughput.device_key("cpu")
    try:
        torch.set_num_threads(threads + 1)
        assert throughput.device_key("cpu")[2] != key
    finally:
        torch.set_num_threads(threads)


def test_a_cap_on_the_cpus_kernels_is_another_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI on an AVX-512 BF16 CPU made bf16 GEMMs 3x slower than float32 where they
    had run 4x faster, and the cache served the uncapped figures."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    key = throughput.device_key("cpu")[2]
    assert f"| {torch.backends.cpu.get_cpu_capability()} kernels |" in key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    capped = throughput.device_key("cpu")[2]
    assert capped != key and "oneDNN up to AVX512_CORE_VNNI" in capped


def test_an_unwritable_cache_warns_and_keeps_the_figures(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(throughput, "_memo", {})
    fresh = fake_throughput({})
    monkeypatch.setattr(throughput, "_measure", lambda *a: fresh)
    with pytest.warns(RuntimeWarning, match="Cannot write ampkit's hardware cache .*set AMPKIT_CACHE_DIR"):
        assert throughput.measure("cpu") == fresh
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert throughput.measure("cpu") == fresh  # kept for this process


def test_recommend_on_a_cpu_without_fast_16_bit_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(throughput, "measure", lambda device="cpu": fake_throughput({"matmul": 0.013, "conv": 0.05}))
    rec = advice.recommend("cpu")
    assert rec.dtype == torch.bfloat16 and rec.compute == "float32" and rec.fastest == "float32"
    assert "for speed alone, float32" in rec.reasons[0] and "matmul 0.013x, conv 0.05x" in rec.reasons[0]
    assert "software-emulated (no avx512_bf16 / amx_bf16)" in rec.reasons[0]
    assert "half the bytes" in rec.reasons[1]
    assert not rec.fp8_native and any(r.startswith("FP8: no FP8 matmuls here; ampkit.convert_to_fp8 emulates")
                                         for r in rec.reasons)
    assert any(r.startswith("MXFP8 / MXFP4 / NVFP4: native block-scaled GEMMs need compute capability 10.0")
               for r in rec.reasons)


def test_recommend_on_a_cpu_with_fast_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    slow_fp16 = fake_throughput({"matmul": 2.0, "conv": 1.8})
    slow_fp16.time_us["matmul"]["float16"] = 100.0 / 0.016
    monkeypatch.setattr(throughput, "measure", lambda device="cpu": slow_fp16)
    rec = advice.recommend("cpu", batch_size=4)
    assert rec.compute == "native" and rec.fastest == "bf16 native" and not rec.loss_scaling
    assert "native bfloat16 kernels run at matmul 2x, conv 1.8x" in rec.reasons[0]
    assert any("native float16 kernels run matmul at 0.016x" in w for w in rec.warnings)
    assert any("batch size 4 is small" in w for w in rec.warnings)


@pytest.mark.parametrize("capability, dtype", [((7, 0), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_recommended_dtype_by_compute_capability(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                                 dtype: torch.dtype) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert advice.recommend_dtype("cuda") == dtype


@requires_cuda
def test_report_lists_and_measures_the_gpu() -> None:
    report = advice.report()
    assert report.gpus and report.gpus[0].fp16_tensor_cores == (torch.cuda.get_device_capability(0) >= (7, 0))
    gpu = [m for m in report.measured if m.device.startswith("cuda")][0]
    if torch.cuda.get_device_capability(0) >= (8, 0):  # tensor cores: native 16-bit GEMMs beat float32
        assert gpu.native_is_faster("matmul", torch.bfloat16) and gpu.native_is_faster("matmul", torch.float16)


def test_a_cache_file_whose_entries_are_a_list_is_measured_again(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))  # a cache of its own: the suite's stays as measured
    monkeypatch.setattr(throughput, "_memo", {})
    throughput.cache_path().parent.mkdir(parents=True, exist_ok=True)
    throughput.cache_path().write_text(json.dumps({"version": throughput.CACHE_VERSION, "entries": []}))
    fresh = fake_throughput({"matmul": 2.0})
    monkeypatch.setattr(throughput, "_measure", lambda *a: fresh)
    assert throughput.measure("cpu") == fresh  # was: AttributeError in env, compare and inspect alike



@pytest.mark.parametrize(("speedup", "flags_native", "native"), [
    (0.95, True, True),    # float32 5% faster, inside a 10% noise: native bf16 flags keep native
    (0.80, True, False),   # beyond the noise: float32
    (1.05, False, False),  # 16-bit 5% faster inside the noise, on a CPU that emulates it: float32
    (1.30, False, True),   # beyond the noise: native
])
def test_the_compute_mode_never_flips_inside_the_measurements_noise(speedup: float, flags_native: bool,
                                                                   native: bool) -> None:
    """On main one measurement taken under load (a float32 conv at 47 ms for 0.7 ms) decided the mode for good,
    and two quiet ones, conv 1.05x and 0.90x, disagreed: a difference inside the noise flipped it."""
    measured = dataclasses.replace(fake_throughput({"conv": speedup}), noise={"conv": 0.10},
                                   native_flags={"bfloat16": flags_native})
    assert measured.native_is_faster("conv", torch.bfloat16) is native


def test_a_busy_measurement_serves_its_process_and_is_not_cached(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "_memo", {})
    busy = dataclasses.replace(fake_throughput({"conv": 5.7}), noise={op: 0.1 for op in throughput.OP_CLASSES})
    busy.noise["conv"] = 66.0  # a float32 conv timed at 47 ms between repeats of 0.7 ms
    tries = []
    monkeypatch.setattr(throughput, "_measure", lambda *a: tries.append(1) or busy)
    with pytest.warns(RuntimeWarning, match=r"while it was busy \(2 tries; conv's repeats spread 6600%"):
        assert throughput.measure("cpu") is busy
    assert len(tries) == 2 and not (tmp_path / "throughput-v1.json").exists()
    assert throughput.measure("cpu") is busy and len(tries) == 2  # this process keeps it


def test_the_cache_key_names_the_cpus_16_bit_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # throughput holds its own name for the reader: both are replaced, whatever this CPU has
    monkeypatch.setattr(flags, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.setattr(throughput, "cpu_flags", flags.cpu_flags)
    assert " | avx512_bf16 | " in throughput.device_key("cpu")[2]
    monkeypatch.setattr(flags, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(throughput, "cpu_flags", flags.cpu_flags)
    assert " | no 16-bit flags | " in throughput.device_key("cpu")[2]


def test_env_shows_the_figures_age_and_noise() -> None:
    from rich.console import Console

    from ampkit.cli.env import speed_table

    measured = dataclasses.replace(fake_throughput({"conv": 2.0}), noise={op: 0.04 for op in throughput.OP_CLASSES})
    console = Console(width=200)
    with console.capture() as captured:
        console.print(speed_table(measured))
    text = captured.get()
    assert "2026-01-01T00:00:00 (" in text and " ago)" in text and "noise" in text and "4%" in text
