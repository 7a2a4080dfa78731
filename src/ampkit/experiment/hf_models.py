"""``--model hf:<architecture>``: a small language model of a transformers family, built from its config with
random weights (nothing is downloaded), so that ``ampkit compare`` runs on real architectures from the command
line (tested for llama, qwen3, gpt2 and bert; ``tune`` and ``--activation-budget`` build their model the same way).

Each is causal (BERT as a decoder: next-token prediction on the text data must not see the next token), keeps no
key/value cache (training keeps none; the recompute planner refuses one) and returns its logits, the one tensor
``ampkit compare`` trains on. Sizes: ``d_model``, ``n_layers``, ``n_heads`` (64, 2, 4 by default), set on the
command line in the name, ``--model hf:llama,d_model=256,n_layers=4,n_heads=8``, so that every subcommand and
every run's record (``results.json``'s ``model``) carries them with the architecture.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PREFIX = "hf:"
SIZES = {"d_model": 64, "n_layers": 2, "n_heads": 4}  # the defaults; ",name=value" in the name sets one
# architecture -> (its config class, its causal LM class, extra config)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # RMSNorms on each head's queries and keys
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "bert": ("BertConfig", "BertLMHeadModel", {"is_decoder": True}),
}
ROTARY = ("llama", "qwen2", "qwen3")  # the families whose attention rotates pairs of a head's features (RoPE)
# --model's help for these models
HELP = (f"{PREFIX}<{'|'.join(ARCHITECTURES)}>" + "".join(f"[,{name}={value}]" for name, value in SIZES.items())
        + " (transformers)")


class CausalLMLogits(nn.Module):
    """A transformers causal LM that takes token ids and returns its logits (``model`` is the transformers model)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


def family(spec: str) -> str:
    """The model name without its sizes: ``hf:llama`` for ``hf:llama,d_model=256`` (any other name as it is)."""
    return spec.partition(",")[0] if spec.startswith(PREFIX) else spec


def parse(spec: str) -> tuple[str, dict[str, int]]:
    """``hf:<architecture>[,d_model=N][,n_layers=N][,n_heads=N]`` as (architecture, sizes); ValueError for an
    unknown architecture or size name, a size that is no positive integer, or ``d_model`` that ``n_heads`` does not
    divide, each naming the choices."""
    architecture, *options = family(spec).removeprefix(PREFIX), *spec.split(",")[1:]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"Unknown transformers architecture {family(spec)!r}. Choose one of "
                         f"{[PREFIX + a for a in ARCHITECTURES]}.")
    sizes = dict(SIZES)
    example = f"{PREFIX}{architecture},d_model=128,n_layers=4,n_heads=4"
    given: set[str] = set()
    for option in options:
        name, _, value = option.partition("=")
        if name not in SIZES:
            raise ValueError(f"Unknown size {name!r} in {spec!r}. Choose from {list(SIZES)}, e.g. {example}.")
        if name in given:
            raise ValueError(f"{name} is given twice in {spec!r}: give each size once, e.g. {example}.")
        given.add(name)
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{name}={value!r} in {spec!r} is invalid: a positive integer, e.g. {example}.")
        sizes[name] = int(value)
    if sizes["d_model"] % sizes["n_heads"]:
        raise ValueError(f"d_model={sizes['d_model']} in {spec!r} is not a multiple of n_heads={sizes['n_heads']}: "
                         f"each head takes d_model / n_heads features, e.g. {example}.")
    head = sizes["d_model"] // sizes["n_heads"]
    if architecture in ROTARY and head % 2:
        raise ValueError(f"d_model={sizes['d_model']} and n_heads={sizes['n_heads']} in {spec!r} give heads of "
                         f"{head} features: {architecture}'s rotary embeddings turn pairs of them, so a head needs an "
                         f"even width, e.g. {example}.")
    return architecture, sizes


def factory(spec: str) -> Callable[..., nn.Module]:
    """The factory ``spec`` names (``parse``'s ValueError for a wrong name; ImportError without transformers,
    naming the install). Its model takes the sizes in ``spec``; keyword arguments override them."""
    architecture, sizes = parse(spec)
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(f"--model {spec} builds a transformers model: pip install transformers") from error
    config_name, model_name, extra = ARCHITECTURES[architecture]

    def build(vocab_size: int, context: int, **given: int) -> nn.Module:
        chosen = sizes | given
        names = _sizes(architecture, vocab_size, context, chosen["d_model"], chosen["n_layers"], chosen["n_heads"])
        config = getattr(transformers, config_name)(**names, **extra, use_cache=False)
        return CausalLMLogits(getattr(transformers, model_name)(config))

    return build


def _sizes(architecture: str, vocab: int, context: int, width: int, layers: int, heads: int) -> dict[str, Any]:
    """Each family's names for the same sizes (a feed-forward 4x wide, as GPT's)."""
    if architecture == "gpt2":
        return {"vocab_size": vocab, "n_positions": context, "n_embd": width, "n_layer": layers, "n_head": heads,
                "bos_token_id": 0, "eos_token_id": 0}
    names = {"vocab_size": vocab, "max_position_embeddings": context, "hidden_size": width,
             "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": 4 * width}
    if architecture in ("llama", "qwen2", "qwen3"):
        names |= {"num_key_value_heads": heads, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if architecture == "qwen3":
        names["head_dim"] = width // heads  # Qwen3Config's own default is 128, whatever the width
    return names
