"""Start-up: ``import ampkit`` and ``ampkit --help`` load no more than they need (issue 41).

Timed by ``benchmarks/bench_startup.py`` (never by a test); here, what each start imports, which is what makes it
slow: nothing for ``import ampkit``, torch not at all for ``--help``; torch's compiler (dynamo, about 1 s here) with
ampkit's precision layer, whose functions carry torch.compile's marks (torch's optimizers import it when built).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_import_loads_no_torch_and_eager_use_sets_no_import_hook_nor_global_state() -> None:
    """``import ampkit`` loads nothing; eager use (regions edited, float32 compute, module overrides, a scaler) marks
    ampkit's own functions for dynamo where they are defined, so dynamo is imported with them, as torch's own
    optimizers import it when built: no import hook waits for it (issue 71), and ``sys.meta_path`` is as it was."""
    code = """
import sys, warnings
warnings.simplefilter("ignore")
finders = list(sys.meta_path)
import ampkit
print("torch" in sys.modules)
import torch
from torch import nn
for name in ampkit.__all__:
    getattr(ampkit, name)
model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32").with_ops(deny=["gelu"]).with_modules(
    nn.LayerNorm, dtype=torch.float32)
with ampkit.autocast(policy, model=model):
    loss = model(torch.randn(2, 8)).float().sum()
scaler = ampkit.DynamicLossScaler()
scaler.scale(loss).backward()
print(sys.meta_path == finders, "torch._dynamo" in sys.modules, "torch._inductor.compile_fx" in sys.modules)
print(getattr(ampkit.autocast.__enter__, "_torchdynamo_disable", False))
"""
    assert _run(code).splitlines() == ["False", "True True False", "True"]


def test_help_imports_no_torch_and_a_commands_help_its_own_module_only() -> None:
    code = """
import contextlib, io, sys
from ampkit.cli.main import main
for argv in (["--help"], ["ops", "--help"]):
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    print("torch" in sys.modules, sorted(m for m in sys.modules if m.startswith("ampkit.cli.") and m not in (
        "ampkit.cli.main", "ampkit.cli.flags")))
"""
    assert _run(code).splitlines() == ["False []", "True ['ampkit.cli.ops']"]


@pytest.mark.slow  # a compile: over 5 s here
def test_compiling_after_eager_use_marks_ampkit_for_dynamo_as_it_is_imported() -> None:
    """The marks (``torch.compiler.disable`` on a region's entry and on the override wrappers' code) are made where
    the functions are defined: a model whose forward opens a region, compiled after eager regions ran, gives the
    eager dtypes, and the region's entry is not traced."""
    code = """
import sys, warnings
warnings.simplefilter("ignore")
import torch
from torch import nn
import ampkit
policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="native").with_ops(deny=["linear"]).with_modules(
    nn.LayerNorm, dtype=torch.float32)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        with ampkit.autocast(policy, model=self):
            return self.norm(self.linear(x)).to(torch.bfloat16) @ self.linear.weight.T

model, x = Net(), torch.randn(4, 8)
eager = model(x)
print("torch._dynamo" in sys.modules)
compiled = torch.compile(model, backend="aot_eager")
got = compiled(x)
print(got.dtype == eager.dtype, torch.equal(got, eager))
print(getattr(ampkit.autocast.__enter__, "_torchdynamo_disable", False))
"""
    assert _run(code).splitlines() == ["True", "True True", "True"]


def test_override_wrappers_set_before_dynamo_is_imported_are_never_traced() -> None:
    """An override region open when torch.compile first compiles: the module's wrapper, made before, runs its
    override eagerly (its code is marked where it is defined), and a graph break inside the overridden module
    runs it in its dtype and leaves the region stack as it was."""
    code = """
import sys, warnings
warnings.simplefilter("ignore")
import torch
from torch import nn
import ampkit
from ampkit.precision import overrides
from ampkit.precision.state import state

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > -1e9:  # a graph break (.item()) that imports no dynamo in eager code
            h = h + 1
        return self.b(h)

model, x = nn.Sequential(nn.Linear(8, 8), Head(), nn.Linear(4, 4)), torch.randn(3, 8)
seen = []
for module in (model[1].a, model[1].b, model[2]):
    module.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="native").with_modules("1", dtype=torch.float32)
with ampkit.autocast(policy, model=model):
    eager = model(x)
    print("torch._dynamo" in sys.modules)
    got = torch.compile(model, backend="aot_eager")(x)
    print(len(state.stack), getattr(overrides._overridden, "_torchdynamo_disable", False))
print(seen == [torch.float32, torch.float32, torch.bfloat16] * 2, torch.equal(eager, got), state.stack == [])
"""
    assert _run(code).splitlines() == ["True", "1 True", "True True True"]


def test_the_suite_says_which_test_runs_long_without_touching_its_captured_output(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``pytest -q`` prints a dot as each test ends: the README's test command was silent for 45-212 s while its
    longest test ran, and 15 s while it collected. tests/heartbeat.py (started by conftest.py) writes a line every
    8 s that collection or a test runs (here every 0.5 s), on its own copy of the terminal, so a test that checks
    its captured output still sees only its own. Run with the plain ``pytest`` command, from the test's own folder,
    as a developer may: the heartbeat needs nothing on the path but the tests' folder."""
    import os
    import shutil
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text((tests / "conftest.py").read_text())  # the suite's, starting the heartbeat
    shutil.copy(tests / "heartbeat.py", tmp_path)
    (tmp_path / "test_long.py").write_text(
        "import time\n"
        "time.sleep(1.2)  # a slow import: collection takes as long\n"
        "def test_long(capfd):\n"
        "    print('own output')\n"
        "    time.sleep(1.6)\n"
        "    assert capfd.readouterr().out == 'own output\\n'\n")
    pytest_command = Path(sys.executable).with_name("pytest")  # the console script, not python -m pytest
    done = subprocess.run([str(pytest_command), "-q", "-p", "no:cacheprovider", "test_long.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AMPKIT_TEST_HEARTBEAT_S": "0.5"})
    assert done.returncode == 0, done.stdout[-2000:]
    # the test's node id (relative to the rootdir pytest picks: the temporary folder or one above it)
    beats = [line for line in done.stdout.splitlines()
             if re.fullmatch(r"\[(\S+/)?test_long\.py::test_long: still running after \d+ s\]", line)]
    assert len(beats) >= 2, done.stdout
    assert "[collecting the tests: still running after 1 s]" in done.stdout.splitlines()
