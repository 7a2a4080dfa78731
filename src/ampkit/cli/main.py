"""Entry point of the `ampkit` console script."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from ampkit.cli.flags import as_flags

# Each command's module and the line ``ampkit --help`` shows for it. The modules import torch (2 s and more), so
# only the command being run, or whose help is asked, is imported: ``ampkit --help`` needs none of them.
COMMANDS = {
    "compare": ("ampkit.cli.compare", "train in float32 and mixed precision, compare time, memory and accuracy"),
    "tune": ("ampkit.cli.tune", "choose each linear's format (FP8, block-scaled, 16-bit) from measured sensitivity "
             "and cost"),
    "inspect": ("ampkit.cli.inspect_cmd", "where a model overflows or underflows in 16 bits, and why"),
    "env": ("ampkit.cli.env", "show 16-bit support of this CPU/GPU and the recommended settings"),
    "ops": ("ampkit.cli.ops", "print the op lists of the default policy"),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with the full parsers of ``commands`` (default: all) and a name and help line for the rest."""
    parser = argparse.ArgumentParser(prog="ampkit", description="Mixed precision training toolkit for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    full = set(COMMANDS if commands is None else commands)
    for name, (module, line) in COMMANDS.items():
        if name in full:
            importlib.import_module(module).add_parser(subparsers, line)
        else:
            subparsers.add_parser(name, help=line)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwind as Ctrl-C does (stopping child runs, keeping partial results), then exit 143."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """A warning as a command's line (``warning: ...``, as ``compare`` prints its runs'), not Python's
    ``/path/bin/ampkit:8: ComputeModeWarning: ...`` with ``sys.exit(main())`` under it."""
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit code (2 for bad input,
    130 on Ctrl-C, 143 on SIGTERM)."""
    words = list(sys.argv[1:] if argv is None else argv)
    command = next((word for word in words if not word.startswith("-")), None)  # ampkit's own options take no value
    args = build_parser([command] if command in COMMANDS else []).parse_args(words)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        with warnings.catch_warnings():  # put back as they were after the command
            warnings.showwarning = _show_warning
            return int(args.run(args))
    except _Terminated:
        print(f"ampkit {args.command}: terminated; results already written are kept.", file=sys.stderr)
        return 143
    except ValueError as error:  # bad input the parser could not see: message, exit 2
        print(f"ampkit {args.command}: error: {as_flags(str(error))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # child runs were stopped on the way out; no traceback
        print(f"ampkit {args.command}: interrupted; results already written are kept.", file=sys.stderr)
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
