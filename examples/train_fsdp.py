"""Sharded mixed precision training of `ampkit compare`'s GPT on FSDP2 (the Python standard library's text).

One machine, N processes (gloo on CPUs, NCCL on GPUs):
    torchrun --nproc-per-node 2 examples/train_fsdp.py --opt-level O2 --reduce-dtype bf16

Each rank holds 1/N of the float32 weights, gradients and AdamW states; O2 all-gathers each block's weights
in bf16 (norms in float32) and reduce-scatters the gradients in --reduce-dtype. With --checkpoint DIR the
run ends with a sharded checkpoint that loads on any number of ranks.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ampkit
from ampkit.distributed import fully_shard, init_from_env, prepare_optimizer, save_sharded_checkpoint, sharding
from ampkit.experiment.data import batches, load, windows
from ampkit.experiment.models import GPT


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--checkpoint", default=None, help="a folder for the sharded checkpoint at the end")
    parser.add_argument("--json", action="store_true", help="rank 0 prints a JSON summary at the end")
    args = parser.parse_args(argv)

    rank, world = init_from_env()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    data = load("text")
    torch.manual_seed(0)  # the same initial weights on every rank, before they are sharded
    model = GPT(**data.model_kwargs(args.context)).to(device)
    model = fully_shard(model, opt_level=args.opt_level, dtype=args.dtype, reduce_dtype=args.reduce_dtype)
    optimizer = prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-3))  # built after sharding
    scaler = ampkit.DynamicLossScaler(enabled=args.dtype == "fp16")  # agrees over the shards' group by itself

    # Every rank draws the same global batches and takes its own slice of each.
    plan = batches(data, args.batch_size * world, args.steps, seed=0, context=args.context)
    losses = []
    for step, starts in enumerate(plan):
        x, y = windows(data.train_x, starts[rank::world], args.context)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x.to(device)).float().flatten(0, 1), y.to(device).flatten())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)

    if args.checkpoint:
        save_sharded_checkpoint(args.checkpoint, model, optimizer, scaler=scaler, extra={"step": args.steps})
    layout = sharding(model)
    if rank == 0:
        summary = {"world_size": world, "first_loss": losses[0], "final_loss": losses[-1], "opt_level": args.opt_level,
                   "reduce_dtype": str(layout.reduce_dtype), "bytes_sent_per_rank": layout.bytes_sent,
                   "blocks": list(layout.blocks), "parameters_per_rank": sum(p.to_local().numel()
                                                                              for p in model.parameters())}
        print(json.dumps(summary) if args.json else summary, flush=True)
    # All collectives ended, then a pause: else a gloo worker freeing the last ones while the interpreter finalizes can
    # abort the process after training (torch's fault; docs/distributed.md, "Exiting a gloo process cleanly").
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.2)


if __name__ == "__main__":
    main()
