"""Float32 compute on 16-bit values: fidelity to native kernels and to exact arithmetic,
memory, overflow, and the auto decision from measured hardware."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit import float32_compute
from ampkit.float32_compute import fast_paths, gelu_recompute
from ampkit.precision import decide
from ampkit.hardware import throughput
from ampkit.diagnostics.memory import saved_bytes_of_step
from ampkit.precision import state
from conftest import LOW_DTYPES, fake_throughput, requires_cuda


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference between ``got`` and ``want`` in units in the last place of ``dtype``."""
    got, want = got.detach().float(), want.detach().float()
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    got, want = got[finite], want[finite]
    _, exponent = torch.frexp(torch.maximum(got.abs(), want.abs()))
    ulp = torch.ldexp(torch.ones_like(want), exponent - 1 - MANTISSA_BITS[dtype])
    smallest = torch.finfo(dtype).smallest_normal * 2.0 ** -MANTISSA_BITS[dtype]  # the subnormal step
    return float(((got - want).abs() / ulp.clamp(min=smallest)).max()) if want.numel() else 0.0


def gemm_dtypes(step: Callable[[], object]) -> set[torch.dtype]:
    """The dtypes the GEMM and convolution kernels below autograd receive while ``step`` runs
    (``_Spy``): {float32} where float32 compute ran, the 16-bit dtype where native kernels did.
    Agreement tests check it too, so a float32 path that silently ran native kernels fails them."""
    spy = _Spy()
    with spy:
        step()
    assert spy.dtypes, "no GEMM ran: the check would pass vacuously"
    return set(spy.dtypes)


# op -> (function, input shapes, constant arguments); small, so the native 16-bit run is
# quick on any CPU. A Python function takes the generic path (a dispatch mode over the
# op's decomposition); the ATen overloads that autocast hands over take the fast paths.
OPS: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[int, ...]], tuple]] = {
    "mm": (torch.mm, [(16, 32), (32, 8)], ()),
    "bmm": (torch.bmm, [(3, 16, 32), (3, 32, 8)], ()),
    "linear": (F.linear, [(4, 5, 32), (8, 32), (8,)], ()),
    "conv2d": (lambda x, w: F.conv2d(x, w, padding=1), [(2, 8, 6, 6), (4, 8, 3, 3)], ()),
    "linear-fast": (torch.ops.aten.linear.default, [(4, 5, 32), (8, 32), (8,)], ()),
    "conv2d-fast": (torch.ops.aten.conv2d.default, [(2, 8, 6, 6), (4, 8, 3, 3), (4,)], ([2, 1], [1, 0])),
}


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(OPS))
def test_emulated_ops_match_native_kernels_within_one_ulp(op: str, dtype: torch.dtype) -> None:
    fn, shapes, constants = OPS[op]
    for _ in range(5):
        inputs = [torch.randn(*shape).to(dtype).requires_grad_() for shape in shapes]
        found: list[torch.Tensor] = []
        # float32 kernels ran (a silently native run_in_float32 would match native with 0 ulps)
        assert gemm_dtypes(lambda: found.append(float32_compute.run_in_float32(fn, *inputs, *constants))) == {
            torch.float32}
        out, native = found[0], fn(*inputs, *constants)
        assert out.dtype == native.dtype == dtype
        assert ulps(out, native, dtype) <= 1
        if not op.startswith("conv2d"):  # see the next test for convolution's backward
            g = torch.randn_like(out)
            grads: list[tuple[torch.Tensor, ...]] = []
            assert gemm_dtypes(lambda: grads.append(torch.autograd.grad(out, inputs, g))) == {torch.float32}
            for e, n in zip(grads[0], torch.autograd.grad(native, inputs, g)):
                assert e.dtype == n.dtype and ulps(e, n, dtype) <= 1


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(OPS))
def test_emulated_forward_and_backward_are_correctly_rounded(op: str, dtype: torch.dtype) -> None:
    """Against float64 arithmetic on the same 16-bit values, rounded once: what a tensor
    core computes (float32 accumulation). torch's native 16-bit convolution backward on
    CPUs without 16-bit arithmetic is further off (8-99 ulps measured on AVX2): that is
    why the convolution's backward is checked here and not against native."""
    fn, shapes, constants = OPS[op]
    inputs = [torch.randn(*shape).to(dtype).requires_grad_() for shape in shapes]
    out = float32_compute.run_in_float32(fn, *inputs, *constants)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, g)
    exact_inputs = [t.detach().double().requires_grad_() for t in inputs]
    exact = fn(*exact_inputs, *constants)
    exact_grads = torch.autograd.grad(exact, exact_inputs, g.double())
    assert ulps(out, exact.to(dtype), dtype) <= 1
    for got, want in zip(grads, exact_grads):
        assert ulps(got, want.to(dtype), dtype) <= 1


def test_emulated_float16_overflows_where_native_does() -> None:
    a = torch.tensor([[65504.0, 1.0]], dtype=torch.float16)
    b = torch.tensor([[2.0], [0.0]], dtype=torch.float16)
    native, emulated = torch.mm(a, b), float32_compute.run_in_float32(torch.mm, a, b)
    assert native.isinf().all() and emulated.isinf().all()
    fits = torch.tensor([[65504.0]], dtype=torch.float16)  # the largest float16 stays finite
    assert float32_compute.run_in_float32(torch.mm, fits, torch.ones(1, 1, dtype=torch.float16)).item() == 65504.0


def test_emulated_float16_keeps_subnormals_and_flushes_below_them() -> None:
    a = torch.tensor([[2.0**-12]], dtype=torch.float16)
    for factor, expected in ((2.0**-6, 2.0**-18), (2.0**-14, 0.0)):  # 2^-18 is subnormal; 2^-26 < 2^-24 is 0
        b = torch.tensor([[factor]], dtype=torch.float16)
        found: list[torch.Tensor] = []
        assert gemm_dtypes(lambda: found.append(float32_compute.run_in_float32(torch.mm, a, b))) == {torch.float32}
        assert found[0].dtype == torch.float16  # rounded once to float16: 2^-26 becomes 0, not a float32 2^-26
        assert found[0].item() == torch.mm(a, b).item() == expected


class _Spy(TorchDispatchMode):
    """Records the dtype of every GEMM / convolution kernel that runs below it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "convolution", "convolution_backward") or "flash_attention" in name:
            self.dtypes.append(args[0].dtype if args[0] is not None else args[1].dtype)
        return func(*args, **(kwargs or {}))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("mode", ["float32", "native"])
def test_every_gemm_of_a_training_step_computes_as_the_mode_says(level: str, mode: str) -> None:
    model, _ = ampkit.initialize(_ConvNet(), None, level, torch.bfloat16, compute=mode)
    spy = _Spy()
    with spy, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(torch.randn(2, 1, 6, 6)).float().sum()
        loss.backward()
    assert len(spy.dtypes) >= 4  # conv, linear, and their backward
    expected = torch.float32 if mode == "float32" else torch.bfloat16
    assert set(spy.dtypes) == {expected}
    assert all(p.grad is not None for p in model.parameters())


def test_saved_for_backward_is_a_native_runs() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    x = torch.randn(4, 1, 8, 8)
    saved, kernels = {}, {}
    for mode in ("native", "float32"):
        model, _ = ampkit.initialize(copy.deepcopy(base), None, "O2", torch.bfloat16, compute=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")

            def step() -> None:
                _, saved[mode] = saved_bytes_of_step(model, lambda: model(x).sum())

            kernels[mode] = gemm_dtypes(step)
    assert kernels == {"native": {torch.bfloat16}, "float32": {torch.float32}}  # each mode ran its own kernels
    assert saved["float32"] == saved["native"] > 0


def test_twenty_steps_of_native_and_emulated_bf16_o1_agree() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    teacher = torch.randn(16, 4)
    data = [(x, (x @ teacher).argmax(1)) for x in torch.randn(20, 32, 16)]
    curves, kernels = {}, {}
    for mode in ("native", "float32"):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = ampkit.initialize(model, optimizer, "O1", torch.bfloat16, compute=mode)
        losses: list[float] = []

        def train() -> None:
            for x, y in data:
                optimizer.zero_grad()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loss = F.cross_entropy(model(x).float(), y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())

        kernels[mode] = gemm_dtypes(train)
        curves[mode] = torch.tensor(losses)
    assert kernels == {"native": {torch.bfloat16}, "float32": {torch.float32}}
    assert curves["native"][-1] < 0.8 * curves["native"][0]  # it learned
    assert torch.allclose(curves["float32"], curves["native"], rtol=1e-2, atol=0)


def test_emulated_fp16_with_loss_scaling_skips_the_steps_native_skips() -> None:
    """A scale too large for float16 overflows the backward GEMMs in both modes alike."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    data = [(torch.randn(8, 8), torch.randint(0, 2, (8,))) for _ in range(12)]
    history, kernels = {}, {}
    for mode in ("native", "float32"):
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = ampkit.initialize(model, optimizer, "O2", torch.float16, compute=mode)
        scaler = ampkit.DynamicLossScaler(init_scale=2.0**24, growth_interval=3)

        def train() -> None:
            for x, y in data:
                optimizer.zero_grad()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()

        kernels[mode] = gemm_dtypes(train)
        history[mode] = [(scale, skipped) for _, scale, skipped in scaler.stats.history]
    assert kernels == {"native": {torch.float16}, "float32": {torch.float32}}
    assert any(skipped for _, skipped in history["native"])  # the test can fail: native did overflow
    assert history["float32"] == history["native"]


# -- the auto decision ---------------------------------------------------------------


@pytest.mark.parametrize(
    "speedups, expected",
    [
        ({"matmul": 0.013, "conv": 0.05}, {"matmul", "conv"}),  # an AVX2-only CPU
        ({"matmul": 2.0, "conv": 1.8}, set()),  # AVX-512 BF16, or a tensor-core GPU
        ({"matmul": 1.5, "conv": 0.5}, {"conv"}),  # each class decided on its own
    ],
)
def test_auto_follows_the_measured_speed(monkeypatch: pytest.MonkeyPatch, speedups: dict[str, float],
                                         expected: set[str]) -> None:
    monkeypatch.setattr(throughput, "measure", lambda device="cpu", refresh=False: fake_throughput(speedups))
    assert decide.decision("cpu", torch.bfloat16, "auto").classes == expected
    assert decide.decision("cpu", torch.bfloat16, "native").classes == set()
    assert decide.decision("cpu", torch.bfloat16, "float32").classes == {"matmul", "conv"}
    ops = decide.decision_of(ampkit.Policy.default("cpu", torch.bfloat16)).ops
    assert ("conv2d" in ops) == ("conv" in expected) and ("linear" in ops) == ("matmul" in expected)


def test_auto_states_its_choice_once_with_the_measured_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throughput, "measure",
                        lambda device="cpu", refresh=False: fake_throughput({"matmul": 0.013, "conv": 0.05}))
    monkeypatch.setattr(state, "_warned", set())
    policy = ampkit.Policy.default("cpu", torch.bfloat16)
    with pytest.warns(ampkit.ComputeModeWarning, match=r"conv 0.05x, matmul 0.013x float32's speed"):
        ampkit.autocast(policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ampkit.autocast(policy)


def test_forcing_slow_native_kernels_warns_with_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throughput, "measure",
                        lambda device="cpu", refresh=False: fake_throughput({"matmul": 0.013, "conv": 0.05}))
    monkeypatch.setattr(state, "_warned", set())
    with pytest.warns(ampkit.SlowPrecisionWarning, match=r"native float16 kernels run matmul at 0.013x"):
        ampkit.autocast(ampkit.Policy.default("cpu", torch.float16, compute="native"))


@pytest.mark.parametrize("matmul_speedup", [0.013, 1.9])  # native slower (a warning), faster (nothing to say)
def test_a_region_built_every_step_reads_the_measurements_once(monkeypatch: pytest.MonkeyPatch,
                                                               matmul_speedup: float) -> None:
    """The slow-kernel note's text reads the measurements (most of an empty region's time, when it was asked at every
    build): asked the first time only, whether or not there is something to say."""
    reads = []

    def measure(device: str = "cpu", refresh: bool = False) -> Any:
        reads.append(device)
        return fake_throughput({"matmul": matmul_speedup, "conv": matmul_speedup})

    monkeypatch.setattr(throughput, "measure", measure)
    monkeypatch.setattr(state, "_warned", set())
    policy = ampkit.Policy.default("cpu", torch.float16, compute="native")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with ampkit.autocast(policy):
                pass
    assert len(reads) == 1
    assert [type(w.message) for w in caught] == ([ampkit.SlowPrecisionWarning] if matmul_speedup < 1 else [])


def test_unknown_compute_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"Unknown compute mode: 'fp32'. Choose one of \['auto', 'native', 'float32'\]"):
        ampkit.Policy.default("cpu", compute="fp32")
    with pytest.raises(ValueError, match="Unknown compute mode: 'fast'"):
        ampkit.initialize(nn.Linear(2, 2), None, "O2", compute="fast")


def test_edited_policies_and_overrides_work_in_float32_compute() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")
    seen: dict[str, torch.dtype] = {}
    model[1].register_forward_hook(lambda m, i, o: seen.__setitem__("gelu", o.dtype))
    model[2].register_forward_hook(lambda m, i, o: seen.__setitem__("head", o.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampkit.autocast(policy.with_ops(deny=["gelu"]).with_modules("2", dtype=torch.float32), model=model):
            out = model(torch.randn(2, 8))
    assert seen == {"gelu": torch.float32, "head": torch.float32}
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_no_grad_and_second_backward() -> None:
    """retain_graph=True works as for a native op (issue 71's rule 6: the generic path kept a nested graph that
    its first backward freed, and a second backward was refused)."""
    w = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with torch.no_grad():
        assert float32_compute.run_in_float32(torch.mm, x, w).dtype == torch.bfloat16
    out = float32_compute.run_in_float32(torch.mm, x, w)
    assert out.grad_fn.name() == "Float32ComputeBackward"
    out.float().sum().backward(retain_graph=True)
    first = w.grad.clone()
    out.float().sum().backward()
    assert torch.equal(w.grad, 2 * first)
    assert torch.equal(first, x.float().sum(0)[:, None].expand(4, 4).to(torch.bfloat16))


@requires_cuda
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_cuda_float32_compute_matches_tensor_cores_and_auto_picks_native(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("no bfloat16 tensor cores")
    a = torch.randn(64, 128, device="cuda").to(dtype).requires_grad_()
    b = torch.randn(128, 32, device="cuda").to(dtype).requires_grad_()
    out, native = float32_compute.run_in_float32(torch.mm, a, b), torch.mm(a, b)
    assert ulps(out, native, dtype) <= 1
    g = torch.randn_like(out)
    for e, n in zip(torch.autograd.grad(out, (a, b), g), torch.autograd.grad(native, (a, b), g)):
        assert ulps(e, n, dtype) <= 1
    assert decide.decision("cuda", dtype, "auto").classes == set()  # tensor cores beat float32


def test_linear_and_convolutions_take_the_fast_paths_and_the_rest_the_generic_one() -> None:
    x, w = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True), torch.randn(3, 4, dtype=torch.bfloat16)
    assert float32_compute.run_in_float32(torch.ops.aten.linear.default, x, w).grad_fn.name() == "_LinearBackward"
    image, kernel = torch.randn(1, 2, 5, 5, dtype=torch.bfloat16, requires_grad=True), torch.randn(3, 2, 3, 3)
    conv = float32_compute.run_in_float32(torch.ops.aten.conv2d.default, image, kernel.bfloat16())
    assert conv.grad_fn.name() == "_ConvolutionBackward"
    same = float32_compute.run_in_float32(torch.ops.aten.conv2d.padding, image, kernel.bfloat16(), None, [1, 1], "same")
    assert same.grad_fn.name() == "Float32ComputeBackward" and same.shape == (1, 3, 5, 5)
    with pytest.raises(RuntimeError, match="same dtype"):  # as native: mixed dtypes are refused, not upcast
        float32_compute.run_in_float32(torch.ops.aten.linear.default, x, w.float())


@pytest.mark.parametrize("mode", ["float32", "native"])
def test_attention_forward_and_backward_compute_as_the_mode_says(mode: str) -> None:
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute=mode)
    throughput.measure("cpu")  # its timed matmuls (once per machine) must not run under the spy
    spy = _Spy()
    with spy, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ampkit.autocast(policy):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and q.grad is not None and q.grad.dtype == torch.bfloat16
    # the fused kernel forward, and in float32 compute the backward's: the forward again, then its backward
    assert len(spy.dtypes) == (3 if mode == "float32" else 2)
    assert set(spy.dtypes) == {torch.float32 if mode == "float32" else torch.bfloat16}


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_attention_takes_a_fast_path_bit_identical_to_the_generic_one(dtype: torch.dtype) -> None:
    """The fast path (public attention on float32 copies, its backward the forward run again under autograd) gives
    the generic path's bits, and float32 attention's rounded: any shape torch takes, 3-D included."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 16, 3, 2, 8).to(dtype).requires_grad_()  # q, k, v: views of one tensor, as in a GPT
    grad = torch.randn(2, 2, 16, 8).to(dtype)

    def run(fn: Callable[..., torch.Tensor], three_d: bool = False, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        q, k, v = (t.flatten(0, 1) if three_d else t for t in qkv.permute(2, 0, 3, 1, 4))
        out = float32_compute.run_in_float32(fn, q, k, v, **kwargs)
        (g,) = torch.autograd.grad(out, qkv, grad.flatten(0, 1) if three_d else grad)
        return out, g, out.grad_fn.name()

    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    for kwargs in ({"is_causal": True}, {"scale": 0.3}, {"attn_mask": mask}):
        fast, generic = run(sdpa, **kwargs), run(F.scaled_dot_product_attention, **kwargs)  # a Python function: generic
        assert (fast[2], generic[2]) == ("_AttentionBackward", "Float32ComputeBackward")
        assert torch.equal(fast[0], generic[0]) and torch.equal(fast[1], generic[1])
        assert fast[0].dtype == fast[1].dtype == dtype
        reference = qkv.detach().float().requires_grad_()
        out = F.scaled_dot_product_attention(*reference.permute(2, 0, 3, 1, 4), **kwargs)
        (want,) = torch.autograd.grad(out, reference, grad.float())
        assert torch.equal(fast[0], out.to(dtype)) and ulps(fast[1], want, dtype) <= 1
        three_d = run(sdpa, three_d=True, **kwargs)  # torch's kernel blocks 3-D inputs its own way: not bitwise
        assert three_d[2] == "_AttentionBackward" and ulps(three_d[1], want, dtype) <= 1
        assert ulps(three_d[0].reshape(fast[0].shape), out, dtype) <= 1
    # Dropout (its random draws) is the generic path's, its backward drawing the forward's mask again: as float32
    # attention's own autograd does, which draws the same mask from the same seed.
    torch.manual_seed(1)
    dropped, g, name = run(sdpa, dropout_p=0.5)
    reference = qkv.detach().float().requires_grad_()
    torch.manual_seed(1)
    out = F.scaled_dot_product_attention(*reference.permute(2, 0, 3, 1, 4), dropout_p=0.5)
    (want,) = torch.autograd.grad(out, reference, grad.float())
    assert name == "Float32ComputeBackward" and torch.equal(dropped, out.to(dtype)) and ulps(g, want, dtype) <= 1


@pytest.mark.parametrize("kv_tokens", [8, 12], ids=["self", "cross"])
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default-scale", "scale"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_float32_attention_in_each_call_form_against_float64_math(is_causal: bool, scale: float | None,
                                                                   kv_tokens: int) -> None:
    # Keys and values as the strided views a fused projection gives; the reference is attention's formula in
    # float64 on the same bf16 values, forward and backward: within one bf16 rounding of it.
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, 16, generator=generator).bfloat16().requires_grad_()
    kv = torch.randn(2, 3, kv_tokens, 32, generator=generator).bfloat16().requires_grad_()
    k, v = kv.split(16, -1)
    out = float32_compute.run_in_float32(torch.ops.aten.scaled_dot_product_attention.default, q, k, v,
                                         is_causal=is_causal, scale=scale)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-2, -1) * (scale if scale is not None else 16 ** -0.5)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(8, kv_tokens, dtype=torch.bool).tril(), float("-inf"))
    want = scores.softmax(-1) @ v64
    assert out.grad_fn.name() == "_AttentionBackward" and ulps(out, want, torch.bfloat16) <= 1
    grad = torch.randn(out.shape, generator=generator).bfloat16()
    got = torch.autograd.grad(out, (q, kv), grad)
    expected = torch.autograd.grad(want, (q64, k64, v64), grad.double())
    # each within a bf16 rounding of its largest (a gradient's near-zero entries are sums that cancel)
    for g, e in ((got[0], expected[0]), (got[1], torch.cat(expected[1:], -1))):
        torch.testing.assert_close(g.double(), e, rtol=2**-8, atol=2**-8 * float(e.abs().max()))


def test_a_linear_after_a_gelu_recomputes_its_input_bit_for_bit_and_saves_one_hidden_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(approximate="tanh"), nn.Linear(128, 32))
    x = torch.randn(64, 32)
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")

    def step() -> torch.Tensor:
        with ampkit.autocast(policy):
            return mlp(x).float().square().mean()

    def gradients() -> list[torch.Tensor]:
        grads = [p.grad.clone() for p in mlp.parameters()]
        mlp.zero_grad()
        return grads

    loss, recomputing = saved_bytes_of_step(mlp, step)
    loss.backward()
    recomputed = gradients()
    hidden: list[torch.Tensor] = []  # the (64, 128) tensors packed under another's hooks, as packed

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape == (64, 128):
            hidden.append(t.detach().clone())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # another's hooks pack what the linear saves
        saved_loss = step()
    assert len(hidden) == 2 and torch.equal(hidden[0], hidden[1])  # the GELU's input, for the GELU and the linear
    saved_loss.backward()
    assert torch.equal(loss, saved_loss)
    assert all(torch.equal(a, b) for a, b in zip(recomputed, gradients()))
    monkeypatch.setattr(fast_paths, "gelu_input", lambda x: None)
    _, saving = saved_bytes_of_step(mlp, step)
    assert saving - recomputing == 64 * 128 * 2  # the bf16 GELU output, which the second linear no longer saves
    step().backward()  # the GELU output saved: the same gradients
    assert all(torch.equal(a, b) for a, b in zip(recomputed, gradients()))


def test_a_gelu_output_or_input_written_in_place_is_saved_not_recomputed() -> None:
    """The recompute would give the GELU's output as computed, not as the model changed it after."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(4, 8)
    with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
        hidden = F.gelu(first(x))
        assert gelu_recompute.gelu_input(hidden) is not None and gelu_recompute.gelu_input(hidden[:2]) is None
        hidden.mul_(2.0)
        assert gelu_recompute.gelu_input(hidden) is None
        out = second(hidden)
        pre = first(x)
        other = F.gelu(pre)
        pre.add_(1.0)  # the GELU's own backward would refuse this; the linear's recompute must not miss it
        assert gelu_recompute.gelu_input(other) is None
    out.float().sum().backward()
    want = hidden.detach().float().sum(0)  # the weight's gradient: the written values, summed over the batch
    assert torch.allclose(second.weight.grad, torch.ones(8, 1) * want, rtol=1e-2)


def test_a_gelu_output_kept_after_backward_does_not_keep_the_gelu_input() -> None:
    """What the recompute notes holds the GELU's input no longer than autograd does."""
    first, second = nn.Linear(8, 16), nn.Linear(16, 8)
    with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
        pre = first(torch.randn(4, 8))
        hidden = F.gelu(pre)  # kept by this test, as a model's hook might keep an activation
        out = second(hidden)
    assert gelu_recompute.gelu_input(hidden)[0] is pre  # type: ignore[index]
    held = weakref.ref(pre)
    del pre
    out.float().sum().backward()
    gc.collect()
    assert held() is None and gelu_recompute.gelu_input(hidden) is None


def test_the_gelu_recompute_under_activation_checkpointing_gives_the_same_bits() -> None:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
        plain = mlp(x).float().sum()
    plain.backward()
    want = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    with ampkit.autocast(ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")):
        checkpointed = torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False,
                                                         context_fn=ampkit.checkpoint_context_fn).float().sum()
    checkpointed.backward()
    assert torch.equal(plain, checkpointed)
    assert all(torch.equal(a, p.grad) for a, p in zip(want, mlp.parameters()))


def test_an_op_of_the_generic_path_computes_in_float32_and_rounds_to_its_inputs_dtype() -> None:
    """``aten::_convolution`` (no fast path; torch 2.11 has no meta kernel for it) computes in float32 and returns
    its inputs' 16-bit dtype."""
    x, w = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3, requires_grad=True)
    policy = ampkit.Policy.default("cpu", torch.bfloat16, compute="float32")
    found: list[torch.Tensor] = []

    def step() -> None:
        with warnings.catch_warnings(), ampkit.autocast(policy):
            warnings.simplefilter("ignore")
            found.append(torch.ops.aten._convolution.deprecated(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                                False, False, False))
        found[0].float().sum().backward()

    assert gemm_dtypes(step) == {torch.float32}  # its backward's convolution kernels: float32
    out = found[0]
    assert out.dtype == torch.bfloat16 and w.grad is not None
    assert torch.equal(out, F.conv2d(x.bfloat16().float(), w.detach().bfloat16().float()).bfloat16())
