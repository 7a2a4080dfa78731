"""Write BENCHMARKS.md, and the generated blocks of README.md and docs/, from benchmarks/results/.

Nothing here is typed by hand: every figure comes from a results file that a
benchmark script wrote; the torch releases CI tests come from pyproject.toml.

    python benchmarks/make_benchmarks_md.py
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from ampkit.experiment.config import CONTEXT
from ampkit.experiment.comparison import REVISE_AFTER
from ampkit.experiment.cost import ESTIMATE_STEPS
from ampkit.experiment.training import final_steps
from ampkit.files import atomic_write
from common import RESULTS

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
ARCHIVE = "avx512-bf16-cpu"  # an earlier machine's records, kept beside this machine's
# Records from the GPU machine a session is sometimes lent (benchmarks/device_check.sh): folder, heading, what it is.
DEVICE_RECORDS = [
    ("h200-cuda", "## A GPU: one NVIDIA H200",
     "From `benchmarks/device_check.sh` on a lent GPU machine (torch 2.11 with CUDA 13.0, the image's own; "
     "`cp -r $OUT/compare-*-cuda benchmarks/results/h200-cuda/` and its autocast.json and fp8-cuda.json beside them). "
     "These training steps are short enough that the host's per-op work, not the GPU's arithmetic, sets their time: "
     "where a Python layer over autocast costs most, and where mixed precision's casts make a step slower than "
     "float32's. The compare records were made before ampkit's default CUDA region stopped pushing a torch function "
     "mode (compiling.needs_guard), the autocast record after it."),
    ("h200-host-cpu", "## The GPU machine's CPU: 16 cores with AMX and AVX-512 BF16",
     "`benchmarks/bench_autocast.py --device cpu --repeats 101` and `benchmarks/bench_compile.py --only gpt` on the "
     "same lent machine's host CPU (an Intel Xeon that computes bfloat16 natively), torch 2.11: the CPU that issue "
     "38's eager and compiled criteria ask for."),
    ("avx2-capped-cpu", "## An AVX2-only CPU, by capping this one",
     "This machine's AVX-512 BF16 CPU with torch's kernels and oneDNN's capped to AVX2 (`ATEN_CPU_CAPABILITY=avx2 "
     "ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_autocast.py --out benchmarks/results/avx2-capped-cpu`, and "
     "`bench_against_commit.py d699444^ --out ...`, the tree issue 71 was filed against): torch then finds no native "
     "bf16 and runs a bf16 GEMM at about 0.015x float32's speed, as an AVX2-only CPU does (0.0205x on the AVX2 machine "
     "of the records above), so ampkit's `compute=\"auto\"` computes GEMMs and convolutions in float32: the setting "
     "issue 71's AVX2 criterion asks about, on a CPU these sessions do not always get."),
]


def machine_line(machine: dict[str, Any]) -> str:
    line = (
        f"{machine['device_name']}, {machine['cpu_cores']} cores, torch {machine['torch']}; "
        f"CPU native bf16: {machine['cpu_native_bf16']}, native fp16: {machine['cpu_native_fp16']}"
    )
    if machine.get("isa_caps"):  # flags read from /proc/cpuinfo; the kernels ran capped
        caps = ", ".join(f"{name}={value}" for name, value in machine["isa_caps"].items())
        line += f" (by its flags), its instructions capped: {caps}"
    if machine.get("compute_capability"):
        line += f"; CUDA {machine['cuda']}, compute capability {machine['compute_capability']}"
    speed = machine.get("measured_speedup")
    if speed:
        line += (f"; measured native bf16 speed over float32: matmul {speed['matmul']['bfloat16']:.3g}x, "
                 f"conv {speed['conv']['bfloat16']:.3g}x")
    return line


def _x(value: float | None) -> str:
    return "" if value is None else f" ({value:.2f}x)"


def compare_table(results: dict[str, Any]) -> str:
    """A comparison's table; results.json version 1 (before compute modes) or 2."""
    config = results["config"]
    v2 = results.get("version", 1) >= 2
    memory = "memory added" if v2 else "peak memory (RSS)"
    divided = f", training loss divided by {config['loss_divisor']:g}" if config.get("loss_divisor", 1) != 1 else ""
    rows = [
        f"`ampkit compare --model {config['model']} --data {config['data']}` (batch {config['batch_size']}, "
        f"{config['steps']} steps, lr {config['lr']}{divided}), {results['created']}, "
        f"on {machine_line(results['machine'])}.",
        "",
        f"| run | compute | ms/step | samples/s | {memory} | saved for backward | final train loss "
        "| test accuracy | skipped | loss scale |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        ratio = run["ratio_to_fp32"]
        first = run["label"] == "fp32"
        r = (lambda k: "" if first else _x(ratio[k]))  # noqa: E731
        scale = "-" if run["final_loss_scale"] is None else f"{run['final_loss_scale']:g}"
        classes = run.get("float32_compute", [])
        mode = ("float32" if run["precision"] == "fp32" else
                "fp32 on 16-bit: " + ", ".join(classes) if classes else "native")
        loss = "-" if run["final_train_loss"] is None else f"{run['final_train_loss']:.4f}"
        accuracy = "-" if run["test_accuracy"] is None else f"{100 * run['test_accuracy']:.1f}%"
        rows.append(
            f"| {run['label']} | {mode} | {run['ms_per_step']:.1f}{r('ms_per_step')} "
            f"| {run['samples_per_s']:.1f}{r('samples_per_s')} "
            f"| {run['peak_memory_bytes'] / MIB:.0f} MiB{r('peak_memory_bytes')} "
            f"| {run['saved_for_backward_bytes'] / MIB:.1f} MiB{r('saved_for_backward_bytes')} "
            f"| {loss} | {accuracy} | {run['skipped_steps']} | {scale} |"
        )
    extra = [run for run in results["runs"] if run.get("parameters") and not run.get("probe")]
    if extra:  # numerics records (issue 13): training state per parameter, zero gradient values, skipped steps
        rows += ["", "| run | weights + gradients + masters + optimizer states | zero gradient values "
                 "| final train loss vs float32 | skipped steps |", "|---|---|---|---|---|"]
        for run in extra:
            zeros = "-" if run.get("zero_grad_fraction") is None else f"{100 * run['zero_grad_fraction']:.2g}%"
            ratio = run["ratio_to_fp32"]["final_train_loss"]
            loss = "-" if ratio is None else f"{ratio:.3f}x"
            rows.append(f"| {run['label']} | {run['state_bytes'] / run['parameters']:.1f} bytes/parameter | {zeros} "
                        f"| {loss} | {run['skipped_steps']} |")
    seeds = len(results.get("seeds", [])) or 1
    if results.get("wall_s") and seeds > 1:
        count = sum(len(run.get("seed_runs") or [run]) for run in results["runs"])
        rows += ["", f"The {count} runs ({len(results['runs'])} settings, {seeds} seeds) took "
                 f"{results['wall_s']:.0f} s of wall time (each in its own process, each seed's steps interleaved, "
                 "one seed after another)"]
    elif results.get("wall_s"):  # version 2: the runs' processes live side by side, stepped in lockstep
        rows += ["", f"The {len(results['runs'])} runs took {results['wall_s']:.0f} s of wall time (each in its own "
                 "process, their steps interleaved)"]
    else:
        wall_s = sum(run["wall_s"] for run in results["runs"])
        rows += ["", f"The {len(results['runs'])} runs took {wall_s:.0f} s of wall time in all (each in its own "
                 "process)"]
    if results.get("estimated_s"):
        rows[-1] += f"; the plan estimated {results['estimated_s']:.0f} s"
    rows[-1] += "."
    if results.get("command"):
        rows[-1] += (f" `{results['command']['command']}` took **{results['command']['wall_s']:.0f} s** from the "
                     "command line to exit.")
    trained = [run for run in results["runs"] if not run.get("probe")]
    for precision in ("bf16", "fp16"):
        o1 = next((run for run in trained if run["precision"] == precision and run["opt_level"] == "O1"), None)
        o2 = next((run for run in trained if run["precision"] == precision and run["opt_level"] == "O2"), None)
        if o1 and o2:
            rows += ["", f"{precision} O2 vs O1: step time {o2['ms_per_step'] / o1['ms_per_step']:.2f}x, memory "
                     f"{o2['peak_memory_bytes'] / o1['peak_memory_bytes']:.2f}x, saved for backward "
                     f"{o2['saved_for_backward_bytes'] / o1['saved_for_backward_bytes']:.2f}x."]
    for probe in (run for run in results["runs"] if run.get("probe")):
        rows += ["", f"Native {probe['precision']} probe ({probe['steps']} steps, the first a warm-up): "
                 f"{probe['ms_per_step']:.0f} ms/step, **{probe['ratio_to_fp32']['ms_per_step']:.1f}x** float32's step "
                 "time: what torch.autocast's 16-bit kernels cost on this machine."]
    if v2:
        rows += ["", "Memory added: the peak resident memory of the run's process during training minus its "
                 "resident memory before the model was built (CUDA: peak allocated tensor bytes)."]
    return "\n".join(rows)


def autocast_table(results: dict[str, Any]) -> str:
    v2 = "ratio_to_float32" in results["models"][0]
    repeats = results.get("repeats", 11)
    warmup = results.get("warmup", 2)
    timed = "median of the steps timed (in brackets)" if v2 else f"median of {repeats}"
    rows = [
        f"`python benchmarks/bench_autocast.py{' --device cuda' if results['machine']['device'] == 'cuda' else ''}"
        f"{'' if results.get('size', 'small') == 'small' else ' --size ' + results['size']}"
        f"{' --compile' if results.get('compiled') else ''}"
        f"{'' if results.get('repeats', 31) == 31 else ' --repeats ' + str(results['repeats'])}`, "
        f"{results['created']}, on {machine_line(results['machine'])}. "
        f"Training steps, {timed} after {warmup} warm-up step{'s' if warmup > 1 else ''}, variants "
        "timed in alternation"
        + ("; after a ratio to float32 (and to torch.autocast, where recorded), in brackets, the middle half of the "
           "per-round ratios (each round times every variant once): how far the figure moves with this machine's noise."
           if "ratio_to_float32_quartiles" in results["models"][0] else ".")
        + (" A compiled variant (torch.compile, inductor; its compile the warm-up) is compared with the compiled "
           "float32 and torch.autocast steps; its saved bytes are its eager twin's."
           if results.get("compiled") else ""),
        "",
    ]
    if v2:
        rows += ["| model | variant | ms/step (steps) | vs float32 | vs torch.autocast | saved for backward | vs float32 |",
                 "|---|---|---|---|---|---|---|"]
    else:
        rows += ["| model | variant | ms/step | vs torch.autocast | saved for backward | equal to torch.autocast's |",
                 "|---|---|---|---|---|---|"]
    for row in results["models"]:
        edits = f" ({row['edits']})" if row["edits"] else ""
        mode = ""
        if row.get("float32_compute"):
            mode = " [fp32 compute: " + ", ".join(row["float32_compute"]) + "]"
        elif v2 and row["variant"].endswith("auto"):
            mode = " [native]"
        steps = f" ({row['timed_steps']})" if "timed_steps" in row else ""
        cells = [row["model"], f"{row['variant']}{edits}{mode}", f"{row['ms_per_step']:.1f}{steps}"]
        if v2:
            quartiles = row.get("ratio_to_float32_quartiles")
            spread = f" ({quartiles[0]:.2f}-{quartiles[1]:.2f})" if quartiles and row["variant"] != "float32" else ""
            against = row.get("ratio_to_torch_autocast_quartiles")  # per round, as the float32 spread is
            near = f" ({against[0]:.2f}-{against[1]:.2f})" if against and "torch.autocast" not in row["variant"] else ""
            cells += [f"{row['ratio_to_float32']:.3f}x{spread}", f"{row['ratio_to_torch_autocast']:.3f}x{near}",
                      f"{row['saved_for_backward_bytes'] / MIB:.1f} MiB", f"{row['saved_ratio_to_float32']:.2f}x"]
        else:
            cells += [f"{row['ratio_to_torch_autocast']:.3f}x", f"{row['saved_for_backward_bytes'] / MIB:.1f} MiB",
                      "yes" if row["saved_equal_to_torch_autocast"] else "no"]
        rows.append("| " + " | ".join(cells) + " |")
    per_op = results["per_op"]
    rows += [
        "",
        f"{per_op['ops']:,} 64x64 linears in one region (µs per op, median of 9): "
        + ", ".join(f"{name} {us:.1f}" for name, us in per_op["us_per_op"].items())
        + f". Default policy minus torch.autocast: {per_op['default_overhead_us_per_op']:+.1f} µs/op "
        f"(the same kernels run: this is the noise floor); an op moved by an edited policy costs "
        f"{per_op['edited_overhead_us_per_op']:.1f} µs more than the same op cast by hand (ampkit's Python kernel).",
        "",
    ]
    matmul = results["matmul_512"]
    if "speed_over_fp32" in matmul:
        rows.append("512x512 matmul (ms, median of 7; in brackets, speed over float32): " + ", ".join(
            f"{k} {v:.2f} ({matmul['speed_over_fp32'][k]:.3g}x)" for k, v in matmul["ms"].items()) + ".")
    else:
        rows.append("512x512 matmul (ms, median of 7): " + ", ".join(f"{k} {v:.2f}" for k, v in matmul["ms"].items())
                    + f": float16 is {matmul['fp16_over_fp32']:.0f}x slower than float32 on this CPU, "
                    f"bfloat16 {matmul['bf16_speedup_over_fp32']:.1f}x faster.")
    return "\n".join(rows)


def hardware_section(results: dict[str, Any], compare: dict[str, Any] | None) -> str:
    """What mixed precision buys on the machine that wrote ``results``: measured kernel speeds,
    the recommendation made from them, and what the default comparison saw."""
    measured, advice = results["measured"], results["recommendation"]
    rows = [
        f"`python benchmarks/bench_hardware.py`, {results['created']}, on {machine_line(results['machine'])}; "
        f"measured in {measured['seconds']:.2f} s, best of several calls.",
        "",
        "| op class (shape) | float32 time | native bf16 speed | native fp16 speed |",
        "|---|---|---|---|",
    ]
    for op, speeds in results["speedup"].items():
        shape = "x".join(map(str, measured["shapes"][op]))
        rows.append(f"| {op} ({shape}) | {measured['time_us'][op]['float32']:.0f} µs | {speeds['bfloat16']:.3g}x "
                    f"| {speeds['float16']:.3g}x |")
    rows += ["", f"Why: bfloat16 {results['why']['bfloat16']}; float16 {results['why']['float16']}.", "",
             f"`ampkit.recommend()` here: {advice['dtype'].removeprefix('torch.')}, compute {advice['compute']}, "
             f"opt level {advice['opt_level']}; fastest: {advice['fastest']}."]
    rows += [f"- {reason}" for reason in advice["reasons"]]
    if compare:
        by_label = {run["label"]: run for run in compare["runs"]}
        fp32 = by_label["fp32"]
        trained = [run for run in compare["runs"][1:] if not run.get("probe")]
        probes = [run for run in compare["runs"] if run.get("probe")]
        rows += ["", f"In the default `ampkit compare` (ResNet-18, batch {compare['config']['batch_size']}; its record "
                 "is in the next section):"]
        for run in trained:
            ratio = run["ratio_to_fp32"]
            rows.append(f"- {run['label']}: {ratio['ms_per_step']:.2f}x float32's step time, "
                        f"{ratio['saved_for_backward_bytes']:.2f}x its activation memory, test accuracy "
                        f"{100 * run['test_accuracy']:.1f}% against {100 * fp32['test_accuracy']:.1f}%")
        for probe in probes:
            rows.append(f"- native {probe['precision']} (what torch.autocast runs): "
                        f"{probe['ratio_to_fp32']['ms_per_step']:.1f}x float32's step time")
    return "\n".join(rows)


def scaler_table(results: dict[str, Any]) -> str:
    ms = results["ms"]
    return (
        f"`python benchmarks/bench_scaler.py`, {results['created']}, on {machine_line(results['machine'])}.\n\n"
        f"Unscale + inf/NaN check + update over {results['tensors']} gradient tensors, {results['elements']:,} "
        f"float32 elements: ampkit {ms['ampkit']:.2f} ms, torch.amp.GradScaler {ms['torch']:.2f} ms "
        f"(median of 15, alternating): **{results['ratio_to_grad_scaler']:.2f}x**."
    )


def guard_table(results: dict[str, Any]) -> str:
    rows = [
        f"`python benchmarks/bench_guard.py{' --compile' if results.get('compiled') else ''}`, {results['created']}, "
        f"on {machine_line(results['machine'])}: the GPT of `ampkit compare` ({results['precision']}, batch "
        f"{results['batch_size']}), {'six' if results.get('compiled') else 'three'} copies stepped in alternation, "
        f"{results['timed_steps']} timed steps each, medians"
        + ("; a compiled copy (torch.compile, inductor) against the compiled unguarded one" if results.get("compiled")
           else "")
        + ". Targets (issue 66): at most 1.02x sampled every 10 steps, 1.05x sampled every step, eager and compiled.",
        "",
        "| run | ms/step | vs no guard | the same losses as without it |",
        "|---|---|---|---|",
    ]
    rows += [f"| {name} | {row['ms_per_step']:.1f} | {row['ratio']:.3f}x | "
             f"{'yes' if row['same_losses'] else 'no'}"
             f"{'' if row['same_losses'] or 'loss_difference' not in row else ', within %.1g' % row['loss_difference']} |"
             for name, row in results["rows"].items()]
    if results.get("compiled_vs_eager_difference") is not None:
        rows += ["", "A compiled guard's hooks are traced into the graph, whose fusion, and so its rounding, changes "
                 "with them; over these steps the unguarded compiled run's losses departed from the eager one's by up "
                 f"to {results['compiled_vs_eager_difference']:.2g} (relative), the measure of rounding alone."]
    return "\n".join(rows)


def function_mode_table(results: dict[str, Any]) -> str:
    rows = [
        f"`python benchmarks/bench_function_mode.py`, {results['created']}, on {machine_line(results['machine'])}. "
        "Issue 38's first direction measured before it is built: a stand-in policy as a `TorchFunctionMode` that "
        "casts in `__torch_function__`, eagerly and through torch.compile (a counting backend), every case twice.",
        "",
        "| case | eager | compiled | graphs so far |",
        "|---|---|---|---|",
    ]
    rows += [f"| {r['case']} | {r['eager']} | {r['compiled']} | {r['graphs so far']} |"
             for r in results["rows"] if r["pass"] == 1]
    rows += ["", f"Compiled dtypes equal eager's in every case: {'yes' if results['same_dtypes'] else 'no'}; graphs "
             f"compiled on the second pass: {results['second_pass_compiles']}. Eager step of an 8-layer MLP with the "
             f"mode entered and none of its ops hit, over torch.autocast's: {results['eager_ratio']:.3f}x."]
    return "\n".join(rows)


def after_regions_section(results: dict[str, Any]) -> str:
    gpt, mm = results["medians"]["gpt_step"], results["medians"]["mm"]
    ratios = results["ratios"]
    return (f"`python benchmarks/bench_after_regions.py`, {results['created']}, on {machine_line(results['machine'])}. "
            "ampkit's Python kernels at the Autocast key (edited, module-override and float32-compute regions) live "
            "while a region needs them and are released when the last one closes, unless another thread runs "
            "rather than waits (then they stay, doing what torch's do, in Python). Plain `torch.autocast`, in one "
            "process, blocks "
            f"alternated between three states ({results['rounds']} rounds; medians): the GPT of `ampkit compare` "
            "(batch 32, forward and backward) right after such regions ran and closed (no ampkit kernel held, "
            f"checked) {gpt['after'] * 1e3:.1f} ms a step, with no region since the last block "
            f"{gpt['without'] * 1e3:.1f} ms (what a fresh process has): **{ratios['gpt_step']['after']:.3f}x** "
            f"(issue 38 asks <= 1.01x); with the regions' {results['registered']} kernels kept by a second thread "
            "that runs "
            f"thread {gpt['kept'] * 1e3:.1f} ms, {ratios['gpt_step']['kept']:.3f}x. A 64x64 `torch.mm`: "
            f"{mm['after'] * 1e6:.1f}, {mm['without'] * 1e6:.1f} and {mm['kept'] * 1e6:.1f} us "
            f"({ratios['mm']['after']:.2f}x, {ratios['mm']['kept']:.2f}x)." + registration_sentence(results))


def against_commit_table(results: dict[str, Any]) -> str:
    rows = ["| model | before (ms/step) | this tree (ms/step) | this tree / before | middle half of the rounds' ratios "
            "| first step's loss |", "|---|---|---|---|---|---|"]
    for model, found in results["models"].items():
        ms, quartiles = found["ms_per_step"], found["ratio_quartiles"]
        spread = f"{quartiles[0]:.3f}-{quartiles[1]:.3f}" if quartiles else "-"
        loss = ("the same bits" if found["same_first_loss"]
                else f"{found['first_loss']['before']:.6g} / {found['first_loss']['this tree']:.6g}")
        rows.append(f"| {model} | {ms['before']:.1f} | {ms['this tree']:.1f} | **{found['ratio']:.3f}x** | {spread} "
                    f"| {loss} |")
    level = results.get("opt_level", "policy")
    step = ("One training step under `ampkit.autocast(Policy.default(\"cpu\", torch.bfloat16))` (compute auto: "
            "float32 compute on bfloat16 values where native bf16 is slower)" if level == "policy" else
            f"One training step at {level} (`ampkit.initialize(model, AdamW, \"{level}\", torch.bfloat16)`, compute "
            "auto)")
    command = results["commit"] + ("" if level == "policy" else f" --opt-level {level}")
    return (f"`python benchmarks/bench_against_commit.py {command}`, {results['created']}, on "
            f"{machine_line(results['machine'])}. {step}, the "
            f"earlier commit's code and this tree's ({results['tree']}) in two processes stepped in alternation, "
            f"{results['rounds']} "
            "rounds after a warm-up step; medians.\n\n" + "\n".join(rows))


def module_hooks_paragraph(results: dict[str, Any]) -> str:
    found = results["us_per_module_call"]
    text = (f"`python benchmarks/bench_module_hooks.py`, {results['created']}, on {machine_line(results['machine'])}. "
            "What a module call costs, no region open, after a model was compiled under a module-override region "
            "(100 `nn.Identity`, best of 9 blocks): " + ", ".join(f"{name} {us:.2f} us" for name, us in found.items())
            + ". The no-op hooks are torch's part of what global hooks cost: until issue 71 ampkit's two stayed for "
            "the process once traced, sending every module call through `nn.Module`'s path for hooks; overrides are "
            "now forward wrappers taken off at the region's exit.")
    entry = results.get("region_entry_us")
    if entry:  # records from 2026-12-06 on
        text += (" A region's entry and exit on those 100 modules (medians of 2,000, alternated): "
                 + ", ".join(f"{name} {us:.1f} us" for name, us in entry.items())
                 + " (the modules walked and matched, one wrapper set and taken off).")
    return text


def region_cost_paragraph(results: dict[str, Any]) -> str:
    regions, steps, mlp = results["us_per_region"], results["small_gpt_step_ms"], results["mlp_float32_compute_ms"]
    return (f"`python benchmarks/bench_region_cost.py`, {results['created']}, on {machine_line(results['machine'])}. "
            "An empty region built where it is opened, as `with ampkit.autocast(policy):` in a training loop does "
            f"(blocks of {results['block']:,}, alternated, medians; compute auto is "
            f"{results['auto_computes']} here): " + ", ".join(f"{name} {us:.1f} us" for name, us in regions.items())
            + ". A small GPT's training step (d_model 32, 2 layers, batch 2, context 16; "
            f"{results['gpt_rounds']} rounds): "
            + ", ".join(f"{name} {ms:.3f} ms" for name, ms in steps.items())
            + f" (**{results['small_gpt_ratio']:.3f}x**; issue 38 asks <= 1.00x). What float32 compute's "
            f"registrations cost a small model (an MLP 784-512-512-10, batch 64, SGD; {results['mlp_rounds']} blocks "
            f"of {results['mlp_steps']} steps each way): "
            + ", ".join(f"{name} {ms:.2f} ms a step" for name, ms in mlp.items())
            + " (the kernels registered at each step's region and released at its exit, the price of a process "
            "that runs torch's own kernels between regions).")


def registration_sentence(results: dict[str, Any]) -> str:
    parts = [f"{name} ({found['ops']} ops) {found['ms']:.2f} ms" for name, found in results["registration"].items()]
    return (" What a region that opens alone pays to register its kernels and release them at its exit (medians of "
            f"50): {', '.join(parts)}.")


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


def fsdp_table(results: dict[str, Any]) -> str:
    rows = [
        f"`python benchmarks/bench_fsdp.py`, {results['created']}, on {machine_line(results['machine'])}; "
        f"{results['world_size']} ranks ({results['device']}), {results['model']} ({results['parameters']:,} "
        f"parameters), batch {results['batch_per_rank']} per rank, AdamW; medians, settings timed in alternation. "
        "Per rank: the weights, gradients and optimizer states training keeps between steps, measured on the "
        "local shards, and `estimate_memory(..., world_size=2, sharding=\"fsdp\")` beside it.",
        "",
        "| setting | step ms | vs DDP | bytes/param per rank | estimate / measured | reduce bytes per step |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results["settings"].items():
        sent = f"{row['reduce_bytes_per_step']:,.0f}" if row["reduce_bytes_per_step"] is not None else "(DDP's own)"
        rows.append(f"| {name} | {row['step_ms']:.1f} | {row['step_vs_ddp']:.2f}x | {row['bytes_per_parameter']:.2f} "
                    f"| {row['estimate_over_measured']:.3f} | {sent} |")
    return "\n".join(rows)


def recompute_table(results: dict[str, Any]) -> str:
    rows = [
        f"`python benchmarks/bench_recompute.py`, {results['created']}, on {machine_line(results['machine'])}; "
        f"one training step (forward, backward, AdamW), medians, settings timed in alternation; batches: "
        + "; ".join(f"{model} {what}" for model, what in results["batches"].items()) + ". Saved-for-backward is "
        "measured on the planned model; segments: the number recomputed, `whole model` where the plan recomputes "
        "the model as one segment (below what any plan of its blocks reaches), `(k selective)`: k of them recompute "
        "all but their GEMMs and attention, whose outputs they keep; `(floor)`: a budget below every plan's reach, "
        "planned at the smallest feasible budget the planner named; `whole blocks`: the planner without selective "
        "recompute; predicted ms: the plan's predicted recompute time per step.",
        "",
        "| model | setting | step ms | vs bf16 O1 | saved for backward MiB | vs bf16 O1 | budget MiB | segments "
        "| predicted ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, settings in results["models"].items():
        for label, row in settings.items():
            budget = f"{row['budget_bytes'] / 2**20:.2f}" if "budget_bytes" in row else ""
            segments = "whole model" if row.get("segments") == [[""]] else str(len(row.get("segments", [])))
            if row.get("selective"):
                segments += f" ({len(row['selective'])} selective)"
            predicted = f"{row['extra_ms']:.1f}" if "extra_ms" in row else ""
            rows.append(f"| {model} | {label} | {row['step_ms']:.1f} | {row['step_vs_bf16']:.2f}x | "
                        f"{row['saved_bytes'] / 2**20:.2f} | {row['saved_vs_bf16']:.2f}x | {budget} | "
                        f"{segments if 'segments' in row else ''} | {predicted} |")
    return "\n".join(rows)


def tune_table(results: dict[str, Any]) -> str:
    plans, runs = results["plans"], results["runs"]
    bf16 = runs[results["bf16"]]["final_train_loss"]
    rows = [
        f"`python benchmarks/bench_tune.py`, {results['created']}, on {machine_line(results['machine'])}. "
        f"`ampkit tune --model {results['model']}` (the compare GPT with input channel 7 of `blocks.0.mlp.3` "
        "planted 10^6x the others), both objectives, each timed from start to exit; then `ampkit compare --model "
        f"{results['model']} --plan` with the memory plan, 400 steps per run (FP8: delayed scaling, emulated "
        "here). Saving: what the plan predicts (the lowered layers' measured savings, each alone, summed; ms: each "
        "layer's own forward and backward) and what the tuned run saved against bf16 O1 (negative: it cost).",
        "",
        "| objective | tune s | linears lowered | predicted saving, bytes | measured | predicted saving, ms/step "
        "| measured | held-out loss change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    measured = results["measured_saving"]
    for objective, plan in plans.items():
        trained = objective == "memory"  # the plan the compare trained
        measured_bytes = f"{measured['bytes']:,}" if trained else ""
        measured_ms = f"{measured['ms']:+.1f}" if trained else ""
        rows.append(f"| {objective} | {plan['tune_s']:.1f} | {len(plan['lowered'])} of {plan['linears']} | "
                    f"{plan['predicted_bytes']:,.0f} | {measured_bytes} | {plan['predicted_ms']:+.1f} | {measured_ms} | "
                    f"{plan['measured_loss_change']:.4%} |")
    rows += ["", "| run | final train loss | vs bf16 O1 | ms/step | saved for backward MiB | skipped steps |",
             "|---|---|---|---|---|---|"]
    for label, row in runs.items():
        rows.append(f"| {label} | {row['final_train_loss']:.4f} | {row['final_train_loss'] / bf16 - 1:+.2%} | "
                    f"{row['ms_per_step']:.1f} | {row['saved_for_backward_bytes'] / 2**20:.2f} | "
                    f"{row['skipped_steps']} |")
    weak = results.get("planted_at_1e4")
    if weak:
        rows += ["", f"Planted at {weak['factor']:.0e} instead (the API, memory objective): the planted layer is "
                 f"{weak['format']}; lowered alone to fp8 its input underflow is {weak['underflow']:.1%}, its "
                 f"gradient change {weak['gradient_change']:.2%} (the other candidates' median "
                 f"{weak['others_gradient_change_median']:.2%}), its loss change {weak['loss_change']:.4%}."]
    rows += ["", "The memory plan, per linear (fp8 alone: loss change, gradient change, input underflow, saved "
             "bytes):", "", "| linear | format | loss | gradients | underflow | saving | why |", "|---|---|---|---|---|---|---|"]
    for layer in plans["memory"]["layers"]:
        tried = "fp8" in layer["loss_change"]
        figures = (f"{layer['loss_change']['fp8']:.4%} | {layer['gradient_change']['fp8']:.2%} | "
                   f"{layer['underflow']['fp8']:.1%} | {layer['saving']['fp8']:,.0f}") if tried else " | | | "
        rows.append(f"| {layer['name']} | {layer['format']} | {figures} | {layer['why']} |")
    return "\n".join(rows)


def integrations_table(results: dict[str, Any]) -> str:
    rows = [
        f"`python benchmarks/bench_integrations.py`, {results['created']}, on {machine_line(results['machine'])}. "
        f"The digits MLP of the examples, batch {results['batch']}; each setting trains {results['steps_timed']} "
        f"timed steps per round, {results['rounds']} rounds in alternating order; median ms per step. `native`: "
        "the same 16-bit kernels as the framework's own setting (the integration's own cost). On a CPU neither "
        "framework trains in float16: Lightning's `16-mixed` switches to bfloat16 without a scaler, Accelerate's "
        "`fp16` trains in float32; so ampkit's float16 row has no reference.",
        "",
        "| framework | setting | ms/step | vs the framework's own setting, same dtype |",
        "|---|---|---|---|",
    ]
    for framework, ms in results["ms"].items():
        for name, value in ms.items():
            ratio = results["ratio"][framework].get(name)
            shown = f"{ratio:.2f}x" if ratio else ("no reference" if name.startswith("ampkit") else "framework's own")
            rows.append(f"| {framework} | {name} | {value:.2f} | {shown} |")
    return "\n".join(rows)


def compile_table(results: dict[str, Any]) -> str:
    only = "" if len(results["models"]) == 3 else " --only " + " ".join(results["models"])  # a run of some models
    rows = [
        f"`python benchmarks/bench_compile.py{only}`, {results['created']}, on {machine_line(results['machine'])}. "
        f"One training step (forward, backward, AdamW) per variant, eager and through torch.compile "
        f"({results['backend']}); medians of up to {results['repeats']} steps, variants timed in alternation (a "
        f"variant leaves the rotation after {results['budget_s']:.0f} s of timed steps). 16-bit variants: "
        f"{results['dtype'].removeprefix('torch.')}, native kernels except float32 compute's; ampkit edited denies "
        "GELU and softmax and allows layer norm. First step: the compiled variant's first training step (its "
        "compile; a graph another variant compiled before is reused). Graphs: dynamo's graphs of the variant, one "
        "for the no-grad forward of the value check and one for training.",
    ]
    for name, model in results["models"].items():
        rows += ["", f"**{name}**: {model['description']}.", "",
                 "| variant | ms/step | x eager float32 | x compiled torch.autocast | first step s | graphs "
                 "| saved for backward MiB |", "|---|---|---|---|---|---|---|"]
        for label, ms in model["ms"].items():
            first = model["first_step_s"].get(label)
            rows.append(f"| {label} | {ms:.1f} | {model['over_float32_eager'][label]:.2f}x | "
                        f"{model['over_compiled_torch_autocast'][label]:.2f}x | "
                        f"{'-' if first is None else f'{first:.1f}'} | {model['graphs'].get(label, '-')} | "
                        f"{model['saved_for_backward'][label] / 2**20:.1f} |")
        ms = model["ms"]
        rows += ["", "Compiled ampkit against compiled torch.autocast: default "
                 f"{ms['compiled, ampkit default'] / ms['compiled, torch.autocast']:.3f}x, edited "
                 f"{ms['compiled, ampkit edited'] / ms['compiled, torch.autocast']:.3f}x; compiled float32 compute "
                 f"against eager float32 compute {ms['compiled, ampkit float32 compute'] / ms['eager, ampkit float32 compute']:.3f}x. "
                 "Compiled forward against eager, same weights: " + "; ".join(
                     f"{policy} {a['dtype_compiled'].removeprefix('torch.')} (eager "
                     f"{a['dtype_eager'].removeprefix('torch.')}), greatest difference {a['max_abs_diff']:.3g}"
                     for policy, a in model["agreement"].items()) + "."]
    return "\n".join(rows)


def startup_table(results: dict[str, Any]) -> str:
    """bench_startup.py: each start a fresh process, medians of interleaved rounds, against ``import torch``."""
    rows = ["| start (a fresh process) | median s | min-max s | / import torch |", "|---|---|---|---|"]
    rows += [f"| {row['variant']} | {row['median_s']:.2f} | {row['min_s']:.2f}-{row['max_s']:.2f} | "
             f"{row['ratio_to_import_torch']:.2f}x |" for row in results["rows"]]
    return "\n".join([machine_line(results["machine"]) + f". {results['rounds']} rounds in alternation.", "", *rows])


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


def gradients_section(results: dict[str, Any], relative: str) -> str:
    """Where the GPT's float32 gradients sit against float16's range, at several loss scales."""
    rows = [f"One step of `ampkit compare`'s GPT after {results['steps_before']} float32 steps, "
            f"{results['created']}, on {machine_line(results['machine'])} (`python benchmarks/bench_gradients.py`). "
            "Fractions of the nonzero values that float16 would flush to zero (below 2^-25) or keep only as "
            "subnormals (below 2^-14, fewer significant bits) once multiplied by the loss scale:", "",
            "| gradients | values | median log2 | loss scale | flushed to zero | subnormal | overflow |",
            "|---|---|---|---|---|---|---|"]
    for name, summary in results["summaries"].items():
        for scale, fractions in summary["fractions"].items():
            rows.append(f"| {name} | {summary['values']:,} | {summary['log2_median']:.1f} | {scale} "
                        f"| {100 * fractions['flushed']:.2f}% | {100 * fractions['subnormal']:.2f}% "
                        f"| {100 * fractions['overflow']:.2f}% |")
    rows += ["", f"![gradient histograms]({relative}/gradients.png)"]
    return "\n".join(rows)


def attention_route_table(results: dict[str, Any]) -> str:
    """Float32 compute's attention: its public route against CPU's private flash kernels it called before
    (issue 71)."""
    rows = [f"`python benchmarks/bench_attention_route.py`, {results['created']}, on "
            f"{machine_line(results['machine'])}: one causal attention in {results['dtype'].removeprefix('torch.')}, "
            f"forward and backward, medians of {results['repeats']} alternated rounds; bytes saved for backward "
            "beyond q, k and v themselves.", "",
            "| size | route | ms | vs the private kernels | saved for backward |", "|---|---|---|---|---|"]
    for size, routes in results["routes"].items():
        for name, row in routes.items():
            rows.append(f"| {size} | {name} | {row['ms']:.2f} | {row['ratio_to_private']:.3f}x "
                        f"| {row['saved_bytes'] / 2**20:.2f} MiB |")
    return "\n".join(rows)


def block_scaled_section(results: dict[str, Any]) -> str:
    """Emulated block-scaled steps against bf16, the casts compiled and eager (issue 68)."""
    rows = [f"`python benchmarks/bench_block_scaled.py`, {results['created']}, on {machine_line(results['machine'])}: "
            f"`ampkit compare`'s GPT, one training step at O1 bf16, its linears block-scaled as compare converts them; "
            f"medians of {results['repeats']} alternated rounds.", "",
            "| variant | ms/step | vs bf16 (quartiles) |", "|---|---|---|"]
    for label, row in results["variants"].items():
        quartiles = row["quartiles"]
        spread = f" ({quartiles[0]:.2f}-{quartiles[1]:.2f})" if quartiles else ""
        rows.append(f"| {label} | {row['ms_per_step']:.1f} | {row['ratio']:.2f}x{spread} |")
    return "\n".join(rows)


def block_quality_section(results: dict[str, Any]) -> str:
    """Block-scaled formats' final train loss against bf16 over seeds, and the NVFP4 recipe's ablation (issue 68)."""
    rows = [f"`python benchmarks/bench_block_quality.py`, {results['created']}, on {machine_line(results['machine'])}: "
            f"each `ampkit compare` setting at O1 trained {results['steps']} steps per seed, one process per run; final "
            "train loss as compare's (the mean of the last steps); the ratio is the mean over seeds against bf16's "
            "mean over the same seeds." + (" `nvfp4` is the full recipe, `nvfp4-plain` the format alone, `nvfp4-no-X` "
            "the recipe without one part, `nvfp4-4over6` the recipe with Four Over Six's choice of each block's scale."
            if any("nvfp4" in label for label in results["summary"]) else ""), "",
            "| model | setting | seeds | final loss per seed | mean | vs bf16 |",
            "|---|---|---|---|---|---|"]
    for label, row in results["summary"].items():
        model, setting = label.rsplit(" ", 1)
        finals = " / ".join("diverged" if v is None else f"{v:.4f}" for v in row["finals"].values())
        if row.get("diverged"):
            rows.append(f"| {model} | {setting} | {len(row['finals'])} | {finals} | - | - |")
            continue
        ratio = f"{(row['vs_bf16'] - 1) * 100:+.1f}%" if row["vs_bf16"] is not None and setting != "bf16" else "-"
        rows.append(f"| {model} | {setting} | {row['seeds']} | {finals} | {row['mean']:.4f} | {ratio} |")
    return "\n".join(rows)


def policy_mechanism_section(results: dict[str, Any]) -> str:
    """An edited policy through a TorchFunctionMode against the Autocast-key kernels (issue 71's first rule)."""
    edits = ", ".join(f"{kind} {' '.join(ops)}" for kind, ops in results["edits"].items())
    rows = [f"`python benchmarks/bench_policy_mechanism.py`, {results['created']}, on "
            f"{machine_line(results['machine'])}: the GPT of `bench_autocast.py` in eager, one training step, medians "
            f"of {results['repeats']} alternated rounds; the edit: {edits}. A mode sees "
            f"{results['torch_calls_per_step']} torch-function calls a step. The edited step's loss: "
            f"{results['losses']['kernels']:.5f} through the kernels, {results['losses']['mode']:.5f} through the "
            "mode" + (f", {results['losses']['by_hand']:.5f} written by hand" if "by_hand" in results["losses"] else "")
            + ".", "", "| variant | ms/step | vs torch.autocast (quartiles) |", "|---|---|---|"]
    variants = results["variants"]
    for label, row in variants.items():
        quartiles = row["quartiles"]
        spread = f" ({quartiles[0]:.3f}-{quartiles[1]:.3f})" if quartiles else ""
        rows.append(f"| {label} | {row['ms_per_step']:.1f} | {row['ratio']:.3f}x{spread} |")
    hand = variants.get("torch.autocast, the edit by hand")
    if hand:  # the edit's own numerics, no mechanism: what each mechanism adds to them
        added = {label: variants[label]["ms_per_step"] / hand["ms_per_step"]
                 for label in ("ampkit edited (kernels)", "torch.autocast + mode, edited")}
        rows += ["", "Against the same edit written by hand under torch.autocast (medians' ratio): "
                 + ", ".join(f"{label} {ratio:.3f}x" for label, ratio in added.items()) + "."]
    rows += ["", "Per call, 10,000 64x64 linears without grad:", "", "| variant | us a linear |", "|---|---|"]
    rows += [f"| {label} | {us:.2f} |" for label, us in results["us_per_linear"].items()]
    return "\n".join(rows)


def gpt_head_section(results: dict[str, Any]) -> str:
    """The ablation of what bf16 O1/O2 keep in float32 on the GPT."""
    settings = results["settings"]
    base = settings["fp32"]["final_train_loss"]
    rows = [f"`python benchmarks/bench_gpt_head.py`, {results['created']}, on {machine_line(results['machine'])}: "
            "`ampkit compare`'s GPT, seed 0, the same 400 batches for every setting, bf16 GEMMs computed in float32; "
            "final train loss = mean of the last 40 steps.", "",
            "| setting | final train loss | vs float32 |", "|---|---|---|"]
    for name, result in settings.items():
        rows.append(f"| {name} | {result['final_train_loss']:.4f} | {result['final_train_loss'] / base:.3f}x |")
    return "\n".join(rows)


# Issue 42's targets: a setting's bytes per parameter at most this, its mean final loss within 1.01x float32's.
BYTES_TARGETS = {"bf16 O2 fp32-grads": 18.0, "bf16 O2 fp32-grads 8bit-states": 12.0,
                 "bf16 O3 stochastic bf16-states": 8.0}
LOSS_TARGET = 1.01


def bytes_per_parameter_section(results: dict[str, Any]) -> str:
    """O2 with float32 gradient accumulation against bfloat16 accumulation and float32, and AdamW's moments in fewer
    bits, on the GPT (issue 42)."""
    seeds = list(results["seeds"])
    rows = [f"`python benchmarks/bench_bytes_per_parameter.py`, {results['created']}, on "
            f"{machine_line(results['machine'])}: one comparison per seed ({', '.join(seeds)}; 400 steps, batch 32 "
            f"in {results['micro_batches']} micro-batches, the runs of a seed interleaved) of float32, `--opt-level O2 "
            "--grad-accum fp32 bf16`, O2 fp32-grads with `--states " + " ".join(results.get("o2_states", []))
            + "`, and `--opt-level O3 --update stochastic --states " + " ".join(results.get("o3_states", []))
            + "`. Bytes per parameter: the weights, gradients, masters and optimizer states the run held after "
            "training, measured from its tensors; final train loss (mean of the last 40 steps) over float32's of the "
            "same seed; ms/step over float32's, the mean over seeds.", "",
            f"| run | bytes/parameter | {' | '.join(f'loss vs float32, seed {s}' for s in seeds)} | mean over seeds "
            "| ms/step vs float32 |",
            "|---|---|" + "---|" * len(seeds) + "---|---|"]
    for label, row in results["summary"].items():
        speed = row.get("ms_per_step_vs_float32")
        rows.append(f"| {label} | {row['bytes_per_parameter']:.2f} | "
                    + " | ".join(f"{r:.4f}x" for r in row["final_loss_vs_float32"])
                    + f" | {row['mean_vs_float32']:.4f}x | {'-' if speed is None else f'{speed:.2f}x'} |")
    verdicts = []
    for label, bound in BYTES_TARGETS.items():
        row = results["summary"].get(label)
        if row is None:
            continue
        size, loss = row["bytes_per_parameter"], row["mean_vs_float32"]
        size_text = (f"{size:.2f} <= {bound:g}" if size <= bound else f"{size:.2f}, over {bound:g} by {size - bound:.2f}")
        loss_text = (f"mean loss {loss:.4f}x <= {LOSS_TARGET}x" if loss <= LOSS_TARGET
                     else f"mean loss {loss:.4f}x, over {LOSS_TARGET}x")
        verdicts.append(f"{label}: {size_text} bytes/parameter, {loss_text}")
    if verdicts:
        rows += ["", "Against the targets (issue 42): " + "; ".join(verdicts) + "."]
    larger = results.get("larger_model")
    if larger:
        config = larger["config"]
        rows += ["", f"The same options on a larger GPT (d_model {config['d_model']}, {config['n_layers']} layers; "
                 "`ampkit.estimate_memory`, which equals the tensors' count): "
                 + ", ".join(f"{label} {value:.2f}" for label, value in larger["bytes_per_parameter"].items())
                 + " bytes/parameter. torchao's code tables and the tensors it leaves unquantized are costs per "
                 "tensor, which weigh less on larger tensors."]
    errors = results["accumulation_errors"]
    rows += ["", f"One step's gradients of the same GPT at O2 accumulated over {results['accumulated']} micro-batches "
             "(2 windows each), against the micro-batches' gradients taken one at a time and summed in float32 "
             f"(relative error, all parameters together): float32 accumulation (`grad_dtype=torch.float32`) "
             f"{errors['float32']:.1e}, bfloat16 accumulation (the default) {errors['bfloat16']:.1e}."]
    return "\n".join(rows)


def bf16_moments_section(results: dict[str, Any]) -> str:
    """Pure bf16 training's moments in float32, in bf16 stochastically rounded and rounded to nearest (issue 42)."""
    seeds = list(results["seeds"])
    rows = [f"`python benchmarks/bench_bf16_moments.py`, {results['created']}, on {machine_line(results['machine'])}: "
            "the GPT at `--opt-level O3 --update stochastic` (400 steps, batch 32 in 4 micro-batches, as the record "
            "above) with AdamW's moments in float32 (`states=\"fp32\"`) and in bf16 (`states=\"bf16\"`) with both "
            "moments stochastically rounded, both rounded to nearest (as torch's and torch-optimi's optimizers keep "
            "them), and by `state_rounding=\"auto\"`, the default (the second moment stochastically, the first to "
            "nearest); final train loss over float32 training's, per seed.", "",
            f"| moments | {' | '.join(f'loss vs float32, seed {s}' for s in seeds)} | mean over seeds |",
            "|---|" + "---|" * len(seeds) + "---|"]
    for name, mean in results["means"].items():
        rows.append(f"| {name} | " + " | ".join(f"{results['seeds'][s][name]:.4f}x" for s in seeds)
                    + f" | {mean:.4f}x |")
    return "\n".join(rows)


def _by_setting(results: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """A compare record's trained runs by setting, the compute mode left out of the label (``bf16 O1``)."""
    runs = results["runs"] if results else []
    return {run["label"].replace(" fp32-compute", ""): run for run in runs if not run.get("probe")}


def seeds_section(directory: Path) -> str | None:
    """bf16 O1 and O2 against float32 on the GPT, per seed (the compare-gpt records)."""
    rows = []
    for name in ("compare-gpt-cpu", "compare-gpt-seed1-cpu", "compare-gpt-seed2-cpu"):
        results = load(directory / name, "results.json")
        if results is None:
            continue
        runs = _by_setting(results)
        base = runs["fp32"]["final_train_loss"]
        cells = [f"{runs[k]['final_train_loss']:.4f} ({runs[k]['final_train_loss'] / base:.3f}x)" if k in runs else "-"
                 for k in ("bf16 O1", "bf16 O2")]
        rows.append(f"| {results['config']['seed']} | {base:.4f} | {' | '.join(cells)} |")
    if len(rows) < 2:
        return None
    return "\n".join(["| seed | fp32 | bf16 O1 | bf16 O2 |", "|---|---|---|---|", *rows])


def verdict_section(directory: Path) -> str | None:
    """Every compare record over several seeds: each setting's final train loss and test accuracy (mean, half
    their range over the seeds) and its verdict against float32 (``ampkit compare --seeds``), its sentence below."""
    rows, sentences = [], []
    for path in sorted(directory.glob("compare-*/results.json")):
        results = json.loads(path.read_text())
        if len(results.get("seeds", [])) < 2:
            continue
        verdicts = {v["label"]: v for v in results.get("verdicts", [])}
        for run in results["runs"]:
            seeds = run.get("seed_runs") or [run]
            losses = [s["final_train_loss"] for s in seeds if s["final_train_loss"] is not None]
            accuracies = [s["test_accuracy"] for s in seeds if s["test_accuracy"] is not None]
            loss = f"{sum(losses) / len(losses):.4f} ± {(max(losses) - min(losses)) / 2:.4f}" if losses else "-"
            accuracy = (f"{100 * sum(accuracies) / len(accuracies):.1f}% "
                        f"± {50 * (max(accuracies) - min(accuracies)):.1f}" if accuracies else "-")
            verdict = verdicts.get(run["label"])
            said = ("matches" if verdict["matches"] else "outside seed noise") if verdict else "(the reference)"
            rows.append(f"| {path.parent.name.removeprefix('compare-')} | {run['label']} | {len(seeds)} | {loss} | "
                        f"{accuracy} | {said} |")
        sentences += [f"- {path.parent.name.removeprefix('compare-')}: {v['sentence']}" for v in verdicts.values()]
    if not rows:
        return None
    return "\n".join(["| record | setting | seeds | final train loss (mean ± half range) | test accuracy | "
                       "against float32 |", "|---|---|---|---|---|---|", *rows, "", *sentences])


def mxfp8_section(directory: Path) -> str | None:
    """MXFP8 with each E8M0 scale mode against bf16 O1 on the GPT, per seed (the compare-gpt-mxfp8 records)."""
    rows = []
    settings = ("mxfp8-floor O1", "mxfp8-rceil O1")
    for name in ("compare-gpt-mxfp8-cpu", "compare-gpt-mxfp8-seed1-cpu"):
        results = load(directory / name, "results.json")
        if results is None:
            continue
        runs = _by_setting(results)
        base = runs["bf16 O1"]["final_train_loss"]
        cells = [f"{runs[k]['final_train_loss']:.4f} ({100 * (runs[k]['final_train_loss'] / base - 1):+.1f}%)"
                 for k in settings]
        skipped = sum(runs[k]["skipped_steps"] for k in settings)
        non_finite = len(results.get("non_finite", []))
        rows.append(f"| {results['config']['seed']} | {runs['fp32']['final_train_loss']:.4f} | {base:.4f} | "
                    f"{' | '.join(cells)} | {skipped} | {non_finite} |")
    if not rows:
        return None
    return "\n".join(["| seed | fp32 | bf16 O1 | mxfp8 FLOOR (the spec's) | mxfp8 RCEIL | skipped steps | "
                      "non-finite values in the record |", "|---|---|---|---|---|---|---|", *rows])


# Records made before this were estimated by the earlier method: every run at float32's step (float32-compute
# runs) or at the measured kernels' throughput (native ones), and no compile.
ESTIMATE_TIMES_EACH_SETTING = "2026-12-01T14:40"
# From this on, the plan times 5 steps of each setting and of float32 in turn and takes medians (before: 3 float32
# steps, then a single step of each setting, one after another).
ESTIMATE_TIMES_IN_TURN = "2026-12-02T21:00"
REVISED_FROM_RUNS = "2026-12-03T00:40"  # records from this on carry revised_s


def estimate_section(directory: Path) -> str | None:
    """The plan's estimate against the time each comparison took, for every compare record."""
    rows = []
    for path in sorted(directory.glob("compare-*/results.json")):
        results = json.loads(path.read_text())
        if results.get("estimated_s") is None or results.get("wall_s") is None:
            continue
        method = ("settings in turn, medians" if results["created"] >= ESTIMATE_TIMES_IN_TURN else
                  "each setting timed" if results["created"] >= ESTIMATE_TIMES_EACH_SETTING else "float32's step")
        native = results.get("machine", {}).get("cpu_native_bf16")
        cpu = {True: "native bf16", False: "AVX2 (bf16 emulated)"}.get(native, "?")
        revised = results.get("revised_s")
        again = f"{revised:.0f} ({results['wall_s'] / revised:.2f}x)" if revised else "-"
        rows.append(f"| {path.parent.name.removeprefix('compare-')} | {cpu} | {results['created'][:16]} | {method} | "
                    f"{results['estimated_s']:.0f} | {results['wall_s']:.0f} | "
                    f"{results['wall_s'] / results['estimated_s']:.2f}x | {again} |")
    if not rows:
        return None
    return "\n".join(["| record | CPU | created | estimate | estimated s | took s | took / estimated | "
                       "from the runs' first steps: s (took / it) |", "|---|---|---|---|---|---|---|---|", *rows])


def underflow_section(directory: Path, relative: str) -> str | None:
    """Micikevicius et al.'s claim on the GPT: float16 loss scaling at the workload's own gradient magnitudes
    (compare-gpt-loss-scaling) and at a 16x larger batch's (compare-gpt-underflow, the loss divided by 16)."""
    records = [load(directory / name, "results.json") for name in ("compare-gpt-loss-scaling-cpu",
                                                                    "compare-gpt-underflow-cpu", "compare-gpt-cpu")]
    if any(r is None for r in records[:2]):
        return None

    own, divided, default = (_by_setting(r) for r in records)
    if "bf16 O1" in default and default["fp32"]["final_train_loss"] == own["fp32"]["final_train_loss"]:
        own["bf16 O1"] = default["bf16 O1"]  # compare-gpt: the same float32 run, so its bf16 O1 belongs here
    config = records[1]["config"]  # type: ignore[index]
    divisor, tokens, steps = config["loss_divisor"], config["batch_size"] * CONTEXT, config["steps"]
    rows = [f"Final train loss against float32's (mean of the last {final_steps(steps)} of {steps} steps), zero "
            f"gradient values and skipped steps of the records compare-gpt-loss-scaling (the GPT's own batch, "
            f"{tokens:,} tokens) and compare-gpt-underflow (the training loss divided by {divisor:g}: each gradient "
            f"value where a {tokens * divisor:,.0f}-token batch puts it; AdamW's eps divided too, so float32 trains "
            "as before).", "",
            f"| setting | own batch: loss vs float32 | zero gradients | skipped | loss / {divisor:g}: loss vs "
            "float32 | zero gradients | skipped |", "|---|---|---|---|---|---|---|"]

    def cells(run: dict[str, Any] | None) -> list[str]:
        if run is None:
            return ["-", "-", "-"]
        zeros = run.get("zero_grad_fraction")
        return [f"{run['ratio_to_fp32']['final_train_loss']:.3f}x ({run['final_train_loss']:.4f})",
                "-" if zeros is None else f"{100 * zeros:.2g}%", str(run["skipped_steps"])]

    for label in dict.fromkeys([*own, *divided]):
        rows.append(f"| {label} | {' | '.join(cells(own.get(label)) + cells(divided.get(label)))} |")
    same = [label for label in ("fp32", "bf16 O1")
            if label in own and label in divided and own[label]["losses"] == divided[label]["losses"]]
    if same:
        rows += ["", f"{' and '.join(same)} lost the same value at every step with the loss divided by {divisor:g} "
                 "as without (bit for bit: their exponent range holds the smaller gradients), so what changes in the "
                 "last columns is float16's range at work."]
    rows += ["", f"![loss curves, loss / {divisor:g}]({relative}/compare-gpt-underflow-cpu/curves.png)"]
    return "\n".join(rows)


def load(directory: Path, name: str) -> dict[str, Any] | None:
    path = directory / name
    return json.loads(path.read_text()) if path.exists() else None


def compare_line(results: dict[str, Any]) -> str:
    """One sentence of the default comparison, for the README's front page."""
    base = results["runs"][0]
    mixed = [run for run in results["runs"][1:] if not run.get("probe")]
    figures = "; ".join(
        f"{run['label']} {run['ratio_to_fp32']['ms_per_step']:.2f}x float32's step time, "
        f"{run['ratio_to_fp32']['saved_for_backward_bytes']:.2f}x its activation memory, "
        f"{100 * run['test_accuracy']:.1f}% test accuracy" for run in mixed)
    return (f"`ampkit compare` (ResNet-18 on the digits, {results['created'][:10]}, {machine_line(results['machine'])}): "
            f"{figures}, against float32's {100 * base['test_accuracy']:.1f}% "
            "([every record](BENCHMARKS.md)).")


def torch_versions_blocks() -> dict[str, str]:
    """The README's and docs/getting-started.md's lines on the torch releases CI tests, from pyproject.toml
    (``[tool.ampkit] tested-torch``, and the dependency's lower bound)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    versions = project["tool"]["ampkit"]["tested-torch"]
    bound = next(d for d in project["project"]["dependencies"] if re.match(r"torch\b", d))
    ordered = sorted(versions, key=lambda v: tuple(int(part) for part in v.split(".")))
    def listed(names: list[str]) -> str:
        return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)

    others = [v for v in ordered if v != versions[0]]
    oldest, newest = others[0], others[-1]
    between = [v for v in others if v not in (oldest, newest)]
    tested = (f"Every CI run tests torch {listed(ordered)} (`.ci/run`): {versions[0]}, the CPU wheel the commands "
              f"above install where no torch is, with the whole suite; then {listed(others)} from the package "
              "registry (CUDA builds, which run on a CPU too), each in a venv of its own, with the same test command "
              f"by tiers (.ci/torch_matrix.sh): the newest, {newest}, and the oldest, {oldest}, the fast tier "
              f"(`-m \"not slow\"`), and {oldest} the slow tier's compiled tests and the offline device rehearsal too "
              "(what a user's plain venv sees)")
    if between:
        tested += (f"; {listed(between)}, between them, the loans tier: the tests of every torch private ampkit "
                   "calls, in each call form it makes, of torch's autocast lists and of the call shapes users write "
                   "(the whole suite on every release would not fit CI's 90 minutes on 2 cores)")
    tested += (". A release the registry does not serve is a SKIPPED line there, never a silent pass; so is one that "
               "does not fit CI's time on a slower machine (its tier's time estimated from the whole suite's there: "
               "the newest first, then the oldest, a fast tier that does not fit run as the loans tier), naming the "
               "command that runs it.")
    suite = RESULTS / "test-suite.json"
    if suite.exists():  # benchmarks/bench_test_suite.py
        record = json.loads(suite.read_text())
        counts = ", ".join(f"{n} {kind}" for kind, n in record["counts"].items())
        tested += (f" The whole suite (`{record['command']}`) took {record['seconds'] / 60:.0f} minutes ({counts}) on "
                   f"{machine_line(record['machine'])}, {record['created'][:10]}.")
    return {"torch-versions": f"Both keep a torch you already have (a CUDA build). {tested}",
            "torch-versions-docs": f"Torch versions: `{bound}`. {tested} The list is `[tool.ampkit] tested-torch` "
                                   "in pyproject.toml, the one place it is written."}


def replace_block(text: str, name: str, body: str) -> str | None:
    """``text`` with the generated block ``name`` filled with ``body``; None where it has no such block."""
    pattern = re.compile(rf"(<!-- generated:{name}:start -->\n).*?(<!-- generated:{name}:end -->)", re.S)
    if not pattern.search(text):
        return None
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def native_fp8_paragraph(results: dict[str, Any]) -> str:
    """benchmarks/device_fp8.py: the same GPT steps with native FP8 matmuls and emulated ones, per recipe."""
    runs = ", ".join(
        f"{recipe} scaling native {run['native']['median_step_ms']:.1f} ms/step against emulated "
        f"{run['emulated']['median_step_ms']:.1f}, losses at most {100 * run['max_relative_loss_difference']:.2f}% apart"
        for recipe, run in results["runs"].items())
    return (f"`python benchmarks/device_fp8.py` on {results['device']} (torch {results['torch']}), the `ampkit compare` "
            f"GPT for {results['steps']} steps (median step after two): {runs}.")


def records(directory: Path, level: str) -> tuple[list[str], dict[str, str]]:
    """The Markdown sections of one machine's records, and the generated blocks (README.md, docs/) they fill."""
    relative = directory.relative_to(ROOT).as_posix()
    sections: list[str] = []
    blocks: dict[str, str] = {}
    digits = None
    for path in sorted(directory.glob("compare-*/results.json")):
        results = json.loads(path.read_text())
        results["command"] = load(path.parent, "command.json")
        name = path.parent.name
        sections += [f"{level} `ampkit compare`: {name.removeprefix('compare-')}", "", compare_table(results), ""]
        pictures = [f"![{alt}]({relative}/{name}/{file})" for alt, file in
                    (("loss curves", "curves.png"), ("time and memory", "summary.png")) if (path.parent / file).exists()]
        sections += [*pictures, ""] if pictures else []  # a GPU run brings back its results.json alone
        if name == "compare-digits-cpu":
            blocks["compare"] = compare_table(results)
            if all("ratio_to_fp32" in run for run in results["runs"]):  # the earlier machine's records predate it
                blocks["compare-line"] = compare_line(results)
            digits = results
    seeds = seeds_section(directory)
    if seeds:
        sections += [f"{level} GPT: bf16 O1 and O2 against float32, per seed", "",
                     "Final train losses (mean of the last 40 of 400 steps) from the compare-gpt records above; "
                     "each seed is its own initialisation and batch order.", "", seeds, ""]
    verdicts = verdict_section(directory)
    if verdicts:
        sections += [f"{level} `ampkit compare --seeds 3`: each setting against float32 within seed noise", "",
                     "From each compare record over several seeds above: a setting matches float32 where its mean "
                     "lies inside float32's range over the same seeds widened on each side by that range's width "
                     "(`ampkit/experiment/seeds.py`); each verdict's sentence as the command printed it.", "",
                     verdicts, ""]
    estimates = estimate_section(directory)
    if estimates:
        sections += [f"{level} `ampkit compare`: the plan's estimate against the time taken", "",
                     "From each compare record above: the estimate printed before training and the comparison's "
                     "wall time (`estimated_s`, `wall_s` in results.json). Since "
                     f"{ESTIMATE_TIMES_EACH_SETTING}, the estimate times one step of each mixed setting's own model "
                     "and, for compiled runs, one compile of the float32 model; before, every run was costed at "
                     f"float32's step or the kernels' measured throughput. Since {ESTIMATE_TIMES_IN_TURN}, it takes "
                     f"the median of {ESTIMATE_STEPS} steps of float32 and of each setting, timed in turn as the runs "
                     "take their steps (a single step per setting had let a busy moment decide the plan). Since "
                     f"{REVISED_FROM_RUNS}, the comparison makes the estimate again after {REVISE_AFTER} steps of each "
                     "run beyond its first, from the runs' own steps (`revised_s`; the last column).", "",
                     estimates, ""]
    mxfp8 = mxfp8_section(directory)
    if mxfp8:
        sections += [f"{level} GPT: MXFP8's two scale modes against bf16 O1, per seed", "",
                     "Final train losses (mean of the last 40 of 400 steps) from the compare-gpt-mxfp8 records above, "
                     "percent from bf16 O1 of the same record. The records ran as `--precision mxfp8 mxfp8-rceil`, "
                     "before `mxfp8` came to mean RCEIL on this evidence (`mxfp8-floor` is the spec's FLOOR now); "
                     "their run labels name the scale mode either way.", "", mxfp8, ""]
    underflow = underflow_section(directory, relative)
    if underflow:
        sections += [f"{level} GPT: float16 with and without loss scaling (the paper's experiment)", "", underflow, ""]
    per_parameter = load(directory, "bytes-per-parameter.json")
    if per_parameter:
        blocks["bytes-per-parameter"] = bytes_per_parameter_section(per_parameter)
        sections += [f"{level} Bytes per parameter: gradients accumulated in float32, optimizer states in fewer bits", "",
                     blocks["bytes-per-parameter"], ""]
    moments = load(directory, "bf16-moments.json")
    if moments:
        sections += [f"{level} Pure bf16: its moments stochastically rounded or rounded to nearest (an ablation)", "",
                     bf16_moments_section(moments), ""]
    route = load(directory, "attention-route.json")
    if route:
        sections += [f"{level} Float32 compute's attention: its public route against the private kernels", "",
                     attention_route_table(route), ""]
    block = load(directory, "block-scaled.json")
    if block:
        sections += [f"{level} Emulated block-scaled steps against bf16", "", block_scaled_section(block), ""]
    quality = load(directory, "block-quality.json")
    if quality:
        sections += [f"{level} Block-scaled formats against bf16 over seeds, and the NVFP4 recipe's ablation", "",
                     block_quality_section(quality), ""]
    quality = load(directory, "block-quality-mxfp4.json")
    if quality:
        sections += [f"{level} MXFP4 against its training recipe, over seeds", "", block_quality_section(quality), "",
                     "`mxfp4-recipe` is Tseng et al.'s (arXiv 2502.20586): a 16-bit forward, both backward GEMMs in "
                     "MXFP4 on operands through a 64x64 random Hadamard transform, rounded stochastically at 3/4 of "
                     "each block's scale (`python benchmarks/bench_block_quality.py --set mxfp4`).", ""]
    mechanism = load(directory, "policy-mechanism.json")
    if mechanism:
        sections += [f"{level} An edited policy: a TorchFunctionMode against the Autocast-key kernels", "",
                     policy_mechanism_section(mechanism), ""]
    head = load(directory, "gpt-head.json")
    if head:
        sections += [f"{level} GPT: what bf16 keeps in float32 (an ablation)", "", gpt_head_section(head), ""]
    gradients = load(directory, "gradients.json")
    if gradients:
        sections += [f"{level} Gradients against float16's range", "", gradients_section(gradients, relative), ""]
    hardware = load(directory, "hardware.json")
    if hardware:
        blocks["hardware"] = hardware_section(hardware, digits)
        sections[:0] = [f"{level} What mixed precision buys on this machine", "", blocks["hardware"], ""]
    autocast = load(directory, "autocast.json")
    if autocast:
        blocks["autocast"] = autocast_table(autocast)
        sections += [f"{level} Autocast: ampkit policies against float32 and torch.autocast", "", blocks["autocast"], ""]
    scaler = load(directory, "scaler.json")
    if scaler:
        sections += [f"{level} Loss scaler overhead", "", scaler_table(scaler), ""]
    inspect = load(directory, "inspect.json")
    if inspect:
        sections += [f"{level} Numerics report (`ampkit inspect`)", "",
                     inspect_section(inspect).replace("benchmarks/results/", f"{relative}/"), ""]
    guard = load(directory, "guard.json")
    if guard:
        blocks["guard-overhead"] = guard_table(guard)
        sections += [f"{level} The guard's cost while nothing goes wrong", "", blocks["guard-overhead"], ""]
    distributed = load(directory, "distributed.json")
    if distributed:
        sections += [f"{level} Distributed gradient compression", "", distributed_table(distributed), ""]
    for name in ("fsdp.json", "fsdp-cuda.json"):
        fsdp = load(directory, name)
        if fsdp:
            sections += [f"{level} FSDP2: per-rank memory and step time", "", fsdp_table(fsdp), ""]
    recompute = load(directory, "recompute.json")
    if recompute:
        sections += [f"{level} Recompute on a budget: the planner, sqrt(n) and every block", "",
                     recompute_table(recompute), ""]
    tuned = load(directory, "tune.json")
    if tuned:
        sections += [f"{level} Formats per layer: `ampkit tune` on a planted outlier", "", tune_table(tuned), ""]
    function_mode = load(directory, "function-mode.json")
    if function_mode:
        sections += [f"{level} The precision layer as a torch function mode (issue 38, measured before building)", "",
                     function_mode_table(function_mode), ""]
    after_regions = load(directory, "after-regions.json")
    if after_regions:
        sections += [f"{level} Plain torch.autocast after ampkit's regions ran (issue 38's side effects)", "",
                     after_regions_section(after_regions), ""]
        module_hooks = load(directory, "module-hooks.json")
        if module_hooks:
            sections += [module_hooks_paragraph(module_hooks), ""]
        region_cost = load(directory, "region-cost.json")
        if region_cost:
            sections += [region_cost_paragraph(region_cost), ""]
    against = load(directory, "against-commit.json")
    if against:
        sections += [f"{level} ampkit's default policy against an earlier commit's (issue 38: no slower)", "",
                     against_commit_table(against), ""]
    against_o2 = load(directory, "against-commit-o2.json")
    if against_o2:
        sections += [f"{level} O2's step against the commit before its contract (issue 64: no slower)", "",
                     against_commit_table(against_o2), ""]
    native_fp8 = load(directory, "fp8-cuda.json")
    if native_fp8:
        sections += [f"{level} FP8: native matmuls against emulation", "", native_fp8_paragraph(native_fp8), ""]
    compiled = load(directory, "compile.json")
    if compiled:
        sections += [f"{level} torch.compile under every kind of policy", "", compile_table(compiled), ""]
    startup = load(directory, "startup.json")
    if startup:
        sections += [f"{level} Start-up: `import ampkit` and `ampkit --help` against `import torch`", "",
                     startup_table(startup), ""]
    integrations = load(directory, "integrations.json")
    if integrations:
        sections += [f"{level} Lightning and Accelerate: per-step cost", "", integrations_table(integrations), ""]
    return sections, blocks


def main() -> None:
    sections = ["# Benchmarks", "", "Generated by `python benchmarks/make_benchmarks_md.py` from the JSON files in "
                "`benchmarks/results/`, which the scripts beside it write. Do not edit by hand.", ""]
    current, blocks = records(RESULTS, "###")
    blocks.update(torch_versions_blocks())
    sections += ["## This machine", "", "The records the scripts wrote last, on the machine named in each.", ""]
    sections += current
    archive = RESULTS / ARCHIVE
    if archive.is_dir():
        earlier, _ = records(archive, "###")
        sections += ["## Earlier machine: a 2-core CPU with AVX-512 BF16", "",
                     f"Kept from `{archive.relative_to(ROOT).as_posix()}/`: the same scripts on the project's earlier "
                     "machine, which computed bfloat16 natively (about 2x float32), before ampkit measured hardware "
                     "or had float32 compute; peak memory there is the whole process's peak RSS.", ""]
        sections += earlier
    for folder, heading, about in DEVICE_RECORDS:
        if (RESULTS / folder).is_dir():
            gpu, _ = records(RESULTS / folder, "###")
            sections += [heading, "", about, ""] + gpu
    # The README and the manual's pages hold generated blocks; each block lives in exactly one of them.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts = {page: page.read_text() for page in pages}
    for name, body in blocks.items():
        holders = [page for page in pages if replace_block(texts[page], name, body) is not None]
        if len(holders) != 1:
            raise SystemExit(f"the generated:{name} block is in {len(holders)} of README.md and docs/*.md, not 1")
        texts[holders[0]] = replace_block(texts[holders[0]], name, body)  # type: ignore[assignment]
    atomic_write(ROOT / "BENCHMARKS.md", lambda tmp: tmp.write_text("\n".join(sections)))
    for page, text in texts.items():
        if text != page.read_text():
            atomic_write(page, lambda tmp, text=text: tmp.write_text(text))
    print(f"wrote BENCHMARKS.md and the generated blocks ({', '.join(blocks)}) of README.md and docs/")


if __name__ == "__main__":
    main()
