"""What per-module overrides cost a module call outside their regions, and a region's entry (issues 38 and 71).

Until issue 71 module overrides (``Policy.with_modules``) ran through two global module hooks that, once a compiled
call had traced them, stayed for the process: every module call in it then took ``nn.Module``'s path for hooks. Now
an override is a forward wrapper that the region sets on the matching modules of its model and takes off at its exit.
Measured, in this order: a module call with no global hook (what a fresh process has), with two no-op Python hooks
of the same kinds registered (what the old design's hooks cost at least: torch's part, any global hook pays it),
and after a model was compiled (``eager`` backend) under a module-override region, no region open. 100
``nn.Identity`` in a Sequential, best of 9 blocks of 200 calls, microseconds per module call (the Sequential counts
as one). Then what entering and leaving a region costs on that chain with an override matching one module (its
modules walked and matched, one wrapper set and taken off) against the same policy without the override, medians
of 2,000 in alternation.

Writes results/module-hooks.json.

    python benchmarks/bench_module_hooks.py
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.nn.modules import module as nn_module

import ampkit
from common import interleaved_medians, save


def _best_us(chain: torch.nn.Module, x: torch.Tensor) -> float:
    blocks = []
    for _ in range(9):
        start = time.perf_counter()
        for _ in range(200):
            chain(x)
        blocks.append((time.perf_counter() - start) / 200 / (len(chain) + 1) * 1e6)
    return min(blocks)


def main() -> None:
    warnings.simplefilter("ignore")
    chain, x = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(100)]), torch.randn(2)
    found = {"no hooks": _best_us(chain, x)}
    handles = [nn_module.register_module_forward_pre_hook(lambda module, args: None),
               nn_module.register_module_forward_hook(lambda module, args, output: None, always_call=True)]
    found["two no-op hooks"] = _best_us(chain, x)
    for handle in handles:
        handle.remove()
    native = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    policy = native.with_modules("3", dtype="fp32")
    with ampkit.autocast(policy, model=chain):
        torch.compile(chain, backend="eager")(x)
    assert not nn_module._global_forward_pre_hooks and "forward" not in chain[3].__dict__  # nothing stays
    found["ampkit's, after a compiled override region"] = _best_us(chain, x)

    def region(p: ampkit.Policy) -> None:
        with ampkit.autocast(p, model=chain):
            pass

    entry = interleaved_medians({"with the override": lambda: region(policy), "without": lambda: region(native)},
                                warmup=50, repeats=2000)
    path = save("module-hooks", {"us_per_module_call": found,
                                 "region_entry_us": {name: s * 1e6 for name, s in entry.items()}})
    print("a module call, no region open: " + ", ".join(f"{name} {us:.2f} us" for name, us in found.items())
          + "; a region's entry and exit on 100 modules: " + ", ".join(f"{name} {s * 1e6:.1f} us"
                                                                      for name, s in entry.items()) + f"; {path}")


if __name__ == "__main__":
    main()
