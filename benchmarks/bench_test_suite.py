"""How long the README's test command takes here: the whole suite, timed once, recorded with the machine.

    python benchmarks/bench_test_suite.py            (then python benchmarks/make_benchmarks_md.py)

It runs the command's test part (``python -m pytest -q``, read from README.md) in a subprocess and writes
``results/test-suite.json``: the wall time, the counts pytest printed, and the machine. The README's line on
the tests quotes it through the generator, with its machine and date: a figure from one machine, never a
constant in prose.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from common import save

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    command = re.search(r"python -m pytest -q[^`\n]*", (ROOT / "README.md").read_text())
    assert command, "README.md has no `python -m pytest -q` command"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *command.group(0).split()[1:]], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
    if done.returncode != 0:
        sys.exit(f"the test command failed (rc {done.returncode}): {last}; nothing recorded")
    path = save("test-suite", {"command": command.group(0), "seconds": round(seconds), "counts": counts})
    print(f"{command.group(0)}: {seconds / 60:.1f} min, {counts}; wrote {path}")


if __name__ == "__main__":
    main()
