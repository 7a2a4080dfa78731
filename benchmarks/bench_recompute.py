"""Recompute on a budget: saved-for-backward and step time of the planner against Chen's sqrt(n) segments
and every-block checkpointing, on ResNet-18 (the digits' shape) and the GPT of `ampkit compare`, bf16 O1.

Per model, one interleaved timing of training steps (forward, backward, AdamW) of: float32; bf16 O1 without
a plan; bf16 O1 with the planner's plan at 0.85, 0.5 and 0.25 of its own saved-for-backward (or the smallest
feasible budget the planner names, when a budget is below what any block plan reaches), and at 0.85 and 0.5
without selective recompute (whole blocks only: what selective recompute gains, measured); sqrt(n); every
block, whole and selective (the selective variant's record has no predicted bytes: the plan was not made
for it; its measured bytes stand). Saved-for-backward is measured on the planned model (``saved_bytes_of_step``), beside the plan's
prediction.

    python benchmarks/bench_recompute.py   # writes benchmarks/results/recompute.json
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
import torch.nn.functional as F

import ampkit
from ampkit.diagnostics.memory import saved_bytes_of_step
from ampkit.experiment.models import GPT, ResNet18
from common import interleaved_medians, save

WORKLOADS = {
    "resnet18": (lambda: ResNet18(), lambda g: (torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,),
                                                                                                      generator=g))),
    "gpt": (lambda: GPT(), lambda g: (lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 256, (32, 65), generator=g))),
}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


def run_model(name: str) -> dict:
    make, data = WORKLOADS[name]
    x, y = data(torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    base = make()
    bf16, _ = ampkit.initialize(copy.deepcopy(base), None, "O1", torch.bfloat16)
    settings: dict[str, torch.nn.Module] = {"float32": copy.deepcopy(base), "bf16 O1": copy.deepcopy(bf16)}
    plans: dict[str, dict] = {}
    for label, budget, strategy, selective in (
            ("plan 0.85", 0.85, "auto", True), ("plan 0.85, whole blocks", 0.85, "auto", False),
            ("plan 0.5", 0.5, "auto", True), ("plan 0.5, whole blocks", 0.5, "auto", False),
            ("plan 0.25", 0.25, "auto", True), ("sqrt(n)", 1.0, "sqrt", False), ("every block", 1.0, "blocks", False)):
        model = copy.deepcopy(bf16)
        options = dict(strategy=strategy, selective=selective)
        try:
            plan = ampkit.plan_recompute(model, x, budget, lambda out: _loss(out, y), **options)
        except ValueError as error:  # below the block floor: plan at the floor the planner names
            floor = int(str(error).split("smallest feasible budget is ")[1].split(" ")[0])
            plan = ampkit.plan_recompute(model, x, floor, lambda out: _loss(out, y), **options)
            label = f"{label} (floor)"
        variants = [(label, plan)]
        if strategy == "blocks":  # and every block recomputed selectively: what that costs and frees
            variants.append(("every block, selective",
                             dataclasses.replace(plan, selective=tuple(s[0] for s in plan.segments),
                                                 extra_ms=sum(b.selective_ms for b in plan.blocks if b.name))))
        for label, plan in variants:
            selective_variant = label == "every block, selective"
            model = copy.deepcopy(bf16) if selective_variant else model
            plan.apply(model)
            settings[label] = model
            plans[label] = {"budget_bytes": plan.budget_bytes,
                            "predicted_bytes": None if selective_variant else plan.planned_bytes,
                            "segments": [list(s) for s in plan.segments], "selective": list(plan.selective),
                            "extra_ms": plan.extra_ms}
    optimizers = {label: torch.optim.AdamW(m.parameters(), lr=1e-4) for label, m in settings.items()}
    saved = {}
    for label, model in settings.items():
        _, saved[label] = saved_bytes_of_step(model, lambda model=model: _loss(model(x), y))

    def step(label: str):  # type: ignore[no-untyped-def]
        model, optimizer = settings[label], optimizers[label]

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            _loss(model(x), y).backward()
            optimizer.step()
        return run

    times = interleaved_medians({label: step(label) for label in settings}, warmup=2, repeats=41)
    reference = times["bf16 O1"]
    return {label: {"step_ms": times[label] * 1e3, "step_vs_bf16": times[label] / reference,
                    "saved_bytes": saved[label], "saved_vs_bf16": saved[label] / saved["bf16 O1"],
                    **plans.get(label, {})} for label in settings}


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    result = {"models": {name: run_model(name) for name in WORKLOADS},
              "batches": {"resnet18": "64 digits-shaped images", "gpt": "32 windows of 64 bytes"}}
    path = save("recompute", result)
    for model, rows in result["models"].items():
        for label, row in rows.items():
            print(f"{model} {label}: {row['step_ms']:.1f} ms ({row['step_vs_bf16']:.2f}x bf16), saved "
                  f"{row['saved_bytes'] / 2**20:.2f} MiB ({row['saved_vs_bf16']:.2f}x)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
