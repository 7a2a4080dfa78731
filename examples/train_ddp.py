"""Data-parallel training of the `ampkit compare` default workload with 16-bit gradient compression.

One machine, N processes:
    torchrun --nproc-per-node 2 examples/train_ddp.py --compression fp16
Several machines (run on each node, node-rank 0..K-1):
    torchrun --nnodes K --node-rank R --nproc-per-node 8 --rdzv-backend c10d \
             --rdzv-endpoint HOST:29500 examples/train_ddp.py

Each rank trains ResNet-18 on its shard of the bundled digits; gradients cross
the wire in 16 bits through ampkit's DDP communication hook.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import ampkit
from ampkit.distributed import HookState, compression_hook, init_from_env
from ampkit.experiment.data import batches, load
from ampkit.experiment.models import ResNet18


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compression", default="fp16", choices=["none", "fp16", "bf16"])
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--json", action="store_true", help="rank 0 prints a JSON summary at the end")
    args = parser.parse_args(argv)

    rank, world = init_from_env()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    data = load("digits")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ResNet18().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = ampkit.initialize(model, optimizer, "O1")
    ddp = DistributedDataParallel(model)
    state = HookState()
    dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.compression]
    ddp.register_comm_hook(state, compression_hook(dtype))

    # Every rank draws the same global batches and takes its own slice of each.
    plan = batches(data, args.batch_size * world, args.steps, seed=0, context=0)
    for step, index in enumerate(plan):
        index = index[rank::world]
        x, y = data.train_x[index].to(device), data.train_y[index].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x).float(), y)
        loss.backward()
        optimizer.step()
        if rank == 0 and (step + 1) % 5 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)

    if rank == 0:
        summary = {"world_size": world, "final_loss": loss.item(), "bytes_sent_per_rank": state.bytes_sent,
                   "overflows": state.overflows, "compression": args.compression}
        print(json.dumps(summary) if args.json else summary, flush=True)
    # All collectives ended, then a pause: else a gloo worker freeing the last ones while the interpreter finalizes can
    # abort the process after training (torch's fault; docs/distributed.md, "Exiting a gloo process cleanly").
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.2)


if __name__ == "__main__":
    main()
