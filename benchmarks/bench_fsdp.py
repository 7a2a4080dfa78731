"""Sharded mixed precision on 2 ranks: per-rank bytes per parameter and step time, DDP against FSDP2.

Settings (a GPT of width 256, 4 blocks, context 64, batch 8 per rank, AdamW), timed in alternation:
DDP float32; FSDP2 float32 (O0); FSDP2 ampkit O2 bf16 with float32 and with bf16 reduce-scatters;
FSDP2 with FP8 all-gathers (torchao's current scaling, emulated off Hopper). Per-rank memory is what
training keeps between steps (weights, gradients, optimizer states: ``measured_state_bytes`` on the
local shards), beside ``estimate_memory(..., world_size=2, sharding="fsdp")``'s figure.

    python benchmarks/bench_fsdp.py                  # gloo on this machine's CPUs
    python benchmarks/bench_fsdp.py --device cuda    # NCCL, one GPU per rank
writes benchmarks/results/fsdp.json (fsdp-cuda.json with --device cuda).
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ampkit
from ampkit.distributed import fully_shard, precompute_fp8_scales, sharding
from ampkit.experiment.models import GPT
from common import interleaved_medians, save

WORLD, WIDTH, LAYERS, CONTEXT, PER_RANK = 2, 256, 4, 64, 8


def _gpt(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(d_model=WIDTH, n_layers=LAYERS, n_heads=4, context=CONTEXT).to(device)


def _settings(device: torch.device) -> dict[str, tuple[torch.nn.Module, dict]]:
    """name -> (the model, estimate_memory's arguments for it)."""
    models = {"DDP float32": (DistributedDataParallel(_gpt(device)), {"opt_level": "O1", "sharding": "none"})}
    models["FSDP2 float32"] = (fully_shard(_gpt(device), opt_level="O0"), {"opt_level": "O1", "sharding": "fsdp"})
    for reduce_name, reduce_dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        model = fully_shard(_gpt(device), opt_level="O2", dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        models[f"FSDP2 O2 bf16, {reduce_name} reduce"] = (model, {"opt_level": "O2", "sharding": "fsdp"})
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return models
    model = _gpt(device)
    ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(scaling="current", fsdp_all_gather=True))
    models["FSDP2 FP8 all-gather (current)"] = (fully_shard(model, opt_level="O0"), {"opt_level": "O1", "sharding": "fsdp"})
    return models


def worker(rank: int, port: int, out: str, device_type: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (PER_RANK, CONTEXT + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    settings = _settings(device)
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, (model, _) in settings.items()}
    state_bytes: dict[str, int] = {}

    def step(name: str):  # type: ignore[no-untyped-def]
        model, optimizer = settings[name][0], optimizers[name]

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
            state_bytes[name] = ampkit.measured_state_bytes(model, optimizer)  # gradients present
            optimizer.step()
            if "FP8" in name:
                precompute_fp8_scales(model)
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    times = interleaved_medians({name: step(name) for name in settings}, warmup=2, repeats=7)
    total = sum(p.numel() for p in _gpt(torch.device("cpu")).parameters())
    results = {}
    for name, (model, estimate_args) in settings.items():
        sent = sharding(model).bytes_sent if estimate_args["sharding"] == "fsdp" else None
        estimate = ampkit.estimate_memory(_gpt(torch.device("cpu")), x[:, :].cpu(), estimate_args["opt_level"],
                                          "adamw", torch.bfloat16, loss_fn=lambda out: out.float().mean(),
                                          world_size=WORLD if estimate_args["sharding"] == "fsdp" else 1,
                                          sharding=estimate_args["sharding"])
        side = estimate.mixed if "O2" in name else estimate.float32
        predicted = side.weights + side.gradients + side.master_weights + side.optimizer_states
        results[name] = {"step_ms": times[name] * 1e3, "state_bytes_per_rank": state_bytes[name],
                         "bytes_per_parameter": state_bytes[name] / total, "estimate_bytes": predicted,
                         "estimate_over_measured": predicted / state_bytes[name],
                         "reduce_bytes_per_step": sent / (2 + 7) if sent is not None else None}
    if rank == 0:
        torch.save({"settings": results, "parameters": total}, Path(out) / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(port, out, args.device), nprocs=WORLD, join=True)
        result = torch.load(Path(out) / "result.pt")
    reference = result["settings"]["DDP float32"]["step_ms"]
    for row in result["settings"].values():
        row["step_vs_ddp"] = row["step_ms"] / reference
    result.update(world_size=WORLD, device=args.device, model=f"GPT width {WIDTH}, {LAYERS} blocks, context {CONTEXT}",
                  batch_per_rank=PER_RANK)
    path = save("fsdp" if args.device == "cpu" else "fsdp-cuda", result)
    for name, row in result["settings"].items():
        print(f"{name}: {row['step_ms']:.1f} ms ({row['step_vs_ddp']:.2f}x DDP), {row['bytes_per_parameter']:.2f} "
              f"B/param per rank, estimate {row['estimate_over_measured']:.3f}x measured")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
