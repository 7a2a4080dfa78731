"""Loss scalers: keep small float16 gradients from underflowing, never skip silently.

The call pattern is torch.amp.GradScaler's, so switching is a one-line change::

    scaler = ampkit.DynamicLossScaler()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        with ampkit.autocast(policy):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if scaler.step(optimizer):   # False when the step was skipped
            scheduler.step()
        scaler.update()
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ampkit.scaling import rules
from ampkit.scaling.rules import ScaleRule, ScaleState, total
from ampkit.scaling.state_dicts import STATE_VERSION, ScalerStats, check_scale, checked_state
from ampkit.shards import is_sharded, shard_group

_HISTORY_LEN = 1000



class NonFiniteError(RuntimeError):
    """Training cannot continue: steps keep overflowing at the smallest scale."""


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class DynamicLossScaler:
    """Dynamic loss scaling: grow after clean steps, back off and skip on inf/NaN.

    Args:
        init_scale: the first scale (default 2**16).
        growth_factor: multiplier after ``growth_interval`` clean steps (default 2.0).
        backoff_factor: multiplier on overflow (default 0.5).
        growth_interval: clean steps before growing (default 2000).
        hysteresis: overflowing steps tolerated before a back-off (default 1: every overflow backs off, as
            torch's GradScaler; DeepSpeed uses 2). Steps that overflow are skipped either way.
        min_scale: the lower bound of the scale (default 1.0).
        max_scale: the upper bound of the scale (default 2**24).
        max_min_scale_overflows: overflowing steps in a row at ``min_scale`` before NonFiniteError (default 10).
        enabled: False makes every method a pass-through (``scale`` returns its input, ``step`` just
            steps, and counts it in ``stats``).
        process_group: with torch.distributed, a process group (``dist.group.WORLD`` for all ranks):
            the overflow finding is all-reduced over it (one scalar) before deciding, so every rank skips
            the same steps even when ranks check different gradients. None (default): locally, or over the
            group FSDP2 gradients (DTensors) are sharded over (a rank skipping alone would leave the model
            half-updated).

    Raises:
        ValueError: a constant out of range.

    Note:
        ``step`` syncs with the device once (to decide whether to skip), as torch's
        GradScaler does; ``scale`` and ``unscale_`` do not.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        max_min_scale_overflows: int = 10,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        self.rule = ScaleRule(growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale)
        check_scale(init_scale, self.rule, "init_scale")
        if isinstance(max_min_scale_overflows, bool) or not isinstance(max_min_scale_overflows, int) \
                or max_min_scale_overflows < 1:
            raise ValueError(f"max_min_scale_overflows={max_min_scale_overflows!r} is invalid: use an integer >= 1 "
                             "(overflowing steps in a row, at a scale that cannot go lower, before NonFiniteError).")
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled={enabled!r} is not a bool: pass True or False (as torch.amp.GradScaler).")
        self.enabled = enabled
        self.max_min_scale_overflows = max_min_scale_overflows
        self.process_group = process_group
        self._shard_group: Any = None  # found on the first FSDP2 gradient when process_group is None
        self._last_loss: torch.Tensor | None = None
        self._state = ScaleState(float(init_scale), 0, hysteresis)
        self._steps = self._skipped = self._overflows = self._updates = 0
        self._min_scale_overflows = 0
        self._history: collections.deque[tuple[int, float, bool]] = collections.deque(maxlen=_HISTORY_LEN)
        self._begin_iteration()

    # -- the training-loop calls ------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply a loss (or a list/tuple of them) by the current scale."""
        if not self.enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._last_loss = outputs.detach()
            self._scaled = True
            return outputs * self._state.scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError(f"scale() takes a tensor or a list/tuple of tensors, got {type(outputs).__name__}.")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and check them.

        Call it before working on true gradients (clipping, logging). At most once
        per optimizer between updates.

        Raises:
            RuntimeError: called twice for one optimizer, or after ``step``.
        """
        if not self.enabled:
            return
        stage = self._stages.get(id(optimizer), _Stage.READY)
        if stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call it before step(), once per update().")
        prepare = getattr(optimizer, "prepare_grads_", None)
        if prepare is not None:  # DistributedOptimizer reduces, MasterWeightOptimizer copies to float32
            prepare()
        self._found[id(optimizer)] = self._unscale_grads(_params(optimizer))
        self._stages[id(optimizer)] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *args: Any, **kwargs: Any) -> bool:
        """Unscale if needed, then step unless a gradient is inf/NaN.

        Args:
            optimizer: one optimizer, or a list of them to step together: all step,
                or (when any of their gradients overflowed) none does. Separate
                ``step`` calls skip independently, as torch's GradScaler.
            *args: passed to ``optimizer.step``.
            **kwargs: passed to ``optimizer.step``.

        Returns:
            True when the optimizer(s) stepped, False when skipped.

        Raises:
            RuntimeError: ``step`` twice for one optimizer since the last update, or
                gradients that were never scaled.
        """
        optimizers: list[torch.optim.Optimizer] = (
            list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]  # type: ignore[list-item]
        )
        if not self.enabled:
            for opt in optimizers:
                opt.step(*args, **kwargs)
            self._steps += 1
            return True
        if "closure" in kwargs:
            raise RuntimeError("step(closure=...) is not supported with loss scaling: run the closure yourself.")
        if not self._scaled:
            raise RuntimeError("step() was called before scale(): scale the loss and call backward() first.")
        for opt in optimizers:
            if self._stages.get(id(opt)) is _Stage.STEPPED:
                raise RuntimeError("step() has already been called on this optimizer since the last update().")
            if self._stages.get(id(opt), _Stage.READY) is _Stage.READY:
                self.unscale_(opt)
        found = total([self._found[id(opt)] for opt in optimizers] + self._loose_found)
        overflow = self._agree(found)  # syncs once
        self._iteration_overflow |= overflow
        for opt in optimizers:
            self._stages[id(opt)] = _Stage.STEPPED
            if not overflow:
                opt.step(*args, **kwargs)
        if overflow:
            self._skipped += 1
        else:
            self._steps += 1
        return not overflow

    def update(self, new_scale: float | None = None) -> None:
        """Update the scale from this iteration's overflow findings.

        Args:
            new_scale: set this scale instead (counters are reset).

        Raises:
            RuntimeError: no ``step`` since the last update.
            NonFiniteError: ``max_min_scale_overflows`` overflowing updates in a row at
                ``min_scale``; the message says whether the loss itself is inf/NaN.
        """
        if not self.enabled:
            return
        if new_scale is not None:
            check_scale(new_scale, self.rule, "new_scale")
            self._state = ScaleState(float(new_scale), 0, self.rule.hysteresis)
            self._begin_iteration()
            return
        if not any(stage is _Stage.STEPPED for stage in self._stages.values()):
            raise RuntimeError("update() was called without step(): call scaler.step(optimizer) first.")
        overflow = self._iteration_overflow
        self._history.append((self._updates, self._state.scale, overflow))
        self._updates += 1
        backoff = self._scale_overflowed(overflow)
        if overflow:
            self._overflows += 1
            self._min_scale_overflows = self._min_scale_overflows + 1 if self._at_min_scale(backoff) else 0
        else:
            self._min_scale_overflows = 0
        self._state = rules.next_scale(self._state, backoff, self.rule)
        last_loss = self._last_loss
        self._begin_iteration()
        if self._min_scale_overflows >= self.max_min_scale_overflows:
            raise NonFiniteError(self._diagnose(last_loss))

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._state.scale if self.enabled else 1.0

    @property
    def stats(self) -> ScalerStats:
        """Steps taken and skipped, overflows, the scale, a bounded history, whether enabled."""
        stats = (self._steps, self._skipped, self._overflows, self.get_scale(), tuple(self._history))
        return ScalerStats(*stats, self.enabled)

    def clip_grad_norm_(
        self,
        optimizer_or_params: torch.optim.Optimizer | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip true (unscaled) gradients; unscales first where needed.

        Args:
            optimizer_or_params: an optimizer (unscaled via ``unscale_`` if not yet),
                or parameters whose gradients are unscaled here.
            max_norm: as ``torch.nn.utils.clip_grad_norm_``'s.
            norm_type: as ``torch.nn.utils.clip_grad_norm_``'s.

        Returns:
            The total norm of the unscaled gradients before clipping (inf/NaN when a
            gradient overflowed; the following ``step`` is then skipped).
        """
        if isinstance(optimizer_or_params, torch.optim.Optimizer):
            if self.enabled and self._stages.get(id(optimizer_or_params), _Stage.READY) is _Stage.READY:
                self.unscale_(optimizer_or_params)
            params = _params(optimizer_or_params)
        else:
            params = list(optimizer_or_params)
            if self.enabled:  # counted in the next step's decision
                self._loose_found.append(self._unscale_grads(params))
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)  # over FSDP2 shards too
        return norm.full_tensor() if is_sharded(norm) else norm  # type: ignore[attr-defined]  # a replicated DTensor for sharded gradients

    # -- checkpoints --------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume.

        Keys: ``version``, ``scale``, ``growth_tracker``, ``hysteresis_left``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``,
        ``min_scale``, ``max_scale``, ``steps``, ``skipped``, ``overflows``, ``updates``,
        ``min_scale_overflows``.
        """
        return {
            "version": STATE_VERSION,
            "scale": self._state.scale,
            "growth_tracker": self._state.growth_tracker,
            "hysteresis_left": self._state.hysteresis_left,
            **dataclasses.asdict(self.rule),
            "steps": self._steps,
            "skipped": self._skipped,
            "overflows": self._overflows,
            "updates": self._updates,
            "min_scale_overflows": self._min_scale_overflows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()``, or from a torch.amp.GradScaler's state dict.

        Raises:
            RuntimeError: the dict is empty or misses keys (they are named).
        """
        if not isinstance(state_dict, dict):
            raise RuntimeError(f"Cannot load loss scaler state from a {type(state_dict).__name__}: pass the dict "
                               "from DynamicLossScaler.state_dict() or torch.amp.GradScaler.state_dict().")
        rule, counters = checked_state(state_dict, self.rule, set(self.state_dict()))
        self.rule = rule
        self._state = ScaleState(counters["scale"], counters["growth_tracker"], counters["hysteresis_left"])
        self._steps, self._skipped = counters["steps"], counters["skipped"]
        self._overflows, self._updates = counters["overflows"], counters["updates"]
        self._min_scale_overflows = counters["min_scale_overflows"]

    # -- internals ------------------------------------------------------------------

    def _begin_iteration(self) -> None:
        self._stages: dict[int, _Stage] = {}
        self._found: dict[int, torch.Tensor] = {}
        self._loose_found: list[torch.Tensor] = []
        self._unscaled: dict[int, torch.Tensor] = {}
        self._iteration_overflow = False
        self._scaled = False
        self._last_loss = None

    def _scale_overflowed(self, overflow: bool) -> bool:
        """Whether this iteration's overflow is the (global) scale's: it backs off. Subclasses with
        more than one scale say which overflowed."""
        return overflow

    def _at_min_scale(self, backoff: bool) -> bool:
        """Whether the scale that overflowed cannot go lower: at min_scale, or a backoff_factor of
        1.0 keeps it."""
        return self._state.scale <= self.rule.min_scale or self.rule.backoff_factor == 1.0

    def _first_unscale(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is still to be unscaled this iteration (it then counts as done). Known by the
        gradient tensor, not the parameter: at O2 a weight's gradient is its master's own, and unscaling the model's
        parameters and then the optimizer's must divide it once."""
        if param.grad is None or id(param.grad) in self._unscaled:
            return False
        self._unscaled[id(param.grad)] = param.grad  # held, so that its id is not reused this iteration
        return True

    def _unscale_grads(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        grads = []
        for p in params:
            if self._first_unscale(p):
                grad: torch.Tensor = p.grad  # type: ignore[assignment]  # _first_unscale: not None
                if grad.is_sparse and grad.dtype == torch.float16:
                    # Duplicates add up on coalescing and may overflow only then (GradScaler coalesces too).
                    grad = p.grad = grad.coalesce()
                grads.append(grad)
                self._shard_group = self._shard_group or shard_group(grad)
        found = rules.unscale_and_check_(grads, 1.0 / self._state.scale)
        return total(list(found.values()))

    def _agree(self, found: torch.Tensor) -> bool:
        group = self.process_group if self.process_group is not None else self._shard_group
        if group is not None:
            found = found.detach().clone()
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def _diagnose(self, last_loss: torch.Tensor | None) -> str:
        why = ("backoff_factor=1.0 keeps it" if self.rule.backoff_factor == 1.0 and self._state.scale > self.rule.min_scale
               else "min_scale")
        head = (
            f"{self._min_scale_overflows} optimizer steps in a row were skipped at a loss scale that cannot go "
            f"lower ({self._state.scale:g}: {why}); scaling cannot help further."
        )
        if last_loss is not None and not bool(torch.isfinite(last_loss).all()):
            return (
                f"{head} The loss itself is {last_loss.float().flatten()[0].item()} in the forward pass: find the op "
                "that overflows with ampkit.find_nonfinite(model, inputs, policy), keep it in float32 "
                "(policy.with_ops(deny=[...]) or with_modules(..., dtype=torch.float32)), or use bfloat16."
            )
        return (
            f"{head} The loss is finite but its gradients overflow even unscaled: lower the learning rate, "
            "clip gradients, keep the overflowing layers in float32, or use bfloat16."
        )


class StaticLossScaler(DynamicLossScaler):
    """A fixed loss scale. Steps whose gradients overflow are still skipped and counted.

    Args:
        scale: the loss scale (e.g. 128.0 or 2**10).
        max_min_scale_overflows: overflowing steps in a row before NonFiniteError (default 10).
        enabled: False makes every method a pass-through.
    """

    def __init__(
        self, scale: float, max_min_scale_overflows: int = 10, enabled: bool = True, process_group: Any = None
    ) -> None:
        super().__init__(init_scale=scale, growth_factor=1.0, backoff_factor=1.0, growth_interval=2**31 - 1,
                         min_scale=scale, max_scale=scale, max_min_scale_overflows=max_min_scale_overflows,
                         enabled=enabled, process_group=process_group)


def check_scaler(scaler: object) -> None:
    """Refuse anything but an ampkit scaler (or None) where one is passed in (ValueError)."""
    if scaler is not None and not isinstance(scaler, DynamicLossScaler):  # Static and Adaptive derive from it
        raise ValueError(f"scaler={type(scaler).__name__} is not an ampkit scaler: pass ampkit.DynamicLossScaler(...), "
                         "ampkit.StaticLossScaler(...) or ampkit.AdaptiveLossScaler(model, ...).")


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


