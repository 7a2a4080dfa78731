"""FP32 master weights and Apex-style opt levels O0-O3.

A 16-bit weight cannot take an update smaller than half its spacing: bfloat16
has 8 significant bits, so ``1.0 + 1e-3`` rounds back to ``1.0``. Keeping a
float32 copy of every weight for the optimizer (Micikevicius et al., 2018,
"Mixed Precision Training") keeps those updates.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ampkit import compute as compute_mod
from ampkit import hardware, pure16
from ampkit.autocast import autocast
from ampkit.policy import LOW_DTYPES, Policy, resolve_dtype

STATE_VERSION = 1
OPT_LEVELS = ("O0", "O1", "O2", "O3")
NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Update a 16-bit model through float32 copies of its weights.

    The wrapped optimizer's ``param_groups`` hold the float32 masters (so its
    state, e.g. Adam moments, is float32 too); ``model_params`` are the model's
    own parameters. ``step`` copies the 16-bit gradients into float32 (done
    earlier by a loss scaler's ``unscale_``, which then unscales in float32),
    steps the inner optimizer and writes the masters back, rounded.

    Args:
        optimizer: any torch.optim optimizer built over the model's parameters.
            Build this wrapper while they are still float32 (``initialize`` does),
            or the masters start from already-rounded values.

    Example:
        >>> opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        >>> model.to(torch.bfloat16)
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, MasterWeightOptimizer) or getattr(optimizer, "_ampkit_masters", False):
            raise ValueError("The optimizer already keeps master weights; wrap the inner optimizer once.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"MasterWeightOptimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}: "
                             "build one over the model's parameters first, e.g. torch.optim.AdamW(model.parameters()).")
        self.optimizer = optimizer
        self.model_params: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            masters = []
            for param in group["params"]:
                self.model_params.append(param)
                masters.append(param.detach().clone().float().requires_grad_(param.requires_grad))
            group["params"] = masters
        self.master_params: list[torch.Tensor] = [m for g in optimizer.param_groups for m in g["params"]]
        self._grads_synced = False
        optimizer._ampkit_masters = True  # type: ignore[attr-defined]  # its groups now hold masters

    # torch.optim.Optimizer's own attributes, delegated so schedulers and hooks work.
    @property  # type: ignore[misc]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property  # type: ignore[misc]
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        # Anything else (hooks, _opt_called set by LR schedulers) lives on the inner optimizer.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def prepare_grads_(self) -> None:
        """Copy the model's 16-bit gradients into the masters' float32 ``.grad``.

        Called by ``step`` and by a loss scaler's ``unscale_``; once per step.
        """
        if self._grads_synced:
            return
        targets, sources = [], []
        for param, master in zip(self.model_params, self.master_params):
            if param.grad is None:
                master.grad = None
            elif master.grad is None or master.grad.shape != param.grad.shape:
                master.grad = param.grad.detach().float()
            else:
                targets.append(master.grad)
                sources.append(param.grad)
        if targets:
            torch._foreach_copy_(targets, sources)  # one fused, converting copy
        self._grads_synced = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Step the inner optimizer on the masters and write them back to the model."""
        self.prepare_grads_()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        torch._foreach_copy_(self.model_params, self.master_params)
        self._grads_synced = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the masters' gradients."""
        for tensors in (self.model_params, self.master_params):
            for t in tensors:
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.detach_().zero_()
        self._grads_synced = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "add_param_group() on a MasterWeightOptimizer is not supported: build the inner optimizer "
            "with every group, then wrap it."
        )

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus the float32 masters.

        Keys: ``version``, ``optimizer`` (the inner state dict), ``master_params``.
        """
        return {
            "version": STATE_VERSION,
            "optimizer": self.optimizer.state_dict(),
            "master_params": [m.detach().clone() for m in self.master_params],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; the model's weights are set from the masters.

        A plain optimizer state dict (from float32 training without this wrapper)
        loads too: its state is applied and the masters keep their values; to take
        the weights from a float32 model checkpoint use ``load_fp32_weights``.

        Raises:
            RuntimeError: an empty dict, or masters that do not match in count or shape.
        """
        if not isinstance(state_dict, dict) or not state_dict:
            raise RuntimeError(f"Cannot load {'an empty dict' if isinstance(state_dict, dict) else repr(state_dict)} "
                               "into MasterWeightOptimizer: pass the dict from its state_dict().")
        if "master_params" not in state_dict:
            if "state" not in state_dict or "param_groups" not in state_dict:
                raise RuntimeError(
                    f"Not an optimizer state dict: keys {sorted(state_dict)}; expected 'version', 'optimizer' "
                    "and 'master_params' (MasterWeightOptimizer) or 'state' and 'param_groups' (torch.optim)."
                )
            self.optimizer.load_state_dict(state_dict)
            return
        missing = sorted({"version", "optimizer", "master_params"} - set(state_dict))
        if missing:
            raise RuntimeError(f"MasterWeightOptimizer state misses {missing}: pass the dict from its state_dict().")
        if state_dict["version"] != STATE_VERSION:
            raise RuntimeError(f"MasterWeightOptimizer state version {state_dict['version']!r} is not "
                               f"{STATE_VERSION!r}: this ampkit reads version {STATE_VERSION} state dicts.")
        masters = state_dict["master_params"]
        if len(masters) != len(self.master_params):
            raise RuntimeError(
                f"The checkpoint has {len(masters)} master weights, this optimizer {len(self.master_params)}."
            )
        # Everything is checked before anything changes: a failed load leaves the optimizer as it was.
        for index, (master, saved) in enumerate(zip(self.master_params, masters)):
            if not isinstance(saved, torch.Tensor) or master.shape != saved.shape:
                shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
                raise RuntimeError(f"Master weight {index} in the checkpoint is {shape}, this model's "
                                   f"{tuple(master.shape)}: the checkpoint is from another model.")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for master, saved in zip(self.master_params, masters):
                master.copy_(saved)
            torch._foreach_copy_(self.model_params, self.master_params)

    @torch.no_grad()
    def load_fp32_weights(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a float32 model checkpoint: exact into the masters, rounded into ``model``."""
        model.load_state_dict(state_dict)
        index = {id(p): i for i, p in enumerate(self.model_params)}
        for name, param in model.named_parameters():
            if id(param) in index:
                self.master_params[index[id(param)]].copy_(state_dict[name])

    @torch.no_grad()
    def fp32_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` with every trained weight taken from its float32 master."""
        masters = {id(p): m for p, m in zip(self.model_params, self.master_params)}
        state = model.state_dict()
        for name, param in model.named_parameters():
            if id(param) in masters:
                state[name] = masters[id(param)].detach().clone()
        return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


def _cast_inputs(dtype: torch.dtype) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def cast(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.to(dtype)
            return v

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook


def cast_output_to_float32(module: nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook: a 16-bit tensor output becomes float32 (the O2/O3 model boundary)."""
    if isinstance(output, torch.Tensor) and output.dtype in LOW_DTYPES:
        return output.float()
    return output


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str = "O1",
    dtype: torch.dtype | str | None = None,
    compute: str = "auto",
    policy: Policy | None = None,
    update: str = "plain",
    keep_float32: Sequence[type[nn.Module]] = (),
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Prepare a float32 model and its optimizer for mixed precision (Apex's levels).

    Args:
        model: a float32 model, already on its device.
        optimizer: its optimizer (optional, for inference).
        opt_level: ``"O0"`` float32; ``"O1"`` autocast with the default policy,
            float32 weights; ``"O2"`` model in ``dtype`` except normalization layers,
            float32 master weights, inputs cast to ``dtype`` and outputs to float32 at
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
        update: at O3, how the optimizer's updates reach the 16-bit weights (see ``ampkit.pure16``):
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

    Returns:
        (model, optimizer): the model is changed in place; the optimizer is wrapped
        in ``MasterWeightOptimizer`` for O2.

    Raises:
        ValueError: an unknown ``opt_level``, dtype, compute mode or update; a policy with O0, O2 or O3;
            an update other than ``"plain"`` below O3.

    Example:
        >>> model, optimizer = ampkit.initialize(model, optimizer, "O2")
    """
    check_settings(opt_level, compute, policy, update)
    check_keep_float32(opt_level, keep_float32)
    if getattr(model, "_ampkit_opt_level", None) is not None:
        raise ValueError(
            f"The model was initialized at {model._ampkit_opt_level} already; call ampkit.initialize once, on the "
            "float32 model and its plain optimizer (a second call adds masters of masters and a second set of hooks)."
        )
    model._ampkit_opt_level = opt_level  # type: ignore[assignment]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = resolve_dtype(dtype) if dtype is not None else hardware.recommend_dtype(device)
    if opt_level == "O0":
        return model, optimizer
    if opt_level == "O1":
        _wrap_forward(model, autocast(policy or Policy.default(device.type, dtype, compute=compute)))
        return model, optimizer
    if opt_level == "O2" and optimizer is not None:
        optimizer = MasterWeightOptimizer(optimizer)  # before the cast: masters are exact
    cast_model_(model, opt_level, dtype, tuple(keep_float32))
    if optimizer is not None and update != "plain":
        optimizer = pure16.pure16_optimizer(optimizer, update)
    model16 = Policy.for_16bit_model(device.type, dtype, compute)
    if compute_mod.float32_ops(model16):
        _wrap_forward(model, autocast(model16))
    return model, optimizer


def check_settings(opt_level: str, compute: str, policy: Policy | None, update: str = "plain") -> None:
    """Refuse an unknown opt level, compute mode or update, a policy at levels other than O1 and
    a pure 16-bit update below O3 (ValueError)."""
    if opt_level not in OPT_LEVELS:
        raise ValueError(f"Unknown opt_level: {opt_level!r}. Choose one of {list(OPT_LEVELS)}.")
    compute_mod.check_compute(compute)
    pure16.check_update(update)
    if update != "plain" and opt_level != "O3":
        raise ValueError(f"update={update!r} applies at O3 only (opt_level={opt_level!r} keeps float32 weights or "
                         "master weights, which take small updates as they are): drop update=, or use opt_level='O3'.")
    if policy is not None and opt_level != "O1":
        raise ValueError(f"policy= applies at O1 only (opt_level={opt_level!r} casts nothing by policy): drop "
                         "policy=, or use opt_level='O1'.")


def check_keep_float32(opt_level: str, keep_float32: Sequence[type[nn.Module]]) -> None:
    """Raise ValueError unless ``keep_float32`` lists nn.Module subclasses, at O2 (or is empty)."""
    if keep_float32 and opt_level != "O2":
        raise ValueError(f"keep_float32= applies at O2 only (opt_level={opt_level!r}): drop it, or use opt_level='O2'.")
    bad = [t for t in keep_float32 if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad:
        raise ValueError(f"keep_float32={list(keep_float32)!r} must list nn.Module subclasses, e.g. [nn.Embedding]; "
                         f"not {bad}.")


def cast_model_(model: nn.Module, opt_level: str, dtype: torch.dtype,
                keep_float32: tuple[type[nn.Module], ...] = ()) -> None:
    """The model half of O2 and O3: cast the weights to ``dtype`` (O2 keeps normalization layers
    and ``keep_float32`` types in float32, with any weight tied to theirs), and cast floating inputs
    to ``dtype`` and 16-bit outputs to float32 at ``model``'s forward. Parameter objects are kept,
    so optimizers built on them still hold them.

    With ``keep_float32``, float32 activations can reach 16-bit layers (a transformer's residual
    stream from a float32 embedding), so every module whose own weights are 16-bit casts its
    floating inputs to ``dtype``. torch's norms take 16-bit inputs with float32 weights as they are.
    """
    kept_types = (*NORM_TYPES, *keep_float32) if opt_level == "O2" else ()
    kept = {id(p) for m in model.modules() if isinstance(m, kept_types) for p in m.parameters(recurse=False)}
    for module in model.modules():
        if isinstance(module, kept_types):
            continue
        _cast_own(module, dtype, kept)
        own = list(module.parameters(recurse=False))
        if keep_float32 and module is not model and own and all(p.dtype == dtype for p in own):
            module.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    model.register_forward_pre_hook(_cast_inputs(dtype), with_kwargs=True)
    model.register_forward_hook(cast_output_to_float32)


def _wrap_forward(model: nn.Module, region: autocast) -> None:
    model.forward = types.MethodType(region(type(model).forward), model)  # type: ignore[method-assign]


def _cast_own(module: nn.Module, dtype: torch.dtype, kept: frozenset[int] | set[int] = frozenset()) -> None:
    """Cast a module's own parameters (but those in ``kept``, by id) and floating buffers,
    not its children's.

    ``param.data`` is replaced, so the Parameter objects (which optimizers hold) stay.
    """
    for param in module.parameters(recurse=False):
        if id(param) not in kept:
            param.data = param.data.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buf.is_floating_point():
            setattr(module, name, buf.to(dtype))
