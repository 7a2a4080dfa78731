"""`ampkit env`: what this machine supports for mixed precision, and what to use."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import torch
from rich.console import Console
from rich.table import Table

from ampkit.hardware import throughput
from ampkit.hardware.advice import recommend, report
from ampkit.hardware.flags import native_support
from ampkit.hardware.throughput import OP_CLASSES, Throughput, cache_path


def add_parser(subparsers: argparse._SubParsersAction, line: str) -> None:
    """Add this command's parser; ``line`` is its help line in ``ampkit --help`` (cli/main.py)."""
    parser = subparsers.add_parser(
        "env", help=line,
        description="What this machine supports in 16 bits (CPU flags, GPU compute capability), the measured speed "
        "of its 16-bit kernels against float32 (cached per machine), and the dtype, compute mode and opt level "
        "ampkit recommends here.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--remeasure", action="store_true",
                        help="time the 16-bit kernels again instead of reading this machine's cached figures")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.remeasure:
        throughput.measure("cpu", refresh=True)
        if torch.cuda.is_available():
            throughput.measure("cuda", refresh=True)
    hw = report()
    advice = recommend()
    if args.json:
        payload = {"hardware": dataclasses.asdict(hw), "recommendation": dataclasses.asdict(advice)}
        print(json.dumps(payload, indent=2, default=str))
        return 0
    console = Console()
    table = Table(title="ampkit env", show_header=False)
    table.add_row("torch", hw.torch_version)
    table.add_row("CUDA", hw.cuda_version or "not in this build")
    table.add_row("CPU", f"{hw.cpu} ({hw.cpu_cores} cores, torch kernels: {hw.cpu_capability})")
    table.add_row("CPU features", " ".join(f"{name}={'yes' if ok else 'no'}" for name, ok in hw.cpu_features.items()))
    table.add_row("CPU native bf16 / fp16", f"{hw.cpu_native_bf16} / {hw.cpu_native_fp16}")
    for gpu in hw.gpus:
        table.add_row(
            f"GPU {gpu.index}",
            f"{gpu.name}, compute capability {gpu.compute_capability}, {gpu.memory_bytes / 2**30:.0f} GiB; "
            f"tensor cores: fp16 {gpu.fp16_tensor_cores}, bf16 {gpu.bf16_tensor_cores}, fp8 {gpu.fp8_tensor_cores}",
        )
    if not hw.gpus:
        table.add_row("GPU", "none visible")
    console.print(table)
    for measured in hw.measured:
        console.print(speed_table(measured))
    console.print(f"Recommended on {advice.device}: dtype {advice.dtype}, compute {advice.compute}, "
                  f"opt level {advice.opt_level}, loss scaling {'on' if advice.loss_scaling else 'off'}; "
                  f"fastest here: {advice.fastest}")
    for reason in advice.reasons:
        console.print(f"  - {reason}")
    for caution in advice.warnings:
        console.print(f"  ! {caution}")
    return 0


def speed_table(measured: Throughput) -> Table:
    """Measured speed of native 16-bit kernels against float32, with the flags that explain it."""
    device = measured.device.split(":")[0]
    table = Table(title=f"Measured on {measured.device_name} ({measured.device}), {measured.measured_at} "
                        f"({_age(measured.measured_at)})",
                  caption="speed of the native 16-bit kernel over float32's (above 1: faster); best of several "
                  "calls; noise: the spread of the repeats (a difference inside it does not change the compute "
                  f"mode); cached in {cache_path()}; `ampkit env --remeasure` measures again")
    table.add_column("op class")
    for dtype in (torch.bfloat16, torch.float16):
        table.add_column(str(dtype).removeprefix("torch."), justify="right")
    table.add_column("float32 time", justify="right")
    table.add_column("noise", justify="right")
    for op in OP_CLASSES:
        shape = "x".join(map(str, measured.shapes[op]))
        cells = [f"{measured.speedup(op, dtype):.3g}x" for dtype in (torch.bfloat16, torch.float16)]
        noise = f"{measured.noise[op]:.0%}" if op in measured.noise else "-"
        table.add_row(f"{op} ({shape})", *cells, f"{measured.time_us[op]['float32']:.0f} us", noise)
    table.add_row(
        "why", *(native_support(device, dtype) for dtype in (torch.bfloat16, torch.float16)), "", ""
    )
    return table


def _age(measured_at: str) -> str:
    """How long ago ``measured_at`` (ISO 8601, local time) was: ``3 days ago``, ``just now``."""
    try:
        seconds = (datetime.datetime.now() - datetime.datetime.fromisoformat(measured_at)).total_seconds()
    except ValueError:
        return "when unknown"
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"
