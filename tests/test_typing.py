"""The public API is typed: mypy passes on src/ (STYLE.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # over 5 s here; CI runs it (deselect with -m "not slow")
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is a test extra: pip install -e '.[test]'")
def test_mypy_passes_on_src(tmp_path: Path) -> None:
    # its cache in the test's own folder: the test command writes nothing in the checkout
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), "src/"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
