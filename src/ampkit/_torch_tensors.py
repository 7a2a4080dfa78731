"""The tensor attributes torch keeps private that ampkit reads, one wrapper each, as in ``_torch.py``.

They are part of every tensor since torch 1.x (``tests/test_torch_shim.py`` checks each wrapper on every release
CI tests, ``_torch.CHECKED``): the view a tensor was made from, its count of in-place writes, a sparse tensor's own
values. No public API gives the same without a copy. This module imports nothing of ampkit.
"""

from __future__ import annotations

import torch

def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, else None (``Tensor._base``, 2.4-2.15.0)."""
    return t._base


def version(t: torch.Tensor) -> int:
    """How many in-place writes ``t``'s storage has had (``Tensor._version``, 2.4-2.15.0): a memo keyed by it is
    stale once the tensor is written."""
    return t._version


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """A sparse COO tensor's stored values themselves, not a copy (``Tensor._values()``, 2.4-2.15.0; the public
    ``values()`` needs a coalesced tensor, and ``coalesce()`` copies)."""
    return t._values()
