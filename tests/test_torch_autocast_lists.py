"""ampkit's default policies against PyTorch's own autocast test lists (torch.testing._internal.
autocast_test_lists, the ops and arguments of PyTorch's test_autocast_* tests): every op gives the dtype
torch.autocast gives, which is the dtype PyTorch's lists expect. Written by others, so it checks ampkit's
op lists (precision/op_lists.py) and its kernels against more than ampkit's own expectations.

CPU: AutocastCPUTestLists with bfloat16, under native and float32 compute. CUDA: AutocastTestLists with
float16, marked gpu. The lists import PyTorch's test utilities, which need ``expecttest`` (in the test extra).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ampkit

lists = pytest.importorskip("torch.testing._internal.autocast_test_lists", reason="needs expecttest")

# list name -> (module the op is looked up in, the output dtype PyTorch's lists expect)
CPU_LISTS = {
    "torch_16": (torch, torch.bfloat16), "nn_16": (torch._C._nn, torch.bfloat16),
    "torch_fp32": (torch, torch.float32), "nn_fp32": (torch._C._nn, torch.float32),
    "torch_need_autocast_promote": (torch, torch.float32),
}
CUDA_LISTS = {
    "torch_fp16": (torch, torch.float16), "nn_fp16": (torch._C._nn, torch.float16),
    "torch_fp32": (torch, torch.float32), "nn_fp32": (torch._C._nn, torch.float32),
    "torch_need_autocast_promote": (torch, torch.float32),
}


def _cases(test_lists: Any, names: dict[str, Any]) -> list[tuple[str, int, str]]:
    return [(name, i, entry[0]) for name in names for i, entry in enumerate(getattr(test_lists, name))]


CPU_CASES = _cases(lists.AutocastCPUTestLists("cpu"), CPU_LISTS)
CUDA_CASES = _cases(lists.AutocastTestLists("meta"), CUDA_LISTS)  # names only: the tensors are made per test


def _dtype(out: Any) -> torch.dtype:
    while isinstance(out, (tuple, list)):
        out = out[0]
    assert isinstance(out, torch.Tensor)
    return out.dtype


def _run(entry: tuple, module: Any, region: Any) -> torch.dtype:
    op, args, *rest = entry
    kwargs = rest[0] if rest and isinstance(rest[0], dict) else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with region:
            return _dtype(getattr(module, op)(*args, **kwargs))


def _retyped(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its float16 tensors (in tuples too) cast to ``dtype``."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float16:
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_retyped(v, dtype) for v in value)
    return value


@pytest.mark.parametrize("list_name, index, op", CPU_CASES, ids=[f"{n}-{op}-{i}" for n, i, op in CPU_CASES])
def test_cpu_lists_of_pytorch_give_torch_autocasts_dtypes(list_name: str, index: int, op: str) -> None:
    entry = getattr(lists.AutocastCPUTestLists("cpu"), list_name)[index]
    module, expected = CPU_LISTS[list_name]
    assert _run(entry, module, torch.autocast("cpu", torch.bfloat16)) == expected  # PyTorch's own expectation
    for compute in ("native", "float32"):
        policy = ampkit.Policy.default("cpu", torch.bfloat16, compute=compute)
        assert _run(entry, module, ampkit.autocast(policy)) == expected, compute


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("list_name, index, op", CUDA_CASES, ids=[f"{n}-{op}-{i}" for n, i, op in CUDA_CASES])
def test_cuda_lists_of_pytorch_give_torch_autocasts_dtypes(list_name: str, index: int, op: str,
                                                           dtype: torch.dtype) -> None:
    """PyTorch's lists are written for float16 (their expectation is checked there); under bfloat16
    (compute capability >= 8.0) ampkit must give what torch.autocast gives with the same arguments."""
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("bfloat16 needs compute capability >= 8.0")
    entry = getattr(lists.AutocastTestLists("cuda"), list_name)[index]
    if len(entry) > 2 and entry[-1] is True:
        pytest.skip(f"{op}: PyTorch skips it on this platform (ROCm)")
    if isinstance(entry[1], str):
        pytest.skip(f"{op}: PyTorch's list gives a 4-index equation over 2-D operands (its own loop reads them as a "
                    "skip flag and never runs it)")
    module, expected = CUDA_LISTS[list_name]
    entry = tuple(e for e in entry if not isinstance(e, bool))
    if dtype == torch.bfloat16:  # the lists' float16 tensors as bfloat16: torch.autocast refuses to promote the two
        entry = _retyped(entry, dtype)
    torch_dtype = _run(entry, module, torch.autocast("cuda", dtype))
    if dtype == torch.float16:
        assert torch_dtype == expected  # PyTorch's own expectation
    policy = ampkit.Policy.default("cuda", dtype, compute="native")
    assert _run(entry, module, ampkit.autocast(policy)) == torch_dtype
