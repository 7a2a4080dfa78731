"""The torch releases ampkit supports, stated once: pyproject.toml's ``[tool.ampkit] tested-torch``. CI runs the
suite on each (.ci/run, .ci/torch_matrix.sh); the dependency's lower bound, the README's commands and the generated
lines of the README and docs/getting-started.md follow from that list, and a test here fails where one drifts."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TESTED = PROJECT["tool"]["ampkit"]["tested-torch"]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _generator():  # benchmarks/make_benchmarks_md.py, which imports its neighbour common.py
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("make_benchmarks_md", ROOT / "benchmarks/make_benchmarks_md.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_lower_bound_is_the_oldest_release_ci_tests() -> None:
    bound = next(d for d in PROJECT["project"]["dependencies"] if re.match(r"torch\b", d))
    oldest = min(TESTED, key=_version)
    assert bound == f"torch>={'.'.join(oldest.split('.')[:2])}", (bound, oldest)
    assert len(TESTED) == len(set(TESTED)) >= 3


def test_the_shim_names_the_releases_ci_tests() -> None:
    from ampkit import _torch

    assert sorted(_torch.CHECKED, key=_version) == sorted(TESTED, key=_version)


def test_the_readme_commands_install_the_first_release() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in (line for line in readme.splitlines() if line.startswith("python -m pip show -q torch")):
        assert f"pip install torch=={TESTED[0]};" in command, command
    assert "python -m pytest -q" in readme and "&& ampkit compare" in readme


@pytest.mark.parametrize("page, block", [("README.md", "torch-versions"),
                                         ("docs/getting-started.md", "torch-versions-docs")])
def test_the_pages_name_the_tested_releases_as_generated(page: str, block: str) -> None:
    body = _generator().torch_versions_blocks()[block]
    text = (ROOT / page).read_text()
    assert f"<!-- generated:{block}:start -->\n{body}\n<!-- generated:{block}:end -->" in text, (
        f"{page} is out of date: run python benchmarks/make_benchmarks_md.py")
    for version in TESTED:
        assert version in body


def test_ci_runs_the_readme_command_then_every_other_release() -> None:
    run = (ROOT / ".ci/run").read_text()
    assert "grep -m1 -F 'python -m pytest -q' README.md" in run and "bash .ci/torch_matrix.sh" in run
    listed = subprocess.run(["bash", ".ci/torch_matrix.sh", "--list"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "AMPKIT_TORCH_VERSIONS": ""})
    assert listed.returncode == 0 and listed.stdout.split() == TESTED[1:], listed


def test_a_release_the_registry_does_not_serve_is_a_skipped_line_not_a_pass() -> None:
    done = subprocess.run(["bash", ".ci/torch_matrix.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AMPKIT_TORCH_VERSIONS": "9.9.9"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIPPED torch 9.9.9: the package registry does not serve it" in done.stdout
    assert "the README's test command" not in done.stdout  # nothing was installed or run for it


def test_a_release_out_of_cis_time_on_this_machine_is_a_skipped_line_naming_how_to_run_it() -> None:
    """CI stops at 90 minutes and machines differ over twice in speed: the matrix runs what fits in the budget .ci/run
    hands it (here 100 s left, and a whole suite of an hour: not even the loans tier fits) and says what it left out."""
    done = subprocess.run(["bash", ".ci/torch_matrix.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "AMPKIT_TORCH_VERSIONS": TESTED[1], "AMPKIT_CI_LEFT_S": "100",
                               "AMPKIT_CI_README_S": "3600"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (f"SKIPPED torch {TESTED[1]}: its loans tier needs about 840 s on this machine (the README's whole suite "
            "took 3600 s here)") in done.stdout, done.stdout
    assert f"run it with AMPKIT_TORCH_VERSIONS={TESTED[1]} bash .ci/torch_matrix.sh" in done.stdout
    assert "the README's test command" not in done.stdout  # nothing was installed or run for it
