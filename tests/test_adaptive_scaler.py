"""AdaptiveLossScaler: per-layer scales keep a small-gradient layer that a global scale flushes."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import ampkit
from ampkit import AdaptiveLossScaler, DynamicLossScaler

A_OUTPUT_WEIGHT = 2.0**-6


class TwoHeads(nn.Module):
    """out = A(x1) / 64 + B(x2): with loss = out.sum(), A's weight gradients are x1 / 64 and B's x2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 4, bias=False)
        self.b = nn.Linear(32, 4, bias=False)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.a(x1).float() * A_OUTPUT_WEIGHT + self.b(x2).float()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    # x1: powers of two from 1 down to float16's smallest subnormal 2**-24 (exact in float16),
    # so A's gradients span 2**-6 .. 2**-30, as a layer's gradients span many octaves; B's are 2**14.
    x1 = torch.pow(2.0, -(torch.arange(32) % 25).float()).reshape(1, 32)
    x2 = torch.full((1, 32), 2.0**14)
    return x1, x2


def _train(scaler_of, steps: int = 30):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TwoHeads()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), "O2", torch.float16,
                                   compute="float32")
    scaler = scaler_of(model)
    x1, x2 = _inputs()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(x1, x2).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    return model, opt, scaler


def test_two_layers_2_20_apart_global_scale_flushes_the_small_one_adaptive_keeps_both() -> None:
    x1, x2 = _inputs()
    expected_a, expected_b = x1.expand(4, 32) * A_OUTPUT_WEIGHT, x2.expand(4, 32)  # the float32 gradients
    assert expected_b.abs().max() / expected_a.abs().max() == 2.0**20

    _, opt, scaler = _train(lambda model: DynamicLossScaler())
    grads = [m.grad for m in opt.master_params]  # float32 masters, unscaled
    assert scaler.stats.skipped == 15  # halving from 2**16 to 2
    # The global scale settles where B's 2**14 fits float16 (max 65504): 2, after backing off from 2**16.
    assert scaler.get_scale() == 2.0
    flushed = (grads[0] == 0) & (expected_a != 0)
    # Whatever falls below float16's smallest subnormal (2**-24) once scaled by 2 rounds to 0 (2**-25 ties to even).
    assert torch.equal(flushed, expected_a < 2.0**-25)
    assert flushed.float().mean() > 0.1
    assert torch.equal(grads[1], expected_b)

    _, opt, scaler = _train(lambda model: AdaptiveLossScaler(model))
    grads = [m.grad for m in opt.master_params]
    assert torch.equal(grads[0], expected_a)  # every value kept, exactly
    assert torch.equal(grads[1], expected_b)
    scales = {s.name: s.scale for s in scaler.layer_stats}
    # The largest power of two that keeps a layer's amax 2 powers of two (the margin) below float16's
    # max 65504: 2**-6 * 2**19 = 2**13 <= 65504 / 4; B's would be 2**-1, held at min_scale 1.
    assert scales == {"a": 2.0**19, "b": 1.0}
    assert scaler.layer_scale("a") == 2.0**19
    # One global back-off (the loss gradient 2**16 overflows float16), then B's own scale halves
    # from 2**16 as the global one did; A's never overflowed.
    assert scaler.stats.skipped == 16
    assert [s.overflows for s in scaler.layer_stats] == [0, 15]


def test_an_overflowing_layer_backs_off_alone_and_the_step_is_skipped() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = AdaptiveLossScaler(model, init_scale=2.0**10)
    x = torch.randn(4, 8).half()
    scaler.scale(model(x).float().sum()).backward()
    assert scaler.step(opt)
    scaler.update()
    before = {s.name: s.scale for s in scaler.layer_stats}
    global_before = scaler.get_scale()

    weights = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    scaler.scale(model(x).float().sum()).backward()
    model[2].weight.grad[0, 0] = float("inf")  # the last layer's own weight gradient overflows
    assert not scaler.step(opt)
    scaler.update()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # skipped: unchanged
    after = {s.name: s.scale for s in scaler.layer_stats}
    assert after["2"] == before["2"] / 2  # only that layer backs off
    assert after["0"] == before["0"]
    assert scaler.get_scale() == global_before
    assert [s.overflows for s in scaler.layer_stats] == [0, 1]


def test_an_iteration_reads_the_device_once_as_dynamic_loss_scaling_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer statistics travel with the overflow flag: one host read per step + update."""
    reads: list[str] = []
    for method in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, method)

        def counting(self, *args, _original=original, _method=method):  # type: ignore[no-untyped-def]
            reads.append(_method)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, method, counting)
    x = torch.randn(4, 8).half()
    for make in (DynamicLossScaler, AdaptiveLossScaler):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make(model) if make is AdaptiveLossScaler else make()
        counts = []
        for _ in range(3):
            reads.clear()
            scaler.scale(model(x).float().sum()).backward()
            scaler.step(opt)
            scaler.update()
            counts.append(len(reads))
        assert counts == [1, 1, 1], (make.__name__, counts)


def test_gradients_match_float32_through_residuals_and_tied_weights() -> None:
    """Outside the brackets all gradients are at the global scale, so a residual sum and a weight
    tied across two modules get the same gradients as unscaled float32."""
    from ampkit.experiment.models import GPT

    torch.manual_seed(0)
    reference = GPT(vocab_size=32, context=16, d_model=32, n_layers=2, n_heads=2)
    model = copy.deepcopy(reference)
    idx = torch.randint(0, 32, (2, 16))
    reference(idx).float().square().mean().backward()
    scaler = AdaptiveLossScaler(model)
    assert "tok+lm_head" in scaler.names  # the tied weight is one layer
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(2):  # the second step runs with scales set from the first one's statistics
        opt.zero_grad()
        scaler.scale(model(idx).float().square().mean()).backward()
        scaler.unscale_(opt)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9, msg=name)
        assert scaler.step(opt)
        scaler.update()
    assert len({s.scale for s in scaler.layer_stats}) > 1  # the layers did get different scales


def test_float32_compute_still_recomputes_a_gelu_output_behind_the_brackets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The brackets' identity rescaling sits between a GELU and the next linear; the linear sees
    through it (``gelu_recompute.identity_forward``) and saves one hidden tensor, not two."""
    from ampkit.float32_compute import fast_paths
    from ampkit.diagnostics.memory import saved_bytes_of_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    policy = ampkit.Policy.default("cpu", torch.float16, compute="float32")
    scaler = AdaptiveLossScaler(model)

    def run() -> tuple[int, list[torch.Tensor]]:
        model.zero_grad()

        def step() -> torch.Tensor:
            with ampkit.autocast(policy):
                return model(x).float().square().mean()

        loss, saved = saved_bytes_of_step(model, step)
        scaler.scale(loss).backward()
        return saved, [p.grad.clone() for p in model.parameters()]

    recomputing, grads = run()
    monkeypatch.setattr(fast_paths, "gelu_input", lambda t: None)
    saving, saved_grads = run()
    assert saving - recomputing == 8 * 64 * 2  # the float16 GELU output
    assert all(torch.equal(a, b) for a, b in zip(grads, saved_grads))


def test_a_rebuilt_optimizer_taking_a_freed_ones_id_still_unscales_by_each_layers_scale() -> None:
    # A training loop that builds a new optimizer (a new phase, a resume) keeps its scaler. CPython gives a new
    # object the address of one just freed now and then, and the scaler once took "this id was mapped" for "these
    # masters were mapped": A's master gradients were then unscaled by the global scale, silently wrong.
    from ampkit.optim.master import MasterWeightOptimizer

    model, opt, scaler = _train(lambda model: AdaptiveLossScaler(model))
    x1, x2 = _inputs()
    expected_a = x1.expand(4, 32) * A_OUTPUT_WEIGHT
    seen, reused, old_masters = {id(opt)}, 0, []
    for _ in range(300):  # until 3 rebuilds took a freed id (1 in 6 did when written)
        old_masters.append(opt.master_params)  # kept: new masters with old ids would hide the fault
        del opt
        gc.collect()
        opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
        reused += id(opt) in seen
        seen.add(id(opt))
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            scaler.scale(model(x1, x2).float().sum()).backward()
            scaler.step(opt)
            scaler.update()
        assert torch.equal(opt.master_params[0].grad, expected_a)
        if reused == 3:
            break
    assert reused == 3  # the case this test is for happened


def test_state_dict_round_trip_resumes_identically() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).half()
    scaler = AdaptiveLossScaler(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 8).half()).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    state = scaler.state_dict()
    other = AdaptiveLossScaler(copy.deepcopy(model))
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert state["adaptive_version"] == 1 and state["layer_names"] == ["0", "2"]
    with pytest.raises(RuntimeError, match=r"missing keys \['adaptive_version'"):
        other.load_state_dict(DynamicLossScaler().state_dict())
    with pytest.raises(RuntimeError, match="build the scaler on the model the state was saved from"):
        AdaptiveLossScaler(nn.Linear(2, 2)).load_state_dict(state)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"margin=-1 is invalid"):
        AdaptiveLossScaler(nn.Linear(2, 2), margin=-1)
    with pytest.raises(ValueError, match="takes the nn.Module it scales"):
        AdaptiveLossScaler(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no trainable parameters"):
        AdaptiveLossScaler(nn.ReLU())


def _distributed_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from ampkit.distributed import Compression, DistributedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = DistributedOptimizer(ampkit.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
                               model.named_parameters(), compression=Compression.fp16)
    model.half()
    scaler = AdaptiveLossScaler(model, process_group=dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        opt.zero_grad()
        # Rank 1's inputs are 2**6 larger: its local statistics alone would give other scales.
        x = torch.randn(4, 8, generator=g).half() * (64 if rank == 1 else 1)
        scaler.scale(model(x).float().square().mean()).backward()
        if rank == 1 and step == 2:
            model[2].weight.grad[0, 0] = float("inf")  # only rank 1 sees it
        scaler.step(opt)
        scaler.update()
    return {"scales": [s.scale for s in scaler.layer_stats], "overflows": [s.overflows for s in scaler.layer_stats],
            "skipped": scaler.stats.skipped, "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.distributed
def test_ranks_agree_on_layer_scales_and_skips() -> None:
    from multiprocess import run_ranks

    results = run_ranks(_distributed_worker, 2)
    assert results[0]["scales"] == results[1]["scales"]
    assert results[0]["overflows"] == results[1]["overflows"]
    assert results[0]["overflows"][1] >= 1  # rank 1's inf, blamed on layer "2" on both ranks
    assert results[0]["skipped"] == results[1]["skipped"] >= 1
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        assert torch.equal(a, b)
