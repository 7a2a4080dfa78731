"""The vocabulary of mixed precision: the 16-bit dtypes, the compute modes and the opt levels.

This module imports nothing of ampkit (a leaf: every other module may use it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

_Backward = TypeVar("_Backward", bound=Callable[..., Any])

LOW_DTYPES = (torch.float16, torch.bfloat16)
SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # as the command line names them
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

# How GEMMs and convolutions on 16-bit values compute (see ampkit.float32_compute).
COMPUTE_MODES = ("auto", "native", "float32")


@dataclass(frozen=True)
class OptLevel:
    """What an opt level (Apex's O0-O3) does to a model and its optimizer: the one description that
    ``initialize``, ``distributed.fully_shard``, the Lightning and Fabric plugins and the memory estimate read,
    instead of each testing the level's name.
    """

    name: str
    policy_region: bool  # the forward runs in an ampkit.autocast region under a policy, on float32 weights (O1)
    weights_16bit: bool  # the parameters are stored in the 16-bit dtype (O2, O3)
    masters: bool  # float32 master weights step for the 16-bit ones (O2)
    keeps_float32: bool  # normalization layers, keep_float32 types and buffers stay float32 (O2)
    losses_in_float32: bool  # a loss the model computes itself takes float32 inputs (O2)
    summary: str

    @property
    def mixed(self) -> bool:
        """Anything in 16 bits (O1-O3)."""
        return self.policy_region or self.weights_16bit

    @property
    def pure16(self) -> bool:
        """Every weight 16-bit with no float32 copy (O3): where ``update="kahan"`` / ``"stochastic"`` apply and the
        optimizer's states are the weights' dtype."""
        return self.weights_16bit and not self.masters

    def __str__(self) -> str:
        return self.name


OPT_LEVELS: dict[str, OptLevel] = {level.name: level for level in (
    OptLevel("O0", False, False, False, False, False, "float32"),
    OptLevel("O1", True, False, False, False, False, "float32 weights, the forward under an autocast policy"),
    OptLevel("O2", False, True, True, True, True,
             "a 16-bit model but its normalization layers and buffers, float32 master weights"),
    OptLevel("O3", False, True, False, False, False, "everything 16-bit, no master weights"),
)}
MIXED_LEVELS = tuple(name for name, level in OPT_LEVELS.items() if level.mixed)  # what a 16-bit run may choose


def opt_level(name: str | OptLevel) -> OptLevel:
    """The ``OptLevel`` named ``name``; ValueError naming the choices for any other value."""
    if isinstance(name, OptLevel):
        return name
    if isinstance(name, str) and name in OPT_LEVELS:
        return OPT_LEVELS[name]
    raise ValueError(f"Unknown opt_level: {name!r}. Choose one of {list(OPT_LEVELS)}: "
                     + "; ".join(f"{level.name} {level.summary}" for level in OPT_LEVELS.values()) + ".")


class ComputeModeWarning(UserWarning):
    """Says, once per device, dtype and mode, that GEMMs compute in float32 on 16-bit values."""


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the 16-bit torch dtype named by ``dtype``.

    Raises:
        ValueError: ``dtype`` is not float16 or bfloat16.
    """
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    if dtype in LOW_DTYPES:
        return dtype  # type: ignore[return-value]
    raise ValueError(
        f"Unsupported mixed precision dtype: {dtype!r}. Choose torch.float16 ('fp16') or "
        "torch.bfloat16 ('bf16'); float32 is what mixed precision falls back to, not a "
        "compute dtype to choose."
    )


def check_compute(compute: str) -> str:
    """Return ``compute`` if it is a compute mode, else raise ValueError."""
    if compute not in COMPUTE_MODES:
        raise ValueError(
            f"Unknown compute mode: {compute!r}. Choose one of {list(COMPUTE_MODES)}: 'native' runs 16-bit "
            "kernels, 'float32' computes GEMMs and convolutions in float32 on the 16-bit values, 'auto' "
            "picks per op class what the measured hardware runs faster."
        )
    return compute


def without_autocast(backward: _Backward) -> _Backward:
    """Run a custom autograd Function's ``backward`` with autocast off on its gradients' device.

    Eager autograd runs a backward where ``.backward()`` is called, outside the region as a rule; torch.compile
    traces it under the forward's autocast state instead, which cast the float32 GEMMs of ampkit's emulations
    (float32 compute, block-scaled formats) to 16 bits: inductor then ran a native bfloat16 GEMM where eager
    runs a float32 one (a GPT step far slower on a CPU without bf16 arithmetic). Off, both run what is written.
    """

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return backward(ctx, *grads)

    return run  # type: ignore[return-value]


def check_model_and_optimizer(model: object, optimizer: object, needed_by: str | None = None) -> None:
    """Refuse a model that is no nn.Module, an optimizer that is no torch.optim.Optimizer, and one that
    steps tensors other than the model's parameters (it would train nothing of this model): ValueError. None is
    no optimizer (inference), refused where ``needed_by`` names what needs one."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not an nn.Module: pass the model itself.")
    if optimizer is None and needed_by is not None:
        raise ValueError(f"optimizer=None: {needed_by} needs the model's optimizer, e.g. "
                         "torch.optim.AdamW(model.parameters()) (the one ampkit.initialize returned, if it ran).")
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={optimizer!r} is a {type(optimizer).__name__}, not a torch.optim.Optimizer: build "
                         "one on the model's parameters, e.g. torch.optim.AdamW(model.parameters(), lr=1e-3), or pass "
                         "None for inference.")
    own = {id(p) for p in model.parameters()}
    # A MasterWeightOptimizer's groups hold the masters: the model's weights it steps are its model_params.
    stepped = getattr(optimizer, "model_params", None) or [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in stepped if id(p) not in own]
    if foreign:
        raise ValueError(f"The optimizer steps {len(foreign)} tensor(s) that are not parameters of this model (shapes "
                         f"{[tuple(p.shape) for p in foreign[:3]]}): build it on this model's parameters, "
                         "model.parameters(), after any change to the model (after ampkit.initialize, pass the model "
                         "and the optimizer it returned).")
