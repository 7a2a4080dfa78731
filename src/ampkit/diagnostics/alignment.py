"""Tensor-core alignment: layer sizes that are not multiples of 8 (16 for fp8).

Tensor cores take float16/bfloat16 matrix tiles whose dimensions are multiples
of 8 (16 for fp8); cuBLAS pads or falls back to slower kernels otherwise.
NVIDIA's guidance: make linear and convolution dimensions and vocabulary sizes
multiples of 8 (e.g. GPT-2's 50257 tokens -> 50304).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

_DIMENSIONS = {
    nn.Linear: ("in_features", "out_features"),
    nn.Embedding: ("num_embeddings", "embedding_dim"),
    **dict.fromkeys((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
                    ("in_channels", "out_channels")),
}


@dataclasses.dataclass(frozen=True)
class AlignmentFinding:
    """One dimension that is not a multiple of ``multiple``."""

    module: str
    type: str
    dimension: str
    size: int
    padded: int


def check_multiple(multiple: object) -> int:
    """``multiple`` if it is an integer >= 1, else ValueError."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple={multiple!r} is invalid: use a positive integer (8 for fp16/bf16 tensor cores, "
                         "16 for fp8).")
    return multiple


def padded_size(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def check_alignment(model: nn.Module, multiple: int = 8) -> list[AlignmentFinding]:
    """List Linear / Conv / Embedding dimensions that are not multiples of ``multiple``.

    Args:
        model: the model.
        multiple: 8 for float16/bfloat16 tensor cores, 16 for fp8.

    Returns:
        Findings in module order, each with the padded size to use. Convolutions
        with one input channel (grayscale images) are left out: the stem cannot be padded
        usefully.
    """
    check_multiple(multiple)
    findings = []
    for name, module in model.named_modules():
        for kind, dims in _DIMENSIONS.items():
            if not isinstance(module, kind):
                continue
            for dim in dims:
                size = getattr(module, dim)
                if size % multiple and not (dim == "in_channels" and size <= 4):
                    findings.append(AlignmentFinding(name, type(module).__name__, dim, size, padded_size(size, multiple)))
    return findings


@torch.no_grad()
def pad_vocab(module: nn.Embedding | nn.Linear, multiple: int = 8) -> nn.Embedding | nn.Linear:
    """A copy of an embedding or a language-model head with its vocabulary padded.

    Embedding: extra rows are zeros (no real token indexes them). Linear head:
    extra output rows have zero weights; with a bias, their bias is the dtype's most
    negative finite value (not -inf, which turns into NaN in some kernels), so softmax
    gives padded tokens probability ~0; without a bias, slice the logits,
    ``logits[..., :vocab]``, before the loss or sampling. Tied weights must be
    re-tied after padding both modules.

    Args:
        module: the ``nn.Embedding`` or the ``nn.Linear`` head whose vocabulary dimension is padded.
        multiple: the vocabulary size is rounded up to a multiple of this (default 8, tensor cores' step).

    Returns:
        A new module of the same type with the padded vocabulary (``module`` itself is unchanged).

    Raises:
        ValueError: neither an nn.Embedding nor an nn.Linear, or ``multiple`` not a positive integer.
    """
    check_multiple(multiple)
    if isinstance(module, nn.Embedding):
        vocab = padded_size(module.num_embeddings, multiple)
        embedding = nn.Embedding(vocab, module.embedding_dim, padding_idx=module.padding_idx,
                                 device=module.weight.device, dtype=module.weight.dtype)
        embedding.weight.zero_()
        embedding.weight[: module.num_embeddings] = module.weight
        return embedding
    if isinstance(module, nn.Linear):
        vocab = padded_size(module.out_features, multiple)
        head = nn.Linear(module.in_features, vocab, bias=module.bias is not None,
                         device=module.weight.device, dtype=module.weight.dtype)
        head.weight.zero_()
        head.weight[: module.out_features] = module.weight
        if module.bias is not None:
            head.bias.fill_(torch.finfo(module.bias.dtype).min)
            head.bias[: module.out_features] = module.bias
        return head
    raise ValueError(f"pad_vocab takes an nn.Embedding or an nn.Linear head, got {type(module).__name__}.")
