"""How block-scaled formats train against bf16 (issue 68's quality runs and the NVFP4 recipe's ablation).

Each run is one `ampkit compare` setting (``settings.plan``, O1, the model's defaults but ``--steps``), trained by
``training.execute`` in a subprocess of its own (a fresh process per run: compiled casts and caches do not carry
over), seeds 0, 1 and 2. The final train loss is compare's (the mean of the last steps' losses). Every finished
run is saved at once, so an interrupted script keeps what it measured; ``--resume`` skips those runs.

- ``gpt`` (compare's GPT): bf16, mxfp8, nvfp4 (the full recipe), nvfp4-plain (the format alone), nvfp4 with
  each part of the recipe removed (the ablation) and nvfp4-4over6 (the recipe, each block scaled to 4 or 6);
- ``hf:llama`` (the zoo's Llama): bf16, mxfp8, nvfp4, nvfp4-plain, nvfp4-4over6.

Writes results/block-quality.json. With ``--set mxfp4``: bf16, MXFP4 alone and MXFP4's recipe (Tseng et al.:
a 16-bit forward, the backward in MXFP4 with the Hadamard transform and stochastic rounding) on both models, in
results/block-quality-mxfp4.json.

    python benchmarks/bench_block_quality.py [--steps 200] [--seeds 3] [--resume] [--set mxfp4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import RESULTS, save

RUNS = {
    "gpt": ("bf16", "mxfp8", "nvfp4", "nvfp4-plain", "nvfp4-no-tiles", "nvfp4-no-sr", "nvfp4-no-hadamard",
            "nvfp4-no-kept", "nvfp4-4over6"),
    "hf:llama": ("bf16", "mxfp8", "nvfp4", "nvfp4-plain", "nvfp4-4over6"),
}
SETS = {"issue": ("block-quality", RUNS),
        "mxfp4": ("block-quality-mxfp4", {model: ("bf16", "mxfp4", "mxfp4-recipe") for model in RUNS})}


def one_run(model: str, precision: str, steps: int, seed: int) -> dict[str, object]:
    """Train one setting in this process; its final loss, step time and losses."""
    import warnings

    from ampkit.experiment import settings, training

    warnings.simplefilter("ignore")
    config = next(c for c in settings.plan(model=model, precisions=[precision], opt_levels=["O1"], steps=steps,
                                           seed=seed, probe=False) if c.precision == precision)
    result = training.execute(config)
    return {"final_train_loss": result.final_train_loss, "ms_per_step": result.ms_per_step,
            "diverged": result.diverged, "losses": result.losses, "wall_s": result.wall_s}


def key(model: str, precision: str, seed: int) -> str:
    return f"{model} {precision} seed {seed}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--resume", action="store_true", help="keep the runs the record already holds")
    parser.add_argument("--set", choices=sorted(SETS), default="issue", help="which settings: issue 68's (default) or "
                        "MXFP4 alone against its recipe")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "PRECISION", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, precision, seed = args.one
        print(json.dumps(one_run(model, precision, args.steps, int(seed))))
        return
    name, table = SETS[args.set]
    path = RESULTS / f"{name}.json"
    runs: dict[str, dict[str, object]] = {}
    if args.resume and path.exists():
        previous = json.loads(path.read_text())
        if previous.get("steps") == args.steps:
            runs = previous["runs"]
    for seed in range(args.seeds):
        for model, precisions in table.items():
            for precision in precisions:
                if key(model, precision, seed) in runs:
                    continue
                found = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", model,
                                        precision, str(seed)], capture_output=True, text=True, env=os.environ)
                if found.returncode:
                    raise RuntimeError(f"{key(model, precision, seed)} failed:\n{found.stderr[-4000:]}")
                runs[key(model, precision, seed)] = json.loads(found.stdout.strip().splitlines()[-1])
                save(name, {"steps": args.steps, "runs": runs, "summary": summary(runs, table)})
                print(key(model, precision, seed), f"{runs[key(model, precision, seed)]['final_train_loss']}",
                      flush=True)
    print(json.dumps(summary(runs, table), indent=1))


def summary(runs: dict[str, dict[str, object]], settings: dict[str, tuple[str, ...]]) -> dict[str, dict[str, object]]:
    """Per model and precision: the seeds' final losses, their mean, and the mean against bf16's (seeds both ran)."""
    table: dict[str, dict[str, object]] = {}
    for model, precisions in settings.items():
        for precision in precisions:
            finals = {seed: runs[key(model, precision, seed)]["final_train_loss"] for seed in range(10)
                      if key(model, precision, seed) in runs}
            base = {seed: runs[key(model, "bf16", seed)]["final_train_loss"] for seed in finals
                    if key(model, "bf16", seed) in runs}
            if not finals or None in finals.values():
                table[f"{model} {precision}"] = {"finals": finals, "diverged": True}
                continue
            mean = statistics.fmean(finals.values())  # type: ignore[arg-type]
            paired = [s for s in finals if s in base]
            ratio = (statistics.fmean(finals[s] for s in paired) / statistics.fmean(base[s] for s in paired)  # type: ignore[misc]
                     if paired else None)
            table[f"{model} {precision}"] = {"finals": finals, "mean": mean, "vs_bf16": ratio, "seeds": len(finals)}
    return table


if __name__ == "__main__":
    main()
