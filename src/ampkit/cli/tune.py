"""`ampkit tune`: choose each linear's format from measured sensitivity and cost; print the table, write the plan."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ampkit.experiment.data import DATASETS
from ampkit.experiment.hf_models import HELP as HF_HELP
from ampkit.experiment.models import MODELS
from ampkit.experiment.tuning import run_tune
from ampkit.planning.precision_plan import BASES, LOWER, PrecisionPlan
from ampkit.planning.tune import OBJECTIVES


def add_parser(subparsers: argparse._SubParsersAction, line: str) -> None:
    """Add this command's parser; ``line`` is its help line in ``ampkit --help`` (cli/main.py)."""
    parser = subparsers.add_parser(
        "tune", help=line,
        description="Lowers each candidate linear alone, measures the loss change and the saving, and keeps the "
        "plan within --tolerance; writes the plan for `ampkit compare --plan`.")
    parser.add_argument("--model", default="gpt", help=f"{' | '.join(MODELS)} | {HF_HELP} | "
                        "pkg.module:factory (default gpt)")
    parser.add_argument("--data", default=None, help=f"{' | '.join(DATASETS)} (default: text for gpt, else digits)")
    parser.add_argument("--formats", nargs="+", default=["fp8", "bf16"], choices=[*LOWER, *BASES],
                        help="formats to lower to and the 16-bit base (default: fp8 bf16)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="relative loss change allowed (default 0.01)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="time",
                        help="time: ms per step saved; memory: saved-for-backward bytes (default time)")
    parser.add_argument("--batches", type=int, default=8, help="batches measured, a quarter held out (default 8)")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--include", nargs="+", default=[], help="first or last linears to consider too")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("plan.json"), help="the plan file (default plan.json)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--quiet", action="store_true", help="no line per layer measured")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.out.is_dir():  # --force replaces a plan file, never a directory (the measurement would run first)
        raise ValueError(f"--out {args.out} is a directory; the plan is one file: pass a file path, e.g. --out "
                         f"{args.out / 'plan.json'}.")
    if args.out.exists() and not args.force:
        raise ValueError(f"--out {args.out} exists: pass --force to replace it, or another --out.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compute-mode notice: the table says what ran
        plan, _ = run_tune(args.model, args.data, args.formats, args.tolerance, args.objective, args.batches,
                           args.batch_size, args.include, args.seed, args.device,
                           None if args.quiet else lambda line: print(f"ampkit tune: {line}", file=sys.stderr,
                                                                      flush=True))
    console = Console()
    console.print(table(plan, console.width))
    plan.save(args.out, overwrite=args.force)
    print(f"wrote {args.out}: {len(plan.lowered())} of {len(plan.layers)} linears lowered; held-out loss change "
          f"{plan.measured_loss_change:.3%} (predicted {plan.predicted_loss_change:.3%}, tolerance "
          f"{plan.tolerance:.2%}); tuned in {plan.tune_s:.1f} s. Train with it: ampkit compare --plan {args.out}")
    return 0


WIDE = 140  # columns from which each figure gets a column of its own


def table(plan: PrecisionPlan, width: int = WIDE) -> Table:
    """The plan, a row per linear: on a console ``width`` columns wide, a column per figure (``WIDE`` and more), else
    the layer's name whole and its figures and reason wrapped in one column (at 80 columns every column was cut)."""
    unit = "ms/step" if plan.objective == "time" else "bytes"
    result = Table(title=f"ampkit tune: {plan.model}, base {plan.base}, objective {plan.objective}"
                   + (" (the lowered formats run emulated here: their cost is emulation's)" if plan.emulated else ""))
    wide = width >= WIDE
    result.add_column("layer", no_wrap=True)
    for column in ("shape", "format"):
        result.add_column(column, no_wrap=not wide)
    for column in (("loss change", "gradient change", "saturation / underflow", f"saving ({unit})", "why") if wide
                   else ("measured, and why",)):
        result.add_column(column, ratio=1 if not wide else None)
    for layer in plan.layers:
        tried = list(layer.loss_change)
        saturation = {f: f"{'-' if layer.saturation[f] is None else f'{layer.saturation[f]:.1%}'} / "
                         f"{layer.underflow[f]:.1%}" for f in tried}
        if wide:
            cells = [" ".join(f"{f} {layer.loss_change[f]:.3%}" for f in tried),
                     " ".join(f"{f} {layer.gradient_change[f]:.3%}" for f in tried),
                     " ".join(f"{f} {saturation[f]}" for f in tried),
                     " ".join(f"{f} {layer.saving[f]:+.3g}" for f in tried), layer.why]
        else:
            cells = ["\n".join([*(f"{f}: loss {layer.loss_change[f]:.3%}, gradients {layer.gradient_change[f]:.3%}, "
                                  f"saturation / underflow {saturation[f]}, saves {layer.saving[f]:+.3g} {unit}"
                                  for f in tried), layer.why])]
        result.add_row(layer.name, f"{layer.shape[0]}x{layer.shape[1]}", layer.format, *cells)
    return result
