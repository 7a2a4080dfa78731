"""The training loop's contract after ``ampkit.initialize`` (issue 64; docs/training.md, "The contract").

Code written for float32 works unchanged at every opt level: the optimizer the user steps updates the weights,
clipping ``model.parameters()`` clips what the step uses and reports the true norm, a scheduler built before
``initialize`` drives the optimizer it returns, a float32 checkpoint resumes from its trained weights, and a save
and load continues bit for bit. Each case runs the same loop in float32 beside it: {O0, O1, O2, O3} x {bf16,
fp16 with a dynamic loss scaler} x {ampkit's loop (the README's), torch's AMP recipe (torch.amp.GradScaler)}. The
frameworks (transformers' Trainer, Accelerate, Lightning, Fabric) are in ``test_training_contract_frameworks.py``.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.optim.states import loaded_in_format

LEVELS = ["O0", "O1", "O2", "O3"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
RECIPES = ["ampkit", "torch-amp"]
# How far a mixed run may sit from float32's, relative to the quantity compared: each format's rounding of the
# forward, the gradients and (at O3) the weights, well below a wrong clip (x10 and more) or a lost update.
TOLERANCE = {"bf16": 0.05, "fp16": 0.02}

X = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """What the model's state dict holds, in float32 (at O2 the masters)."""
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)))


class Loop:
    """One training loop, written once, as a float32 user writes it, with the recipe's scaler."""

    def __init__(self, level: str | None, dtype: str, recipe: str, make_optimizer: Callable[[nn.Module], Any],
                 states: str | None = None, scheduler: bool = False) -> None:
        self.model = _model()
        optimizer = make_optimizer(self.model)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s) if scheduler else None
        if level is not None:  # None: the float32 reference, no ampkit at all
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the compute mode's one-time note
                self.model, optimizer = ampkit.initialize(self.model, optimizer, level, DTYPES[dtype],
                                                          compute="native", states=states)
        self.optimizer = optimizer
        fp16 = level not in (None, "O0") and dtype == "fp16"
        self.scaler = (ampkit.DynamicLossScaler(enabled=fp16) if recipe == "ampkit"
                       else torch.amp.GradScaler("cpu", enabled=fp16))
        self.recipe = recipe

    def step(self, clip: float | None = None, how: str = "unscale_") -> float | None:
        """One step; with ``clip``, the gradients clipped to that norm (``how``: torch's recipe, ``unscale_`` then
        ``clip_grad_norm_(model.parameters())``; or ampkit's scaler's ``clip_grad_norm_`` given the optimizer or the
        model's parameters); the norm it reported."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(X).float(), Y)
        self.scaler.scale(loss).backward()
        norm = None
        if clip is not None and how == "unscale_":
            self.scaler.unscale_(self.optimizer)
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        elif clip is not None:
            target = self.optimizer if how == "scaler, optimizer" else self.model.parameters()
            norm = float(self.scaler.clip_grad_norm_(target, clip))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return norm

    def state(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict()}, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)  # what a file would give back: copies

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=20.0)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    # eps above the gradients' square root: each update is proportional to the gradient, so a format's rounding
    # moves it proportionally (with a small eps AdamW's update is the gradient's sign, and rounding flips it)
    return torch.optim.AdamW(model.parameters(), lr=0.5, eps=0.1)


# torch's GradScaler refuses float16 gradients ("Attempting to unscale FP16 gradients"), which O3's 16-bit weights
# have: there the loop takes ampkit's scaler (docs/training.md says so)
CASES = [pytest.param(level, dtype, recipe, id=f"{level}-{dtype}-{recipe}")
         for level in LEVELS for dtype in DTYPES for recipe in RECIPES
         if not (level == "O3" and dtype == "fp16" and recipe == "torch-amp")]


CLIPS = [pytest.param(level, dtype, recipe, how, id=f"{level}-{dtype}-{recipe}-{how.replace(', ', '-')}")
         for level, dtype, recipe in (p.values for p in CASES)
         for how in (["unscale_"] if recipe == "torch-amp" else ["unscale_", "scaler, optimizer", "scaler, params"])]


@pytest.mark.parametrize("level, dtype, recipe, how", CLIPS)
def test_clipping_clips_what_the_step_uses_and_reports_the_true_norm(level: str, dtype: str, recipe: str,
                                                                     how: str) -> None:
    reference, mixed = Loop(None, dtype, recipe, _sgd), Loop(level, dtype, recipe, _sgd)
    before = _weights(reference.model)
    true_norm = reference.step(clip=0.05, how=how)
    reported = mixed.step(clip=0.05, how=how)
    assert true_norm is not None and true_norm > 0.2  # the clip bites: the update is 20 x 0.05
    assert reported == pytest.approx(true_norm, rel=TOLERANCE[dtype])
    float32_update = _distance(_weights(reference.model), before)
    assert float32_update == pytest.approx(1.0, rel=1e-4)
    assert _distance(_weights(mixed.model), before) == pytest.approx(float32_update, rel=TOLERANCE[dtype])
    assert _distance(_weights(mixed.model), _weights(reference.model)) < TOLERANCE[dtype] * float32_update


@pytest.mark.parametrize("states", [None, "bf16"])
@pytest.mark.parametrize("level, dtype, recipe", CASES)
def test_a_scheduler_built_before_initialize_drives_the_optimizer_it_returns(
        level: str, dtype: str, recipe: str, states: str | None) -> None:
    if states is not None and level in ("O0", "O3"):
        pytest.skip("states= at O0 is float32's optimizer and at O3 takes an update rule: O1 and O2 cover it")
    reference = Loop(None, dtype, recipe, _adamw, scheduler=True)
    mixed = Loop(level, dtype, recipe, _adamw, states=states, scheduler=True)
    before = _weights(reference.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's one warning when the optimizer was replaced (states=)
        for _ in range(4):
            reference.step()
            mixed.step()
    assert [g["lr"] for g in mixed.optimizer.param_groups] == [0.5 * 0.5**4]
    moved = _distance(_weights(reference.model), before)
    assert _distance(_weights(mixed.model), _weights(reference.model)) < 2 * TOLERANCE[dtype] * moved


@pytest.mark.parametrize("level, dtype, recipe", CASES)
def test_a_float32_checkpoint_resumes_from_its_trained_weights(level: str, dtype: str, recipe: str) -> None:
    trained = Loop(None, dtype, recipe, _adamw)
    fresh = _weights(_model())
    for _ in range(3):
        trained.step()
    checkpoint = trained.state()
    del checkpoint["scaler"]  # a float32 run has none to give (GradScaler's disabled state is empty)
    resumed = Loop(level, dtype, recipe, _adamw)
    resumed.load(checkpoint)
    assert _distance(_weights(resumed.model), checkpoint["model"]) < TOLERANCE[dtype] * _distance(
        checkpoint["model"], fresh)
    trained.step()
    resumed.step()
    expected = _weights(trained.model)
    assert _distance(_weights(resumed.model), expected) < TOLERANCE[dtype] * _distance(expected, fresh)


@pytest.mark.parametrize("level, dtype, recipe", CASES)
def test_a_saved_run_loads_and_continues_bit_for_bit(level: str, dtype: str, recipe: str) -> None:
    run = Loop(level, dtype, recipe, _adamw)
    for _ in range(2):
        run.step()
    saved = run.state()
    uninterrupted = copy.deepcopy(_weights(run.model))
    run.step()
    uninterrupted = _weights(run.model)
    resumed = Loop(level, dtype, recipe, _adamw)
    resumed.load(saved)
    resumed.step()
    got = _weights(resumed.model)
    assert all(torch.equal(got[name], uninterrupted[name]) for name in got)
    if level == "O2":  # the model's state dict holds the float32 masters: a float32 loop's save keeps them
        assert all(value.dtype == torch.float32 for value in saved["model"].values())


# ---------------------------------------------------------------------------
# The rest of what issue 64 found silent or unclear, each as it was met


def test_states_keep_every_key_of_the_users_param_groups() -> None:
    model = _model()
    optimizer = torch.optim.AdamW([{"params": model[0].parameters(), "name": "first", "lr": 0.1},
                                   {"params": model[3].parameters(), "name": "middle"},
                                   {"params": [*model[1].parameters(), *model[5].parameters()], "name": "rest"}],
                                  lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, converted = ampkit.initialize(model, optimizer, "O2", torch.bfloat16, compute="native", states="bf16")
    assert [(g["name"], g["lr"]) for g in converted.param_groups] == [("first", 0.1), ("middle", 0.01),
                                                                      ("rest", 0.01)]  # names were dropped


def _float32_adamw_state() -> dict[str, Any]:
    run = Loop(None, "bf16", "ampkit", _adamw)
    run.step()
    return run.optimizer.state_dict()


def test_a_float32_optimizer_state_loaded_into_bf16_moments_is_converted() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model()
        _, optimizer = ampkit.initialize(model, _adamw(model), "O2", torch.bfloat16, compute="native", states="bf16")
    optimizer.load_state_dict(_float32_adamw_state())
    moments = [state[key] for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.dtype == torch.bfloat16 for m in moments)  # were kept float32, then saved as "bf16"


def test_moments_a_low_bit_optimizer_cannot_take_are_refused_naming_both_formats() -> None:
    pytest.importorskip("torchao")
    # tensors torchao quantizes (4096 values and up), after a norm whose small moments it keeps unquantized
    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), "O1", states="8bit")
    plain = torch.optim.AdamW(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64)).parameters())
    for p in (p for g in plain.param_groups for p in g["params"]):
        p.grad = torch.ones_like(p)
    plain.step()
    with pytest.raises(RuntimeError, match=r"keeps AdamW's moments as 'fp32', this optimizer as '8bit': they cannot "
                                           r"be converted. Build the optimizer with states='fp32'"):
        optimizer.load_state_dict(plain.state_dict())  # it has not stepped: no quantized state to take them
    model(torch.randn(2, 64)).float().sum().backward()
    optimizer.step()
    # torch's own optimizer takes any state dict: the check an O2 optimizer makes of a plain one (MasterWeightOptimizer
    # .load_state_dict) refuses a low-bit optimizer's codes
    with pytest.raises(RuntimeError, match=r"keeps AdamW's moments as '8bit', this optimizer as 'as given'"):
        loaded_in_format(plain, optimizer.state_dict())


def test_an_o2_checkpoint_resumes_a_float32_run(tmp_path: Any) -> None:
    run = Loop("O2", "bf16", "ampkit", _adamw)
    for _ in range(2):
        run.step()
    ampkit.save_checkpoint(tmp_path / "o2.pt", model=run.model, optimizer=run.optimizer)
    plain = Loop(None, "bf16", "ampkit", _adamw)
    ampkit.load_checkpoint(tmp_path / "o2.pt", model=plain.model, optimizer=plain.optimizer)  # was refused:
    # "nothing was changed: 'param_groups'", not naming the masters
    assert all(torch.equal(plain.model.state_dict()[k], v) for k, v in run.model.state_dict().items())
    moments = [s["exp_avg"] for s in plain.optimizer.state.values()]
    assert len(moments) == 8 and all(m.dtype == torch.float32 for m in moments)


@pytest.mark.parametrize("call, message", [
    (lambda m, o: ampkit.Guard(m, None), r"optimizer=None: Guard needs the model's optimizer"),
    (lambda m, o: ampkit.Guard("model", o), r"model=str is not an nn.Module: pass the model itself"),
    (lambda m, o: ampkit.measured_state_bytes(m, None), r"optimizer=None: measured_state_bytes needs the model's"),
])
def test_a_missing_or_wrong_argument_is_named_not_an_attribute_error(call: Callable[..., Any], message: str) -> None:
    model = _model()
    with pytest.raises(ValueError, match=message):  # each raised AttributeError inside ampkit
        call(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_torchs_ddp_around_an_o2_model_is_refused_at_the_first_forward_naming_the_fix() -> None:
    import os

    import torch.distributed as dist

    from multiprocess import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = _model()
        model, _ = ampkit.initialize(model, _sgd(model), "O2", torch.bfloat16, compute="native")
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(ValueError, match=r"DistributedDataParallel reduces gradients in the weights' dtype "
                                             r"\(bfloat16\).*grad_dtype=torch.bfloat16"):
            ddp(X)  # was: "Expected BFloat16, got Float" from DDP's reducer, in the first backward
        sixteen = _model()
        sixteen, _ = ampkit.initialize(sixteen, _sgd(sixteen), "O2", torch.bfloat16, compute="native",
                                       grad_dtype=torch.bfloat16)
        nn.parallel.DistributedDataParallel(sixteen)(X).float().sum().backward()  # the way the message names
        assert all(p.grad is not None and p.grad.dtype == p.dtype for p in sixteen.parameters())
    finally:
        dist.destroy_process_group()


def test_a_weight_average_of_an_o2_model_is_16_bit_and_the_documented_twin_averages_the_masters() -> None:
    """What still differs (docs/training.md): ``AveragedModel`` copies an O2 model's 16-bit weights and averages in
    16 bits, where an EMA's small steps round away; the recipe there, a float32 twin loaded from the model's state
    dict (the masters), gives the float32 EMA of the masters exactly."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    decay = 0.999
    model = _model()
    twin = copy.deepcopy(model)  # float32, before initialize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2",
                                             torch.bfloat16)
    naive = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    ema = AveragedModel(twin, multi_avg_fn=get_ema_multi_avg_fn(decay))
    expected: list[torch.Tensor] = []
    for _ in range(20):
        F.cross_entropy(model(X).float(), Y).backward()
        optimizer.step()
        optimizer.zero_grad()
        naive.update_parameters(model)
        twin.load_state_dict(model.state_dict())
        ema.update_parameters(twin)
        masters = [m.detach() for m in optimizer.master_params]
        expected = [m.clone() for m in masters] if not expected else [
            torch.lerp(e, m, 1 - decay) for e, m in zip(expected, masters)]
    assert {p.dtype for p in naive.module.parameters() if p.dim() > 1} == {torch.bfloat16}
    assert all(torch.equal(a, e) for a, e in zip(ema.module.parameters(), expected))


def test_save_pretrained_after_o2_writes_the_float32_masters() -> None:
    transformers = pytest.importorskip("transformers")
    import tempfile

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2",
                                             torch.bfloat16, compute="native")
    tokens = torch.randint(0, 64, (2, 16))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    masters = optimizer.fp32_state_dict(model)  # each 16-bit weight's float32 master, the rest as it is
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        back = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = back.state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in masters.items() if name in loaded)  # were bf16


def test_save_pretrained_after_convert_to_fp8_writes_and_loads_back() -> None:
    transformers = pytest.importorskip("transformers")
    import tempfile

    from safetensors.torch import load_file

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                      use_cache=False)
    model, twin = transformers.LlamaForCausalLM(config), transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (model, twin):
            ampkit.convert_to_fp8(m, ampkit.Fp8Recipe())
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)  # failed inside huggingface_hub: the layers' extra state was a dict
        saved = load_file(f"{folder}/model.safetensors")
    assert any(key.endswith("_extra_state") for key in saved)
    twin.load_state_dict(saved, strict=False)  # the recipe checked and taken back
    with pytest.raises(RuntimeError, match=r"recipe .* differs from this model's"):
        other = transformers.LlamaForCausalLM(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ampkit.convert_to_fp8(other, ampkit.Fp8Recipe(margin=1))
        other.load_state_dict(saved, strict=False)
