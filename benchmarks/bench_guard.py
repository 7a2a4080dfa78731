"""What ``ampkit.Guard`` costs while nothing goes wrong, on the GPT of `ampkit compare` (issue 43's overhead target:
at most 3% of the step time).

The same bf16 O1 model and batches as compare's GPT run (batch 32, its lr), built three times from one seed and
stepped in alternation (A B C, C B A: ``interleaved_medians``): without a guard (``scaler.step`` as compare takes it),
with ``Guard(sample_every=10)`` (the default: the layers' figures sampled every tenth step) and with
``sample_every=1``. Each call is one training step (forward, backward, the guard's checks, the optimizer's step). The
ratio of the medians is the overhead; the guarded models' losses are checked against the unguarded one's (a sound
run: the guard changes nothing). With ``--compile`` the same three again with the forward through torch.compile
(inductor), each against the compiled unguarded run: there the guard's hooks are traced into the graph, whose
fusion, and so its rounding, changes with them (their losses differ by as little as compiled and eager ones do; the
record keeps the largest relative difference).

Writes results/guard.json.

    python benchmarks/bench_guard.py [--steps 300] [--compile]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ampkit
from ampkit.experiment import data as data_mod
from ampkit.experiment.config import CONTEXT, RunConfig
from ampkit.experiment.training import make_scaler, prepare
from common import interleaved_medians, save

VARIANTS = {"no guard": None, "guard, sampled every 10 steps": 10, "guard, sampled every step": 1}


def stepper(config: RunConfig, sample_every: int | None, dataset: data_mod.Dataset,
            losses: list[float], compiled: bool = False) -> Callable[[], None]:
    """One training step a call of a fresh model of ``config`` (the same weights and batches for every variant),
    its forward through torch.compile (inductor) where ``compiled``."""
    model, optimizer = prepare(config, dataset, torch.device("cpu"))
    scaler = make_scaler(config.scaling, model)
    guard = None if sample_every is None else ampkit.Guard(model, optimizer, scaler, sample_every=sample_every)
    forward = torch.compile(model) if compiled else model
    plan = data_mod.batches(dataset, config.batch_size, 10_000, config.seed, CONTEXT)
    step = iter(range(len(plan)))

    def one() -> None:
        x, y = data_mod.pair(dataset, plan[next(step)], CONTEXT, "train")
        optimizer.zero_grad(set_to_none=True)
        logits = forward(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        scaler.scale(loss).backward()
        if guard is not None:
            guard.step(loss, batch=(x, y))
        else:
            scaler.step(optimizer)
            scaler.update()
        losses.append(loss.item())

    return one


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="timed steps per variant (default 300)")
    parser.add_argument("--compile", action="store_true",
                        help="also the three variants through torch.compile (the compile is the warm-up)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    config = RunConfig(model="gpt", data="text", precision="bf16", opt_level="O1", batch_size=32, lr=6e-3)
    dataset = data_mod.load(config.data)
    variants = {name: (every, False) for name, every in VARIANTS.items()}
    if args.compile:
        variants |= {f"compiled, {name}": (every, True) for name, every in VARIANTS.items()}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    steps = {name: stepper(config, every, dataset, losses[name], compiled)
             for name, (every, compiled) in variants.items()}
    samples: dict[str, list[float]] = {}
    medians = interleaved_medians(steps, warmup=5, repeats=args.steps, samples=samples)

    def reference(name: str) -> str:  # each variant against the unguarded run compiled as it is
        return "compiled, no guard" if name.startswith("compiled") else "no guard"

    # compiled or not, losses as the unguarded run's of the same kind (inductor's fused arithmetic differs from eager)
    def difference(name: str) -> float:  # the largest relative difference of a step's loss from the reference's
        return max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses[reference(name)]))

    rows = {name: {"ms_per_step": medians[name] * 1e3, "ratio": medians[name] / medians[reference(name)],
                   "same_losses": losses[name] == losses[reference(name)], "loss_difference": difference(name)}
            for name in variants}
    for name, row in rows.items():
        print(f"{name}: {row['ms_per_step']:.1f} ms/step, {row['ratio']:.4f}x, the same losses: {row['same_losses']} "
              f"(largest relative difference {row['loss_difference']:.2g})")
    # what rounding alone does to the trajectory: the compiled unguarded run against the eager one
    rounding = max(abs(a - b) / abs(b) for a, b in zip(losses["compiled, no guard"], losses["no guard"])) \
        if args.compile else None
    if rounding is not None:
        print(f"compiled against eager, both unguarded: largest relative difference {rounding:.2g}")
    path = save("guard", {"model": "gpt", "precision": "bf16 O1", "batch_size": config.batch_size,
                          "timed_steps": args.steps, "rows": rows, "compiled": args.compile,
                          "compiled_vs_eager_difference": rounding,
                          "wall_s": time.perf_counter() - start})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
