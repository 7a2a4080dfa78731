"""What a module call costs once ampkit's override hooks stay for the process (issue 38).

Module overrides (``Policy.with_modules``) run through two global module hooks (precision/overrides.py). Once a
compiled call has traced them they stay for the process: dynamo's graphs guard on the hooks' keys in torch's table,
and installed anew at each region they failed that guard at every step. Outside regions they return at once, but
every module call in the process then takes ``nn.Module``'s path for hooks. Measured, in this order (the last state
cannot be left): a module call with no global hook (what a fresh process has), with two no-op Python hooks of the
same kinds registered (torch's part of the cost: any global hook pays it), and after a model was compiled (``eager``
backend) under a module-override region, no region open. 100 ``nn.Identity`` in a Sequential, best of 9 blocks of
200 calls, microseconds per module call (the Sequential counts as one).

Writes results/module-hooks.json.

    python benchmarks/bench_module_hooks.py
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.nn.modules import module as nn_module

import ampkit
from ampkit.precision import overrides
from common import save


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
    assert not overrides._hook_handles  # nothing of ampkit's installed yet
    found = {"no hooks": _best_us(chain, x)}
    handles = [nn_module.register_module_forward_pre_hook(lambda module, args: None),
               nn_module.register_module_forward_hook(lambda module, args, output: None, always_call=True)]
    found["two no-op hooks"] = _best_us(chain, x)
    for handle in handles:
        handle.remove()
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="native").with_modules("3", dtype="fp32")
    with ampkit.autocast(policy):
        torch.compile(chain, backend="eager")(x)
    assert overrides._hook_handles  # traced: they stay
    found["ampkit's, after a compiled override region"] = _best_us(chain, x)
    path = save("module-hooks", {"us_per_module_call": found})
    print("a module call, no region open: " + ", ".join(f"{name} {us:.2f} us" for name, us in found.items())
          + f"; {path}")


if __name__ == "__main__":
    main()
