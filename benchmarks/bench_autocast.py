"""ampkit's policies against float32 and torch.autocast, measured in one run.

Training steps of ResNet-18 (1x28x28, batch 64) and a small GPT (4 layers, d=384,
context 256, batch 8) on the CPU in float32, torch.autocast bf16, ampkit's default
bf16 policy with ``compute="auto"`` (native 16-bit kernels where this machine runs
them faster than float32, else float32 compute on bf16 values), an edited
policy, and O2 (a bf16 model with float32 master weights, ``compute="auto"``); ms/step (median after a warm-up step, variants timed in alternation; a
variant leaves the rotation after 45 s of timed steps and 3 timings), bytes saved
for backward and ratios to float32 and to torch.autocast. Then the per-op overhead over 10,000 small
linears, and 16-bit against float32 matmul speed.

On a GPU (``--device cuda``) the same workloads and variants run there, each timing ending in a device sync;
these small steps are bound by the host's per-op work rather than the GPU's arithmetic, which is where a
Python layer over autocast costs most.

    python benchmarks/bench_autocast.py   # writes benchmarks/results/autocast.json
    python benchmarks/bench_autocast.py --device cuda --out DIR   # writes DIR/autocast.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import ampkit
from ampkit import float32_compute
from ampkit.precision import decide
from ampkit.experiment import sizing
from ampkit.experiment.models import GPT, ResNet18
from ampkit.diagnostics.memory import saved_bytes_of_step
from common import RESULTS, interleaved_medians, paired_ratio_quartiles, save

WARMUP, REPEATS = 1, 31
BUDGET_S = 45.0  # per variant: torch.autocast's 16-bit kernels take tens of seconds a step on AVX2-only CPUs
EDITS = {
    "resnet18": {"infer": ["add"], "deny": ["adaptive_avg_pool2d"]},
    "gpt": {"infer": ["add"], "deny": ["layer_norm", "gelu"]},
}


def workload(name: str, device: str, size: str = "small") -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model and a batch: at ``small`` this script's own sizes; at ``medium`` and ``large`` ``ampkit compare``'s
    (experiment/sizing.py: its ResNet-18's batch and stem; its GPT's width, depth and heads, with the same tokens
    a step as compare's 64-byte windows give, here in windows of 256)."""
    torch.manual_seed(0)
    batch, kwargs = sizing.LADDER[name][size] if size != "small" else (0, {})
    if name == "resnet18":
        batch = batch or 64
        model, x, y = ResNet18(**kwargs), torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    else:
        tokens = torch.randint(0, 256, (batch // 4 or 8, 257))
        widths = kwargs or {"d_model": 384, "n_layers": 4, "n_heads": 6}
        model, x, y = GPT(context=256, **widths), tokens[:, :-1], tokens[:, 1:]
    return model.to(device), x.to(device), y.to(device)


def synced(fn: Callable[[], object], device: str) -> Callable[[], None]:
    """``fn``, then a wait for the GPU's queue: a timing covers the work, not only its launch."""
    if device == "cpu":
        return fn  # type: ignore[return-value]

    def run() -> None:
        fn()
        torch.cuda.synchronize()
    return run


def step_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
            region: Callable[[], contextlib.AbstractContextManager],
            optimizer: torch.optim.Optimizer | None = None) -> Callable[[], torch.Tensor]:
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=1e-4)

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
    step.model = model  # type: ignore[attr-defined]
    return step


def bench_models(device: str, repeats: int = REPEATS, size: str = "small", compiled: bool = False) -> list[dict]:
    """Every variant's step on both workloads at ``size``; with ``compiled``, the GPT's float32, torch.autocast and
    ampkit's default steps also through torch.compile (inductor; the compile is the warm-up), each against its
    compiled torch.autocast."""
    rows = []
    for name in ("resnet18", "gpt"):
        model, x, y = workload(name, device, size)
        auto = ampkit.Policy.default(device, torch.bfloat16)  # compute="auto"
        edited = auto.with_ops(**EDITS[name])
        regions = {
            "float32": contextlib.nullcontext,
            "torch.autocast bf16": lambda: torch.autocast(device, torch.bfloat16),
            "ampkit default bf16, auto": lambda: ampkit.autocast(auto),
            "ampkit edited bf16, auto": lambda: ampkit.autocast(edited),
        }
        steps = {label: step_fn(model, x, y, region) for label, region in regions.items()}
        # O2: a bf16 copy of the model with float32 master weights (ampkit.initialize, compute="auto").
        o2_model = copy.deepcopy(model)
        o2_model, o2_optimizer = ampkit.initialize(o2_model, torch.optim.SGD(o2_model.parameters(), lr=1e-4), "O2",
                                                   torch.bfloat16)
        steps["ampkit O2 bf16, auto"] = step_fn(o2_model, x, y, contextlib.nullcontext, o2_optimizer)
        if compiled and name == "gpt":  # a compiled module per variant (each region its own graph); the GPT's only:
            # three compiles of each model would not fit the device check's budget
            for label in ("float32", "torch.autocast bf16", "ampkit default bf16, auto"):
                twin = copy.deepcopy(model)
                steps[f"{label} compiled"] = step_fn(torch.compile(twin), x, y, regions[label],
                                                     torch.optim.SGD(twin.parameters(), lr=1e-4))
        samples: dict[str, list[float]] = {}
        timed = {label: synced(step, device) for label, step in steps.items()}
        medians = interleaved_medians(timed, warmup=WARMUP, repeats=repeats, budget_s=BUDGET_S, samples=samples)
        saved = {label: saved_bytes_of_step(step.model, step.forward)[1]  # type: ignore[attr-defined]
                 for label, step in steps.items() if not label.endswith(" compiled")}
        # a compiled step saves what its eager twin saves (counted there)
        saved |= {label: saved[label.removesuffix(" compiled")] for label in steps}
        for label in steps:
            reference = "torch.autocast bf16" + (" compiled" if label.endswith("compiled") else "")
            float32 = "float32" + (" compiled" if label.endswith("compiled") else "")
            rows.append({
                "model": name,
                "size": size,
                "batch": len(x),
                "variant": label,
                "compute": decide.decision_of(auto).describe() if ", auto" in label else None,
                "float32_compute": sorted(decide.decision(device, torch.bfloat16, "auto").classes)
                if ", auto" in label else [],
                "edits": EDITS[name] if label.startswith("ampkit edited") else None,
                "ms_per_step": medians[label] * 1e3,
                "timed_steps": len(samples[label]),
                "ratio_to_float32": medians[label] / medians[float32],
                "ratio_to_float32_quartiles": paired_ratio_quartiles(samples[label], samples[float32]),
                "ratio_to_torch_autocast": medians[label] / medians[reference],
                "ratio_to_torch_autocast_quartiles": paired_ratio_quartiles(samples[label], samples[reference]),
                "saved_for_backward_bytes": saved[label],
                "saved_ratio_to_float32": saved[label] / saved[float32],
                "saved_equal_to_torch_autocast": saved[label] == saved[reference],
            })
    return rows


def bench_per_op(device: str, n: int = 10_000) -> dict:
    x, w = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device, requires_grad=True)
    # Native compute: this measures the cost of ampkit's casting kernels, not of the arithmetic.
    default = ampkit.Policy.default(device, torch.bfloat16, compute="native")
    edited = default.with_ops(deny=["linear"])  # every call goes through ampkit's kernel

    def loop(region: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), region():
                for _ in range(n):
                    F.linear(x, w)
        return synced(run, device)

    medians = interleaved_medians(
        {
            "torch.autocast": loop(lambda: torch.autocast(device, torch.bfloat16)),
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


def bench_matmul(device: str) -> dict:
    """512x512 matmuls: native float32, bfloat16 and float16, and both 16-bit dtypes computed
    in float32 on their values (ampkit.float32_compute.run_in_float32)."""
    a, b = torch.randn(512, 512, device=device), torch.randn(512, 512, device=device)
    variants = {}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a16, b16 = a.to(dt), b.to(dt)
        variants[str(dt).removeprefix("torch.")] = lambda a16=a16, b16=b16: a16 @ b16
        if dt != torch.float32:
            variants[f"{str(dt).removeprefix('torch.')} float32-compute"] = (
                lambda a16=a16, b16=b16: float32_compute.run_in_float32(torch.mm, a16, b16)
            )
    medians = interleaved_medians({k: synced(v, device) for k, v in variants.items()}, warmup=1, repeats=7)
    return {
        "ms": {k: v * 1e3 for k, v in medians.items()},
        "speed_over_fp32": {k: medians["float32"] / v for k, v in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder autocast.json goes to")
    parser.add_argument("--size", choices=sizing.RUNGS, default="small",
                        help="small: this script's workloads (default); medium, large: ampkit compare's sizes")
    parser.add_argument("--compile", action="store_true",
                        help="also time the GPT's float32, torch.autocast and ampkit's default steps through "
                             "torch.compile")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help=f"timed rounds of the training steps (default {REPEATS}; more narrow the ratios' spread)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no CUDA device; run it on a GPU machine, or --device cpu")
    torch.manual_seed(0)
    rows = bench_models(args.device, args.repeats, args.size, args.compile)
    per_op = bench_per_op(args.device)
    matmul = bench_matmul(args.device)
    path = save("autocast", {"models": rows, "per_op": per_op, "matmul_512": matmul,
                             "warmup": WARMUP, "repeats": args.repeats, "size": args.size,
                             "compiled": args.compile}, args.out, args.device)
    table = Table(title=f"Training step on {args.device}: ampkit vs float32 and torch.autocast (same run)")
    for col in ("model", "variant", "ms/step", "vs float32", "vs torch.autocast", "saved for backward",
                "vs float32"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["model"], row["variant"], f"{row['ms_per_step']:.1f}", f"{row['ratio_to_float32']:.3f}x",
                      f"{row['ratio_to_torch_autocast']:.3f}x", f"{row['saved_for_backward_bytes'] / 2**20:.1f} MiB",
                      f"{row['saved_ratio_to_float32']:.2f}x")
    console = Console(width=140)
    console.print(table)
    console.print(f"per-op: {per_op}")
    console.print(f"512x512 matmul: {matmul}")
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
