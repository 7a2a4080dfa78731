"""Gradient accumulation in float32 for 16-bit models: initialize(..., grad_dtype=torch.float32) at O2 and O3,
and fully_shard's reduce_dtype on 2 ranks; each against float32 accumulation of the same 16-bit micro-batch
gradients."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import ampkit
from multiprocess import run_ranks

MICRO = 64  # micro-batches accumulated into one step


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _micro_batches(seed: int = 0) -> list[torch.Tensor]:
    """A large first micro-batch and 63 small ones: against the growing sum, bfloat16's 8 significant bits
    lose what the small ones add."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 16, generator=g) * (1.0 if i == 0 else 0.05) for i in range(MICRO)]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean() / MICRO


def _float32_sums(model16: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The reference: each micro-batch's 16-bit gradients on their own, summed in float32 in the same order."""
    sums: list[torch.Tensor | None] = [None] * len(list(model16.parameters()))
    for x in batches:
        model16.zero_grad(set_to_none=True)
        _loss(model16, x).backward()
        for i, p in enumerate(model16.parameters()):
            g = p.grad.float()
            sums[i] = g if sums[i] is None else sums[i] + g
    return [s for s in sums if s is not None]


def _accumulated(grad_dtype: str | None, level: str = "O2") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    return ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), level, torch.bfloat16,
                             compute="native", grad_dtype=grad_dtype)


def test_64_micro_batches_at_o2_sum_as_float32_accumulation_does() -> None:
    """The issue's test: 64 micro-batches of small gradients at O2. With grad_dtype=float32 the accumulated
    gradient is float32 accumulation of the micro-batches' bfloat16 gradients, bit for bit (O2's default since
    issue 64); bfloat16 accumulation (grad_dtype=torch.bfloat16) is off by far more than float32 rounding."""
    batches = _micro_batches()
    model = _model()
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2",
                                         torch.bfloat16, compute="native", grad_dtype=torch.float32)
    reference = _float32_sums(copy.deepcopy(model), batches)  # the same bfloat16 weights, 16-bit gradients
    for x in batches:
        _loss(model, x).backward()
    for p, expected in zip(model.parameters(), reference):
        assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.float32
        assert torch.equal(p.grad, expected)
    plain = _model()
    plain, _ = ampkit.initialize(plain, None, "O2", torch.bfloat16, compute="native", grad_dtype=torch.bfloat16)
    for x in batches:
        _loss(plain, x).backward()
    errors = [((p.grad.float() - e).norm() / e.norm()).item() for p, e in zip(plain.parameters(), reference)]
    assert max(errors) > 1e-3  # what bfloat16 accumulation loses here (float32's is 0 above)


def test_the_masters_take_the_float32_gradients_without_a_copy_and_step_as_float32() -> None:
    model, optimizer = _accumulated("fp32")
    for x in _micro_batches()[:4]:
        _loss(model, x).backward()
    optimizer.prepare_grads_()
    for param, master in zip(optimizer.model_params, optimizer.master_params):
        assert master.grad is param.grad  # one float32 buffer: no copy at the step
    expected = copy.deepcopy(optimizer.optimizer)  # the same AdamW over float32 masters with those gradients
    expected.step()
    optimizer.step()
    for param, master, want in zip(optimizer.model_params, optimizer.master_params,
                                   [p for g in expected.param_groups for p in g["params"]]):
        assert torch.equal(master, want) and torch.equal(param, want.to(torch.bfloat16))
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    _loss(model, _micro_batches()[0]).backward()  # the next step's backward: float32 again, taken again
    optimizer.prepare_grads_()
    assert all(m.grad is p.grad for p, m in zip(optimizer.model_params, optimizer.master_params))


def test_o3_steps_16_bit_weights_on_the_rounded_float32_sum_and_keeps_the_sum() -> None:
    """At O3 torch's AdamW refuses a float32 gradient on a bfloat16 weight: the sum is rounded for the step
    and is the gradient again after it."""
    model, optimizer = _accumulated("fp32", "O3")
    twin, twin_optimizer = _accumulated(None, "O3")
    for x in _micro_batches()[:8]:
        _loss(model, x).backward()
    sums = [p.grad.clone() for p in model.parameters()]
    for p, s in zip(twin.parameters(), sums):
        p.grad = s.to(torch.bfloat16)  # what the step should see
    optimizer.step()
    twin_optimizer.step()
    for p, t, s in zip(model.parameters(), twin.parameters(), sums):
        assert p.dtype == torch.bfloat16 and torch.equal(p, t)
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, s)
    _loss(model, _micro_batches()[0]).backward()  # the next backward accumulates in float32 again
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("scaler", ["ampkit", "torch"])
def test_float16_o2_unscales_the_float32_sum_and_skips_an_overflow(scaler: str) -> None:
    """A loss scaler unscales the float32 gradients (torch.amp.GradScaler refuses 16-bit ones) and still
    skips a step whose gradients overflowed."""
    model = _model()
    model, optimizer = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                                         torch.float16, compute="native", grad_dtype="fp32")
    scale = ampkit.DynamicLossScaler(init_scale=2.0**10) if scaler == "ampkit" else torch.amp.GradScaler(
        "cpu", init_scale=2.0**10)
    before = [p.detach().clone() for p in model.parameters()]
    for x in _micro_batches()[:4]:
        scale.scale(_loss(model, x)).backward()
    sums = [p.grad.clone() / 2.0**10 for p in model.parameters()]
    scale.unscale_(optimizer)
    for m, s in zip(optimizer.master_params, sums):
        assert m.grad.dtype == torch.float32 and torch.allclose(m.grad, s, rtol=1e-6, atol=0)
    scale.step(optimizer)
    scale.update()
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))  # it stepped
    optimizer.zero_grad()
    stepped = [p.detach().clone() for p in model.parameters()]
    scale.scale(_loss(model, _micro_batches()[0] * 1e30)).backward()  # an overflow
    scale.step(optimizer)
    scale.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), stepped))  # skipped
    assert scale.get_scale() < 2.0**10


@pytest.mark.parametrize("call, message", [
    (lambda m, o: ampkit.initialize(m, o, "O2", torch.bfloat16, grad_dtype="fp8"),
     r"grad_dtype='fp8' is not a gradient dtype at O2 with dtype=torch.bfloat16: choose torch.float32"),
    (lambda m, o: ampkit.initialize(m, o, "O2", torch.bfloat16, grad_dtype=torch.float16),
     r"grad_dtype=torch.float16 is not a gradient dtype"),
    (lambda m, o: ampkit.initialize(m, o, "O1", torch.bfloat16, grad_dtype="bf16"),
     r"None \(the weights' dtype, float32\)"),
])
def test_a_bad_grad_dtype_is_refused_and_changes_nothing(call, message: str) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        call(model, optimizer)
    assert all(p.dtype == torch.float32 and p.grad_dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert not hasattr(model, "_ampkit_opt_level")
    ampkit.initialize(model, optimizer, "O2", torch.bfloat16, grad_dtype="fp32")  # the retry works


def test_the_state_says_how_gradients_accumulated_and_a_different_resume_warns() -> None:
    model, optimizer = _accumulated("fp32")
    _loss(model, _micro_batches()[0]).backward()
    optimizer.step()
    state = optimizer.state_dict()
    assert state["grad_dtype"] == "float32"
    other_model, other = _accumulated("bf16")
    assert other.state_dict()["grad_dtype"] == "weights"
    with pytest.warns(UserWarning, match=r"accumulated gradients in 'float32', this one in 'weights'"):
        other.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _accumulated("fp32")[1].load_state_dict(state)  # the same setting: no warning
        del state["grad_dtype"]  # an older state dict says nothing: taken as this run's
        other.load_state_dict(state)


def _fsdp_worker(rank: int, world: int) -> dict:
    """64 micro-batches without gradient sync, then one with it, at O2 (reduce_dtype float32, then bfloat16);
    the reference: this rank's and the other's micro-batches, each a 16-bit gradient of the same bfloat16
    weights in one process, summed in float32 and averaged over the ranks as FSDP2's reduce-scatter does."""
    from ampkit.distributed import fsdp

    out: dict = {}
    batches = {r: _micro_batches(seed=r) for r in range(world)}
    model16 = copy.deepcopy(_model())
    model16, _ = ampkit.initialize(model16, None, "O2", torch.bfloat16, compute="native")
    sums = [_float32_sums(copy.deepcopy(model16), batches[r]) for r in range(world)]
    reference = [sum(s[i] for s in sums) / world for i in range(len(sums[0]))]
    for reduce_dtype in (torch.float32, torch.bfloat16):
        model = fsdp.fully_shard(_model(), opt_level="O2", dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                 compute="native")
        for i, x in enumerate(batches[rank]):
            model.set_requires_gradient_sync(i == MICRO - 1)
            _loss(model, x).backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        out[str(reduce_dtype)] = max(((g.float() - e).norm() / e.norm()).item() for g, e in zip(grads, reference))
        out[f"{reduce_dtype} dtype"] = str(grads[0].dtype)
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_64_micro_batches_on_two_fsdp2_ranks_sum_as_float32_accumulation_does() -> None:
    """FSDP2 accumulates unsynced gradients in its reduce_dtype: float32 (fully_shard's default) matches float32
    accumulation to float32 rounding; bfloat16's error is reported beside it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_fsdp_worker, 2, timeout_s=240)
    for rank in ranks:
        assert rank["torch.float32 dtype"] == "torch.float32"
        assert rank["torch.float32"] < 1e-6
        assert rank["torch.bfloat16"] > 1e-3


def test_compare_plans_a_run_per_gradient_accumulation_at_o2_and_o3() -> None:
    from ampkit.experiment import settings

    configs = settings.plan(model="mlp", precisions=["bf16"], opt_levels=["O1", "O2", "O3"], grad_accums=["fp32", "bf16"],
                            computes=["native"], steps=4, batch_size=8, micro_batches=4)
    assert [c.label for c in configs] == ["fp32", "bf16 O1", "bf16 O2 fp32-grads", "bf16 O2 bf16-grads",
                                          "bf16 O3 fp32-grads", "bf16 O3 bf16-grads"]
    assert [c.grad_accum for c in configs] == [None, None, "fp32", "bf16", "fp32", "bf16"]
    assert {c.micro_batches for c in configs} == {4}


@pytest.mark.parametrize("options, message", [
    (dict(micro_batches=3), r"micro_batches=3 does not divide batch_size=8: choose a divisor \(e.g. 2, 4, 8\)"),
    (dict(micro_batches=0), r"micro_batches=0 is invalid: use an integer >= 1"),
    (dict(grad_accums=["fp16"], opt_levels=["O2"]), r"grad_accums=\['fp16'\] with precision 'bf16', whose 16-bit "
                                                   r"weights are bf16: gradients accumulate in fp32 or in the weights'"),
    (dict(grad_accums=["fp32"], opt_levels=["O1"]), r"grad_accums=\['fp32'\] applies to O2 and O3 runs only"),
    (dict(grad_accums=["fp64"], opt_levels=["O2"]), r"Unknown gradient accumulation 'fp64'. Choose from \['fp32', 'bf16', 'fp16'\]"),
    (dict(grad_accums=["fp32", "fp32"], opt_levels=["O2"]), r"fp32 named more than once"),
])
def test_bad_accumulation_options_are_refused_before_any_run(options: dict, message: str) -> None:
    from ampkit.experiment import settings

    with pytest.raises(ValueError, match=message):
        settings.plan(**{"model": "mlp", "precisions": ["bf16"], "steps": 4, "batch_size": 8, **options})


def test_micro_batches_train_float32_as_the_whole_batch_does_and_o2_keeps_18_bytes_a_parameter() -> None:
    """4 micro-batches of 2 take the step one batch of 8 takes (up to float32 rounding: the sums differ in order);
    O2 with float32 accumulation (its default) holds 18 bytes per parameter (16-bit weights, float32 gradients,
    masters, two moments) where 16-bit gradients and their float32 copies hold 20."""
    from ampkit.experiment.config import RunConfig
    from ampkit.experiment.training import execute

    common = dict(model="mlp", steps=4, batch_size=8)
    whole = execute(RunConfig(**common))
    micro = execute(RunConfig(**common, micro_batches=4))
    assert micro.losses == pytest.approx(whole.losses, rel=1e-5)
    assert micro.saved_for_backward_bytes < whole.saved_for_backward_bytes  # a micro-batch's activations at once
    o2 = dict(common, precision="bf16", opt_level="O2", compute="native", micro_batches=4)
    per_parameter = {accumulate: execute(RunConfig(**o2, grad_accum=accumulate))
                     for accumulate in ("fp32", None, "bf16")}
    assert {a: round(r.state_bytes / r.parameters, 2)
            for a, r in per_parameter.items()} == {"fp32": 18.0, None: 18.0, "bf16": 20.0}


@pytest.mark.slow  # a first inductor compile
def test_a_compiled_o2_model_accumulates_in_float32_as_the_eager_one() -> None:
    """torch.compile leaves the accumulation to autograd's engine, outside the graph: 4 micro-batches give the
    eager model's float32 sums to the bit. (copy.deepcopy does not keep a parameter's grad_dtype: the eager twin
    sets it again.)"""
    from ampkit.optim.grads import accumulate_in

    model, _ = _accumulated("fp32")
    eager = copy.deepcopy(model)
    assert all(p.grad_dtype == torch.bfloat16 for p in eager.parameters())  # torch's deepcopy drops it
    accumulate_in(eager.parameters(), torch.float32)
    compiled = torch.compile(model)
    for x in _micro_batches()[:4]:
        _loss(compiled, x).backward()
        _loss(eager, x).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_run_accumulating_in_float32_resumes_from_a_checkpoint_bit_identically(level: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """4 steps of 4 micro-batches each, straight through, against 2 steps, save_checkpoint, a fresh model (other
    weights) loading it, and 2 more: the same weights and losses to the bit."""

    def setup(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model(seed)
        return ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, torch.bfloat16,
                                 compute="native", grad_dtype="fp32")

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for x in _micro_batches(step)[:4]:
                loss = _loss(model, x)
                loss.backward()
                total += loss.item()
            optimizer.step()
            losses.append(total)
        return losses

    expected = train(*setup(0), range(4))
    first = setup(0)
    train(*first, range(2))
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=first[0], optimizer=first[1])
    resumed = setup(1)
    ampkit.load_checkpoint(tmp_path / "ck.pt", model=resumed[0], optimizer=resumed[1])
    assert train(*resumed, range(2, 4)) == expected[2:]
    straight = setup(0)
    train(*straight, range(4))
    for a, b in zip(straight[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)
    assert all(p.grad_dtype == torch.float32 for p in resumed[0].parameters())
