"""Entry point of the `ampkit` console script."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from ampkit.cli import compare, env, inspect_cmd, ops, tune
from ampkit.cli.flags import as_flags

SUBCOMMANDS = [compare, tune, inspect_cmd, env, ops]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampkit", description="Mixed precision training toolkit for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwind as Ctrl-C does (stopping child runs, keeping partial results), then exit 143."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit code (2 for bad input,
    130 on Ctrl-C, 143 on SIGTERM)."""
    args = build_parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
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
