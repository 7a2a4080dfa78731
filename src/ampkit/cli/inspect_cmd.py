"""`ampkit inspect`: per-layer float16/bfloat16 range report, loss-scale advice, memory and alignment."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from ampkit.cli.flags import directory
from ampkit.diagnostics.alignment import check_alignment
from ampkit.diagnostics.memory import estimate_memory
from ampkit.diagnostics.nonfinite import find_nonfinite
from ampkit.diagnostics.numerics import NumericsReport, inspect_numerics, write_histogram
from ampkit.experiment import data as data_mod
from ampkit.experiment.config import CONTEXT
from ampkit.experiment.hf_models import HELP as HF_HELP
from ampkit.experiment.models import MODELS, build, check_output
from ampkit.experiment.settings import model_defaults
from ampkit.files import strict_json, writable_directory
from ampkit.formats.recipes import BlockScaledRecipe, Fp8Recipe
from ampkit.modes import MIXED_LEVELS
from ampkit.precision.decide import decision_of
from ampkit.precision.policy import Policy

MIB = 2**20


def add_parser(subparsers: argparse._SubParsersAction, line: str) -> None:
    """Add this command's parser; ``line`` is its help line in ``ampkit --help`` (cli/main.py)."""
    parser = subparsers.add_parser(
        "inspect", help=line,
        description="Runs one batch of the model under a 16-bit policy and reports each layer's value ranges "
        "against the format's (overflow, underflow), the memory the opt level would take and the dimensions "
        "that do not suit 16-bit GEMMs; with --find-nonfinite, the first op that makes inf/NaN.")
    parser.add_argument("--model", default="resnet18", help=f"{' | '.join(MODELS)} | {HF_HELP} | "
                        "pkg.module:factory")
    parser.add_argument("--data", default=None, help="digits | mnist:DIR | text | synthetic (default: digits; text for gpt)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 32 (8 for text models)")
    parser.add_argument("--opt-level", default="O2", choices=MIXED_LEVELS, help="for the memory estimate")
    parser.add_argument("--find-nonfinite", choices=["fp16", "bf16"], help="also run under this policy and name the "
                        "first op that makes inf/NaN (slow: checks every op)")
    parser.add_argument("--fp8", action="store_true", help="also name the linears FP8 (E4M3/E5M2, per-tensor scales) "
                        "would lose values of")
    parser.add_argument("--block-scaled", choices=["mxfp8", "mxfp4", "nvfp4"],
                        help="also report, per linear, how this block-scaled format casts its input, weight and "
                             "output gradient (saturated blocks, flushed values, block range)")
    parser.add_argument("--out", type=directory, help="directory for the histogram (default: ./ampkit-runs/inspect-<time>/)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text_model = (model_defaults(args.model) or {}).get("data") == "text"
    data_name = args.data or ("text" if text_model else "digits")
    if text_model and data_name != "text" or args.model in ("resnet18", "mlp") and data_name == "text":
        raise ValueError(f"--model {args.model} and --data {data_name} do not fit: text goes with gpt (or your own "
                         "text model), images with resnet18, mlp or your own image model.")
    out = args.out or Path("ampkit-runs") / datetime.datetime.now().strftime("inspect-%Y%m%d-%H%M%S")
    histogram = out / "grad_histogram.png"
    if histogram.exists():
        raise ValueError(f"{histogram} exists; ampkit never overwrites results. Pass another --out.")
    dataset = data_mod.load(data_name)
    torch.manual_seed(0)
    model = build(args.model, **dataset.model_kwargs(CONTEXT))
    batch = (8 if dataset.kind == "text" else 32) if args.batch_size is None else args.batch_size
    available = len(dataset.train_x) // (CONTEXT + 1) if dataset.kind == "text" else len(dataset.train_y)
    if not 1 <= batch <= available:
        raise ValueError(f"--batch-size {batch} is invalid: use 1 to {available} ({data_name} has {available} "
                         f"{'windows' if dataset.kind == 'text' else 'training samples'}).")
    if dataset.kind == "text":
        x, y = data_mod.windows(dataset.train_x, torch.arange(batch) * (CONTEXT + 1), CONTEXT)
    else:
        # Copies, not views: a view keeps the whole dataset's storage, which the memory estimate would count.
        x, y = dataset.train_x[:batch].clone(), dataset.train_y[:batch].clone()

    with torch.no_grad():  # the model's output, checked as compare checks it (a tuple, a wrong shape: one line)
        check_output(args.model, model(x), dataset.num_classes, tuple(y.shape))
    # Before the work, after every check of the model and batch: a refused command leaves no folder behind.
    writable_directory(out)
    report = inspect_numerics(model, x, y, fp8=Fp8Recipe() if args.fp8 else None,
                              block_scaled=BlockScaledRecipe(args.block_scaled) if args.block_scaled else None)
    memory = estimate_memory(model, x, args.opt_level)
    alignment = check_alignment(model)
    nonfinite = None
    policy = Policy.default("cpu", args.find_nonfinite or "bf16")
    if args.find_nonfinite:
        nonfinite = find_nonfinite(model, x, policy, target=y)
    write_histogram(report, histogram)

    if args.json:
        payload = {"numerics": dataclasses.asdict(report), "memory": dataclasses.asdict(memory),
                   "alignment": [dataclasses.asdict(a) for a in alignment],
                   "nonfinite": dataclasses.asdict(nonfinite) if nonfinite else None,
                   "nonfinite_compute": decision_of(policy).label if args.find_nonfinite else None,
                   "histogram": str(histogram)}
        non_finite: list[str] = []
        payload = strict_json(payload, "", non_finite)  # inf/NaN as null, their places listed: strict JSON
        payload["non_finite"] = non_finite
        print(json.dumps(payload, indent=2, allow_nan=False))
        return 0
    console = Console()
    # No name or figure cut at 80 columns: light borders, headers on two lines, the module's type only where there
    # is room for it (at 80 columns it cut every other column), and a name too long for its column (a transformers
    # model's "model.layers.0.post_attention_layernorm") folded onto a second line, whole, not the figures cut.
    typed = console.width >= 100
    table = Table(title=f"ampkit inspect: {args.model} on {data_name}, batch {batch} (float32 pass)",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for header in ("module", *(["type"] if typed else []), "max\n|act|", "act >\n65504", "max\n|grad|",
                   "grad fp16\nsubnormal", "grad\nfp16 -> 0", "grad\nbf16 -> 0"):
        named = header in ("module", "type")
        table.add_column(header, justify="left" if named else "right", no_wrap=not named, overflow="fold")
    for m in report.modules:
        g = m.gradient
        table.add_row(
            m.name, *([m.type] if typed else []), f"{m.activation.max_abs:.3g}",
            f"{100 * m.activation.fp16_overflow:.2f}%", "-" if g is None else f"{g.max_abs:.3g}",
            "-" if g is None else f"{100 * g.fp16_subnormal:.2f}%", "-" if g is None else f"{100 * g.fp16_zero:.2f}%",
            "-" if g is None else f"{100 * g.bf16_zero:.2f}%",
        )
    console.print(table)
    if args.fp8:
        console.print(_fp8_table(report))
    if args.block_scaled:
        console.print(_block_table(report))
    for reason in report.reasons:
        console.print(f"- {reason}")
    mem = Table(title=f"Memory estimate, MiB ({memory.parameters:,} parameters, AdamW)", box=box.SIMPLE_HEAD,
                pad_edge=False, collapse_padding=True)  # as the ranges' table: whole at 80 columns
    for header in ("setting", "weights", "gradients", "master\nweights", "optimizer\nstates", "activations", "total"):
        named = header == "setting"
        mem.add_column(header, justify="left" if named else "right", no_wrap=not named, overflow="fold")
    for row in (memory.float32, memory.mixed):
        mem.add_row(row.label, *(f"{v / MIB:.1f}" for v in (row.weights, row.gradients, row.master_weights,
                                                         row.optimizer_states, row.activations, row.total)))
    console.print(mem)
    # tensor cores are a GPU's: on a machine without one, the dimensions are listed for a later GPU run, not advised
    where = "" if torch.cuda.is_available() else " (it matters on a GPU; this machine has none, so nothing to change here)"
    if alignment:
        console.print(f"Tensor-core alignment{where}: {len(alignment)} dimension(s) not a multiple of 8:")
        for a in alignment:
            console.print(f"  {a.module} ({a.type}) {a.dimension} = {a.size}: a GPU run would pad it to {a.padded}")
    else:
        console.print(f"Tensor-core alignment{where}: every Linear/Conv/Embedding dimension is a multiple of 8.")
    if args.find_nonfinite:
        console.print(f"First inf/NaN under {args.find_nonfinite} (compute: {decision_of(policy).label}): " + (
            "none" if nonfinite is None else
            f"{nonfinite.op} in {nonfinite.module} ({nonfinite.phase}), input ranges {nonfinite.input_ranges}"))
    console.print(f"Wrote {histogram}")
    return 0


def _casts_table(report: NumericsReport, title: str, headers: tuple[str, ...], layer: Any, cells: Any) -> Table:
    """Per linear, one row per cast tensor (input, weight, output gradient): ``layer(module)`` gives the
    module's casts (or None), ``cells(cast)`` the figures after the module, tensor and format columns."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)  # as the ranges' table
    for header in ("module", "tensor", "format", *headers):
        named = header in ("module", "tensor", "format")
        table.add_column(header, justify="left" if named else "right", no_wrap=named)
    for m in report.modules:
        casts = layer(m)
        if casts is None:
            continue
        for what, cast in (("input", casts.input), ("weight", casts.weight), ("gradient", casts.gradient)):
            if cast is not None:
                table.add_row(m.name if what == "input" else "", what, cast.format, *cells(cast))
    return table


def _fp8_table(report: NumericsReport) -> Table:
    """Per linear, how FP8 casts its input, weight and output gradient (``--fp8``)."""
    return _casts_table(report, "FP8 casts per linear (scale: the layer's delayed scale, or current scaling's)",
                        ("amax", "scale", "clamped", "-> 0"), lambda m: m.fp8,
                        lambda c: (f"{c.amax:.3g}", f"{c.scale:.3g}", f"{100 * c.overflow:.2f}%",
                                   f"{100 * c.underflow:.2f}%"))


def _block_table(report: NumericsReport) -> Table:
    """Per linear, how a block-scaled format casts its input, weight and output gradient (``--block-scaled``)."""
    return _casts_table(report, "Block-scaled casts per linear (blocks along each GEMM's reduction dimension)",
                        ("saturated blocks", "-> 0", "block range median", "widest"), lambda m: m.block,
                        lambda c: (f"{100 * c.saturated_blocks:.1f}%", f"{100 * c.flushed:.2f}%",
                                   f"{c.range_median:.3g}", f"{c.range_max:.3g}"))
