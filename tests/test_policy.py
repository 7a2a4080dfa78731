"""Policy: construction, validation, editing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampkit import Policy
from ampkit.precision import op_lists
from ampkit.precision.policy import autocast_ops, torch_lists


def test_default_equals_torch_lists_except_banned_ops() -> None:
    for device in op_lists.DEVICE_TYPES:
        policy, lists = Policy.default(device), torch_lists(device)
        banned = set(op_lists.BANNED[device]) & autocast_ops(device)
        assert policy.allow == lists["allow"] and policy.infer == lists["infer"]
        assert policy.deny == lists["deny"] | banned
        assert policy.edits == banned


def test_default_dtypes_follow_torch_autocast() -> None:
    assert Policy.default("cpu").dtype == torch.bfloat16
    assert Policy.default("cuda").dtype == torch.float16
    assert Policy.default("cpu", "fp16").dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, "fp8", torch.int8])
def test_bad_dtype_names_the_value_and_choices(dtype: object) -> None:
    with pytest.raises(ValueError, match=r"Unsupported mixed precision dtype: .*Choose torch.float16"):
        Policy.default("cpu", dtype)  # type: ignore[arg-type]


def test_bad_device_type() -> None:
    with pytest.raises(ValueError, match=r"Unknown device_type: 'tpu'. Choose one of \['cpu', 'cuda'\]"):
        Policy.default("tpu")


def test_with_ops_moves_ops_between_lists() -> None:
    policy = Policy.default("cpu").with_ops(deny=["gelu"], allow=["cross_entropy_loss"], none=["cat"])
    assert policy.category("gelu") == "deny"
    assert policy.category("cross_entropy_loss") == "allow"
    assert "cross_entropy_loss" not in policy.deny
    assert policy.category("cat") is None
    assert policy.edits == {"gelu", "cross_entropy_loss", "cat"}
    # The original is untouched: policies are immutable.
    assert Policy.default("cpu").category("gelu") is None


def test_unknown_op_suggests_close_matches() -> None:
    with pytest.raises(ValueError, match=r"Unknown op 'softmaxx' in deny=.*Did you mean 'softmax'"):
        Policy.default("cpu").with_ops(deny=["softmaxx"])


def test_op_named_twice_or_as_a_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="named in both allow= and deny="):
        Policy.default("cpu").with_ops(allow=["gelu"], deny=["gelu"])
    with pytest.raises(ValueError, match=r"takes a list of op names, got the string 'gelu'"):
        Policy.default("cpu").with_ops(deny="gelu")


def test_op_in_two_lists_at_construction() -> None:
    with pytest.raises(ValueError, match="'mm' is in both allow and deny"):
        Policy("cpu", torch.bfloat16, frozenset({"mm"}), frozenset({"mm"}), frozenset())


def test_with_modules_validates_dtype_and_pattern() -> None:
    policy = Policy.default("cpu").with_modules(nn.LayerNorm, "lm_head", dtype=torch.float32)
    assert [o.pattern for o in policy.overrides] == [nn.LayerNorm, "lm_head"]
    with pytest.raises(ValueError, match="neither torch.float32 nor this policy's dtype"):
        Policy.default("cpu", torch.bfloat16).with_modules("x", dtype=torch.float16)
    with pytest.raises(ValueError, match="neither an nn.Module subclass nor a name pattern"):
        Policy.default("cpu").with_modules(3, dtype=torch.float32)  # type: ignore[arg-type]


def test_policies_compare_by_value() -> None:
    assert Policy.default("cpu") == Policy.default("cpu")
    assert Policy.default("cpu").with_ops(deny=["gelu"]) != Policy.default("cpu")
    assert not Policy.default("cpu").disabled().enabled
