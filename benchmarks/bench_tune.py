"""`ampkit tune` on the GPT of `ampkit compare` with one planted outlier layer (``--model gpt-outlier``), then
`ampkit compare --plan` with the plan: float32, bf16 O1, all-fp8 O1 and the tuned run, 400 steps each.

Both objectives are tuned (each timed from start to exit, as a user waits for it); the compare trains the
``memory`` plan (on a CPU every lowered format is emulated, slower than bf16, so the ``time`` plan lowers
nothing: its record says so). Per run: final train loss, ms per step, saved-for-backward; the plan's
predicted savings (bytes and ms per step) beside the measured ones (the tuned run against bf16 O1).

    python benchmarks/bench_tune.py   # writes benchmarks/results/tune.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, save

MODEL = "gpt-outlier"


def _ampkit(*args: str) -> float:
    """Run ``ampkit ARGS``; its wall seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ampkit.cli.main", *args], text=True, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"ampkit {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    print(done.stdout[-3000:])
    return time.perf_counter() - start


def _planted_at(factor: float) -> dict:
    """The planted layer's figures in a memory plan of the GPT planted at ``factor`` (the API, as tune runs)."""
    import warnings

    import torch

    import ampkit
    from ampkit.experiment.data import load
    from ampkit.experiment.models import gpt_with_outlier
    from ampkit.experiment.tuning import tuning_batches

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ampkit.tune(gpt_with_outlier(factor=factor), tuning_batches(load("text"), 32, 8, 0, torch.device("cpu")),
                           objective="memory")
    layers = {layer.name: layer for layer in plan.layers}
    others = sorted(layer.gradient_change["fp8"] for name, layer in layers.items()
                    if "fp8" in layer.gradient_change and name != "blocks.0.mlp.3")
    planted = layers["blocks.0.mlp.3"]
    return {"factor": factor, "format": planted.format, "underflow": planted.underflow["fp8"],
            "gradient_change": planted.gradient_change["fp8"], "loss_change": planted.loss_change["fp8"],
            "others_gradient_change_median": others[len(others) // 2], "outlier": planted.outlier}


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=RESULTS, prefix=".staging-") as staging:
        plans, tune_s = {}, {}
        for objective in ("memory", "time"):
            path = Path(staging) / f"plan-{objective}.json"
            tune_s[objective] = _ampkit("tune", "--model", MODEL, "--objective", objective, "--out", str(path))
            plans[objective] = json.loads(path.read_text())
        run = Path(staging) / "run"
        compare_s = _ampkit("compare", "--model", MODEL, "--plan", str(Path(staging) / "plan-memory.json"),
                            "--no-probe", "--out", str(run), "--quiet")
        runs = json.loads((run / "results.json").read_text())["runs"]
    weak = _planted_at(1e4)
    rows = {r["label"]: {key: r[key] for key in ("final_train_loss", "ms_per_step", "saved_for_backward_bytes",
                                                  "skipped_steps")} for r in runs}
    bf16 = next(label for label in rows if label.startswith("bf16 O1") and "tuned" not in label)
    tuned = next(label for label in rows if "tuned" in label)
    summary = {objective: {"tune_s": tune_s[objective], "lowered": {l["name"]: l["format"] for l in plan["layers"]
                                                                     if l["format"] != plan["base"]},
                           "linears": len(plan["layers"]), "predicted_saving": plan["predicted_saving"],
                           "predicted_ms": plan["predicted_ms"], "predicted_bytes": plan["predicted_bytes"],
                           "measured_loss_change": plan["measured_loss_change"], "tuned_s_inside": plan["tune_s"],
                           "layers": plan["layers"]} for objective, plan in plans.items()}
    measured = {"bytes": rows[bf16]["saved_for_backward_bytes"] - rows[tuned]["saved_for_backward_bytes"],
                "ms": rows[bf16]["ms_per_step"] - rows[tuned]["ms_per_step"]}
    path = save("tune", {"model": MODEL, "plans": summary, "runs": rows, "bf16": bf16, "tuned": tuned,
                         "measured_saving": measured, "compare_s": compare_s, "planted_at_1e4": weak})
    for label, row in rows.items():
        print(f"{label}: final loss {row['final_train_loss']:.4f}, {row['ms_per_step']:.1f} ms/step, saved "
              f"{row['saved_for_backward_bytes'] / 2**20:.2f} MiB")
    print(f"tune: {tune_s}; predicted memory saving {summary['memory']['predicted_saving']} bytes, measured "
          f"{measured['bytes']}; wrote {path}")


if __name__ == "__main__":
    main()
