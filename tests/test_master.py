"""FP32 master weights and the O0-O3 opt levels."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit import DynamicLossScaler, MasterWeightOptimizer
from conftest import requires_cuda


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 3))


def _task(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def _setup(level: str, opt_class: type, dtype: str, **kwargs: float):  # type: ignore[no-untyped-def]
    model = _net()
    return ampkit.initialize(model, opt_class(model.parameters(), **kwargs), level, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_update_below_16_bit_resolution_is_kept_by_the_master_copy(dtype: torch.dtype) -> None:
    # lr * grad = 1e-5 on a weight of 1.0: far below the spacing of 16-bit numbers at 1.0.
    plain = nn.Parameter(torch.ones(4, dtype=dtype))
    opt_plain = torch.optim.SGD([plain], lr=1e-5)
    mastered = nn.Parameter(torch.ones(4))
    opt_master = MasterWeightOptimizer(torch.optim.SGD([mastered], lr=1e-5))
    mastered.data = mastered.data.to(dtype)
    for _ in range(200):
        for p, opt in ((plain, opt_plain), (mastered, opt_master)):
            opt.zero_grad()
            p.float().sum().backward()
            opt.step()
    assert plain.eq(1.0).all()  # every update rounded away
    torch.testing.assert_close(opt_master.master_params[0], torch.full((4,), 1 - 200e-5), rtol=0, atol=1e-5)
    assert mastered.lt(1.0).all()  # the model sees the accumulated change


def test_o2_trains_to_float32_accuracy() -> None:
    x, y = _task()
    accuracies = {}
    for level in ("O0", "O2"):
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = ampkit.initialize(model, opt, level, dtype=torch.bfloat16)
        for _ in range(60):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        with torch.no_grad():
            accuracies[level] = (model(x).argmax(1) == y).float().mean().item()
    assert accuracies["O0"] > 0.9
    assert abs(accuracies["O2"] - accuracies["O0"]) <= 0.02


def test_o2_with_float16_and_dynamic_scaling() -> None:
    x, y = _task(64)
    model, opt = _setup("O2", torch.optim.SGD, "fp16", lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**24)  # big enough to overflow float16 gradients at first
    stepped = []
    for _ in range(12):
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        stepped.append(scaler.step(opt))
        scaler.update()
    assert not stepped[0] and all(stepped[-3:])
    assert scaler.stats.skipped == stepped.count(False) > 0


@pytest.mark.parametrize("zero_grad", ["optimizer", "model"])
def test_a_skipped_step_leaves_no_stale_master_gradients_whoever_clears_the_gradients(zero_grad: str) -> None:
    """transformers' Trainer clears gradients with ``model.zero_grad()``, not the optimizer's: on main, the masters
    kept the copies of the first overflowed step, and every later step was skipped (scale down to its floor)."""
    x, y = _task(64)
    model, opt = _setup("O2", torch.optim.SGD, "fp16", lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**24)
    stepped = []
    for _ in range(12):
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)  # the copy into the masters, before the step (gradient clipping's place)
        stepped.append(scaler.step(opt))
        scaler.update()
        (opt if zero_grad == "optimizer" else model).zero_grad()
    assert not stepped[0] and all(stepped[-3:])
    assert scaler.get_scale() >= 2.0**10


@pytest.mark.parametrize(
    "level, linear_dtype, norm_dtype, wrapped",
    [
        ("O0", torch.float32, torch.float32, False),
        ("O1", torch.float32, torch.float32, False),
        ("O2", torch.bfloat16, torch.float32, True),
        ("O3", torch.bfloat16, torch.bfloat16, False),
    ],
)
def test_opt_levels(level: str, linear_dtype: torch.dtype, norm_dtype: torch.dtype, wrapped: bool) -> None:
    model, opt = _setup(level, torch.optim.SGD, "bf16", lr=0.1)
    assert model[0].weight.dtype == linear_dtype and model[1].weight.dtype == norm_dtype
    assert isinstance(opt, MasterWeightOptimizer) == wrapped
    hidden = {}
    model[0].register_forward_hook(lambda m, i, o: hidden.__setitem__("dtype", o.dtype))
    out = model(torch.randn(2, 8))  # float32 inputs are cast at the boundary
    assert hidden["dtype"] == (torch.float32 if level == "O0" else torch.bfloat16)
    assert out.dtype == (torch.bfloat16 if level == "O1" else torch.float32)


def test_unknown_opt_level() -> None:
    with pytest.raises(ValueError, match=r"Unknown opt_level: 'O4'. Choose one of \['O0', 'O1', 'O2', 'O3'\]"):
        ampkit.initialize(_net(), None, "O4")


def test_param_groups_schedulers_and_zero_grad() -> None:
    model = _net()
    inner = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[3].parameters(), "lr": 0.01}], lr=0.5
    )
    model, opt = ampkit.initialize(model, inner, "O2", "bf16")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.005]
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in opt.model_params) and len(opt.model_params) == 4


def test_checkpoint_holds_float32_masters_and_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, opt = _setup("O2", torch.optim.Adam, "bf16", lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt")
    assert all(m.dtype == torch.float32 for m in saved["master_params"])

    # Into a float32 model without loss.
    fp32_model = _net()
    fp32_model.load_state_dict(opt.fp32_state_dict(model))
    assert torch.equal(fp32_model[0].weight, opt.master_params[0])

    # Into a fresh O2 setup: masters and Adam state restored exactly.
    model2, opt2 = _setup("O2", torch.optim.Adam, "bf16", lr=1e-3)
    opt2.load_state_dict(saved)
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
    assert torch.equal(model2[0].weight, model[0].weight)


def test_float32_checkpoint_fills_the_masters_exactly() -> None:
    reference = _net()
    with torch.no_grad():
        reference[0].weight.add_(1e-4)  # not representable in bfloat16
    model, opt = _setup("O2", torch.optim.SGD, "bf16", lr=0.1)
    opt.load_fp32_weights(model, reference.state_dict())
    index = [id(p) for p in opt.model_params].index(id(model[0].weight))
    assert torch.equal(opt.master_params[index], reference[0].weight)
    assert model[0].weight.dtype == torch.bfloat16


def test_bad_checkpoints_are_named() -> None:
    _, opt = _setup("O2", torch.optim.SGD, "bf16", lr=0.1)
    with pytest.raises(RuntimeError, match="Cannot load an empty dict into MasterWeightOptimizer"):
        opt.load_state_dict({})
    with pytest.raises(RuntimeError, match=r"Not an optimizer state dict: keys \['weights'\]"):
        opt.load_state_dict({"weights": 1})
    with pytest.raises(RuntimeError, match="has 1 master weights, this optimizer 6"):
        opt.load_state_dict({"version": 1, "optimizer": {}, "master_params": [torch.zeros(1)]})


def test_o2_keep_float32_embeddings_keeps_the_residual_stream_and_a_tied_head_in_float32() -> None:
    from ampkit.experiment.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=32, context=8, d_model=32, n_layers=1, n_heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = ampkit.initialize(model, optimizer, "O2", torch.bfloat16, compute="float32",
                                         keep_float32=[nn.Embedding])
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["tok.weight"] == dtypes["pos.weight"] == torch.float32  # and the head tied to tok
    assert dtypes["blocks.0.attn.qkv.weight"] == torch.bfloat16
    streams = []
    model.blocks[0].register_forward_hook(lambda m, args, out: streams.append(out.dtype))
    model(torch.randint(0, 32, (2, 8))).float().sum().backward()  # 16-bit layers cast their float32 inputs
    optimizer.step()
    assert streams == [torch.float32]
    with pytest.raises(ValueError, match="keep_float32= applies at O2 only"):
        ampkit.initialize(nn.Linear(2, 2), None, "O1", keep_float32=[nn.Embedding])
    with pytest.raises(ValueError, match="must list nn.Module subclasses"):
        ampkit.initialize(nn.Linear(2, 2), None, "O2", keep_float32=["Embedding"])  # type: ignore[list-item]


# -- bad input (moved from test_bad_input.py) ----------------------------------------


def test_initialize_twice_is_refused() -> None:
    # the second call wrapped masters of masters: training silently stopped changing the weights
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ampkit.initialize(model, optimizer, "O2", torch.bfloat16)
    with pytest.raises(ValueError, match="The model was initialized at O2 already; call ampkit.initialize once"):
        ampkit.initialize(model, optimizer, "O2", torch.bfloat16)
    with pytest.raises(ValueError, match="already keeps master weights"):
        ampkit.MasterWeightOptimizer(optimizer)  # the inner optimizer, wrapped again


def test_master_weight_optimizer_takes_an_optimizer() -> None:
    with pytest.raises(ValueError, match="MasterWeightOptimizer takes a torch.optim.Optimizer, got Linear"):
        ampkit.MasterWeightOptimizer(nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "state, message",
    [
        (None, "Cannot load None into MasterWeightOptimizer"),
        ({"version": 1, "master_params": []}, r"misses \['optimizer'\]"),  # was KeyError
        ({"version": 99, "optimizer": {}, "master_params": []}, "version 99 is not 1"),  # was accepted
        # issue 40: was a raw AttributeError
        ({"version": 1, "optimizer": None, "master_params": [torch.zeros(2, 2), torch.zeros(2)]},
         r"'optimizer' is NoneType, not the inner optimizer's state dict"),
    ],
)
def test_master_weight_state_mistakes_are_named(state: object, message: str) -> None:
    model = nn.Linear(2, 2)
    optimizer = ampkit.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=message):
        optimizer.load_state_dict(state)  # type: ignore[arg-type]


def test_a_failed_master_weight_load_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    optimizer = ampkit.MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    other = ampkit.MasterWeightOptimizer(torch.optim.SGD(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).parameters(),
                                                         lr=0.5))
    before = [m.clone() for m in optimizer.master_params]
    with pytest.raises(RuntimeError, match=r"Master weight 2 in the checkpoint is \(2, 2\), this model's \(3, 2\)"):
        optimizer.load_state_dict(other.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, optimizer.master_params))  # master 0 was replaced before
    assert optimizer.param_groups[0]["lr"] == 0.1  # and the inner lr


# -- the second bad-input sweep (issue 25): every check before any change ---------------------------


@pytest.mark.parametrize("optimizer, message", [
    ("sgd", "optimizer='sgd' is a str, not a torch.optim.Optimizer"),
    ("other-model", r"The optimizer steps 2 tensor\(s\) that are not parameters of this model"),
])
def test_initialize_refuses_an_optimizer_that_would_train_nothing(optimizer: object, message: str) -> None:
    model = nn.Linear(3, 3)
    if optimizer == "other-model":
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)  # was: trained nothing, silently
    with pytest.raises(ValueError, match=message):
        ampkit.initialize(model, optimizer, "O1")  # type: ignore[arg-type]
    assert getattr(model, "_ampkit_opt_level", None) is None


@pytest.mark.parametrize("call", ["int8", "string-at-O2", "stochastic-adam"])
def test_a_refused_initialize_changes_nothing_and_the_retry_works(call: str) -> None:
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError):
        if call == "int8":
            ampkit.initialize(model, None, "O2", torch.int8)  # type: ignore[arg-type]
        elif call == "string-at-O2":
            ampkit.initialize(model, "adam", "O2", torch.bfloat16)  # type: ignore[arg-type]
        else:  # was refused only after the weights were cast to bfloat16
            ampkit.initialize(model, torch.optim.Adam(model.parameters()), "O3", torch.bfloat16, update="stochastic")
    assert model.weight.dtype == torch.float32 and getattr(model, "_ampkit_opt_level", None) is None
    model, optimizer = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16 and isinstance(optimizer, MasterWeightOptimizer)


def test_the_compute_mode_warning_points_at_the_users_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """On main it pointed at ampkit's own optim/levels.py, whatever line of the user's led to it."""
    import warnings

    from ampkit.precision import state

    monkeypatch.setattr(state, "_warned", set())  # warned once per process: as if none had been
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ampkit.initialize(_net(), None, "O2", dtype=torch.float16, compute="float32")
    found = [w for w in caught if w.category is ampkit.ComputeModeWarning]
    assert found and all(w.filename == __file__ for w in found)


@pytest.mark.parametrize("resume", [False, True])
def test_a_float32_weight_is_its_own_master_and_training_is_unchanged(resume: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """O2 keeps the LayerNorm float32: from the first step its weights are their own masters (no float32 copy of a
    float32 weight); the run is bit-identical to one with copies, and a resumed run moves the moments over too."""
    x, y = _task(64)

    def train(steps: int, share: bool, start: dict | None = None):  # type: ignore[no-untyped-def]
        if not share:  # the copies kept, as before
            monkeypatch.setattr(MasterWeightOptimizer, "_share_float32_masters", lambda self: None)
        model, optimizer = _setup("O2", torch.optim.AdamW, "bf16", lr=1e-2)
        if start is not None:
            optimizer.load_state_dict(start)
        for _ in range(steps):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        monkeypatch.undo()
        return model, optimizer

    halfway = train(3, share=True)[1].state_dict() if resume else None
    shared_model, shared = train(3 if resume else 6, share=True, start=halfway)
    copied_model, copied = train(6, share=False)
    norm = shared_model[1]
    masters = {id(m) for m in shared.master_params}
    assert id(norm.weight) in masters and id(norm.bias) in masters  # the parameters themselves
    assert id(shared_model[0].weight) not in masters  # a 16-bit weight keeps its float32 master
    assert id(copied_model[1].weight) not in {id(m) for m in copied.master_params}
    assert all(torch.equal(a, b) for a, b in zip(shared_model.parameters(), copied_model.parameters()))
    assert ampkit.measured_state_bytes(copied_model, copied) - ampkit.measured_state_bytes(shared_model, shared) \
        == 4 * sum(p.numel() for p in norm.parameters())
    assert set(map(id, shared.state)) == masters  # the moments are keyed by the masters, the norm's included


class _SeenNormInputs(torch.overrides.TorchFunctionMode):
    """Records the dtype of the input each norm function is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (nn.functional.layer_norm, nn.functional.group_norm, nn.functional.rms_norm):
            self.seen.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _norms() -> list[tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return [(nn.LayerNorm(8), (2, 3, 8)), (nn.GroupNorm(2, 8), (2, 8, 3)), (nn.RMSNorm(8), (2, 3, 8))]


def test_o2_norms_run_on_a_float32_copy_off_the_cpu_and_return_their_inputs_dtype() -> None:
    """CUDA's layer_norm refuses a bfloat16 input beside float32 weights (an H200, torch 2.11: every O2 GPT step
    failed): off the CPU a kept torch norm computes on a float32 copy (the meta device stands in for CUDA here)."""
    from ampkit.optim.kept import add_norm_casts

    for norm, shape in _norms():
        add_norm_casts([norm.to("meta")])
        spy = _SeenNormInputs()
        with spy:
            out = norm(torch.empty(shape, device="meta", dtype=torch.bfloat16))
        assert spy.seen == [torch.float32] and out.dtype == torch.bfloat16, type(norm)
    weightless = nn.LayerNorm(8, elementwise_affine=False)
    add_norm_casts([weightless])  # nothing to mix with: it takes the 16-bit input as it is
    with (spy := _SeenNormInputs()):
        weightless(torch.empty(2, 8, device="meta", dtype=torch.bfloat16))
    assert spy.seen == [torch.bfloat16]


def test_o2_norms_on_the_cpu_take_16_bit_inputs_as_before_bit_for_bit_and_deep_copies_keep_their_own() -> None:
    import copy

    from ampkit.optim.kept import add_norm_casts

    for norm, shape in _norms():
        x = torch.randn(shape).bfloat16()
        expected = norm(x)
        add_norm_casts([norm])
        spy = _SeenNormInputs()
        with spy:
            out = norm(x)
        assert spy.seen == [torch.bfloat16] and torch.equal(out, expected), type(norm)
        twin = copy.deepcopy(norm)
        with torch.no_grad():
            twin.weight.mul_(2)
        assert not torch.equal(twin(x), out) and torch.equal(norm(x), expected), type(norm)


@requires_cuda
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_o2_trains_torchs_norms_on_cuda(dtype: str) -> None:
    """Layer, group, RMS and batch norms kept in float32 beside 16-bit linears and convolutions, one step on CUDA."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8), nn.GroupNorm(2, 8), nn.Flatten(1),
                          nn.LayerNorm(8 * 6), nn.Linear(8 * 6, 16), nn.RMSNorm(16), nn.Linear(16, 3)).cuda()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", dtype)
    outputs = []
    for module in model:
        module.register_forward_hook(lambda m, i, o: outputs.append(o.dtype))
    loss = nn.functional.cross_entropy(model(torch.randn(4, 4, 6, device="cuda")), torch.tensor([0, 1, 2, 0]).cuda())
    loss.backward()
    opt.step()
    low = torch.float16 if dtype == "fp16" else torch.bfloat16
    assert outputs == [low] * len(model) and torch.isfinite(loss)
    assert model[4].weight.dtype == torch.float32 and model[5].weight.dtype == low


def test_a_deep_copy_of_the_model_and_its_optimizer_steps_on_its_own() -> None:
    """``copy.deepcopy`` of the master-weight optimizer (the guard's replay copies a LightningModule that holds it)
    failed with AttributeError: torch's pickled state of an optimizer is its defaults, state and groups, which this
    wrapper delegates to the inner optimizer. A copy of the model and the optimizer together steps the copy's masters
    and writes them into the copy's model; the original's masters are untouched."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2",
                                         torch.bfloat16, compute="native")
    model(torch.randn(3, 4)).float().sum().backward()
    optimizer.step()
    copied, copied_optimizer = copy.deepcopy((model, optimizer))
    before = [master.clone() for master in optimizer.master_params]
    copied_optimizer.zero_grad()
    copied(torch.randn(3, 4)).float().sum().backward()
    copied_optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, optimizer.master_params))
    assert not all(torch.equal(a, b) for a, b in zip(before, copied_optimizer.master_params))
    assert torch.equal(copied[0].weight, copied_optimizer.master_params[0].to(torch.bfloat16))
