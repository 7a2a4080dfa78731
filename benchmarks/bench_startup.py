"""How long ampkit takes to start, against torch: ``import`` and ``ampkit --help``, each a fresh process.

    python benchmarks/bench_startup.py   # writes benchmarks/results/startup.json

Each variant is a new Python process (``sys.executable -c ...``), timed from start to exit, 9 rounds in
alternation (the order reversed every other round), median per variant, then ratios to ``import torch``:

- ``import torch``: the reference;
- ``import ampkit``: names load on first use, so this loads neither torch nor ampkit's modules;
- ``import ampkit`` and every public name read: what a script that uses ampkit loads before it runs anything;
- the same, then an edited float32-compute region with a module override run once, and a loss scaler's step:
  ampkit's eager use (its precision layer's modules import torch's compiler, dynamo, for the marks that keep
  torch.compile off ampkit's own code, as torch's optimizers do when built);
- ``ampkit --help`` (the console script's entry point): no torch.

Issue 41's targets: ``import ampkit`` within 1.3x ``import torch``; ``ampkit --help`` under 2 s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from common import save

ROUNDS = 9
USE = """
import torch, warnings
from torch import nn
import ampkit
warnings.simplefilter("ignore")
for name in ampkit.__all__:
    getattr(ampkit, name)
"""
RUN = USE + """
model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32").with_ops(deny=["gelu"]).with_modules(
    nn.LayerNorm, dtype=torch.float32)
with ampkit.autocast(policy, model=model):
    loss = model(torch.randn(8, 64)).float().sum()
ampkit.DynamicLossScaler().scale(loss).backward()
"""
VARIANTS = {
    "import torch": "import torch",
    "import ampkit": "import ampkit",
    "import ampkit, read every public name": USE,
    "... and run an edited region eagerly": RUN,
    "ampkit --help": "import sys; sys.argv = ['ampkit', '--help']; from ampkit.cli.main import main; main()",
}


def _timed(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for code in VARIANTS.values():  # once each first: the files in the disk cache, as on a second start
        _timed(code)
    names = list(VARIANTS)
    for round_ in range(ROUNDS):
        for name in names if round_ % 2 == 0 else reversed(names):
            times[name].append(_timed(VARIANTS[name]))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    torch_s = medians["import torch"]
    rows = [{"variant": name, "median_s": round(s, 3), "ratio_to_import_torch": round(s / torch_s, 2),
             "min_s": round(min(times[name]), 3), "max_s": round(max(times[name]), 3)} for name, s in medians.items()]
    path = save("startup", {"rounds": ROUNDS, "rows": rows})
    for row in rows:
        print(f"{row['variant']:<45} {row['median_s']:6.2f} s  {row['ratio_to_import_torch']:.2f}x import torch")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
