"""Memory estimates: weights, gradients, master weights, optimizer states and activations.

The arithmetic people do by hand (1M parameters are 4 MB in float32 and 2 MB in
float16), with activations taken from a real trace of one step: the bytes
autograd saves for backward, counted with ``saved_tensors_hooks``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ampkit.float32_compute.weights import is_weight_copy
from ampkit.modes import MIXED_LEVELS, OPT_LEVELS, OptLevel, check_model_and_optimizer, resolve_dtype
from ampkit.shards import local_shard

# Optimizer states per parameter, in the dtype of the parameters the optimizer updates.
SHARDINGS = ("none", "fsdp")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0, "adagrad": 1, "rmsprop": 1}


_kept = threading.local()


def kept_observers() -> list[Callable[[torch.Tensor], Any]]:
    """This thread's observers of the outputs a selectively recomputed block keeps (``planning/selective.py``
    calls them: its checkpoint holds those outputs, not autograd, whose saved-tensor hooks count the rest)."""
    if not hasattr(_kept, "observers"):
        _kept.observers = []
    return _kept.observers


@contextlib.contextmanager
def observing_kept(observe: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """``observe(tensor)`` is called, on this thread, for each output a selectively recomputed block keeps."""
    kept_observers().append(observe)
    try:
        yield
    finally:
        kept_observers().remove(observe)


def saved_bytes_of_step(model: nn.Module, step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``step`` (forward and loss) and count the activation bytes autograd saves for backward.

    Storages are counted once, and so are the outputs a selectively recomputed block keeps (its
    checkpoint holds them, not autograd). Parameters, and the 16-bit copies of parameters that
    autocast saves, are weights rather than activations and are left out, so the figure is the
    activation memory of one step, exact on any device.

    Returns:
        (the loss ``step`` returned, bytes).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def count(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and not is_weight_copy(t):
            seen[storage.data_ptr()] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observing_kept(count):
        loss = step()
    return loss, sum(seen.values())


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of one precision setting."""

    label: str
    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.master_weights + self.optimizer_states + self.activations


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """float32 and the chosen level side by side."""

    parameters: int  # all of them, frozen ones included
    float32: MemoryBreakdown
    mixed: MemoryBreakdown
    world_size: int = 1  # sharded over (sharding="fsdp"): the breakdowns are per rank
    largest_gather_bytes: int = 0  # FSDP2: the largest unit's all-gathered weights (mixed), transient


def estimate_memory(
    model: nn.Module,
    inputs: Any,
    opt_level: str = "O2",
    optimizer: str = "adamw",
    dtype: torch.dtype | str = torch.bfloat16,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    update: str = "plain",
    keep_float32: Sequence[type[nn.Module]] = (),
    world_size: int = 1,
    sharding: str = "none",
    blocks: Sequence[type[nn.Module]] | None = None,
    plan: Any = None,
    grad_dtype: torch.dtype | str | None = None,
    states: str | None = None,
) -> MemoryEstimate:
    """Estimate training memory in float32 and at ``opt_level``.

    O2 counts the float32 masters and their float32 gradient copies (``gradients`` holds
    both the model's 16-bit gradients and the masters' float32 copies of them) and keeps
    normalization layers (and ``keep_float32`` types, with weights tied to theirs) in
    float32, as ``initialize`` does; O3 keeps the
    optimizer states in 16 bits, plus a 16-bit Kahan compensation buffer per weight with
    ``update="kahan"``. ``measured_state_bytes`` gives the same figures from real tensors.

    Args:
        model: a float32 model (left untouched: copies are traced).
        inputs: a tensor or tuple of positional inputs for one step.
        opt_level: ``"O1"``, ``"O2"`` or ``"O3"``.
        optimizer: one of OPTIMIZER_STATES' keys (default ``"adamw"``: two states).
        dtype: the 16-bit dtype.
        loss_fn: ``loss_fn(output) -> loss`` (default: mean square of the output).
        update: O3's update rule (``ampkit.optim.pure16``): ``"plain"``, ``"kahan"`` or ``"stochastic"``.
        keep_float32: at O2, module types kept in float32 besides the normalization layers, as
            ``initialize(..., keep_float32=...)`` keeps them (e.g. ``[nn.Embedding]``).
        world_size: ranks the model is sharded over (``sharding="fsdp"``).
        sharding: ``"none"`` (default: one process's bytes) or ``"fsdp"``: per-rank bytes under
            ``ampkit.distributed.fully_shard`` (each parameter's first dimension split over the ranks,
            rounded up as FSDP2 pads it; its float32 shards are O2's masters, so ``master_weights`` is 0
            and the shards count as weights); ``inputs`` are one rank's batch.
        blocks: with ``sharding="fsdp"``, ``fully_shard``'s ``blocks`` (for ``largest_gather_bytes``).
        plan: a ``RecomputePlan`` (``ampkit.plan_recompute``) made for this setting: the mixed activations
            are its planned saved-for-backward bytes (measured on the model as it trains, with its inputs).
        grad_dtype: ``initialize``'s: ``torch.float32`` counts float32 gradients of the 16-bit weights (at O2
            the masters' own: no copy), the 16-bit dtype the weights' own and their float32 copies; None, as
            ``initialize``, float32 at O2 and the weights' dtype at O3.
        states: ``initialize``'s format of AdamW's moments (``ampkit.optim.states``): None (the optimizer's
            own), ``"fp32"``, ``"bf16"``, ``"8bit"``, ``"4bit"`` or ``"fp8"``, counted per tensor as kept (a
            low-bit moment's codes, its float32 block scales and lookup table; a tensor torchao leaves
            unquantized in its parameter's dtype). Needs ``optimizer="adamw"`` (or ``"adam"``).

    Returns:
        A ``MemoryEstimate``: the parameter count and a ``MemoryBreakdown`` (weights, gradients, masters,
        optimizer states, activations saved for backward) for float32 and for the mixed setting.

    Raises:
        ValueError: an unknown optimizer, opt level or update, an update other than plain below O3,
            ``keep_float32`` below or above O2 or listing something that is not an nn.Module type, an
            unknown sharding, or a world size below 1 (or above 1 without sharding); ``states`` with another
            optimizer, or that the level cannot keep (``ampkit.optim.states.check_format``).
    """
    from ampkit.optim.grads import resolve_grad_dtype
    from ampkit.optim.kept import kept_modules
    from ampkit.optim.levels import check_keep_float32, check_settings, initialize
    from ampkit.optim.states import check_format, state_bytes

    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"Unknown optimizer {optimizer!r}. Choose one of {sorted(OPTIMIZER_STATES)}.")
    if opt_level not in MIXED_LEVELS:
        raise ValueError(f"Unknown opt_level {opt_level!r} for a mixed estimate. Choose one of {list(MIXED_LEVELS)}.")
    level = check_settings(opt_level, "auto", None, update)
    check_keep_float32(level, keep_float32)
    accumulate = resolve_grad_dtype(grad_dtype, level, resolve_dtype(dtype))
    check_format(states, level, resolve_dtype(dtype), update)
    if states is not None and optimizer not in ("adamw", "adam"):
        raise ValueError(f"states={states!r} keeps AdamW's moments in fewer bits; optimizer={optimizer!r}: use "
                         "optimizer='adamw', or drop states.")
    if plan is not None and not (hasattr(plan, "planned_bytes") and hasattr(plan, "segments")):
        raise ValueError(f"plan={type(plan).__name__} is not a RecomputePlan: pass what ampkit.plan_recompute returns.")
    if sharding not in SHARDINGS:
        raise ValueError(f"Unknown sharding {sharding!r}. Choose one of {list(SHARDINGS)}.")
    if sharding == "fsdp":
        if grad_dtype is not None and accumulate is not None:
            raise ValueError(f"grad_dtype={grad_dtype!r} with sharding='fsdp': fully_shard's gradients accumulate in "
                             "its reduce_dtype (float32 by default), which this estimate counts; drop grad_dtype.")
        accumulate = None  # fully_shard's own
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1 \
            or (sharding == "none" and world_size != 1):
        raise ValueError(f"world_size={world_size!r} is invalid: an integer >= 1, with sharding='fsdp' (without "
                         "sharding, every rank holds what one process holds: world_size=1).")
    kept_ids = {id(m) for m in kept_modules(model, keep_float32)}
    dtype = resolve_dtype(dtype)
    moments = OPTIMIZER_STATES[optimizer]
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    loss_fn = loss_fn or (lambda out: out.float().pow(2).mean())

    def activations(name: str) -> int:
        traced = copy.deepcopy(model)
        if OPT_LEVELS[name].mixed:
            traced, _ = initialize(traced, None, name, dtype, keep_float32=keep_float32)  # empty below O2
        _, saved = saved_bytes_of_step(traced, lambda: loss_fn(traced(*args)))
        return saved

    # Each parameter once (a tied weight belongs to two modules); O2 keeps it float32 if any owner is kept.
    params: dict[int, tuple[torch.Tensor, bool]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            kept = level.keeps_float32 and id(module) in kept_ids
            params[id(p)] = (p, kept or params.get(id(p), (p, False))[1])
    n = sum(p.numel() for p, _ in params.values())
    trained = [(p, kept) for p, kept in params.values() if p.requires_grad]  # frozen: no gradients or states
    t = sum(p.numel() for p, _ in trained)
    low = torch.finfo(dtype).bits // 8

    def model_bytes(pairs: Sequence[tuple[torch.Tensor, bool]]) -> int:
        """Bytes of ``pairs`` at opt_level: 16-bit, but the float32 ones O2 keeps."""
        return sum(p.numel() * (4 if kept else low) for p, kept in pairs)

    fp32 = MemoryBreakdown("float32", 4 * n, 4 * t, 0, 4 * moments * t, activations("O0"))
    if not level.weights_16bit:
        mixed = MemoryBreakdown(f"{level} {dtype}", 4 * n, 4 * t, 0, 4 * moments * t, activations(level.name))
    elif level.masters:
        # A float32 gradient is its master's own (no copy); the others get a float32 copy. A float32 weight (a kept
        # norm) is its own master: the 16-bit ones alone have a float32 copy.
        copies = 4 * sum(p.numel() for p, kept in trained if not kept)
        gradients = 4 * t if accumulate == torch.float32 else model_bytes(trained) + copies
        mixed = MemoryBreakdown(f"{level} {dtype}" + (" fp32-grads" if accumulate else ""), model_bytes(
            list(params.values())), gradients, copies, 4 * moments * t, activations(level.name))
    else:
        compensation = model_bytes(trained) if update == "kahan" else 0
        label = f"{level} {dtype}" + (f" {update}" if update != "plain" else "") + (" fp32-grads" if accumulate else "")
        mixed = MemoryBreakdown(label, model_bytes(list(params.values())), 4 * t if accumulate else model_bytes(trained),
                                0, moments * model_bytes(trained) + compensation, activations(level.name))
    if states is not None:  # the optimizer steps float32 weights (masters at O2), or O3's 16-bit ones
        compensation = model_bytes(trained) if update == "kahan" else 0
        moment_bytes = state_bytes((p.numel() for p, _ in trained), states, low if level.pure16 else 4)
        mixed = dataclasses.replace(mixed, label=f"{mixed.label} {states}-states",
                                    optimizer_states=moment_bytes + compensation)
    if plan is not None:
        mixed = dataclasses.replace(mixed, label=f"{mixed.label} recompute", activations=plan.planned_bytes)
    if sharding == "fsdp":
        return sharded_estimate(model, MemoryEstimate(n, fp32, mixed), level, dtype, moments, update,
                                tuple(keep_float32), world_size, blocks, states)
    return MemoryEstimate(n, fp32, mixed)


def sharded_estimate(model: nn.Module, whole: MemoryEstimate, level: OptLevel, dtype: torch.dtype, moments: int,
                     update: str, keep_float32: tuple[type[nn.Module], ...], world_size: int,
                     blocks: Sequence[type[nn.Module]] | None, formats: str | None = None) -> MemoryEstimate:
    """``whole``'s per-rank counterpart under ``fully_shard``: parameters, gradients and optimizer states
    sharded (FSDP2 pads each first dimension to a multiple of the world size), activations unchanged;
    ``formats`` is ``estimate_memory``'s ``states`` (rank 0's shards: torchao decides on each local shard)."""
    from ampkit.optim.states import state_bytes

    from ampkit.distributed.units import plan_units

    def shard(p: torch.Tensor) -> int:
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // world_size) * (p.numel() // max(rows, 1))

    params = {id(p): p for p in model.parameters()}.values()
    trained = [p for p in params if p.requires_grad]
    n, t = sum(shard(p) for p in params), sum(shard(p) for p in trained)
    low = torch.finfo(dtype).bits // 8
    stored = low if level.pure16 else 4  # O0-O2 keep float32 shards, O3 16-bit ones
    extra = t * low if update == "kahan" else 0
    fp32 = dataclasses.replace(whole.float32, weights=4 * n, gradients=4 * t, optimizer_states=4 * moments * t)
    optimizer_states = extra + (stored * moments * t if formats is None else state_bytes(
        (shard(p) for p in trained), formats, stored))
    mixed = dataclasses.replace(whole.mixed, label=whole.mixed.label + " fsdp", weights=stored * n,
                                gradients=stored * t, master_weights=0, optimizer_states=optimizer_states)
    # The largest unit's gathered weights: each unit's own parameters (not an inner unit's), in the dtype gathered.
    kept_named, chosen = plan_units(model, level, keep_float32, blocks)
    kept = [m for _, m in kept_named]
    units = kept + [m for _, m in chosen] + [model]
    owner: dict[int, int] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owner.setdefault(id(p), i)
    sizes = [0] * len(units)
    for p in params:
        i = owner[id(p)]
        sizes[i] += p.numel() * (4 if not level.weights_16bit or i < len(kept) else low)
    return MemoryEstimate(whole.parameters, fp32, mixed, world_size, max(sizes))


def measured_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of what training keeps between steps, from the tensors themselves: the model's
    weights (and floating buffers), their gradients, and the optimizer's parameters (float32
    masters), their gradients and its states (moments, Kahan buffers). Storages count once.

    Args:
        model: the model being trained.
        optimizer: its optimizer (a ``MasterWeightOptimizer`` counts its masters).

    Returns:
        The bytes those tensors hold now (measure after a step, when the states exist): the sum of
        ``measured_state_parts``.

    Raises:
        ValueError: a model that is no nn.Module, an optimizer that is none or steps other tensors.
    """
    return sum(measured_state_parts(model, optimizer).values())


STATE_PARTS = ("weights", "gradients", "masters", "optimizer states")


def measured_state_parts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``measured_state_bytes`` by part (``STATE_PARTS``): the model's weights and buffers, the gradients (the
    model's and the optimizer's parameters'), the masters (the optimizer's parameters that are no model weight) and
    the optimizer's states. A storage counts once, in the first part that holds it (at O2 a weight's float32
    gradient is also its master's: a gradient).

    Raises:
        ValueError: as ``measured_state_bytes``.
    """
    check_model_and_optimizer(model, optimizer, needed_by="measured_state_bytes")
    seen: set[int] = set()
    parts = dict.fromkeys(STATE_PARTS, 0)

    def add(t: Any, part: str) -> None:
        if isinstance(t, torch.Tensor):
            t = local_shard(t)  # an FSDP2 tensor: this rank's shard
            if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass (torchao's FP8-gathered weights): its insides
                for name in t.__tensor_flatten__()[0]:
                    add(getattr(t, name), part)
                return
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                parts[part] += storage.nbytes()

    for tensor in [*model.parameters(), *model.buffers()]:
        add(tensor, "weights")
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    for tensor in [*model.parameters(), *stepped]:
        add(tensor.grad, "gradients")
    for p in stepped:
        add(p, "masters")
    for state in optimizer.state.values():
        for value in state.values():
            add(value, "optimizer states")
    return parts
