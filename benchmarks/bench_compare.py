"""The `ampkit compare` records: the default workload and the GPT on stdlib text.

Runs the same library calls as the CLI and keeps each comparison's results.json,
curves.png and summary.png under benchmarks/results/compare-<name>/ (replaced
as a whole: this script's job is to refresh them).

    python benchmarks/bench_compare.py [--device cuda] [--only digits|gpt]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from ampkit.experiment import comparison, report
from common import RESULTS

WORKLOADS = {"digits": {"model": "resnet18"}, "gpt": {"model": "gpt"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=sorted(WORKLOADS))
    args = parser.parse_args()
    for name, options in WORKLOADS.items():
        if args.only and name != args.only:
            continue
        result = comparison.compare(comparison.plan(device=args.device, **options))
        target = RESULTS / f"compare-{name}-{args.device}"
        staging = Path(tempfile.mkdtemp(dir=RESULTS, prefix=".staging-"))
        report.write_all(result, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        report.table(result)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
