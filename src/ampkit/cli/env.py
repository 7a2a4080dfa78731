"""`ampkit env`: what this machine supports for mixed precision, and what to use."""

from __future__ import annotations

import argparse
import dataclasses
import json

from rich.console import Console
from rich.table import Table

from ampkit import hardware


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="show 16-bit support of this CPU/GPU and the recommended settings")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    hw = hardware.report()
    advice = hardware.recommend()
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
    console.print(f"Recommended on {advice.device}: dtype {advice.dtype}, opt level {advice.opt_level}, "
                  f"loss scaling {'on' if advice.loss_scaling else 'off'}")
    for reason in advice.reasons:
        console.print(f"  - {reason}")
    for caution in advice.warnings:
        console.print(f"  ! {caution}")
    return 0
