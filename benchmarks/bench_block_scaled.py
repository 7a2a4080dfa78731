"""Emulated block-scaled training against bf16: one training step of ``ampkit compare``'s GPT, in one run.

Issue 68 asks for emulated MXFP8 and NVFP4 steps at most 3x bf16's. A block-scaled step quantizes six GEMM operands
per linear (each GEMM's two, along its reduction dimension) and runs the GEMMs in float32 on the decoded values; the
quantization was thirty-odd elementwise passes over each operand, and ``BlockScaledRecipe(compiled_casts=True)``
(the default) fuses them through torch.compile. Each variant is the GPT (compare's default size, 32 windows of 64
bytes) at O1 bf16, its linears converted as ``ampkit compare`` converts them (MXFP8 with RCEIL scales, MXFP4, the
NVFP4 recipe), with the casts compiled and eager; forward, backward and AdamW, timed in alternation (medians of
``--repeats`` rounds after two warm-up steps, which pay the casts' one-time compile).

Writes results/block-scaled.json.

    python benchmarks/bench_block_scaled.py
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

import ampkit
from ampkit.experiment.config import BLOCK_RECIPES
from ampkit.experiment.models import GPT
from ampkit.formats.block_linear import convert_to_block_scaled
from common import save, timed_against

FORMATS = ("mxfp8", "mxfp4", "nvfp4")


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O1", torch.bfloat16)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).backward()
        optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    base, tokens = GPT(), torch.randint(0, 256, (32, 65))
    steps = {"bf16 O1": _step(copy.deepcopy(base), tokens)}
    for name in FORMATS:
        for compiled in (True, False):
            model = copy.deepcopy(base)
            convert_to_block_scaled(model, dataclasses.replace(BLOCK_RECIPES[name], compiled_casts=compiled))
            steps[f"{name}, casts {'compiled' if compiled else 'eager'}"] = _step(model, tokens)
    rows = timed_against(steps, "bf16 O1", args.repeats)
    print(f"wrote {save('block-scaled', {'repeats': args.repeats, 'variants': rows})}")


if __name__ == "__main__":
    main()
