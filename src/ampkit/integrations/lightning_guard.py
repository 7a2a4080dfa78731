"""``ampkit.Guard`` as a Lightning callback: ``Trainer(callbacks=[GuardCallback("run/guard")])``.

Lightning steps the optimizer itself (through its precision plugin, ampkit's ``AmpkitPrecision`` or its own), so the
callback judges each step between the backward and the step (``on_before_optimizer_step``, after the plugin has
unscaled the gradients) with ``Guard.check``; a refused step has its gradients set to None, which torch's
optimizers step over. The loss is taken at ``on_before_backward``, divided by the plugin's loss scale where it has
one (over the micro-batches of ``accumulate_grad_batches``, their mean); each micro-batch of the step at
``on_train_batch_start``. A non-finite step is replayed through the module's own ``training_step`` on a copy of it,
micro-batch by micro-batch (a module need not have a ``forward``; ``loss_fn=`` or ``replay=`` in the options replay
otherwise). At the end of ``fit`` the timeline and the picture are written (``<prefix>.json``, ``<prefix>.png``).
The guard's state (its timeline, raised layers and counters: ``Guard.state_dict``) is the callback's state in
Lightning's checkpoints: ``fit(ckpt_path=...)`` goes on with the same layers raised and the same timeline.

Requires ``pip install ampkit[lightning]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ampkit.guard import Guard


class GuardCallback(Callback):
    """Watch a Lightning run's numerics with ``ampkit.Guard`` and act on a bad step.

    Args:
        prefix: where to write the timeline and the picture at the end of ``fit`` (``prefix + ".json"``,
            ``prefix + ".png"``); None writes nothing (the guard is ``callback.guard``).
        **options: ``Guard``'s settings (``action``, ``loss_fn``, ``sample_every``...), but ``scaler``: the
            Trainer's precision plugin owns the loss scaler.

    Raises:
        ValueError: at ``fit``, a module with more than one optimizer (the guard judges one step), or bad options
            (``Guard``'s errors, before any step).
    """

    def __init__(self, prefix: str | Path | None = None, **options: Any) -> None:
        if "scaler" in options:
            raise ValueError("GuardCallback takes no scaler: the Trainer's precision plugin owns the loss scaler, "
                             "and the callback judges the step after the plugin has unscaled the gradients.")
        self.prefix, self.options = prefix, options
        self.guard: Guard | None = None
        self._batches: list[Any] = []  # the micro-batches of the step under way
        self._losses: list[torch.Tensor] = []
        self._allowed: bool | None = None
        self._scale: float | None = None
        self._resumed: dict[str, Any] | None = None  # a checkpoint's guard state, for the guard on_fit_start builds

    def state_dict(self) -> dict[str, Any]:
        """The guard's state (``Guard.state_dict``), kept in Lightning's checkpoints."""
        return {"guard": self.guard.state_dict()} if self.guard is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's guard state: Lightning restores callbacks before ``on_fit_start``, which builds the
        guard on the restored module and hands it this."""
        self._resumed = state_dict.get("guard")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"GuardCallback judges one optimizer's step; this module has {len(trainer.optimizers)}: "
                             "configure one optimizer, or use ampkit.Guard in a loop of your own.")
        optimizer = trainer.optimizers[0]
        options = self.options if {"loss_fn", "replay"} & set(self.options) else {
            **self.options, "replay": _training_step_replay(trainer)}
        self.guard = Guard(pl_module, getattr(optimizer, "_optimizer", optimizer), **options)
        if self._resumed is not None:  # the same layers raised, the same timeline
            self.guard.load_state_dict(self._resumed)
            self._resumed = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batches.append(batch)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        scaler = _scaler(trainer)
        self._losses.append(loss.detach().float() / (scaler.get_scale() if scaler is not None else 1.0))

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        assert self.guard is not None
        loss = torch.stack(self._losses).mean() if self._losses else torch.tensor(float("nan"))
        self._losses = []
        # an enabled scaler of the plugin checks the gradients and skips an overflowing step itself
        batches, self._batches = self._batches, []
        scaler = _scaler(trainer)
        self._scale = scaler.get_scale() if scaler is not None else None  # the scale this step's backward ran at
        self._allowed = self.guard.check(loss, gradients=scaler is None, batches=batches)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._allowed is None or self.guard is None:  # no optimizer step in this batch (accumulating)
            return
        if self._allowed:
            plugin = trainer.precision_plugin
            taken = getattr(plugin, "last_step_taken", None)
            self.guard.taken(taken(trainer.optimizers[0]) if taken is not None else True, self._scale)
        self._allowed = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.prefix is not None and self.guard is not None and trainer.is_global_zero:
            self.guard.write_timeline(f"{self.prefix}.json")
            self.guard.write_plot(f"{self.prefix}.png")


def _training_step_replay(trainer: Trainer) -> Any:
    """The guard's replay: the loss ``training_step`` computes for a batch (its tensor, or its dict's ``"loss"``) on
    the module's copy, which a deep copy leaves without a trainer: ``trainer`` is attached (a step may read its
    ``global_step``), and nothing of the replay is logged. Over ranks the replay runs on the module itself: its own
    ``log`` and ``log_dict`` are put back after."""
    def replay(module: LightningModule, batch: Any) -> torch.Tensor:
        module.trainer = trainer
        quiet = lambda *args, **kwargs: None  # noqa: E731
        own = {name: module.__dict__[name] for name in ("log", "log_dict") if name in module.__dict__}
        module.log, module.log_dict = quiet, quiet  # type: ignore[method-assign, assignment]
        try:
            out: Any = module.training_step(batch, 0)
        finally:
            for name in ("log", "log_dict"):
                if name in own:
                    setattr(module, name, own[name])
                else:
                    delattr(module, name)
        return out["loss"] if isinstance(out, dict) else out
    return replay


def _scaler(trainer: Trainer) -> Any:
    """The precision plugin's enabled loss scaler (ampkit's, or torch's GradScaler of "16-mixed"), else None."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None:
        return None
    enabled = scaler.is_enabled() if callable(getattr(scaler, "is_enabled", None)) else getattr(scaler, "enabled", True)
    return scaler if enabled else None
