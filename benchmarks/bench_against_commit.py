"""ampkit's default policy against an earlier commit's, in one run: the same training step, the two codes in turn.

Records on different days are different machines' noise (a step's ratio to float32 moved 5% between two runs of the
same code here); this times the step of an earlier commit and of this tree side by side. Two worker processes, each
importing its own ``src/`` (the earlier one unpacked from git into a temporary folder), build the same model from
the same seed (bench_autocast's ResNet-18 and GPT, SGD) and run one training step under
``ampkit.autocast(Policy.default("cpu", torch.bfloat16))`` each time the parent asks, in alternation (the order
reversed every other round). On a CPU without native bf16 the default policy computes GEMMs and convolutions in
float32 on bfloat16 values: issue 38 asks that float32 compute be no slower than before its precision layer.
The first step's loss of each is recorded too: the same code path gives the same bits.

    python benchmarks/bench_against_commit.py [COMMIT]   # default 4e13802^, the tree issue 38 was filed against
                                                           # writes benchmarks/results/against-commit.json
    python benchmarks/bench_against_commit.py 5d87706 --opt-level O2   # issue 64: O2's step before its contract
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common import RESULTS, paired_ratio_quartiles, save

ROOT = Path(__file__).resolve().parents[1]
BASE = "4e13802^"  # the last commit before issue 38's first change
ROUNDS, MODELS = 41, ("resnet18", "gpt")

WORKER = """
import sys, time, torch, torch.nn.functional as F, ampkit
from ampkit.experiment.models import GPT, ResNet18
torch.manual_seed(0)
if sys.argv[1] == "resnet18":
    model, x, y = ResNet18(), torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
else:
    tokens = torch.randint(0, 256, (8, 257))
    model, x, y = GPT(context=256, d_model=384, n_layers=4, n_heads=6), tokens[:, :-1], tokens[:, 1:]
level = sys.argv[2]
if level == "policy":
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    region = lambda: ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16))
else:  # an opt level's whole training step: initialize's model and optimizer
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), level, torch.bfloat16)
    region = torch.enable_grad
print(ampkit.__file__, flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with region():
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    loss.backward()
    optimizer.step()
    print(time.perf_counter() - start, loss.item(), flush=True)
"""


def _unpack(commit: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _worker(src: Path, model: str, level: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONWARNINGS": "ignore"}
    worker = subprocess.Popen([sys.executable, "-c", WORKER, model, level], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=tempfile.gettempdir())
    assert worker.stdout is not None
    imported = worker.stdout.readline().strip()
    if not imported.startswith(str(src)):  # an installed ampkit would shadow the code to be timed
        worker.kill()
        raise RuntimeError(f"the worker for {src} imported ampkit from {imported or 'nowhere'}")
    return worker


def _step(worker: subprocess.Popen[str]) -> tuple[float, float]:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write("step\n")
    worker.stdin.flush()
    line = worker.stdout.readline()
    if not line:
        raise RuntimeError(f"a worker stopped (exit {worker.wait()}): run it alone to see why")
    seconds, loss = line.split()
    return float(seconds), float(loss)


def measure(model: str, sources: dict[str, Path], level: str = "policy") -> dict[str, object]:
    workers = {name: _worker(src, model, level) for name, src in sources.items()}
    try:
        first_loss = {name: _step(worker)[1] for name, worker in workers.items()}  # the warm-up step
        times: dict[str, list[float]] = {name: [] for name in workers}
        names = list(workers)
        for round_ in range(ROUNDS):
            for name in names if round_ % 2 == 0 else reversed(names):
                times[name].append(_step(workers[name])[0])
    finally:
        for worker in workers.values():
            assert worker.stdin is not None
            worker.stdin.close()
            worker.wait(timeout=60)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {"ms_per_step": {name: m * 1e3 for name, m in medians.items()},
            "ratio": medians["this tree"] / medians["before"],
            "ratio_quartiles": paired_ratio_quartiles(times["this tree"], times["before"]),
            "first_loss": first_loss, "same_first_loss": first_loss["this tree"] == first_loss["before"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", nargs="?", default=BASE)
    parser.add_argument("--opt-level", default="policy", choices=["policy", "O1", "O2", "O3"],
                        help="policy (default): the default policy's region around an SGD step; an opt level: "
                             "initialize's model and AdamW at it, the whole step (writes against-commit-<level>.json)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the folder the record goes to")
    args = parser.parse_args()
    commit = args.commit
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()

    resolved, head = git("rev-parse", "--short", commit), git("rev-parse", "--short", "HEAD")
    tree = head + (" with uncommitted changes to src/" if git("status", "--porcelain", "src") else "")
    with tempfile.TemporaryDirectory() as folder:
        sources = {"before": _unpack(commit, Path(folder)), "this tree": ROOT / "src"}
        started = time.perf_counter()
        found = {model: measure(model, sources, args.opt_level) for model in MODELS}
    for model, result in found.items():
        print(f"{model}: {json.dumps(result)}")
    name = "against-commit" if args.opt_level == "policy" else f"against-commit-{args.opt_level.lower()}"
    path = save(name, {"commit": resolved, "tree": tree, "rounds": ROUNDS, "models": found, "opt_level":
                       args.opt_level, "wall_s": round(time.perf_counter() - started)}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
