"""Weights seen through float32 compute's nested graphs, for memory accounting.

The nested graph's aliases of weights (parameters, and 16-bit copies of them made by
autocast): memory accounting counts what the nested graph saves of these storages as
weights, as it does for a native op, which saves the weight copy itself.
"""

from __future__ import annotations

import weakref

import torch

from ampkit import _torch_tensors

_weight_aliases: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()


def is_weight(t: torch.Tensor) -> bool:
    """A parameter (a leaf that requires grad) or a copy of one (``is_weight_copy``)."""
    return t.requires_grad if t.is_leaf else is_weight_copy(t)


def is_weight_copy(t: torch.Tensor) -> bool:
    """A copy of a parameter cast by autocast, or a view of one (a linear saves the
    transposed weight): its only autograd input is a leaf's gradient accumulator."""
    base = _torch_tensors.view_base(t)
    fn = (base if base is not None else t).grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    inputs = [next_fn for next_fn, _ in fn.next_functions if next_fn is not None]
    return bool(inputs) and all(next_fn.name().endswith("AccumulateGrad") for next_fn in inputs)


def weight_storages() -> set[int]:
    """Storage addresses of the weights that live float32-compute ops hold (see ``is_weight``)."""
    return {t.untyped_storage().data_ptr() for t in list(_weight_aliases)}


def remember_weight_alias(t: torch.Tensor) -> None:
    """Count ``t`` (a nested graph's input standing for a weight) as a weight while it lives."""
    _weight_aliases.add(t)
