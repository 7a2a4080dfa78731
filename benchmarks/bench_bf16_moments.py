"""bfloat16 moments, stochastically rounded or rounded to nearest (an ablation for issue 42), on the GPT of
`ampkit compare`.

Pure bfloat16 training with stochastic rounding of the weights (`--opt-level O3 --update stochastic`) and AdamW's
moments kept four ways: float32 (`states="fp32"`), and bfloat16 (`states="bf16"`) with both moments stochastically
rounded, both rounded to nearest (as torch's and torch-optimi's optimizers keep 16-bit moments), and ampkit's
default (`StochasticRoundingOptimizer(state_rounding="auto")`: the second moment, whose step changes it by less
than half a bfloat16 spacing, stochastically, the first to nearest), each against float32 training, on seeds 0, 1
and 2 (400 steps, batch 32 in 4 micro-batches, as the bytes-per-parameter record). The runs train one after another
in this process (the loss is what is compared, not the time); each run is deterministic, so the default's loss is
the bytes-per-parameter record's own.

Writes results/bf16-moments.json.

    python benchmarks/bench_bf16_moments.py
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import warnings

from rich.console import Console
from rich.table import Table

import ampkit
from ampkit.experiment.config import RunConfig
from ampkit.experiment.training import execute
from ampkit.optim import pure16, states
from common import save

SEEDS = (0, 1, 2)
VARIANTS = {"fp32 moments": ("fp32", "auto"), "bf16 moments, both stochastic": ("bf16", "stochastic"),
            "bf16 moments, both nearest": ("bf16", "nearest"),
            "bf16 moments, auto (the default: second stochastic, first nearest)": ("bf16", "auto")}


def final_loss(config: RunConfig, rounding: str) -> float:
    real = states.StochasticRoundingOptimizer
    states.StochasticRoundingOptimizer = functools.partial(real, state_rounding=rounding)  # type: ignore[misc]
    try:
        return float(execute(config).final_train_loss)  # type: ignore[arg-type]
    finally:
        states.StochasticRoundingOptimizer = real  # type: ignore[misc]


def main() -> None:
    warnings.simplefilter("ignore", ampkit.ComputeModeWarning)
    start = time.perf_counter()
    base = RunConfig(model="gpt", data="text", batch_size=32, steps=400, lr=6e-3, micro_batches=4)
    seeds: dict[str, dict[str, float]] = {}
    for seed in SEEDS:
        float32 = execute(dataclasses.replace(base, seed=seed)).final_train_loss
        o3 = dataclasses.replace(base, seed=seed, precision="bf16", opt_level="O3", update="stochastic")
        seeds[str(seed)] = {name: final_loss(dataclasses.replace(o3, states=kept), rounding) / float32
                            for name, (kept, rounding) in VARIANTS.items()}
    means = {name: statistics.fmean(row[name] for row in seeds.values()) for name in VARIANTS}
    table = Table("moments", *(f"loss vs fp32, seed {s}" for s in seeds), "mean")
    for name in VARIANTS:
        table.add_row(name, *(f"{row[name]:.4f}x" for row in seeds.values()), f"{means[name]:.4f}x")
    Console().print(table)
    path = save("bf16-moments", {"seeds": seeds, "means": means, "wall_s": time.perf_counter() - start,
                                 "nearest_is": pure16.StochasticRoundingOptimizer.__name__ + "(state_rounding='nearest')"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
