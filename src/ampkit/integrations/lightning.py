"""ampkit as a Lightning precision plugin: ``Trainer(plugins=[AmpkitPrecision("O2")])``, and for Fabric.

What it changes from Lightning's own ``precision="bf16-mixed"`` / ``"16-mixed"``:
- the forward runs under an ampkit policy (edited op lists, per-module overrides, float32 compute
  on 16-bit values where this machine's 16-bit kernels are slow);
- O2 keeps float32 master weights (Lightning has no such level), O3 trains a pure 16-bit model;
- the loss scaler is ampkit's (hysteresis, NonFiniteError, stats), configurable, and saved in
  Lightning checkpoints together with the master weights (they are the optimizer's state);
- LR schedulers stepped per optimizer step do not advance on skipped steps (Lightning#5558);
- the skipped-step count and the loss scale are logged (``ampkit/skipped_steps``, ``ampkit/loss_scale``);
- with ``strategy="ddp"``, gradients are all-reduced in 16 bits with a pre-divide factor, and every
  rank skips the same steps.

Requires ``pip install ampkit[lightning]``; importing ``ampkit`` never imports Lightning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from ampkit.distributed import HookState, check_compression, compression_hook
from ampkit.formats.fp8 import Fp8Recipe, convert_to_fp8
from ampkit.hardware.advice import recommend_dtype
from ampkit.modes import LOW_DTYPES, resolve_dtype
from ampkit.optim.grads import accumulate_in, resolve_grad_dtype
from ampkit.optim.levels import MasterWeightOptimizer, cast_model_, check_settings, forward_context
from ampkit.optim.master import follow_model
from ampkit.precision.policy import Policy
from ampkit.scaling.scaler import DynamicLossScaler, StaticLossScaler, check_scaler


class _AmpkitCore:
    """What the Trainer plugin and the Fabric plugin share: settings, the region, the last steps, the state."""

    precision: Any

    def _configure(
        self,
        opt_level: str = "O1",
        dtype: torch.dtype | str | None = None,
        *,
        policy: Policy | None = None,
        scaler: DynamicLossScaler | StaticLossScaler | None = None,
        compute: str = "auto",
        compression: torch.dtype | None = None,
        predivide_factor: float | None = None,
        device: str | None = None,
    ) -> None:
        self.level = check_settings(opt_level, compute, policy)
        check_scaler(scaler)
        check_compression(compression)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.opt_level = opt_level
        self.dtype = resolve_dtype(dtype) if dtype is not None else recommend_dtype(self.device)
        self.policy = policy or Policy.default(self.device, self.dtype, compute=compute)  # O1's (others run none)
        self.compute = compute
        self.scaler = scaler if scaler is not None else DynamicLossScaler(
            enabled=self.level.mixed and self.dtype == torch.float16)
        self.compression, self.predivide_factor = compression, predivide_factor
        self.hook_state: Any = None  # ampkit.distributed.HookState once the DDP hook is registered
        # the string Lightning shows and checks (a Literal in Lightning's annotations)
        half = "bf16" if self.dtype == torch.bfloat16 else "16"
        self.precision: Any = ("32-true" if not self.level.mixed else f"{half}-true" if self.level.pure16
                               else f"{half}-mixed")
        self._exact: dict[int, torch.Tensor] = {}  # O2: float32 weights before the cast, for exact masters
        self._stepped: dict[int, bool] = {}  # id(inner optimizer) -> whether its last step was taken
        self._logged: tuple[float, float] | None = None  # (skipped steps, scale) as last logged
        self._model: nn.Module | None = None  # convert_module's: the policy's overrides name its modules

    def _region(self) -> contextlib.AbstractContextManager[Any]:
        return forward_context(self.level, self.device, self.dtype, self.compute, self.policy,  # initialize's
                               model=self._model)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The ampkit region every training, validation, test and predict step runs in."""
        with self._region():
            yield

    def last_step_taken(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s last step was taken (False: skipped for inf/NaN gradients)."""
        return self._stepped.get(id(_inner(optimizer)), True)

    # -- checkpoints (the master weights are the optimizer's state) -----------------------

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "scaler" not in state_dict:
            raise RuntimeError(f"The checkpoint's AmpkitPrecision state has keys {sorted(state_dict)}, not 'scaler': "
                               "it was saved by another precision plugin.")
        self.scaler.load_state_dict(state_dict["scaler"])


class AmpkitPrecision(_AmpkitCore, Precision):
    """A Lightning precision plugin running training through ampkit.

    Args:
        opt_level: ``"O1"`` (default: float32 weights, forward under ``policy``), ``"O2"`` (16-bit
            model except normalization layers, float32 master weights), ``"O3"`` (everything 16-bit),
            ``"O0"`` (float32; the plugin does nothing).
        dtype: torch.bfloat16 / torch.float16 (or ``"bf16"`` / ``"fp16"``); None picks what
            ``ampkit.recommend_dtype`` picks for ``device``.
        policy: the O1 policy (default ``Policy.default(device, dtype, compute=compute)``).
        scaler: a ``DynamicLossScaler`` or ``StaticLossScaler``; default a dynamic scaler, enabled
            for float16 only.
        compute: ``"auto"`` / ``"native"`` / ``"float32"``: how GEMMs and convolutions compute
            (``Policy.compute``).
        compression: None, torch.float16 or torch.bfloat16: under DDP, the dtype gradients are
            all-reduced in (ampkit's ``compression_hook``).
        predivide_factor: the hook's pre-divide factor (None: sqrt(world_size)).
        device: ``"cpu"`` or ``"cuda"``; None: ``"cuda"`` when a GPU is visible, else ``"cpu"``.
        fp8: an ``Fp8Recipe``: the eligible linears train in FP8 (``ampkit.convert_to_fp8``; amaxes
            reduced over the DDP group), the rest as ``opt_level`` says. ``fp8_layers`` then holds
            each linear's decision.

    Raises:
        ValueError: an unknown opt level, dtype, compute mode or compression dtype; a policy
            with O2/O3; a scaler that is not ampkit's.

    Examples:
        >>> trainer = lightning.Trainer(plugins=[AmpkitPrecision("O2", torch.float16)])

    Note:
        At O2 and O3 the LightningModule's own ``forward`` is the model boundary (inputs cast to
        16 bits, outputs to float32), as ``ampkit.initialize`` makes it: call ``self(x)`` in
        ``training_step``.
    """

    def __init__(
        self,
        opt_level: str = "O1",
        dtype: torch.dtype | str | None = None,
        *,
        policy: Policy | None = None,
        scaler: DynamicLossScaler | StaticLossScaler | None = None,
        compute: str = "auto",
        compression: torch.dtype | None = None,
        predivide_factor: float | None = None,
        device: str | None = None,
        fp8: Fp8Recipe | None = None,
    ) -> None:
        self._configure(opt_level, dtype, policy=policy, scaler=scaler, compute=compute, compression=compression,
                        predivide_factor=predivide_factor, device=device)
        self.fp8 = fp8
        self.fp8_layers: dict[str, str] = {}  # with fp8: each linear's name and "fp8" or why it stayed

    # -- setup -----------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """FP8 linears if asked; O2/O3: cast the model as ``ampkit.initialize`` does (in place: DDP wraps it next)."""
        self._model = module
        if self.fp8 is not None:
            dist = torch.distributed
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
            self.fp8_layers = convert_to_fp8(module, self.fp8, process_group=group)
        if self.level.weights_16bit:
            if self.level.masters:
                self._exact = {id(p): p.detach().clone() for p in module.parameters()}
            cast_model_(module, self.level, self.dtype)
            accumulate = resolve_grad_dtype(None, self.level, self.dtype)  # O2: float32, each master's own
            if accumulate is not None:
                accumulate_in(module.parameters(), accumulate)
        return module

    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[nn.Module, list[Any], list[Any]]:
        """Wrap optimizers in master weights (O2), make step schedulers skip-aware, register the DDP hook."""
        if self.level.masters:
            optimizers = [self._with_masters(opt, model) for opt in optimizers]
            if isinstance(model, nn.parallel.DistributedDataParallel):
                # DDP's reducer takes gradients in the weights' dtype only: 16-bit ones, which the scaler's unscale_
                # copies into the masters before Lightning clips them (main_params: the masters).
                accumulate_in(model.parameters(), None)
        for config in lr_schedulers:
            if config.interval == "step" and not isinstance(config.scheduler, _SkipAwareScheduler):
                config.scheduler = _SkipAwareScheduler(config.scheduler, self)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if self.scaler.process_group is None:
                self.scaler.process_group = torch.distributed.group.WORLD  # every rank skips the same steps
            if self.compression is not None and isinstance(model, nn.parallel.DistributedDataParallel):
                self.hook_state = HookState()
                model.register_comm_hook(self.hook_state, compression_hook(self.compression, self.predivide_factor))
        return model, optimizers, lr_schedulers

    def _with_masters(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        if isinstance(optimizer, MasterWeightOptimizer):
            return optimizer
        wrapped = MasterWeightOptimizer(optimizer)
        with torch.no_grad():  # the masters start from the float32 weights, not from their 16-bit rounding
            for param, master in zip(wrapped.model_params, wrapped.master_params):
                if id(param) in self._exact:
                    master.copy_(self._exact[id(param)])
        follow_model(wrapped, model)  # checkpoints hold the masters as the model's weights, as initialize's O2
        return wrapped

    # -- the training step ---------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(self.scaler.scale(tensor), module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure (forward, scaled backward), unscale, clip, then step unless gradients overflowed."""
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("ampkit's loss scaling cannot step LBFGS (it re-evaluates the loss inside step): "
                             "use another optimizer, or Lightning's precision='32-true'.")
        closure_result = closure()
        # In automatic optimization a training_step that returns None skips backward: nothing to step.
        if closure_result is None and isinstance(model, LightningModule) and model.automatic_optimization:
            return closure_result
        self.scaler.unscale_(optimizer)  # clipping (in _after_closure) sees true gradients
        self._after_closure(model, optimizer)
        stepped = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._stepped[id(_inner(optimizer))] = stepped
        if isinstance(model, LightningModule) and model._current_fx_name is not None:
            self._log(model)
        return closure_result

    def _log(self, model: LightningModule) -> None:
        """Log the skip count and the scale when either changed, and on the Trainer's logging steps.

        A LightningModule.log call can cost as much as a small model's whole step on a CPU;
        the values change rarely (a skip, a growth), so logging them on change loses nothing.
        """
        figures = (float(self.scaler.stats.skipped), float(self.scaler.get_scale()))
        every = getattr(model.trainer, "log_every_n_steps", 0) or 1  # set by Lightning's logger connector
        if figures != self._logged or model.trainer.global_step % every == 0:
            model.log_dict({"ampkit/skipped_steps": figures[0], "ampkit/loss_scale": figures[1]},
                           on_step=True, on_epoch=False)
            self._logged = figures


class AmpkitFabricPrecision(_AmpkitCore, FabricPrecision):
    """ampkit as a Fabric precision plugin: ``Fabric(plugins=[AmpkitFabricPrecision("O1", torch.float16)])``.

    Takes the arguments of ``AmpkitPrecision`` except ``compression`` (register
    ``ampkit.distributed.compression_hook`` on the DDP model yourself). ``optimizer.step()`` returns
    False when the scaler skipped the step: ``if optimizer.step(): scheduler.step()``. Save the
    scaler with the rest: ``fabric.save(path, {"model": model, "optimizer": optimizer, "scaler": plugin.scaler})``.

    Note:
        Fabric gives a precision plugin no hook to wrap the optimizer, so for O2 call
        ``ampkit.initialize(model, optimizer, "O2", dtype)`` before ``fabric.setup(model, optimizer)``;
        the plugin then scales the loss and steps through float32 master weights.
    """

    def __init__(
        self,
        opt_level: str = "O1",
        dtype: torch.dtype | str | None = None,
        *,
        policy: Policy | None = None,
        scaler: DynamicLossScaler | StaticLossScaler | None = None,
        compute: str = "auto",
        device: str | None = None,
    ) -> None:
        self._configure(opt_level, dtype, policy=policy, scaler=scaler, compute=compute, device=device)

    def convert_module(self, module: nn.Module) -> nn.Module:
        self._model = module
        initialized = getattr(module, "_ampkit_opt_level", None)
        if self.level.masters:
            if initialized != self.opt_level:
                raise RuntimeError("AmpkitFabricPrecision('O2') needs float32 master weights, which Fabric gives a "
                                   "plugin no hook to create: call model, optimizer = ampkit.initialize(model, "
                                   "optimizer, 'O2', dtype) before fabric.setup(model, optimizer).")
            return module
        if self.level.pure16:
            cast_model_(module, self.level, self.dtype)
        return module

    def _region(self) -> contextlib.AbstractContextManager[Any]:
        if self.level.masters:
            return contextlib.nullcontext()  # ampkit.initialize wrapped the model's forward already
        return super()._region()

    def convert_output(self, data: Any) -> Any:
        """16-bit outputs become float32, as Fabric's own mixed precision makes them (the loss then is float32)."""
        return apply_to_collection(data, torch.Tensor, lambda t: t.float() if t.dtype in LOW_DTYPES else t)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        super().backward(self.scaler.scale(tensor), model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> bool:  # type: ignore[override]
        """Step unless gradients overflowed; returns whether the step was taken."""
        stepped = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        self._stepped[id(_inner(optimizer))] = stepped
        return stepped

    def unscale_gradients(self, optimizer: Any) -> None:
        self.scaler.unscale_(optimizer)  # fabric.clip_gradients calls this first


def _inner(optimizer: Any) -> Any:
    """The torch optimizer under Lightning's and ampkit's wrappers (the one schedulers hold)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return optimizer.optimizer if isinstance(optimizer, MasterWeightOptimizer) else optimizer


class _SkipAwareScheduler:
    """An LR scheduler stepped per optimizer step that stays put when that step was skipped.

    Everything else (state_dict, get_last_lr, attributes) is the wrapped scheduler's.
    """

    def __init__(self, scheduler: Any, plugin: AmpkitPrecision) -> None:
        self.scheduler, self.plugin = scheduler, plugin

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.plugin.last_step_taken(self.scheduler.optimizer):
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "plugin"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
