"""Where the GPT's gradients sit against float16's range (Micikevicius et al., 2018, Figure 3).

Trains `ampkit compare`'s GPT on the stdlib text in float32 for a while, then records
one step's gradients: the activation gradients (each layer's output gradient) and
the weight gradients, as a histogram of log2|g|, and the fraction of nonzero values
that float16 would flush to zero (below half its smallest subnormal, 2**-25) or hold
as subnormals (below 2**-14) at loss scales 1, 1/16 (no scaling, the loss divided by 16
as in the gpt-underflow record), 2**10 (the static setting) and 2**16.
Writes results/gradients.json and results/gradients.png.

    python benchmarks/bench_gradients.py [--steps 100]
"""

from __future__ import annotations

import argparse
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ampkit.experiment import data as data_mod  # noqa: E402
from ampkit.experiment.settings import MODEL_DEFAULTS  # noqa: E402
from ampkit.experiment.models import GPT  # noqa: E402
from ampkit.experiment.config import CONTEXT, STATIC_SCALE  # noqa: E402
from ampkit.experiment.training import lr_factor  # noqa: E402
from ampkit.files import atomic_write  # noqa: E402
from common import RESULTS, save  # noqa: E402

# 1/16: no scaling with the loss divided by 16, as `compare --loss-divisor 16` (gradients of a 16x larger batch)
SCALES = {"1": 1.0, "1/16 (loss / 16)": 2.0**-4, "static 2^10": STATIC_SCALE, "2^16": 2.0**16}
BINS = torch.arange(-50, 21)  # log2 bins


def collect(steps: int) -> dict[str, torch.Tensor]:
    """Train in float32 for ``steps``, then one step's activation and weight gradients (flattened)."""
    defaults = MODEL_DEFAULTS["gpt"]
    dataset = data_mod.load("text")
    torch.manual_seed(0)
    model = GPT(vocab_size=256, context=CONTEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=defaults["lr"])
    plan = data_mod.batches(dataset, defaults["batch_size"], steps + 1, 0, CONTEXT)
    # compare's schedule over its default run length: the recorded step is where a compare run would be
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, defaults["steps"]))

    def loss_of(index: torch.Tensor) -> torch.Tensor:
        x, y = data_mod.windows(dataset.train_x, index, CONTEXT)
        return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    for index in plan[:-1]:
        optimizer.zero_grad()
        loss_of(index).backward()
        optimizer.step()
        scheduler.step()
    activations: list[torch.Tensor] = []
    hooks = [m.register_full_backward_hook(lambda m, gi, go: activations.append(go[0].detach().flatten()))
             for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    optimizer.zero_grad()
    loss_of(plan[-1]).backward()
    for hook in hooks:
        hook.remove()
    weights = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"activation gradients": torch.cat(activations), "weight gradients": weights}


def summarize(values: torch.Tensor) -> dict[str, object]:
    nonzero = values[values != 0].abs().double()
    log2 = nonzero.log2()
    counts = torch.histc(log2.float(), bins=len(BINS) - 1, min=float(BINS[0]), max=float(BINS[-1]))
    fractions = {}
    for name, scale in SCALES.items():
        scaled = nonzero * scale
        fractions[name] = {
            "flushed": float((scaled < 2.0**-25).double().mean()),
            "subnormal": float(((scaled >= 2.0**-25) & (scaled < 2.0**-14)).double().mean()),
            "overflow": float((scaled > 65504).double().mean()),
        }
    return {"values": int(values.numel()), "zeros": int((values == 0).sum()), "log2_min": float(log2.min()),
            "log2_median": float(log2.median()), "log2_max": float(log2.max()),
            "histogram": counts.tolist(), "bins": BINS.tolist(), "fractions": fractions}


def plot(summaries: dict[str, dict[str, object]], path: str) -> None:
    fig, axes = plt.subplots(1, len(summaries), figsize=(12, 3.6), sharey=False)
    for ax, (name, summary) in zip(axes, summaries.items()):
        bins = summary["bins"]
        counts = summary["histogram"]
        total = sum(counts) or 1
        ax.bar(bins[:-1], [c / total for c in counts], width=1.0, align="edge", color="#4c72b0")  # type: ignore[index]
        ax.axvspan(bins[0], -25, color="#d62728", alpha=0.12, label="float16 flushes to 0 (< 2^-25)")  # type: ignore[index]
        ax.axvspan(-25, -14, color="#ff7f0e", alpha=0.12, label="float16 subnormal")
        ax.axvline(math.log2(65504), color="k", lw=0.8, label="float16 max")
        ax.set_title(f"GPT {name} (float32, loss scale 1)")
        ax.set_xlabel("log2 |gradient|")
        ax.set_ylabel("fraction of nonzero values")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    atomic_write(RESULTS / path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100, help="float32 training steps before the recorded one")
    args = parser.parse_args()
    summaries = {name: summarize(values) for name, values in collect(args.steps).items()}
    plot(summaries, "gradients.png")
    path = save("gradients", {"steps_before": args.steps, "summaries": summaries})
    for name, summary in summaries.items():
        print(name, {k: summary[k] for k in ("values", "zeros", "log2_min", "log2_median", "log2_max")})
        for scale, fractions in summary["fractions"].items():  # type: ignore[attr-defined]
            print(f"  scale {scale}: {fractions}")
    print(f"wrote {path} and gradients.png")


if __name__ == "__main__":
    main()
