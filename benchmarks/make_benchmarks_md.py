"""Write BENCHMARKS.md, and the generated tables of README.md, from benchmarks/results/.

Nothing here is typed by hand: every figure comes from a results file that a
benchmark script wrote.

    python benchmarks/make_benchmarks_md.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ampkit.experiment.report import atomic_write
from common import RESULTS

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def machine_line(machine: dict[str, Any]) -> str:
    line = (
        f"{machine['device_name']}, {machine['cpu_cores']} cores, torch {machine['torch']}; "
        f"CPU native bf16: {machine['cpu_native_bf16']}, native fp16: {machine['cpu_native_fp16']}"
    )
    if machine.get("compute_capability"):
        line += f"; CUDA {machine['cuda']}, compute capability {machine['compute_capability']}"
    return line


def compare_table(results: dict[str, Any]) -> str:
    config = results["config"]
    rows = [
        f"`ampkit compare --model {config['model']} --data {config['data']}` (batch {config['batch_size']}, "
        f"{config['steps']} steps, lr {config['lr']}), {results['created']}, on {machine_line(results['machine'])}.",
        "",
        "| precision | opt level | ms/step | samples/s | peak memory | saved for backward | final train loss "
        "| test accuracy | skipped | loss scale |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        ratio = run["ratio_to_fp32"]
        r = (lambda k: "" if run["label"] == "fp32" else f" ({ratio[k]:.2f}x)")  # noqa: E731
        scale = "-" if run["final_loss_scale"] is None else f"{run['final_loss_scale']:g}"
        rows.append(
            f"| {run['precision']} | {run['opt_level']} | {run['ms_per_step']:.1f}{r('ms_per_step')} "
            f"| {run['samples_per_s']:.1f}{r('samples_per_s')} "
            f"| {run['peak_memory_bytes'] / MIB:.0f} MiB{r('peak_memory_bytes')} "
            f"| {run['saved_for_backward_bytes'] / MIB:.1f} MiB{r('saved_for_backward_bytes')} "
            f"| {run['final_train_loss']:.4f} | {100 * run['test_accuracy']:.1f}% | {run['skipped_steps']} | {scale} |"
        )
    wall_s = sum(run["wall_s"] for run in results["runs"])
    rows += ["", f"The {len(results['runs'])} runs took {wall_s:.0f} s of wall time in all (each in its own process)."]
    by_label = {run["label"]: run for run in results["runs"]}
    for precision in ("bf16", "fp16"):
        o1, o2 = by_label.get(f"{precision} O1"), by_label.get(f"{precision} O2")
        if o1 and o2:
            rows += ["", f"{precision} O2 vs O1: step time {o2['ms_per_step'] / o1['ms_per_step']:.2f}x, peak memory "
                     f"{o2['peak_memory_bytes'] / o1['peak_memory_bytes']:.2f}x, saved for backward "
                     f"{o2['saved_for_backward_bytes'] / o1['saved_for_backward_bytes']:.2f}x."]
    return "\n".join(rows)


def autocast_table(results: dict[str, Any]) -> str:
    rows = [
        f"`python benchmarks/bench_autocast.py`, {results['created']}, on {machine_line(results['machine'])}. "
        "Training steps, median of 11 after 2 warm-up steps, variants timed in alternation.",
        "",
        "| model | variant | ms/step | vs torch.autocast | saved for backward | equal to torch.autocast's |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["models"]:
        edits = f" ({row['edits']})" if row["edits"] else ""
        rows.append(
            f"| {row['model']} | {row['variant']}{edits} | {row['ms_per_step']:.1f} "
            f"| {row['ratio_to_torch_autocast']:.3f}x | {row['saved_for_backward_bytes'] / MIB:.1f} MiB "
            f"| {'yes' if row['saved_equal_to_torch_autocast'] else 'no'} |"
        )
    per_op = results["per_op"]
    rows += [
        "",
        f"{per_op['ops']:,} 64x64 linears in one region (µs per op, median of 9): "
        + ", ".join(f"{name} {us:.1f}" for name, us in per_op["us_per_op"].items())
        + f". Default policy minus torch.autocast: {per_op['default_overhead_us_per_op']:+.1f} µs/op "
        f"(the same kernels run: this is the noise floor); an op moved by an edited policy costs "
        f"{per_op['edited_overhead_us_per_op']:.1f} µs more than the same op cast by hand (ampkit's Python kernel).",
        "",
        "512x512 matmul (ms, median of 7): "
        + ", ".join(f"{k} {v:.2f}" for k, v in results["matmul_512"]["ms"].items())
        + f": float16 is {results['matmul_512']['fp16_over_fp32']:.0f}x slower than float32 on this CPU, "
        f"bfloat16 {results['matmul_512']['bf16_speedup_over_fp32']:.1f}x faster.",
    ]
    return "\n".join(rows)


def scaler_table(results: dict[str, Any]) -> str:
    ms = results["ms"]
    return (
        f"`python benchmarks/bench_scaler.py`, {results['created']}, on {machine_line(results['machine'])}.\n\n"
        f"Unscale + inf/NaN check + update over {results['tensors']} gradient tensors, {results['elements']:,} "
        f"float32 elements: ampkit {ms['ampkit']:.2f} ms, torch.amp.GradScaler {ms['torch']:.2f} ms "
        f"(median of 15, alternating): **{results['ratio_to_grad_scaler']:.2f}x**."
    )


def distributed_table(results: dict[str, Any]) -> str:
    ms, sent, steps = results["allreduce_ms"], results["allreduce_bytes"], results["ddp_step_ms"]
    rows = [
        f"`python benchmarks/bench_distributed.py`, {results['created']}, on {machine_line(results['machine'])}; "
        f"{results['world_size']} gloo ranks over loopback, medians, variants timed in alternation.",
        "",
        f"| all-reduce of {results['elements']:,} elements | ms | vs float32 | bytes handed to the collective |",
        "|---|---|---|---|",
    ]
    for name in ms:
        rows.append(f"| {name} | {ms[name]:.1f} | {results['allreduce_ratio_to_float32'][name]:.2f}x | {sent[name]:,} |")
    rows += ["", "| DDP training step (ResNet-18 O1, batch 32 per rank) | ms |", "|---|---|"]
    rows += [f"| {name} | {value:.1f} |" for name, value in steps.items()]
    rows += ["", f"Compressed step / float32 step: {results['ddp_step_ratio']:.2f}x. Over loopback the wire is not "
             "the bottleneck, so the casts cost more than the halved bytes save; compression pays where the "
             "network is slow (several nodes)."]
    return "\n".join(rows)


def inspect_section(results: dict[str, Any]) -> str:
    ms = results["ms"]
    report, memory = results["report"], results["memory"]
    rows = [
        f"`python benchmarks/bench_inspect.py`, {results['created']}, on {machine_line(results['machine'])}: "
        f"{results['model']} on {results['data']}, batch {results['batch_size']}.",
        "",
        f"Overhead: the hooks-based report took {ms['inspect']:.0f} ms, one plain float32 training step "
        f"{ms['train_step']:.0f} ms (medians of 7, alternating): **{results['overhead_ratio']:.2f}x**.",
        "",
        "| module | type | max abs activation | activations > 65504 | max abs gradient | gradients fp16-subnormal "
        "| gradients flushed to 0 in fp16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in report["modules"]:
        g = m["gradient"]
        rows.append(
            f"| {m['name']} | {m['type']} | {m['activation']['max_abs']:.3g} "
            f"| {100 * m['activation']['fp16_overflow']:.2f}% | {'-' if g is None else format(g['max_abs'], '.3g')} "
            f"| {'-' if g is None else format(100 * g['fp16_subnormal'], '.2f') + '%'} "
            f"| {'-' if g is None else format(100 * g['fp16_zero'], '.2f') + '%'} |"
        )
    rows += ["", "Recommendations:"] + [f"- {reason}" for reason in report["reasons"]]
    rows += ["", "| memory | weights | gradients | master weights | optimizer states | activations |",
             "|---|---|---|---|---|---|"]
    for row in (memory["float32"], memory["mixed"]):
        rows.append(f"| {row['label']} | " + " | ".join(
            f"{row[k] / MIB:.1f} MiB" for k in ("weights", "gradients", "master_weights", "optimizer_states",
                                                "activations")) + " |")
    rows += ["", "![activation gradients against float16's range](benchmarks/results/inspect_grad_histogram.png)"]
    return "\n".join(rows)


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- generated:{name}:start -->\n).*?(<!-- generated:{name}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md has no generated:{name} block")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main() -> None:
    sections = ["# Benchmarks", "", "Generated by `python benchmarks/make_benchmarks_md.py` from the JSON files in "
                "`benchmarks/results/`, which the scripts beside it write. Do not edit by hand.", ""]
    readme = (ROOT / "README.md").read_text()
    for path in sorted(RESULTS.glob("compare-*/results.json")):
        results = json.loads(path.read_text())
        name = path.parent.name
        sections += [f"## `ampkit compare`: {name.removeprefix('compare-')}", "", compare_table(results), "",
                     f"![loss curves](benchmarks/results/{name}/curves.png)",
                     f"![time and memory](benchmarks/results/{name}/summary.png)", ""]
        if name == "compare-digits-cpu":
            readme = replace_block(readme, "compare", compare_table(results))
    autocast = load("autocast.json")
    if autocast:
        sections += ["## Autocast overhead (ampkit policies vs torch.autocast)", "", autocast_table(autocast), ""]
        readme = replace_block(readme, "autocast", autocast_table(autocast))
    scaler = load("scaler.json")
    if scaler:
        sections += ["## Loss scaler overhead", "", scaler_table(scaler), ""]
    inspect = load("inspect.json")
    if inspect:
        sections += ["## Numerics report (`ampkit inspect`)", "", inspect_section(inspect), ""]
    distributed = load("distributed.json")
    if distributed:
        sections += ["## Distributed gradient compression", "", distributed_table(distributed), ""]
    atomic_write(ROOT / "BENCHMARKS.md", lambda tmp: tmp.write_text("\n".join(sections)))
    atomic_write(ROOT / "README.md", lambda tmp: tmp.write_text(readme))
    print("wrote BENCHMARKS.md and README.md's generated blocks")


if __name__ == "__main__":
    main()
