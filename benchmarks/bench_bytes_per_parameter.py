"""Bytes per parameter (issue 42): O2 with its gradients accumulated in float32, against bfloat16 accumulation and
float32 training, and AdamW's moments in fewer bits, on the GPT of `ampkit compare`.

1. Training: one comparison per seed (0, 1 and 2; 400 steps, batch 32 in 4 micro-batches of 8, every run's steps
   interleaved) of float32, bf16 O2 with float32 and with bfloat16 gradient accumulation (`ampkit compare --model gpt
   --opt-level O2 --grad-accum fp32 bf16 --micro-batches 4`), bf16 O2 fp32-grads with the moments in bf16, 8 bits,
   4 bits and FP8 (`--states`), and pure bf16 with stochastic rounding (O3) with bf16 and 8-bit moments: each run's
   bytes per parameter, measured from its tensors after training, and its final train loss against float32's, with
   the mean over seeds.
2. Accumulation error: one step's gradients of the GPT at O2 accumulated over 64 micro-batches of 2 training
   windows (each micro-batch loss divided by 64), in float32 and in bfloat16, against the micro-batches'
   gradients taken one at a time and summed in float32: the relative error of each (the norm of the difference
   over the reference's, all parameters together).

3. A larger GPT (d_model 1024, 8 layers): each option's bytes per parameter by ``ampkit.estimate_memory`` (which
   equals the tensors' count, tests/test_optimizer_states.py): the fixed costs per tensor (torchao's code tables,
   the small tensors it leaves unquantized) weigh less on larger tensors.

``--accumulation-only`` measures parts 2 and 3 again and keeps part 1 from the existing record.

Writes results/bytes-per-parameter.json.

    python benchmarks/bench_bytes_per_parameter.py [--accumulation-only]
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import ampkit
from ampkit.experiment import comparison, data as data_mod, settings
from ampkit.experiment.config import CONTEXT
from ampkit.experiment.models import GPT
from ampkit.optim.grads import accumulate_in
from common import RESULTS, save

SEEDS = (0, 1, 2)
MICRO_BATCHES = 4
ACCUMULATED = 64  # micro-batches of the accumulation error
O2_STATES = ["bf16", "8bit", "4bit", "fp8"]  # beside O2 fp32-grads' float32 moments
O3_STATES = ["bf16", "8bit"]  # pure bf16 with stochastic rounding


def training(seed: int) -> dict[str, dict[str, float]]:
    common = dict(model="gpt", precisions=["bf16"], micro_batches=MICRO_BATCHES, seed=seed, probe=False)
    configs = settings.plan(opt_levels=["O2"], grad_accums=["fp32", "bf16"], **common)  # type: ignore[arg-type]
    configs += settings.plan(opt_levels=["O2"], grad_accums=["fp32"], states=O2_STATES, **common)[1:]  # type: ignore[arg-type]
    configs += settings.plan(opt_levels=["O3"], updates=["stochastic"], states=O3_STATES, **common)[1:]  # type: ignore[arg-type]
    result = comparison.compare(configs)
    return {run.label: {"bytes_per_parameter": run.state_bytes / run.parameters,
                        "final_train_loss": run.final_train_loss, "ms_per_step": run.ms_per_step}
            for run in result.runs}


def accumulation_errors() -> dict[str, float]:
    dataset = data_mod.load("text")
    torch.manual_seed(0)
    gpt = GPT(vocab_size=256, context=CONTEXT)
    index = data_mod.batches(dataset, 2 * ACCUMULATED, 1, 0, CONTEXT)[0]
    x, y = data_mod.windows(dataset.train_x, index, CONTEXT)
    batches = list(zip(x.chunk(ACCUMULATED), y.chunk(ACCUMULATED)))

    def loss(model: torch.nn.Module, xm: torch.Tensor, ym: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(xm).reshape(-1, 256).float(), ym.reshape(-1)) / ACCUMULATED

    models = {name: ampkit.initialize(copy.deepcopy(gpt), None, "O2", torch.bfloat16, grad_dtype=grad_dtype)[0]
              for name, grad_dtype in (("float32", torch.float32), ("bfloat16", None))}
    # Each micro-batch's gradients on their own, summed in float32. Taken from a float32-accumulating copy: within
    # one backward, the engine adds the two uses of the GPT's tied embedding in the leaf's gradient dtype.
    # (copy.deepcopy does not keep a parameter's grad_dtype: set again.)
    reference_model = copy.deepcopy(models["float32"])
    accumulate_in(reference_model.parameters(), torch.float32)
    reference: dict[str, torch.Tensor] = {}
    for xm, ym in batches:
        reference_model.zero_grad(set_to_none=True)
        loss(reference_model, xm, ym).backward()
        for name, p in reference_model.named_parameters():
            reference[name] = reference[name] + p.grad.float() if name in reference else p.grad.float()
    errors = {}
    for accumulation, model in models.items():
        for xm, ym in batches:
            loss(model, xm, ym).backward()
        grads = dict(model.named_parameters())
        difference = sum(((grads[n].grad.float() - r) ** 2).sum() for n, r in reference.items())
        errors[accumulation] = (difference / sum((r ** 2).sum() for r in reference.values())).sqrt().item()
    return errors


LARGER = dict(vocab_size=256, context=CONTEXT, d_model=1024, n_layers=8, n_heads=16)
# (label, opt level, gradient dtype, states, update) of the larger GPT's estimates
OPTIONS = [("fp32", "O1", None, None, "plain"), ("bf16 O2 fp32-grads", "O2", "fp32", None, "plain"),
           *[(f"bf16 O2 fp32-grads {s}-states", "O2", "fp32", s, "plain") for s in O2_STATES],
           *[(f"bf16 O3 stochastic {s}-states", "O3", None, s, "stochastic") for s in O3_STATES]]


def larger_model_estimates() -> dict[str, float]:
    torch.manual_seed(0)
    gpt = GPT(**LARGER)
    tokens = torch.randint(0, 256, (2, CONTEXT))
    parameters = sum(p.numel() for p in gpt.parameters())
    out = {}
    for label, level, grad_dtype, states, update in OPTIONS:
        estimate = ampkit.estimate_memory(gpt, tokens, level, grad_dtype=grad_dtype, states=states, update=update)
        kept = estimate.float32 if label == "fp32" else estimate.mixed
        out[label] = (kept.weights + kept.gradients + kept.master_weights + kept.optimizer_states) / parameters
    return out


def main() -> None:
    warnings.simplefilter("ignore", ampkit.ComputeModeWarning)
    start = time.perf_counter()
    if "--accumulation-only" in sys.argv[1:]:
        seeds = json.loads((RESULTS / "bytes-per-parameter.json").read_text())["seeds"]
    else:
        seeds = {str(seed): training(seed) for seed in SEEDS}
    labels = list(seeds["0"])
    summary = {}
    for label in labels:
        ratios = [seeds[s][label]["final_train_loss"] / seeds[s]["fp32"]["final_train_loss"] for s in seeds]
        speeds = [seeds[s][label]["ms_per_step"] / seeds[s]["fp32"]["ms_per_step"] for s in seeds]
        summary[label] = {"bytes_per_parameter": seeds["0"][label]["bytes_per_parameter"],
                          "final_loss_vs_float32": ratios, "mean_vs_float32": statistics.fmean(ratios),
                          "ms_per_step_vs_float32": statistics.fmean(speeds)}
    errors = accumulation_errors()
    larger = larger_model_estimates()
    table = Table("run", "bytes/parameter", *(f"loss vs fp32, seed {s}" for s in seeds), "mean")
    for label, row in summary.items():
        table.add_row(label, f"{row['bytes_per_parameter']:.2f}", *(f"{r:.4f}x" for r in row["final_loss_vs_float32"]),
                      f"{row['mean_vs_float32']:.4f}x")
    Console().print(table)
    print("A GPT of d_model 1024, 8 layers, by estimate_memory: "
          + ", ".join(f"{label} {value:.2f}" for label, value in larger.items()) + " bytes/parameter")
    print(f"{ACCUMULATED} micro-batches: relative error of float32 accumulation {errors['float32']:.2e}, "
          f"of bfloat16 accumulation {errors['bfloat16']:.2e}")
    path = save("bytes-per-parameter", {"seeds": seeds, "summary": summary, "accumulation_errors": errors,
                                        "micro_batches": MICRO_BATCHES, "accumulated": ACCUMULATED,
                                        "o2_states": O2_STATES, "o3_states": O3_STATES,
                                        "larger_model": {"config": LARGER, "bytes_per_parameter": larger},
                                        "wall_s": time.perf_counter() - start})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
