"""Train on the bundled digits with Lightning, through ampkit's precision plugin.

    python examples/lightning_digits.py --opt-level O2 --dtype fp16 [--strategy ddp --devices 2]

From Lightning's own mixed precision, one line changes:
    Trainer(precision="16-mixed")  ->  Trainer(plugins=[AmpkitPrecision("O2", torch.float16)])
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from ampkit.experiment.data import load
from ampkit.integrations.lightning import AmpkitPrecision


class Digits(L.LightningModule):
    def __init__(self, lr: float = 2e-3, inf_at_step: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 10))
        self.lr, self.inf_at_step = lr, inf_at_step
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        if self.trainer.global_step == self.inf_at_step:
            loss = loss * float("inf")  # an overflow, to show the step being skipped
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(batch_size: int = 64, limit: int | None = None) -> torch.utils.data.DataLoader:
    data = load("digits")
    x, y = data.train_x[:limit], data.train_y[:limit]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


def main(argv: list[str] | None = None) -> Digits:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16"], help="default: best for this hardware")
    parser.add_argument("--compute", default="auto", choices=["auto", "native", "float32"])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--strategy", default="auto", help="e.g. ddp (gradients all-reduced in float16)")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = Digits()
    precision = AmpkitPrecision(args.opt_level, args.dtype, compute=args.compute,
                                compression=torch.float16 if args.strategy.startswith("ddp") else None)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=args.strategy, max_steps=args.max_steps,
                        plugins=[precision], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, loader())
    stats = precision.scaler.stats
    print(f"rank {trainer.global_rank}: final loss {model.losses[-1]:.4f} ({precision.precision}, {args.opt_level}), "
          f"{stats.skipped} skipped steps, loss scale {stats.scale:g}")
    if precision.hook_state is not None:
        float32_bytes = sum(p.numel() * 4 for p in model.parameters()) * trainer.global_step
        print(f"rank {trainer.global_rank}: all-reduce bytes {precision.hook_state.bytes_sent} "
              f"= {precision.hook_state.bytes_sent / float32_bytes:.3f}x float32's {float32_bytes}")
    # Before exit, all collectives ended and a pause: else a gloo worker freeing the last ones while the interpreter
    # finalizes can abort the process after training (torch's fault: docs/distributed.md, "Exiting a gloo process
    # cleanly").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        time.sleep(0.2)
    return model


if __name__ == "__main__":
    main()
