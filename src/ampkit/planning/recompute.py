"""Activation memory on a budget: which blocks to recompute in backward instead of saving their activations.

Recomputation trades time for memory (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost":
O(sqrt n) memory for one extra forward; Kirisame et al. 2021, DTR). ``plan_recompute`` measures, per block
of the model (the children of its nn.Sequential / nn.ModuleList containers, as FSDP2's units), the bytes its
ops save for backward and its forward time, in the precision the model trains under (call it inside the
training step's ampkit region, or pass ``policy=``); it then picks the blocks to recompute so that
saved-for-backward fits the budget at the least recompute time. The prediction is exact set arithmetic on
storages: a storage is freed when every op that saved it is inside a recomputed block, and a recomputed
block keeps its inputs instead.

Strategies: ``"auto"`` (the planner: blocks by bytes freed per millisecond of recompute, neighbours merged
into longer segments where the budget asks for it, the unneeded ones dropped again; where no plan of blocks
fits, the whole model as one segment, which keeps only its inputs: Chen's one extra forward, reaching below
what the stem and head outside the blocks save), ``"blocks"`` (every block, the usual ``gradient_checkpointing``) and
``"sqrt"`` (Chen's: about sqrt(n) segments of consecutive blocks per nn.Sequential, each recomputed as one
and keeping only its first input). ``plan.apply(model)`` installs the plan with torch.utils.checkpoint
(non-reentrant), which ampkit makes recompute under the forward's policy and compute mode; batch norms
and FP8 layers inside a recomputed block recompute with the buffers their forward saw (running statistics,
delayed scales) and keep the ones it left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.distributed.units import shard_blocks
from ampkit.float32_compute.gelu_recompute import passthrough
from ampkit.float32_compute.weights import is_weight_copy, weight_storages
from ampkit.planning.segments import checkpoint_module, checkpoint_run
from ampkit.precision.policy import Policy
from ampkit.precision.regions import autocast

STRATEGIES = ("auto", "blocks", "sqrt")
WHOLE = ""  # the whole model as a segment: its name in named_modules()
_OUTSIDE = "(outside the model)"  # what the loss saves: no plan reaches it
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """One block, measured.

    Attributes:
        name: the block's module name.
        saved_bytes: bytes its ops save for backward (storages it shares with other savers included).
        input_bytes: bytes of its tensor inputs (what recomputing it keeps instead).
        forward_ms: its forward time, the price of recomputing it (median of the repeats).
    """

    name: str
    saved_bytes: int
    input_bytes: int
    forward_ms: float


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """What to recompute, and what it is predicted to cost and save (``plan_recompute``).

    Attributes:
        strategy: ``"auto"``, ``"blocks"`` or ``"sqrt"``.
        budget_bytes: the saved-for-backward budget.
        unplanned_bytes: saved-for-backward without a plan (measured).
        planned_bytes: saved-for-backward with the plan (predicted; ``saved_bytes_of_step`` measures it:
            torch's checkpoint saves each segment's inputs through autograd's saved-tensor hooks).
        segments: the recomputed units, each a tuple of consecutive block names (one block each, but
            for ``"sqrt"``); ``(("",),)`` is the whole model.
        extra_ms: the predicted recompute time per step (the segments' forward times).
        blocks: every candidate block, measured, and the whole model (name ``""``).
    """

    strategy: str
    budget_bytes: int
    unplanned_bytes: int
    planned_bytes: int
    segments: tuple[tuple[str, ...], ...]
    extra_ms: float
    blocks: tuple[BlockCost, ...]

    def apply(self, model: nn.Module) -> None:
        """Install the plan on ``model`` (the model it was made for): each segment runs under
        ``torch.utils.checkpoint`` (non-reentrant). Applying twice raises.

        Args:
            model: the model.

        Raises:
            RuntimeError: a plan is installed already.
            ValueError: a segment's block is not in the model.
        """
        if getattr(model, "_ampkit_recompute", None) is not None:
            raise RuntimeError("A recompute plan is installed on this model already: build the model afresh to "
                               "change it (plans do not stack).")
        modules = dict(model.named_modules())
        missing = [name for segment in self.segments for name in segment if name not in modules]
        if missing:
            raise ValueError(f"The plan recomputes {missing[:3]}, which this model does not have: make the plan "
                             "with plan_recompute on this model.")
        for segment in self.segments:
            if len(segment) == 1:
                checkpoint_module(modules[segment[0]])
            else:
                checkpoint_run(modules, segment)
        model._ampkit_recompute = self  # type: ignore[assignment]


def parse_budget(budget: object, unplanned_bytes: int) -> int:
    """A budget in bytes: ``int`` bytes, a ``float`` fraction in (0, 1] of ``unplanned_bytes``, or a string:
    ``"64MiB"``, ``"1.5GB"``, ``"65536"`` (bytes) or ``"0.5"`` (a fraction).

    Raises:
        ValueError: 0, negative, NaN or infinite, a fraction above 1, a bool, or an unreadable string.
    """
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([KMG]?I?B)?\s*", budget.upper())
        if not match:
            raise ValueError(f"budget={budget!r} is unreadable: pass bytes (65536, '64MiB', '1.5GB') or a fraction "
                             "of the unplanned saved-for-backward bytes (0.5).")
        text, unit = match.group(1), match.group(2)
        try:  # without a unit: an integer is bytes, anything else a fraction ("0.5", "1.0")
            budget = int(float(text) * _UNITS[unit]) if unit else int(text)
        except ValueError:
            try:
                budget = float(text)
            except ValueError:
                raise ValueError(f"budget={budget!r} is unreadable: pass bytes (65536, '64MiB') or a fraction (0.5)."
                                 ) from None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"budget={budget!r} is invalid: pass bytes > 0 (65536, '64MiB') or a fraction in (0, 1] of "
                         "the unplanned saved-for-backward bytes (0.5).")
    if isinstance(budget, float):
        if budget > 1:
            raise ValueError(f"budget={budget} is a fraction above 1: fractions are of the unplanned saved-for-"
                             "backward bytes, in (0, 1]; pass bytes as an int (e.g. 67108864) or '64MiB'.")
        return int(budget * unplanned_bytes)
    return int(budget)


def plan_recompute(model: nn.Module, sample_inputs: Any, budget: int | float | str,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None, strategy: str = "auto",
                   policy: Policy | None = None, blocks: list[type[nn.Module]] | None = None,
                   repeats: int = 3) -> RecomputePlan:
    """Choose what to recompute so that saved-for-backward fits ``budget`` at the least recompute time.

    Args:
        model: the model as it trains (after ``ampkit.initialize``, FP8 conversion...).
        sample_inputs: a tensor or a tuple of positional inputs, one step's.
        budget: bytes (int, or ``"64MiB"``) or a fraction in (0, 1] of the unplanned saved-for-backward.
        loss_fn: ``loss_fn(output) -> loss`` (default: mean square of the output).
        strategy: ``"auto"`` (default, the planner), ``"blocks"`` or ``"sqrt"`` (the baselines).
        policy: run the measurement under this ampkit policy (default: whatever region the call is in).
        blocks: module types to treat as blocks (default: the children of the model's containers).
        repeats: forward passes timed (default 3; the median counts).

    Returns:
        A ``RecomputePlan``; ``plan.apply(model)`` installs it.

    Raises:
        ValueError: an unknown strategy, a bad budget (see ``parse_budget``), a model without blocks,
            ``"sqrt"`` over blocks not in an nn.Sequential, or a budget below what any plan of the strategy
            reaches (the smallest feasible budget is named, in bytes).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is invalid: choose one of {list(STRATEGIES)}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid: the number of timed forward passes, an integer >= 1.")
    chosen = shard_blocks(model, blocks)
    if not chosen:
        raise ValueError(f"{type(model).__name__} has no blocks to recompute (no nn.Sequential or nn.ModuleList "
                         "children): pass blocks=[YourBlock].")
    parse_budget(budget, 1)  # refuses a bad budget before measuring
    measured = _measure(model, sample_inputs, loss_fn, policy, chosen, repeats)
    budget_bytes = parse_budget(budget, measured.total())
    if strategy == "sqrt":
        segments = _sqrt_segments(model, chosen)
    elif strategy == "blocks":
        segments = [(name,) for name, _ in chosen]
    else:
        segments = _knapsack(measured, budget_bytes, model)
    planned = measured.predict(segments)
    if planned > budget_bytes:
        floor = measured.predict(segments if strategy != "auto" else _knapsack(measured, 0, model))
        raise ValueError(f"budget {budget_bytes} bytes is below what strategy {strategy!r} reaches: the smallest "
                         f"feasible budget is {floor} bytes (every recomputed block keeps its inputs; unplanned "
                         f"{measured.total()} bytes).")
    costs = {c.name: c for c in measured.costs}
    return RecomputePlan(strategy, budget_bytes, measured.total(), planned, tuple(segments),
                         sum(costs[n].forward_ms for segment in segments for n in segment), tuple(measured.costs))


# -- measurement --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Measured:
    sizes: dict[int, int]  # storage -> bytes, of everything saved for backward
    savers: dict[int, set[str]]  # storage -> the blocks whose ops saved it ("" outside every block)
    inputs: dict[str, dict[int, int]]  # block -> its input storages and their bytes
    costs: list[BlockCost]
    order: list[str]

    def total(self) -> int:
        return sum(self.sizes.values())

    def predict(self, segments: list[tuple[str, ...]] | tuple[tuple[str, ...], ...]) -> int:
        """Saved-for-backward bytes with ``segments`` recomputed: what only their ops saved is freed, and each
        segment keeps its first block's inputs. The whole model holds every block."""
        inside = {name for segment in segments for name in segment}
        if WHOLE in inside:
            inside |= set(self.order)
        kept = {ptr: n for ptr, n in self.sizes.items() if not (self.savers[ptr] <= inside)}
        for segment in segments:
            kept.update(self.inputs.get(segment[0], {}))
        return sum(kept.values())


def _measure(model: nn.Module, sample_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
             policy: Policy | None, chosen: list[tuple[str, nn.Module]], repeats: int) -> _Measured:
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    loss_fn = loss_fn or (lambda out: out.float().pow(2).mean())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    active: list[str] = []
    sizes: dict[int, int] = {}
    savers: dict[int, set[str]] = {}
    inputs: dict[str, dict[int, int]] = {}
    times: dict[str, list[float]] = {name: [] for name, _ in chosen}
    started: dict[str, float] = {}

    @passthrough
    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and not is_weight_copy(t):
            sizes[storage.data_ptr()] = storage.nbytes()
            savers.setdefault(storage.data_ptr(), set()).add(active[-1] if active else _OUTSIDE)
        return t

    def before(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, module_args: tuple) -> None:
            inputs[name] = {a.untyped_storage().data_ptr(): a.untyped_storage().nbytes()
                            for a in module_args if isinstance(a, torch.Tensor)}
            active.append(name)
            _sync(module_args)
            started[name] = time.perf_counter()
        return hook

    def after(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, module_args: tuple, output: Any) -> None:
            _sync(output)
            times[name].append((time.perf_counter() - started[name]) * 1e3)
            active.pop()
        return hook

    candidates = [(WHOLE, model), *chosen]  # the model's own ops, outside every block, save as ""
    times[WHOLE] = []
    handles = [h for name, m in candidates for h in (m.register_forward_pre_hook(before(name)),
                                                      m.register_forward_hook(after(name)))]
    region = autocast(policy) if policy is not None else contextlib.nullcontext()
    # Measuring is not training: buffers (batch-norm statistics, FP8 amax histories), the random
    # generators (dropout, stochastic rounding) are put back as they were.
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    generators = [(g, g.get_state()) for m in model.modules() if isinstance(g := getattr(m, "generator", None),
                                                                             torch.Generator)]
    rng = torch.get_rng_state()
    try:
        for _ in range(repeats):
            sizes.clear()
            savers.clear()
            with region, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = loss_fn(model(*args))
                weights = weight_storages()
            del loss  # the graph goes: nothing is kept between repeats
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        for g, state in generators:
            g.set_state(state)
        torch.set_rng_state(rng)
    for ptr in weights:
        sizes.pop(ptr, None)
    costs = [BlockCost(name, sum(sizes[p] for p in sizes if name in savers[p]), sum(inputs.get(name, {}).values()),
                       statistics.median(times[name]) if times[name] else 0.0) for name, _ in candidates]
    return _Measured(sizes, savers, inputs, costs, [name for name, _ in chosen])


def _sync(value: Any) -> None:
    """Wait for the device before reading the clock (a CUDA tensor among a module's inputs or outputs)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    for tensor in values:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
            return


def _knapsack(measured: _Measured, budget: int, model: nn.Module) -> list[tuple[str, ...]]:
    """Blocks by bytes freed per millisecond of recompute until the prediction fits; then, if it still does
    not, neighbours in one nn.Sequential merged into one segment (free: the same blocks are recomputed, and
    the inner inputs are no longer kept), the most bytes first; then any block the fit no longer needs
    dropped again (the most expensive first)."""
    costs = {c.name: c for c in measured.costs}
    chosen: list[tuple[str, ...]] = []
    remaining = list(measured.order)
    while measured.predict(chosen) > budget and remaining:
        now = measured.predict(chosen)

        def gain(name: str) -> float:
            return (now - measured.predict([*chosen, (name,)])) / max(costs[name].forward_ms, 1e-6)

        best = max(remaining, key=gain)
        if now - measured.predict([*chosen, (best,)]) <= 0:
            break
        chosen.append((best,))
        remaining.remove(best)
    order = {name: i for i, name in enumerate(measured.order)}
    chosen.sort(key=lambda s: order[s[0]])
    sequential = _sequential_neighbours(model, measured.order)
    while measured.predict(chosen) > budget:
        merges = [i for i in range(len(chosen) - 1) if (chosen[i][-1], chosen[i + 1][0]) in sequential]
        if not merges:
            break
        best_i = min(merges, key=lambda i: measured.predict(chosen[:i] + [chosen[i] + chosen[i + 1]] + chosen[i + 2:]))
        chosen = chosen[:best_i] + [chosen[best_i] + chosen[best_i + 1]] + chosen[best_i + 2:]
    for segment in sorted([s for s in chosen if len(s) == 1], key=lambda s: -costs[s[0]].forward_ms):
        rest = [s for s in chosen if s != segment]
        if measured.predict(rest) <= budget:
            chosen = rest
    whole: list[tuple[str, ...]] = [(WHOLE,)]
    if measured.predict(chosen) > budget and measured.predict(whole) < measured.predict(chosen):
        return whole  # below the blocks' reach: one extra forward of everything, keeping only the inputs
    return chosen


def _sequential_neighbours(model: nn.Module, names: list[str]) -> set[tuple[str, str]]:
    """Pairs of blocks that are consecutive children of one nn.Sequential (a segment can run both)."""
    modules = dict(model.named_modules())
    pairs = set()
    for first, second in zip(names, names[1:]):
        parent = first.rpartition(".")[0]
        if parent == second.rpartition(".")[0] and isinstance(modules.get(parent, model), nn.Sequential):
            children = list(dict(modules[parent].named_children()) if parent else dict(model.named_children()))
            a, b = first.rpartition(".")[2], second.rpartition(".")[2]
            if children.index(b) == children.index(a) + 1:
                pairs.add((first, second))
    return pairs


def _sqrt_segments(model: nn.Module, chosen: list[tuple[str, nn.Module]]) -> list[tuple[str, ...]]:
    """Chen's segments: per container, about sqrt(n) runs of consecutive blocks."""
    modules = dict(model.named_modules())
    by_container: dict[str, list[str]] = {}
    for name, _ in chosen:
        parent = name.rpartition(".")[0]
        if not isinstance(modules.get(parent, model), nn.Sequential):
            raise ValueError(f"strategy='sqrt' recomputes runs of consecutive blocks of an nn.Sequential; {name!r} "
                             "is not in one: use strategy='auto' or 'blocks'.")
        by_container.setdefault(parent, []).append(name)
    segments = []
    for names in by_container.values():
        size = max(1, math.ceil(math.sqrt(len(names))))
        segments += [tuple(names[i:i + size]) for i in range(0, len(names), size)]
    return segments
