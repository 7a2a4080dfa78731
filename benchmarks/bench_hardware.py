"""This machine's measured 16-bit speed and ampkit's recommendation from it.

Measures afresh (``throughput.measure(refresh=True)``, as `ampkit env` does on a
new machine) and keeps the figures, the flags that explain them and ``recommend()``
for the "What mixed precision buys on your hardware" page of the manual (docs/hardware.md).

    python benchmarks/bench_hardware.py   # writes benchmarks/results/hardware.json
"""

from __future__ import annotations

import dataclasses

import torch
from rich.console import Console

from ampkit.hardware import advice, flags, throughput
from common import save


def main() -> None:
    measured = throughput.measure("cpu", refresh=True)
    advice = advice.recommend("cpu")
    why = {str(d).removeprefix("torch."): flags.native_support("cpu", d) for d in (torch.bfloat16, torch.float16)}
    payload = {
        "measured": measured.to_dict(),
        "speedup": {op: {d: measured.speedup(op, d) for d in throughput.DTYPES} for op in throughput.OP_CLASSES},
        "why": why,
        "recommendation": {**dataclasses.asdict(advice), "dtype": str(advice.dtype)},
    }
    path = save("hardware", payload)
    console = Console()
    for op, speeds in payload["speedup"].items():
        console.print(f"{op}: " + ", ".join(f"{d} {s:.3g}x" for d, s in speeds.items()))
    console.print(f"measured in {measured.seconds:.2f} s; recommendation: {advice.dtype}, compute {advice.compute}")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
