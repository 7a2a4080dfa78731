"""The package's shape: no import circle (of modules or of subpackages), no upward import, leaves import nothing
of ampkit, no module over 400 lines, torch privates only in the shims (ampkit/_torch.py, ampkit/_torch_tensors.py),
the README's map matches the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ampkit"
README = Path(__file__).resolve().parents[1] / "README.md"

# Modules of vocabulary: every other module may import them, they import nothing of ampkit.
LEAVES = {"ampkit._torch", "ampkit._torch_tensors", "ampkit.files", "ampkit.modes", "ampkit.precision.op_lists",
          "ampkit.formats.recipes", "ampkit.shards"}
# The layers that use the library; the library never imports them (not even inside a function).
USERS = ("ampkit.cli", "ampkit.experiment", "ampkit.integrations")
# What counts as reaching into torch's privates (the patterns shared/hooks/before-stop looks for, and more).
PRIVATE = re.compile(r"torch\._C\b|torch\._dynamo\.|torch\._functorch|torch\._ops\b|torch\._utils\b|_saved_self|"
                     r"_forward_cls|_fwd_used_autocast|torch\.utils\._|torch\._[a-z]\w*\(|_NormBase")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The ampkit modules ``name`` imports (anywhere in it, functions too), with the packages
    whose ``__init__`` each import runs, less ``name``'s own packages (already running)."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names if a.name.startswith("ampkit"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ampkit"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                targets.add(sub if sub in MODULES else node.module)
    with_packages = set()
    for target in targets:
        parts = target.split(".")
        with_packages.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    own = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")) + 1)}
    return {t for t in with_packages if t in MODULES and t not in own}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _package(name: str) -> str:
    """The subpackage (or top-level module) ``name`` belongs to: ``ampkit.precision`` for its modules."""
    return ".".join(name.split(".")[:2])


def _package_graph() -> dict[str, set[str]]:
    """Which subpackages import which, from the modules' imports (a package's ``__init__`` counts as its own)."""
    graph: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        graph.setdefault(_package(name), set()).update(
            _package(t) for t in targets if _package(t) not in (_package(name), "ampkit"))
    return graph


def _cycle(graph: dict[str, set[str]] | None = None) -> list[str] | None:
    """One import circle in ``graph`` (the modules' by default), as a path of names, or None."""
    graph = GRAPH if graph is None else graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_walk_finds_the_package_and_its_imports() -> None:
    # a walk that found nothing would pass every check below
    assert len(MODULES) > 40 and "ampkit.precision.regions" in MODULES
    assert "ampkit.precision.kernels" in GRAPH["ampkit.precision.regions"]
    assert "ampkit.precision" in GRAPH["ampkit.scaling.adaptive"] or "ampkit.float32_compute" in GRAPH[
        "ampkit.scaling.adaptive"]


def test_no_import_circle() -> None:
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_a_circle_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(GRAPH, "ampkit.modes", GRAPH["ampkit.modes"] | {"ampkit.precision.regions"})
    assert _cycle() is not None


def test_no_import_circle_between_subpackages() -> None:
    """Modules without a circle can still make one of packages (precision and float32_compute imported each
    other, as did planning and diagnostics): a package is a layer, and layers import one way."""
    graph = _package_graph()
    assert "ampkit.float32_compute" in graph["ampkit.precision"]  # the walk sees packages' imports
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_a_circle_of_subpackages_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # a diagnostics module importing a planning module that imports no diagnostics
    monkeypatch.setitem(GRAPH, "ampkit.diagnostics.nonfinite",
                        GRAPH["ampkit.diagnostics.nonfinite"] | {"ampkit.planning.segments"})
    assert _cycle() is None  # no circle of modules
    assert _cycle(_package_graph()) is not None


def test_the_library_never_imports_the_cli_the_experiment_or_the_integrations() -> None:
    upward = {(name, target) for name, targets in GRAPH.items() if not name.startswith(USERS)
              for target in targets if target.startswith(USERS)}
    assert upward == set()
    experiment_up = {(n, t) for n, ts in GRAPH.items() if n.startswith("ampkit.experiment")
                     for t in ts if t.startswith(("ampkit.cli", "ampkit.integrations"))}
    assert experiment_up == set()


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaves_import_nothing_of_ampkit(leaf: str) -> None:
    assert GRAPH[leaf] == set()


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_400_lines(name: str) -> None:
    assert len(MODULES[name].read_text().splitlines()) <= 400


def test_torch_privates_only_in_the_shim() -> None:
    offenders = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for name, path in MODULES.items() if name not in ("ampkit._torch", "ampkit._torch_tensors")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line.split("#")[0]) and not line.lstrip().startswith(('"', "'", "``"))
    ]
    assert offenders == []


def test_the_readme_layout_names_every_module() -> None:
    text = README.read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    missing = []
    for name, path in MODULES.items():
        relative = path.relative_to(PACKAGE)
        folder = f"{relative.parent}/" if relative.parent != Path(".") else None
        if relative.name == "__init__.py" and folder:
            continue  # a subpackage's docstring: its folder line stands for it
        if relative.name not in layout or (folder and folder not in layout):
            missing.append(str(relative))
    assert missing == []


def test_the_names_the_readme_documented_before_the_layout_still_work() -> None:
    import ampkit
    import ampkit.distributed

    assert ampkit.memory.measured_state_bytes is ampkit.measured_state_bytes
    for name in ("Compression", "HookState", "compression_hook", "reduce_", "DistributedOptimizer", "init_from_env"):
        assert callable(getattr(ampkit.distributed, name))
    from ampkit.experiment.data import load  # noqa: F401
    from ampkit.experiment.models import GPT, ResNet18  # noqa: F401


def test_private_torch_names_only_go_down() -> None:
    """``benchmarks/private_names.py``'s totals, held to today's so that none is added: issue 71 takes them to 8
    names or fewer, none of dynamo, AOTAutograd or inductor, and none outside the shims."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("private_names", SRC.parent / "benchmarks" / "private_names.py")
    assert spec is not None and spec.loader is not None
    lister = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lister)
    found = lister.find()
    # the lister sees the shim's names, those reached through an object, and a private class through ``nn``
    assert {"torch._foreach_copy_", "torch.utils._python_dispatch", "Tensor._values"} <= found.keys()
    assert "nn.modules.conv._ConvNd" in lister._DOTTED.findall("nn.modules.conv._ConvNd: (1, 2)")
    totals = lister.summary(found)
    assert totals["names"] <= 7 and not totals["internals"], totals
    assert totals["outside_the_shims"] == {}
