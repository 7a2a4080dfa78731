"""torch.compile (inductor) against eager for the GPT under ampkit's default policy.

ampkit's default policy with native kernels is torch.autocast, which torch.compile traces and
guards on; under edited and float32-compute policies compiled code runs eagerly (docs/policies.md).
This script times a training step of the small GPT of `ampkit compare` (batch 2, context 128,
so that native 16-bit kernels stay affordable on a CPU without 16-bit arithmetic) eagerly and
compiled, each inside an ampkit default region and in float32, in alternation, and checks that
the compiled logits match the eager ones (dtype, greatest difference).

    python benchmarks/bench_compile.py   # writes benchmarks/results/compile.json
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
import torch.nn.functional as F
from rich.console import Console

import ampkit
from ampkit.experiment.models import GPT
from common import interleaved_medians, save

BATCH, CONTEXT = 2, 128


def main() -> None:
    warnings.simplefilter("ignore", ampkit.SlowPrecisionWarning)  # native kernels are the point here
    console = Console()
    torch.manual_seed(0)
    base = GPT(context=CONTEXT, d_model=384, n_layers=4, n_heads=6)
    tokens = torch.randint(0, 256, (BATCH, CONTEXT + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    dtype = ampkit.recommend_dtype("cpu")
    policy = ampkit.Policy.default("cpu", dtype, compute="native")

    def step_of(model: torch.nn.Module, enabled: bool):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with ampkit.autocast(policy, enabled=enabled):
                logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
            optimizer.step()

        return step

    # Values first, on identical weights: the compiled forward against the eager one.
    agreement = {}
    for enabled in (True, False):
        eager, compiled = copy.deepcopy(base), torch.compile(copy.deepcopy(base), backend="inductor")
        with torch.no_grad(), ampkit.autocast(policy, enabled=enabled):
            start = time.perf_counter()
            out_compiled = compiled(x)
            compile_s = time.perf_counter() - start
            out_eager = eager(x)
        name = str(dtype).removeprefix("torch.") if enabled else "float32"
        agreement[name] = {"dtype_eager": str(out_eager.dtype), "dtype_compiled": str(out_compiled.dtype),
                           "max_abs_diff": (out_compiled.float() - out_eager.float()).abs().max().item(),
                           "first_call_s": compile_s}
        console.print(f"{name}: eager {out_eager.dtype}, compiled {out_compiled.dtype}, "
                      f"greatest difference {agreement[name]['max_abs_diff']:.3g}, first compiled call {compile_s:.1f} s")

    torch._dynamo.reset()
    variants = {
        f"eager, ampkit default {dtype}": step_of(copy.deepcopy(base), True),
        f"compiled, ampkit default {dtype}": step_of(torch.compile(copy.deepcopy(base)), True),
        "eager, float32": step_of(copy.deepcopy(base), False),
        "compiled, float32": step_of(torch.compile(copy.deepcopy(base)), False),
    }
    seconds = interleaved_medians(variants, warmup=2, repeats=5)
    ms = {name: 1000 * s for name, s in seconds.items()}
    names = list(ms)
    ratio = {"default policy": ms[names[1]] / ms[names[0]], "float32": ms[names[3]] / ms[names[2]]}
    for name, value in ms.items():
        console.print(f"{name:36s} {value:9.1f} ms/step")
    console.print(f"compiled / eager: default policy {ratio['default policy']:.2f}x, float32 {ratio['float32']:.2f}x")
    path = save("compile", {"batch": BATCH, "context": CONTEXT, "dtype": str(dtype), "backend": "inductor",
                            "ms": ms, "compiled_over_eager": ratio, "agreement": agreement})
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
