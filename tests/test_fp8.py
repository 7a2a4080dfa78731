"""FP8 recipes against references written from the recipes' formulas, resume, and amax agreement across ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampkit
from ampkit.formats import fp8
from ampkit.formats.fp8 import Fp8Linear, convert_to_fp8
from ampkit.formats.recipes import E4M3, E5M2, Fp8Recipe
from multiprocess import run_ranks


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def _fake(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The reference: scale, saturate at the format's largest value, round to FP8, unscale (float32)."""
    limit = {E4M3: 448.0, E5M2: 57344.0}[dtype]
    return (x.float() * scale).clamp(-limit, limit).to(dtype).float() / scale


# -- the formulas -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "amax, margin, expected",
    [(2.0, 0, 224.0), (2.0, 1, 112.0), (448.0, 0, 1.0), (0.0, 0, 7.0), (float("inf"), 0, 7.0), (float("nan"), 0, 7.0)],
)
def test_scale_is_fp8_max_over_amax_over_two_to_the_margin(amax: float, margin: int, expected: float) -> None:
    scale = fp8.scale_from_amax(torch.tensor(amax), E4M3, margin, previous=torch.tensor(7.0))
    assert scale.item() == expected  # amax 0 or not finite keeps the previous scale (Transformer Engine)


def test_quantize_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([1000.0, -1000.0, 1e-9, 3.0])
    assert fp8.quantize(x, torch.tensor(1.0), E4M3).float().tolist() == [448.0, -448.0, 0.0, 3.0]
    assert fp8.quantize(x, torch.tensor(1.0), E5M2).float()[0].item() == 1024.0  # E5M2's range, 2 mantissa bits


@pytest.mark.parametrize(
    "kwargs, message",
    [({"scaling": "jit"}, r"scaling='jit'\) is invalid: choose one of \['delayed', 'current'\]"),
     ({"format": "e5m2"}, r"format='e5m2'\) is invalid: choose one of \['e4m3', 'hybrid'\]"),
     ({"amax_history_len": 0}, r"amax_history_len=0\) is invalid: use an integer >= 1"),
     ({"margin": -1}, r"margin=-1\) is invalid"),
     ({"granularity": "row"}, r"granularity='row'\) needs scaling='current'")],
)
def test_bad_recipes_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fp8Recipe(**kwargs)


# -- delayed scaling ------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [Fp8Recipe(), Fp8Recipe(format="e4m3", amax_history_len=2,
                                                         amax_compute_algo="most_recent", margin=1)])
def test_delayed_scaling_matches_the_recipe_written_out(recipe: Fp8Recipe) -> None:
    """Three training steps of one FP8 linear against the recipe computed by hand: each step casts with
    the scales from earlier steps' amaxes, then rolls its own amaxes into the histories."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    model = Fp8Linear.from_linear(copy.deepcopy(layer), recipe)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    history = {role: [0.0] * recipe.amax_history_len for role in ("x", "w", "g")}
    scales = {"x": 1.0, "w": 1.0, "g": 1.0}
    grad_dtype = E5M2 if recipe.format == "hybrid" else E4M3

    def record(role: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        history[role] = [tensor.abs().max().item()] + history[role][:-1]
        amax = max(history[role]) if recipe.amax_compute_algo == "max" else history[role][0]
        scales[role] = float(torch.tensor(448.0 if dtype == E4M3 else 57344.0, dtype=torch.float64) / amax
                             / 2.0**recipe.margin) if amax > 0 else scales[role]

    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)) * (10.0 if step == 1 else 1.0)
        grad_out = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + step))
        xs, ws, gs = scales["x"], scales["w"], scales["g"]
        expected = _fake(x, xs, E4M3) @ _fake(w, ws, E4M3).t() + b
        record("x", x, E4M3)
        record("w", w, E4M3)
        expected_gx = _fake(grad_out, gs, grad_dtype) @ _fake(w, ws, E4M3)
        expected_gw = _fake(grad_out, gs, grad_dtype).t() @ _fake(x, xs, E4M3)
        record("g", grad_out, grad_dtype)

        x.requires_grad_()
        out = model(x)
        out.backward(grad_out)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, expected_gx, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model.weight.grad, expected_gw, rtol=1e-6, atol=1e-6)
        assert model.scale.tolist() == pytest.approx([scales["x"], scales["w"], scales["g"]], rel=1e-6)
        model.weight.grad = None


def test_an_outlier_saturates_once_then_widens_the_scale_for_the_history() -> None:
    layer = Fp8Linear.from_linear(nn.Linear(16, 16), Fp8Recipe(amax_history_len=2))
    for amax in (1.0, 1000.0, 1.0, 1.0):
        layer(torch.full((1, 16), amax))
    history = layer.amax_history[fp8.INPUT].tolist()
    assert history == [1.0, 1.0]  # the outlier left the 2-step history
    assert layer.scale[fp8.INPUT].item() == 448.0
    layer(torch.full((1, 16), 1000.0))
    assert layer.scale[fp8.INPUT].item() == pytest.approx(0.448)


def test_a_non_finite_input_leaves_the_history_and_the_next_finite_one_sets_the_scale() -> None:
    """An inf input (a float16 overflow before the layer: a step the scaler skips) is not rolled into the amax
    history: rolled in, it held the scale where it was until it rolled out (a float16 overflow before a Llama's FP8
    linear froze its scale for 8 steps); the next finite input's amax sets the scale at once."""
    layer = Fp8Linear.from_linear(nn.Linear(16, 16), Fp8Recipe(amax_history_len=4))
    layer(torch.full((1, 16), 1.0))
    layer(torch.full((1, 16), float("inf")))
    assert layer.amax_history[fp8.INPUT].tolist() == [1.0, 0.0, 0.0, 0.0]
    layer(torch.full((1, 16), 1000.0))
    assert layer.amax_history[fp8.INPUT].tolist() == [1000.0, 1.0, 0.0, 0.0]
    assert layer.scale[fp8.INPUT].item() == pytest.approx(0.448)


def test_evaluation_leaves_the_scales_alone() -> None:
    layer = Fp8Linear.from_linear(nn.Linear(16, 16), Fp8Recipe())
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 16))
    assert layer.amax_history.abs().sum().item() == 0 and layer.scale.tolist() == [1.0, 1.0, 1.0]


def test_fp8_linear_takes_16_bit_inputs_under_an_ampkit_region() -> None:
    """The converted linear computes on FP8-rounded values of its 16-bit input (against the formula:
    E4M3 input and weight at this step's scales, float32 product, rounded to the input's dtype, bias
    added there), and records the input's amax: a convert_to_fp8 that did nothing fails both."""
    model = _mlp()
    convert_to_fp8(model)
    layer = model[2]
    assert isinstance(layer, Fp8Linear)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    layer.register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
        out = model(torch.randn(4, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    x, got = seen[0]
    assert x.dtype == got.dtype == torch.bfloat16
    w = layer.weight.detach()
    want = (_fake(x, 1.0, E4M3) @ _fake(w, 1.0, E4M3).t()).to(torch.bfloat16) + layer.bias.to(torch.bfloat16)
    assert torch.equal(got, want)  # the first step's scales are 1.0
    plain = (x.float() @ w.t()).to(torch.bfloat16) + layer.bias.to(torch.bfloat16)
    assert not torch.equal(got, plain)  # FP8's rounding shows: the same linear without it differs
    assert layer.amax_history[fp8.INPUT, 0].item() == x.float().abs().max().item()


# -- current scaling (torchao) ---------------------------------------------------------------------

@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_current_scaling_runs_on_torchao_and_matches_the_formula(granularity: str) -> None:
    pytest.importorskip("torchao.float8")
    model = _mlp()
    reference = copy.deepcopy(model)
    convert_to_fp8(model, Fp8Recipe(scaling="current", granularity=granularity), include=["0"])
    assert fp8.fp8_layers(model) == ["0", "2"]
    x = torch.randn(8, 32)
    layer, ref = model[0], reference[0]
    dim = -1 if granularity == "row" else None  # one scale per row of x and of the weight
    sx = 448.0 / x.abs().amax(dim=dim, keepdim=True).double().clamp(min=1e-12)
    sw = 448.0 / ref.weight.detach().abs().amax(dim=dim, keepdim=True).double().clamp(min=1e-12)
    expected = _fake(x, sx.float(), E4M3) @ _fake(ref.weight.detach(), sw.float(), E4M3).t() + ref.bias.detach()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_o3_is_refused_on_weights_all_gathered_in_fp8_and_changes_nothing() -> None:
    """torchao's FP8 all-gather casts float32 weights: at O3 (16-bit weights) AdamW's first step raised deep in
    torch (``expected dtype float for `end```), and FSDP2 asserted on the mixed dtypes. O2 trains."""
    pytest.importorskip("torchao.float8")
    model = _mlp()
    convert_to_fp8(model, Fp8Recipe(scaling="current", fsdp_all_gather=True), include=["0"], emulate=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {name: (p, p.dtype) for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"opt_level='O3' stores 16-bit weights, but 2 weight\(s\) \(0.weight, "
                                         r"\.\.\.\) are converted with Fp8Recipe\(fsdp_all_gather=True\).*'O2'"):
        ampkit.initialize(model, optimizer, "O3", torch.bfloat16)
    assert {name: (p, p.dtype) for name, p in model.named_parameters()} == before
    assert not hasattr(model, "_ampkit_opt_level") and not optimizer.state
    model, optimizer = ampkit.initialize(model, optimizer, "O2", torch.bfloat16)
    model(torch.randn(4, 32)).float().pow(2).mean().backward()
    optimizer.step()


# -- the module swap ---------------------------------------------------------------------------

def test_first_last_and_odd_sized_linears_stay_unless_named() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 48), nn.Linear(48, 20), nn.Linear(20, 32),
                          nn.Linear(32, 16))
    weights = [m.weight for m in model]
    decisions = convert_to_fp8(model)
    assert decisions == {"0": "kept: the first linear", "1": "fp8",
                         "2": "kept: 48x20 is not a multiple of 16", "3": "kept: 20x32 is not a multiple of 16",
                         "4": "kept: the last linear"}
    assert [m.weight for m in model] == weights  # the optimizer's parameters are the model's still
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 48), nn.Linear(48, 16))
    assert convert_to_fp8(model, keep=["1"], include=["2"]) == {
        "0": "kept: the first linear", "1": "kept: named in keep=", "2": "fp8"}
    with pytest.raises(ValueError, match=r"The pattern 'blocks.\*' matches no linear of the model"):
        convert_to_fp8(_mlp(), keep=["blocks.*"])


def test_resume_is_bit_identical_and_the_recipe_is_checked() -> None:
    def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _mlp()
        convert_to_fp8(model, Fp8Recipe(amax_history_len=4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
        losses = []
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    model, optimizer = setup()
    train(model, optimizer, range(3))
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    expected = train(model, optimizer, range(3, 6))
    resumed, resumed_optimizer = setup()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    assert train(resumed, resumed_optimizer, range(3, 6)) == expected
    assert torch.equal(resumed[2].amax_history, model[2].amax_history) and torch.equal(resumed[2].scale,
                                                                                       model[2].scale)
    other = _mlp()
    convert_to_fp8(other, Fp8Recipe(amax_history_len=4, margin=2))
    with pytest.raises(RuntimeError, match=r"The checkpoint's FP8 recipe .* differs from this model's"):
        other.load_state_dict(saved["model"])


# -- distributed -----------------------------------------------------------------------------

def _amax_worker(rank: int, world: int, reduce: bool) -> list[float]:
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(nn.Linear(16, 16), Fp8Recipe(),
                                  process_group=dist.group.WORLD if reduce else None)
    x = torch.randn(4, 16) * (rank + 1)  # each rank sees other data
    layer(x).sum().backward()
    return layer.scale.tolist()


@pytest.mark.distributed
def test_amaxes_are_reduced_over_the_data_parallel_group() -> None:
    reduced = run_ranks(_amax_worker, 2, True)
    assert reduced[0] == reduced[1]
    alone = run_ranks(_amax_worker, 2, False)
    assert alone[0][fp8.INPUT] != alone[1][fp8.INPUT]  # without the group, each rank scales its own way
    assert reduced[0][fp8.INPUT] == alone[1][fp8.INPUT]  # the group's scale is the widest rank's


def _compiled_amax_worker(rank: int, world: int) -> tuple[list[bool], int, list[float]]:
    """Three steps eagerly and compiled (aot_eager, fullgraph) on a fresh copy: each step's gradients and scales."""
    import torch._dynamo.testing

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    inputs = [torch.randn(4, 16) * (rank + 1) * 4**step for step in range(3)]  # scales change on every step
    found: list[list[torch.Tensor]] = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        convert_to_fp8(model, Fp8Recipe(scaling="delayed"), include=("0", "2"), process_group=dist.group.WORLD)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        run = torch.compile(model, backend=counter, fullgraph=True) if compiled else model
        found.append([])
        for x0 in inputs:
            x = x0.clone().requires_grad_()
            run(x).square().sum().backward()
            found[-1] += [x.grad, model[0].weight.grad.clone(), model[0].scale.clone(), model[2].scale.clone()]
            model[0].weight.grad = model[2].weight.grad = None
    return [torch.equal(a, b) for a, b in zip(*found)], counter.frame_count, found[1][-2].tolist()


@pytest.mark.distributed
def test_compiled_amax_reduction_is_one_graph_with_the_eager_scales_and_gradients() -> None:
    """The amaxes are reduced by ``torch.distributed.all_reduce``, which dynamo traces into its graph (as its
    functional collective): a process group does not keep the linear eager (a graph break on either side of it)."""
    equal, graphs, scales = zip(*run_ranks(_compiled_amax_worker, 2, timeout_s=240))
    assert all(all(e) and len(e) == 12 for e in equal)
    assert graphs == (1, 1)
    assert scales[0] == scales[1]  # every rank scales as the group's widest


@pytest.mark.parametrize("margin", [0, 1])
def test_a_growing_activation_is_followed_with_the_history_lag(margin: int) -> None:
    """An input whose amax doubles every step: with ``most_recent`` the scale lags one step, so the
    cast saturates by exactly 2x without margin; a margin of 1 (2x headroom) covers the growth."""
    layer = Fp8Linear.from_linear(nn.Linear(16, 16), Fp8Recipe(amax_history_len=4, amax_compute_algo="most_recent",
                                                                margin=margin))
    saturated = []
    for step in range(6):
        amax = 2.0 ** step
        x = torch.full((1, 16), amax)
        scale_used = layer.scale[fp8.INPUT].item()
        layer(x)
        saturated.append(amax * scale_used > 448.0)
        assert layer.scale[fp8.INPUT].item() == 448.0 / amax / 2**margin  # follows the amax just seen
        assert layer.amax_history[fp8.INPUT, 0].item() == amax
    # step 0 uses the initial scale 1 (amax 1: no saturation); afterwards each step is cast with the
    # previous step's scale, 2x too large without margin
    assert saturated == ([False] + [True] * 5 if margin == 0 else [False] * 6)


def test_saved_for_backward_counts_what_fp8_stores() -> None:
    from ampkit.diagnostics.memory import saved_bytes_of_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
    x = torch.randn(8, 64)
    _, float32_bytes = saved_bytes_of_step(model, lambda: model(x).sum())
    convert_to_fp8(model)
    _, fp8_bytes = saved_bytes_of_step(model, lambda: model(x).sum())
    # The FP8 linear stores its input (8 x 256) and its weight (256 x 256) in FP8, one byte each, and three
    # scales; ReLU keeps its float32 output, which the float32 linear shared.
    assert fp8_bytes == float32_bytes + 8 * 256 + 256 * 256 + 3 * 4


def _native_fp8_runs_on_cpu() -> bool:
    """Whether ``F.scaled_mm`` has a CPU kernel (torch 2.13 and later; 2.11's is CUDA only)."""
    one = torch.ones(16, 16).to(E4M3)
    try:
        fp8.scaled_mm(one, torch.ones(()), one, torch.ones(()), torch.float32, native=True)
    except NotImplementedError:
        return False
    return True


_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not _native_fp8_runs_on_cpu(),
                                                 reason="F.scaled_mm has no CPU kernel in this torch")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _FP8_GPU, reason="needs a GPU with FP8 matmuls (compute capability >= 8.9)")]),
])
def test_native_fp8_matches_emulation(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """torch's ``F.scaled_mm`` (the native path) against the emulated matmul on the same FP8 values and
    scales, over three steps of an ``Fp8Linear`` (the third on delayed scales). On the CPU both are float32
    GEMMs that apply the scales at different points: equal to float32's rounding."""
    results = []
    for native in (True, False):
        monkeypatch.setattr(fp8, "native_fp8", lambda device, native=native: native)
        torch.manual_seed(0)
        layer = Fp8Linear.from_linear(nn.Linear(64, 32).to(device), Fp8Recipe())
        x = torch.randn(16, 64, device=device, requires_grad=True)
        for _ in range(3):
            out = layer(x)
            out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad.clone(), layer.weight.grad.clone()))
    for a, b in zip(*results):
        tolerance = 1e-5 if device == "cpu" else 1e-2
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_the_native_fp8_gemm_compiles_into_one_graph() -> None:
    """torch 2.11's dynamo refuses the ``torch._scaled_mm_v2`` that ``F.scaled_mm`` calls: unmarked, every
    compiled FP8 GEMM broke the graph there (and fullgraph=True raised). Meta tensors: the trace needs no
    FP8 kernel, so this runs on every torch CI tests."""
    from torch._dynamo.testing import CompileCounter

    def gemm(a: torch.Tensor, scale_a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
        return fp8.scaled_mm(a, scale_a, b, scale_b, torch.bfloat16, native=True) * 2

    a, b = torch.empty(16, 32, device="meta", dtype=E4M3), torch.empty(32, 48, device="meta", dtype=E5M2)
    scale = torch.empty((), device="meta")
    counter = CompileCounter()
    torch._dynamo.reset()
    out = torch.compile(gemm, backend=counter, fullgraph=True)(a, scale, b, scale)
    assert (counter.frame_count, out.shape, out.dtype) == (1, (16, 48), torch.bfloat16)


def test_a_margin_past_the_formats_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Fp8Recipe\(margin=200\) is invalid: use an integer in \[0, 8\]"):
        Fp8Recipe(margin=200)  # was accepted, and every output turned NaN from step 2
    assert Fp8Recipe(margin=8).margin == 8


def test_converting_twice_is_refused_and_keeps_the_histories() -> None:
    model = _mlp()
    convert_to_fp8(model)
    model(torch.randn(4, 32))
    history = model[2].amax_history.clone()
    with pytest.raises(ValueError, match=r"The model trains in FP8 already \(2\): convert_to_fp8 converts a model once"):
        convert_to_fp8(model)  # was: a silent reset of the amax histories and scales
    assert torch.equal(model[2].amax_history, history) and history.abs().sum() > 0


def test_an_fp8_linear_in_a_region_returns_the_regions_dtype_as_a_linear_does() -> None:
    """A float32 input (a norm's output under autocast) gave a float32 output, which every op after it
    then computed and saved in float32; torchao's and Transformer Engine's FP8 linears return the
    autocast dtype."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    fp8 = Fp8Linear.from_linear(copy.deepcopy(linear), Fp8Recipe())
    x = torch.randn(4, 32)
    with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="native")):
        assert linear(x).dtype == fp8(x).dtype == torch.bfloat16
    assert fp8(x).dtype == torch.float32  # outside a region: the input's


def test_a_checkpoint_of_another_recipe_is_refused_before_any_layer_loads() -> None:
    """On main, the first FP8 layer's weights were overwritten, then its recipe refused: a half-loaded model."""
    saved, model = _mlp(), _mlp()
    convert_to_fp8(saved, Fp8Recipe(amax_history_len=16), include=["*"])
    convert_to_fp8(model, Fp8Recipe(amax_history_len=8), include=["*"])
    with torch.no_grad():  # other weights than the checkpoint's: a load that overwrote them would show
        for param in model.parameters():
            param.add_(1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"The checkpoint's FP8 recipe .*amax_history_len=16.* differs from this "
                                           r"model's .*amax_history_len=8"):
        model.load_state_dict(saved.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
