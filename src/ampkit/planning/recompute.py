"""Activation memory on a budget: which blocks to recompute in backward instead of saving their activations.

Recomputation trades time for memory (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost":
O(sqrt n) memory for one extra forward; Kirisame et al. 2021, DTR). ``plan_recompute`` measures, per block
of the model (the children of its nn.Sequential / nn.ModuleList containers, as FSDP2's units), the bytes its
ops save for backward and its forward time, in the precision the model trains under (call it inside the
training step's ampkit region, or pass ``policy=``); it then picks the blocks to recompute so that
saved-for-backward fits the budget at the least recompute time. The prediction is exact set arithmetic on
storages: a storage is freed when every op that saved it is inside a recomputed block, and a recomputed
block keeps its inputs instead.

Each block can also be recomputed selectively, keeping its GEMM and attention outputs (``selective.py``);
its recompute costs, whole and selective, are timed on the block itself (``measure.py``).

Strategies: ``"auto"`` (the planner: blocks by bytes freed per millisecond of recompute, neighbours merged
into longer segments where the budget asks for it, the unneeded ones dropped again; where no plan of blocks
fits, the whole model as one segment, which keeps only its inputs: Chen's one extra forward, reaching below
what the stem and head outside the blocks save; a baseline's plan where it fits and times faster),
``"blocks"`` (every block, the usual ``gradient_checkpointing``) and
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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.distributed.units import shard_blocks
from ampkit.planning.measure import WHOLE, BlockCost, Measured, measure, step_ms
from ampkit.planning.segments import install
from ampkit.precision.policy import Policy
from ampkit.shards import is_sharded

STRATEGIES = ("auto", "blocks", "sqrt")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


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
        extra_ms: the predicted recompute time per step (the segments' measured ``recompute_ms``, a
            selective one's ``selective_ms``).
        blocks: every candidate block, measured, and the whole model (name ``""``).
        selective: the one-block segments recomputed selectively, keeping their GEMM and attention
            outputs (``planning/selective.py``); the others recompute every op.
    """

    strategy: str
    budget_bytes: int
    unplanned_bytes: int
    planned_bytes: int
    segments: tuple[tuple[str, ...], ...]
    extra_ms: float
    blocks: tuple[BlockCost, ...]
    selective: tuple[str, ...] = ()

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
        install(model, self.segments, self.selective)
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
                   repeats: int = 3, selective: bool = True) -> RecomputePlan:
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
        selective: the planner may recompute a block but for its GEMMs and attention (default). False:
            whole blocks only. The baselines always recompute whole blocks.

    Returns:
        A ``RecomputePlan``; ``plan.apply(model)`` installs it.

    Raises:
        ValueError: an unknown strategy, a bad budget (see ``parse_budget``), a model without blocks or sharded
            by FSDP2 (plan it before sharding), ``"sqrt"`` over blocks not in an nn.Sequential, or a budget below
            what any plan of the strategy reaches (the smallest feasible budget is named, in bytes).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is invalid: choose one of {list(STRATEGIES)}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid: the number of timed forward passes, an integer >= 1.")
    if any(is_sharded(p) for p in model.parameters()):
        raise ValueError("plan_recompute measures a model in one process, and this one is sharded by FSDP2 (DTensor "
                         "parameters, gathered and freed around each unit). Plan the float32 model before sharding, on "
                         "one rank's batch under the policy it will train at, then apply the plan and shard it: "
                         "plan = ampkit.plan_recompute(model, x, budget, policy=ampkit.Policy.default('cpu', "
                         "torch.bfloat16)); plan.apply(model); model = ampkit.distributed.fully_shard(model, "
                         "opt_level='O2', ...).")
    chosen = shard_blocks(model, blocks)
    if not chosen:
        raise ValueError(f"{type(model).__name__} has no blocks to recompute (no nn.Sequential or nn.ModuleList "
                         "children): pass blocks=[YourBlock].")
    parse_budget(budget, 1)  # refuses a bad budget before measuring
    measured = measure(model, sample_inputs, loss_fn, policy, chosen, repeats)
    budget_bytes = parse_budget(budget, measured.total())
    costs = {c.name: c for c in measured.costs}

    def extra_ms(segments: list[tuple[str, ...]], partial: set[str]) -> float:
        return sum(costs[n].selective_ms if n in partial else costs[n].recompute_ms for seg in segments for n in seg)

    partial: set[str] = set()
    segments: list[tuple[str, ...]]
    if strategy == "sqrt":
        segments = _sqrt_segments(model, chosen)
    elif strategy == "blocks":
        segments = [(name,) for name, _ in chosen]
    else:
        segments, partial = _against_baselines(
            measured, budget_bytes, model, chosen,
            _knapsack(measured, budget_bytes, model, selective),
            lambda plans: step_ms(model, sample_inputs, loss_fn, policy, plans, repeats))
    planned = measured.predict(segments, partial)
    if planned > budget_bytes:
        floor = measured.predict(segments if strategy != "auto" else _knapsack(measured, 0, model, False)[0])
        raise ValueError(f"budget {budget_bytes} bytes is below what strategy {strategy!r} reaches: the smallest "
                         f"feasible budget is {floor} bytes (every recomputed block keeps its inputs; unplanned "
                         f"{measured.total()} bytes).")
    return RecomputePlan(strategy, budget_bytes, measured.total(), planned, tuple(segments),
                         extra_ms(segments, partial), tuple(measured.costs),
                         tuple(n for n in measured.order if n in partial))


_Plan = tuple[list[tuple[str, ...]], set[str]]  # the segments, and the blocks among them recomputed selectively


def _against_baselines(measured: Measured, budget: int, model: nn.Module, chosen: list[tuple[str, nn.Module]],
                       plan: _Plan, time_plans: Callable[[list[_Plan]], list[tuple[float, float]]]) -> _Plan:
    """The knapsack is greedy, on costs measured block by block: the baselines (every block, Chen's
    segments) are checked against its plan where they fit the budget. One that recomputes only blocks the
    plan recomputes whole, and keeps no more bytes, is the plan (no more recompute; its longer segments
    cost fewer checkpoints). Otherwise the plans are timed as installed (``time_plans``: forward and
    backward of the sample, median and its standard error), and a baseline replaces the knapsack's plan
    only where it is faster by more than twice the standard error of the difference (plans of the same
    work time alike, and noise must not pick among them)."""
    segments, partial = plan
    baselines: list[list[tuple[str, ...]]] = [[(name,) for name, _ in chosen]]
    with contextlib.suppress(ValueError):  # blocks outside an nn.Sequential: no sqrt(n) segments
        baselines.append(_sqrt_segments(model, chosen))
    fitting = [b for b in baselines if measured.predict(b) <= budget and (b, set()) != plan]
    whole = {name for segment in segments for name in segment} - partial
    covered = [b for b in fitting if {name for segment in b for name in segment} <= whole
               and measured.predict(b) <= measured.predict(segments, partial)]
    if covered:
        return min(covered, key=measured.predict), set()
    if not fitting:
        return plan
    candidates = [plan, *((b, set()) for b in fitting)]
    times = time_plans(candidates)
    (own, error), (best, best_error) = times[0], min(times[1:])
    if best + 2 * math.hypot(error, best_error) < own:
        return candidates[times.index((best, best_error))]
    return plan


def _knapsack(measured: Measured, budget: int, model: nn.Module,
              selective: bool) -> tuple[list[tuple[str, ...]], set[str]]:
    """Blocks by bytes freed per millisecond of recompute until the prediction fits, each block recomputed
    whole or (``selective``) but for its GEMMs and attention, and a selective one made whole where that is
    the best next step; then, if it still does not fit, neighbours in one nn.Sequential merged into one
    segment (free: the same blocks are recomputed, and the inner inputs are no longer kept), the most bytes
    first; then any block the fit no longer needs dropped again, or made selective, the most expensive
    first. Returns the segments and the blocks among them recomputed selectively."""
    costs = {c.name: c for c in measured.costs}
    whole_blocks: list[tuple[str, ...]] = []
    partial: set[str] = set()

    def predict(segments: list[tuple[str, ...]], selected: set[str]) -> int:
        return measured.predict(segments + [(n,) for n in selected], selected)

    def fits(segments: list[tuple[str, ...]], selected: set[str]) -> bool:
        return predict(segments, selected) <= budget

    while not fits(whole_blocks, partial):
        now, steps = predict(whole_blocks, partial), []
        for name in measured.order:
            if (name,) in whole_blocks:
                continue
            spent = costs[name].selective_ms if name in partial else 0.0
            options = [(whole_blocks + [(name,)], partial - {name}, costs[name].recompute_ms)]
            if selective and name not in partial:
                options.append((whole_blocks, partial | {name}, costs[name].selective_ms))
            for segments, selected, ms in options:
                freed = now - predict(segments, selected)
                if freed > 0:
                    steps.append((freed / max(ms - spent, 1e-6), segments, selected))
        if not steps:
            break
        _, whole_blocks, partial = max(steps, key=lambda step: step[0])
    order = {name: i for i, name in enumerate(measured.order)}
    whole_blocks.sort(key=lambda s: order[s[0]])
    sequential = _sequential_neighbours(model, measured.order)
    while not fits(whole_blocks, partial):
        merges = [i for i in range(len(whole_blocks) - 1)
                  if (whole_blocks[i][-1], whole_blocks[i + 1][0]) in sequential]
        if not merges:
            break

        def merged(i: int) -> list[tuple[str, ...]]:
            return whole_blocks[:i] + [whole_blocks[i] + whole_blocks[i + 1]] + whole_blocks[i + 2:]

        whole_blocks = merged(min(merges, key=lambda i: predict(merged(i), partial)))
    for segment in sorted([s for s in whole_blocks if len(s) == 1], key=lambda s: -costs[s[0]].recompute_ms):
        rest = [s for s in whole_blocks if s != segment]
        if fits(rest, partial):
            whole_blocks = rest
        elif selective and fits(rest, partial | {segment[0]}):
            whole_blocks, partial = rest, partial | {segment[0]}
    for name in sorted(partial, key=lambda n: -costs[n].selective_ms):
        if fits(whole_blocks, partial - {name}):
            partial = partial - {name}
    segments = sorted(whole_blocks + [(n,) for n in partial], key=lambda s: order[s[0]])
    whole: list[tuple[str, ...]] = [(WHOLE,)]
    if not fits(whole_blocks, partial) and measured.predict(whole) < predict(whole_blocks, partial):
        return whole, set()  # below the blocks' reach: one extra forward of everything, keeping only the inputs
    return segments, partial


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
