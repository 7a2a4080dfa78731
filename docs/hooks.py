"""MkDocs hook: the CLI and API reference pages are generated from the code, never retyped.

``<!-- cli-reference -->`` becomes each subcommand's ``--help`` (from the argparse parsers that
``ampkit`` itself builds); ``<!-- api-reference -->`` becomes one mkdocstrings entry per name of
``ampkit.__all__``, in its groups, and per name of ``ampkit.distributed.__all__``. ``tests/test_docs.py`` checks both against the code.
"""

from __future__ import annotations

import os
from typing import Any

CLI_MARK = "<!-- cli-reference -->"
API_MARK = "<!-- api-reference -->"
HELP_COLUMNS = "100"  # argparse wraps to $COLUMNS: fixed, so the page does not depend on the terminal


def cli_reference() -> str:
    """Markdown: ``ampkit --help`` and ``ampkit <command> --help`` for every subcommand, as argparse prints them."""
    os.environ["COLUMNS"] = HELP_COLUMNS
    from ampkit.cli.main import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    parts = ["## ampkit", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in subparsers.choices.items():
        parts += [f"## ampkit {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def api_groups() -> list[tuple[str, list[str]]]:
    """``ampkit.__all__`` in the groups its source comments name (``# Casting`` ...), from ``ampkit._WHERE``."""
    import inspect

    import ampkit

    groups: list[tuple[str, list[str]]] = []
    source = inspect.getsource(ampkit)
    listing = source[source.index("_WHERE: dict[str, str] = {"):]
    for line in listing.splitlines()[1:]:
        line = line.strip()
        if line.startswith("#"):
            groups.append((line.lstrip("# "), []))
        elif line.startswith('"'):
            groups[-1][1].append(line.split('"')[1])
        elif line.startswith("}"):
            break
    return groups


def api_reference() -> str:
    """Markdown: a ``::: ampkit.NAME`` entry (mkdocstrings) per public name, grouped; then
    ``ampkit.distributed.__all__`` (imported on use, so not re-exported by ``ampkit``)."""
    import ampkit.distributed

    parts: list[str] = []
    for title, names in api_groups():
        parts += [f"## {title}", ""]
        parts += [f"::: ampkit.{name}\n" for name in names]
    parts += ["## Distributed (`ampkit.distributed`)", ""]
    parts += [f"::: ampkit.distributed.{name}\n" for name in ampkit.distributed.__all__]
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    if API_MARK in markdown:
        markdown = markdown.replace(API_MARK, api_reference())
    return markdown
