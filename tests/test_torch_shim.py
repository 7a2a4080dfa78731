"""ampkit/_torch.py: every torch private ampkit uses resolves on the installed torch, and a missing one is
named (not silently switched off)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ampkit import _torch
from ampkit.float32_compute import gelu_recompute


def test_every_private_resolves_on_this_torch() -> None:
    # A torch release that renames one fails here, by name, instead of in the feature that needs it.
    assert _torch.missing() == [], f"torch {torch.__version__} lacks: {_torch.missing()}"


def test_a_missing_private_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    monkeypatch.delattr(torch.utils.checkpoint, "CheckpointFunction")
    assert _torch.missing() == ["torch.utils.checkpoint entry points", "torch._fused_sdp_choice"]
    assert _torch.checkpoint_entry_points() is None  # checkpointing.install then warns instead of patching
    q = torch.randn(1, 2, 4, 8)
    assert _torch.fused_sdp_choice(q, q, q, False, None) is None  # attention takes the generic path


def test_without_the_saved_tensors_getter_a_gelu_output_is_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    hidden = F.gelu(x)
    assert gelu_recompute.gelu_input(hidden) is not None  # the recompute finds the GELU's input
    monkeypatch.delattr(torch._C._autograd, "_top_saved_tensors_default_hooks")
    assert gelu_recompute.gelu_input(hidden) is None  # unknown hooks: save, as without ampkit


def test_the_wrappers_call_what_they_name() -> None:
    assert "mm" in _torch.aten_op_names() and "softmax" in _torch.aten_op_names()
    assert _torch.is_mutable(torch.ops.aten.add_.Tensor) and not _torch.is_mutable(torch.ops.aten.add.Tensor)
    a, b = [torch.ones(3)], [torch.full((3,), 2.0)]
    _torch.foreach_copy_(a, b)
    assert a[0].tolist() == [2.0, 2.0, 2.0] and _torch.foreach_norm(a, 2.0)[0].item() == pytest.approx(12**0.5)
    found, inv = torch.zeros(1), torch.full((1,), 0.5)
    grads = [torch.tensor([4.0, float("inf")])]
    _torch.amp_unscale_(grads, found, inv)
    assert found.item() == 1.0 and grads[0][0].item() == 2.0
