"""``--model hf:<architecture>``: a small language model of a transformers family, built from its config with
random weights (nothing is downloaded), so that ``ampkit compare`` runs on real architectures from the command
line (tested for llama, gpt2 and bert; ``tune`` and ``--activation-budget`` build their model the same way).

Each is causal (BERT as a decoder: next-token prediction on the text data must not see the next token), keeps no
key/value cache (training keeps none; the recompute planner refuses one) and returns its logits, the one tensor
``ampkit compare`` trains on. Sizes: the factory's ``d_model``, ``n_layers``, ``n_heads`` (64, 2, 4; no command
line flag sets them yet).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PREFIX = "hf:"
# architecture -> (its config class, its causal LM class, extra config)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "bert": ("BertConfig", "BertLMHeadModel", {"is_decoder": True}),
}


class CausalLMLogits(nn.Module):
    """A transformers causal LM that takes token ids and returns its logits (``model`` is the transformers model)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


def factory(spec: str) -> Callable[..., nn.Module]:
    """The factory ``hf:<architecture>`` names (ValueError for another name, naming the choices; ImportError
    without transformers, naming the install)."""
    architecture = spec.removeprefix(PREFIX)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"Unknown transformers architecture {spec!r}. Choose one of "
                         f"{[PREFIX + a for a in ARCHITECTURES]}.")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(f"--model {spec} builds a transformers model: pip install transformers") from error
    config_name, model_name, extra = ARCHITECTURES[architecture]

    def build(vocab_size: int, context: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4) -> nn.Module:
        sizes = _sizes(architecture, vocab_size, context, d_model, n_layers, n_heads)
        config = getattr(transformers, config_name)(**sizes, **extra, use_cache=False)
        return CausalLMLogits(getattr(transformers, model_name)(config))

    return build


def _sizes(architecture: str, vocab: int, context: int, width: int, layers: int, heads: int) -> dict[str, Any]:
    """Each family's names for the same sizes (a feed-forward 4x wide, as GPT's)."""
    if architecture == "gpt2":
        return {"vocab_size": vocab, "n_positions": context, "n_embd": width, "n_layer": layers, "n_head": heads,
                "bos_token_id": 0, "eos_token_id": 0}
    names = {"vocab_size": vocab, "max_position_embeddings": context, "hidden_size": width,
             "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": 4 * width}
    if architecture in ("llama", "qwen2"):
        names |= {"num_key_value_heads": heads, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    return names
