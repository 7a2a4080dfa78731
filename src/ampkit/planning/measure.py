"""The recompute planner's measurement: per block, what its ops save for backward, its inputs, its forward
time, and what a selective recompute of it would keep and repeat; and the prediction of a plan's
saved-for-backward bytes from them, exact set arithmetic on storages (``recompute.py`` chooses).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit import _trees
from ampkit.diagnostics.memory import observing_kept
from ampkit.float32_compute.single_ops import single_ops
from ampkit.float32_compute.weights import is_weight_copy
from ampkit.planning.segments import installed
from ampkit.planning.selective import OpRecorder, contexts
from ampkit.precision.checkpointing import checkpoint_context_fn
from ampkit.precision.op_lists import DEVICE_TYPES
from ampkit.precision.policy import Policy
from ampkit.precision.regions import autocast
from ampkit.precision.state import current_region

WHOLE = ""  # the whole model as a segment: its name in named_modules()
_OUTSIDE = "(outside the model)"  # what the loss saves: no plan reaches it


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """One block, measured.

    Attributes:
        name: the block's module name.
        saved_bytes: bytes its ops save for backward (storages it shares with other savers included).
        input_bytes: bytes of its tensor inputs (what recomputing it keeps instead).
        forward_ms: its forward time (median of the repeats).
        recompute_ms: what recomputing it adds to a training step: the block's own step (forward and
            backward, on the inputs it saw, under the policy it ran in) under torch's checkpoint, less the
            same step without (median of paired runs); the whole model's: its ``forward_ms``.
        selective_kept_bytes: bytes of its GEMM and attention outputs, what a selective recompute keeps
            besides its inputs (0 for the whole model, which is never recomputed selectively).
        selective_ms: what a selective recompute adds, measured as ``recompute_ms`` is (the checkpoint's
            dispatch modes run every op of the block through Python, forward and recompute: on a CPU
            that can cost more than the ops it spares).
    """

    name: str
    saved_bytes: int
    input_bytes: int
    forward_ms: float
    recompute_ms: float = 0.0
    selective_kept_bytes: int = 0
    selective_ms: float = 0.0


@dataclasses.dataclass
class Measured:
    sizes: dict[int, int]  # storage -> bytes, of everything saved for backward
    savers: dict[int, set[str]]  # storage -> the blocks whose ops saved it ("" outside every block)
    inputs: dict[str, dict[int, int]]  # block -> its input storages and their bytes
    kept: dict[str, dict[int, int]]  # block -> its GEMM and attention output storages and their bytes
    costs: list[BlockCost]
    order: list[str]

    def total(self) -> int:
        return sum(self.sizes.values())

    def predict(self, segments: Iterable[tuple[str, ...]], selective: Iterable[str] = ()) -> int:
        """Saved-for-backward bytes with ``segments`` recomputed (``selective``: the one-block segments
        recomputed but for their GEMMs and attention): what only their ops saved is freed, each segment
        keeps its first block's inputs, a selective one its GEMM and attention outputs too. The whole
        model holds every block."""
        segments = list(segments)
        inside = {name for segment in segments for name in segment}
        if WHOLE in inside:
            inside |= set(self.order)
        kept = {ptr: n for ptr, n in self.sizes.items() if not (self.savers[ptr] <= inside)}
        for segment in segments:
            kept.update(self.inputs.get(segment[0], {}))
        for name in selective:
            kept.update(self.kept.get(name, {}))
        return sum(kept.values())


def measure(model: nn.Module, sample_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
            policy: Policy | None, chosen: list[tuple[str, nn.Module]], repeats: int) -> Measured:
    """``repeats`` timed forwards and one more that records every op (``selective.OpRecorder``); the
    storages are the last one's, so that every figure refers to the same tensors. Then each block's
    recompute, whole and selective, timed on the inputs it saw there (``_recompute_ms``)."""
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    loss_fn = loss_fn or (lambda out: out.float().pow(2).mean())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    active: list[str] = []
    sizes: dict[int, int] = {}
    savers: dict[int, set[str]] = {}
    inputs: dict[str, dict[int, int]] = {}
    times: dict[str, list[float]] = {name: [] for name, _ in chosen}
    started: dict[str, float] = {}
    # block -> its inputs and the policies it ran under, each with the model its overrides name
    seen: dict[str, tuple[tuple, dict, list[tuple[Policy, nn.Module | None]]]] = {}
    recorder = OpRecorder(lambda: active[-1] if active and active[-1] != WHOLE else None)
    recording = [False]

    def count(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and not is_weight_copy(t):
            sizes[storage.data_ptr()] = storage.nbytes()
            savers.setdefault(storage.data_ptr(), set()).add(active[-1] if active else _OUTSIDE)

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    def before(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, module_args: tuple, module_kwargs: dict) -> None:
            # what torch's checkpoint saves for backward: its positional tensor inputs (keyword ones it holds by
            # reference, unsaved; a transformers block's rotary cos and sin, shared by every block)
            inputs[name] = {a.untyped_storage().data_ptr(): a.untyped_storage().nbytes()
                            for a in module_args if isinstance(a, torch.Tensor)}
            if recording[0] and name != WHOLE:
                _check_replayable(name, module_args, module_kwargs)
                seen[name] = (module_args, module_kwargs, [(r.policy, r.model) for r in map(current_region, DEVICE_TYPES)
                                                            if r is not None and r.policy is not None])
            active.append(name)
            _sync(module_args)
            started[name] = time.perf_counter()
        return hook

    def after(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, module_args: tuple, output: Any) -> None:
            _sync(output)
            if not recording[0]:
                times[name].append((time.perf_counter() - started[name]) * 1e3)
            active.pop()
        return hook

    candidates = [(WHOLE, model), *chosen]  # the model's own ops, outside every block, save as ""
    times[WHOLE] = []
    handles = [h for name, m in candidates for h in (m.register_forward_pre_hook(before(name), with_kwargs=True),
                                                      m.register_forward_hook(after(name)))]
    region = autocast(policy, model=model) if policy is not None else contextlib.nullcontext()
    try:
        with untouched(model):
            for repeat in range(repeats + 1):
                sizes.clear()
                savers.clear()
                recording[0] = repeat == repeats  # the last forward records ops (as a selective recompute runs them)
                with contextlib.ExitStack() as stack:
                    stack.enter_context(region)
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
                    stack.enter_context(observing_kept(count))  # a block the model recomputes selectively already
                    if recording[0]:
                        stack.enter_context(single_ops())
                        stack.enter_context(recorder)
                    loss = loss_fn(model(*args))
                del loss  # the graph goes: nothing is kept between repeats
            for handle in handles:  # (and again below, where an error leaves early)
                handle.remove()
            extra = {name: _recompute_ms(module, *seen[name], repeats) for name, module in chosen if name in seen}
    finally:
        for handle in handles:
            handle.remove()
    kept = {name: recorder.kept.get(name, {}) for name, _ in chosen}
    costs = []
    for name, _ in candidates:
        forward_ms = statistics.median(times[name]) if times[name] else 0.0
        whole_ms, selective_ms = extra.get(name, (forward_ms, 0.0))
        costs.append(BlockCost(name, sum(sizes[p] for p in sizes if name in savers[p]),
                               sum(inputs.get(name, {}).values()), forward_ms, whole_ms,
                               sum(kept.get(name, {}).values()), selective_ms))
    return Measured(sizes, savers, inputs, kept, costs, [name for name, _ in chosen])


def step_ms(model: nn.Module, sample_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
            policy: Policy | None, plans: list[tuple[list[tuple[str, ...]], set[str]]],
            repeats: int) -> list[tuple[float, float]]:
    """Each plan's forward and backward of the sample (ms), installed in turn (``segments.installed``),
    in alternating order: (median, its standard error); the model and its ``.grad`` as they were after."""
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    loss_fn = loss_fn or (lambda out: out.float().pow(2).mean())
    params = [p for p in model.parameters() if p.requires_grad]
    region = autocast(policy, model=model) if policy is not None else contextlib.nullcontext()

    def step(plan: tuple[list[tuple[str, ...]], set[str]]) -> float:
        with installed(model, *plan), region:
            started = time.perf_counter()
            loss = loss_fn(model(*args))
            if loss.requires_grad and params:
                torch.autograd.grad(loss, params, allow_unused=True)
            _sync(loss)
            return (time.perf_counter() - started) * 1e3

    runs: list[list[float]] = [[] for _ in plans]
    with untouched(model):
        for repeat in range(2 * repeats + 2):
            for i in (range(len(plans)) if repeat % 2 else reversed(range(len(plans)))):
                runs[i].append(step(plans[i]))
    # The first run warms up. The median's standard error: 1.2533 sigma / sqrt(n), for normal noise.
    return [(statistics.median(r[1:]), 1.2533 * statistics.stdev(r[1:]) / math.sqrt(len(r) - 1)) for r in runs]


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Measuring is not training: the model's buffers (batch-norm statistics, FP8 amax histories, NVFP4's
    counts of stochastic rounding draws) and torch's random generator are put back as they were."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(rng)


# What a block may take and be replayed on alone: tensors and plain values, in tuples, lists and dicts (_trees.py).
# Anything else (transformers' key/value cache) the block may change, and a replay would see it changed.
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, through its containers."""
    return [t for t in _trees.leaves(value) if isinstance(t, torch.Tensor)]


def _check_replayable(name: str, args: tuple, kwargs: dict) -> None:
    """Refuse a block whose inputs hold an object it may change (ValueError), before any plan is made."""
    for where, value in [*((f"positional input {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        found = next((leaf for leaf in _trees.leaves(value) if not isinstance(leaf, (torch.Tensor, *_PLAIN))),
                     None)
        if found is not None:
            raise ValueError(
                f"Block {name!r} takes a {type(found).__name__} ({where}): the planner measures each block by running "
                "it again alone, as a recompute does, and an object the block may change (a key/value cache appends "
                "at every call) would not be as it was. Train without it, as transformers' own gradient "
                "checkpointing does: model.config.use_cache = False, and the same on each config a sub-model keeps "
                "as its own copy (T5's: model.decoder.config.use_cache = False).")


def _detached(value: Any) -> Any:
    """``value`` with each tensor detached (keeping ``requires_grad``), through its containers."""
    return _trees.map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), value)


def _recompute_ms(module: nn.Module, args: tuple, kwargs: dict, policies: list[tuple[Policy, nn.Module | None]],
                  repeats: int) -> tuple[float, float]:
    """What recomputing ``module`` adds to a step, whole and selective (ms): its own forward and backward
    on ``args`` and ``kwargs`` under ``policies``, checkpointed less plain, paired runs in alternating order,
    medians."""
    def step(context_fn: Callable[[], Any] | None) -> float:
        inputs, keywords = _detached(args), _detached(kwargs)
        with contextlib.ExitStack() as stack:
            for policy, model in policies:  # each with the model its overrides name
                stack.enter_context(autocast(policy, model=model))
            _sync(inputs)
            started = time.perf_counter()
            if context_fn is None:
                out = module(*inputs, **keywords)
            else:
                out = torch.utils.checkpoint.checkpoint(module, *inputs, use_reentrant=False, context_fn=context_fn,
                                                        **keywords)
            outputs = [t for t in _tensors_in(out) if t.requires_grad]
            wrt = [t for t in (*module.parameters(), *_tensors_in((inputs, keywords))) if t.requires_grad]
            if outputs and wrt:  # autograd.grad: the model's .grad stay as they are
                torch.autograd.grad(outputs, wrt, [torch.ones_like(t) for t in outputs], allow_unused=True)
            _sync(outputs)
        return (time.perf_counter() - started) * 1e3

    variants: dict[str, Callable[[], Any] | None] = {  # as the plan's segments checkpoint (planning/segments.py)
        "plain": None, "whole": checkpoint_context_fn, "selective": functools.partial(checkpoint_context_fn, contexts)}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(2 * repeats + 2):  # a difference of two timings: more of them than of one
        for name in (list(variants) if repeat % 2 else list(reversed(variants))):
            runs[name].append(step(variants[name]))
    plain, whole, selective = (statistics.median(runs[name][1:]) for name in variants)  # the first warms up
    return max(whole - plain, 0.0), max(selective - plain, 0.0)


def _sync(value: Any) -> None:
    """Wait for the device before reading the clock (a CUDA tensor among a module's inputs or outputs)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    for tensor in values:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
            return
