"""Entry point of the `ampkit` console script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ampkit.cli import compare, env, inspect_cmd, ops

SUBCOMMANDS = [compare, inspect_cmd, env, ops]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampkit", description="Mixed precision training toolkit for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit code (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as error:  # bad input the parser could not see: message, exit 2
        print(f"ampkit {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # child runs were stopped on the way out; no traceback
        print(f"ampkit {args.command}: interrupted; results already written are kept.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
