"""Layer-wise adaptive loss scaling: one loss scale per layer, set from gradient statistics.

One global loss scale is a compromise: the layer with the largest gradients caps it,
and then the layer with the smallest ones flushes to zero in float16. Zhao et al.,
"Adaptive Loss Scaling for Mixed Precision Training" (2019), give every layer its
own scale, computed during backward from its gradients' statistics; their code is
Chainer's. This is ampkit's PyTorch version.

How: each layer (a module that owns parameters and has no children that do) is
bracketed by two gradient rescalings. Its output gradient arrives at the global
scale ``S`` and is multiplied by ``S_l / S``; the layer's backward (its weight
gradients and its input gradient) then runs at its own scale ``S_l``; the input
gradient is multiplied by ``S / S_l`` on the way out. Outside the brackets every
gradient is at ``S``, so residual connections and any other graph sum gradients of
one scale; all scales are powers of two, so the rescalings are exact.

- ``S`` is dynamic loss scaling as ``DynamicLossScaler`` (it guards the gradients
  flowing between layers);
- ``S_l`` follows the layer's largest true gradient (weights, output and input
  gradients) of the last clean step, ``amax``: the largest power of two with
  ``amax * S_l <= finfo(dtype).max / 2**margin``, within [min_scale, max_scale];
- an overflow is blamed where it starts: a layer whose output gradient arrived finite
  but whose own gradients are inf/NaN backs off its own scale only; an overflow
  with no such layer is the global scale's. The step is skipped either way.

Parameters used outside their own module's forward are not seen by the brackets:
keep them in modules (as torch's layers do); parameters of modules with
parameter-owning children (and weights tied across modules, grouped into one
layer) are handled correctly, at the global scale or the group's.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from ampkit import _torch_tensors
from ampkit.float32_compute.gelu_recompute import identity_forward
from ampkit.scaling import rules
from ampkit.scaling.rules import total
from ampkit.scaling.scaler import DynamicLossScaler
from ampkit.shards import local_shard, shard_group

STATE_VERSION = 1
_GLOBAL = -1  # the group of parameters outside every bracketed layer


@dataclasses.dataclass(frozen=True)
class LayerScaleStats:
    """One layer's loss scale.

    Attributes:
        name: the module's qualified name (``a+b`` for modules sharing a weight).
        scale: its current loss scale.
        amax: its largest true gradient magnitude in the last clean step (None before one).
        overflows: steps its own gradients overflowed (and it backed off).
    """

    name: str
    scale: float
    amax: float | None
    overflows: int


@identity_forward  # a float32-compute linear still recomputes a GELU output behind it
class _RescaleGrad(torch.autograd.Function):
    """Identity forward; backward records the incoming gradient's amax, then multiplies by ``factor``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float, record: Any) -> torch.Tensor:
        ctx.factor, ctx.record = factor, record
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.record(grad.detach().abs().amax().float())
        return grad * ctx.factor, None, None


def _rescaled(value: Any, factor: float, record: Any) -> Any:
    """``value`` behind a _RescaleGrad when gradients flow into it; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
        return _RescaleGrad.apply(value, factor, record)
    return value


class AdaptiveLossScaler(DynamicLossScaler):
    """Loss scaling with one scale per layer, set from its gradients (see the module docstring).

    Same call pattern as DynamicLossScaler (``scale`` / ``unscale_`` / ``step`` / ``update``,
    ``state_dict``; ``step`` returns False when the step was skipped), with MasterWeightOptimizer
    and DistributedOptimizer alike. Build it on the model before the forward passes it scales;
    the brackets are forward hooks on its layers (``remove_hooks`` takes them off).

    Args:
        model: the model whose layers get their own scales.
        dtype: the 16-bit format whose range the scales fit (default torch.float16;
            bfloat16 has float32's range and needs no loss scaling).
        margin: powers of two of headroom above a layer's largest gradient (default 2:
            the layer's gradients may grow 4x from one step to the next before they overflow).
        scaler_args: DynamicLossScaler's keyword arguments (init_scale, growth_factor,
            backoff_factor, growth_interval, hysteresis, min_scale, max_scale,
            max_min_scale_overflows, enabled, process_group), for the global scale;
            ``min_scale`` and ``max_scale`` bound the layer scales too, and ``init_scale`` is
            every layer's scale until its first clean step. ``process_group`` also reduces the
            layer statistics, so every rank keeps the same scales.

    Raises:
        ValueError: a constant out of range, or a model without parameters.

    Examples:
        >>> scaler = ampkit.AdaptiveLossScaler(model)
        >>> scaler.scale(loss_fn(model(x), y)).backward()
        >>> scaler.step(optimizer); scaler.update()
        >>> [(s.name, s.scale) for s in scaler.layer_stats]
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float16, margin: int = 2,
                 **scaler_args: Any) -> None:
        super().__init__(**scaler_args)  # the global scale: DynamicLossScaler's own arguments and checks
        if not isinstance(model, nn.Module):
            raise ValueError(f"AdaptiveLossScaler(model=...) takes the nn.Module it scales, got {type(model).__name__}.")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype} is not a 16-bit float: use torch.float16 (or torch.bfloat16).")
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin={margin!r} is invalid: use an integer >= 0 (powers of two of headroom).")
        self.dtype, self.margin = dtype, margin
        self.names, self._group_of, layers = _layer_groups(model)
        if not self._group_of:
            raise ValueError("The model has no trainable parameters: there is nothing to scale.")
        self._layer_scales = [self._state.scale] * len(self.names)
        self._layer_amax: list[float | None] = [None] * len(self.names)
        self._layer_overflows = [0] * len(self.names)
        self._faulted: list[int] = []  # layers whose own gradients overflowed in the last update
        self._table: list[list[float]] = []  # per group: largest incoming, input and weight gradient (last sync)
        self._master_of: dict[int, int] = {}  # id of a float32 master -> id of its model parameter
        # each optimizer with masters -> their ids when _master_of was built (weak: a rebuilt optimizer may take
        # a freed one's id)
        self._mapped: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()
        self._handles: list[Any] = []
        if self.enabled:
            for module, group in layers:
                self._handles.append(module.register_forward_pre_hook(self._bracket_inputs(group), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._bracket_output(group)))

    # -- what it adds to DynamicLossScaler ----------------------------------------

    @property
    def layer_stats(self) -> list[LayerScaleStats]:
        """Each layer's scale, last clean amax and overflow count, in module order."""
        return [LayerScaleStats(*row) for row in zip(self.names, self._layer_scales, self._layer_amax,
                                                     self._layer_overflows)]

    def layer_scale(self, name: str) -> float:
        """The current loss scale of the layer ``name`` (a module's qualified name).

        Raises:
            ValueError: no bracketed layer has that name (the valid names are listed).
        """
        for names, scale in zip(self.names, self._layer_scales):
            if name in names.split("+"):
                return scale
        raise ValueError(f"No layer named {name!r}; layers: {self.names}.")

    def remove_hooks(self) -> None:
        """Take the brackets off the model (it then trains at the global scale only: use a
        DynamicLossScaler instead)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """DynamicLossScaler.unscale_, each layer's gradients divided by the scale they were computed at."""
        self._map_masters(optimizer)
        super().unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """DynamicLossScaler's keys plus ``adaptive_version``, ``layer_names``, ``layer_scales``,
        ``layer_amax`` and ``layer_overflows`` (lists in module order)."""
        return {
            **super().state_dict(),
            "adaptive_version": STATE_VERSION,
            "layer_names": list(self.names),
            "layer_scales": list(self._layer_scales),
            "layer_amax": list(self._layer_amax),
            "layer_overflows": list(self._layer_overflows),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` of a scaler built on the same model.

        Raises:
            RuntimeError: missing keys, another version, or other layers (their names are given).
        """
        keys = ("adaptive_version", "layer_names", "layer_scales", "layer_amax", "layer_overflows")
        missing = [k for k in keys if k not in (state_dict if isinstance(state_dict, dict) else {})]
        if missing:
            raise RuntimeError(f"Cannot load adaptive loss scaler state: missing keys {missing}. Pass the dict from "
                               "AdaptiveLossScaler.state_dict() (a DynamicLossScaler's has no layer scales).")
        if state_dict["adaptive_version"] != STATE_VERSION:
            raise RuntimeError(f"Adaptive loss scaler state version {state_dict['adaptive_version']!r} is not "
                               f"{STATE_VERSION}: this ampkit reads version {STATE_VERSION}.")
        if list(state_dict["layer_names"]) != self.names:
            raise RuntimeError(f"The state is of layers {state_dict['layer_names']}, this model's are {self.names}: "
                               "build the scaler on the model the state was saved from.")
        scales = [float(s) for s in state_dict["layer_scales"]]
        bad = [s for s in scales if not (math.isfinite(s) and self.rule.min_scale <= s <= self.rule.max_scale)]
        if bad:
            raise RuntimeError(f"Cannot load adaptive loss scaler state: layer scales {bad} are outside "
                               f"[{self.rule.min_scale}, {self.rule.max_scale}].")
        super().load_state_dict(state_dict)  # checks and loads the global part, or changes nothing
        self._layer_scales = scales
        self._layer_amax = [None if a is None else float(a) for a in state_dict["layer_amax"]]
        self._layer_overflows = [int(n) for n in state_dict["layer_overflows"]]

    # -- the brackets (forward hooks) ------------------------------------------------

    def _record(self, group: int, kind: str) -> Any:
        scale_at = self._state.scale if kind == "incoming" else self._layer_scales[group]
        events = self._events

        def record(amax: torch.Tensor) -> None:
            events[group][kind].append(amax / scale_at)  # the true gradient's amax

        return record

    def _bracket_inputs(self, group: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not torch.is_grad_enabled():
                return None
            factor = self._state.scale / self._layer_scales[group]
            record = self._record(group, "input")
            return (tuple(_rescaled(a, factor, record) for a in args),
                    {k: _rescaled(v, factor, record) for k, v in kwargs.items()})

        return hook

    def _bracket_output(self, group: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            factor = self._layer_scales[group] / self._state.scale
            record = self._record(group, "incoming")
            if isinstance(output, (tuple, list)):
                return type(output)(_rescaled(v, factor, record) for v in output)
            return _rescaled(output, factor, record)

        return hook

    # -- DynamicLossScaler's extension points --------------------------------------------

    def _begin_iteration(self) -> None:
        super()._begin_iteration()
        # Per group: amaxes of true gradients seen this iteration, by kind.
        self._events: defaultdict[int, dict[str, list[torch.Tensor]]] = defaultdict(
            lambda: {"incoming": [], "input": [], "weights": []})

    def _unscale_grads(self, params: Any) -> torch.Tensor:
        groups: defaultdict[int, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if self._first_unscale(p):
                if p.grad.is_sparse and p.grad.dtype == torch.float16:
                    p.grad = p.grad.coalesce()
                groups[self._group_of.get(self._master_of.get(id(p), id(p)), _GLOBAL)].append(p.grad)
                self._shard_group = self._shard_group or shard_group(p.grad)
        found = []
        for group, grads in groups.items():
            scale = self._state.scale if group == _GLOBAL else self._layer_scales[group]
            found += list(rules.unscale_and_check_(grads, 1.0 / scale).values())
            values = [_torch_tensors.sparse_values(g) if g.is_sparse else local_shard(g) for g in grads]
            # the largest gradient magnitude in the group: the infinity norm over all its tensors
            self._events[group]["weights"].append(torch.nn.utils.get_total_norm(values, math.inf).float())
        return total(found)

    def _agree(self, found: torch.Tensor) -> bool:
        """DynamicLossScaler's overflow check, with this iteration's layer statistics in the
        same host sync (and the same all-reduce across ranks): one sync per ``step``."""
        kinds = ("incoming", "input", "weights")
        rows = []
        for group in [*range(len(self.names)), _GLOBAL]:
            events = self._events.get(group, {"incoming": [], "input": [], "weights": []})
            # -1: nothing seen this iteration; inf stands for inf/NaN (NaN does not survive a MAX reduction).
            rows.append(torch.stack([torch.nan_to_num(torch.stack(events[k]).amax(), nan=math.inf, posinf=math.inf)
                                     if events[k] else torch.tensor(-1.0, device=found.device) for k in kinds]))
        packed = torch.cat([torch.stack(rows).flatten(), found.detach().float().reshape(1)])
        group = self.process_group if self.process_group is not None else self._shard_group
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        *table, overflow = packed.tolist()  # the one sync
        self._table = [table[i:i + len(kinds)] for i in range(0, len(table), len(kinds))]
        return overflow > 0

    def _scale_overflowed(self, overflow: bool) -> bool:
        """Blame the overflow, update the layer scales; True when the global scale backs off."""
        values = self._table  # from the last step's sync: every gradient of the iteration was seen by then
        faulted = [g for g in range(len(self.names))
                   if math.isfinite(values[g][0]) and not all(math.isfinite(v) for v in values[g][1:])]
        self._faulted = faulted
        for group in range(len(self.names)):
            incoming, inputs, weights = values[group]
            if group in faulted:
                self._layer_overflows[group] += 1
                self._layer_scales[group] = max(self._layer_scales[group] * self.rule.backoff_factor,
                                                self.rule.min_scale)
            elif not overflow and max(incoming, inputs, weights) > 0:
                amax = max(incoming, inputs, weights)
                self._layer_amax[group] = amax
                self._layer_scales[group] = self._fit(amax)
        return overflow and not faulted

    def _at_min_scale(self, backoff: bool) -> bool:
        if backoff or not self._faulted:
            return super()._at_min_scale(backoff)
        return all(self._layer_scales[g] <= self.rule.min_scale for g in self._faulted)

    def _fit(self, amax: float) -> float:
        """The largest power of two that keeps ``amax`` ``margin`` powers of two below the format's max."""
        limit = torch.finfo(self.dtype).max / 2.0**self.margin
        scale = 2.0 ** math.floor(math.log2(limit / amax))
        return min(max(scale, self.rule.min_scale), self.rule.max_scale)

    def _map_masters(self, optimizer: Any) -> None:
        """Let gradients of float32 masters (MasterWeightOptimizer, possibly inside a
        DistributedOptimizer) find their model parameters' layers. Built again whenever an optimizer's masters
        are not those of the last build: a new optimizer, or masters replaced."""
        inner = optimizer
        while inner is not None and not hasattr(inner, "master_params"):
            inner = inner.__dict__.get("optimizer")
        if inner is None:
            return
        masters = tuple(map(id, inner.master_params))
        if self._mapped.get(inner) == masters:
            return
        self._mapped[inner] = masters
        self._master_of = {id(m): id(p) for mapped in self._mapped.keys()
                           for m, p in zip(mapped.master_params, mapped.model_params)}


def _layer_groups(model: nn.Module) -> tuple[list[str], dict[int, int], list[tuple[nn.Module, int]]]:
    """The bracketed layers: modules with trainable parameters of their own and no descendants
    with any; modules sharing a parameter form one group. Returns (group names, parameter id ->
    group, (module, group) pairs)."""
    leaves = [(name, m) for name, m in model.named_modules()
              if any(p.requires_grad for p in m.parameters(recurse=False))
              and not any(True for child in m.modules() if child is not m and any(child.parameters(recurse=False)))]
    parent = list(range(len(leaves)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return parent[i]

    owner: dict[int, int] = {}
    for i, (_, module) in enumerate(leaves):
        for p in module.parameters(recurse=False):
            if id(p) in owner:
                parent[root(i)] = root(owner[id(p)])
            else:
                owner[id(p)] = i
    roots = sorted({root(i) for i in range(len(leaves))})
    index = {r: g for g, r in enumerate(roots)}
    names = ["+".join(leaves[i][0] or "(model)" for i in range(len(leaves)) if root(i) == r) for r in roots]
    group_of = {pid: index[root(i)] for pid, i in owner.items()}
    return names, group_of, [(m, index[root(i)]) for i, (_, m) in enumerate(leaves)]

