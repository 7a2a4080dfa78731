"""ampkit/_torch.py: every torch private ampkit uses resolves on the installed torch, and a missing one is
named (not silently switched off)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit import _torch, _torch_tensors


def test_every_private_resolves_on_this_torch() -> None:
    # A torch release that renames one fails here, by name, instead of in the feature that needs it.
    assert _torch.missing() == [], f"torch {torch.__version__} lacks: {_torch.missing()}"


def test_a_missing_private_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_foreach_copy_")
    assert _torch.missing() == ["torch._foreach_copy_"]
    a, b = [torch.ones(3)], [torch.full((3,), 2.0)]
    with pytest.warns(_torch.TorchVersionWarning, match="copied one at a time"):
        _torch.foreach_copy_(a, b)  # the fallback, said once
    assert a[0].tolist() == [2.0, 2.0, 2.0]


def test_the_wrappers_call_what_they_name() -> None:
    assert _torch.is_mutable(torch.ops.aten.add_.Tensor) and not _torch.is_mutable(torch.ops.aten.add.Tensor)
    assert _torch.is_mutable(torch.ops.aten.max.dim_max)  # an out= variant no name says is one
    assert _torch.is_mutable(torch.ops.aten._native_batch_norm_legit.default)  # its running statistics: no tag
    a, b = [torch.ones(3)], [torch.full((3,), 2.0)]
    _torch.foreach_copy_(a, b)
    assert a[0].tolist() == [2.0, 2.0, 2.0]
    found, inv = torch.zeros(1), torch.full((1,), 0.5)
    grads = [torch.tensor([4.0, float("inf")])]
    _torch.amp_unscale_(grads, found, inv)
    assert found.item() == 1.0 and grads[0][0].item() == 2.0



def test_the_tensor_attribute_wrappers_read_what_they_name() -> None:
    whole = torch.arange(6.0)
    part = whole[2:]
    assert _torch_tensors.view_base(part) is whole and _torch_tensors.view_base(whole) is None
    before = _torch_tensors.version(part)
    part.add_(1)
    assert _torch_tensors.version(part) == before + 1  # a memo keyed by it sees the write
    sparse = torch.sparse_coo_tensor([[0, 0]], [1.0, 2.0], (3,))  # one index twice: not coalesced
    values = _torch_tensors.sparse_values(sparse)
    assert values.tolist() == [1.0, 2.0]  # stored as given, not summed by coalesce()
    values.mul_(2)
    assert _torch_tensors.sparse_values(sparse).tolist() == [2.0, 4.0]  # the values themselves, not a copy


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch, "_warned", set())


def test_without_the_fused_unscale_gradients_are_unscaled_alike_and_it_is_said(monkeypatch: pytest.MonkeyPatch,
                                                                               fresh_warnings: None) -> None:
    values = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 1000

    def run(inv_scale: float) -> tuple[float, list[list[float]]]:
        grads = [torch.tensor([4.0, -2.0]), torch.tensor([1.0, float("inf")]), torch.tensor([0.5]),
                 *(values.to(dtype) for dtype in (torch.float16, torch.bfloat16, torch.float64))]
        found = torch.zeros(1)
        _torch.amp_unscale_(grads, found, torch.full((1,), inv_scale))
        return found.item(), [g.tolist() for g in grads]

    # Bit for bit with torch's fused kernel, 16-bit gradients too: a large loss scale's inverse (2**-25 is 0 in fp16,
    # so it must not be rounded to the gradient's dtype) and a static scale's that is no power of 2.
    inverse_scales = (0.25, 2.0**-25, 1 / 1000)
    fused = [run(inv_scale) for inv_scale in inverse_scales]
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    with pytest.warns(_torch.TorchVersionWarning, match="lacks torch._amp_foreach_non_finite_check_and_unscale_"):
        assert [run(inv_scale) for inv_scale in inverse_scales] == fused
    clean = [torch.tensor([2.0])]
    found = torch.zeros(1)
    _torch.amp_unscale_(clean, found, torch.full((1,), 0.5))
    assert found.item() == 0.0 and clean[0].item() == 1.0


def test_without_the_foreach_copy_the_fallback_agrees(monkeypatch: pytest.MonkeyPatch,
                                                      fresh_warnings: None) -> None:
    tensors = [torch.randn(3, 2), torch.randn(5)]
    monkeypatch.delattr(torch, "_foreach_copy_")
    targets = [torch.zeros(3, 2), torch.zeros(5)]
    with pytest.warns(_torch.TorchVersionWarning):
        _torch.foreach_copy_(targets, tensors)
    assert all(torch.equal(a, b) for a, b in zip(targets, tensors))


def test_an_op_that_raises_in_ampkits_kernel_leaves_autocast_on_and_the_region_working() -> None:
    # ampkit's kernels dispatch below the Autocast key by turning autocast off for the call (public, where torch's
    # own kernels use the dispatcher's private guard): an error inside must turn it back on.
    edited = ampkit.Policy.default("cpu", compute="native").with_ops(deny=["mm"])
    with ampkit.autocast(edited):
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            torch.mm(torch.ones(2, 3), torch.ones(2, 3))
        assert torch.is_autocast_enabled("cpu")
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
        assert torch.mm(torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2)).dtype == torch.float32


def test_every_torch_norm_with_batch_statistics_is_kept_by_its_public_name() -> None:
    # O2 keeps torch's batch and instance norms in float32 by class; ampkit names them publicly, where it once took
    # their private base class: none of this torch's may be missing, in eval mode too (no probe finds them there).
    from ampkit.optim.kept import NORM_TYPES, is_normalization

    found, todo = set(), [torch.nn.modules.batchnorm._NormBase]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if getattr(torch.nn, sub.__name__, None) is sub:  # torch.nn's public classes
                found.add(sub)
    assert len(found) >= 13 and found <= set(NORM_TYPES), found - set(NORM_TYPES)
    assert is_normalization(torch.nn.BatchNorm2d(8).eval()) and is_normalization(torch.nn.InstanceNorm1d(8, affine=True))


def test_first_use_on_a_torch_without_a_private_warns_once_naming_it() -> None:
    import subprocess
    import sys

    # ``import ampkit`` loads nothing (names load on first use); the shim checks the running torch when first loaded
    script = ("import torch, warnings; del torch._foreach_copy_; warnings.simplefilter('always'); "
              "import ampkit; ampkit.autocast; ampkit.Policy; print('imported')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-2000:]
    assert done.stderr.count("TorchVersionWarning") == 1 and "lacks torch._foreach_copy_" in done.stderr


def test_the_loan_that_waits_on_torch_still_has_no_public_route() -> None:
    # A private ampkit keeps (issue 38) waits on torch itself: the assert fails on the first torch release CI tests
    # that gives the public route, naming the loan that can go from that release on.
    import importlib.util

    assert importlib.util.find_spec("torch.utils.pytree") is None, (
        f"torch {torch.__version__} has a public torch.utils.pytree: ampkit/_trees.py can be taken from it")
