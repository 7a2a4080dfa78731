"""Autocast overhead: ampkit's policies against torch.autocast, measured in one run.

Training steps of ResNet-18 (1x28x28, batch 64) and a small GPT (4 layers, d=384,
context 256, batch 8) on the CPU in float32, torch.autocast bf16, ampkit's default
bf16 policy and an edited policy; ms/step (median after warm-up, variants timed in
alternation), bytes saved for backward and ratios to torch.autocast. Then the
per-op overhead over 10,000 small linears, and float16 vs float32 matmul speed.

    python benchmarks/bench_autocast.py   # writes benchmarks/results/autocast.json
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import ampkit
from ampkit.experiment.models import GPT, ResNet18
from ampkit.memory import saved_bytes_of_step
from common import interleaved_medians, save

EDITS = {
    "resnet18": {"infer": ["add"], "deny": ["adaptive_avg_pool2d"]},
    "gpt": {"infer": ["add"], "deny": ["layer_norm", "gelu"]},
}


def workload(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "resnet18":
        return ResNet18(), torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    tokens = torch.randint(0, 256, (8, 257))
    return GPT(), tokens[:, :-1], tokens[:, 1:]


def step_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
            region: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def forward() -> torch.Tensor:
        with region():
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = forward()
        loss.backward()
        optimizer.step()
        return loss

    step.forward = forward  # type: ignore[attr-defined]
    return step


def bench_models() -> list[dict]:
    rows = []
    for name in ("resnet18", "gpt"):
        model, x, y = workload(name)
        default = ampkit.Policy.default("cpu", torch.bfloat16)
        edited = default.with_ops(**EDITS[name])
        regions = {
            "float32": contextlib.nullcontext,
            "torch.autocast bf16": lambda: torch.autocast("cpu", torch.bfloat16),
            "ampkit default bf16": lambda: ampkit.autocast(default),
            "ampkit edited bf16": lambda: ampkit.autocast(edited),
        }
        steps = {label: step_fn(model, x, y, region) for label, region in regions.items()}
        medians = interleaved_medians(steps, warmup=2, repeats=11)
        saved = {label: saved_bytes_of_step(model, step.forward)[1] for label, step in steps.items()}  # type: ignore[attr-defined]
        reference = "torch.autocast bf16"
        for label in regions:
            rows.append({
                "model": name,
                "variant": label,
                "edits": EDITS[name] if label == "ampkit edited bf16" else None,
                "ms_per_step": medians[label] * 1e3,
                "ratio_to_torch_autocast": medians[label] / medians[reference],
                "saved_for_backward_bytes": saved[label],
                "saved_equal_to_torch_autocast": saved[label] == saved[reference],
            })
    return rows


def bench_per_op(n: int = 10_000) -> dict:
    x, w = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    default = ampkit.Policy.default("cpu", torch.bfloat16)
    edited = default.with_ops(deny=["linear"])  # every call goes through ampkit's kernel

    def loop(region: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), region():
                for _ in range(n):
                    F.linear(x, w)
        return run

    medians = interleaved_medians(
        {
            "torch.autocast": loop(lambda: torch.autocast("cpu", torch.bfloat16)),
            "ampkit default": loop(lambda: ampkit.autocast(default)),
            "ampkit edited (linear moved)": loop(lambda: ampkit.autocast(edited)),
            "torch.autocast, linear to fp32 by hand": loop(contextlib.nullcontext),
        },
        warmup=1,
        repeats=9,
    )
    per_op = {k: v / n * 1e6 for k, v in medians.items()}
    return {
        "ops": n,
        "us_per_op": per_op,
        "default_overhead_us_per_op": per_op["ampkit default"] - per_op["torch.autocast"],
        "edited_overhead_us_per_op": per_op["ampkit edited (linear moved)"]
        - per_op["torch.autocast, linear to fp32 by hand"],
    }


def bench_fp16_matmul() -> dict:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    pairs = {str(dt).removeprefix("torch."): (a.to(dt), b.to(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    medians = interleaved_medians({k: (lambda p=p: p[0] @ p[1]) for k, p in pairs.items()}, warmup=2, repeats=7)
    return {
        "ms": {k: v * 1e3 for k, v in medians.items()},
        "fp16_over_fp32": medians["float16"] / medians["float32"],
        "bf16_speedup_over_fp32": medians["float32"] / medians["bfloat16"],
    }


def main() -> None:
    torch.manual_seed(0)
    rows = bench_models()
    per_op = bench_per_op()
    matmul = bench_fp16_matmul()
    path = save("autocast", {"models": rows, "per_op": per_op, "matmul_512": matmul})
    table = Table(title="Training step on CPU: ampkit vs torch.autocast (same run)")
    for col in ("model", "variant", "ms/step", "vs torch.autocast", "saved for backward", "same as torch"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["model"], row["variant"], f"{row['ms_per_step']:.1f}",
                      f"{row['ratio_to_torch_autocast']:.3f}x", f"{row['saved_for_backward_bytes'] / 2**20:.1f} MiB",
                      str(row["saved_equal_to_torch_autocast"]))
    console = Console(width=140)
    console.print(table)
    console.print(f"per-op: {per_op}")
    console.print(f"512x512 matmul: {matmul}")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
