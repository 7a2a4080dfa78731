"""`ampkit compare`: train float32 and mixed precision side by side; print and save the record."""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ampkit.cli.flags import as_flags, directory
from ampkit.experiment import report
from ampkit.experiment.comparison import REVISE_AFTER, Comparison, check_out_dir, compare, reserve_out_dir
from ampkit.experiment.config import COMPILE_MODES, GRAD_ACCUMS, LOSS_SCALES, PRECISIONS, RunConfig, low_dtype
from ampkit.experiment.cost import Estimate, estimate
from ampkit.experiment.data import DATASETS
from ampkit.experiment.hf_models import HELP as HF_HELP
from ampkit.experiment.models import MODELS
from ampkit.experiment.process import RunFailed, warning_key
from ampkit.experiment import sizing
from ampkit.experiment.seeds import check_seeds
from ampkit.experiment.sizing import SIZES
from ampkit.experiment.settings import IMAGE_DEFAULTS, MODEL_DEFAULTS, check_device, plan
from ampkit.files import atomic_write
from ampkit.hardware import flags, throughput
from ampkit.modes import COMPUTE_MODES, MIXED_LEVELS, SHORT_NAMES, ComputeModeWarning
from ampkit.optim.pure16 import UPDATES
from ampkit.optim.states import STATES
from ampkit.precision.decide import GEMM_OPS


def _defaults(name: str) -> str:
    """Each model's default for a setting, as --help shows it: ``64 for images; 32 for gpt, gpt-outlier, ...``."""
    by_model = {"images": IMAGE_DEFAULTS.get(name), **{m: d.get(name) for m, d in MODEL_DEFAULTS.items()}}
    values: dict[Any, list[str]] = {}
    for model, value in by_model.items():
        if value is not None:
            values.setdefault(value, []).append(model)
    return "; ".join(f"{value} for {', '.join(models)}" for value, models in values.items()) or "none"


def add_parser(subparsers: argparse._SubParsersAction, line: str) -> None:
    """Add this command's parser; ``line`` is its help line in ``ampkit --help`` (cli/main.py)."""
    parser = subparsers.add_parser(
        "compare", help=line,
        description="With no arguments: ResNet-18 on the bundled handwritten digits, float32 vs the mixed "
        "settings this hardware supports.",
    )
    parser.add_argument("--model", default="resnet18", help=f"{' | '.join(MODELS)} | {HF_HELP} | "
                        "pkg.module:factory")
    parser.add_argument("--data", default=None, help=f"{' | '.join(DATASETS)} (default: digits; text for gpt)")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, help="mixed precisions to run")
    parser.add_argument("--opt-level", nargs="+", choices=MIXED_LEVELS,
                        help="opt levels of the mixed runs (default: O1 and O2; O1 alone for the block-scaled formats)")
    parser.add_argument("--compute", nargs="+", choices=COMPUTE_MODES,
                        help="how the mixed runs' GEMMs compute (default: auto, native where measured faster here)")
    parser.add_argument("--loss-scale", nargs="+", choices=LOSS_SCALES,
                        help="loss scaling of the fp16 runs (default auto: dynamic for fp16, none otherwise; static "
                             "is 1024; adaptive is per layer)")
    parser.add_argument("--update", nargs="+", choices=UPDATES,
                        help="how O3 runs update their 16-bit weights: plain (default), kahan, stochastic")
    parser.add_argument("--grad-accum", nargs="+", choices=GRAD_ACCUMS,
                        help="what the O2/O3 runs' 16-bit weights' gradients accumulate in: fp32 (O2's default), "
                             "or their own dtype (bf16 or fp16: O3's default); several add a run each")
    parser.add_argument("--states", nargs="+", choices=STATES,
                        help="the format of AdamW's moments in the mixed runs: fp32 (default), bf16 (the second "
                             "moment stochastically rounded), 8bit, 4bit, fp8 (torchao's low-bit AdamW); several add a run each")
    parser.add_argument("--guard", action="store_true",
                        help="train every run through ampkit.Guard: bad steps refused and named, a failing layer's "
                             "precision raised (O1); events in the table, guard-*.png beside the curves")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="split each step's batch into this many micro-batches, a backward each, their gradients "
                             "accumulated into one step (a divisor of the batch size; default 1)")
    parser.add_argument("--loss-divisor", type=float, default=1.0,
                        help="divide every run's training loss (and AdamW's eps) by this: gradients as a this-times "
                             "larger batch's, where float16 needs loss scaling (1 to 65536; default 1)")
    parser.add_argument("--activation-budget", nargs="+",
                        help="saved-for-backward budgets (0.5 of a run's own, or bytes: 64MiB): each mixed setting "
                             "also trains with a recompute plan for each (ampkit.plan_recompute)")
    parser.add_argument("--compile", nargs="?", const="on", default="off", choices=COMPILE_MODES,
                        help="train through torch.compile (inductor): --compile (or on) compiles every run, "
                             "--compile both runs each setting eagerly and compiled, --compile reduce-overhead "
                             "compiles every run with CUDA graphs (torch.compile's mode: one launch a step on a GPU); "
                             "the first step, the compile, is reported apart")
    parser.add_argument("--plan", help="a precision plan from `ampkit tune --out`: adds a run with it (beside fp32, "
                                       "its base and its lowest format for every linear, unless --precision is given)")
    parser.add_argument("--no-probe", action="store_true",
                        help="skip the short native 16-bit probe run added where auto computes in float32")
    parser.add_argument("--size", choices=SIZES,
                        help="the model's width and batch: small (the CPU's default), medium, large, or auto (CUDA's "
                             "default): the smallest whose float32 step is arithmetic-bound here, measured")
    parser.add_argument("--batch-size", type=int, help=f"examples per step (default: {_defaults('batch_size')})")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--epochs", type=int, help=f"passes over the training data (default: {_defaults('epochs')})")
    group.add_argument("--steps", type=int, help=f"optimizer steps, instead of epochs (default: {_defaults('steps')})")
    parser.add_argument("--lr", type=float, help=f"AdamW's learning rate, cosine-decayed (default: {_defaults('lr')})")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches of every run "
                        "alike (default 0)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="train every setting with this many seeds (--seed, then one more each), one seed's runs "
                             "after another's: the table shows each figure's mean and spread, and whether each "
                             "mixed setting matches float32 within seed noise (default 1; 3 gives a verdict)")
    parser.add_argument("--out", type=directory, help="output directory (default: ./ampkit-runs/<timestamp>/)")
    parser.add_argument("--json", action="store_true", help="print results.json to stdout instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress (bars on a terminal, else lines on stderr)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    check_seeds(args.seeds)
    if args.out is not None:
        check_out_dir(args.out)
    size = args.size or ("auto" if check_device(args.device).type == "cuda" else "small")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if size == "auto":
            print(f"ampkit compare: planning: timing float32 steps of the small {args.model} to size the runs",
                  file=sys.stderr, flush=True)
        configs = plan(
            model=args.model, data=args.data, precisions=args.precision, opt_levels=args.opt_level,
            batch_size=args.batch_size, epochs=args.epochs, steps=args.steps, lr=args.lr, device=args.device,
            seed=args.seed, computes=args.compute, probe=False if args.no_probe else None,
            loss_scales=args.loss_scale, updates=args.update, loss_divisor=args.loss_divisor,
            activation_budgets=args.activation_budget, compile=args.compile, precision_plan=args.plan,
            grad_accums=args.grad_accum, micro_batches=args.micro_batches, states=args.states, guard=args.guard,
            size=size,
        )
        # builds and steps the model (a bad model fails here); a line per timing, as the runs' progress does
        cost = estimate(configs, lambda line: print(f"ampkit compare: {line}", file=sys.stderr, flush=True))
        out = reserve_out_dir(args.out)  # before training: a bad location fails now
    for warning in caught:
        if not issubclass(warning.category, _in_the_plan(configs)):
            print(f"warning: {warning.message}", file=sys.stderr)
    console = Console(stderr=args.json)
    print_plan(console, configs, cost, args.seeds)
    if size == "auto":  # measured once: plan asked the same
        first = configs[0]
        why = sizing.auto(first.model, first.data, torch.device(first.device), len(configs), first.steps).why
        console.print(f"  size: {why}.", highlight=False)
    planned = time.perf_counter()  # what the estimate is of: the runs, from here
    try:
        result = _compare(args, configs, cost, console, {warning_key(warning) for warning in caught})
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: keep the steps taken, marked incomplete
        partial = getattr(interrupt, "partial", None)
        if partial is not None:
            text = json.dumps(partial, indent=2, allow_nan=False)
            atomic_write(out / "results.json", lambda tmp: tmp.write_text(text + "\n"))
            print(f"ampkit compare: kept the losses of the steps taken in {out / 'results.json'} (incomplete).",
                  file=sys.stderr)
        raise
    except RunFailed as failure:
        log, text = out / f"{failure.label.replace(' ', '-')}-error.log", failure.log
        atomic_write(log, lambda tmp: tmp.write_text(text))
        print(f"ampkit compare: {failure} (its full error output: {log})", file=sys.stderr)
        return 1
    try:
        paths = report.write_all(result, out)
    except FileExistsError as clash:  # a file appeared in --out during the run: keep both, overwrite nothing
        elsewhere = reserve_out_dir(None)
        paths = report.write_all(result, elsewhere)
        print(f"ampkit compare: {clash.filename2 or clash.filename} appeared during the run and is kept as it is; these results are "
              f"in {elsewhere} instead.", file=sys.stderr)
    except OSError as error:  # a full disk, say: nothing half-written is left
        print(f"ampkit compare: cannot write the results in {out}: {error.strerror or error}; nothing was written. "
              "Free space (or pass another --out) and run again.", file=sys.stderr)
        return 1
    diverged = [f"ampkit compare: the {run.label} run diverged: {as_flags(run.diverged)}." for run in result.runs
                if run.diverged]
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        console.print(report.table(result))
        for line in report.guard_lines(result):
            console.print(f"  guard, {line}", highlight=False)
        if (slower := report.slower_line(result, cost.native_speedup)) is not None:
            console.print(f"  {slower}", highlight=False)
        if (crossover := report.crossover_line(result)) is not None:
            console.print(f"  {crossover}", highlight=False)
        for line in report.verdict_lines(result):
            console.print(f"  {line}", highlight=False)
        if args.seeds == 1:
            console.print(f"  One seed: whether the differences from float32 are more than seed noise is not known; "
                          f"--seeds 3 (about {cost.seeds_s(configs, 3):.0f} s here) trains each setting three times "
                          "and says so.", highlight=False)
        again = f"; {result.revised_s:.0f} s from the runs' first steps" if result.revised_s is not None else ""
        console.print(f"Took {time.perf_counter() - planned:.0f} s (estimated {cost.seeds_s(configs, args.seeds):.0f} "
                      f"s{again}), after "
                      f"{planned - start:.0f} s of planning. Wrote " + ", ".join(str(p) for p in paths))
    for line in diverged:
        print(line, file=sys.stderr)
    return 1 if diverged else 0


def _compare(args: argparse.Namespace, configs: list[RunConfig], estimate: Estimate, console: Console,
             shown: set[str]) -> Comparison:
    times: dict[str, Any] = dict(estimated_s=estimate.seeds_s(configs, args.seeds), evaluation_s=estimate.evaluation_s,
                                 shown=shown, seeds=args.seeds)

    def revised(say: Callable[[str], None]) -> Callable[[float], None]:
        return lambda total_s: say(f"ampkit compare: from the runs' own first {REVISE_AFTER + 1} steps, about "
                                   f"{total_s:.0f} s in all (the plan estimated {estimate.total_s:.0f} s).")

    if args.quiet:
        return compare(configs, **times)
    if args.json or not console.is_terminal:  # a log file, CI, a pipe: plain lines on stderr, never a long silence
        return compare(configs, PlainProgress(), revise=revised(lambda line: print(line, file=sys.stderr, flush=True)),
                       **times)
    with Progress(
        TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(), console=console,
    ) as bars:
        named = run_names(configs, args.seeds)
        tasks = {name: bars.add_task(name, total=config.steps, loss="-") for name, config in named}
        return compare(
            configs, lambda label, step, total, loss: bars.update(tasks[label], completed=step, loss=f"{loss:.4f}"),
            revise=revised(bars.console.print), **times,
        )


class PlainProgress:
    """Progress as plain lines on stderr, where the output is no terminal (or is JSON): every ``interval_s`` seconds
    and at the end of each run, the step, the total and the loss of every run of the seed under way, and the time
    since the start."""

    def __init__(self, interval_s: float = 8.0) -> None:  # a line within 10 s, with the step's own time
        self.interval_s, self.start = interval_s, time.perf_counter()
        self.last = self.start
        self.latest: dict[str, tuple[int, int, float]] = {}

    def __call__(self, label: str, step: int, total: int, loss: float) -> None:
        if label not in self.latest:  # a run starts: the finished ones (an earlier seed's) said their last line
            self.latest = {name: state for name, state in self.latest.items() if state[0] < state[1]}
        self.latest[label] = (step, total, loss)
        now = time.perf_counter()
        if step == total or now - self.last >= self.interval_s:
            self.last = now
            runs = "; ".join(f"{name} step {done}/{steps} loss {value:.4f}"
                             for name, (done, steps, value) in self.latest.items())
            print(f"ampkit compare [{now - self.start:.0f} s]: {runs}", file=sys.stderr, flush=True)


def _in_the_plan(configs: list[RunConfig]) -> tuple[type[Warning], ...]:
    """The warnings that the regions of the estimate's steps raise and ``print_plan`` says already: what float32
    compute does, and, where float32-compute runs stand beside the native ones, the native kernels' measured speeds
    and why (without them the warning's advice, ``--compute auto``, is news)."""
    return (ComputeModeWarning, *((flags.SlowPrecisionWarning,) if any(c.float32_compute for c in configs) else ()))


def run_names(configs: list[RunConfig], seeds: int) -> list[tuple[str, RunConfig]]:
    """Every run's name in ``compare``'s progress, with its configuration: its label, and with several seeds its
    seed (a probe runs with the first seed only)."""
    if seeds == 1:
        return [(c.label, c) for c in configs]
    first = configs[0].seed
    return [(f"{c.label} seed {seed}", c) for seed in range(first, first + seeds) for c in configs
            if seed == first or not c.probe]


def print_plan(console: Console, configs: list[RunConfig], estimate: Estimate, seeds: int = 1) -> None:
    """The runs about to start, why their compute mode is what it is, and the time they will take."""
    first = configs[0]
    over = f" with each of {seeds} seeds ({first.seed} to {first.seed + seeds - 1}), a seed's runs at a time" \
        if seeds > 1 else ""
    console.print(
        f"Plan: {', '.join(c.label for c in configs)}; {first.model} on {first.data}, batch {first.batch_size}"
        f"{f' in {first.micro_batches} micro-batches' if first.micro_batches != 1 else ''}, "
        f"{first.steps} steps per run{over}. Estimated {estimate.seeds_s(configs, seeds):.0f} s "
        f"(a float32 step measured here: {estimate.float32_step_s * 1e3:.0f} ms)."
    )
    measured = throughput.measure(first.device)
    said: set[torch.dtype] = set()
    for precision, speedup in sorted(estimate.native_speedup.items()):
        dtype = low_dtype(precision, first.device)  # an FP8 or block-scaled setting's: the rest of its model's
        if dtype in said:
            continue
        said.add(dtype)
        line = ", ".join(f"{c} {measured.speedup(c, dtype):.3g}x" for c in GEMM_OPS)
        console.print(f"  native {SHORT_NAMES[dtype]} kernels here run at {line} float32's speed "
                      f"(this model: {speedup:.3g}x), measured on {measured.device_name}: "
                      f"{flags.native_support(first.device, dtype)}.")
    if any(c.float32_compute for c in configs):
        console.print("  fp32-compute runs keep tensors in 16 bits and compute GEMMs and convolutions in float32.")
    if any(c.compiled for c in configs):
        graphs = ("; mode reduce-overhead: each step replays as CUDA graphs on a GPU, the host's per-op launches "
                  "out of the step (on a CPU, torch.compile's default code)"
                  if any(c.compile_mode == "reduce-overhead" for c in configs) else "")
        console.print(f"  compiled runs: each first step compiles, estimated at {estimate.compile_s:.0f} s (the float32 "
                      f"model compiled here; reported apart from the step time){graphs}.")
