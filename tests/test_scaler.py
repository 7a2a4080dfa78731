"""Loss scalers: replayed step sequences against torch.amp.GradScaler, edge cases, checkpoints."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit import DynamicLossScaler, NonFiniteError, StaticLossScaler
from conftest import requires_cuda


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)


def _train(model, opt, scaler, steps, inf_at=(), start=0):  # type: ignore[no-untyped-def]
    results = []
    for i in range(start, start + steps):
        x, y = _batch(i)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if i in inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        results.append(scaler.step(opt))
        scaler.update()
    return results


def test_one_injected_inf_skips_exactly_one_step_and_growth_resumes() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    _train(model, opt, scaler, 2)
    before = copy.deepcopy(model.state_dict())
    stepped = _train(model, opt, scaler, 1, inf_at={2}, start=2)
    assert stepped == [False]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bitwise unchanged
    assert scaler.get_scale() == 512.0
    assert _train(model, opt, scaler, 3, start=3) == [True] * 3
    assert scaler.get_scale() == 1024.0
    stats = scaler.stats
    assert (stats.steps, stats.skipped, stats.overflows) == (5, 1, 1)
    assert stats.history[2] == (2, 1024.0, True)


def test_same_sequence_as_torch_grad_scaler() -> None:
    infs = {3, 4, 9}
    ours, theirs = _model(), _model()
    opt_a = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    opt_b = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    scaler_a = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, hysteresis=1)
    scaler_b = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for i in range(15):
        x, y = _batch(i)
        for model, opt, scaler in ((ours, opt_a, scaler_a), (theirs, opt_b, scaler_b)):
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if i in infs:
                next(model.parameters()).grad[0, 0] = float("nan")
            scaler.step(opt)
            scaler.update()
        assert scaler_a.get_scale() == scaler_b.get_scale()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


def test_resume_is_bitwise_identical(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def make():  # type: ignore[no-untyped-def]
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, DynamicLossScaler(init_scale=2.0**8, growth_interval=4, hysteresis=2)

    straight = make()
    _train(*straight, 20, inf_at={5, 6, 14})

    first = make()
    _train(*first, 10, inf_at={5, 6, 14})
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first[0].state_dict(), "opt": first[1].state_dict(), "scaler": first[2].state_dict()}, path)
    resumed = make()
    ckpt = torch.load(path)
    resumed[0].load_state_dict(ckpt["model"])
    resumed[1].load_state_dict(ckpt["opt"])
    resumed[2].load_state_dict(ckpt["scaler"])
    _train(*resumed, 10, inf_at={5, 6, 14}, start=10)

    assert resumed[2].state_dict() == straight[2].state_dict()
    for a, b in zip(resumed[0].parameters(), straight[0].parameters()):
        assert torch.equal(a, b)


def test_float16_gradients_are_unscaled_not_refused() -> None:
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    x = torch.randn(4, 6, dtype=torch.float16)
    scaler.scale(model(x).float().sum()).backward()
    grad_scaled = model[0].bias.grad.clone()
    scaler.unscale_(opt)
    assert torch.equal(model[0].bias.grad, grad_scaled / 8)


def test_step_returns_false_on_skip_and_the_scheduler_warns_nothing() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = DynamicLossScaler()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            x, y = _batch(i)
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if i == 0:
                model[0].weight.grad.fill_(float("inf"))
            if scaler.step(opt):
                sched.step()
            scaler.update()
    assert sched.last_epoch == 2


@pytest.mark.parametrize("target", ["optimizer", "params"])
def test_clip_grad_norm_returns_the_unscaled_norm(target: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    opt.zero_grad()
    scaler = DynamicLossScaler(init_scale=2.0**12)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    norm = scaler.clip_grad_norm_(opt if target == "optimizer" else model.parameters(), max_norm=1e9)
    assert torch.allclose(norm, reference, rtol=1e-5)
    assert scaler.step(opt)  # the step uses the unscaled gradients: not unscaled twice
    assert torch.allclose(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]), reference)
    scaler.update()


def test_gradient_accumulation_equals_one_big_batch() -> None:
    x, y = torch.randn(32, 6), torch.randn(32, 2)
    big, small = _model(), _model()
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    opt_small = torch.optim.SGD(small.parameters(), lr=0.1)
    scaler_big, scaler_small = DynamicLossScaler(init_scale=2.0**10), DynamicLossScaler(init_scale=2.0**10)
    scaler_big.scale(nn.functional.mse_loss(big(x), y)).backward()
    scaler_big.step(opt_big)
    scaler_big.update()
    for xb, yb in zip(x.chunk(4), y.chunk(4)):  # documented pattern: scale each micro-batch loss / 4
        scaler_small.scale(nn.functional.mse_loss(small(xb), yb) / 4).backward()
    scaler_small.step(opt_small)  # unscale, check and update once per optimizer step
    scaler_small.update()
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _gan_step(scaler, opt_d, opt_g, d, g, together: bool):  # type: ignore[no-untyped-def]
    x = torch.randn(4, 6)
    opt_d.zero_grad()
    opt_g.zero_grad()
    scaler.scale([d(x).sum(), g(x).sum()])[0].backward()
    scaler.scale(g(x).sum()).backward()
    g[0].weight.grad[0, 0] = float("inf")  # only the generator overflows
    if together:
        return [scaler.step([opt_d, opt_g])]
    return [scaler.step(opt_d), scaler.step(opt_g)]


@pytest.mark.parametrize("together, expected", [(True, [False]), (False, [True, False])])
def test_one_scaler_several_optimizers(together: bool, expected: list[bool]) -> None:
    d, g = _model(), _model()
    opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    d_before = copy.deepcopy(d.state_dict())
    scaler = DynamicLossScaler()
    assert _gan_step(scaler, opt_d, opt_g, d, g, together) == expected
    scaler.update()
    assert torch.equal(d[0].weight, d_before["0.weight"]) == together
    assert scaler.get_scale() == 2.0**15


def test_one_scaler_per_loss() -> None:
    d, g = _model(), _model()
    opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters(), lr=0.1)
    scaler_d, scaler_g = DynamicLossScaler(), DynamicLossScaler()
    x = torch.randn(4, 6)
    scaler_d.scale(d(x).sum()).backward()
    scaler_g.scale(g(x).sum()).backward()
    g[0].weight.grad[0, 0] = float("nan")
    assert scaler_d.step(opt_d) and not scaler_g.step(opt_g)
    scaler_d.update()
    scaler_g.update()
    assert (scaler_d.get_scale(), scaler_g.get_scale()) == (2.0**16, 2.0**15)


def test_non_finite_loss_raises_with_a_diagnosis_naming_the_loss() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_min_scale_overflows=3)
    with pytest.raises(NonFiniteError, match=r"The loss itself is (inf|nan) in the forward pass"):
        for _ in range(20):
            opt.zero_grad()
            loss = model(torch.full((2, 6), float("inf"))).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 1.0  # never decays to zero
    assert scaler.stats.skipped == 5  # 4 -> 2 -> 1, then 3 in a row at the minimum


def test_gradient_overflow_with_finite_loss_is_diagnosed_as_such() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = StaticLossScaler(2.0**10, max_min_scale_overflows=2)
    with pytest.raises(NonFiniteError, match="The loss is finite but its gradients overflow"):
        for i in range(5):
            _train(model, opt, scaler, 1, inf_at={i}, start=i)


@pytest.mark.parametrize(
    "calls, match",
    [
        (["unscale", "unscale"], r"unscale_\(\) has already been called"),
        (["step", "unscale"], r"unscale_\(\) is being called after step\(\)"),
        (["step", "step"], r"step\(\) has already been called"),
        (["update"], r"update\(\) was called without step\(\)"),
    ],
)
def test_call_order_mistakes_name_the_call(calls: list[str], match: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler()
    scaler.scale(model(torch.randn(2, 6)).sum()).backward()
    with pytest.raises(RuntimeError, match=match):
        for call in calls:
            {"unscale": scaler.unscale_, "step": scaler.step, "update": lambda _: scaler.update()}[call](opt)


def test_step_before_scale_is_an_error() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(RuntimeError, match=r"step\(\) was called before scale\(\)"):
        DynamicLossScaler().step(opt)


def test_load_grad_scaler_state_and_reject_bad_dicts() -> None:
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    scaler = DynamicLossScaler()
    scaler.load_state_dict(torch_scaler.state_dict())
    assert scaler.get_scale() == 512.0 and scaler.rule.growth_interval == 7
    with pytest.raises(RuntimeError, match=r"missing keys \['backoff_factor'"):
        scaler.load_state_dict({})
    with pytest.raises(RuntimeError, match=r"missing keys \[.*'scale'"):
        scaler.load_state_dict({"version": 1})


def test_disabled_scaler_is_a_pass_through() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(enabled=False)
    loss = model(torch.randn(2, 6)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = model[0].weight.clone()
    assert scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model[0].weight) and scaler.get_scale() == 1.0


def test_init_scale_outside_bounds() -> None:
    with pytest.raises(ValueError, match=r"init_scale=0.5 is outside \[min_scale, max_scale\]"):
        DynamicLossScaler(init_scale=0.5)
    assert isinstance(ampkit.StaticLossScaler(4.0), DynamicLossScaler)


@requires_cuda
def test_cuda_float16_gradients_and_grad_scaler_trajectory() -> None:
    model = _model().cuda().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**20)  # overflows float16 gradients at first
    stepped = []
    for i in range(8):
        x, y = _batch(i)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x.cuda().half()).float(), y.cuda())).backward()
        stepped.append(scaler.step(opt))
        scaler.update()
    assert stepped.count(False) == scaler.stats.skipped and stepped[-1]


# -- sparse gradients: ported from PyTorch's test_grad_scaling_unscale_sparse (test/test_cuda.py,
# the CPU copy in test/test_torch.py). Adapted: torch calls the private GradScaler._unscale_grads_
# with an explicit inv_scale; here a scaler with init_scale=4 unscales through its public calls
# (inv_scale 0.25 as in torch's test) and "found inf" is read as step() returning False.

_INDICES = torch.tensor([[0, 1, 1], [2, 0, 2]])


def _sparse_step(values: list[float], dtype: torch.dtype, indices: torch.Tensor = _INDICES,
                 step: bool = True) -> tuple[torch.Tensor, bool]:
    """Unscale a sparse gradient with a scaler at scale 4; returns (its gradient, whether the step ran).
    Without ``step``, only unscale (CPU has no float16 sparse add for the optimizer to step with)."""
    p = torch.sparse_coo_tensor(_INDICES, torch.tensor([16.0, 32.0, 64.0]), (2, 3)).to(dtype)
    optimizer = torch.optim.SGD([p], lr=0.0)
    p.grad = torch.sparse_coo_tensor(indices, torch.tensor(values), (2, 3)).to(dtype)
    scaler = DynamicLossScaler(init_scale=4.0)
    scaler.scale(torch.zeros(()))  # the call order of a step; the gradient above stands for its backward
    scaler.unscale_(optimizer)
    stepped = scaler.step(optimizer) if step else True
    return p.grad, stepped


def test_sparse_gradients_are_unscaled_in_place() -> None:
    s = torch.sparse_coo_tensor(_INDICES, torch.tensor([16.0, 32.0, 64.0]), (2, 3))
    grad, stepped = _sparse_step([16.0, 32.0, 64.0], torch.float32)
    assert stepped and torch.equal(grad.to_dense(), (s / 4).to_dense())
    grad, _ = _sparse_step([16.0, 32.0, 64.0], torch.float16, step=False)
    assert torch.equal(grad.to_dense(), (s.half() / 4).to_dense())


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_sparse_gradients_skip_the_step(bad: float) -> None:
    _, stepped = _sparse_step([16.0, 32.0, bad], torch.float32)
    assert not stepped


def test_uncoalesced_float16_sparse_gradient_that_overflows_once_summed_skips_the_step() -> None:
    # 64000 + 64000 > 65504 only once the duplicate index (0, 2) is coalesced.
    _, stepped = _sparse_step([64000.0, 32.0, 64000.0], torch.float16, torch.tensor([[0, 1, 0], [2, 0, 2]]))
    assert not stepped


def test_sparse_embedding_trains_as_without_scaling() -> None:
    torch.manual_seed(0)
    base = nn.Embedding(10, 4, sparse=True)
    tokens, target = torch.randint(0, 10, (6, 5)), torch.randn(6, 5, 4)
    weights = []
    for scaler in (DynamicLossScaler(enabled=False), DynamicLossScaler(init_scale=2.0**16)):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            scaler.scale((model(tokens) - target).pow(2).mean()).backward()
            assert scaler.step(optimizer)
            scaler.update()
        weights.append(model.weight.detach())
    torch.testing.assert_close(weights[1], weights[0])  # was 2**16 times the step before the fix
