"""Train on the bundled digits with Hugging Face Accelerate, through ampkit.

    python examples/accelerate_digits.py --opt-level O2 --dtype fp16
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_digits.py --compression fp16

From Accelerate's own mixed precision, two lines change:
    accelerator = Accelerator(mixed_precision="fp16")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
becomes
    accelerator = Accelerator()
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler,
                                                  opt_level="O2", dtype=torch.float16)
The loop (accelerator.backward, optimizer.step, scheduler.step, save_state) stays Accelerate's.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from ampkit.experiment.data import load
from ampkit.integrations.accelerate import prepare

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


def loader(batch_size: int = 64, limit: int | None = None) -> torch.utils.data.DataLoader:
    data = load("digits")
    dataset = torch.utils.data.TensorDataset(data.train_x[:limit], data.train_y[:limit])
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


def train(accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, batches: object,
          scheduler: object, inf_at_step: int | None = None, clip: float | None = None) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches):  # type: ignore[call-overload]
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            losses.append(loss.item())
            if step == inf_at_step:
                loss = loss * float("inf")  # an overflow, to show the step being skipped
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)  # unscaled first, through ampkit's scaler
            optimizer.step()
            scheduler.step()  # Accelerate's prepared scheduler stays put when optimizer.step_was_skipped
            optimizer.zero_grad()
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16"], help="default: best for this hardware")
    parser.add_argument("--compute", default="auto", choices=["auto", "native", "float32"])
    parser.add_argument("--compression", default=None, choices=["bf16", "fp16"], help="DDP all-reduce dtype")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    accelerator = Accelerator()
    model, optimizer, scheduler = build()
    model, optimizer, batches, scheduler = prepare(
        accelerator, model, optimizer, loader(), scheduler, opt_level=args.opt_level, dtype=DTYPES[args.dtype],
        compute=args.compute, compression=DTYPES[args.compression])
    backwards = 0
    for epoch in range(args.epochs):
        losses = train(accelerator, model, optimizer, batches, scheduler)
        backwards += len(losses)
        stats = accelerator.scaler.stats
        accelerator.print(f"epoch {epoch + 1}: loss {losses[-1]:.4f}, {stats.skipped} skipped steps, "
                          f"loss scale {stats.scale:g}")
    hook = getattr(accelerator, "ampkit_hook_state", None)
    if hook is not None:
        float32_bytes = sum(p.numel() * 4 for p in model.parameters()) * backwards  # one all-reduce per backward
        print(f"rank {accelerator.process_index}: all-reduce bytes {hook.bytes_sent} "
              f"= {hook.bytes_sent / float32_bytes:.3f}x float32's {float32_bytes}")
    # Before exit, all collectives ended (the ranks meet), the model and the process group let go, and a pause:
    # else a gloo worker freeing the last collectives while the interpreter finalizes can abort the process after
    # training (SIGABRT, "terminate called without an active exception"; torch's fault: docs/distributed.md,
    # "Exiting a gloo process cleanly").
    accelerator.wait_for_everyone()
    model, optimizer, batches, scheduler = accelerator.free_memory(model, optimizer, batches, scheduler)
    accelerator.end_training()
    time.sleep(0.2)
    return losses


if __name__ == "__main__":
    main()
