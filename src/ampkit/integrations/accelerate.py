"""ampkit under Hugging Face Accelerate: ``prepare`` in place of ``accelerator.prepare``.

Accelerate has no precision plugin API, but its Accelerator and AcceleratedOptimizer drive any
object with GradScaler's protocol (``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``)
stored as ``accelerator.scaler``. So ``prepare``:
- runs ``ampkit.initialize`` on the model and optimizer (the forward under an ampkit policy at O1,
  a 16-bit model with float32 master weights at O2, pure 16 bits at O3); the model's 16-bit outputs
  are cast to float32, as Accelerate's own ``convert_outputs_to_fp32`` does;
- installs ampkit's loss scaler as ``accelerator.scaler``: ``accelerator.backward`` scales,
  ``optimizer.step()`` steps through it only when ``accelerator.sync_gradients`` (Accelerate's own
  rule) and records a skipped step as ``optimizer.step_was_skipped``, which Accelerate's prepared
  LR schedulers already honour; ``accelerator.save_state`` / ``load_state`` keep the scaler (and the
  masters, which are the optimizer's state);
- makes ``accelerator.clip_grad_norm_`` unscale through that scaler first, so clipping sees true
  gradients (Accelerate unscales only its own float16 GradScaler);
- under DDP, all-reduces gradients in 16 bits with a pre-divide factor (ampkit's ``compression_hook``),
  and makes every rank skip the same steps.

Requires ``pip install ampkit[accelerate]``; importing ``ampkit`` never imports Accelerate.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import SCALER_NAME
from torch import nn

from ampkit.distributed import HookState, check_compression, compression_hook
from ampkit.formats.fp8 import Fp8Recipe, convert_to_fp8
from ampkit.hardware.advice import recommend_dtype
from ampkit.modes import resolve_dtype
from ampkit.optim.kept import cast_output_to_float32
from ampkit.optim.levels import check_settings, initialize
from ampkit.optim.master import MasterWeightOptimizer
from ampkit.precision.policy import Policy
from ampkit.scaling.scaler import DynamicLossScaler, StaticLossScaler, check_scaler


def prepare(
    accelerator: Accelerator,
    *objects: Any,
    opt_level: str = "O1",
    dtype: torch.dtype | str | None = None,
    policy: Policy | None = None,
    scaler: DynamicLossScaler | StaticLossScaler | None = None,
    compute: str = "auto",
    compression: torch.dtype | None = None,
    predivide_factor: float | None = None,
    fp8: Fp8Recipe | None = None,
) -> Any:
    """``accelerator.prepare(*objects)`` with ampkit's mixed precision.

    Args:
        accelerator: an ``Accelerator(mixed_precision="no")``: ampkit replaces Accelerate's own.
        *objects: what ``accelerator.prepare`` takes: one model, at most one optimizer, data
            loaders, LR schedulers, in any order.
        opt_level, dtype, policy, compute: as ``ampkit.initialize``.
        scaler: a ``DynamicLossScaler`` / ``StaticLossScaler``; default a dynamic scaler, enabled
            for float16 only. Also available afterwards as ``accelerator.scaler``.
        compression: None, torch.float16 or torch.bfloat16: under DDP, the dtype gradients are
            all-reduced in.
        predivide_factor: the compression hook's pre-divide factor (None: sqrt(world_size)).
        fp8: an ``Fp8Recipe``: the model's eligible linears train in FP8 (``ampkit.convert_to_fp8``,
            amaxes reduced over all processes), the rest as ``opt_level`` says.

    Returns:
        What ``accelerator.prepare`` returns for ``objects``, in the same order.

    Raises:
        ValueError: Accelerate's own mixed precision is on, not exactly one model, several
            optimizers, a scaler that is not ampkit's, an invalid compression dtype.

    Examples:
        >>> accelerator = Accelerator()
        >>> model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler,
        ...                                               opt_level="O2", dtype=torch.float16)
    """
    if accelerator.mixed_precision != "no":
        raise ValueError(f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) already runs torch.autocast "
                         "and its own GradScaler: create Accelerator(mixed_precision='no') and let ampkit's prepare "
                         "set the precision.")
    models = [i for i, obj in enumerate(objects) if isinstance(obj, nn.Module)]
    optimizers = [i for i, obj in enumerate(objects) if isinstance(obj, torch.optim.Optimizer)]
    if len(models) != 1 or len(optimizers) > 1:
        raise ValueError(f"prepare takes one model and at most one optimizer; got {len(models)} models and "
                         f"{len(optimizers)} optimizers. Prepare other models with accelerator.prepare.")
    level = check_settings(opt_level, compute, policy)  # before anything changes the model
    check_scaler(scaler)
    check_compression(compression)

    items = list(objects)
    model = items[models[0]].to(accelerator.device)  # initialize reads the device from the weights
    optimizer = items[optimizers[0]] if optimizers else None
    if dtype is not None:
        dtype = resolve_dtype(dtype)
    else:
        dtype = policy.dtype if policy is not None else recommend_dtype(accelerator.device)
    if fp8 is not None:
        group = torch.distributed.group.WORLD if accelerator.num_processes > 1 else None
        convert_to_fp8(model, fp8, process_group=group)
    # DDP's reducer takes gradients in the weights' dtype only: under it O2's are 16-bit, each copied into its float32
    # master by the scaler's unscale_, which clip_grad_norm_ then clips (_clip_grad_norm_).
    ddp = accelerator.num_processes > 1 and accelerator.distributed_type.name.startswith("MULTI_")
    model, optimizer = initialize(model, optimizer, opt_level, dtype, compute=compute, policy=policy,
                                  grad_dtype=dtype if ddp and level.masters else None)
    if level.policy_region:  # as Accelerate's own mixed precision does: the loss is computed in float32
        model.register_forward_hook(cast_output_to_float32)
    items[models[0]] = model
    if optimizers:
        items[optimizers[0]] = optimizer
    if scaler is None:
        scaler = DynamicLossScaler(enabled=level.mixed and dtype == torch.float16)
    install_scaler(accelerator, scaler)

    prepared = accelerator.prepare(*items)
    prepared = list(prepared) if isinstance(prepared, tuple) else [prepared]
    wrapped = prepared[models[0]]
    if compression is not None and isinstance(wrapped, nn.parallel.DistributedDataParallel):
        accelerator.ampkit_hook_state = HookState()  # type: ignore[attr-defined]  # bytes sent, overflows
        wrapped.register_comm_hook(accelerator.ampkit_hook_state, compression_hook(compression, predivide_factor))
    return tuple(prepared) if len(prepared) > 1 else prepared[0]


def install_scaler(accelerator: Accelerator, scaler: DynamicLossScaler | StaticLossScaler) -> None:
    """Make ``scaler`` the loss scaler of ``accelerator`` (``prepare`` does it; so does the transformers Trainer
    recipe, whose Trainer builds its own Accelerator): ``accelerator.backward`` scales, ``clip_grad_norm_``
    unscales first, each prepared optimizer steps through it and reports a skipped step, and
    ``save_state`` / the Trainer's checkpoints keep its state. Call it before the optimizer is prepared
    (before ``accelerator.prepare``, or ``trainer.train()``).

    Raises:
        ValueError: Accelerate's own mixed precision is on (its GradScaler would scale as well), or
            ``scaler`` is not ampkit's.
    """
    if accelerator.mixed_precision != "no":
        raise ValueError(f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) runs torch.autocast and its own "
                         "GradScaler: turn it off (Accelerator(mixed_precision='no'); a Trainer's fp16=False and "
                         "bf16=False) and let ampkit's scaler scale.")
    check_scaler(scaler)
    if scaler is None:
        raise ValueError("scaler=None: pass the loss scaler to install, e.g. ampkit.DynamicLossScaler().")
    if accelerator.num_processes > 1 and scaler.process_group is None:
        scaler.process_group = torch.distributed.group.WORLD  # every rank skips the same steps
    # Before accelerator.prepare: each AcceleratedOptimizer takes the accelerator's scaler when built.
    accelerator.scaler = scaler
    accelerator.unscale_gradients = types.MethodType(_unscale_gradients, accelerator)  # type: ignore[method-assign]
    accelerator.clip_grad_norm_ = types.MethodType(_clip_grad_norm_, accelerator)  # type: ignore[method-assign]
    accelerator.load_state = types.MethodType(_load_state, accelerator)  # type: ignore[method-assign]


def _load_state(self: Accelerator, input_dir: str | None = None, load_kwargs: dict | None = None,
                **kwargs: Any) -> Any:
    """``accelerator.load_state`` of a checkpoint that holds no loss scaler (a float32 or bf16 run's): Accelerate
    read the scaler's file last and failed on it, after the model and optimizer had loaded. There ampkit's scaler
    keeps its configured start, said once."""
    if input_dir is None or self.scaler is None or (Path(input_dir).expanduser() / SCALER_NAME).exists():
        return Accelerator.load_state(self, input_dir, load_kwargs, **kwargs)
    warnings.warn(f"{input_dir} holds no loss scaler state (a run without one saved it): ampkit's scaler starts as "
                  "configured.", UserWarning, stacklevel=2)
    scaler, self.scaler = self.scaler, None
    try:
        return Accelerator.load_state(self, input_dir, load_kwargs, **kwargs)
    finally:
        self.scaler = scaler


def _optimizers(self: Accelerator, optimizer: Any = None) -> list[torch.optim.Optimizer]:
    """The torch optimizers under ``optimizer`` (one or a list; None: every prepared one)."""
    if optimizer is None:
        optimizer = self._optimizers
    elif not isinstance(optimizer, (tuple, list)):
        optimizer = [optimizer]
    found = []
    for opt in optimizer:
        while isinstance(opt, AcceleratedOptimizer):
            opt = opt.optimizer
        found.append(opt)
    return found


def _unscale_gradients(self: Accelerator, optimizer: Any = None) -> None:
    """``accelerator.unscale_gradients`` through ampkit's scaler (``clip_grad_norm_`` calls it)."""
    for opt in _optimizers(self, optimizer):
        if self.scaler.enabled:
            self.scaler.unscale_(opt)
        elif isinstance(opt, MasterWeightOptimizer):
            opt.prepare_grads_()  # 16-bit gradients (under DDP) reach the masters, which clipping then clips


def _clip_grad_norm_(self: Accelerator, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
    """``accelerator.clip_grad_norm_`` on what the step uses: at O2 each weight's float32 master (the model's
    gradient is the master's own, or under DDP copied into it by the unscale)."""
    masters = [opt for opt in _optimizers(self) if isinstance(opt, MasterWeightOptimizer)]
    params = list(parameters) if masters else parameters
    for opt in masters:
        params = [opt.master_of(p) if opt.master_of(p) is not None else p for p in params]
    return Accelerator.clip_grad_norm_(self, params, max_norm, norm_type)
