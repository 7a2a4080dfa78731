"""precision/checkpointing.py: activation checkpointing inside a region recomputes under its policy."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ampkit import Policy, autocast

CPU = Policy.default("cpu", torch.bfloat16)


@pytest.mark.parametrize("backward", ["after the region", "inside the region"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("edit", ["edited", "float32-compute"])
def test_activation_checkpointing_recomputes_under_the_region_policy(edit: str, use_reentrant: bool,
                                                                     backward: str) -> None:
    """torch.utils.checkpoint restores torch.autocast's state for the recompute, not ampkit's;
    before ampkit hooked it, non-reentrant raised CheckpointError (float32 saved, bfloat16
    recomputed) and reentrant gave other gradients. A backward inside the region did the same
    until the hook re-entered the policy there too: torch's restored torch.autocast, opened
    inside the region, hid it from ampkit's kernels."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    policy = (CPU.with_ops(deny=["gelu"], allow=["layer_norm"]) if edit == "edited"
              else CPU.with_compute("float32"))
    grads = []
    for checkpointed in (False, True):
        model, x = copy.deepcopy(block), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with autocast(policy):
                out = checkpoint(model, x, use_reentrant=use_reentrant) if checkpointed else model(x)
                if backward == "inside the region":
                    out.float().sum().backward()
        if backward == "after the region":
            out.float().sum().backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))



def test_the_public_context_fn_route_cannot_serve_reentrant_checkpoints() -> None:
    """Why ampkit wraps torch's two entry points instead of asking for context_fn: the reentrant
    mode refuses one, and a model's own checkpoint calls pass none (see the module's docstring)."""
    block, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    contexts = lambda: (torch.autocast("cpu", enabled=False), torch.autocast("cpu", enabled=False))  # noqa: E731
    with pytest.raises(ValueError, match="context_fn"):
        checkpoint(block, x, use_reentrant=True, context_fn=contexts)


def test_a_region_that_needs_kernels_installs_the_wrappers_where_torch_looks_them_up_and_removes_them() -> None:
    from torch.utils import checkpoint as cp

    # the generator torch's checkpoint calls: its _impl from 2.14 on (the old name is then a shim torch never calls)
    called = "_checkpoint_without_reentrant_generator" + ("_impl" if hasattr(cp, "_checkpoint_without_reentrant_"
                                                                       "generator_impl") else "")
    torch_own = (cp.CheckpointFunction, getattr(cp, called))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with autocast(CPU.with_ops(deny=["gelu"])):
            assert cp.CheckpointFunction.__module__ == "ampkit.precision.checkpointing"
            assert getattr(cp, called).__module__ == "ampkit.precision.checkpointing"
    assert (cp.CheckpointFunction, getattr(cp, called)) == torch_own  # torch's own, once no region needs them


def test_entry_points_someone_else_replaced_meanwhile_are_left_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import checkpoint as cp

    class Theirs(cp.CheckpointFunction):  # type: ignore[misc, name-defined]
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with autocast(CPU.with_ops(deny=["gelu"])):
            monkeypatch.setattr(cp, "CheckpointFunction", Theirs)
    assert cp.CheckpointFunction is Theirs  # and torch's generator is back
    assert all(getattr(cp, name).__module__ == "torch.utils.checkpoint" for name in dir(cp)
               if name.startswith("_checkpoint_without_reentrant_generator"))
