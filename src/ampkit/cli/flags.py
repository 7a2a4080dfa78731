"""Library errors name parameters (``batch_size=0``); the CLI shows them as its flags (``--batch-size 0``)."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

# Parameter of the library call -> the flag that sets it.
FLAGS = {
    "model": "--model", "data": "--data", "precisions": "--precision", "opt_levels": "--opt-level",
    "batch_size": "--batch-size", "epochs": "--epochs", "steps": "--steps", "lr": "--lr", "device": "--device",
    "seed": "--seed", "computes": "--compute", "loss_scales": "--loss-scale", "updates": "--update",
    "loss_divisor": "--loss-divisor", "out": "--out", "activation_budgets": "--activation-budget",
    "grad_accums": "--grad-accum", "micro_batches": "--micro-batches", "states": "--states", "update": "--update",
}
_PARAMETER = re.compile(rf"\b({'|'.join(FLAGS)})=(\[[^\]]*\]|'[^']*'|[^\s,:;)]+)")


def _value(text: str) -> str:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a placeholder such as DIR, or a number with its sentence's full stop
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def as_flags(message: str) -> str:
    """``message`` with each ``parameter=value`` written as the flag that sets it.

    Examples:
        >>> as_flags("batch_size=0 is invalid; precisions=['fp8', 'bf16']")
        '--batch-size 0 is invalid; --precision fp8 bf16'
    """
    return _PARAMETER.sub(lambda m: f"{FLAGS[m.group(1)]} {_value(m.group(2))}", message)


def directory(text: str) -> Path:
    """An ``--out`` value: a directory path, never empty (``Path("")`` is the current directory, where results
    would land among the user's own files)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give a directory, e.g. --out runs/first")
    path = Path(text)
    try:
        path.exists()  # a name longer than the file system takes, a path through a file: said now, not after the run
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text[:40]}{'...' if len(text) > 40 else ''} cannot be a directory here "
                                         f"({error.strerror}): give a shorter path, e.g. --out runs/first") from None
    return path
