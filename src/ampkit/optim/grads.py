"""Gradient accumulation in float32 for a 16-bit model (O2, O3).

A 16-bit model's gradients are 16-bit: over micro-batches each backward adds a bfloat16 gradient into a
bfloat16 ``.grad``, and the sum loses what bfloat16's 8 significant bits cannot hold (DeepSpeed's
``grad_accum_dtype`` fixed the same error). torch's ``Tensor.grad_dtype`` (public, in every torch ampkit
supports) makes the autograd engine cast each incoming gradient to float32 and accumulate there: one float32
buffer per weight, and no second copy at the step (an O2 master takes the model's float32 gradient as its own).

At O3 the optimizer steps the 16-bit weights themselves, and torch's optimizers want a gradient of their
parameter's dtype (AdamW refuses a float32 gradient on a bfloat16 weight): the float32 sum is rounded once,
just before the step, and restored after it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from ampkit.modes import _DTYPE_NAMES, OptLevel, opt_level as level_named

# the 16-bit names initialize's dtype takes, and float32's
GRAD_DTYPE_NAMES = {**_DTYPE_NAMES, "float32": torch.float32, "fp32": torch.float32}


def resolve_grad_dtype(grad_dtype: torch.dtype | str | None, opt_level: str | OptLevel,
                       dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a model's gradients accumulate in: ``torch.float32``, or None for the weights' own dtype.

    None (the default) is float32 where the level keeps float32 masters (O2): the model's gradient is then the
    master's own, one tensor with one owner, so what a float32 loop does to ``model.parameters()``' gradients
    (clipping them, a scaler's ``unscale_``, logging their norm) is what the step uses (docs/training.md, "The
    contract"). It is also 2 bytes per parameter fewer than a 16-bit gradient and its float32 copy. At O3, whose
    optimizer steps the 16-bit weights themselves, None is the weights' own dtype.

    Raises:
        ValueError: a name or dtype other than float32 and ``dtype``; float32 accumulation at O0 and O1, whose
            weights and gradients are float32 already, is accepted (it changes nothing).
    """
    level = level_named(opt_level)
    if grad_dtype is None:
        return torch.float32 if level.masters else None
    resolved = GRAD_DTYPE_NAMES.get(grad_dtype.lower()) if isinstance(grad_dtype, str) else grad_dtype
    if resolved == dtype and level.weights_16bit:
        return None  # the weights' own dtype: what torch does by default
    if resolved == torch.float32:
        return torch.float32 if level.weights_16bit else None
    raise ValueError(f"grad_dtype={grad_dtype!r} is not a gradient dtype at {level} with dtype={dtype}: choose "
                     f"torch.float32 ('fp32': accumulate in float32) or None (the weights' dtype, "
                     f"{dtype if level.weights_16bit else 'float32'}).")


def accumulate_in(params: Iterable[torch.Tensor], grad_dtype: torch.dtype | None) -> None:
    """Make each floating, trained leaf in ``params`` whose dtype is not ``grad_dtype`` accumulate its
    gradient in ``grad_dtype`` (``Tensor.grad_dtype``; None: its own dtype again); a gradient already there is
    converted."""
    for param in params:
        if param.requires_grad and param.is_floating_point() and param.dtype != grad_dtype:
            grad, param.grad = param.grad, None  # torch refuses a gradient of another dtype than grad_dtype
            param.grad_dtype = grad_dtype
            if grad is not None:
                param.grad = grad.to(grad_dtype or param.dtype)


def step_in_own_dtype(optimizer: torch.optim.Optimizer) -> None:
    """At O3: round each float32 gradient to its weight's dtype for ``optimizer``'s step and put the float32
    sum back after it (torch's step hooks), so any optimizer steps 16-bit weights on 16-bit gradients."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before(*_: object) -> None:
        after()  # a step that raised left its 16-bit copies: the float32 sums come back first
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None and grad.dtype != param.dtype:
                    swapped.append((param, grad))
                    param.grad_dtype = None  # lets the 16-bit copy in
                    param.grad = grad.to(param.dtype)

    def after(*_: object) -> None:
        while swapped:
            param, grad = swapped.pop()
            param.grad = grad
            param.grad_dtype = grad.dtype

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def refuse_ddp_at_first_forward(model: nn.Module, dtype: torch.dtype) -> None:
    """Refuse, at ``model``'s first forward, torch's DistributedDataParallel around it (ValueError naming the fix):
    DDP's reducer copies each gradient into buckets of its weight's dtype and fails in the first backward on a
    float32 gradient of a 16-bit weight (``Expected BFloat16, got Float``). DDP gives no sign of itself on the
    module; its ``forward`` is found among the callers' frames (``inspect``, once: the check goes after a forward
    that passed)."""

    def check(module: nn.Module, args: object) -> None:
        if torch.compiler.is_compiling():
            return  # dynamo cannot trace the frames; a compiled model's first eager call has made the check
        frame = inspect.currentframe()
        for _ in range(12):  # DDP.forward, _run_ddp_forward, Module.__call__: a few frames up
            frame = frame.f_back if frame is not None else None
            if frame is None:
                break
            caller = frame.f_locals.get("self")
            if isinstance(caller, nn.parallel.DistributedDataParallel) and caller.module is module:
                name = str(dtype).removeprefix("torch.")
                raise ValueError(
                    f"torch's DistributedDataParallel reduces gradients in the weights' dtype ({name}), and O2 "
                    "accumulates this model's gradients in float32 (one gradient, its master's own). Pass "
                    f"ampkit.initialize(..., grad_dtype=torch.{name}) under DDP (clip through the loss scaler: "
                    "scaler.clip_grad_norm_(optimizer, max_norm)), or train without DDP's reducer: "
                    "ampkit.distributed.DistributedOptimizer, or ampkit.distributed.fully_shard.")
        handle.remove()

    handle = model.register_forward_pre_hook(check)
