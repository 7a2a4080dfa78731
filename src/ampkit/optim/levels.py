"""initialize(): Apex-style opt levels O0-O3 over a model and its optimizer.

- O0: float32 (a pass-through); O1: float32 weights, autocast per op;
- O2: a 16-bit model with float32 master weights, norms kept in float32;
- O3: a pure 16-bit model (with ``update="kahan"`` or ``"stochastic"`` for its updates).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ampkit.formats.torchao import check_fp8_gathers
from ampkit.hardware.advice import recommend_dtype
from ampkit.modes import OptLevel, check_compute, check_model_and_optimizer, opt_level as level_named, resolve_dtype
from ampkit.optim import grads, pure16
from ampkit.optim.kept import (
    Float32Losses,
    add_input_casts,
    add_norm_casts,
    cast_inputs,
    cast_output_to_float32,
    kept_modules,
    losses_in_float32,
    needs_input_casts,
)
from ampkit.optim.master import MasterWeightOptimizer, follow_model
from ampkit.optim.states import check_states, for_level
from ampkit.precision.decide import decision_of
from ampkit.precision.policy import Policy
from ampkit.precision.regions import autocast
from ampkit.shards import is_sharded

def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str = "O1",
    dtype: torch.dtype | str | None = None,
    compute: str = "auto",
    policy: Policy | None = None,
    update: str = "plain",
    keep_float32: Sequence[type[nn.Module]] = (),
    grad_dtype: torch.dtype | str | None = None,
    states: str | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Prepare a float32 model and its optimizer for mixed precision (Apex's levels).

    Args:
        model: a float32 model, already on its device.
        optimizer: its optimizer (optional, for inference).
        opt_level: ``"O0"`` float32; ``"O1"`` autocast with the default policy,
            float32 weights; ``"O2"`` model in ``dtype`` except normalization layers (by
            behaviour) and buffers, float32 master weights, inputs cast to ``dtype`` and outputs to float32 at
            the model boundary; ``"O3"`` everything in ``dtype`` (no masters).
        dtype: torch.float16 or torch.bfloat16; None picks bfloat16 on CPUs and on
            GPUs of compute capability >= 8.0, float16 on older GPUs.
        compute: how GEMMs and convolutions compute (``Policy.compute``): ``"auto"``
            (default: native 16-bit kernels where measured faster than float32 here,
            else float32 arithmetic on the 16-bit values), ``"native"`` or ``"float32"``.
            At O2/O3 float32 compute wraps the model's forward in an ampkit region
            that casts nothing.
        policy: the O1 policy (default ``Policy.default(device, dtype, compute=compute)``);
            O2 and O3 models are 16-bit and take none.
        update: at O3, how the optimizer's updates reach the 16-bit weights (see ``ampkit.optim.pure16``):
            ``"plain"`` (default: the optimizer as given; updates smaller than half a weight's
            spacing are lost), ``"kahan"`` (torch-optimi with Kahan summation: a 16-bit
            compensation buffer per weight) or ``"stochastic"`` (unbiased stochastic rounding).
            ``"kahan"`` and ``"stochastic"`` take a torch.optim SGD or AdamW and return their own.
        keep_float32: at O2, module types kept in float32 besides the normalization layers, e.g.
            ``[nn.Embedding]``: a float32 embedding keeps a transformer's residual stream in float32
            (``x + f(x)`` with a 16-bit ``f(x)`` promotes to float32) and a head tied to it computes
            float32 logits; the 16-bit modules then cast their inputs. Measured on the GPT of
            `ampkit compare`: no difference in final loss beyond seed-to-seed noise
            (benchmarks/bench_gpt_head.py), and more saved for backward (every LayerNorm then saves
            a float32 input), hence not the default.
        grad_dtype: at O2 and O3, what the 16-bit weights' gradients accumulate in: None (default: the
            weights' dtype) or ``torch.float32`` (``"fp32"``): each backward's gradient is added into a
            float32 ``.grad`` (torch's ``Tensor.grad_dtype``), so gradient accumulation over micro-batches
            sums in float32. At O2 the masters take those gradients as their own (no float32 copy at the
            step: 2 bytes per parameter fewer than the default). At O3 they are rounded to the weights' dtype
            for the step. DDP builds its buckets in the parameters' dtype and refuses float32 gradients of
            16-bit weights: with DDP keep the default (``ampkit.distributed.fully_shard`` accumulates in its
            ``reduce_dtype``). See ``ampkit.optim.grads``.
        states: the format of AdamW's moments (``ampkit.optim.states``): None (default: the optimizer's own,
            float32 at O0-O2, the weights' dtype at O3), ``"fp32"``, ``"bf16"`` (its second moment stochastically
            rounded), ``"8bit"``, ``"4bit"`` or ``"fp8"`` (torchao's low-bit AdamW). The optimizer must be a
            torch.optim.AdamW (or Adam without weight decay); it is replaced by one keeping that format (at
            O2 the masters' optimizer is).

    Returns:
        (model, optimizer): the model is changed in place; the optimizer is wrapped
        in ``MasterWeightOptimizer`` for O2.

    Raises:
        ValueError: an unknown ``opt_level``, dtype, compute mode or update; a policy with O0, O2 or O3;
            an update other than ``"plain"`` below O3; a ``grad_dtype`` other than float32 and ``dtype``;
            ``states`` that the optimizer or the level cannot take (``states.check_states``); O3 on weights
            converted with ``Fp8Recipe(fsdp_all_gather=True)``.

    Examples:
        >>> model, optimizer = ampkit.initialize(model, optimizer, "O2")
    """
    # Every check before any change: a refused call leaves the model and the optimizer as they were.
    level = check_settings(opt_level, compute, policy, update)
    check_keep_float32(level, keep_float32)
    if getattr(model, "_ampkit_sharding", None) is not None:  # fully_shard applied its opt level itself
        raise ValueError(f"The model is sharded by ampkit.distributed.fully_shard at {model._ampkit_opt_level}, which "
                         "applied that opt level: initialize is not called on it. For another level, shard the float32 "
                         f"model with fully_shard(model, opt_level={level.name!r}); for the optimizer, "
                         "ampkit.distributed.prepare_optimizer.")
    if getattr(model, "_ampkit_opt_level", None) is not None:
        raise ValueError(
            f"The model was initialized at {model._ampkit_opt_level} already; call ampkit.initialize once, on the "
            "float32 model and its plain optimizer (a second call adds masters of masters and a second set of hooks)."
        )
    check_model_and_optimizer(model, optimizer)
    check_fp8_gathers(model, level.name, level.pure16)
    if level.weights_16bit and any(is_sharded(p) for p in model.parameters()):
        raise ValueError(f"The model is sharded with FSDP2 already: {level} casts weights, which FSDP2 does "
                         "at its all-gathers. Call ampkit.distributed.fully_shard(model, opt_level="
                         f"{level.name!r}) on the float32 model instead of torch's fully_shard and initialize.")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = resolve_dtype(dtype) if dtype is not None else recommend_dtype(device)
    accumulate = grads.resolve_grad_dtype(grad_dtype, level, dtype)
    if optimizer is not None and update != "plain":
        pure16.pure16_groups(optimizer, update)  # refuses before the weights are cast
    check_states(states, optimizer, level, dtype, update)
    model._ampkit_opt_level = level.name  # type: ignore[assignment]
    if optimizer is not None and not level.pure16:
        optimizer = for_level(optimizer, states)
    if level.masters and optimizer is not None:
        optimizer = MasterWeightOptimizer(optimizer)  # before the cast: masters are exact
    if level.weights_16bit:
        cast_model_(model, level, dtype, tuple(keep_float32))
    if optimizer is not None and level.pure16:
        optimizer = for_level(optimizer, states, update, float32_weights=False)
    if isinstance(optimizer, MasterWeightOptimizer):
        follow_model(optimizer, model)
    if accumulate is not None:
        grads.accumulate_in(model.parameters(), accumulate)
        grads.refuse_ddp_at_first_forward(model, dtype)
        if level.pure16 and optimizer is not None:
            grads.step_in_own_dtype(optimizer)
    wrap_forward(model, *forward_wrappers(level, device.type, dtype, compute, policy))
    return model, optimizer


def check_settings(opt_level: str | OptLevel, compute: str, policy: Policy | None, update: str = "plain") -> OptLevel:
    """The ``OptLevel`` named ``opt_level``; ValueError for an unknown level, compute mode or update, a policy at
    levels that run none and a pure 16-bit update at levels with float32 weights."""
    level = level_named(opt_level)
    check_compute(compute)
    pure16.check_update(update)
    if update != "plain" and not level.pure16:
        raise ValueError(f"update={update!r} applies at O3 only (opt_level={level.name!r} keeps float32 weights or "
                         "master weights, which take small updates as they are): drop update=, or use opt_level='O3'.")
    if policy is not None and not level.policy_region:
        raise ValueError(f"policy= applies at O1 only (opt_level={level.name!r} casts nothing by policy): drop "
                         "policy=, or use opt_level='O1'.")
    return level


def check_keep_float32(level: OptLevel, keep_float32: Sequence[type[nn.Module]]) -> None:
    """Raise ValueError unless ``keep_float32`` lists nn.Module subclasses, at O2 (or is empty)."""
    if isinstance(keep_float32, type):
        raise ValueError(f"keep_float32={keep_float32.__name__} is one type: pass a list, keep_float32="
                         f"[{keep_float32.__name__}].")
    if keep_float32 and not level.keeps_float32:
        raise ValueError(f"keep_float32= applies at O2 only (opt_level={level.name!r}): drop it, or use opt_level='O2'.")
    bad = [t for t in keep_float32 if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad:
        raise ValueError(f"keep_float32={list(keep_float32)!r} must list nn.Module subclasses, e.g. [nn.Embedding]; "
                         f"not {bad}.")


def cast_model_(model: nn.Module, level: OptLevel, dtype: torch.dtype,
                keep_float32: tuple[type[nn.Module], ...] = ()) -> None:
    """The model half of O2 and O3: cast the weights to ``dtype``, and cast floating inputs to ``dtype`` and
    16-bit outputs to float32 at ``model``'s forward. Parameter objects are kept, so optimizers built on them
    still hold them.

    O2 keeps in float32 what ``optim/kept.py`` says: normalization layers (by behaviour; each returns its input's
    dtype) and ``keep_float32`` types, with any weight tied to theirs, and every buffer. Where that lets float32
    activations reach 16-bit layers (anything but torch's norms kept), each module whose own weights are 16-bit
    casts its floating inputs to ``dtype``. O3 casts every floating parameter and buffer.
    """
    kept = kept_modules(model, keep_float32) if level.keeps_float32 else []
    kept_ids = {id(m) for m in kept}
    kept_params = {id(p) for m in kept for p in m.parameters(recurse=False)}
    for module in model.modules():
        if id(module) not in kept_ids:
            _cast_own(module, dtype, kept_params, buffers=not level.keeps_float32)
    add_norm_casts(kept)
    if level.keeps_float32 and needs_input_casts(model, kept, keep_float32):
        add_input_casts(model, dtype, kept_params)
    model.register_forward_pre_hook(cast_inputs(dtype), with_kwargs=True)
    model.register_forward_hook(cast_output_to_float32)


def forward_region(level: OptLevel, device_type: str, dtype: torch.dtype, compute: str,
                   policy: Policy | None = None, model: nn.Module | None = None) -> autocast | None:
    """The ampkit region a model's forward runs in at ``level``: O1's policy (``policy``, or the default one); at
    O2 and O3 the 16-bit model's policy where it computes some ops in float32; else None. With
    ``level.losses_in_float32`` the forward also runs under ``kept.Float32Losses``: ``initialize`` and
    ``fully_shard`` wrap the forward in both (``forward_wrappers``), the Lightning plugins enter both around each
    step (``forward_context``, with the ``model`` the policy's overrides name)."""
    if level.policy_region:
        return autocast(policy or Policy.default(device_type, dtype, compute=compute), model=model)
    if not level.weights_16bit:
        return None
    model16 = Policy.for_16bit_model(device_type, dtype, compute)
    return autocast(model16) if decision_of(model16).ops else None


def forward_wrappers(level: OptLevel, device_type: str, dtype: torch.dtype, compute: str,
                     policy: Policy | None = None) -> list[Callable[..., Any]]:
    """The decorators of a model's forward at ``level`` (innermost first, for ``wrap_forward``)."""
    region = forward_region(level, device_type, dtype, compute, policy)
    wrappers: list[Callable[..., Any]] = [losses_in_float32] if level.losses_in_float32 else []
    return wrappers + ([region] if region is not None else [])


@contextlib.contextmanager
def forward_context(level: OptLevel, device_type: str, dtype: torch.dtype, compute: str,
                    policy: Policy | None = None, model: nn.Module | None = None) -> Iterator[None]:
    """What ``forward_wrappers`` wraps a forward in, as one context for code that runs the forward itself."""
    with contextlib.ExitStack() as stack:
        if level.losses_in_float32:
            stack.enter_context(Float32Losses())
        region = forward_region(level, device_type, dtype, compute, policy, model)
        if region is not None:
            stack.enter_context(region)
        yield


def wrap_forward(model: nn.Module, *wrappers: Callable[..., Any]) -> None:
    """``model``'s forward wrapped in each of ``wrappers`` (the first innermost); nothing for none."""
    if not wrappers:
        return
    forward = type(model).forward
    for wrap in wrappers:
        forward = wrap(forward)
    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]


def _cast_own(module: nn.Module, dtype: torch.dtype, kept: frozenset[int] | set[int] = frozenset(),
              buffers: bool = True) -> None:
    """Cast a module's own parameters (but those in ``kept``, by id) and, with ``buffers``, its floating
    buffers, not its children's.

    ``param.data`` is replaced, so the Parameter objects (which optimizers hold) stay.
    """
    for param in module.parameters(recurse=False):
        if id(param) not in kept:
            param.data = param.data.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buffers and buf.is_floating_point():
            setattr(module, name, buf.to(dtype))
