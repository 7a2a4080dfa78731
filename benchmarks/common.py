"""Shared helpers of the benchmark scripts: interleaved timing, medians, result files."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit.hardware import advice
from ampkit.files import atomic_write

RESULTS = Path(__file__).parent / "results"
# The environment variables that cap the instructions torch's own kernels (ATen) and oneDNN's use: with
# ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 a CPU with AVX-512 BF16 runs bf16 GEMMs as an AVX2-only one
# does (torch finds no native bf16 and a 512x512 bf16 matmul takes 0.015x float32's speed, as on an AVX2 CPU).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def interleaved_medians(
    variants: dict[str, Callable[[], Any]], warmup: int, repeats: int, budget_s: float | None = None,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each variant, timed in alternation.

    Alternating rather than running each variant in a block spreads the machine's
    slow moments over all of them, so the ratios hold on a noisy machine. The order
    is reversed every other round (A B C, C B A, ...): on one machine the variant
    that runs right after another was measured 1-2% slower (torch.autocast against
    itself: 1.014x), a position effect that a fixed order would book to one variant.

    With ``budget_s``, a variant leaves the rotation once its timed calls add up to
    that many seconds and it has been timed 3 times (a 16-bit kernel emulated in
    software can take tens of seconds a call); ``samples`` receives every timing
    (seconds, in round order).
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            spent = sum(times[name])
            if budget_s is not None and len(times[name]) >= 3 and spent >= budget_s:
                continue
            fn = variants[name]
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if samples is not None:
        samples.update(times)
    return {name: statistics.median(ts) for name, ts in times.items()}


def save(name: str, payload: dict[str, Any], directory: Path = RESULTS, device: str = "cpu") -> Path:
    """Write ``<directory>/<name>.json`` (``results/`` unless named) atomically, with the machine it ran on (and
    the GPU, for ``device="cuda"``)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    machine = advice.machine_summary(device)
    capped = {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}
    if capped:  # a CPU run with torch's and oneDNN's instruction sets capped: a record of another CPU kind
        machine["isa_caps"] = capped
    payload = {"machine": machine, "created": time.strftime("%Y-%m-%d %H:%M"), **payload}
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(payload, indent=2) + "\n"))
    return path


def paired_ratio_quartiles(times: list[float], reference: list[float]) -> list[float] | None:
    """The first and third quartiles of ``times[i] / reference[i]`` over the rounds of
    ``interleaved_medians`` (each round times every variant once): how far one run's ratio
    moves with the machine's noise. None when the two were not timed in the same rounds."""
    if len(times) != len(reference) or len(times) < 4:
        return None
    q1, _, q3 = statistics.quantiles([t / r for t, r in zip(times, reference)], n=4)
    return [q1, q3]


def timed_against(steps: dict[str, Callable[[], Any]], reference: str, repeats: int,
                  warmup: int = 2) -> dict[str, dict[str, Any]]:
    """Each of ``steps`` timed in alternation (``interleaved_medians``) and printed against ``reference``: per
    label, ``ms_per_step``, ``ratio`` (to the reference's median) and the ratio's ``quartiles`` over the rounds."""
    samples: dict[str, list[float]] = {}
    medians = interleaved_medians(steps, warmup=warmup, repeats=repeats, samples=samples)
    rows = {label: {"ms_per_step": s * 1e3, "ratio": s / medians[reference],
                    "quartiles": paired_ratio_quartiles(samples[label], samples[reference])}
            for label, s in medians.items()}
    for label, row in rows.items():
        print(f"{label:40s} {row['ms_per_step']:8.2f} ms  {row['ratio']:.3f}x {reference}")
    return rows

