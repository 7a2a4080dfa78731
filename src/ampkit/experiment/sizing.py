"""How large `ampkit compare`'s model and batch are: ``small`` (the sizes a 2-core CPU trains in a minute or two),
``medium``, ``large``, or ``auto``: the smallest at which float32's step is arithmetic-bound here.

Mixed precision speeds up arithmetic: 16-bit GEMMs on a GPU's tensor cores run ten times float32's rate or more.
A step whose time is set by something else (each op's launch, Python, the casts and element-wise ops around the
GEMMs) cannot show it: at the small sizes an H200 spent most of a float32 step on per-op work, and every mixed
setting came out slower than float32 (BENCHMARKS.md, "A GPU"). ``auto`` measures the two parts instead of
guessing: it times float32 steps of the small model here, computes the part of them its GEMMs take from their
FLOPs (counted by torch's FlopCounterMode) at the GEMM rates ``hardware.throughput`` measured, and calls the rest
per-op work, which does not grow with the batch or the width. Each larger size's GEMM time follows from its
FLOPs (counted in a step of two samples, scaled to its batch); ``choose`` takes the smallest size whose GEMMs take at
least ``ARITHMETIC_SHARE`` of its float32 step, whose runs fit the free memory together, and whose float32 run
stays within ``MAX_FLOAT32_RUN_S``. ``auto`` is CUDA's default only: on a CPU a larger size's runs take minutes
where the main job takes one, and the small sizes' figures stay comparable from one record to the next, so the CPU's
default stays ``small`` (``--size auto`` there measures as anywhere, and may grow a model whose small step is mostly
per-op work, as the MLP's is).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ampkit.experiment import data as data_mod
from ampkit.experiment.config import CONTEXT
from ampkit.experiment.hf_models import PREFIX
from ampkit.experiment.models import MODELS, build
from ampkit.experiment.timing import synchronizer, timed_step
from ampkit.hardware import throughput

SIZES = ("auto", "small", "medium", "large")
RUNGS = SIZES[1:]
_TRANSFORMER = {"small": (32, {}), "medium": (64, {"d_model": 512, "n_layers": 4, "n_heads": 8}),
                "large": (128, {"d_model": 1024, "n_layers": 8, "n_heads": 16})}
# Per built-in model: per size, the batch and the model's keyword arguments (``small`` is the model's defaults).
# The images' larger sizes keep 28x28 through the first stage (the small stem: about 16x the arithmetic).
LADDER: dict[str, dict[str, tuple[int, dict[str, Any]]]] = {
    "gpt": _TRANSFORMER, "gpt-outlier": _TRANSFORMER, "gpt-overflow": _TRANSFORMER, PREFIX: _TRANSFORMER,
    "resnet18": {"small": (64, {}), "medium": (256, {"stem": "small"}), "large": (1024, {"stem": "small"})},
    "mlp": {"small": (64, {}), "medium": (256, {"hidden": 2048}), "large": (1024, {"hidden": 4096})},
}
ARITHMETIC_SHARE = 0.75  # float32's GEMMs three times the rest of its step: what mixed precision speeds up leads
MAX_FLOAT32_RUN_S = 60.0  # a larger size whose float32 run would take longer is not chosen
MEMORY_MARGIN = 1.5  # free memory needed over the runs' estimated bytes (allocator caches, workspaces, a context)
TIMED_STEPS = 3
COUNTED = 2  # samples of the step that counts a size's FLOPs and bytes (batch norm needs two)


def ladder(model: str) -> dict[str, tuple[int, dict[str, Any]]] | None:
    """The sizes of a built-in model (``hf:`` names with their family's); None for a model of your own."""
    return LADDER.get(PREFIX if model.startswith(PREFIX) else model)


def check_size(size: str, model: str) -> None:
    """Refuse an unknown size, or a larger size for a model of the user's own (its sizes are its factory's)."""
    if size not in SIZES:
        raise ValueError(f"Unknown size {size!r}. Choose one of {list(SIZES)}.")
    if size in ("medium", "large") and ladder(model) is None:
        raise ValueError(f"size={size!r} sets a built-in model's width and batch; model={model!r} is your own, its "
                         "sizes are your factory's: use size='small' (or 'auto') and --batch-size.")


def model_kwargs(model: str, size: str) -> dict[str, Any]:
    """The keyword arguments of ``model`` at ``size`` (none at ``small`` and for a model of your own)."""
    sizes = ladder(model)
    return {} if sizes is None or size not in sizes else dict(sizes[size][1])


def batch_size(model: str, size: str) -> int | None:
    """The batch of ``model`` at ``size``; None at ``small`` (and ``auto``, not yet chosen) or for a model of your own
    (its default stands)."""
    sizes = ladder(model)
    return sizes[size][0] if sizes is not None and size in ("medium", "large") else None


@dataclasses.dataclass(frozen=True)
class Rung:
    """One size of a model as ``choose`` weighs it.

    Attributes:
        name: small, medium or large.
        flops: op class (``matmul``, ``conv``) -> FLOPs of one float32 training step's GEMMs.
        step_bytes: a float32 run's bytes: weights, gradients and AdamW's two moments, and one step's saved
            activations.
    """

    name: str
    flops: dict[str, float]
    step_bytes: int


@dataclasses.dataclass(frozen=True)
class SizeChoice:
    """What ``auto`` chose and why (``why``: a sentence for the plan)."""

    name: str
    why: str


def gemm_s(rung: Rung, rates: dict[str, float]) -> float:
    """Seconds ``rung``'s GEMMs take at ``rates`` (op class -> float32 FLOPs per second)."""
    return sum(flops / rates[op] for op, flops in rung.flops.items())


def choose(rungs: list[Rung], step_s: float, rates: dict[str, float], free_bytes: int, processes: int,
           steps: int) -> SizeChoice:
    """The smallest of ``rungs`` (small first) whose float32 step is arithmetic-bound here.

    Args:
        rungs: the model's sizes, small first.
        step_s: a float32 training step of ``rungs[0]``, measured here.
        rates: op class -> float32 FLOPs per second, measured here.
        free_bytes: the device's free memory.
        processes: the runs that hold memory at once (a seed's runs).
        steps: the steps of a run.
    """
    overhead_s = max(step_s - gemm_s(rungs[0], rates), 0.0)  # per-op work: the same at every size

    def share(rung: Rung) -> float:
        return gemm_s(rung, rates) / (gemm_s(rung, rates) + overhead_s)

    def fits(rung: Rung) -> bool:
        return rung.step_bytes * processes * MEMORY_MARGIN <= free_bytes and \
            (gemm_s(rung, rates) + overhead_s) * steps <= MAX_FLOAT32_RUN_S

    usable = [rungs[0]] + [rung for rung in rungs[1:] if fits(rung)]
    chosen = next((rung for rung in usable if share(rung) >= ARITHMETIC_SHARE), usable[-1])
    small = (f"at small, float32's GEMMs take {1e3 * gemm_s(rungs[0], rates):.3g} ms of a {1e3 * step_s:.3g} ms "
             f"step here ({100 * share(rungs[0]):.0f}%; the rest, {1e3 * overhead_s:.3g} ms, is per-op work)")
    if chosen is rungs[0]:
        reason = "arithmetic-bound already" if share(chosen) >= ARITHMETIC_SHARE else \
            "no larger size fits the free memory and a minute's float32 run"
        return SizeChoice(chosen.name, f"{chosen.name} ({reason}: {small})")
    bound = "arithmetic-bound" if share(chosen) >= ARITHMETIC_SHARE else "the largest that fits"
    return SizeChoice(chosen.name, f"{chosen.name}, {bound}: {small}; at {chosen.name} an estimated "
                      f"{1e3 * gemm_s(chosen, rates):.3g} ms ({100 * share(chosen):.0f}%), "
                      f"{chosen.step_bytes * processes / 2**30:.2g} GiB for {processes} runs of "
                      f"{free_bytes / 2**30:.3g} GiB free")


def rung(model: str, data: str, size: str, device: torch.device) -> Rung:
    """``model`` at ``size`` on ``data``: its GEMMs' FLOPs and a float32 run's bytes, counted in a step of
    ``COUNTED`` samples on ``device`` and scaled to the size's batch (a training step's FLOPs and saved activations
    grow in proportion to the batch; transformers' models read tensors' values as they run, so the meta device,
    which has none, cannot count them)."""
    dataset = data_mod.load(data)
    batch = (ladder(model) or {})[size][0]
    saved = 0
    net = build(model, **dataset.model_kwargs(CONTEXT), **model_kwargs(model, size)).to(device)
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}

    def count(tensor: torch.Tensor) -> torch.Tensor:  # activations only: a weight saved for backward is no more
        nonlocal saved
        if tensor.untyped_storage().data_ptr() not in weights:
            saved += tensor.numel() * tensor.element_size()
        return tensor

    if dataset.kind == "text":
        x = torch.zeros(COUNTED, CONTEXT, dtype=torch.long, device=device)
    else:
        x = torch.randn(COUNTED, *dataset.train_x.shape[1:], device=device)
    with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        net(x).float().sum().backward()
    flops: dict[str, float] = {}
    for op, n in counter.get_flop_counts().get("Global", {}).items():
        name = "conv" if "convolution" in str(op) else "matmul"
        flops[name] = flops.get(name, 0.0) + n * batch / COUNTED
    parameters = sum(p.numel() for p in net.parameters())
    return Rung(size, flops, 16 * parameters + saved * batch // COUNTED)


def measured_rates(device: torch.device) -> dict[str, float]:
    """float32 FLOPs per second of a GEMM and of a convolution here (``hardware.throughput``'s shapes and times)."""
    measured = throughput.measure(device)
    n = measured.shapes["matmul"][0]
    batch, channels, height, width = measured.shapes["conv"]
    conv_flops = 2 * batch * channels * channels * 9 * height * width
    return {"matmul": 2 * n**3 / (measured.time_us["matmul"]["float32"] * 1e-6),
            "conv": conv_flops / (measured.time_us["conv"]["float32"] * 1e-6)}


@functools.lru_cache(maxsize=8)
def auto(model: str, data: str, device: torch.device, processes: int, steps: int) -> SizeChoice:
    """The size ``choose`` takes for ``model`` here, from float32 steps of its small size timed on ``device``
    (measured once per process for the same arguments: ``plan`` and the plan's printout ask alike)."""
    if ladder(model) is None:
        return SizeChoice("small", "small (your own model: its sizes are its factory's)")
    step_s = _float32_step_s(model, data, device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _available_cpu_bytes()
    rungs = [rung(model, data, name, device) for name in RUNGS]
    return choose(rungs, step_s, measured_rates(device), free, processes, steps)


def _float32_step_s(model: str, data: str, device: torch.device) -> float:
    """The median of ``TIMED_STEPS`` float32 training steps of ``model``'s small size (after a warm-up step)."""
    dataset = data_mod.load(data)
    net = build(model, **dataset.model_kwargs(CONTEXT)).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.0)  # lr 0: timed, not trained
    small_batch = LADDER["gpt" if dataset.kind == "text" else "mlp"]["small"][0]
    x, y = (t.to(device) for t in data_mod.first_batch(dataset, small_batch, CONTEXT))
    sync = synchronizer(device)
    timed_step(net, optimizer, x, y, sync)  # the warm-up
    return statistics.median(timed_step(net, optimizer, x, y, sync)[0] for _ in range(TIMED_STEPS))


def _available_cpu_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else a size that never limits."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62
