"""`inspect_numerics` overhead and an example report.

Times the hooks-based report on ResNet-18 (1x28x28, batch 64, digits) against one
plain float32 training step, alternating, and keeps the report (JSON) and its
gradient histogram (PNG) under benchmarks/results/ as the example in BENCHMARKS.md.

    python benchmarks/bench_inspect.py
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ampkit.experiment.data import load
from ampkit.experiment.models import ResNet18
from ampkit.diagnostics.memory import estimate_memory
from ampkit.diagnostics.numerics import inspect_numerics, write_histogram
from common import RESULTS, interleaved_medians, save


def main() -> None:
    data = load("digits")
    x, y = data.train_x[:64], data.train_y[:64]
    torch.manual_seed(0)
    model = ResNet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    medians = interleaved_medians({"train_step": train_step, "inspect": lambda: inspect_numerics(model, x, y)},
                                  warmup=1, repeats=7)
    report = inspect_numerics(model, x, y)
    write_histogram(report, RESULTS / "inspect_grad_histogram.png")
    memory = estimate_memory(model, x, "O2")
    path = save("inspect", {
        "model": "resnet18", "data": "digits", "batch_size": 64,
        "ms": {k: v * 1e3 for k, v in medians.items()},
        "overhead_ratio": medians["inspect"] / medians["train_step"],
        "report": dataclasses.asdict(report),
        "memory": dataclasses.asdict(memory),
    })
    print(f"inspect {medians['inspect'] * 1e3:.0f} ms vs train step {medians['train_step'] * 1e3:.0f} ms: "
          f"{medians['inspect'] / medians['train_step']:.2f}x; wrote {path}")


if __name__ == "__main__":
    main()
