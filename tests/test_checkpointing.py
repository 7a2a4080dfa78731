"""precision/checkpointing.py: a checkpointed segment given ampkit's context_fn recomputes under its region's policy."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampkit
from ampkit import Policy, autocast

CPU = Policy.default("cpu", torch.bfloat16)


@pytest.mark.parametrize("backward", ["after the region", "inside the region"])
@pytest.mark.parametrize("edit", ["edited", "float32-compute", "module override"])
def test_a_checkpoint_given_ampkits_context_fn_recomputes_under_the_region_policy(edit: str, backward: str) -> None:
    """torch.utils.checkpoint restores torch.autocast's state for the recompute, not ampkit's: given
    ``ampkit.checkpoint_context_fn`` (issue 71's rule 4: torch's public route), the recompute re-enters the forward's
    region (its policy, the model its overrides name), so the gradients are those of the run without checkpointing,
    bit for bit. A backward inside the region works too (torch's restored torch.autocast, opened inside the region,
    hid it from ampkit's kernels until the recompute re-entered it there as well)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    policy = {"edited": CPU.with_ops(deny=["gelu"], allow=["layer_norm"]), "float32-compute": CPU.with_compute("float32"),
              "module override": CPU.with_modules("3", dtype=torch.float32)}[edit]
    grads = []
    for checkpointed in (False, True):
        model, x = copy.deepcopy(block), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        x.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with autocast(policy, model=model):
                out = (checkpoint(model, x, use_reentrant=False, context_fn=ampkit.checkpoint_context_fn)
                       if checkpointed else model(x))
                if backward == "inside the region":
                    out.float().sum().backward()
        if backward == "after the region":
            out.float().sum().backward()
        grads.append([p.grad for p in model.parameters()] + [x.grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_checkpoint_without_it_in_an_edited_region_is_refused_by_torchs_own_check_at_the_backward() -> None:
    """What docs/policies.md says of a plain checkpoint (rule 4: torch.utils.checkpoint is not wrapped): its recompute
    runs under torch.autocast's lists, so a tensor an edit made float32 comes back bfloat16, and torch's comparison of
    the recomputed tensors with the saved ones raises, naming the difference."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with autocast(CPU.with_ops(deny=["gelu"])):
            out = checkpoint(model, torch.randn(2, 8, requires_grad=True), use_reentrant=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="dtype"):
        out.float().sum().backward()


def test_ampkits_context_fn_composes_with_a_selective_one_and_leaves_torchs_checkpoint_unwrapped() -> None:
    """``functools.partial(ampkit.checkpoint_context_fn, selective)``: the selective contexts run inside the region's
    re-entry (the planner's segments use it so); torch.utils.checkpoint's own functions are never replaced."""
    from torch.utils import checkpoint as cp
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    own = {name: getattr(cp, name) for name in dir(cp)}
    saved: list[object] = []

    def selective():  # type: ignore[no-untyped-def]
        def policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
            keep = op == torch.ops.aten.mm.default or op == torch.ops.aten.addmm.default
            if keep and ctx.is_recompute is False:
                saved.append(op)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    x = torch.randn(2, 8, requires_grad=True)
    grads = []
    for context_fn in (None, functools.partial(ampkit.checkpoint_context_fn, selective)):
        x.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with autocast(CPU.with_ops(deny=["gelu"])):
                out = checkpoint(model, x, use_reentrant=False, context_fn=context_fn) if context_fn else model(x)
                assert {name: getattr(cp, name) for name in dir(cp)} == own
        out.float().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()] + [x.grad])
        model.zero_grad()
    assert saved and all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_public_context_fn_route_cannot_serve_reentrant_checkpoints() -> None:
    """Why a reentrant checkpoint inside an edited region is documented, not served: torch refuses a context_fn
    there (docs/policies.md: use the non-reentrant mode with ``ampkit.checkpoint_context_fn``)."""
    block, x = nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="context_fn"):
        checkpoint(block, x, use_reentrant=True, context_fn=ampkit.checkpoint_context_fn)


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
                context_fn = (functools.partial(ampkit.checkpoint_context_fn, contexts) if context == "selective"
                              else ampkit.checkpoint_context_fn)
                out = checkpoint(model, x, use_reentrant=False, context_fn=context_fn) if checkpointed else model(x)
            out.float().pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
        assert model.forwards == (2 if checkpointed else 1)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
