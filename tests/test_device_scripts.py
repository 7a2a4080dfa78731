"""benchmarks/device_check.sh stays runnable on a GPU image with no registry: its rehearsal here
installs everything offline (--no-index) in a fresh venv and runs the steps that need no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "device_check.sh"


def test_the_device_steps_are_listed_with_budgets_inside_one_device_call() -> None:
    header = CHECK.read_text().split("set -uo pipefail")[0]
    budgets = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#   (\S+)\s+(\d+) s ", header, re.M)}
    assert list(budgets) == ["setup", "gpu-tests", "compare", "fp8", "autocast"]
    assert sum(budgets.values()) <= 9 * 60  # a device call runs 10 minutes at most
    body = CHECK.read_text().split("else\n", 1)[1]  # the GPU's branch
    # every step the script runs is bounded by its listed budget
    assert re.search(r"step setup 45 ", CHECK.read_text()) and re.search(r"step gpu-tests 60 ", body)
    assert "budget=150" in body and "budget=90" in body and "step autocast 150 " in body
    # the GPU-sized comparison (--size auto is CUDA's default) and the bench at that size, eager and compiled
    assert "--size auto" not in body and "--batch-size" not in body
    assert "fp8 fp8-current" in CHECK.read_text() and '--size "$size" --compile' in body
    whole = CHECK.read_text()
    assert "timeout --kill-after" in whole and "--no-index" in whole and "--no-deps" in whole


def test_at_least_25_gpu_tests_are_collected() -> None:
    # This interpreter's pytest, not the first on PATH: a venv run by its path without being activated
    # (.venv/bin/python -m pytest) has another python first there, maybe one without torch.
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "--collect-only"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    found = re.search(r"(\d+)/\d+ tests collected", done.stdout)
    assert found and int(found.group(1)) >= 25, done.stdout[-500:]


def _checkout_files() -> set[str]:
    """What git lists in the checkout, ignored files included (Python's own bytecode caches aside)."""
    done = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return {line for line in done.stdout.splitlines() if "__pycache__" not in line and ".pytest_cache" not in line}


@pytest.mark.slow  # about 35 s: a venv, an offline install, a tiny compare
def test_the_rehearsal_installs_offline_and_runs_the_cpu_steps() -> None:
    before = _checkout_files()
    # the suite's own Python: in a plain venv (a user's) the rehearsal must see the venv's torch, not its base's
    done = subprocess.run(["bash", "benchmarks/device_rehearsal.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "AMPKIT_REHEARSAL_PYTHON": sys.executable})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert _checkout_files() == before  # its downloads and ampkit's build stay in its temporary folder
    assert "steps that failed: none" in out and "torch privates missing here: none" in out
    carried = re.search(r"^torchao \S+ (\S+)", out, re.M)
    assert carried and "/site/torchao/" in carried.group(1)  # the carried wheel, not this machine's torchao
    assert re.search(r"rehearsal files: env.json fp8-cpu.json log.txt steps.txt", out)
