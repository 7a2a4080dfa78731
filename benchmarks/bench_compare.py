"""The `ampkit compare` records: the default workload and the GPT on stdlib text.

Runs the command line itself, timed from start to exit (what a user waits for:
start-up, the hardware measurement, the plan's estimate, every run and the
files), and keeps each comparison's results.json, curves.png and summary.png
under benchmarks/results/compare-<name>-<device>/ with command.json beside them
(replaced as a whole: this script's job is to refresh them).

    python benchmarks/bench_compare.py [--device cuda] [--only NAME ...] [--kind KIND]  (NAME: a key of WORKLOADS)

``--kind`` names the machine in the record's folder (compare-<name>-<kind>-<device>), so a second kind of CPU
(e.g. ``native-bf16``: AVX-512 BF16, where the first records were taken on AVX2) keeps its own records.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS

WORKLOADS = {
    "digits": [],
    "gpt": ["--model", "gpt"],
    # FP8 (issue 12): both recipes against bf16 over the default 400 steps
    "gpt-fp8": ["--model", "gpt", "--precision", "bf16", "fp8", "fp8-current", "--opt-level", "O1",
                "--no-probe"],
    # Block-scaled formats (issue 26), emulated: MXFP8, MXFP4 and NVFP4 (full, and each recipe part removed)
    "gpt-block-scaled": ["--model", "gpt", "--precision", "bf16", "mxfp8-floor", "mxfp4", "nvfp4", "nvfp4-no-tiles",
                         "nvfp4-no-sr", "nvfp4-no-hadamard", "nvfp4-no-kept", "--opt-level", "O1", "--no-probe"],
    # Issue 68's command as a user types it: its time against the plan's estimate and 4 minutes
    "gpt-formats": ["--model", "gpt", "--precision", "bf16", "mxfp8", "nvfp4"],
    # MXFP8's two scale modes against bf16 on two seeds: the spec's FLOOR (saturates a block's largest values)
    # and RCEIL (never saturates); one seed's final loss moves by a few percent with any rounding change.
    "gpt-mxfp8": ["--model", "gpt", "--precision", "bf16", "mxfp8-floor", "mxfp8", "--opt-level", "O1", "--no-probe"],
    "gpt-mxfp8-seed1": ["--model", "gpt", "--precision", "bf16", "mxfp8-floor", "mxfp8", "--opt-level", "O1",
                        "--seed", "1", "--no-probe"],
    # Numerics (issue 13). The paper's experiment: float16 with no, static, dynamic and per-layer loss scaling.
    "gpt-loss-scaling": ["--model", "gpt", "--precision", "fp16", "--opt-level", "O1",
                         "--loss-scale", "none", "static", "dynamic", "adaptive", "--no-probe"],
    # The same at the gradient magnitudes of a 16x larger batch (32,768 tokens a step): there float16 without
    # loss scaling stalls, and bf16 (float32's exponent range) needs none.
    "gpt-underflow": ["--model", "gpt", "--precision", "bf16", "fp16", "--opt-level", "O1", "--loss-scale", "none",
                      "static", "dynamic", "adaptive", "--loss-divisor", "16", "--no-probe"],
    # O2 against float32 and O1 on two more seeds (trajectories of one seed differ by a few percent).
    "gpt-seed1": ["--model", "gpt", "--seed", "1", "--no-probe"],
    "gpt-seed2": ["--model", "gpt", "--seed", "2", "--no-probe"],
    # Pure bfloat16 (no masters) with plain, Kahan and stochastic-rounding updates, against O2.
    "gpt-pure16": ["--model", "gpt", "--precision", "bf16", "--opt-level", "O2", "O3",
                   "--update", "plain", "kahan", "stochastic", "--no-probe"],
    "digits-pure16": ["--precision", "bf16", "--opt-level", "O2", "O3", "--update", "plain", "kahan", "stochastic",
                      "--no-probe"],
    # A verdict across seeds (issue 67): every setting over 3 seeds, the table's means and spreads, a sentence each
    "digits-seeds3": ["--seeds", "3"],
    "gpt-seeds3": ["--model", "gpt", "--seeds", "3", "--no-probe"],
    # torch.compile (issue 23): float32 and bf16 O1, each eager and compiled, in one interleaved comparison.
    "gpt-compile": ["--model", "gpt", "--precision", "fp32", "bf16", "--opt-level", "O1", "--compile", "both",
                    "--no-probe"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="+", choices=sorted(WORKLOADS))
    parser.add_argument("--kind", help="the machine's kind, in the record's folder name (e.g. native-bf16)")
    args = parser.parse_args()
    for name, options in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        target = RESULTS / f"compare-{name}{f'-{args.kind}' if args.kind else ''}-{args.device}"
        RESULTS.mkdir(exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=RESULTS, prefix=".staging-"))
        command = ["ampkit", "compare", *options, *(["--device", args.device] if args.device != "cpu" else [])]
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "ampkit.cli.main", *command[1:], "--out", str(staging / "run"), "--quiet"],
            text=True, capture_output=True,
        )
        wall_s = time.perf_counter() - start
        if done.returncode != 0:
            shutil.rmtree(staging)
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
        (staging / "run" / "command.json").write_text(json.dumps({"command": " ".join(command), "wall_s": wall_s}) + "\n")
        print(done.stdout)
        shutil.rmtree(target, ignore_errors=True)
        (staging / "run").rename(target)
        staging.rmdir()
        print(f"{' '.join(command)}: {wall_s:.0f} s; wrote {target}")


if __name__ == "__main__":
    main()
