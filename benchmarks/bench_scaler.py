"""Loss-scaler overhead: unscale + inf/NaN check + update, ampkit vs torch.amp.GradScaler.

100 gradient tensors totalling 25M float32 elements, as a mid-sized model's
gradients; both scalers use the same tensors in the same run (alternating),
with a scale of 1.0 so repeated unscaling leaves the values alone, and an
optimizer whose step does nothing, so only the scaler's own work is timed.

    python benchmarks/bench_scaler.py   # writes benchmarks/results/scaler.json
"""

from __future__ import annotations

import torch

import ampkit
from common import interleaved_medians, save

TOTAL, COUNT = 25_000_000, 100


class NoStep(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        return None


def setup() -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    sizes = torch.linspace(0.2, 1.8, COUNT)
    sizes = (sizes / sizes.sum() * TOTAL).long()
    params = [torch.nn.Parameter(torch.zeros(int(n))) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params, NoStep(params, lr=0.0)


def main() -> None:
    params, opt = setup()
    loss = torch.zeros((), requires_grad=True)
    ours = ampkit.DynamicLossScaler(init_scale=1.0)
    theirs = torch.amp.GradScaler("cpu", init_scale=1.0)

    def step(scaler) -> None:  # type: ignore[no-untyped-def]
        scaler.scale(loss)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    medians = interleaved_medians({"ampkit": lambda: step(ours), "torch": lambda: step(theirs)}, warmup=2, repeats=15)
    result = {
        "tensors": COUNT,
        "elements": sum(p.numel() for p in params),
        "ms": {k: v * 1e3 for k, v in medians.items()},
        "ratio_to_grad_scaler": medians["ampkit"] / medians["torch"],
    }
    path = save("scaler", result)
    print(result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
