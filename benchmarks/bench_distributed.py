"""Gradient compression on 2 gloo ranks of this machine: all-reduce time and bytes, and DDP step time.

- all-reduce of 25M gradient elements: float32 vs compressed float16 / bfloat16
  (pre-divided by sqrt(2)), the three timed in alternation;
- a training step of examples/train_ddp.py's model (ResNet-18 O1, batch 32 per
  rank) with the DDP default all-reduce vs ampkit's fp16 compression hook.

    python benchmarks/bench_distributed.py   # writes benchmarks/results/distributed.json
"""

from __future__ import annotations

import math
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ampkit
from ampkit.distributed import Compression, HookState, compression_hook, reduce_
from ampkit.experiment.models import ResNet18
from common import interleaved_medians, save

ELEMENTS = 25_000_000
WORLD = 2


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=300))
    grads = torch.randn(ELEMENTS)
    sent: dict[str, int] = {}

    def allreduce(name: str, compressor: ampkit.distributed.Compressor):  # type: ignore[no-untyped-def]
        def run() -> None:
            _, sent[name] = reduce_(grads.clone(), compressor, math.sqrt(WORLD))
        return run

    reduce_times = interleaved_medians(
        {"float32": allreduce("float32", Compression.none), "float16": allreduce("float16", Compression.fp16),
         "bfloat16": allreduce("bfloat16", Compression.bf16)},
        warmup=1, repeats=5,
    )

    torch.manual_seed(0)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    steps = {}
    for name, hook in (("DDP default (float32)", None), ("ampkit fp16 hook", compression_hook(torch.float16))):
        model = ResNet18()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, optimizer = ampkit.initialize(model, optimizer, "O1")
        ddp = DistributedDataParallel(model)
        if hook is not None:
            ddp.register_comm_hook(HookState(), hook)

        def step(ddp=ddp, optimizer=optimizer) -> None:  # type: ignore[no-untyped-def]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x).float(), y).backward()
            optimizer.step()

        steps[name] = step
    step_times = interleaved_medians(steps, warmup=2, repeats=7)
    if rank == 0:
        torch.save({"allreduce_ms": {k: v * 1e3 for k, v in reduce_times.items()}, "allreduce_bytes": sent,
                    "ddp_step_ms": {k: v * 1e3 for k, v in step_times.items()}}, Path(out) / "result.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(port, out), nprocs=WORLD, join=True)
        result = torch.load(Path(out) / "result.pt")
    ms, steps = result["allreduce_ms"], result["ddp_step_ms"]
    result["allreduce_ratio_to_float32"] = {k: v / ms["float32"] for k, v in ms.items()}
    result["ddp_step_ratio"] = steps["ampkit fp16 hook"] / steps["DDP default (float32)"]
    result["elements"], result["world_size"] = ELEMENTS, WORLD
    path = save("distributed", result)
    print(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
