"""precision/checkpointing.py: activation checkpointing inside a region recomputes under its policy."""

from __future__ import annotations

import contextlib
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


class _Attention(nn.Module):
    """Ops float32 compute runs on its generic path (a nested graph): matmuls, attention with a mask, and
    grouped-query attention called as transformers calls it (``attn_mask=None`` among its arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 16), nn.Linear(8, 8)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split([8, 4, 4], -1)
        q, k, v = q.view(batch, length, 2, 4).transpose(1, 2), k[:, None], v[:, None]  # 2 query heads, 1 key head
        scores = torch.matmul(q, k.transpose(-1, -2)).softmax(-1)
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        masked = nn.functional.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), attn_mask=mask)
        grouped = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, scale=0.5,
                                                             enable_gqa=True)
        return self.out((torch.matmul(scores, v) + masked + grouped).transpose(1, 2).reshape(batch, length, 8))


@pytest.mark.parametrize("context", ["whole", "selective"])
def test_a_checkpointed_segment_of_generic_float32_ops_is_recomputed_once(context: str) -> None:
    """float32 compute's generic ops keep a nested graph, whose backward is a graph task of its own; under a
    non-reentrant checkpoint, torch recomputes a segment once per graph task that unpacks from it. On the tree
    before this test each generic op's backward recomputed the whole segment again (5 recomputes for this one's
    4 ops), and under a selective policy (a context_fn returning a generator's context manager, as ampkit's
    planner's) the second recompute raised AttributeError entering it again. Now one recompute, and the same
    gradients to the bit as without the checkpoint."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def contexts():  # type: ignore[no-untyped-def]
        forward, recompute = create_selective_checkpoint_contexts(
            lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)

        @contextlib.contextmanager
        def entered(mode):  # type: ignore[no-untyped-def]
            with mode:
                yield

        return entered(forward), entered(recompute)

    torch.manual_seed(0)
    block = _Attention()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointed in (False, True):
        model = copy.deepcopy(block)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with autocast(CPU.with_compute("float32")):
                out = (checkpoint(model, x, use_reentrant=False, **({"context_fn": contexts} if context == "selective"
                                                                      else {})) if checkpointed else model(x))
            out.float().pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
        assert model.forwards == (2 if checkpointed else 1)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
