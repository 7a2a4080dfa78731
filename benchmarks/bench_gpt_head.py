"""Why bf16 lost to float32 on the GPT: an ablation of what stays in float32.

`ampkit compare`'s GPT (seed 0, its default 400 steps, batch 32, lr 6e-3 with compare's schedule) trained in one
process per setting, the same batches for all, GEMMs in float32 on bf16 values:

- float32;
- O1 (torch.autocast's lists): float32 residual stream, bf16 logits from the tied head;
- O1 with ``with_modules("lm_head", dtype=torch.float32)``: float32 logits;
- O2 (norms in float32, everything else bf16: a bf16 residual stream and bf16 logits);
- O2 with ``keep_float32=[nn.Embedding]``: float32 residual stream, and float32 logits from the tied head.

Final train loss = mean of the last 40 steps. Writes results/gpt-head.json.

    python benchmarks/bench_gpt_head.py
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import ampkit
from ampkit.experiment import data as data_mod
from ampkit.experiment.settings import MODEL_DEFAULTS
from ampkit.experiment.models import GPT
from ampkit.experiment.config import CONTEXT
from ampkit.experiment.training import final_steps, lr_factor
from common import save

SETTINGS = ("fp32", "O1", "O1 lm_head float32", "O2", "O2 embeddings float32")


def train(setting: str) -> list[float]:
    defaults = MODEL_DEFAULTS["gpt"]
    dataset = data_mod.load("text")
    torch.manual_seed(0)
    model = GPT(vocab_size=256, context=CONTEXT)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=defaults["lr"])
    dtype = torch.bfloat16
    if setting.startswith("O1"):
        policy = ampkit.Policy.default("cpu", dtype, compute="float32")
        if "lm_head" in setting:
            policy = policy.with_modules("lm_head", dtype=torch.float32)
        model, optimizer = ampkit.initialize(model, optimizer, "O1", dtype, policy=policy)  # type: ignore[assignment]
    elif setting.startswith("O2"):
        keep = [torch.nn.Embedding] if "embeddings" in setting else []
        model, optimizer = ampkit.initialize(model, optimizer, "O2", dtype, compute="float32",  # type: ignore[assignment]
                                             keep_float32=keep)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, defaults["steps"]))
    losses = []
    for index in data_mod.batches(dataset, defaults["batch_size"], defaults["steps"], 0, CONTEXT):
        x, y = data_mod.windows(dataset.train_x, index, CONTEXT)
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    warnings.simplefilter("ignore", ampkit.ComputeModeWarning)
    results = {}
    for setting in SETTINGS:
        start = time.perf_counter()
        losses = train(setting)
        final = statistics.fmean(losses[-final_steps(len(losses)):])
        results[setting] = {"final_train_loss": final, "losses": losses, "wall_s": time.perf_counter() - start}
    base = results["fp32"]["final_train_loss"]
    table = Table("setting", "final train loss", "vs float32")
    for setting, result in results.items():
        table.add_row(setting, f"{result['final_train_loss']:.4f}", f"{result['final_train_loss'] / base:.3f}x")
    Console().print(table)
    print(f"wrote {save('gpt-head', {'settings': results})}")


if __name__ == "__main__":
    main()
