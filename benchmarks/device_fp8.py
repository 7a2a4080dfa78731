"""Native FP8 against emulation on a GPU with FP8 matmuls: the same 20 GPT steps, both recipes.

Delayed scaling (ampkit's own) and current scaling (torchao) train the `ampkit compare` GPT on the same
batches with native ``F.scaled_mm`` and with emulation (float32 matmuls on the FP8-rounded values);
the losses should agree to about FP8's rounding. Absolute times are this GPU's, labelled as such.

    python benchmarks/device_fp8.py --out fp8-cuda.json   # a CUDA device with compute capability >= 8.9
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ampkit
from ampkit.experiment.config import CONTEXT
from ampkit.experiment.data import batches, load, windows
from ampkit.experiment.models import GPT
from ampkit.files import atomic_write
from ampkit.formats import fp8

STEPS = 20


def train(recipe: ampkit.Fp8Recipe, native: bool, data: list[torch.Tensor], stream: torch.Tensor,
          device: str) -> dict:
    torch.manual_seed(0)
    model = GPT(vocab_size=256, context=CONTEXT).to(device)
    original = fp8.native_fp8
    fp8.native_fp8 = lambda device: native  # delayed scaling asks per call; current scaling takes emulate=
    try:
        ampkit.convert_to_fp8(model, recipe, emulate=not native)
        optimizer = torch.optim.AdamW(model.parameters(), lr=6e-3)
        policy = ampkit.Policy.default(device, torch.bfloat16)
        losses, times = [], []
        for starts in data:
            x, y = (t.to(device) for t in windows(stream, starts, CONTEXT))
            sync(device)
            t0 = time.perf_counter()
            with ampkit.autocast(policy):
                logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    finally:
        fp8.native_fp8 = original
    timed = sorted(times[2:] or times)
    return {"losses": losses, "median_step_ms": 1000 * timed[len(timed) // 2]}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (emulation on both sides)")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    native_here = args.device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    if args.device == "cuda" and not native_here:
        raise SystemExit("device_fp8.py needs a CUDA GPU with FP8 matmuls (compute capability >= 8.9)")
    dataset = load("text")
    stream = dataset.train_x
    data = batches(dataset, 32, args.steps, 0, CONTEXT)
    name_of_device = torch.cuda.get_device_name(0) if native_here else "cpu (smoke run: emulated on both sides)"
    record = {"device": name_of_device, "torch": torch.__version__, "steps": args.steps, "runs": {}}
    for name, recipe in (("delayed", ampkit.Fp8Recipe()), ("current", ampkit.Fp8Recipe(scaling="current"))):
        native = train(recipe, native_here, data, stream, args.device)
        emulated = train(recipe, False, data, stream, args.device)
        worst = max(abs(a - b) / max(abs(b), 1e-8) for a, b in zip(native["losses"], emulated["losses"]))
        record["runs"][name] = {"native": native, "emulated": emulated, "max_relative_loss_difference": worst}
        print(f"{name}: native {native['median_step_ms']:.1f} ms/step, emulated {emulated['median_step_ms']:.1f} "
              f"ms/step (absolute times on {name_of_device}); losses differ by at most {worst:.2%}")
    text = json.dumps(record, indent=2)
    atomic_write(args.out, lambda tmp: tmp.write_text(text + "\n"))


if __name__ == "__main__":
    main()
