"""Pure 16-bit training: Kahan summation and stochastic rounding keep updates plain 16-bit rounding loses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit import pure16_optimizer, stochastic_round


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("update", ["plain", "kahan", "stochastic"])
def test_a_thousand_updates_of_1e_4_to_a_weight_of_one(update: str, dtype: torch.dtype) -> None:
    weight = nn.Parameter(torch.ones(4096, dtype=dtype))
    optimizer = pure16_optimizer(torch.optim.SGD([weight], lr=1e-4), update)
    for _ in range(1000):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
    values = weight.detach().float()
    if update == "plain":
        assert torch.equal(values, torch.ones(4096))  # every update rounds back to 1.0: all lost
    elif update == "kahan":
        # The compensation buffer carries what rounding lost: within one 16-bit spacing of 0.9.
        spacing = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
        assert (values - 0.9).abs().max() <= spacing
    else:
        # Unbiased: each weight takes a random walk around the exact path (its rounding errors add up
        # to a spread of ~0.06 after 1000 bfloat16 steps), and their mean lands on 0.9 (standard error
        # ~1e-3 over 4096 weights; the draws are seeded).
        assert abs(values.mean().item() - 0.9) < 5e-3
        assert (values < 1.0).all()


def test_stochastic_round_is_unbiased_and_exact_where_representable() -> None:
    x = torch.full((100_000,), 1.0 + 1e-3)
    rounded = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}  # the two neighbours only
    assert abs(rounded.mean().item() - (1.0 + 1e-3)) < 1e-4
    exact = torch.tensor([0.0, -2.0, 1.5, 65504.0, float("inf"), -float("inf")])
    assert torch.equal(stochastic_round(exact, torch.float16).float(), exact)
    assert stochastic_round(torch.tensor([float("nan")]), torch.bfloat16).isnan().all()


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
], ids=["sgd", "adamw"])
def test_on_float32_weights_the_converted_optimizers_follow_torch_optim(update: str, make) -> None:  # type: ignore[no-untyped-def]
    """Rounding aside, the update is torch.optim's: same hyperparameters, same trajectory."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    reference, converted = make(model.parameters()), pure16_optimizer(make(twin.parameters()), update)
    for step in range(10):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step))
        for m, opt in ((model, reference), (twin, converted)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_initialize_o3_with_kahan_trains_a_bf16_model_without_masters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O3",
                                         torch.bfloat16, compute="float32", update="kahan")
    assert type(optimizer).__module__.startswith("optimi")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(100):
        optimizer.zero_grad()
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    state = optimizer.state[next(model.parameters())]
    assert state["kahan_comp"].dtype == torch.bfloat16  # the compensation buffer is 16-bit


def test_bad_settings_are_refused_with_the_fix() -> None:
    params = [nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=r"Unknown update 'exact'. Choose one of \['plain', 'kahan', 'stochastic'\]"):
        pure16_optimizer(torch.optim.SGD(params, lr=0.1), "exact")
    with pytest.raises(ValueError, match="needs a torch.optim.SGD or torch.optim.AdamW, got torch.optim.adam.Adam"):
        pure16_optimizer(torch.optim.Adam(params, lr=0.1), "kahan")
    with pytest.raises(ValueError, match="nesterov=True is not supported"):
        pure16_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True), "stochastic")
    with pytest.raises(ValueError, match="update='kahan' applies at O3 only"):
        ampkit.initialize(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), "O2",
                          update="kahan")


@pytest.mark.parametrize("update", ["plain", "kahan"])
def test_o3_float16_adamw_with_an_eps_float16_cannot_hold_is_refused_and_one_it_holds_trains(update: str) -> None:
    """torch's AdamW (and torch-optimi's) keep O3's float16 moments in float16 and divide by their root plus eps
    there: the default eps, 1e-8, rounds to 0, and the first step made every weight with a zero gradient NaN with
    no word. Refused at initialize, the model and the optimizer as they were; eps=1e-4 trains, as does
    update='stochastic' (float32 arithmetic) with the default."""
    if update == "kahan":
        pytest.importorskip("optimi")

    def run(eps: float, update: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=eps)

    model, optimizer = run(1e-8, update)
    before = {name: (p, p.dtype) for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"opt_level='O3' with float16 weights keeps AdamW's moments in float16, "
                                         r"where eps=1e-08 rounds to 0.*eps=1e-4.*update='stochastic'"):
        ampkit.initialize(model, optimizer, "O3", torch.float16, compute="native", update=update)
    assert {name: (p, p.dtype) for name, p in model.named_parameters()} == before and not optimizer.state
    assert not hasattr(model, "_ampkit_opt_level")
    for eps, chosen in ((1e-4, update), (1e-8, "stochastic")):
        model, optimizer = ampkit.initialize(*run(eps, chosen), "O3", torch.float16, compute="native", update=chosen)
        scaler = ampkit.DynamicLossScaler()
        x, y = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)), torch.randn(16, 4)
        for _ in range(3):
            optimizer.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x).float(), y)).backward()
            scaler.step(optimizer)
            scaler.update()
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), (eps, chosen)
