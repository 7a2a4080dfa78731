"""The call forms users write, under every kind of policy, checked against torch.autocast.

ampkit's own models split attention heads (4-D) and call linears on 2-D or 3-D inputs; users do not: torch 2.14.1
changed CPU flash attention's private kernel to take 4-D inputs only, and float32 compute raised on a plain 3-D
``F.scaled_dot_product_attention`` call while every test passed. Each case here is one documented call form of
one op (attention with 2 to 5 dims, masks, grouped-query attention, dropout, ``scale=``, strided views; ``F.linear``
on 1-D and N-D inputs; convolutions with groups, dilation, no batch, ``padding="same"``; ``bmm`` and ``matmul``'s
broadcast forms; ``layer_norm`` without affine; ``embedding_bag``; ``einsum``), run on float32 leaves (O1: a
float32 model under autocast) and on bf16 leaves (O2: a 16-bit model), forward and backward, under:

- the default policy, native compute: torch.autocast's dtypes, its values and gradients;
- an edited policy (each of the case's listed ops moved to the other list: allow to deny, the rest to allow): the
  values of the op run by hand on inputs cast to the list's dtype, as the edit says;
- float32 compute: torch.autocast's dtypes; values and gradients within bf16 rounding of float32's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.precision.policy import torch_category

DTYPE = torch.bfloat16
# Norm-wise relative error allowed against float32 where an op rounds to bf16 (inputs, then output): a few units
# of bf16's 2**-8 relative rounding; a wrong dtype or a wrong shape's arithmetic is off by far more.
BF16_ROUNDING = 2.0 ** -6


@dataclass(frozen=True)
class Case:
    """One call form: ``fn(*inputs)`` on inputs of ``shapes`` (an int tensor where ``shapes`` names a maker)."""

    name: str
    fn: Callable[..., torch.Tensor]
    shapes: tuple[Any, ...]
    ops: tuple[str, ...]  # the ops an edited policy moves (names as Policy.with_ops takes them)
    random: bool = False  # draws random numbers (dropout): same seed, same draws, compared as any other case


def _mask_bool(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool).tril())


def _mask_float(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))


def _chunked_3d(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.chunk(3, -1)  # (batch, tokens, width) views with a stride of 3 widths: no head split
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _strided_4d(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # a GPT's heads: non-contiguous views of one projection
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _transposed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def _embedding_bag(weight: torch.Tensor, mode: str) -> torch.Tensor:
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 3, 5])
    return F.embedding_bag(indices, weight, offsets, mode=mode)


SDPA = ("scaled_dot_product_attention",)
CASES = [
    Case("sdpa-2d", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         ((8, 16),) * 3, SDPA),
    Case("sdpa-3d", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         ((2, 8, 16),) * 3, SDPA),
    Case("sdpa-3d-chunked", _chunked_3d, ((2, 8, 48),), SDPA),
    Case("sdpa-4d", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         ((2, 2, 8, 16),) * 3, SDPA),
    Case("sdpa-4d-strided", _strided_4d, ((2, 8, 3, 2, 16),), SDPA),
    Case("sdpa-4d-transposed", _transposed, ((2, 8, 2, 16),) * 3, SDPA),
    Case("sdpa-5d", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
         ((2, 3, 2, 8, 16),) * 3, SDPA),
    Case("sdpa-broadcast-batch", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
         ((2, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), SDPA),
    Case("sdpa-cross", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
         ((2, 2, 8, 16), (2, 2, 12, 16), (2, 2, 12, 24)), SDPA),
    Case("sdpa-bool-mask", _mask_bool, ((2, 2, 8, 16),) * 3, SDPA),
    Case("sdpa-float-mask", _mask_float, ((2, 2, 8, 16),) * 3, SDPA),
    Case("sdpa-gqa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
         ((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)), SDPA),
    Case("sdpa-scale", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3),
         ((2, 8, 16),) * 3, SDPA),
    Case("sdpa-dropout", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.25),
         ((2, 2, 8, 16),) * 3, SDPA, random=True),
    Case("linear-1d", F.linear, ((16,), (8, 16), (8,)), ("linear",)),
    Case("linear-nd", F.linear, ((2, 3, 4, 16), (8, 16), (8,)), ("linear",)),
    Case("linear-no-bias", F.linear, ((5, 16), (8, 16)), ("linear",)),
    Case("conv1d-groups-dilation", lambda x, w, b: F.conv1d(x, w, b, padding=2, dilation=2, groups=2),
         ((2, 4, 16), (6, 2, 3), (6,)), ("conv1d",)),
    Case("conv2d-groups-dilation-stride", lambda x, w: F.conv2d(x, w, stride=2, padding=1, dilation=2, groups=2),
         ((2, 4, 9, 9), (6, 2, 3, 3)), ("conv2d",)),
    Case("conv2d-unbatched", lambda x, w, b: F.conv2d(x, w, b, padding=1), ((4, 8, 8), (6, 4, 3, 3), (6,)),
         ("conv2d",)),
    Case("conv2d-padding-same", lambda x, w: F.conv2d(x, w, padding="same"), ((2, 4, 8, 8), (6, 4, 3, 3)),
         ("conv2d",)),
    Case("conv3d-groups", lambda x, w: F.conv3d(x, w, groups=2), ((1, 4, 5, 5, 5), (4, 2, 3, 3, 3)), ("conv3d",)),
    Case("bmm", torch.bmm, ((2, 4, 8), (2, 8, 3)), ("bmm",)),
    Case("matmul-1d-1d", torch.matmul, ((16,), (16,)), ("matmul",)),
    Case("matmul-1d-2d", torch.matmul, ((8,), (8, 5)), ("matmul",)),
    Case("matmul-2d-1d", torch.matmul, ((5, 8), (8,)), ("matmul",)),
    Case("matmul-1d-3d", torch.matmul, ((8,), (3, 8, 5)), ("matmul",)),
    Case("matmul-3d-2d", torch.matmul, ((3, 4, 8), (8, 5)), ("matmul",)),
    Case("matmul-broadcast-4d", torch.matmul, ((2, 1, 4, 8), (3, 8, 5)), ("matmul",)),
    Case("layer-norm-no-affine", lambda x: F.layer_norm(x, (16,)), ((2, 5, 16),), ("layer_norm",)),
    Case("layer-norm", lambda x, w, b: F.layer_norm(x, (16,), w, b), ((2, 5, 16), (16,), (16,)), ("layer_norm",)),
    Case("embedding-bag-sum", lambda w: _embedding_bag(w, "sum"), ((10, 6),), ("embedding_bag",)),
    Case("embedding-bag-mean", lambda w: _embedding_bag(w, "mean"), ((10, 6),), ("embedding_bag",)),
    Case("einsum-batched", lambda a, b: torch.einsum("bij,bjk->bik", a, b), ((2, 4, 8), (2, 8, 3)), ("bmm",)),
    Case("einsum-heads", lambda q, k: torch.einsum("bhld,bhmd->bhlm", q, k), ((2, 2, 5, 8), (2, 2, 6, 8)),
         ("bmm",)),
    Case("einsum-dot", lambda a, b: torch.einsum("i,i->", a, b), ((16,), (16,)), ("bmm",)),
]


def _inputs(case: Case, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(len(case.name))
    return [torch.randn(*shape, generator=generator).to(dtype).requires_grad_() for shape in case.shapes]


def _run(case: Case, inputs: list[torch.Tensor], region: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The case's output and its inputs' gradients (a fixed upstream gradient) under ``region``."""
    torch.manual_seed(0)  # dropout's draws
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float32 compute's one-time note about the mode
        with region:
            out = case.fn(*inputs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, inputs, upstream, allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _assert_within(got: tuple[torch.Tensor, list[torch.Tensor]], want: tuple[torch.Tensor, list[torch.Tensor]],
                   tolerance: float) -> None:
    for i, (g, w) in enumerate(zip([got[0], *got[1]], [want[0], *want[1]])):
        what = "output" if i == 0 else f"input {i - 1}'s gradient"
        assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)}, want {tuple(w.shape)}"
        assert torch.isfinite(g).all(), f"{what}: not finite"
        error = _relative_error(g, w)
        assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance:.2e}"


def _float32_reference(case: Case, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.detach().float().requires_grad_() for x in inputs]
    return _run(case, leaves, torch.autocast("cpu", enabled=False))


LEAF_DTYPES = [pytest.param(torch.float32, id="fp32-leaves"), pytest.param(DTYPE, id="bf16-leaves")]
IDS = [case.name for case in CASES]


@pytest.mark.parametrize("leaf_dtype", LEAF_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_default_policy_gives_torch_autocasts_dtypes_and_values(case: Case, leaf_dtype: torch.dtype) -> None:
    inputs = _inputs(case, leaf_dtype)
    want = _run(case, inputs, torch.autocast("cpu", dtype=DTYPE))
    got = _run(case, inputs, ampkit.autocast(ampkit.Policy.default("cpu", DTYPE, compute="native")))
    assert got[0].dtype == want[0].dtype
    assert [g.dtype for g in got[1]] == [x.dtype for x in inputs]
    _assert_within(got, want, 0.0 if not case.random else BF16_ROUNDING)  # the same kernels on the same values


@pytest.mark.parametrize("leaf_dtype", LEAF_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_compute_gives_torch_autocasts_dtypes_within_bf16_rounding_of_float32(
        case: Case, leaf_dtype: torch.dtype) -> None:
    inputs = _inputs(case, leaf_dtype)
    autocast_out = _run(case, inputs, torch.autocast("cpu", dtype=DTYPE))[0]
    got = _run(case, inputs, ampkit.autocast(ampkit.Policy.default("cpu", DTYPE, compute="float32")))
    assert got[0].dtype == autocast_out.dtype
    assert [g.dtype for g in got[1]] == [x.dtype for x in inputs]
    _assert_within(got, _float32_reference(case, inputs), BF16_ROUNDING)


@pytest.mark.parametrize("compute", ["native", "float32"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_an_edited_policy_runs_each_moved_op_in_its_new_lists_dtype(case: Case, compute: str) -> None:
    # Allow-list ops move to deny (float32 on float32 casts); the others (layer_norm, embedding_bag: in no list on
    # the CPU) move to allow (bf16 on bf16 casts). The reference runs the op by hand on inputs cast so.
    to_deny = torch_category("cpu", case.ops[0]) == "allow"
    policy = ampkit.Policy.default("cpu", DTYPE, compute=compute)
    policy = policy.with_ops(deny=case.ops) if to_deny else policy.with_ops(allow=case.ops)
    inputs = _inputs(case, torch.float32)
    got = _run(case, inputs, ampkit.autocast(policy))
    assert got[0].dtype == (torch.float32 if to_deny else DTYPE)
    if to_deny:
        _assert_within(got, _float32_reference(case, inputs), 1e-6)
    else:
        casts = [x.detach().to(DTYPE).requires_grad_() for x in inputs]
        want = _run(case, casts, torch.autocast("cpu", enabled=False))
        out, grads = got
        # The reference's gradients are the casts' (bf16); the leaves' are those, cast back to float32.
        _assert_within((out, grads), (want[0], [g.float() for g in want[1]]), 0.0 if compute == "native"
                       else BF16_ROUNDING)


# ---------------------------------------------------------------------------
# A model with 3-D attention, trained as a user would (torch 2.14.1 and 2.15.0 raised at its first forward)


def test_the_issues_3d_attention_call_runs_in_float32_compute_with_gradients() -> None:
    q = torch.randn(4, 16, 32, requires_grad=True)  # (batch, tokens, width): sdpa's documented 3-D form
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad is not None and torch.isfinite(q.grad).all()
    assert out.grad_fn.name() == "_AttentionBackward"  # the fast path takes the 3-D form as torch's attention does


class Block(nn.Module):
    """A small transformer block as people write one: no head split, so attention gets (batch, tokens, width)."""

    def __init__(self, width: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, width), nn.LayerNorm(width)
        self.qkv, self.out, self.head = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        q, k, v = self.qkv(self.norm(h)).chunk(3, -1)
        h = h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.head(h)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 12) -> list[float]:
    tokens = torch.randint(0, 50, (8, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 50), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_initialize_trains_a_3d_attention_model_in_float32_compute_as_float32_does(opt_level: str) -> None:
    torch.manual_seed(0)
    reference = Block()
    model = Block()
    model.load_state_dict(reference.state_dict())
    want = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level,
                                             dtype=torch.bfloat16, compute="float32")
        got = _train(model, optimizer)
    assert got[-1] < 0.7 * got[0]  # it learns
    assert abs(got[-1] - want[-1]) <= 0.05 * want[-1], (got, want)  # as float32 does, within bf16's rounding


def test_an_edited_policy_compiles_a_3d_attention_model_in_float32_compute() -> None:
    torch.manual_seed(0)
    model, tokens = Block(), torch.randint(0, 50, (4, 16))
    policy = ampkit.Policy.default("cpu", DTYPE, compute="float32").with_ops(deny=["gelu"])
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd's trace: fake tensors through the kernels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampkit.autocast(policy):
            got = compiled(tokens)
        with ampkit.autocast(policy):
            want = model(tokens)
    got.float().sum().backward()
    assert got.dtype == want.dtype == DTYPE
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_16_bit_models_policy_keeps_torchs_listed_ops_on_their_fast_paths() -> None:
    # O2 and O3 run float32 compute under a policy that lists no op (Policy.for_16bit_model): an op torch lists
    # (linear, conv2d, attention) keeps its own kernel and fast path there, and only an op in none of torch's lists
    # is decomposed (einsum into bmm). Decomposing every unlisted composite op sent a 16-bit model's linears
    # through the generic path (its forward run again in the backward).
    policy = ampkit.Policy.for_16bit_model("cpu", DTYPE, "float32")
    linear, conv = nn.Linear(16, 8).to(DTYPE), nn.Conv2d(4, 6, 3).to(DTYPE)
    q = torch.randn(2, 2, 8, 16).to(DTYPE).requires_grad_()
    with ampkit.autocast(policy):
        outs = {"linear": linear(torch.randn(4, 16).to(DTYPE)), "conv2d": conv(torch.randn(2, 4, 8, 8).to(DTYPE)),
                "attention": F.scaled_dot_product_attention(q, q, q, is_causal=True),
                "einsum": torch.einsum("bij,bjk->bik", q[0], q[0].transpose(1, 2))}
    # read while the outputs live (torch 2.11 invalidates a Function's node once its output is freed)
    names = {op: out.grad_fn.name() for op, out in outs.items()}
    assert names == {"linear": "_LinearBackward", "conv2d": "_ConvolutionBackward",
                     "attention": "_AttentionBackward", "einsum": "ViewBackward0"}  # einsum's bmm, then its view
