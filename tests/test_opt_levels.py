"""O0-O3 are one description (``ampkit.modes.OptLevel``) that ``initialize``, ``distributed.fully_shard`` and the
Lightning plugin read: each applies a level to the same model alike."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.modes import MIXED_LEVELS, OPT_LEVELS, opt_level
from ampkit.precision.state import current_policy


class Net(nn.Module):
    """A norm O2 keeps in float32 between two linears, and a loss the model computes itself (O2's float32 losses)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc2(F.gelu(self.norm(self.fc1(x))))
        return h, F.mse_loss(h, y)


def _run(model: nn.Module, enter: Any = None) -> dict[str, Any]:
    """The forward's outputs, and as each layer's forward sees them: its weight's and input's dtypes and the ampkit
    policy it runs under (none, or O1's, or the 16-bit model's where it computes in float32)."""
    seen: dict[str, tuple[torch.dtype, torch.dtype, Any]] = {}
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(
        name, (m.weight.dtype, args[0].dtype, current_policy("cpu"))))
        for name, module in model.named_modules() if name]
    x, y = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)), torch.randn(4, 8)
    with enter() if enter is not None else torch.no_grad():
        h, loss = model(x, y)
    for hook in hooks:
        hook.remove()
    return {"seen": seen, "h": h.detach(), "loss": loss.detach()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["seen"] == b["seen"]
    for key in ("h", "loss"):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


SETTINGS: dict[str, Any] = dict(dtype=torch.bfloat16)
LEVELS_AND_COMPUTES = pytest.mark.parametrize("level, compute", [(level, compute) for level in OPT_LEVELS
                                                                 for compute in ("native", "float32")])


def _initialized(level: str, compute: str) -> dict[str, Any]:
    """What ``initialize`` makes of the level: the reference the others are held to."""
    run = _run(ampkit.initialize(Net(), None, level, compute=compute, **SETTINGS)[0])
    described = OPT_LEVELS[level]
    assert run["seen"]["norm"][0] == (torch.float32 if not described.weights_16bit or described.keeps_float32
                                      else torch.bfloat16)
    policy = run["seen"]["fc1"][2]
    assert (policy is not None) == (described.policy_region or described.weights_16bit and compute == "float32")
    assert run["loss"].dtype == torch.float32  # every level's boundary (O1: the loss outside any 16-bit list)
    return run


@LEVELS_AND_COMPUTES
def test_fully_shard_applies_a_level_as_initialize_does(level: str, compute: str, one_rank: None) -> None:
    sharded = ampkit.distributed.fully_shard(Net(), opt_level=level, compute=compute, **SETTINGS)
    _same(_run(sharded), _initialized(level, compute))


@LEVELS_AND_COMPUTES
def test_the_lightning_plugin_applies_a_level_as_initialize_does(level: str, compute: str) -> None:
    lightning = pytest.importorskip("ampkit.integrations.lightning")
    plugin = lightning.AmpkitPrecision(level, compute=compute, **SETTINGS)
    _same(_run(plugin.convert_module(Net()), plugin.forward_context), _initialized(level, compute))


def test_the_levels_are_one_frozen_table() -> None:
    o2 = OPT_LEVELS["O2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        o2.masters = False  # type: ignore[misc]
    assert [name for name, level in OPT_LEVELS.items() if level.pure16] == ["O3"]
    assert [name for name, level in OPT_LEVELS.items() if level.masters] == ["O2"]
    assert MIXED_LEVELS == ("O1", "O2", "O3") and opt_level("O2") is o2 and opt_level(o2) is o2
    with pytest.raises(ValueError, match=r"Unknown opt_level: 'o2'. Choose one of \['O0', 'O1', 'O2', 'O3'\]: O0 "
                                         r"float32; O1 float32 weights"):
        opt_level("o2")
