"""What ampkit's regions leave behind in a process (issue 38): plain torch.autocast's step with the kernels that
edited, override and float32-compute regions registered, against its step without them, in the same process.

ampkit's edited policies, module overrides and float32 compute register Python kernels at the Autocast dispatch
key on first need and keep them for the process (precision/kernels.py): afterwards plain torch.autocast reaches
those kernels for their ops, which do what torch's would (tests/test_autocast.py checks the bits), in Python.
What that costs: the GPT of `ampkit compare` (batch 32, forward and backward under plain
``torch.autocast("cpu", torch.bfloat16)``), blocks of 20 steps alternated between the two states of one process:
with the kernels (one step each under an edited, a module-override and a float32-compute ampkit policy registers
them, untimed) and without (the benchmark drops the registry's ``torch.library.Library`` objects, whose finalizers
give the ops back to torch's kernels: what a fresh process has), 15 rounds, the order reversed every other round;
medians. Also one op alone: a 64x64 ``torch.mm`` under plain torch.autocast, the same alternation.

Writes results/after-regions.json.

    python benchmarks/bench_after_regions.py
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ampkit
from ampkit.experiment.models import GPT
from ampkit.precision import kernels
from common import save

ROUNDS, STEPS = 15, 20


def _regions(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One step under each kind of policy that registers kernels (untimed)."""
    default = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    for policy in (default.with_ops(deny=["gelu"], allow=["softmax"]), default.with_modules("lm_head", dtype="fp32"),
                   ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
        with ampkit.autocast(policy):
            logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
        model.zero_grad(set_to_none=True)


def _drop_kernels() -> None:
    """Give every op back to torch's own kernels: the registry's Library objects go, and their finalizers with them
    (ampkit's own registry, reached into by this benchmark alone)."""
    kernels.registry._libs.clear()
    gc.collect()


def _alternate(block: Callable[[], list[float]], model: torch.nn.Module, x: torch.Tensor) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(ROUNDS):
        for state in (("with", "without") if round_ % 2 == 0 else ("without", "with")):
            if state == "with":
                _regions(model, x)
            else:
                _drop_kernels()
            times[state] += block()
    return times


def main() -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT()
    x = torch.randint(0, 256, (32, 64))

    def gpt_block() -> list[float]:
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16):
                logits = model(x)
            F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
            model.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return times

    a = torch.randn(64, 64)

    def mm_block() -> list[float]:
        with torch.autocast("cpu", torch.bfloat16):
            start = time.perf_counter()
            for _ in range(500):
                torch.mm(a, a)
            return [(time.perf_counter() - start) / 500]

    _regions(model, x)
    registered = len(kernels.registry.registered())
    gpt_block(), _drop_kernels(), gpt_block()  # warm-up, in both states
    gpt = _alternate(gpt_block, model, x)
    mm = _alternate(mm_block, model, x)
    medians = {name: {state: statistics.median(t) for state, t in found.items()}
               for name, found in (("gpt_step", gpt), ("mm", mm))}
    payload = {"rounds": ROUNDS, "steps": STEPS, "registered": registered, "medians": medians,
               "gpt_ratio": medians["gpt_step"]["with"] / medians["gpt_step"]["without"],
               "mm_ratio": medians["mm"]["with"] / medians["mm"]["without"]}
    path = save("after-regions", payload)
    print(f"plain torch.autocast with ampkit's {registered} kernels registered: GPT step "
          f"{medians['gpt_step']['with'] * 1e3:.1f} ms against {medians['gpt_step']['without'] * 1e3:.1f} ms without, "
          f"{payload['gpt_ratio']:.3f}x; a 64x64 mm {medians['mm']['with'] * 1e6:.1f} us against "
          f"{medians['mm']['without'] * 1e6:.1f} us, {payload['mm_ratio']:.2f}x; {path}")


if __name__ == "__main__":
    main()
