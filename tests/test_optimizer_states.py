"""Optimizer states in fewer bits (ampkit.optim.states): initialize(..., states=...) at each opt level, against
torchao's own low-bit optimizers and torch.optim.AdamW; bfloat16 moments against AdamW's formula; the estimate
against the tensors; checkpoints; FSDP2 shards; compare's --states.

torchao compiles its step function with torch.compile on the first step of each shape (seconds each on a CPU):
these tests step it eagerly (``torch.compiler.set_stance("force_eager")``, one float32 rounding away from the
compiled step) but for the one marked slow."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import ampkit
from multiprocess import run_ranks

pytest.importorskip("torchao.optim")
LOW_BIT = ["8bit", "4bit", "fp8"]


@pytest.fixture(autouse=True)
def _eager_torchao():  # type: ignore[no-untyped-def]
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's and the compute mode's notes
        yield


def _model(seed: int = 0) -> nn.Module:
    """Two linears with 8192 weights each (torchao quantizes tensors of >= 4096 values) and small biases (kept
    in the parameters' dtype)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = model(_batch(step)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _groups(model: nn.Module) -> list[dict]:
    """Two groups with their own lr and weight decay: each must reach the new optimizer."""
    first, second = model[0], model[2]
    return [{"params": list(first.parameters()), "lr": 3e-3, "weight_decay": 0.1},
            {"params": list(second.parameters()), "lr": 1e-3, "weight_decay": 0.0}]


def _initialized(level: str, states: str | None, update: str = "plain", seed: int = 0,
                 **options: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    optimizer = torch.optim.AdamW(_groups(model), betas=(0.8, 0.99), eps=1e-6)
    return ampkit.initialize(model, optimizer, level, torch.bfloat16, compute="native", update=update,
                             states=states, **options)


@pytest.mark.parametrize("states", LOW_BIT)
def test_a_low_bit_format_at_o1_steps_as_torchaos_optimizer_built_by_hand(states: str) -> None:
    """Every group's lr and weight decay, and the betas and eps, reach torchao's optimizer: the weights equal those
    of torchao's AdamW8bit/4bit/Fp8 built by hand on the same groups, to the bit."""
    import torchao.optim

    model, optimizer = _initialized("O1", states)
    name = {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}[states]
    assert type(optimizer).__name__ == name
    reference = _model()
    reference_optimizer = getattr(torchao.optim, name)(_groups(reference), betas=(0.8, 0.99), eps=1e-6)
    reference, reference_optimizer = ampkit.initialize(reference, reference_optimizer, "O1", torch.bfloat16,
                                                       compute="native")
    _train(model, optimizer, range(3))
    _train(reference, reference_optimizer, range(3))
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert type(optimizer.state[model[0].weight]["exp_avg"]).__name__.startswith("OptimState")
    assert not type(optimizer.state[model[0].bias]["exp_avg"]).__name__.startswith("OptimState")  # 128 values


@pytest.mark.parametrize("states, tolerance", [("bf16", 0.02), ("8bit", 0.05), ("4bit", 0.3), ("fp8", 0.05)])
def test_each_format_at_o2_follows_float32_adamw(states: str, tolerance: float) -> None:
    """10 steps at O2 with the moments in fewer bits move the weights as float32 moments do, to within the format's
    coarseness (relative to the distance the weights travelled)."""
    start = copy.deepcopy(_model().state_dict())
    model, optimizer = _initialized("O2", states)
    reference, reference_optimizer = _initialized("O2", None)
    _train(model, optimizer, range(10))
    _train(reference, reference_optimizer, range(10))
    for name, a in optimizer.fp32_state_dict(model).items():
        b = reference_optimizer.fp32_state_dict(reference)[name]
        moved = (b - start[name]).norm()
        assert (a - b).norm() / moved < tolerance, name


def test_bfloat16_moments_decay_as_adamw_s_formula_says_where_rounding_to_nearest_freezes_them() -> None:
    """One large gradient, then zero gradients: AdamW's second moment decays by beta2 a step (the formula,
    v_k = beta2**k v_0). The stochastically rounded bfloat16 second moment follows it on average; rounded to
    nearest, 0.999 v rounds back to v and the moment never decays (what torch.optim.AdamW on bfloat16 tensors
    does)."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.zeros(20000))
    model, optimizer = ampkit.initialize(nn.ParameterList([weight]), torch.optim.AdamW([weight], lr=0.0), "O0",
                                         states="bf16")
    bf16_weight = nn.Parameter(torch.zeros(20000, dtype=torch.bfloat16))
    nearest = torch.optim.AdamW([bf16_weight], lr=0.0)
    for step in range(301):
        for p in (weight, bf16_weight):
            p.grad = torch.ones_like(p) if step == 0 else torch.zeros_like(p)
        optimizer.step()
        nearest.step()
    expected = (1 - 0.999) * 0.999**300  # v_0 = (1 - beta2) g**2
    decayed = optimizer.state[weight]["exp_avg_sq"]
    assert decayed.dtype == torch.bfloat16
    assert decayed.float().mean().item() == pytest.approx(expected, rel=0.01)
    frozen = nearest.state[bf16_weight]["exp_avg_sq"].float().mean().item()
    assert frozen == pytest.approx(1 - 0.999, rel=0.01)  # not 0.74 of it: it never moved


def test_nearest_rounded_moments_follow_adamw_s_formula_rounded_once_and_an_unknown_rounding_is_refused() -> None:
    """state_rounding="nearest" (the ablation's): each step's moments computed in float32 from the stored ones and
    rounded to bfloat16 once (torch's AdamW on bfloat16 tensors rounds after each of its ops, a step further off)."""
    from ampkit.optim.pure16 import StochasticRoundingOptimizer

    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    ours = StochasticRoundingOptimizer([weight], "adamw", lr=0.0, state_rounding="nearest")
    twin = nn.Parameter(weight.detach().clone())
    auto = StochasticRoundingOptimizer([twin], "adamw", lr=0.0)  # "auto": the first moment to nearest too
    m = v = torch.zeros(64, dtype=torch.bfloat16)
    for step in range(5):
        grad = torch.randn(64, generator=torch.Generator().manual_seed(step)).bfloat16()
        weight.grad, twin.grad = grad, grad.clone()
        ours.step()
        auto.step()
        g = grad.float()
        m = m.float().lerp(g, 1 - 0.9).bfloat16()  # torch.optim.AdamW's expressions, in float32
        v = v.float().mul(0.999).addcmul(g, g, value=1 - 0.999).bfloat16()
        assert torch.equal(ours.state[weight]["exp_avg"], m) and torch.equal(ours.state[weight]["exp_avg_sq"], v)
        assert torch.equal(auto.state[twin]["exp_avg"], m)
    with pytest.raises(ValueError, match=r"state_rounding='up' is not a rounding: choose 'auto', 'stochastic' or 'nearest'"):
        StochasticRoundingOptimizer([weight], "adamw", lr=0.0, state_rounding="up")


@pytest.mark.parametrize("level, states, update, grad_dtype", [
    *[("O2", s, "plain", g) for s in ["fp32", "bf16", *LOW_BIT] for g in (None, "fp32")],
    *[("O1", s, "plain", None) for s in ["bf16", *LOW_BIT]],
    *[("O3", s, u, None) for s in ["bf16", *LOW_BIT] for u in ("plain", "stochastic")],
    ("O3", "fp32", "stochastic", None), ("O3", "bf16", "kahan", None), ("O3", "8bit", "stochastic", "fp32"),
])
def test_the_estimate_counts_each_format_as_the_tensors_hold_it(level: str, states: str, update: str,
                                                                 grad_dtype: str | None) -> None:
    """estimate_memory(states=...) against measured_state_bytes after a step: equal but for the step counters
    (one 4-byte scalar per parameter tensor), on a GPT whose tensors torchao quantizes or keeps by their size."""
    from ampkit.experiment.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=64, context=16, d_model=64, n_layers=1, n_heads=2)
    tokens = torch.randint(0, 64, (2, 16))
    mixed = ampkit.estimate_memory(model, tokens, level, update=update, states=states, grad_dtype=grad_dtype).mixed
    estimated = mixed.weights + mixed.gradients + mixed.master_weights + mixed.optimizer_states
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), level, torch.bfloat16,
                                         compute="native", update=update, states=states, grad_dtype=grad_dtype)
    model(tokens).float().square().mean().backward()
    optimizer.step()
    counters = 4 * len(list(model.parameters()))
    assert estimated <= ampkit.measured_state_bytes(model, optimizer) <= estimated + counters
    assert f"{states}-states" in mixed.label


def test_8bit_states_at_o2_with_float32_gradients_take_about_12_bytes_a_parameter() -> None:
    """The issue's target on a GPT-sized layout: 2 (weights) + 4 (float32 gradients, the masters' own) + 4
    (masters) + 2 x (1 + a float32 scale per 256) bytes, plus what stays float32 (norms, small tensors)."""
    from ampkit.experiment.models import GPT

    model = GPT(vocab_size=256, context=64, d_model=256, n_layers=2, n_heads=4)
    tokens = torch.randint(0, 256, (2, 64))
    per_parameter = {}
    for states in (None, "8bit", "4bit"):
        mixed = ampkit.estimate_memory(model, tokens, "O2", states=states, grad_dtype="fp32").mixed
        total = mixed.weights + mixed.gradients + mixed.master_weights + mixed.optimizer_states
        per_parameter[states] = total / sum(p.numel() for p in model.parameters())
    assert per_parameter[None] == pytest.approx(18.0, abs=0.05)
    assert 12.0 < per_parameter["8bit"] < 12.2
    assert 11.0 < per_parameter["4bit"] < 11.2


@pytest.mark.parametrize("call, message", [
    (lambda m: ampkit.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), "O2", states="8bit"),
     r"states='8bit' keeps AdamW's moments in fewer bits; the optimizer is SGD. Build a torch.optim.AdamW"),
    (lambda m: ampkit.initialize(m, torch.optim.AdamW(m.parameters(), amsgrad=True), "O2", states="4bit"),
     r"amsgrad=True is not supported with states='4bit': use amsgrad=False, or states='fp32'"),
    (lambda m: ampkit.initialize(m, torch.optim.Adam(m.parameters(), weight_decay=0.1), "O1", states="bf16"),
     r"Adam's weight decay is an L2 term"),
    (lambda m: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), "O2", states="int8"),
     r"Unknown states 'int8'. Choose one of \['fp32', 'bf16', '8bit', '4bit', 'fp8'\]"),
    (lambda m: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), "O3", states="fp32"),
     r"states='fp32' at O3 with update='plain': .* Use update='stochastic'"),
    (lambda m: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), "O3", states="8bit", update="kahan"),
     r"states='8bit' with update='kahan': torchao's low-bit optimizers have no Kahan summation"),
    (lambda m: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), "O3", torch.float16, states="fp8",
                                 update="stochastic"),
     r"torchao rounds stochastically into bfloat16 only"),
    (lambda m: ampkit.initialize(m, torch.optim.AdamW(m.parameters()), "O3", torch.float16, states="bf16"),
     r"states='bf16' at O3 with torch.float16 weights"),
    (lambda m: ampkit.initialize(m, None, "O2", states="8bit"), r"states='8bit' needs the optimizer"),
])
def test_a_refused_format_names_the_fix_and_changes_nothing(call, message: str) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        call(model)
    assert all(torch.equal(before[k], v) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    assert getattr(model, "_ampkit_opt_level", None) is None  # initialize can still be called


def test_an_optimizer_that_has_stepped_is_refused() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    _train(model, optimizer, range(1))
    with pytest.raises(ValueError, match=r"states='8bit': the optimizer has already stepped"):
        ampkit.initialize(model, optimizer, "O2", states="8bit")


def test_the_estimate_refuses_a_format_without_adamw() -> None:
    with pytest.raises(ValueError, match=r"states='8bit' keeps AdamW's moments in fewer bits; optimizer='sgd'"):
        ampkit.estimate_memory(_model(), _batch(0), "O2", optimizer="sgd", states="8bit")
    with pytest.raises(ValueError, match=r"states='fp32' at O3 with update='kahan'"):
        ampkit.estimate_memory(_model(), _batch(0), "O3", update="kahan", states="fp32")


@pytest.mark.parametrize("level, states, update", [
    *[("O2", s, "plain") for s in ["bf16", *LOW_BIT]],
    ("O3", "bf16", "stochastic"), ("O3", "8bit", "stochastic"), ("O3", "fp32", "stochastic"), ("O1", "4bit", "plain"),
])
def test_every_format_resumes_from_a_checkpoint_bit_identically(level: str, states: str, update: str,
                                                               tmp_path) -> None:  # type: ignore[no-untyped-def]
    """4 steps straight through against 2 steps, save_checkpoint, a fresh model (other weights) loading it and 2
    more: the same losses and weights to the bit. torchao's stochastic rounding draws from torch's global
    generator, which the checkpoint carries here as a training script's would (ampkit's own draws from the
    optimizer's generator, in its state)."""
    straight = _initialized(level, states, update)
    torch.manual_seed(123)  # after the models' seeding
    expected = _train(*straight, range(4))
    first = _initialized(level, states, update)
    torch.manual_seed(123)
    _train(*first, range(2))
    ampkit.save_checkpoint(tmp_path / "ck.pt", model=first[0], optimizer=first[1],
                           extra={"rng": torch.get_rng_state()})
    resumed = _initialized(level, states, update, seed=1)
    torch.manual_seed(7)  # another state: the checkpoint's must come back
    extra = ampkit.load_checkpoint(tmp_path / "ck.pt", model=resumed[0], optimizer=resumed[1])
    torch.set_rng_state(extra["rng"])
    assert _train(*resumed, range(2, 4)) == expected[2:]
    for a, b in zip(straight[0].parameters(), resumed[0].parameters()):
        assert torch.equal(a, b)


def test_an_o2_checkpoint_of_another_format_is_refused_with_the_fix_and_changes_nothing() -> None:
    """The masters' optimizer says its format (``states`` in its state dict); loading 8-bit moments into float32
    ones is refused before anything changes."""
    model, optimizer = _initialized("O2", "8bit")
    _train(model, optimizer, range(1))
    state = optimizer.state_dict()
    assert state["states"] == "8bit"
    other_model, other = _initialized("O2", None, seed=1)
    _train(other_model, other, range(1))
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(RuntimeError, match=r"kept AdamW's moments as '8bit', this one keeps them as 'as given'.*"
                                           r"states='8bit'"):
        other.load_state_dict(state)
    after = other.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(before["master_params"], after["master_params"]))
    assert after["states"] == "as given"


def test_stochastic_rounding_draws_follow_from_the_optimizer_state() -> None:
    """ampkit's stochastically rounding optimizer draws from (seed, parameter, its count of steps): a twin loaded
    from its state draws the roundings the original goes on to draw, whatever torch's global generator does."""
    model, optimizer = _initialized("O3", "bf16", "stochastic")
    _train(model, optimizer, range(2))
    state = copy.deepcopy(optimizer.state_dict())
    assert {s["rounded_steps"] for s in state["state"].values()} == {2}
    twin, twin_optimizer = _initialized("O3", "bf16", "stochastic", seed=1)
    twin.load_state_dict(model.state_dict())
    twin_optimizer.load_state_dict(state)
    torch.manual_seed(1)
    _train(model, optimizer, range(2, 4))
    torch.manual_seed(2)
    _train(twin, twin_optimizer, range(2, 4))
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow  # torchao compiles its step per shape
def test_the_compiled_torchao_step_follows_the_eager_one() -> None:
    """What the runs use: torchao's step through torch.compile, within float32 rounding of the eager step."""
    model, optimizer = _initialized("O2", "8bit")
    eager, eager_optimizer = _initialized("O2", "8bit")
    with torch.compiler.set_stance("default"):
        _train(model, optimizer, range(3))
    _train(eager, eager_optimizer, range(3))
    for a, b in zip(optimizer.master_params, eager_optimizer.master_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fsdp_worker(rank: int, world: int, states: str, path: str) -> dict:
    """O2 on 2 ranks with the moments in ``states``: the per-rank bytes against the sharded estimate, and a sharded
    checkpoint's resume against straight training."""
    from ampkit.distributed import fsdp, load_sharded_checkpoint, save_sharded_checkpoint

    torch.compiler.set_stance("force_eager")
    warnings.simplefilter("ignore")

    def setup(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = fsdp.fully_shard(_model(seed), opt_level="O2", dtype=torch.bfloat16, compute="native")
        optimizer = fsdp.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), states=states)
        return model, optimizer

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            loss = model(_batch(10 * step + rank)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    straight = setup(0)
    expected = train(*straight, range(4))
    first = setup(0)
    train(*first, range(2))
    measured = ampkit.measured_state_bytes(*first)
    save_sharded_checkpoint(path, first[0], first[1])
    resumed = setup(1)
    load_sharded_checkpoint(path, resumed[0], resumed[1])
    moments = type(first[1].state[next(iter(first[0].parameters()))]["exp_avg"].to_local()).__name__
    estimate = ampkit.estimate_memory(_model(), _batch(0), "O2", states=states, sharding="fsdp", world_size=world)
    mixed = estimate.mixed
    return {"resumed": train(*resumed, range(2, 4)), "expected": expected[2:], "measured": measured,
            "estimated": mixed.weights + mixed.optimizer_states, "moments": moments,  # gradients cleared
            "same": all(torch.equal(a.full_tensor(), b.full_tensor())
                        for a, b in zip(straight[0].parameters(), resumed[0].parameters()))}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("states, moments", [("8bit", "OptimState8bit"), ("bf16", "Tensor")])
def test_sharded_moments_on_two_fsdp2_ranks_match_the_estimate_and_resume_bit_identically(
        states: str, moments: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each rank keeps its shards' moments in the format (torchao quantizes each local shard); a sharded
    checkpoint resumes them to the bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks = run_ranks(_fsdp_worker, 2, states, str(tmp_path / "ck"), timeout_s=300)
    for rank in ranks:
        assert rank["moments"] == moments
        assert rank["resumed"] == rank["expected"] and rank["same"]
        counters = 4 * len(list(_model().parameters()))
        assert rank["estimated"] <= rank["measured"] <= rank["estimated"] + counters + 64


def test_compare_plans_a_run_per_format_and_refuses_what_a_setting_cannot_keep() -> None:
    from ampkit.experiment import settings

    configs = settings.plan(model="mlp", precisions=["bf16"], opt_levels=["O2", "O3"], updates=["stochastic"],
                            states=["fp32", "8bit"], computes=["native"], steps=4, batch_size=8)
    assert [c.label for c in configs] == ["fp32", "bf16 O2", "bf16 O2 8bit-states", "bf16 O3 stochastic fp32-states",
                                          "bf16 O3 stochastic 8bit-states"]
    with pytest.raises(ValueError, match=r"states=\['fp32'\] with the bf16 O3 plain setting: states='fp32' at O3"):
        settings.plan(model="mlp", precisions=["bf16"], opt_levels=["O3"], states=["fp32"], steps=4)
    with pytest.raises(ValueError, match=r"precisions=\['fp32'\] runs float32 alone, which ignores states=\['8bit'\]"):
        settings.plan(model="mlp", precisions=["fp32"], states=["8bit"], steps=4)
    with pytest.raises(ValueError, match=r"Unknown optimizer state format 'int8'"):
        settings.plan(model="mlp", precisions=["bf16"], states=["int8"], steps=4)


def test_a_run_with_8bit_states_reports_its_bytes_per_parameter() -> None:
    """compare's training with --states: the run's measured state bytes are the estimate's."""
    from ampkit.experiment.config import RunConfig
    from ampkit.experiment.training import execute

    common = dict(model="mlp", steps=3, batch_size=8, precision="bf16", opt_level="O2", compute="native")
    plain = execute(RunConfig(**common))
    low = execute(RunConfig(**common, states="8bit"))
    assert low.label == "bf16 O2 8bit-states"
    assert plain.state_bytes / plain.parameters == pytest.approx(18.0, abs=0.01)  # float32 gradients: O2's default
    assert low.state_bytes / low.parameters < 12.3  # 18 less 8 of float32 moments, plus 8-bit codes and scales
