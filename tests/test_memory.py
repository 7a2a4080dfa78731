"""Memory estimates against hand arithmetic and a measured step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit.experiment.models import ResNet18
from ampkit.experiment.config import RunConfig
from ampkit.experiment.training import execute
from ampkit.diagnostics.memory import estimate_memory


def test_one_million_parameters_are_4_mb_in_fp32_and_2_mb_in_16_bits() -> None:
    model = nn.Linear(1000, 1000, bias=False)  # 1,000,000 parameters
    est = estimate_memory(model, torch.randn(2, 1000), "O3", optimizer="sgd-nomomentum", dtype=torch.float16)
    assert est.parameters == 1_000_000
    assert est.float32.weights == 4_000_000 and est.mixed.weights == 2_000_000
    assert est.mixed.master_weights == 0 and est.float32.optimizer_states == 0


def test_o2_adds_masters_and_keeps_norms_in_fp32() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.LayerNorm(10))
    est = estimate_memory(model, torch.randn(2, 10), "O2", optimizer="adamw")
    n_linear, n_norm = 110, 20
    assert est.mixed.weights == 2 * n_linear + 4 * n_norm
    assert est.mixed.master_weights == 4 * n_linear  # the float32 norm is its own master
    assert est.mixed.gradients == 4 * (n_linear + n_norm)  # float32 gradients, the masters' own
    assert est.mixed.optimizer_states == 2 * 4 * (n_linear + n_norm)  # AdamW's two float32 moments
    sixteen = estimate_memory(model, torch.randn(2, 10), "O2", optimizer="adamw", grad_dtype=torch.bfloat16)
    assert sixteen.mixed.gradients == 2 * n_linear + 4 * n_norm + 4 * n_linear  # 16-bit ones and float32 copies


def test_activations_agree_with_a_measured_compare_step() -> None:
    config = RunConfig(model="resnet18", steps=1, batch_size=8, precision="bf16", opt_level="O2")
    measured = execute(config).saved_for_backward_bytes
    baseline = execute(RunConfig(model="resnet18", steps=1, batch_size=8)).saved_for_backward_bytes
    torch.manual_seed(0)
    est = estimate_memory(ResNet18(), torch.randn(8, 1, 28, 28), "O2")
    assert est.mixed.activations == pytest.approx(measured, rel=0.05)
    assert est.float32.activations == pytest.approx(baseline, rel=0.05)
    assert est.mixed.activations < est.float32.activations


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"Unknown optimizer 'lion'. Choose one of"):
        estimate_memory(nn.Linear(2, 2), torch.randn(1, 2), optimizer="lion")
    with pytest.raises(ValueError, match=r"Unknown opt_level 'O0' for a mixed estimate"):
        estimate_memory(nn.Linear(2, 2), torch.randn(1, 2), "O0")


@pytest.mark.parametrize("level, update, grad_dtype, bytes_per_parameter", [
    ("O1", "plain", None, 16), ("O2", "plain", None, 18), ("O3", "plain", None, 8), ("O3", "kahan", None, 10),
    ("O3", "stochastic", None, 8),
    # O2's default is float32 gradients, the masters' own (2 + 4 + 4 + 8); 16-bit ones and their float32 copies
    # take 2 bytes more; at O3 float32 gradients are 2 bytes more than 16-bit ones
    ("O2", "plain", "bf16", 20), ("O2", "plain", "fp32", 18), ("O3", "plain", "fp32", 10),
    ("O3", "stochastic", "fp32", 10),
])
def test_estimate_matches_the_tensors_after_a_step(level: str, update: str, grad_dtype: str | None,
                                                   bytes_per_parameter: int) -> None:
    """Weights, gradients, masters and AdamW states, as counted from the real tensors."""
    import ampkit
    from ampkit.diagnostics.memory import measured_state_bytes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    est = estimate_memory(model, torch.randn(4, 64), level, "adamw", torch.bfloat16, update=update,
                          grad_dtype=grad_dtype)
    mixed = est.mixed
    estimated = mixed.weights + mixed.gradients + mixed.master_weights + mixed.optimizer_states
    assert estimated == bytes_per_parameter * est.parameters
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), level, torch.bfloat16,
                                         compute="float32", update=update, grad_dtype=grad_dtype)
    model(torch.randn(4, 64)).float().sum().backward()
    optimizer.step()
    # The optimizers' step counters (a few bytes) are the only tensors the estimate leaves out.
    assert measured_state_bytes(model, optimizer) == pytest.approx(estimated, abs=64)


def test_a_tied_weight_is_counted_once() -> None:
    from ampkit.experiment.models import GPT

    model = GPT(vocab_size=64, context=8, d_model=32, n_layers=1, n_heads=2)
    est = estimate_memory(model, torch.randint(0, 64, (2, 8)), "O2")
    assert est.parameters == sum(p.numel() for p in model.parameters())  # the tied head is not counted twice
    norms = sum(p.numel() for name, p in model.named_parameters() if "ln" in name)
    assert est.mixed.weights == 4 * norms + 2 * (est.parameters - norms)


def test_keep_float32_is_estimated_as_initialize_keeps_it() -> None:
    """Float32 embeddings (and the head tied to them) at O2: the estimate counts the real tensors."""
    import ampkit
    from ampkit.experiment.models import GPT
    from ampkit.diagnostics.memory import measured_state_bytes

    torch.manual_seed(0)
    model = GPT(vocab_size=64, context=8, d_model=32, n_layers=1, n_heads=2)
    tokens = torch.randint(0, 64, (2, 8))
    kept = estimate_memory(model, tokens, "O2", keep_float32=[nn.Embedding])
    plain = estimate_memory(model, tokens, "O2")
    embeddings = model.tok.weight.numel() + model.pos.weight.numel()
    assert kept.mixed.weights == plain.mixed.weights + 2 * embeddings  # 4 bytes each instead of 2
    mixed = kept.mixed
    estimated = mixed.weights + mixed.gradients + mixed.master_weights + mixed.optimizer_states
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), "O2", torch.bfloat16,
                                         compute="float32", keep_float32=[nn.Embedding])
    model(tokens).float().sum().backward()
    optimizer.step()
    assert model.tok.weight.dtype == model.lm_head.weight.dtype == torch.float32
    assert measured_state_bytes(model, optimizer) == pytest.approx(estimated, abs=64)
    with pytest.raises(ValueError, match=r"keep_float32= applies at O2 only \(opt_level='O3'\)"):
        estimate_memory(model, tokens, "O3", keep_float32=[nn.Embedding])
    with pytest.raises(ValueError, match=r"must list nn.Module subclasses"):
        estimate_memory(model, tokens, "O2", keep_float32=["Embedding"])  # type: ignore[list-item]


# -- bad input (moved from test_bad_input.py) ----------------------------------------


def test_frozen_parameters_still_take_weight_memory() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    model[0].requires_grad_(False)
    estimate = ampkit.estimate_memory(model, torch.randn(2, 10), "O2", optimizer="adamw")
    assert estimate.parameters == 220 and estimate.float32.weights == 4 * 220  # was 4 * 110
    assert estimate.float32.gradients == 4 * 110 and estimate.mixed.master_weights == 4 * 110
    assert estimate.mixed.weights == 2 * 220


def test_a_sharded_estimate_splits_the_first_dimension_as_fsdp2_pads_it() -> None:
    model = nn.Sequential(nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 3))  # 5 and 3 rows: uneven over 2 ranks
    x = torch.randn(4, 8)
    whole = ampkit.estimate_memory(model, x, "O2", "adamw", torch.bfloat16)
    sharded = ampkit.estimate_memory(model, x, "O2", "adamw", torch.bfloat16, world_size=2, sharding="fsdp")
    # Each rank: ceil(rows / 2) rows of each parameter, float32 (the shards are O2's masters), and 2 AdamW states.
    rows = [(5, 8), (5, 1), (5, 1), (5, 1), (3, 5), (3, 1)]
    elements = sum(-(-r // 2) * c for r, c in rows)
    assert sharded.world_size == 2 and sharded.mixed.master_weights == 0
    assert (sharded.mixed.weights, sharded.mixed.gradients, sharded.mixed.optimizer_states) == (
        4 * elements, 4 * elements, 8 * elements)
    assert sharded.mixed.activations == whole.mixed.activations  # one rank's batch, as unsharded
    # Units: each child of the Sequential; the first linear is the largest, gathered in bf16 at O2 (the norm,
    # a float32 unit of its own at O2, is not a block as well).
    assert sharded.largest_gather_bytes == 2 * (8 * 5 + 5)


@pytest.mark.parametrize("kwargs, message", [
    ({"sharding": "zero3"}, "Unknown sharding 'zero3'"),
    ({"world_size": 0, "sharding": "fsdp"}, "world_size=0 is invalid"),
    ({"world_size": 2}, "world_size=2 is invalid"),
])
def test_bad_sharding_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ampkit.estimate_memory(nn.Linear(4, 4), torch.randn(2, 4), "O2", **kwargs)
