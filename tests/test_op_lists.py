"""The op-list data against the installed torch.

Two checks, both generated from ampkit.op_lists:
- coverage: the ops torch registers autocast kernels for (per device, read from the
  dispatcher) are exactly the ops the lists name; a torch release that adds or drops
  an op fails here.
- behaviour: every CPU op runs under torch.autocast and under ampkit.autocast with the
  default policy, with the output dtype its list promises; then moved to another list,
  with the dtype of that list (this exercises ampkit's own kernels op by op).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit import Policy
from ampkit.precision import decide
from ampkit.precision import op_lists
from ampkit.precision import policy as policy_module

MkT = Callable[..., torch.Tensor]


def _i(*values: int) -> torch.Tensor:
    return torch.tensor(values)


def _spd(mk: MkT) -> torch.Tensor:
    a = mk(3, 3)
    return a @ a.mT + 3 * torch.eye(3, dtype=a.dtype)


# One call per CPU-listed op; mk(*shape) makes a floating tensor in the dtype the test chooses.
CPU_SAMPLES: dict[str, Callable[[MkT], object]] = {
    # allow
    "conv1d": lambda mk: F.conv1d(mk(1, 2, 8), mk(3, 2, 3)),
    "conv2d": lambda mk: F.conv2d(mk(1, 2, 6, 6), mk(3, 2, 3, 3)),
    "conv3d": lambda mk: F.conv3d(mk(1, 2, 4, 4, 4), mk(3, 2, 3, 3, 3)),
    "conv_tbc": lambda mk: torch.conv_tbc(mk(5, 1, 2), mk(3, 2, 4), mk(4)),
    "conv_transpose1d": lambda mk: F.conv_transpose1d(mk(1, 2, 5), mk(2, 3, 3)),
    "conv_transpose2d": lambda mk: F.conv_transpose2d(mk(1, 2, 5, 5), mk(2, 3, 3, 3)),
    "conv_transpose3d": lambda mk: F.conv_transpose3d(mk(1, 2, 3, 3, 3), mk(2, 3, 2, 2, 2)),
    "_convolution": lambda mk: torch.ops.aten._convolution.deprecated(
        mk(1, 2, 6, 6), mk(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, False
    ),
    "bmm": lambda mk: torch.bmm(mk(2, 3, 4), mk(2, 4, 5)),
    "mm": lambda mk: torch.mm(mk(3, 4), mk(4, 5)),
    "baddbmm": lambda mk: torch.baddbmm(mk(2, 3, 5), mk(2, 3, 4), mk(2, 4, 5)),
    "addmm": lambda mk: torch.addmm(mk(3, 5), mk(3, 4), mk(4, 5)),
    "addbmm": lambda mk: torch.addbmm(mk(3, 5), mk(2, 3, 4), mk(2, 4, 5)),
    "_addmm_activation": lambda mk: torch.ops.aten._addmm_activation(mk(3, 5), mk(3, 4), mk(4, 5)),
    "linalg_vecdot": lambda mk: torch.linalg.vecdot(mk(3, 4), mk(3, 4)),
    "linear": lambda mk: F.linear(mk(3, 4), mk(5, 4)),
    "matmul": lambda mk: torch.matmul(mk(3, 4), mk(4, 5)),
    "prelu": lambda mk: F.prelu(mk(2, 3, 4), mk(3)),
    "mkldnn_rnn_layer": lambda mk: torch.ops.aten.mkldnn_rnn_layer(
        mk(3, 1, 4), mk(8, 4), mk(8, 2), mk(8), mk(8), mk(1, 2), mk(1, 2), False, [3], 2, 2, 1, True, False, False, False
    ),
    "scaled_dot_product_attention": lambda mk: F.scaled_dot_product_attention(
        mk(1, 2, 4, 8), mk(1, 2, 4, 8), mk(1, 2, 4, 8)
    ),
    "_native_multi_head_attention": lambda mk: torch._native_multi_head_attention(
        mk(1, 3, 4), mk(1, 3, 4), mk(1, 3, 4), 4, 2, mk(12, 4), mk(12), mk(4, 4), mk(4)
    ),
    # infer
    "cat": lambda mk: torch.cat([mk(2, 3), mk(2, 3)]),
    "stack": lambda mk: torch.stack([mk(2, 3), mk(2, 3)]),
    "index_copy": lambda mk: torch.index_copy(mk(4, 3), 0, _i(0, 2), mk(2, 3)),
    # deny: pooling, padding, sampling
    "avg_pool3d": lambda mk: F.avg_pool3d(mk(1, 1, 4, 4, 4), 2),
    "max_pool3d": lambda mk: torch.ops.aten.max_pool3d(mk(1, 1, 4, 4, 4), [2, 2, 2]),
    "adaptive_avg_pool3d": lambda mk: F.adaptive_avg_pool3d(mk(1, 1, 4, 4, 4), 2),
    "adaptive_max_pool3d": lambda mk: F.adaptive_max_pool3d(mk(1, 1, 4, 4, 4), 2),
    "fractional_max_pool2d": lambda mk: F.fractional_max_pool2d(mk(1, 1, 6, 6), 2, output_size=3),
    "fractional_max_pool3d": lambda mk: F.fractional_max_pool3d(mk(1, 1, 6, 6, 6), 2, output_size=3),
    "max_unpool2d": lambda mk: F.max_unpool2d(mk(1, 1, 2, 2), torch.tensor([[[[0, 3], [8, 15]]]]), 2),
    "max_unpool3d": lambda mk: F.max_unpool3d(mk(1, 1, 1, 1, 2), torch.tensor([[[[[0, 7]]]]]), 2),
    "reflection_pad1d": lambda mk: torch.ops.aten.reflection_pad1d(mk(1, 2, 5), [1, 1]),
    "reflection_pad2d": lambda mk: torch.ops.aten.reflection_pad2d(mk(1, 2, 5, 5), [1, 1, 1, 1]),
    "replication_pad1d": lambda mk: torch.ops.aten.replication_pad1d(mk(1, 2, 5), [1, 1]),
    "replication_pad2d": lambda mk: torch.ops.aten.replication_pad2d(mk(1, 2, 5, 5), [1, 1, 1, 1]),
    "replication_pad3d": lambda mk: torch.ops.aten.replication_pad3d(mk(1, 1, 3, 3, 3), [1] * 6),
    "grid_sampler": lambda mk: torch.grid_sampler(mk(1, 1, 4, 4), mk(1, 2, 2, 2).tanh(), 0, 0, False),
    "grid_sampler_2d": lambda mk: torch.grid_sampler_2d(mk(1, 1, 4, 4), mk(1, 2, 2, 2).tanh(), 0, 0, False),
    "grid_sampler_3d": lambda mk: torch.grid_sampler_3d(mk(1, 1, 3, 3, 3), mk(1, 2, 2, 2, 3).tanh(), 0, 0, False),
    "_grid_sampler_2d_cpu_fallback": lambda mk: torch._grid_sampler_2d_cpu_fallback(
        mk(1, 1, 4, 4), mk(1, 2, 2, 2).tanh(), 0, 0, False
    ),
    # deny: reductions, statistics, spectral
    "polar": lambda mk: torch.polar(mk(3).abs(), mk(3)),
    "prod": lambda mk: torch.prod(mk(3, 4)),
    "quantile": lambda mk: torch.quantile(mk(8), 0.5),
    "nanquantile": lambda mk: torch.nanquantile(mk(8), 0.5),
    "stft": lambda mk: torch.stft(mk(64), 16, return_complex=True),
    "cdist": lambda mk: torch.cdist(mk(3, 4), mk(5, 4)),
    "trace": lambda mk: torch.trace(mk(3, 3)),
    "view_as_complex": lambda mk: torch.view_as_complex(mk(3, 2)),
    "fake_quantize_per_tensor_affine": lambda mk: torch.fake_quantize_per_tensor_affine(mk(4), 0.1, 0, -128, 127),
    "fft_fft": lambda mk: torch.fft.fft(mk(8)),
    "fft_fft2": lambda mk: torch.fft.fft2(mk(4, 4)),
    "fft_fftn": lambda mk: torch.fft.fftn(mk(4, 4)),
    "fft_hfft": lambda mk: torch.fft.hfft(mk(8)),
    "fft_ifft": lambda mk: torch.fft.ifft(mk(8)),
    "fft_ifft2": lambda mk: torch.fft.ifft2(mk(4, 4)),
    "fft_ifftn": lambda mk: torch.fft.ifftn(mk(4, 4)),
    "fft_ihfft": lambda mk: torch.fft.ihfft(mk(8)),
    "fft_irfft": lambda mk: torch.fft.irfft(mk(8)),
    "fft_irfft2": lambda mk: torch.fft.irfft2(mk(4, 4)),
    "fft_irfftn": lambda mk: torch.fft.irfftn(mk(4, 4)),
    "fft_rfft": lambda mk: torch.fft.rfft(mk(8)),
    "fft_rfft2": lambda mk: torch.fft.rfft2(mk(4, 4)),
    "fft_rfftn": lambda mk: torch.fft.rfftn(mk(4, 4)),
    # deny: linear algebra
    "cholesky": lambda mk: torch.ops.aten.cholesky(_spd(mk)),
    "cholesky_inverse": lambda mk: torch.cholesky_inverse(torch.linalg.cholesky(_spd(mk).float()).to(mk(1).dtype)),
    "cholesky_solve": lambda mk: torch.cholesky_solve(mk(3, 2), mk(3, 3).tril() + 3 * torch.eye(3, dtype=mk(1).dtype)),
    "inverse": lambda mk: torch.inverse(_spd(mk)),
    "lu_solve": lambda mk: torch.lu_solve(mk(3, 2), *torch.linalg.lu_factor(_spd(mk).float())),
    "_lu_with_info": lambda mk: torch.ops.aten._lu_with_info(_spd(mk)),
    "orgqr": lambda mk: torch.orgqr(mk(4, 3), mk(3)),
    "ormqr": lambda mk: torch.ormqr(mk(4, 3), mk(3), mk(4, 2)),
    "pinverse": lambda mk: torch.pinverse(mk(3, 4)),
    "geqrf": lambda mk: torch.geqrf(mk(4, 3)),
    "qr": lambda mk: torch.qr(mk(4, 3)),
    "svd": lambda mk: torch.svd(mk(4, 3)),
    "triangular_solve": lambda mk: torch.triangular_solve(mk(3, 2), mk(3, 3).triu() + 3 * torch.eye(3, dtype=mk(1).dtype)),
    "linalg_cholesky": lambda mk: torch.linalg.cholesky(_spd(mk)),
    "linalg_cholesky_ex": lambda mk: torch.linalg.cholesky_ex(_spd(mk)),
    "linalg_cond": lambda mk: torch.linalg.cond(_spd(mk)),
    "linalg_eig": lambda mk: torch.linalg.eig(_spd(mk)),
    "linalg_eigh": lambda mk: torch.linalg.eigh(_spd(mk)),
    "linalg_eigvals": lambda mk: torch.linalg.eigvals(_spd(mk)),
    "linalg_eigvalsh": lambda mk: torch.linalg.eigvalsh(_spd(mk)),
    "linalg_householder_product": lambda mk: torch.linalg.householder_product(mk(4, 3), mk(3)),
    "linalg_inv": lambda mk: torch.linalg.inv(_spd(mk)),
    "linalg_inv_ex": lambda mk: torch.linalg.inv_ex(_spd(mk)),
    "linalg_lstsq": lambda mk: torch.linalg.lstsq(mk(4, 3), mk(4, 2)),
    "linalg_matrix_rank": lambda mk: torch.linalg.matrix_rank(mk(3, 3)),
    "linalg_matrix_sqrth": lambda mk: torch.linalg.matrix_sqrth(_spd(mk)),  # torch 2.14 on
    "linalg_qr": lambda mk: torch.linalg.qr(mk(4, 3)),
    "linalg_solve": lambda mk: torch.linalg.solve(_spd(mk), mk(3, 2)),
    "linalg_svd": lambda mk: torch.linalg.svd(mk(4, 3)),
    "linalg_svdvals": lambda mk: torch.linalg.svdvals(mk(4, 3)),
    "linalg_tensorinv": lambda mk: torch.linalg.tensorinv(_spd(mk), ind=1),
    "linalg_tensorsolve": lambda mk: torch.linalg.tensorsolve(_spd(mk), mk(3)),
    # deny: losses
    "binary_cross_entropy": lambda mk: F.binary_cross_entropy(mk(4).sigmoid(), mk(4).sigmoid()),
    "binary_cross_entropy_with_logits": lambda mk: F.binary_cross_entropy_with_logits(mk(4), mk(4).sigmoid()),
    "cross_entropy_loss": lambda mk: F.cross_entropy(mk(3, 5), _i(0, 1, 4)),
    "nll_loss": lambda mk: torch.ops.aten.nll_loss(mk(3, 5), _i(0, 1, 4)),
    "nll_loss2d": lambda mk: torch.ops.aten.nll_loss2d(mk(1, 3, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long)),
    "mse_loss": lambda mk: F.mse_loss(mk(4), mk(4)),
    "l1_loss": lambda mk: F.l1_loss(mk(4), mk(4)),
    "smooth_l1_loss": lambda mk: F.smooth_l1_loss(mk(4), mk(4)),
    "huber_loss": lambda mk: F.huber_loss(mk(4), mk(4)),
    "kl_div": lambda mk: F.kl_div(mk(4), mk(4), reduction="sum"),
    "ctc_loss": lambda mk: F.ctc_loss(mk(6, 1, 4).log_softmax(-1), _i(1, 2).view(1, 2), _i(6), _i(2)),
    "poisson_nll_loss": lambda mk: F.poisson_nll_loss(mk(4), mk(4).abs()),
    "cosine_embedding_loss": lambda mk: F.cosine_embedding_loss(mk(2, 4), mk(2, 4), _i(1, -1)),
    "hinge_embedding_loss": lambda mk: F.hinge_embedding_loss(mk(4), _i(1, -1, 1, -1)),
    "margin_ranking_loss": lambda mk: F.margin_ranking_loss(mk(4), mk(4), _i(1, -1, 1, -1)),
    "soft_margin_loss": lambda mk: F.soft_margin_loss(mk(4), _i(1, -1, 1, -1).float()),
    "triplet_margin_loss": lambda mk: F.triplet_margin_loss(mk(2, 4), mk(2, 4), mk(2, 4)),
    "multi_margin_loss": lambda mk: F.multi_margin_loss(mk(3, 5), _i(0, 1, 4)),
    "multilabel_margin_loss": lambda mk: F.multilabel_margin_loss(mk(2, 4), torch.tensor([[0, 1, -1, 0], [2, -1, 0, 0]])),
    "multilabel_margin_loss_forward": lambda mk: torch.ops.aten.multilabel_margin_loss_forward(
        mk(2, 4), torch.tensor([[0, 1, -1, 0], [2, -1, 0, 0]]), 1
    ),
}

# The running torch's defaults: the table's ops that this torch autocasts (a release drops and adds some).
CPU_LISTS = Policy.default("cpu").lists
CPU_OPS = sorted(op for ops in CPU_LISTS.values() for op in ops)
TABLE_CPU_OPS = set().union(*op_lists.TABLE["cpu"].values())
EXPECTED_OUT = {op_lists.ALLOW: torch.bfloat16, op_lists.DENY: torch.float32, op_lists.INFER: torch.float32}


def _first_float(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and (out.is_floating_point() or out.is_complex()):
        return out
    if isinstance(out, (tuple, list)):
        for item in out:
            try:
                return _first_float(item)
            except LookupError:
                continue
    raise LookupError(f"no floating tensor in {type(out)}")


class _FirstFloatInput(TorchDispatchMode):
    """Records the first floating input dtype that reaches the kernels (below autocast)."""

    dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        for arg in torch.utils._pytree.tree_leaves((args, kwargs)):
            if self.dtype is None and isinstance(arg, torch.Tensor) and arg.is_floating_point():
                self.dtype = arg.dtype
        return func(*args, **(kwargs or {}))


def _out_dtype(op: str, input_dtypes: list[torch.dtype], region: object, device: str = "cpu") -> torch.dtype:
    """Run the op's sample with inputs cycling through input_dtypes inside region.

    Returns the output's floating dtype or, for ops with integer results
    (matrix_rank), the dtype its kernels computed in.
    """
    calls = iter(range(10_000))

    def mk(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(input_dtypes[next(calls) % len(input_dtypes)])

    with region, torch.device(device):  # type: ignore[attr-defined]  # the samples' own tensors on device too
        sample = CPU_SAMPLES[op]
        out = sample(mk)
        try:
            dtype = _first_float(out).dtype
        except LookupError:
            with _FirstFloatInput() as seen:
                calls = iter(range(10_000))
                sample(mk)
            assert seen.dtype is not None
            dtype = seen.dtype
    return torch.float32 if dtype == torch.complex64 else dtype


def _inputs_for(category: str | None) -> list[torch.dtype]:
    # Inputs chosen so the category shows: allow casts float32 down, deny casts bfloat16
    # up, infer widens a bfloat16 / float32 mix.
    return {op_lists.ALLOW: [torch.float32], op_lists.DENY: [torch.bfloat16]}.get(
        category or "", [torch.bfloat16, torch.float32]
    )


_DISPATCHER_OPS = """
import json, sys, torch
names = torch._C._dispatch_get_all_op_names()
print(json.dumps(sorted({
    name[len("aten::"):].split(".")[0]
    for name in names
    if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, sys.argv[1])
})))
"""


def _dispatcher_ops(key: str) -> set[str]:
    """The ops with a kernel at ``key``, read in a fresh process: this one may hold ampkit's
    own kernels (registered on first need and kept), which are not torch's."""
    done = subprocess.run([sys.executable, "-c", _DISPATCHER_OPS, key], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


@pytest.mark.parametrize("device_type, key", [("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")])
def test_default_lists_are_exactly_the_ops_this_torch_autocasts(device_type: str, key: str) -> None:
    """Read in a fresh process (this one may hold ampkit's kernels): every op torch autocasts has a
    category in the table, and the default policy names exactly those ops, none that this torch lacks."""
    table = set().union(*op_lists.TABLE[device_type].values()) | set(op_lists.BANNED[device_type])
    registered = _dispatcher_ops(key)
    assert registered - table == set(), "torch autocasts ops the table has no category for"
    listed = set().union(*Policy.default(device_type).lists.values())
    torch_listed = set().union(*policy_module.torch_lists(device_type).values())
    banned = set(op_lists.BANNED[device_type]) & registered
    assert listed == registered and torch_listed == registered - banned


def _torch_autocasts(monkeypatch: pytest.MonkeyPatch, ops: dict[str, set[str]]) -> None:
    """This test sees a torch whose dispatcher has autocast kernels for ``ops[device_type]``; the process's own
    reading is kept (its cache bypassed, not cleared: a reading taken after ampkit registered kernels would hold
    them)."""
    device = {op_lists.autocast_key(device_type): device_type for device_type in op_lists.DEVICE_TYPES}
    monkeypatch.setattr(policy_module, "_has_kernel", lambda op, key: op in ops[device[key]])
    monkeypatch.setattr(policy_module, "autocast_ops", policy_module.autocast_ops.__wrapped__)


def test_a_default_policy_leaves_out_the_ops_the_running_torch_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on torch 2.14, which removed cholesky and qr (the table names both), and on a CPU build, which
    has no cuDNN RNN."""
    _torch_autocasts(monkeypatch, {"cpu": {"mm", "inverse", "cat"}, "cuda": {"mm", "_cudnn_rnn"}})
    cpu = Policy.default("cpu")
    assert (cpu.allow, cpu.deny, cpu.infer) == ({"mm"}, {"inverse"}, {"cat"})
    assert policy_module.torch_category("cpu", "cholesky") is None and cpu.edits == set()
    cuda = Policy.default("cuda")  # binary_cross_entropy is banned, and absent here: not in deny either
    assert (cuda.allow, cuda.deny, cuda.infer) == ({"mm", "_cudnn_rnn"}, set(), set())
    with pytest.raises(ValueError, match="Unknown op 'not_an_op' in deny="):
        cpu.with_ops(deny=["not_an_op"])  # an edited list still names an unknown op


def test_lists_are_disjoint_and_every_cpu_op_has_a_sample() -> None:
    for table in op_lists.TABLE.values():
        assert not (table["allow"] & table["deny"]) and not (table["deny"] & table["infer"])
        assert not (table["allow"] & table["infer"])
    assert TABLE_CPU_OPS == set(CPU_SAMPLES)


def _outcome(op: str, input_dtypes: list[torch.dtype], region: object, device: str = "cpu") -> torch.dtype | str:
    """The output dtype, or the error (type and first line) the op raised."""
    try:
        return _out_dtype(op, input_dtypes, region, device)
    except (RuntimeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"


@pytest.mark.parametrize("op", CPU_OPS)
def test_cpu_op_matches_torch_autocast(op: str) -> None:
    """ampkit with native compute does what torch.autocast does on this machine, errors
    included (oneDNN has no bfloat16 LSTM on CPUs without AVX-512 BF16: torch.autocast
    raises for mkldnn_rnn_layer there); with float32 compute, GEMM-class ops run
    where native kernels are missing and give the dtype their list promises."""
    category = policy_module.torch_category("cpu", op)
    inputs = _inputs_for(category)
    expected = EXPECTED_OUT[category]
    torch_outcome = _outcome(op, inputs, torch.autocast("cpu", torch.bfloat16))
    if torch_outcome != expected:  # torch itself fails here: only a missing kernel is acceptable
        assert isinstance(torch_outcome, str) and "primitive descriptor" in torch_outcome, torch_outcome
    native = ampkit.Policy.default("cpu", torch.bfloat16, compute="native")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampkit.SlowPrecisionWarning)
        assert _outcome(op, inputs, ampkit.autocast(native)) == torch_outcome
    emulated = native.with_compute("float32")
    in_float32 = op in decide.decision_of(emulated).ops
    assert _outcome(op, inputs, ampkit.autocast(emulated)) == (expected if in_float32 else torch_outcome)


@pytest.mark.parametrize("op", CPU_OPS)
def test_cpu_op_moved_to_another_list_runs_as_that_list_says(op: str) -> None:
    policy = ampkit.Policy.default("cpu", torch.bfloat16)
    # allow -> deny (float32 out of float32 and bfloat16 inputs); deny and infer -> allow.
    target = op_lists.DENY if policy.category(op) == op_lists.ALLOW else op_lists.ALLOW
    edited = policy.with_ops(**{target: [op]})
    assert edited.edits == {op}
    inputs = _inputs_for(op_lists.INFER) if target == op_lists.DENY else [torch.float32]
    try:
        out = _out_dtype(op, inputs, ampkit.autocast(edited))
    except (RuntimeError, NotImplementedError) as error:
        # Only acceptable when torch itself has no bfloat16 kernel for the op.
        with pytest.raises((RuntimeError, NotImplementedError)):
            _out_dtype(op, [torch.bfloat16], contextlib.nullcontext())
        pytest.skip(f"{op} has no bfloat16 kernel in torch: {str(error)[:80]}")
    assert out == EXPECTED_OUT[target]


def test_op_moved_to_no_list_follows_its_inputs() -> None:
    policy = ampkit.Policy.default("cpu").with_ops(none=["mm", "mse_loss"])
    with ampkit.autocast(policy):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
        x = torch.randn(4, dtype=torch.bfloat16)
        assert F.mse_loss(x, x).dtype == torch.bfloat16


# The CPU samples of ops that torch.autocast also lists for CUDA (PyTorch's CUDA autocast op lists, as
# ampkit's own CUDA lists reproduce them): on a GPU, ampkit's default float16 policy must give each one
# torch.autocast's dtype.
CUDA_SHARED_OPS = sorted(set(CPU_SAMPLES) & set().union(*policy_module.torch_lists("cuda").values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", CUDA_SHARED_OPS)
def test_cuda_op_matches_torch_autocast(op: str) -> None:
    category = policy_module.torch_category("cuda", op)
    inputs = {op_lists.ALLOW: [torch.float32], op_lists.DENY: [torch.float16]}.get(
        category or "", [torch.float16, torch.float32])
    torch_outcome = _outcome(op, inputs, torch.autocast("cuda", torch.float16), "cuda")
    expected = {op_lists.ALLOW: torch.float16, op_lists.DENY: torch.float32, op_lists.INFER: torch.float32}[category]
    assert torch_outcome == expected, f"torch.autocast gave {torch_outcome} for {op}"
    policy = ampkit.Policy.default("cuda", torch.float16, compute="native")
    assert _outcome(op, inputs, ampkit.autocast(policy), "cuda") == torch_outcome

