"""ampkit.Guard's layer watch and its raise action (issue 43's faults (a) and (b)), each against the same run without
the guard and the run without the fault."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit
import test_guard
from ampkit.experiment.models import ChannelScale, GrowingLinear
from ampkit.formats.fp8 import Fp8Linear, Fp8Recipe
from ampkit.guard import layers
from ampkit.guard.replay import NOT_REPRODUCED, Replay
from ampkit.scaling.scaler import NonFiniteError

STEPS = 40


def _growing(rate: float, level: str = "O1") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), GrowingLinear(32, 32, rate=rate), nn.LayerNorm(32), nn.ReLU(),
                          nn.Linear(32, 4))
    return ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, torch.float16,
                             compute="native")


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).repeat(1, 4)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, guard: ampkit.Guard | None, scaler: object,
           plant: object = None, steps: int = STEPS) -> list[float]:
    return test_guard._train(model, optimizer, guard, _batch, scaler, plant, steps)


def _final(losses: list[float]) -> float:
    """The final loss: the mean of the last 20 steps' (each step's batch differs)."""
    return sum(losses[-20:]) / 20


def test_a_layer_overflowing_float16_is_named_within_one_step_and_raised_to_float32() -> None:
    """Fault (a): a layer's weights grow until its float16 output overflows. Unguarded, the dynamic scaler skips every
    step from then on (the forward overflows at any scale) until it gives up; guarded, the layer is named at the first
    overflowing step, raised to float32, and the run ends within 2% of the unfaulted run's final loss (100 steps)."""
    unfaulted = _train(*_growing(rate=1.0), None, ampkit.DynamicLossScaler(), steps=100)
    model, optimizer = _growing(rate=2.0)
    scaler = ampkit.DynamicLossScaler()
    with pytest.raises(NonFiniteError, match="10 optimizer steps in a row were skipped at a loss scale that cannot"):
        _train(model, optimizer, None, scaler, steps=100)  # diverges: it skips every step, then gives up
    first = next(step for step, _, overflow in scaler.stats.history if overflow)
    assert all(overflow for _, _, overflow in scaler.stats.history[first:])

    model, optimizer = _growing(rate=2.0)
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise")
    guarded = _train(model, optimizer, guard, scaler, steps=100)
    event = guard.events[0]
    assert event.signal == "nonfinite-loss" and event.layer == "1" and event.action == "raised to float32 and skipped", event
    assert event.step == first  # named at the first overflowing step
    assert guarded[event.step - 1] == pytest.approx(unfaulted[event.step - 1], rel=0.02)  # finite until then
    assert not math.isfinite(guarded[event.step])  # named at the first overflowing step
    assert len(guard.events) == 1 and guard.raised == {"1": "float32"}
    assert all(math.isfinite(v) for v in guarded[event.step + 1:])
    assert _final(guarded) == pytest.approx(_final(unfaulted), rel=0.02)


def test_at_o2_an_overflowing_layer_computes_from_its_float32_masters_and_returns_rounded() -> None:
    """Fault (a) at O2 (issue 66's second item; refused before: the layer's weights are float16): the layer is named
    at the first overflowing step and raised, its weights now its masters' float32 values, which the optimizer goes
    on stepping (the layer's gradients float32, its masters' own); after its quiet window the layer returns, its
    weights rounded to float16 from the masters again, and (the fault persisting) is raised again; the run ends
    within 2% of the unfaulted O2 run."""
    unfaulted = _train(*_growing(rate=1.0, level="O2"), None, ampkit.DynamicLossScaler(), steps=100)
    model, optimizer = _growing(rate=2.0, level="O2")
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise", quiet_window=60)
    layer, master = model[1], optimizer.master_params[2]  # the growing layer's weight's master
    held: list[tuple[torch.dtype, bool, bool]] = []

    def plant(step: int) -> None:  # before each step: the layer's weight's dtype, whether it is its master's value,
        # and whether it is its master's value rounded to that dtype
        weight = layer.weight.detach()
        held.append((weight.dtype, torch.equal(weight.float(), master), torch.equal(weight, master.to(weight.dtype))))

    guarded = _train(model, optimizer, guard, scaler, plant=plant, steps=100)
    raised, returned, again = guard.events
    assert (raised.signal, raised.layer, raised.action) == ("nonfinite-loss", "1", "raised to float32 and skipped")
    assert not math.isfinite(guarded[raised.step]) and all(math.isfinite(v) for v in guarded[:raised.step])
    # float16 until the raise, then float32 and the master's own values until it returns after 60 quiet steps
    assert {dtype for dtype, _, _ in held[:raised.step + 1]} == {torch.float16}
    assert held[raised.step + 1:returned.step + 1] == [(torch.float32, True, True)] * 60
    assert (returned.signal, returned.step, returned.action) == ("layer-returned", raised.step + 60,
                                                                 "returned to 16 bits")
    assert held[returned.step + 1] == (torch.float16, False, True)  # rounded from the master when it returned
    # the fault still there (its gain stays at 2**24): raised again at the next step, its window now doubled
    assert (again.step, again.layer, again.action) == (returned.step + 1, "1", "raised to float32 and skipped")
    assert "should it fail again: 120" in returned.where
    finite = [v for v in guarded[raised.step + 1:] if math.isfinite(v)]
    assert len(finite) == len(guarded) - raised.step - 2  # the two raised steps skipped, nothing else
    assert again.step < 81 and sum(guarded[-19:]) / 19 == pytest.approx(sum(unfaulted[-19:]) / 19, rel=0.02)


def test_at_o2_a_raised_block_computes_its_children_in_float32_where_inputs_are_cast() -> None:
    """A raised module that holds linears (a transformers MLP, a block) at O2 where a kept float32 module's output
    reaches 16-bit layers, so each casts its inputs to float16: the raised block's children have float32 weights
    (their masters') and took float16 inputs: its first call raised torch's dtype mismatch of a GEMM (found by a
    gradient-only fault on a Llama's MLP, tests/test_guard_llama.py). Now they take their inputs as the block gives
    them, in float32: its output is the block's float32 function of the masters' values."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model = nn.Sequential(nn.Embedding(32, 16), block, nn.Linear(16, 4))
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), "O2", torch.float16,
                                         keep_float32=[nn.Embedding], compute="native")
    tokens = torch.randint(0, 32, (8,))
    layers.raise_layer(model, "1", optimizer.master_of)
    assert {p.dtype for p in block.parameters()} == {torch.float32}
    with torch.no_grad():
        output = block(model[0](tokens))
        assert output.dtype == torch.float32
        hidden = torch.relu(F.linear(model[0](tokens), block[0].weight, block[0].bias))
        assert torch.equal(output, F.linear(hidden, block[2].weight, block[2].bias))


def tiny_llama() -> nn.Module:
    """A transformers Llama of 2 layers, 64 wide, over 128 tokens, its random weights seeded with 0."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _growing_llama(level: str, rate: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A transformers Llama whose first attention output projection grows (``GrowingLinear``, from step 10) until its
    float16 output overflows (about step 30): the fault issue 66 names, at ``level`` (or, "autocast", a float32 model
    for the loop's own torch.autocast)."""
    model = tiny_llama()
    attention = model.model.layers[0].self_attn
    attention.o_proj = GrowingLinear.from_linear(attention.o_proj, rate, start=10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if level == "autocast":
        return model, optimizer
    return ampkit.initialize(model, optimizer, level, torch.float16, compute="native")


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight windows of 32 tokens, each one or two past the one before, at random (a loss that falls to about 0.85
    in 100 steps, not to 0)."""
    g = torch.Generator().manual_seed(step)
    starts, steps = torch.randint(0, 128, (8, 1), generator=g), torch.randint(1, 3, (8, 32), generator=g)
    tokens = torch.cat([starts, starts + steps.cumsum(1)], 1) % 128
    return tokens[:, :-1], tokens[:, 1:]


def _train_llama(level: str, rate: float, guarded: bool, compiled: bool = False
                 ) -> tuple[list[float], ampkit.Guard | None]:
    model, optimizer = _growing_llama(level, rate)
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise") if guarded else None
    region = torch.autocast("cpu", torch.float16) if level == "autocast" else contextlib.nullcontext()
    if compiled:
        torch.compiler.reset()
    run = torch.compile(model) if compiled else model

    def forward(x: torch.Tensor) -> torch.Tensor:
        with region:
            return run(x).logits.reshape(-1, 128)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _tokens(step)
        return x, y.reshape(-1)

    return test_guard._train(model, optimizer, guard, batch, scaler, steps=100, forward=forward,
                             loss_fn=F.cross_entropy), guard


@pytest.mark.parametrize("level, compiled", [("O1", False), ("O2", False), ("autocast", False),
                                             pytest.param("O1", True, marks=pytest.mark.slow)])  # inductor: 100 s
def test_a_llama_whose_attention_projection_overflows_float16_is_named_raised_and_trains_on(level: str,
                                                                                            compiled: bool) -> None:
    """Issue 66's user fault on a transformers Llama (at O1, at O2 and in the loop's own torch.autocast; at O1
    compiled by inductor too): the first attention output projection grows until its float16 output overflows.
    Unguarded, the scaler skips every step from then on and gives up; guarded, the projection is named at the first
    overflowing step, raised to float32 once, and the run ends within 1% of the run without the fault (the mean of
    the last 10 losses; the compiled runs against the compiled unfaulted one)."""
    unfaulted, _ = _train_llama(level, 1.0, guarded=False, compiled=compiled)
    if not compiled:  # the same fault, eager: enough to show the run dies without the guard
        with pytest.raises(NonFiniteError, match="optimizer steps in a row were skipped"):
            _train_llama(level, 2.0, guarded=False)
    losses, guard = _train_llama(level, 2.0, guarded=True, compiled=compiled)
    [event] = guard.events
    assert (event.signal, event.layer, event.action) == ("nonfinite-loss", "model.layers.0.self_attn.o_proj",
                                                         "raised to float32 and skipped")
    assert all(math.isfinite(v) for v in losses[:event.step]) and not math.isfinite(losses[event.step])
    assert all(math.isfinite(v) for v in losses[event.step + 1:])
    assert sum(losses[-10:]) / 10 == pytest.approx(sum(unfaulted[-10:]) / 10, rel=0.01)


def _outlier_model() -> tuple[nn.Module, torch.optim.Optimizer, ChannelScale, nn.Module]:
    torch.manual_seed(0)
    head = nn.Linear(64, 4)
    outlier = ChannelScale(64, channel=7, factor=1.0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), outlier, Fp8Linear.from_linear(nn.Linear(64, 64), Fp8Recipe()),
                          nn.GELU(), head)
    mask = torch.ones(64, 64).index_fill_(1, torch.tensor([7]), 0.0)
    model[3].weight.register_hook(lambda grad: grad * mask)  # the outlier's column stays as planted (gpt-outlier's)
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "O1", torch.bfloat16,
                                         compute="native")
    return model, optimizer, outlier, model[3]


def _plant_at(step: int, outlier: ChannelScale, linear: nn.Module) -> object:
    def plant(now: int) -> None:
        if now == step:  # the same function in exact arithmetic: the channel x 1e6, its weight column / 1e6
            with torch.no_grad():
                outlier.scale[7] = 1e6
                linear.weight[:, 7] /= 1e6
    return plant


def test_an_fp8_linear_whose_input_gets_an_outlier_channel_is_named_and_raised_to_16_bits() -> None:
    """Fault (b): an FP8 linear's input gets an outlier channel at step 21 (as gpt-outlier plants it, mid-run). Its
    delayed scale then flushes the other channels to zero; unguarded, the loss moves away from the unfaulted run's;
    guarded (layers sampled every step), the layer is named and raised to 16 bits on the step the outlier came
    (its step taken: the gradients are finite), before the loss moved beyond 1% from the unfaulted run's."""
    model, optimizer, _, _ = _outlier_model()
    unfaulted = _train(model, optimizer, None, None)
    model, optimizer, outlier, linear = _outlier_model()
    unguarded = _train(model, optimizer, None, None, _plant_at(21, outlier, linear))
    assert sum(unguarded[-10:]) > 3 * sum(unfaulted[-10:])  # FP8 flushes all but the outlier channel: lost

    model, optimizer, outlier, linear = _outlier_model()
    guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    guarded = _train(model, optimizer, guard, None, _plant_at(21, outlier, linear))
    event = guard.events[0]
    assert event.layer == "3" and event.signal in ("layer-saturation", "layer-underflow"), event
    assert event.step == 21 and event.action == "raised to 16 bits"
    # in place: the same module (FSDP2 gathers into it) on the optimizer's Parameter, watched as a 16-bit layer
    assert model[3] is linear and layers.kind(linear) == "16-bit" and layers.raised_to(linear) == "float32"
    # raised on the step the outlier came, before the loss moved 1% from the unfaulted run's, and for the next steps
    # it stays there (later, FP8's and bf16's roundings part the two runs' batches by a few percent, not the 3x above)
    assert max(abs(g - u) / u for g, u in zip(guarded[:27], unfaulted[:27])) < 0.01
    assert sum(guarded[-10:]) / 10 == pytest.approx(sum(unfaulted[-10:]) / 10, rel=0.03)
    assert guard.samples[0][0] == 0 and "3" in guard.samples[0][1]


def test_the_steps_between_samples_measure_nothing() -> None:
    """Layers are sampled every ``sample_every`` steps (step 0, N, 2N...), on the step's own forward."""
    model, optimizer, _, _ = _outlier_model()
    guard = ampkit.Guard(model, optimizer, sample_every=7)
    _train(model, optimizer, guard, None)
    assert [step for step, _ in guard.samples] == [0, 7, 14, 21, 28, 35]
    assert set(guard.samples[0][1]) == {"0", "3", "5"}  # the bf16 linears and the FP8 one; not the float32 norms
    guard.close()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    _train(model, optimizer, guard, None)
    assert len(guard.samples) == 6 and guard.step_count == 2 * STEPS


def test_a_layer_signal_without_raise_is_recorded_and_the_step_taken(tmp_path: Path) -> None:
    model, optimizer, outlier, linear = _outlier_model()
    guard = ampkit.Guard(model, optimizer, action="skip", sample_every=1)
    _train(model, optimizer, guard, None, _plant_at(21, outlier, linear))
    assert guard.events and all(e.action == "recorded" and e.layer == "3" for e in guard.events)
    assert layers.kind(model[3]) == "fp8"
    timeline = json.loads(guard.write_timeline(tmp_path / "guard.json").read_text())
    assert timeline["samples"][21]["layers"]["3"]["saturation"] > 0.01
    assert timeline["raised"] == {}
    png = guard.write_plot(tmp_path / "guard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_float16_figures_are_read_from_the_output() -> None:
    out = torch.tensor([1.0, 2.0**-20, -32752.0, 0.0], dtype=torch.float16)
    assert layers.output_figures(out).tolist() == [0.0, pytest.approx(1 / 3), 0.5]  # 2**-20 of 3 nonzero; 32752/65504
    out[0] = -math.inf
    assert layers.output_figures(out).tolist() == [1.0, pytest.approx(1 / 3), 1.0]  # an inf: saturated
    out[0] = math.nan
    assert layers.output_figures(out).tolist()[0] == 1.0
    assert layers.output_figures([out.bfloat16(), out.float()]).tolist() == [1.0, 0.0, 1.0]  # bf16: no underflow
    # float32 (a 16-bit product plus a float32 bias, under autocast): saturated where not finite, else nothing
    assert layers.output_figures(torch.tensor([1.0, -math.inf])).tolist() == [1.0, 0.0, 1.0]
    assert layers.output_figures(torch.tensor([1e30, 2.0**-140])).tolist() == [0.0, 0.0,
                                                                              pytest.approx(1e30 / 3.4028e38, rel=1e-3)]


def test_a_sampled_step_keeps_each_layers_worst_over_its_calls_in_one_table_sorted_by_name() -> None:
    """Two micro-batches through one float16 and one bfloat16 layer: the figures of all 16-bit outputs are made at
    take(), a layer's worst over its calls kept (the second call's inf saturates ``b``, the first call's tiny value
    sets ``a``'s underflow), names sorted for the ranks' reduction, and a clean slate after."""
    model = nn.ModuleDict({"b": nn.Linear(2, 2).bfloat16(), "a": nn.Linear(2, 2).half()})
    watch = layers.LayerWatch(model)
    watch.sampling = True
    with torch.no_grad():
        model["a"].weight.copy_(torch.eye(2)), model["a"].bias.zero_()
        model["b"].weight.copy_(torch.eye(2)), model["b"].bias.zero_()
    with torch.enable_grad():
        model["a"](torch.tensor([[2.0**-20, 1.0]], dtype=torch.float16))
        model["b"](torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16))
        model["a"](torch.tensor([[1.0, 2.0]], dtype=torch.float16))
        model["b"](torch.tensor([[math.inf, 1.0]], dtype=torch.bfloat16))
    names, table = watch.take()
    assert names == ["a", "b"] and table is not None
    assert table[0].tolist() == [0.0, pytest.approx(0.5), pytest.approx(2.0 / 65504.0)]  # 1 of 2 nonzero tiny
    assert table[1].tolist() == [1.0, 0.0, 1.0]
    assert watch.take() == ([], None)


def test_an_o2_run_with_a_raised_layer_resumes_from_its_checkpoint_loss_for_loss(tmp_path: Path) -> None:
    """The raised layer's float32 weights and its masters come back through ``save_checkpoint`` / ``load_checkpoint``
    (the guard restored before the model): the resumed run is the uninterrupted one, loss for loss."""
    def guarded() -> tuple[nn.Module, torch.optim.Optimizer, ampkit.DynamicLossScaler, ampkit.Guard]:
        model, optimizer = _growing(rate=2.0, level="O2")
        scaler = ampkit.DynamicLossScaler()
        return model, optimizer, scaler, ampkit.Guard(model, optimizer, scaler, action="raise")

    def later(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(step + 30)

    model, optimizer, scaler, guard = guarded()
    test_guard._train(model, optimizer, guard, _batch, scaler, steps=30)
    assert guard.raised == {"1": "float32"}
    ampkit.save_checkpoint(tmp_path / "run.pt", model=model, optimizer=optimizer, scaler=scaler, guard=guard)
    uninterrupted = test_guard._train(model, optimizer, guard, later, scaler, steps=20)
    model, optimizer, scaler, guard = guarded()
    ampkit.load_checkpoint(tmp_path / "run.pt", model=model, optimizer=optimizer, scaler=scaler, guard=guard)
    assert guard.raised == {"1": "float32"} and model[1].weight.dtype == torch.float32
    assert test_guard._train(model, optimizer, guard, later, scaler, steps=20) == uninterrupted


class _Scores(nn.Module):
    """Attention by hand: once ``gain`` grows, its float16 scores (q . k) overflow, while its output (a softmax's mix
    of v) stays in range."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(16, 32)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x) * self.gain, self.k(x) * self.gain
        return torch.softmax(q @ k.T / 32 ** 0.5, dim=-1) @ self.v(x)


def _scores(level: str, gain: float) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Scores(), nn.Linear(32, 4))
    model, optimizer = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), level,
                                         torch.float16,
                                         compute="native")

    def plant(step: int) -> None:
        if step == 10:
            model[1].gain = gain

    return model, optimizer, plant


def test_at_o3_a_layer_whose_float16_scores_overflow_computes_on_float32_copies_of_its_weights() -> None:
    """Issue 66's raise at O3 (refused before: its weights are float16, with no float32 masters): the attention whose
    scores overflow float16 from step 10 is named there and raised; it computes on float32 copies of its float16
    weights, which the optimizer goes on stepping (the same Parameters, float16), and rounds its output to float16
    for the rest of the model. No step after the raise is skipped; the run ends within 2% of the same planted run
    in float32, where nothing overflows."""
    model, optimizer, plant = _scores("O0", gain=1000.0)
    reference = _train(model, optimizer, None, None, plant)
    model, optimizer, plant = _scores("O3", gain=1000.0)
    scaler = ampkit.DynamicLossScaler()
    with pytest.raises(NonFiniteError, match="10 optimizer steps in a row were skipped at a loss scale that cannot"):
        _train(model, optimizer, None, scaler, plant)  # every step from the plant on overflows, then it gives up
    assert all(overflow for _, _, overflow in scaler.stats.history[10:])

    model, optimizer, plant = _scores("O3", gain=1000.0)
    weights = list(model[1].parameters())
    held: list[torch.Tensor] = []

    def plant_and_hold(step: int) -> None:  # the plant, and the layer's value weight before each step
        plant(step)
        held.append(model[1].v.weight.detach().clone())

    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise")
    guarded = _train(model, optimizer, guard, scaler, plant_and_hold)
    [event] = guard.events
    assert (event.step, event.signal, event.layer, event.action) == (10, "nonfinite-loss", "1",
                                                                     "raised to float32 and skipped")
    assert all(math.isfinite(v) for v in guarded[:10] + guarded[11:])
    assert list(model[1].parameters()) == weights and {w.dtype for w in weights} == {torch.float16}
    skipped = [step for step, (a, b) in enumerate(zip(held, held[1:])) if torch.equal(a, b)]
    overflowed = [step for step, _, overflow in scaler.stats.history if overflow]  # the scaler's own skips
    assert skipped[0] == 10 and len(skipped) == 1 + len(overflowed) <= 3  # stepped at every other step after
    assert model(torch.randn(2, 16)).dtype == torch.float32  # O3's model output, its raised layer's rounded inside
    assert _final(guarded) == pytest.approx(_final(reference), rel=0.02)


@pytest.mark.slow  # two comparisons of the GPT: 20 s
def test_compare_guard_shows_the_planted_float16_overflow_in_its_table_and_pictures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``ampkit compare --guard`` on the planted float16 case (gpt-overflow: block 0's first MLP linear grows until
    float16 overflows): unguarded, the fp16 run skips every step from the overflow on and ends diverged; guarded, the event is in the
    table, in results.json, on the curves and in the run's guard picture, and the run trains on."""
    from ampkit.cli.main import main

    # --compute float32: the same run and label on every CPU (auto computed only convolutions in float32 where this
    # machine's native fp16 matmuls are faster, and the run was "fp16 O1 fp32-conv")
    args = ["compare", "--model", "gpt-overflow", "--precision", "fp16", "--opt-level", "O1", "--steps", "40",
            "--batch-size", "8", "--no-probe", "--compute", "float32"]
    assert main([*args, "--out", str(tmp_path / "plain"), "--json"]) == 1  # diverged
    plain = json.loads((tmp_path / "plain" / "results.json").read_text())["runs"][1]
    assert plain["guard"] is None and plain["skipped_steps"] >= 5  # from the overflow to the end
    assert "outputs are inf/NaN in evaluation" in plain["diverged"]
    capsys.readouterr()
    assert main([*args, "--guard", "--out", str(tmp_path / "guarded")]) == 0
    shown = capsys.readouterr().out
    run = json.loads((tmp_path / "guarded" / "results.json").read_text())["runs"][1]
    event = run["guard"]["events"][0]
    assert event["layer"] == "blocks.0.mlp.0" and event["action"] == "raised to float32 and skipped"
    assert run["skipped_steps"] == 0 and run["guard"]["raised"] == {"blocks.0.mlp.0": "float32"}
    assert run["final_train_loss"] == pytest.approx(
        json.loads((tmp_path / "guarded" / "results.json").read_text())["runs"][0]["final_train_loss"], rel=0.02)
    assert "guard: 1" in shown and f"fp16 O1 fp32-compute: step {event['step'] + 1} nonfinite-loss" in " ".join(
        shown.split())
    for picture in ("curves.png", "guard-fp16-O1-fp32-compute.png", "guard-fp32.png"):
        assert (tmp_path / "guarded" / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _sharded_worker(rank: int, world: int) -> dict:
    """An MLP sharded with FSDP2 on 2 ranks, each on its half of the batch; at step 3 rank 1's half holds a NaN."""
    from ampkit.distributed import fully_shard, prepare_optimizer

    out = {}
    for guarded in (False, True):
        torch.manual_seed(0)
        model = fully_shard(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), opt_level="O1",
                            dtype=torch.bfloat16, compute="native")
        optimizer = prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        guard = ampkit.Guard(model, optimizer, sample_every=2) if guarded else None
        for step in range(6):
            x, y = _batch(step)
            x, y = x[rank::world].clone(), y[rank::world]
            if step == 3 and rank == 1:
                x[2, 5] = math.nan
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            guard.step(loss, batch=(x, y)) if guard is not None else optimizer.step()
        weights = [p.detach().full_tensor() for p in model.parameters()]
        out[guarded] = {"finite": all(bool(torch.isfinite(w).all()) for w in weights),
                        "events": [dataclasses.astuple(e) for e in guard.events] if guard else [],
                        "losses": guard.losses if guard else [], "samples": len(guard.samples) if guard else 0,
                        "weights": weights}
    return out


@pytest.mark.distributed
@pytest.mark.slow  # 2 spawned ranks: about 15 s
def test_on_fsdp2_shards_every_rank_takes_the_same_action() -> None:
    """A NaN in one rank's half of the batch: unguarded, it reaches both ranks' weights through the reduce-scatter;
    guarded, the verdict is reduced over the ranks first, so both skip the step, record the same event (naming rank
    1's batch) and the same losses, and train on with finite weights."""
    from multiprocess import run_ranks

    ranks = run_ranks(_sharded_worker, 2, timeout_s=240)
    for rank in ranks:
        assert not rank[False]["finite"] and rank[True]["finite"]
        [event] = rank[True]["events"]
        assert event[:4] == (3, "nonfinite-loss", "the batch of rank 1: a tensor holding an inf or a NaN", "skipped")
        assert rank[True]["samples"] == 3  # steps 0, 2, 4: the layers' figures reduced over the ranks
    assert ranks[0][True]["events"] == ranks[1][True]["events"]
    assert ranks[0][True]["losses"] == ranks[1][True]["losses"] and ranks[0][True]["losses"][3] is None
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][True]["weights"], ranks[1][True]["weights"]))


def _sharded_growing_worker(rank: int, world: int) -> dict:
    """Fault (a) on 2 ranks: the growing layer of ``_growing``, sharded with FSDP2 at O1 (float32 shards and
    all-gathers under float16 autocast) or O2 (float16 all-gathers: a raised layer computes on float32 copies of
    them), each rank on its half of the batch, sampled every step; unguarded, then guarded with ``"raise"``."""
    from ampkit.distributed import fully_shard, prepare_optimizer

    out = {}
    for level, guarded in (("O1", False), ("O1", True), ("O2", True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), GrowingLinear(32, 32, rate=2.0), nn.LayerNorm(32), nn.ReLU(),
                              nn.Linear(32, 4))
        model = fully_shard(model, opt_level=level, dtype=torch.float16, compute="native")
        optimizer = prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        scaler = ampkit.DynamicLossScaler()
        every = 1 if level == "O1" else 7  # O2: steps 7, 14, 21...; after an unnamed one, the next
        guard = ampkit.Guard(model, optimizer, scaler, action="raise", sample_every=every) if guarded else None
        def half(step: int) -> tuple[torch.Tensor, torch.Tensor]:  # this rank's half of the step's batch
            x, y = _batch(step)
            return x[rank::world].clone(), y[rank::world]

        losses = test_guard._train(model, optimizer, guard, half, scaler, steps=STEPS)
        out[level, guarded] = {"losses": losses, "agreed": guard.losses if guard else [],
                               "events": [dataclasses.astuple(e)[:4] for e in guard.events] if guard else [],
                               "raised": dict(guard.raised) if guard else {}}
    return out


@pytest.mark.distributed
@pytest.mark.slow  # 2 spawned ranks: about 20 s
def test_on_fsdp2_shards_an_overflowing_layer_is_raised_alike_on_every_rank() -> None:
    """Issue 66's raise under FSDP2 (refused before): the growing layer's float16 output overflows; unguarded, the
    scaler skips every step from then on; guarded, every rank re-runs its half of the batch on the live model (FSDP2
    refuses a copy), and the lowest rank whose replay names a module decides: both ranks raise the layer at the
    first overflow, at O1 and at O2 (sampled every 7 steps: before the replay over ranks, the figures of the next
    step named it), record the same events and losses, and train on."""
    from multiprocess import run_ranks

    ranks = run_ranks(_sharded_growing_worker, 2, timeout_s=300)
    # the first step whose loss overflows on either rank's half
    first = min(next(step for step, value in enumerate(rank["O1", False]["losses"]) if not math.isfinite(value))
                for rank in ranks)
    for rank in ranks:
        unguarded = rank["O1", False]["losses"]
        assert not any(math.isfinite(value) for value in unguarded[first + 1:])  # every step from the overflow on
        for level in ("O1", "O2"):
            run = rank[level, True]
            assert run["events"] == [(first, "nonfinite-loss", "1 (mm in forward) on rank 0",
                                      "raised to float32 and skipped")], run["events"]
            assert run["raised"] == {"1": "float32"} and all(math.isfinite(v) for v in run["losses"][first + 1:])
    for level in ("O1", "O2"):
        assert ranks[0][level, True]["events"] == ranks[1][level, True]["events"]
        assert ranks[0][level, True]["agreed"] == ranks[1][level, True]["agreed"]  # the mean over the ranks


def _sharded_outlier_worker(rank: int, world: int) -> dict:
    """Fault (b) on 2 ranks: ``_outlier_model``'s network sharded with FSDP2 at O1 bf16, each rank on its half of
    the batch, the outlier planted at step 21 (its weight column's gradient zeroed on the shards before each step,
    as the single-process test's mask does); without the plant, with it unguarded, with it guarded."""
    from ampkit.distributed import fully_shard, prepare_optimizer
    from ampkit.shards import local_shard

    out = {}
    for planted, guarded in ((False, False), (True, False), (True, True), ("unkept", True)):
        torch.manual_seed(0)
        outlier = ChannelScale(64, channel=7, factor=1.0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), outlier,
                              Fp8Linear.from_linear(nn.Linear(64, 64), Fp8Recipe()), nn.GELU(), nn.Linear(64, 4))
        model = fully_shard(model, opt_level="O1", dtype=torch.bfloat16, compute="native")
        optimizer = prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        weight = model[3].weight

        def keep_column(*_: object) -> None:
            local_shard(weight.grad)[:, 7] = 0

        if planted != "unkept":  # unkept: the column trains on, its outputs x 1e6: loss spikes from step 22
            optimizer.register_step_pre_hook(keep_column)
        guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1) if guarded else None

        def plant(step: int) -> None:
            if planted and step == 21:
                with torch.no_grad():
                    outlier.scale[7] = 1e6
                    local_shard(weight)[:, 7] /= 1e6

        def half(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = _batch(step)
            return x[rank::world].clone(), y[rank::world]

        try:
            losses = test_guard._train(model, optimizer, guard, half, None, plant, steps=STEPS)
        except ampkit.GuardStopped:
            losses = []
        out[planted, guarded] = {"losses": losses, "agreed": guard.losses if guard else [],
                                 "events": [dataclasses.astuple(e)[:4] for e in guard.events] if guard else []}
    return out


@pytest.mark.distributed
@pytest.mark.slow  # 2 spawned ranks: about 15 s
def test_on_fsdp2_shards_an_fp8_linear_with_an_outlier_is_raised_alike_on_every_rank() -> None:
    """Fault (b) under FSDP2: the FP8 linear, raised in place (its forward replaced on the module FSDP2 gathers
    into), is named at step 21 on both ranks from the sampled figures reduced over them, with the same events and
    agreed losses; the run ends within 2% of the unfaulted one, where the unguarded one is lost. With the planted
    column left to train, the loss spikes: over ranks the spikes are not replayed, and the run stops."""
    from multiprocess import run_ranks

    ranks = run_ranks(_sharded_outlier_worker, 2, timeout_s=300)
    for rank in ranks:
        unfaulted, unguarded = rank[False, False]["losses"], rank[True, False]["losses"]
        guarded = rank[True, True]
        assert sum(unguarded[-10:]) > 3 * sum(unfaulted[-10:])  # FP8 flushes all but the outlier channel
        [(step, signal, where, action)] = guarded["events"]
        assert (step, action) == (21, "raised to 16 bits") and where.startswith("3 (fp8): values"), guarded["events"]
        assert sum(guarded["losses"][-10:]) == pytest.approx(sum(unfaulted[-10:]), rel=0.02)
        # spikes over ranks are not replayed (the replay copies the model, and FSDP2 refuses a copy: it crashed)
        raised, *spikes = rank["unkept", True]["events"]
        assert raised[3] == "raised to 16 bits" and spikes and {s[1] for s in spikes} == {"loss-spike"}
        assert all(s[2].endswith("not replayed: the run spans ranks") for s in spikes), spikes
    assert ranks[0][True, True]["agreed"] == ranks[1][True, True]["agreed"]


@pytest.mark.slow  # torch.compile: about 10 s
def test_under_torch_compile_the_raise_recompiles_once_and_the_run_matches_eager() -> None:
    """Fault (b) with the model compiled (a counting backend, dynamo's graphs run as traced): the guard names and
    raises the FP8 linear at the same step as in eager code, the losses are eager's, and the raise adds its graphs
    once (its forward replaced), not a recompile at every later step."""
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    def run(compiled: bool) -> tuple[list[float], ampkit.Guard, list[int]]:
        torch.compiler.reset()
        graphs.clear()
        model, optimizer, outlier, linear = _outlier_model()
        guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
        forward = torch.compile(model, backend=counting) if compiled else model
        plant, counts, losses = _plant_at(21, outlier, linear), [], []
        for step in range(STEPS):
            plant(step)
            optimizer.zero_grad(set_to_none=True)
            x, y = _batch(step)
            loss = F.mse_loss(forward(x).float(), y)
            loss.backward()
            guard.step(loss, batch=(x, y))
            losses.append(loss.item())
            counts.append(len(graphs))
        return losses, guard, counts

    eager, eager_guard, _ = run(compiled=False)
    compiled, guard, counts = run(compiled=True)
    assert [(e.step, e.layer, e.action) for e in guard.events] == [(21, "3", "raised to 16 bits")]
    assert [(e.step, e.layer) for e in eager_guard.events] == [(21, "3")]
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert counts[21] == counts[0]  # sampled every step: no recompile before the raise
    # the raise's graphs (2 on torch 2.13 and 2.14.1; on 2.11, whose graph breaks differ, 3 and a fourth at the
    # next step after other tests), then none: the last 15 steps compile nothing
    assert counts[22] > counts[21] and counts[-1] == counts[24]


def test_a_deep_copy_of_a_layer_raised_twice_runs_its_own_weights() -> None:
    """An FP8 linear raised to 16 bits, then to float32: the guard's replay deep-copies the model, and the copy's
    raised forward ran the original's 16-bit forward, bound to the original module and its weights."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear.from_linear(nn.Linear(8, 8), Fp8Recipe()))
    layers.raise_layer(model, "0")
    layers.raise_layer(model, "0")
    assert layers.kind(model[0]) == "16-bit" and layers.raised_to(model[0]) == "float32"
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.mul_(2)
    x = torch.randn(2, 8)
    assert torch.equal(twin(x), F.linear(x, twin[0].weight, twin[0].bias))
    assert torch.equal(model(x), F.linear(x, model[0].weight, model[0].bias))
    assert layers.lower_layer(model, "0") is model[0] and layers.kind(model[0]) == "fp8"


def test_a_torchao_float8_linear_is_raised_to_a_16_bit_linear_on_its_weights() -> None:
    """torchao's Float8Linear (FP8 with current scaling, as compare's fp8-current runs convert): it was taken for a
    16-bit layer and "raised to float32" by running its own forward with autocast off, FP8 casts and all."""
    pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
    ampkit.convert_to_fp8(model, Fp8Recipe(scaling="current"), include=["2"], emulate=True)
    linear = model[2]
    assert layers.raised_to(linear) == "16 bits" and layers.format_of(linear) == "fp8"
    x = torch.randn(8, 16)
    with torch.autocast("cpu", torch.bfloat16):
        quantized = model(x)
        raised = layers.raise_layer(model, "2")
        plain = F.linear(model[1](model[0](x)), linear.weight, linear.bias)
        assert raised is linear and torch.equal(model(x), plain) and not torch.equal(quantized, plain)
    assert layers.raised_to(linear) == "float32" and layers.kind(linear) == "16-bit"
    assert layers.lower_layer(model, "2") is linear and layers.raised_to(linear) == "16 bits"
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(model(x), quantized)  # torchao's own forward again


def test_the_fp8_figures_agree_with_the_diagnostics_and_a_per_channel_reference() -> None:
    """The guard's in-graph FP8 figures (no host read): the clamped fraction against ``fp8.cast_numerics``, the
    diagnostics' own; the underflow, each input channel's square sum's share flushed to zero averaged over the
    channels, against that written as a loop over the channels in float64 (the diagnostics' fraction of values
    flushed is not it: half a Llama's MLP input flushes with one channel x 3e4, and the run trains as without)."""
    from ampkit.formats.fp8 import cast_numerics
    from ampkit.formats.recipes import E4M3

    torch.manual_seed(0)
    x = torch.randn(64, 32)
    x[:, 3] *= 1e4  # clamped at the scale below
    x[:, 5] *= 1e-6  # flushed
    found = []
    for scale in (torch.tensor(0.5), torch.tensor(2.0**-8)):
        saturation, underflow, _ = layers.fp8_figures(x, scale, E4M3).tolist()
        theirs = cast_numerics(x, scale, E4M3)
        assert saturation == pytest.approx(theirs.overflow)
        shares = []
        for channel in x.double().abs().t():
            flushed = channel * scale.double() <= 2.0**-10  # half E4M3's smallest subnormal, 2**-9
            shares.append(float(channel[flushed].square().sum() / channel.square().sum()))
        assert underflow == pytest.approx(sum(shares) / len(shares), rel=1e-5)
        assert theirs.underflow > underflow  # the values flushed are the smallest
        found.append((saturation > 0, underflow))
    [(clamped, coarse), (clamped_finer, fine)] = found
    assert (clamped, clamped_finer) == (True, False)  # at 2**-8, 1e4 fits E4M3's 448
    assert 1 / 32 <= coarse < fine  # channel 5 whole at both; at 2**-8 more of the others' small values too


def test_a_block_scaled_linear_is_watched_and_raised_to_16_bits_on_its_own_parameters() -> None:
    from ampkit.formats.block_linear import BlockScaledLinear
    from ampkit.formats.recipes import BlockScaledRecipe

    torch.manual_seed(0)
    model = nn.Sequential(BlockScaledLinear.from_linear(nn.Linear(64, 32), BlockScaledRecipe("mxfp8", scale_mode="rceil")), nn.ReLU())
    weight = model[0].weight
    x = torch.randn(8, 64)
    x[:, 1:32] *= 1e-12  # in each row's first block of 32, all but one value sit far below the block's largest
    saturation, underflow, _ = layers.block_figures(x, model[0]).tolist()
    assert saturation == 0 and underflow == pytest.approx(31 / 64, abs=0.02)  # RCEIL: no element saturates
    raised = layers.raise_layer(model, "0")
    assert model[0] is raised and layers.kind(raised) == "16-bit" and raised.weight is weight
    assert torch.equal(model(x), F.relu(F.linear(x, weight, model[0].bias)))
    assert layers.raised_to(raised) == "float32"  # the next raise


def test_a_recompute_plan_changes_none_of_the_guard_figures_or_losses() -> None:
    """With the recompute planner's plan applied, the recomputed forwards of backward run the hooks again on the same
    values: every sampled figure and every loss is the unplanned run's."""
    from ampkit.experiment.models import GPT

    def run(planned: bool) -> tuple[list, list]:
        torch.manual_seed(0)
        model = GPT(d_model=32, n_layers=2, n_heads=2, context=16)
        model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O1",
                                             torch.bfloat16, compute="native")
        tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1], tokens[:, 1:]

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

        if planned:
            ampkit.plan_recompute(model, x, 0.5, loss_of, strategy="blocks").apply(model)
        guard = ampkit.Guard(model, optimizer, sample_every=1)
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model(x))
            loss.backward()
            guard.step(loss, batch=(x, y))
        return guard.losses, guard.samples

    planned = run(planned=True)
    assert len(planned[1]) == 3 and all(len(found) >= 8 for _, found in planned[1])  # every step, every linear
    assert planned == run(planned=False)


# -- Issue 66: the guard wherever the loop runs -------------------------------------------------------------------

def _growing_float32(rate: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``_growing``'s model left in float32: the loop opens torch.autocast itself (torch's AMP recipe)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), GrowingLinear(32, 32, rate=rate), nn.LayerNorm(32), nn.ReLU(),
                          nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_under_autocast(model: nn.Module, optimizer: torch.optim.Optimizer, guard: ampkit.Guard | None,
                          scaler: ampkit.DynamicLossScaler, steps: int = STEPS) -> list[float]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.float16):
            return model(x)

    return test_guard._train(model, optimizer, guard, _batch, scaler, steps=steps, forward=forward)


def test_under_the_loops_own_torch_autocast_an_overflowing_layer_is_named_and_raised() -> None:
    """Fault (a) in torch's AMP recipe (a float32 model, the loop's own torch.autocast): the replay ran in float32,
    reproduced nothing, and every later step was skipped "not reproduced". It replays under the step's region now:
    the layer is named at the first overflowing step, raised once, and the run ends within 2% of the unfaulted one."""
    unfaulted = _train_under_autocast(*_growing_float32(rate=1.0), None, ampkit.DynamicLossScaler(), steps=100)
    model, optimizer = _growing_float32(rate=2.0)
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise", sample_every=0)  # the replay alone names it
    guarded = _train_under_autocast(model, optimizer, guard, scaler, steps=100)
    (event,) = guard.events
    assert (event.signal, event.layer, event.action) == ("nonfinite-loss", "1", "raised to float32 and skipped")
    assert "1 (" in event.where and "in forward" in event.where, event.where
    assert not math.isfinite(guarded[event.step]) and all(math.isfinite(v) for v in guarded[:event.step])
    assert guard.raised == {"1": "float32"} and all(math.isfinite(v) for v in guarded[event.step + 1:])
    assert _final(guarded) == pytest.approx(_final(unfaulted), rel=0.02)


def _overflowing() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A float16 O1 model whose layer "2" the tests make overflow (the LayerNorm after it holds the run)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(),
                          nn.Linear(32, 4))
    return ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O1", torch.float16,
                             compute="native")


def test_where_the_replay_does_not_reproduce_a_fault_the_steps_sampled_figures_name_the_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault the replay cannot reproduce (here: a replay that finds nothing) is decided by the step's own figures:
    the layer they show saturated (its float16 output overflowed) is named and raised; before, the figures were
    ignored whenever the loss was not finite, and every later step was skipped unexplained."""
    import ampkit.diagnostics.nonfinite as nonfinite

    monkeypatch.setattr(nonfinite, "find_nonfinite", lambda *args, **kwargs: None)
    # the scaler's own skips later (its scale grown too far) stay its own: their re-runs would find nothing too
    monkeypatch.setattr(Replay, "scaler_skip", lambda *args: None)
    model, optimizer = _overflowing()
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise", sample_every=1)

    def grow(step: int) -> None:
        if step == 10:  # its outputs pass float16's largest from here on (the LayerNorm after it holds the run)
            with torch.no_grad():
                model[2].weight.mul_(1e5)

    losses = _train(model, optimizer, guard, scaler, grow, steps=30)
    (event,) = guard.events
    assert (event.step, event.signal, event.layer) == (10, "nonfinite-loss", "2"), event
    assert event.action == "raised to float32 and skipped"
    assert event.where.startswith("2 (16-bit): values clamped or not finite 1") and NOT_REPRODUCED in event.where
    assert all(math.isfinite(v) for v in losses[11:])


class _Amplify(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor`` in its own dtype (float16 overflows)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None  # type: ignore[attr-defined]


class _LoudGradient(nn.Linear):
    """A linear whose backward multiplies its output's gradient by ``factor`` (1: none; a gradient-only fault)."""

    factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Amplify.apply(super().forward(x), self.factor)


@pytest.mark.parametrize("loop", ["initialize O1", "torch.autocast"])
def test_a_gradient_only_inf_is_named_by_its_module(loop: str) -> None:
    """Fault (d): an inf only in the backward (the forward and the loss finite) was named by op alone ("mul in
    backward", module "(model)"); the replay now names the module whose backward made it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _LoudGradient(32, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if loop == "initialize O1":
        model, optimizer = ampkit.initialize(model, optimizer, "O1", torch.float16, compute="native")
    guard = ampkit.Guard(model, optimizer, action="raise")  # no scaler: the guard checks the gradients
    for step in range(6):
        model[2].factor = 1e7 if step == 3 else 1.0  # float16 holds none of it; float32 does
        optimizer.zero_grad(set_to_none=True)
        x, y = _batch(step)
        with torch.autocast("cpu", torch.float16, enabled=loop == "torch.autocast"):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        guard.step(loss, batch=(x, y))
    (event,) = guard.events
    assert (event.step, event.signal, event.layer) == (3, "nonfinite-gradient", "2"), event
    assert event.where.startswith("2 (mul in backward") and event.action == "raised to float32 and skipped"


def test_steps_refused_again_and_again_stop_the_run_with_the_evidence() -> None:
    """A cause nothing the guard does cures (a weight gone NaN, under "skip") was an endless run of skipped steps
    that trained nothing; after max_refused in a row the guard stops with those events."""
    model, optimizer = _growing(rate=1.0)
    guard = ampkit.Guard(model, optimizer, action="skip", max_refused=3)

    def poison(step: int) -> None:
        if step == 4:
            with torch.no_grad():
                model[4].weight[0, 0] = math.nan

    with pytest.raises(ampkit.GuardStopped, match=r"refused 3 steps in a row \(steps 4 to 6; max_refused=3\)") as stop:
        _train(model, optimizer, guard, None, poison, steps=20)
    assert [e.step for e in stop.value.events] == [4, 5, 6] and guard.step_count == 7
    assert all(e.action == "skipped" and "4" in e.where for e in stop.value.events)


def _fault_that_stops(quiet_window: int | None) -> tuple[list[float], ampkit.Guard]:
    """A float16 O1 run whose layer "2" overflows for steps 10-13 and again 40-43 (its weight x1e5, then back)."""
    model, optimizer = _overflowing()
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise", quiet_window=quiet_window)

    def plant(step: int) -> None:
        with torch.no_grad():
            if step in (10, 40):
                model[2].weight.mul_(1e5)
            if step in (14, 44):
                model[2].weight.div_(1e5)

    return _train(model, optimizer, guard, scaler, plant, steps=100), guard


def test_a_raised_layer_returns_to_its_format_after_a_quiet_window_that_doubles_when_it_fails_again() -> None:
    """Down as well as up: without a return a long run drifts to float32 layer by layer. The layer raised at step 10
    returns to float16 after 10 quiet steps; failing again at 40 it is raised again and waits 20. The run ends within
    2% of the one whose layer never returns (measured: 1.4% at 100 steps, 1.2% at 200: float16 against float32 for
    that layer's last steps)."""
    returns, guard = _fault_that_stops(quiet_window=10)
    assert [(e.step, e.signal, e.action) for e in guard.events] == [
        (10, "nonfinite-loss", "raised to float32 and skipped"), (20, "layer-returned", "returned to 16 bits"),
        (40, "nonfinite-loss", "raised to float32 and skipped"), (60, "layer-returned", "returned to 16 bits")]
    assert "20 quiet steps since its raise at step 40" in guard.events[3].where
    assert guard.raised == {} and "forward" not in vars(guard.model[2])  # its own forward again
    stays, kept = _fault_that_stops(quiet_window=None)
    assert kept.raised == {"2": "float32"} and len(kept.events) == 1
    assert all(math.isfinite(v) for v in returns[11:40] + returns[41:])
    assert _final(returns) == pytest.approx(_final(stays), rel=0.02)


def test_an_fp8_layer_returns_with_a_fresh_scale_history() -> None:
    """An FP8 linear raised to 16 bits comes back on the same Parameters with its amax history and scales reset
    (they described the tensors of before its raise)."""
    model, optimizer, outlier, linear = _outlier_model()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", torch.bfloat16):
        model(x).float().sum().backward()  # the history holds this step's amaxes
    assert linear.amax_history.abs().sum() > 0
    raised = layers.raise_layer(model, "3")
    assert model[3] is raised is linear and layers.kind(raised) == "16-bit"
    back = layers.lower_layer(model, "3")
    assert model[3] is back is linear and torch.all(linear.amax_history == 0) and torch.all(linear.scale == 1)


def test_a_resumed_run_has_the_same_layers_raised_and_the_same_timeline(tmp_path: Path) -> None:
    """It remembers (issue 66's fourth item, the single-file checkpoint): the guard is saved with the model and the
    optimizer; a run resumed from the checkpoint has the FP8 layer raised again (it is restored before the model,
    whose state is the raised one's) and the timeline it had, and its steps are the uninterrupted run's, loss for loss.
    Before, a resumed run had its FP8 layer back, the timeline empty."""
    model, optimizer, outlier, linear = _outlier_model()
    guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    plant = _plant_at(21, outlier, linear)
    through = _train(model, optimizer, guard, None, plant, steps=30)

    model, optimizer, outlier, linear = _outlier_model()
    guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    first = _train(model, optimizer, guard, None, _plant_at(21, outlier, linear), steps=25)
    assert guard.raised == {"3": "16 bits"}
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer, guard=guard)

    model, optimizer, outlier, _ = _outlier_model()
    with torch.no_grad():
        outlier.scale[7] = 1e6  # the resumed model's own planted state (a buffer the checkpoint restores too)
    resumed = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    ampkit.load_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer, guard=resumed)  # guard last
    assert resumed.raised == {"3": "16 bits"} and layers.kind(model[3]) == "16-bit"
    assert resumed.events == guard.events and resumed.losses == guard.losses and resumed.step_count == 25
    rest = [test_guard._train(model, optimizer, resumed, lambda _, at=at: _batch(at), steps=1)[0]  # type: ignore[misc]
            for at in range(25, 30)]
    assert first + rest == through


def test_a_run_resumed_from_a_sharded_checkpoint_has_the_same_layers_raised_and_timeline(tmp_path: Path) -> None:
    """It remembers in sharded checkpoints too (DCP, ``save_sharded_checkpoint(..., guard=guard)``): the guard's
    state travels whole and is restored before the model, whose saved state is the raised layer's; the resumed run
    is the uninterrupted one, loss for loss. Before, the load was refused: the model, its layer FP8 again, asked for
    FP8 scales the raised layer's saved state has none of ("a checkpoint of another model")."""
    from ampkit.distributed import load_sharded_checkpoint, save_sharded_checkpoint

    model, optimizer, outlier, linear = _outlier_model()
    guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    through = _train(model, optimizer, guard, None, _plant_at(21, outlier, linear), steps=30)

    model, optimizer, outlier, linear = _outlier_model()
    guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    first = _train(model, optimizer, guard, None, _plant_at(21, outlier, linear), steps=25)
    save_sharded_checkpoint(tmp_path / "step-25", model, optimizer, guard=guard)

    model, optimizer, outlier, fp8 = _outlier_model()
    with torch.no_grad():
        outlier.scale[7] = 1e6
    resumed = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    load_sharded_checkpoint(tmp_path / "step-25", model, optimizer, guard=resumed)
    assert resumed.raised == {"3": "16 bits"} and layers.kind(model[3]) == "16-bit"
    assert resumed.events == guard.events and resumed.losses == guard.losses and resumed.step_count == 25
    rest = [test_guard._train(model, optimizer, resumed, lambda _, at=at: _batch(at), steps=1)[0]  # type: ignore[misc]
            for at in range(25, 30)]
    assert first + rest == through

    other, _, _, other_fp8 = _outlier_model()  # another head: the load fails after the guard raised its layer
    other[5] = nn.Linear(64, 5)
    fresh = ampkit.Guard(other, torch.optim.AdamW(other.parameters()), action="raise")
    with pytest.raises(RuntimeError, match="could not be read into this model, nothing was changed"):
        load_sharded_checkpoint(tmp_path / "step-25", other, guard=fresh)
    assert other[3] is other_fp8 and fresh.raised == {} and fresh.events == []


def test_a_resume_that_fails_leaves_the_guard_and_the_models_layers_as_they_were(tmp_path: Path) -> None:
    """load_checkpoint is all or nothing: the guard raised the FP8 layer before the model's load failed (another
    head), and is put back: the layer is FP8 again, the timeline empty."""
    model, optimizer, outlier, linear = _outlier_model()
    guard = ampkit.Guard(model, optimizer, action="raise", sample_every=1)
    _train(model, optimizer, guard, None, _plant_at(21, outlier, linear), steps=25)
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, guard=guard)
    other, _, _, fp8 = _outlier_model()
    other[5] = nn.Linear(64, 5)
    fresh = ampkit.Guard(other, torch.optim.AdamW(other.parameters()), action="raise")
    with pytest.raises(RuntimeError, match=r"loading 'model' failed, nothing was changed"):
        ampkit.load_checkpoint(tmp_path / "last.pt", model=other, guard=fresh)
    assert other[3] is fp8 and fresh.raised == {} and fresh.events == [] and fresh.step_count == 0


def test_a_raised_layer_of_a_compiled_model_computes_float32_in_its_backward_too() -> None:
    """Fault (a) compiled (aot_eager: AOTAutograd traces the backward as inductor does, and runs it as traced): the
    raised layer's backward had run under the forward's float16 autocast, its overflow came back, and the scaler
    skipped every later step down to a scale of 1 (18 of 40) where eager skipped none. The raised layer runs eagerly
    now, a graph break at it: the compiled run is eager's, loss for loss (inductor: no skip either, its final loss
    0.6% from eager's, as its fused float16 arithmetic is before the raise)."""
    def run(compiled: bool) -> tuple[list[float], ampkit.Guard, ampkit.DynamicLossScaler]:
        torch.compiler.reset()
        model, optimizer = _growing(rate=2.0)
        scaler = ampkit.DynamicLossScaler()
        guard = ampkit.Guard(model, optimizer, scaler, action="raise", sample_every=0)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        return test_guard._train(model, optimizer, guard, _batch, scaler, steps=STEPS, forward=forward), guard, scaler

    eager, eager_guard, _ = run(compiled=False)
    compiled, guard, scaler = run(compiled=True)
    assert [(e.step, e.layer, e.action) for e in guard.events] == [
        (e.step, e.layer, e.action) for e in eager_guard.events] == [(19, "1", "raised to float32 and skipped")]
    assert scaler.stats.skipped == 0 and scaler.get_scale() == 65536.0
    assert compiled[20:] == pytest.approx(eager[20:], rel=1e-6)


class _Offset(nn.Linear):
    """A linear whose output goes through ``+ offset - offset``: exact in float32, rounded to float16's spacing at
    the offset under a float16 region (32 at 32768: the output's unit-sized values are lost)."""

    offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) + self.offset) - self.offset


def _spiking(action: str) -> tuple[list[float], ampkit.Guard]:
    """A float16 O1 run whose layer "2" loses its output to float16's rounding from step 20 on (a precision
    spike), and whose batch 35 has targets 100 times larger (a data spike)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _Offset(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1", torch.float16,
                                         compute="native")
    guard = ampkit.Guard(model, optimizer, action=action, window=10, spike_sigmas=3)

    def plant(step: int) -> None:
        model[2].offset = 32768.0 if step >= 20 else 0.0

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _batch(step)
        return (x, y * 100) if step == 35 else (x, y)

    return test_guard._train(model, optimizer, guard, batch, None, plant, steps=50), guard


def test_a_loss_spike_is_replayed_in_float32_and_a_precision_spike_raises_its_layer() -> None:
    """Loss spikes attributed by the replay (issue 66's fifth item): a spike float32 does not reproduce on the same
    batch and weights is the precision's, named by the module where the departure from float32 starts (its output's
    relative error most beyond its input's) and raised; a spike float32 reproduces (the batch's) is skipped, not
    raised. Before, both were "loss-spike" with figures only, the precision's skipped at every step from then on."""
    losses, guard = _spiking("raise")
    spikes = [(e.step, e.layer, e.action) for e in guard.events]
    assert spikes == [(20, "2", "raised to float32 and skipped"), (35, None, "skipped")], guard.events
    assert "the precision's, from 2 (its output departs from float32's by" in guard.events[0].where
    assert "on this batch too: the batch's or the update's, not the precision's" in guard.events[1].where
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[40:]) / 10 < sum(losses[10:20]) / 10  # raised, the layer trains on (was: zeros from step 20)


def test_the_region_a_compiled_forward_ran_in_is_noted_for_the_replay() -> None:
    """A compiled model's forward noted no region (the hook returned early under compile): under torch's AMP recipe
    the replay ran in float32, reproduced no float16 overflow, and called the fault transient. The hook is traced
    now: the loop's torch.autocast dtype, or initialize's policy, is noted with no graph break (dynamo alone: the
    noting is dynamo's part, not the backend's)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    guard = ampkit.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break would fail here
    for dtype in (torch.float16, torch.bfloat16, None):
        with torch.autocast("cpu", dtype or torch.float16, enabled=dtype is not None):
            compiled(torch.randn(8, 16))
        assert guard.attribution.region[0] == dtype
    model16, optimizer = _overflowing()
    guard = ampkit.Guard(model16, optimizer)
    torch.compile(model16, backend="eager")(torch.randn(8, 16))
    assert isinstance(guard.attribution.region[0], ampkit.Policy)


def test_a_module_without_parameters_is_raised_to_float32() -> None:
    """A module with no parameters of its own (an elementwise scale) whose float16 output overflows: its raise took
    the device from its first parameter and crashed the run (StopIteration, found with an outlier channel planted in
    float16 on a Llama); it computes in float32 on the model's device now, and the LayerNorm after it takes its
    float32 output: named, raised once, every later step finite."""
    torch.manual_seed(0)
    scale = ChannelScale(32, channel=3, factor=1.0)
    model = nn.Sequential(nn.Linear(16, 32), scale, nn.LayerNorm(32), nn.Linear(32, 4))
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1", torch.float16,
                                         compute="native")
    scaler = ampkit.DynamicLossScaler()
    guard = ampkit.Guard(model, optimizer, scaler, action="raise")

    def plant(step: int) -> None:
        if step == 12:
            scale.scale[3] = 1e6

    losses = test_guard._train(model, optimizer, guard, _batch, scaler, plant)
    assert [(e.step, e.signal, e.where, e.action) for e in guard.events] == [
        (12, "nonfinite-loss", "1 (_to_copy in forward)", "raised to float32 and skipped")]
    assert guard.raised == {"1": "float32"} and all(math.isfinite(v) for v in losses[13:])
