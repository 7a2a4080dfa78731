"""FP32 master weights: the optimizer steps float32 copies of a 16-bit model's weights.

A 16-bit weight cannot take an update smaller than half its spacing: bfloat16
has 8 significant bits, so ``1.0 + 1e-3`` rounds back to ``1.0``. Keeping a
float32 copy of every weight for the optimizer (Micikevicius et al., 2018,
"Mixed Precision Training") keeps those updates.

What a float32 loop does to the model and its optimizer must still mean what it means (docs/training.md, "The
contract"): the optimizer the user built is the inner one, its groups now over the masters (a scheduler built on
it before ``initialize`` drives them); at O2 each weight's gradient is float32 and is its master's own
(``optim/grads.py``), so clipping ``model.parameters()`` clips what the step uses; and ``follow_model`` makes
the model's state dict the masters' (``model.state_dict()`` holds the trained float32 values, and
``model.load_state_dict`` of a float32 checkpoint sets the masters exactly, so a float32 run resumes at O2 from
its trained weights). The other direction measured (float32 parameters with 16-bit copies for compute, as FSDP2's
``MixedPrecisionPolicy`` keeps shards) would change O2's weights, checkpoints and every integration at once; this
one keeps them and closes each way a float32 loop could reach a stale copy.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ampkit import _torch
from ampkit.optim.states import check_same_format, loaded_in_format, states_format

STATE_VERSION = 1


def _on_gradient(owner: weakref.ref, index: int, param: torch.Tensor) -> None:
    """After a backward added into ``param.grad``: the masters' copies are stale; a float32 gradient is its
    master's own at once (so torch.amp.GradScaler, which reads the masters, unscales it)."""
    optimizer = owner()
    if optimizer is not None:
        optimizer._grads_synced = False
        master = optimizer.master_params[index]
        if param.grad is not None and param.grad.dtype == master.dtype and param.grad.device == master.device:
            master.grad = param.grad


def _master_state_dict(owner: weakref.ref, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                       local_metadata: Any) -> None:
    """``module.state_dict()``'s entries for its own 16-bit weights replaced by their float32 masters (detached, as
    torch's own entries are; ``keep_vars=True`` entries, the Parameters themselves, are left)."""
    optimizer = owner()
    if optimizer is None:
        return
    for name, param in module.named_parameters(recurse=False):
        master, key = optimizer.master_of(param), prefix + name
        if master is not None and key in state_dict and not isinstance(state_dict[key], nn.Parameter):
            state_dict[key] = master.detach()


def _capture_loaded(captured: dict[str, torch.Tensor], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                    *_: Any) -> None:
    """Before ``module.load_state_dict`` rounds them into 16-bit weights: the values it loads for the module's own
    weights, by their names in the module."""
    captured.clear()
    for name in dict(module.named_parameters(recurse=False)):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor):
            captured[name] = value


def _masters_from_loaded(owner: weakref.ref, captured: dict[str, torch.Tensor], module: nn.Module,
                         incompatible_keys: Any) -> None:
    """After ``module.load_state_dict``: each master of a weight it loaded takes the loaded value, exactly where it
    was float32 (a float32 checkpoint, or an O2 model's own state dict, which holds the masters); a 16-bit value
    (an older O2 state dict) is taken only where the master does not round to it already, so that loading the
    model before or after the optimizer's state (which holds the exact masters) keeps them exact."""
    optimizer, loaded = owner(), dict(captured)
    captured.clear()
    if optimizer is None:
        return
    with torch.no_grad():
        for name, param in module.named_parameters(recurse=False):
            master, value = optimizer.master_of(param), loaded.get(name)
            if master is None or value is None or value.shape != master.shape:
                continue
            if value.dtype != torch.float32:
                if torch.equal(master.to(param.dtype), param):
                    continue
                value = param
            master.copy_(value)


def follow_model(optimizer: MasterWeightOptimizer, model: nn.Module) -> None:
    """Make ``model``'s state dict its masters': ``model.state_dict()`` gives each 16-bit weight's float32 master
    (torch.save, ``save_pretrained`` and a framework's checkpoint keep the trained float32 values), and
    ``model.load_state_dict`` sets the masters of what it loads (a float32 checkpoint resumes exactly). Through
    torch's public module state-dict hooks on each module with a weight of ``optimizer``'s; they hold the optimizer
    weakly, and do nothing once it is gone."""
    owner = weakref.ref(optimizer)
    for module in model.modules():
        if not any(optimizer.master_of(p) is not None for p in module.parameters(recurse=False)):
            continue
        captured: dict[str, torch.Tensor] = {}
        module.register_state_dict_post_hook(functools.partial(_master_state_dict, owner))
        module.register_load_state_dict_pre_hook(functools.partial(_capture_loaded, captured))
        module.register_load_state_dict_post_hook(functools.partial(_masters_from_loaded, owner, captured))


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

    Examples:
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
        self._index = {id(p): i for i, p in enumerate(self.model_params)}
        self._grads_synced = False
        self._shared = False  # whether the float32 parameters are their own masters yet (_share_float32_masters)
        # what a step writes back: each weight and its master (a float32 weight that is its own master needs none)
        self._written, self._written_from = list(self.model_params), list(self.master_params)
        # A new backward makes the masters' copies stale, whoever clears the model's gradients: a skipped step
        # followed by model.zero_grad() (transformers' Trainer) kept the overflowed copies for good otherwise.
        owner = weakref.ref(self)  # the model's parameters must not keep the optimizer alive
        for index, param in enumerate(self.model_params):
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(functools.partial(_on_gradient, owner, index))
        optimizer._ampkit_masters = True  # type: ignore[attr-defined]  # its groups now hold masters

    # torch.optim.Optimizer's own attributes, delegated so schedulers and hooks work.
    @property  # type: ignore[misc]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's groups (over the float32 masters): a scheduler edits their ``lr`` here."""
        return self.optimizer.param_groups

    @property  # type: ignore[misc]
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-parameter state (its moments, keyed by the masters)."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's default hyperparameters."""
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        # Anything else (hooks, _opt_called set by LR schedulers) lives on the inner optimizer.
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    # A copy (copy.deepcopy: the guard's replay of a module that holds its optimizer) is of the wrapper's own
    # attributes; torch.optim.Optimizer's pickled state (defaults, state, groups) is the inner optimizer's.
    def __getstate__(self) -> dict[str, Any]:  # type: ignore[override]
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The float32 master of the model's parameter ``param``; None where ``param`` is not one of the model's
        weights this optimizer steps, or is its own master (a float32 weight, from the first step on)."""
        index = self._index.get(id(param))
        if index is None or self.model_params[index] is not param or self.master_params[index] is param:
            return None
        return self.master_params[index]

    def prepare_grads_(self) -> None:
        """Copy the model's 16-bit gradients into the masters' float32 ``.grad`` (a float32 gradient of the
        model's is the master's own, not copied).

        Called by ``step`` and by a loss scaler's ``unscale_``; once per step.
        """
        if self._grads_synced:
            return
        if not self._shared:
            self._share_float32_masters()
        targets, sources = [], []
        for param, master in zip(self.model_params, self.master_params):
            if param.grad is None:
                master.grad = None
            elif param.grad.dtype == master.dtype and param.grad.device == master.device:
                master.grad = param.grad  # float32 already (initialize's grad_dtype): the master takes it, no copy
            elif master.grad is None or master.grad.shape != param.grad.shape or master.grad is param.grad:
                master.grad = param.grad.detach().float()
            else:
                targets.append(master.grad)
                sources.append(param.grad)
        if targets:
            _torch.foreach_copy_(targets, sources)  # one fused, converting copy
        self._grads_synced = True

    @torch.no_grad()
    def _share_float32_masters(self) -> None:
        """Make each model parameter that is float32 at the first step (O2 keeps norms in float32) its own master:
        a copy of it would hold the same values, 4 bytes per parameter more. Done at the first step, not when the
        wrapper is built: ``initialize`` builds it before the cast, while every weight is still float32. The inner
        optimizer's groups and any state it holds (a resumed run's moments) move to the parameter."""
        self._shared = True
        index = 0
        for group in self.optimizer.param_groups:
            for position, master in enumerate(group["params"]):
                param = self.model_params[index]
                if (param is not master and param.dtype == master.dtype == torch.float32
                        and param.device == master.device and param.shape == master.shape):
                    group["params"][position] = self.master_params[index] = param
                    if master in self.optimizer.state:
                        self.optimizer.state[param] = self.optimizer.state.pop(master)
                    if param.grad is None and master.grad is not None:
                        param.grad = master.grad
                index += 1
        pairs = [(p, m) for p, m in zip(self.model_params, self.master_params) if p is not m]
        self._written, self._written_from = [p for p, _ in pairs], [m for _, m in pairs]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Step the inner optimizer on the masters and write them back to the model."""
        self.prepare_grads_()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if self._written:
            _torch.foreach_copy_(self._written, self._written_from)
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

        Keys: ``version``, ``optimizer`` (the inner state dict), ``master_params``, ``grad_dtype`` (what the
        16-bit weights' gradients accumulate in: ``"float32"`` or ``"weights"``, their own dtype), ``states`` (the
        format of the inner optimizer's moments: ``"as given"``, ``"fp32"``, ``"bf16"``, ``"8bit"``, ``"4bit"``,
        ``"fp8"``; ``ampkit.optim.states``).
        """
        return {
            "version": STATE_VERSION,
            "optimizer": self.optimizer.state_dict(),
            "master_params": [m.detach().clone() for m in self.master_params],
            "grad_dtype": self._grad_dtype(),
            "states": states_format(self),
        }

    def _grad_dtype(self) -> str:
        """``"float32"`` where the model's 16-bit weights accumulate their gradients in float32, else ``"weights"``."""
        low = [p for p in self.model_params if p.dtype in (torch.float16, torch.bfloat16) and p.requires_grad]
        return "float32" if low and all(p.grad_dtype == torch.float32 for p in low) else "weights"

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
            loaded_in_format(self.optimizer, state_dict)
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
        inner = state_dict["optimizer"]
        if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
            raise RuntimeError(f"MasterWeightOptimizer state's 'optimizer' is {type(inner).__name__}, not the inner "
                               "optimizer's state dict ('state' and 'param_groups'): pass the dict from its "
                               "state_dict().")
        check_same_format(state_dict.get("states", states_format(self)), self,  # older state dicts do not say
                          "The checkpoint's optimizer")
        saved_grads = state_dict.get("grad_dtype", self._grad_dtype())  # older state dicts do not say
        if saved_grads != self._grad_dtype():
            warnings.warn(f"The checkpoint's run accumulated gradients in {saved_grads!r}, this one in "
                          f"{self._grad_dtype()!r} ('weights': the 16-bit weights' own dtype): the resumed run will "
                          "not match an uninterrupted one; pass initialize the checkpoint's grad_dtype to match it.",
                          stacklevel=2)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            for master, saved in zip(self.master_params, masters):
                master.copy_(saved)
            _torch.foreach_copy_(self.model_params, self.master_params)

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
