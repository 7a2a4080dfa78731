"""`ampkit ops`: print the allow / deny / infer lists of a policy."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from ampkit.precision.op_lists import CATEGORIES
from ampkit.precision.policy import Policy


def add_parser(subparsers: argparse._SubParsersAction, line: str) -> None:
    """Add this command's parser; ``line`` is its help line in ``ampkit --help`` (cli/main.py)."""
    parser = subparsers.add_parser("ops", help=line)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="device type (default: cpu)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default=None, help="default: bf16 on cpu, fp16 on cuda")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    policy = Policy.default(args.device, args.dtype)
    table = Table(title=f"ampkit default policy: {args.device}, {policy.dtype}")
    table.add_column("list")
    table.add_column("runs in")
    table.add_column("ops")
    runs_in = {"allow": str(policy.dtype), "deny": "torch.float32", "infer": "widest input dtype"}
    for category in CATEGORIES:
        ops = sorted(getattr(policy, category))
        table.add_row(f"{category} ({len(ops)})", runs_in[category], " ".join(ops))
    Console().print(table)
    return 0
