"""Memory estimates: weights, gradients, master weights, optimizer states and activations.

The arithmetic people do by hand (1M parameters are 4 MB in float32 and 2 MB in
float16), with activations taken from a real trace of one step: the bytes
autograd saves for backward, counted with ``saved_tensors_hooks``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ampkit import compute
from ampkit.policy import resolve_dtype

# Optimizer states per parameter, in the dtype of the parameters the optimizer updates.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-nomomentum": 0, "adagrad": 1, "rmsprop": 1}


def saved_bytes_of_step(model: nn.Module, step: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``step`` (forward and loss) and count the activation bytes autograd saves for backward.

    Storages are counted once. Parameters, and the 16-bit copies of parameters
    that autocast saves, are weights rather than activations and are left out,
    so the figure is the activation memory of one step, exact on any device.

    Returns:
        (the loss ``step`` returned, bytes).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and not compute.is_weight_copy(t):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
        # Read before the step's graph can go: float32-compute ops save aliases of weights.
        weights = compute.weight_storages()
    return loss, sum(n for ptr, n in seen.items() if ptr not in weights)


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


def estimate_memory(
    model: nn.Module,
    inputs: Any,
    opt_level: str = "O2",
    optimizer: str = "adamw",
    dtype: torch.dtype | str = torch.bfloat16,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> MemoryEstimate:
    """Estimate training memory in float32 and at ``opt_level``.

    Args:
        model: a float32 model (left untouched: copies are traced).
        inputs: a tensor or tuple of positional inputs for one step.
        opt_level: ``"O1"``, ``"O2"`` or ``"O3"``.
        optimizer: one of OPTIMIZER_STATES' keys (default ``"adamw"``: two states).
        dtype: the 16-bit dtype.
        loss_fn: ``loss_fn(output) -> loss`` (default: mean square of the output).

    Raises:
        ValueError: an unknown optimizer or opt level.
    """
    from ampkit.master import NORM_TYPES, OPT_LEVELS, initialize

    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"Unknown optimizer {optimizer!r}. Choose one of {sorted(OPTIMIZER_STATES)}.")
    if opt_level not in OPT_LEVELS[1:]:
        raise ValueError(f"Unknown opt_level {opt_level!r} for a mixed estimate. Choose one of {list(OPT_LEVELS[1:])}.")
    dtype = resolve_dtype(dtype)
    states = OPTIMIZER_STATES[optimizer]
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    loss_fn = loss_fn or (lambda out: out.float().pow(2).mean())

    def activations(level: str) -> int:
        traced = copy.deepcopy(model)
        if level != "O0":
            traced, _ = initialize(traced, None, level, dtype)
        _, saved = saved_bytes_of_step(traced, lambda: loss_fn(traced(*args)))
        return saved

    # Frozen parameters take weight memory but have no gradients, masters or optimizer states.
    params = [(m, p) for m in model.modules() for p in m.parameters(recurse=False)]
    n = sum(p.numel() for _, p in params)
    trained = [(m, p) for m, p in params if p.requires_grad]
    t = sum(p.numel() for _, p in trained)
    low = torch.finfo(dtype).bits // 8

    def model_bytes(pairs: Sequence[tuple[nn.Module, torch.Tensor]]) -> int:
        """16-bit bytes of ``pairs`` at opt_level; O2 keeps normalization layers in float32."""
        kept = sum(p.numel() for m, p in pairs if opt_level == "O2" and isinstance(m, NORM_TYPES))
        return low * (sum(p.numel() for _, p in pairs) - kept) + 4 * kept

    fp32 = MemoryBreakdown("float32", 4 * n, 4 * t, 0, 4 * states * t, activations("O0"))
    if opt_level == "O1":
        mixed = MemoryBreakdown(f"{opt_level} {dtype}", 4 * n, 4 * t, 0, 4 * states * t, activations("O1"))
    else:
        masters = 4 * t if opt_level == "O2" else 0
        state_bytes = states * (4 * t if opt_level == "O2" else model_bytes(trained))
        mixed = MemoryBreakdown(f"{opt_level} {dtype}", model_bytes(params), model_bytes(trained), masters,
                                state_bytes, activations(opt_level))
    return MemoryEstimate(n, fp32, mixed)
