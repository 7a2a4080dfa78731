"""Tensor-core alignment findings and vocabulary padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit.diagnostics.alignment import check_alignment, pad_vocab


def test_odd_sizes_are_listed_with_their_padded_size() -> None:
    model = nn.Sequential(nn.Embedding(50257, 768), nn.Linear(768, 3072), nn.Linear(3072, 50257),
                          nn.Conv2d(3, 30, 3))
    findings = {(f.module, f.dimension): (f.size, f.padded) for f in check_alignment(model)}
    assert findings == {("0", "num_embeddings"): (50257, 50264), ("2", "out_features"): (50257, 50264),
                        ("3", "out_channels"): (30, 32)}
    assert {(f.module, f.padded) for f in check_alignment(model, multiple=16)} >= {("0", 50272)}


def test_aligned_model_has_no_findings() -> None:
    assert check_alignment(nn.Sequential(nn.Linear(64, 128), nn.Conv2d(1, 32, 3))) == []


def test_pad_vocab_keeps_outputs_and_hides_padded_tokens() -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 10)
    padded = pad_vocab(head)
    x = torch.randn(3, 16)
    logits = padded(x)
    assert logits.shape == (3, 16)
    torch.testing.assert_close(logits[:, :10], head(x))  # a wider matmul may round in other places
    assert torch.softmax(logits, -1)[:, 10:].max() == 0
    emb = nn.Embedding(10, 4)
    padded_emb = pad_vocab(emb)
    assert padded_emb.num_embeddings == 16 and torch.equal(padded_emb(torch.arange(10)), emb(torch.arange(10)))
    with pytest.raises(ValueError, match="takes an nn.Embedding or an nn.Linear head, got Conv1d"):
        pad_vocab(nn.Conv1d(1, 1, 1))  # type: ignore[arg-type]


# -- bad input (moved from test_bad_input.py) ----------------------------------------


@pytest.mark.parametrize("multiple", [2.5, 0, -8, True])
def test_alignment_multiples_must_be_positive_integers(multiple: object) -> None:
    with pytest.raises(ValueError, match=rf"multiple={multiple!r} is invalid: use a positive integer"):
        ampkit.check_alignment(nn.Linear(3, 3), multiple=multiple)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is invalid: use a positive integer"):
        ampkit.pad_vocab(nn.Linear(3, 3), multiple=multiple)  # type: ignore[arg-type]  # was ZeroDivisionError
