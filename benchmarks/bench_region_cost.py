"""What opening an ``ampkit.autocast`` region costs against ``torch.autocast`` (issue 38: the default policy no slower).

A region is usually built where it is opened, every step (``with ampkit.autocast(policy):``), so its construction
counts as much as its entry. Timed in alternation (``common.interleaved_medians``), blocks of 1,000 empty regions,
microseconds per region: ``torch.autocast``, ampkit's default policy with native kernels built each time and one
instance reused, and the default policy with compute "auto" (on a CPU whose bf16 GEMMs are slower than float32's,
that is float32 compute: the region registers its kernels at entry and releases them at exit). Then what those
microseconds are in a training step where they weigh most: a small GPT (d_model 32, 2 layers, batch 2, context 16),
forward and backward, under ``torch.autocast`` and under ampkit's default policy, native kernels, built every step.
Last, what float32 compute's registrations cost a small model's training step (an MLP 784-512-512-10, batch 64,
SGD): released at each step's exit, as where every other thread waits, against kept by a second thread that runs
(then the kernels stay registered, precision/kernels.py).

Writes results/region-cost.json.

    python benchmarks/bench_region_cost.py
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import ampkit
from ampkit.experiment.models import GPT, MLP
from ampkit.precision.decide import decision_of
from ampkit.precision.kernels import registry
from common import interleaved_medians, save

BLOCK, GPT_ROUNDS, MLP_ROUNDS, MLP_STEPS = 1000, 301, 15, 20


def _regions(make: Callable[[], Any]) -> Callable[[], None]:
    def block() -> None:
        for _ in range(BLOCK):
            with make():
                pass

    return block


def main() -> None:
    warnings.simplefilter("ignore")  # the slow-kernel and compute-mode notes, said once
    native = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    auto = ampkit.Policy.default("cpu", torch.bfloat16)
    reused = ampkit.autocast(native)
    regions = {
        "torch.autocast": lambda: torch.autocast("cpu", torch.bfloat16),
        "ampkit default, native": lambda: ampkit.autocast(native),
        "ampkit default, native, one instance reused": lambda: reused,
        "ampkit default, compute auto": lambda: ampkit.autocast(auto),
    }
    seconds = interleaved_medians({name: _regions(make) for name, make in regions.items()}, warmup=1, repeats=15)
    us_per_region = {name: s / BLOCK * 1e6 for name, s in seconds.items()}

    torch.manual_seed(0)
    model, tokens = GPT(context=16, d_model=32, n_layers=2, n_heads=2), torch.randint(0, 256, (2, 16))

    def step(make: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with make():
                loss = model(tokens).float().mean()
            loss.backward()

        return run

    step_s = interleaved_medians({name: step(regions[name]) for name in ("torch.autocast", "ampkit default, native")},
                                 warmup=5, repeats=GPT_ROUNDS)
    ratio = step_s["ampkit default, native"] / step_s["torch.autocast"]
    mlp_ms = _float32_compute_steps()
    path = save("region-cost", {"us_per_region": us_per_region, "small_gpt_step_ms": {
        name: s * 1e3 for name, s in step_s.items()}, "small_gpt_ratio": ratio, "mlp_float32_compute_ms": mlp_ms,
        "auto_computes": decision_of(auto).label, "block": BLOCK, "gpt_rounds": GPT_ROUNDS, "mlp_rounds": MLP_ROUNDS,
        "mlp_steps": MLP_STEPS})
    print("an empty region: " + ", ".join(f"{name} {us:.1f} us" for name, us in us_per_region.items())
          + "; a small GPT step: " + ", ".join(f"{name} {s * 1e3:.3f} ms" for name, s in step_s.items())
          + f" ({ratio:.3f}x); an MLP step, float32 compute: "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in mlp_ms.items()) + f"; {path}")


def _float32_compute_steps(steps: int = MLP_STEPS, rounds: int = MLP_ROUNDS) -> dict[str, float]:
    """ms per MLP step under float32 compute, blocks of ``steps`` alternated: the kernels released at every step's
    exit, and kept by a second thread that runs, sleeping 10 ms at a time (started and stopped outside the timed
    steps)."""
    torch.manual_seed(0)
    model, x, y = MLP(784, 10, 512), torch.randn(64, 784), torch.randint(0, 10, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")

    def block() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            with ampkit.autocast(policy):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return (time.perf_counter() - start) / steps * 1e3

    times: dict[str, list[float]] = {"released at each step": [], "kept (a second thread runs)": []}
    block()  # warm-up
    for _ in range(rounds):
        times["released at each step"].append(block())
        assert not registry.registered()
        stop = threading.Event()
        thread = threading.Thread(target=lambda: [time.sleep(0.01) for _ in iter(stop.is_set, True)])
        thread.start()
        times["kept (a second thread runs)"].append(block())
        assert registry.registered()
        stop.set()
        thread.join()
        with ampkit.autocast(policy):  # closes with no other thread running: the kernels go
            pass
    return {name: statistics.median(found) for name, found in times.items()}


if __name__ == "__main__":
    main()
