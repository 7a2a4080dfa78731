"""The front door and the manual: README under 150 lines with every link resolving, the site builds with
``mkdocs build --strict``, its CLI reference is what ``--help`` prints, its API reference lists every name
of ``ampkit.__all__``, and every public object has the docstring STYLE.md asks for."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ampkit
import ampkit.distributed
from ampkit.cli.main import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import hooks  # noqa: E402  (docs/hooks.py: what the site generates)

needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or
                                  importlib.util.find_spec("mkdocstrings") is None,
                                  reason="the docs extra: pip install -e '.[docs]' (the test extra has it)")


def test_the_readme_is_a_front_door_under_150_lines_whose_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 150
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert len(links) >= 12  # one line per capability, each a page
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == []
    assert "ampkit compare" in text and "python -m pytest -q" in text and "## Layout" in text


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(argv)
    return out.getvalue().rstrip()


def test_the_cli_reference_is_what_help_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    page = hooks.cli_reference()
    monkeypatch.setenv("COLUMNS", hooks.HELP_COLUMNS)
    commands = list(COMMANDS)
    names = list(next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices).choices)
    assert len(names) == len(commands) == 5
    for name in names:
        assert f"## ampkit {name}\n\n```text\n{_help([name, '--help'])}\n```" in page
    assert _help(["--help"]) in page


def test_the_api_reference_lists_every_public_name() -> None:
    listed = [name for _, names in hooks.api_groups() for name in names]
    assert sorted(listed) == sorted(ampkit.__all__) and len(listed) == len(set(listed))
    assert all(f"::: ampkit.{name}" in hooks.api_reference() for name in ampkit.__all__)
    assert all(f"::: ampkit.distributed.{name}" in hooks.api_reference() for name in ampkit.distributed.__all__)


def _public_objects() -> list[tuple[str, object]]:
    found: list[tuple[str, object]] = []
    public = [(name, getattr(ampkit, name)) for name in ampkit.__all__]
    public += [(name, getattr(ampkit.distributed, name)) for name in ampkit.distributed.__all__]
    for name, obj in public:
        found.append((name, obj))
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_"):
                    target = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                    if callable(target):
                        found.append((f"{name}.{attr}", target))
    return found


def _missing_sections(name: str, obj: object) -> list[str]:
    doc = inspect.getdoc(obj) or ""
    if not doc.strip():
        return ["a docstring"]
    missing = []
    if inspect.isfunction(obj) and "." not in name:
        signature = inspect.signature(obj)
        if [p for p in signature.parameters if p not in ("self", "args", "kwargs")] and "Args:" not in doc:
            missing.append("Args:")
        if signature.return_annotation not in (None, "None", inspect.Signature.empty) and "Returns:" not in doc:
            missing.append("Returns:")
    elif inspect.isclass(obj) and not issubclass(obj, BaseException):
        fields = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
        if fields and not re.search(r"^(Args|Attributes):", doc, re.M):
            missing.append("Args: or Attributes:")
    return missing


def test_every_public_object_has_the_docstring_style_asks_for() -> None:
    gaps = {name: missing for name, obj in _public_objects() if (missing := _missing_sections(name, obj))}
    assert gaps == {}


def test_the_docstring_check_finds_a_gap() -> None:
    def undocumented(x: int) -> int:
        """Summary only."""
        return x

    assert _missing_sections("undocumented", undocumented) == ["Args:", "Returns:"]


@needs_mkdocs
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert all(f'id="ampkit.{name}"' in api for name in ampkit.__all__)  # mkdocstrings found every object
    assert all(f'id="ampkit.distributed.{name}"' in api for name in ampkit.distributed.__all__)
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "usage: ampkit compare" in cli and "--loss-divisor" in cli
