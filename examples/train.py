"""Train a small CNN on the bundled handwritten digits with ampkit, at O1 or O2.

    python examples/train.py --opt-level O2 [--dtype bf16|fp16] [--epochs 3]

The float32 loop plus three lines: initialize, a loss scaler, and scaler.step/update.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.experiment.data import load


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16"], help="default: best for this hardware")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    data = load("digits")
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 10),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * 23)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: ampkit.recommend_dtype("cpu")}[args.dtype]
    model, optimizer = ampkit.initialize(model, optimizer, args.opt_level, dtype)  # +1
    scaler = ampkit.DynamicLossScaler(enabled=dtype == torch.float16)  # +2: bf16 needs no loss scaling

    for epoch in range(args.epochs):
        for index in torch.randperm(len(data.train_y)).split(64):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data.train_x[index]), data.train_y[index])
            scaler.scale(loss).backward()  # +3: step only when the gradients are finite
            if scaler.step(optimizer):
                scheduler.step()
            scaler.update()
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}, {scaler.stats.skipped} skipped steps")

    model.eval()
    with torch.no_grad():
        accuracy = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
    print(f"test accuracy {100 * accuracy:.1f}% ({args.opt_level})")
    return accuracy


if __name__ == "__main__":
    main()
