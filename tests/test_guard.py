"""ampkit.Guard (issue 43): planted faults (c) and (d), each against the same run without the guard; settings refused.
(The layer watch and its raise: test_guard_layers.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

STEPS = 30


def _setup(level: str = "O2", dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, dtype, compute="native")


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).repeat(1, 4)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, guard: ampkit.Guard | None,
           batch: object = _batch, scaler: object = None, plant: object = None, steps: int = STEPS,
           forward: object = None, loss_fn: object = nn.functional.mse_loss) -> list[float]:
    """``steps`` steps of ``loss_fn`` (mean square error) on ``batch(step)``, through the guard, else the scaler,
    else plainly; ``plant(step)`` first, where given (a fault planted at a step); ``forward(x)`` in place of
    ``model(x)``."""
    losses = []
    for step in range(steps):
        if plant is not None:
            plant(step)  # type: ignore[operator]
        optimizer.zero_grad(set_to_none=True)
        x, y = batch(step)  # type: ignore[operator]
        loss = loss_fn((forward or model)(x).float(), y)  # type: ignore[operator]
        (scaler.scale(loss) if scaler is not None else loss).backward()  # type: ignore[attr-defined]
        if guard is not None:
            guard.step(loss, batch=(x, y))
        elif scaler is not None:
            scaler.step(optimizer)  # type: ignore[attr-defined]
            scaler.update()  # type: ignore[attr-defined]
        else:
            optimizer.step()
        losses.append(loss.item())
    return losses


def _nan_at_12(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    if step == 12:
        x = x.clone()
        x[3, 5] = math.nan
    return x, y


def test_a_batch_with_a_nan_is_skipped_and_named_and_training_goes_on() -> None:
    """Issue 43's fault (c): unguarded, one NaN batch makes every weight NaN for good; guarded, that step is skipped,
    the batch named, and the run ends as the run without that batch does."""
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer)
    guarded = _train(model, optimizer, guard, _nan_at_12)
    assert [(e.step, e.signal, e.action) for e in guard.events] == [(12, "nonfinite-loss", "skipped")]
    assert "the batch: its tensor 0 holds an inf or a NaN" in guard.events[0].where
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert math.isfinite(guarded[-1])
    plain, plain_optimizer = _setup()
    unguarded = _train(plain, plain_optimizer, None, _nan_at_12)
    assert all(math.isnan(v) for v in unguarded[13:])  # the fault, unguarded


def test_a_weight_gone_non_finite_is_traced_to_its_layer_and_the_last_good_state_restored() -> None:
    """An inf planted in the second linear's master after step 19: the replay names that layer (its input already
    non-finite: the weight), and "restore" puts back the state kept at step 19 (every 10 good steps); training goes
    on, finite."""
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer, action="restore", keep_every=10)

    def planted(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 20:
            with torch.no_grad():
                optimizer.master_params[2][0, 0] = math.inf  # type: ignore[attr-defined]
                model[2].weight[0, 0] = math.inf
        return _batch(step)

    _train(model, optimizer, guard, planted)
    event = guard.events[0]
    assert (event.step, event.signal, event.action) == (20, "nonfinite-loss", "restored step 19")
    assert event.where.startswith("2 (") and "its inputs already non-finite" in event.where
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert len(guard.events) == 1


def test_restore_from_the_last_checkpoint_the_loop_saved(tmp_path: Path) -> None:
    """``checkpoint=``: "restore" puts back the state last saved there (step 15's) instead of a copy in memory; before
    the first save (a NaN batch at step 3) it only skips. Against the weights of that save, to the bit."""
    model, optimizer = _setup()
    path = tmp_path / "last.pt"
    guard = ampkit.Guard(model, optimizer, action="restore", checkpoint=path)
    saved: dict[str, torch.Tensor] = {}

    def planted(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 15:
            ampkit.save_checkpoint(path, model=model, optimizer=optimizer)
            saved.update({k: v.clone() for k, v in model.state_dict().items()})
        if step == 20:
            with torch.no_grad():
                optimizer.master_params[2][0, 0] = math.inf  # type: ignore[attr-defined]
                model[2].weight[0, 0] = math.inf
        return _nan_at_3(step)

    _train(model, optimizer, guard, planted, steps=21)
    assert [e.action for e in guard.events] == [f"skipped (no checkpoint at {path} yet)", f"restored {path}"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())


def _nan_at_3(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    return (torch.full_like(x, math.nan), y) if step == 3 else (x, y)


def test_a_loss_spike_beyond_its_recent_history_is_skipped() -> None:
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer, window=10)

    def spiking(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _batch(step)
        return (x, y * 100) if step == 25 else (x, y)

    weights: dict[int, list[torch.Tensor]] = {}
    _train(model, optimizer, guard, spiking)
    assert [(e.step, e.signal, e.action) for e in guard.events] == [(25, "loss-spike", "skipped")]
    assert "over the last 10 steps" in guard.events[0].where
    del weights


@pytest.mark.parametrize("spike_factor", [3.0, math.inf], ids=["factor-3", "factor-off"])
def test_a_loss_over_k_times_its_running_median_is_a_spike_where_the_band_misses_it(spike_factor: float) -> None:
    """Issue 66's spike rule: a loss over ``spike_factor`` times its running median. A noisy run (losses 1 and 3 in
    turn: mean 2, standard deviation 1) puts the 6-sigma band at 8; a loss of 7 is over 3 times the median (6)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = ampkit.Guard(model, optimizer, window=10, spike_factor=spike_factor)  # the default, 10, misses it
    for step in range(24):
        optimizer.zero_grad(set_to_none=True)
        value = 7.0 if step == 20 else (1.0, 3.0)[step % 2]
        loss = model(torch.ones(2, 4)).sum() * 0 + value
        loss.backward()
        guard.step(loss)
    found = [(e.step, e.signal, e.action) for e in guard.events]
    assert found == ([(20, "loss-spike", "skipped")] if spike_factor == 3.0 else [])
    if found:
        assert "(median 2) over the last 10 steps" in guard.events[0].where


def test_repeated_skips_of_a_float16_scaler_are_recorded() -> None:
    """A scaler that skips every step (the loss overflows float16 at any scale): the guard records it once it has
    skipped max_skips in a row; the scaler keeps its own decisions."""
    model, optimizer = _setup("O2", torch.float16)
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**16, min_scale=1.0)
    guard = ampkit.Guard(model, optimizer, scaler, max_skips=3)

    def overflowing(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _batch(step)
        return x * 1e4, y

    before = [p.detach().clone() for p in model.parameters()]
    for step in range(6):  # the scaler itself gives up (NonFiniteError) after 10 skips at its smallest scale
        optimizer.zero_grad(set_to_none=True)
        x, y = overflowing(step)
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        assert not guard.step(loss, batch=(x, y))
    skips = [e for e in guard.events if e.signal == "repeated-skips"]
    assert skips and skips[0].step == 2 and "skipped 3 steps in a row" in skips[0].where
    assert scaler.stats.skipped > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_sound_run_is_untouched_by_the_guard() -> None:
    """No event, and the same losses and weights as the run without the guard, to the bit."""
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer, action="restore")
    guarded = _train(model, optimizer, guard)
    plain, plain_optimizer = _setup()
    assert _train(plain, plain_optimizer, None) == guarded and guard.events == []
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_the_timeline_and_the_plot_are_written(tmp_path: Path) -> None:
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer)
    _train(model, optimizer, guard, _nan_at_12)
    timeline = json.loads(guard.write_timeline(tmp_path / "guard.json").read_text())
    assert timeline["steps"] == STEPS and timeline["losses"][12] is None
    assert timeline["events"][0]["signal"] == "nonfinite-loss" and timeline["events"][0]["step"] == 12
    png = guard.write_plot(tmp_path / "guard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.parametrize("options, match", [
    (dict(action="lower"), r"Unknown action 'lower'. Choose one of \['skip', 'restore', 'raise'\]"),
    (dict(scaler=torch.amp.GradScaler("cpu")), r"torch.amp.GradScaler does not say whether it skipped a step"),
    (dict(spike_sigmas=0), r"spike_sigmas=0 is invalid"),
    (dict(spike_factor=1), r"spike_factor=1 is invalid: a number > 1"),
    (dict(window=2), r"window=2 is invalid: an integer >= 4"),
    (dict(keep_every=0), r"keep_every=0 is invalid"),
    (dict(sample_every=-1), r"sample_every=-1 is invalid: an integer >= 0"),
    (dict(saturation=0), r"saturation=0 is invalid: a fraction in \(0, 1\]"),
    (dict(near_overflow=1.5), r"near_overflow=1.5 is invalid"),
    (dict(checkpoint="last.pt"), r"checkpoint='last.pt' is where action='restore' reads the state it puts back"),
    # a folder was accepted, and the first bad step raised FileNotFoundError
    (dict(action="restore", checkpoint="."), r"checkpoint='.' is a folder: pass the file the loop writes with "
                                              r"ampkit.save_checkpoint"),
    (dict(action="restore", checkpoint="no/such/folder/last.pt"), r"is in a folder that does not exist"),
    (dict(max_refused=0), r"max_refused=0 is invalid: an integer >= 1"),
])
def test_bad_guard_settings_are_refused(options: dict, match: str) -> None:
    model, optimizer = _setup()
    with pytest.raises(ValueError, match=match):
        ampkit.Guard(model, optimizer, **options)


def test_an_optimizer_of_another_model_is_refused() -> None:
    model, _ = _setup()
    other, other_optimizer = _setup()
    with pytest.raises(ValueError, match=r"The optimizer steps 4 tensor\(s\) that are not parameters of this model"):
        ampkit.Guard(model, other_optimizer)


def test_raise_on_an_fsdp2_model_takes_its_block_scaled_layers_in_place_and_refuses_fp8_all_gathers() -> None:
    """A raise replaces a layer's forward, not the module FSDP2 gathers into: a block-scaled layer of a sharded model
    is raised to a plain linear on its gathered weights (on 2 ranks, 16-bit layers: tests/test_guard_layers.py).
    Weights torchao all-gathers in FP8 are cast at the all-gather whatever the layer computes: refused at the first
    call, before any hook."""
    import socket

    import torch.distributed as dist

    from ampkit.distributed import fully_shard, prepare_optimizer
    from ampkit.formats.block_linear import BlockScaledLinear
    from ampkit.formats.recipes import BlockScaledRecipe
    from ampkit.guard import layers

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        torch.manual_seed(0)
        block = BlockScaledLinear.from_linear(nn.Linear(32, 32), BlockScaledRecipe("mxfp8"))
        model = fully_shard(nn.Sequential(nn.Linear(4, 32), block), opt_level="O1", dtype=torch.bfloat16)
        optimizer = prepare_optimizer(model, torch.optim.AdamW(model.parameters()))
        guard = ampkit.Guard(model, optimizer, action="raise")
        assert guard.agreement.world == 1 and guard.agreement.group is not None  # found on the shards
        x = torch.randn(8, 4)
        quantized = model(x)
        assert guard.raises.raise_("1", 0) == "raised to 16 bits" and model[1] is block
        raised = model(x)  # the plain 16-bit linear of the region, on the gathered weights
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            hidden = F.linear(x, model[0].weight.full_tensor(), model[0].bias.full_tensor())
            plain = F.linear(hidden, block.weight.full_tensor(), block.bias.full_tensor())
        assert torch.equal(raised.float(), plain.float()) and not torch.equal(raised.float(), quantized.float())
        raised.float().sum().backward()
        assert block.weight.grad is not None and layers.kind(block) == "16-bit"

        pytest.importorskip("torchao.float8")
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        ampkit.convert_to_fp8(model, ampkit.Fp8Recipe(scaling="current", fsdp_all_gather=True), include=["0"],
                              emulate=True)
        model = fully_shard(model, opt_level="O2", dtype=torch.bfloat16)
        hooks = [len(m._forward_hooks) for m in model.modules()]
        with pytest.raises(ValueError, match=r"action='raise' cannot raise the layers of an FSDP2 model whose "
                                             r"weights torchao all-gathers in FP8 \(0.weight, \.\.\.\)"):
            ampkit.Guard(model, prepare_optimizer(model, torch.optim.AdamW(model.parameters())), action="raise")
        assert [len(m._forward_hooks) for m in model.modules()] == hooks
    finally:
        dist.destroy_process_group()


def test_a_nan_batch_under_a_float16_scaler_is_skipped_before_the_scaler_sees_it() -> None:
    """float16 O2 with ampkit's dynamic scaler: the guard drops the NaN batch's step itself (the scaler never counts
    it as an overflow, nor lowers its scale for it), and the scaler goes on with the next step."""
    model, optimizer = _setup("O2", torch.float16)
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler)
    _train(model, optimizer, guard, _nan_at_12, scaler)
    assert [(e.step, e.signal) for e in guard.events] == [(12, "nonfinite-loss")]
    assert scaler.stats.steps + scaler.stats.skipped == STEPS - 1  # every step but the guard's reached the scaler
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_non_finite_gradient_with_a_finite_loss_is_skipped_and_said_transient() -> None:
    """An inf that reaches a gradient but not the loss (planted after the backward, as a bit flip or a faulty
    reduction would leave it): without a scaler the guard checks the gradients itself; the replay, a re-run of the
    step from its state, does not reproduce it: a transient fault, said so."""
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer)
    x, y = _batch(0)
    nn.functional.mse_loss(model(x).float(), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    model[0].weight.grad[0, 0] = math.inf
    loss = nn.functional.mse_loss(model(x).float(), y)
    assert not guard.step(loss, batch=(x, y))
    assert [(e.signal, e.where) for e in guard.events] == [
        ("nonfinite-gradient", "transient: not reproduced by a replay of the batch (the run's transient fault 1)")]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and model[0].weight.grad is None


def test_under_a_float16_scaler_a_bit_flip_is_transient_and_an_overflow_a_lower_scale_cures_is_the_scalers() -> None:
    """A skip of the loss scaler's is re-run from the step's state at its scale: a bit flip in a gradient, which the
    scaler took for an overflow and skipped with no word, is not reproduced there and is said transient; an
    overflow of a scale grown too far is reproduced at that scale and not unscaled: the scaler's own, no event."""
    model, optimizer = _setup("O1", torch.float16)
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler)
    for step in range(12):
        if step == 9:
            scaler.update(2.0**24)  # float16 gradients cannot hold the loss x 2**24
        optimizer.zero_grad(set_to_none=True)
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == 5:
            model[2].weight.grad.view(torch.int32)[1, 2] |= 0x7F800000  # every exponent bit set: an inf or a NaN
        guard.step(loss, batch=(x, y))
    assert [(e.step, e.signal) for e in guard.events] == [(5, "nonfinite-gradient")]
    assert guard.events[0].where == ("transient: not reproduced by a replay of the batch at loss scale 65536 (the "
                                     "run's transient fault 1)") and guard.transients == [5]
    assert scaler.stats.skipped == 4  # step 5, and 9 to 11 while the scale came down: one event


class _MaskFault(nn.Module):
    """Armed, its output is inf for the dropout mask it first saw (kept, as an attribute, by the replay's copy) and
    finite for any other: a fault that one mask makes."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.seen = False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        if self.seen is None:
            self.seen = x != 0
        return x * math.inf if torch.equal(x != 0, self.seen) else x


def test_a_replay_draws_the_dropout_masks_of_the_step_it_re_runs() -> None:
    """The replay re-runs each micro-batch from the random state its forward began with: a fault that only the
    step's dropout mask makes is reproduced and named (it read as transient, the replay's masks drawn anew)."""
    torch.manual_seed(0)
    fault = _MaskFault()
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), fault, nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = ampkit.Guard(model, optimizer)
    for step in range(4):
        fault.armed = step == 2
        optimizer.zero_grad(set_to_none=True)
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss, batch=(x, y))
    (event,) = guard.events
    assert (event.step, event.signal, event.layer) == (2, "nonfinite-loss", "2"), event
    assert event.where.startswith("2 (mul in forward")
    assert guard.transients == []


@pytest.mark.parametrize("loss, match", [(0.5, r"got 0.5"), (torch.ones(3), r"got a tensor of shape \(3,\)")])
def test_a_loss_that_is_not_one_value_is_refused_before_anything_changes(loss: object, match: str) -> None:
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer)
    with pytest.raises(ValueError, match=r"Guard.step takes the step's loss as a one-element tensor .*" + match):
        guard.step(loss)  # type: ignore[arg-type]
    assert guard.step_count == 0 and guard.events == []


def test_a_batch_and_micro_batches_together_are_refused_before_anything_changes() -> None:
    model, optimizer = _setup()
    guard = ampkit.Guard(model, optimizer)
    x, y = _batch(0)
    loss = nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    with pytest.raises(ValueError, match=r"pass the step's micro-batches as one list, batches=\[...\], and no batch="):
        guard.step(loss, batch=(x, y), batches=[(x, y)])
    assert guard.step_count == 0 and model[0].weight.grad is not None


def test_transient_faults_are_counted_and_past_suspect_after_the_machine_is_suspected() -> None:
    """Fault (e): a bit flip in one step's gradient is named transient (the step re-run from its state is sound),
    that step alone is skipped (the run is, loss for loss, the unfaulted run without those steps), and three in a
    run make a "suspect-machine" event."""
    flips = (5, 11, 17)
    model, optimizer = _setup()
    without: list[float] = []  # the unfaulted run, the flipped steps not taken
    reference_model, reference_optimizer = _setup()
    for step in range(STEPS):
        reference_optimizer.zero_grad(set_to_none=True)
        x, y = _batch(step)
        loss = nn.functional.mse_loss(reference_model(x).float(), y)
        loss.backward()
        if step not in flips:
            reference_optimizer.step()
        without.append(loss.item())
    guard = ampkit.Guard(model, optimizer, suspect_after=3)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        if step in flips:
            model[2].weight.grad.view(torch.int32)[1, 2] |= 0x7F800000  # every exponent bit set: an inf or a NaN
        guard.step(loss, batch=(x, y))
        losses.append(loss.item())
    assert [(e.step, e.signal) for e in guard.events] == [(5, "nonfinite-gradient"), (11, "nonfinite-gradient"),
                                                         (17, "nonfinite-gradient"), (17, "suspect-machine")]
    assert all(e.where.startswith("transient: ") for e in guard.events[:3]) and guard.transients == list(flips)
    assert "3 transient faults (steps 5, 11, 17)" in guard.events[3].where
    assert losses == without
