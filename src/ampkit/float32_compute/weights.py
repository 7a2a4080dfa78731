"""Weights among the tensors a step saves, for memory accounting.

A native op saves the 16-bit copy of a weight autocast made (a linear saves its transposed view); so does a
float32-compute op, through ``save_for_backward``. Memory accounting counts those as weights, not activations.
"""

from __future__ import annotations

import torch

from ampkit import _torch_tensors


def is_weight_copy(t: torch.Tensor) -> bool:
    """A copy of a parameter cast by autocast, or a view of one (a linear saves the
    transposed weight): its only autograd input is a leaf's gradient accumulator."""
    base = _torch_tensors.view_base(t)
    fn = (base if base is not None else t).grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    inputs = [next_fn for next_fn, _ in fn.next_functions if next_fn is not None]
    return bool(inputs) and all(next_fn.name().endswith("AccumulateGrad") for next_fn in inputs)
