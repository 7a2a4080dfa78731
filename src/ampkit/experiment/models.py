"""The models `ampkit compare` trains: ResNet-18 for 1x28x28 images, a small GPT, an MLP (and transformers'
language models, ``hf_models.py``).

Defined here because torchvision is not a dependency; each factory takes the
data's shape and returns a float32 ``nn.Module``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ampkit.experiment import hf_models


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (He et al., 2016) with its standard stem, for grayscale images.

    Args:
        in_channels: 1 for the digits and MNIST.
        num_classes: 10.
        stem: ``"standard"`` (default: the paper's 7x7 stride-2 conv and 3x3 stride-2
            max-pool, which take 28x28 down to 7x7 before the first stage) or
            ``"small"`` (a 3x3 stride-1 conv that keeps 28x28 for the first stage, as
            CIFAR ResNets do: about 16x the arithmetic, which the digits, 8x8 images
            upsampled to 28x28, do not need).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, stem: str = "standard") -> None:
        super().__init__()
        if stem not in ("standard", "small"):
            raise ValueError(f"Unknown ResNet-18 stem {stem!r}. Choose 'standard' or 'small'.")
        if stem == "standard":
            self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
            self.pool: nn.Module = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
            self.pool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(64)
        layers, channels = [], 64
        for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
            channels = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.pool(F.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


class MLP(nn.Module):
    def __init__(self, in_features: int = 784, num_classes: int = 10, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d_model), CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer (nanoGPT's shape): token + position embeddings,
    pre-norm blocks, a tied language-model head.

    The defaults (width 128, 2 blocks, 4 heads, 64-byte context) are `ampkit compare`'s
    text workload: small enough for hundreds of steps in a few minutes on 2 CPU cores,
    long enough to learn well below the bytes' unigram entropy. nanoGPT's small
    character model is ``GPT(d_model=384, n_layers=6, n_heads=6, context=256)``.
    """

    def __init__(self, vocab_size: int = 256, context: int = 64, d_model: int = 128, n_layers: int = 2,
                 n_heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight
        for module in self.modules():  # GPT-2's initialisation, as nanoGPT
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(positions))
        return self.lm_head(self.ln_f(x))


class ChannelScale(nn.Module):
    """Multiplies one input channel by ``factor`` (a buffer): an outlier feature, as LLM.int8() found them."""

    scale: torch.Tensor

    def __init__(self, features: int, channel: int, factor: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(features).index_fill_(0, torch.tensor([channel]), factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype)


def gpt_with_outlier(channel: int = 7, factor: float = 1e6, **kwargs: int) -> GPT:
    """The GPT with one planted outlier: input channel ``channel`` of block 0's second MLP linear
    (``blocks.0.mlp.3``) is ``factor`` times larger, and that weight column ``factor`` times smaller (the
    same function in exact arithmetic). The column's gradient is zeroed so that AdamW, which moves every
    weight by about the learning rate, cannot move it ``factor`` times faster in function space: it
    stays as initialised. A per-tensor FP8 scale of that linear's input is set by the one channel: at
    10^6 E4M3 flushes the others to zero (at 10^4, LLM.int8()'s int8 failure, E4M3's subnormals still hold
    them, a few bits each; docs/tune.md). (A deep copy drops the gradient hook: build the model again.)"""
    model = GPT(**kwargs)
    first, gelu, second = model.blocks[0].mlp  # type: ignore[union-attr, misc]
    with torch.no_grad():
        second.weight[:, channel] /= factor
    mask = torch.ones_like(second.weight).index_fill_(1, torch.tensor([channel]), 0.0)
    second.weight.register_hook(lambda grad: grad * mask.to(grad.dtype))
    model.blocks[0].mlp = nn.Sequential(first, gelu, ChannelScale(second.in_features, channel, factor), second)
    return model


class GrowingLinear(nn.Linear):
    """A linear whose weight is multiplied by ``gain`` and its output divided by it: the same function in exact
    arithmetic. ``gain`` grows by ``rate`` at each training forward from the ``start``-th on, up to 2**24, so in
    float16 the output overflows at a known step, where float32 and bfloat16 hold it: a layer whose weights grow
    until float16 cannot hold its output (``ampkit.Guard``'s planted fault). The count and the gain are buffers
    (in the state dict; torch.compile traces their update instead of recompiling for each count)."""

    gain: torch.Tensor
    calls: torch.Tensor

    def __init__(self, in_features: int, out_features: int, rate: float = 2.0, start: int = 5,
                 bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.rate, self.start = rate, start
        self.register_buffer("gain", torch.ones(()))
        self.register_buffer("calls", torch.zeros(()))

    @classmethod
    def from_linear(cls, linear: nn.Linear, rate: float, start: int) -> GrowingLinear:
        grown = cls(linear.in_features, linear.out_features, rate, start, bias=linear.bias is not None)
        grown.load_state_dict({**linear.state_dict(), "gain": grown.gain, "calls": grown.calls})
        return grown

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            self.calls.add_(1)
            self.gain.copy_(torch.pow(self.rate, (self.calls - self.start).clamp(min=0)).clamp(max=2.0**24))
        out = F.linear(x, self.weight * self.gain) / self.gain
        return out + self.bias if self.bias is not None else out


def gpt_with_growing_layer(rate: float = 2.0, start: int = 20, **kwargs: int) -> GPT:
    """The GPT whose block 0's first MLP linear (``blocks.0.mlp.0``) is a ``GrowingLinear``: in float16 its output
    overflows some 14 steps after ``start``, at any loss scale (at step 34 of compare's GPT run on the text data,
    where the gain, 2**14, passes 65504 over the layer's largest output)."""
    model = GPT(**kwargs)
    mlp: nn.Sequential = model.blocks[0].mlp  # type: ignore[union-attr, assignment]
    first: nn.Linear = mlp[0]  # type: ignore[assignment]
    mlp[0] = GrowingLinear.from_linear(first, rate, start)
    return model


MODELS: dict[str, Callable[..., nn.Module]] = {"resnet18": ResNet18, "gpt": GPT, "mlp": MLP,
                                               "gpt-outlier": gpt_with_outlier, "gpt-overflow": gpt_with_growing_layer}


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """A model factory: a name in MODELS, or ``pkg.module:factory`` (a user's own).

    Raises:
        ValueError: an unknown name, or a ``module:factory`` that cannot be imported.
    """
    if spec in MODELS:
        return MODELS[spec]
    if spec.startswith(hf_models.PREFIX):
        return hf_models.factory(spec)
    if ":" not in spec:
        raise ValueError(f"Unknown model {spec!r}. Choose one of {sorted(MODELS)}, hf:<architecture> "
                         f"({', '.join(hf_models.ARCHITECTURES)}: transformers) or give pkg.module:factory.")
    module_name, _, attr = spec.partition(":")
    if not module_name or module_name.startswith("."):  # a relative name has no package to start from
        raise ValueError(f"Model factory {spec!r} names {'a relative module' if module_name else 'no module'}: give "
                         "the module's full name, pkg.module:factory, with the module on PYTHONPATH.")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except SystemExit as exit_:
        raise ValueError(f"Cannot load model factory {spec!r}: importing {module_name} called "
                         f"sys.exit({exit_.code!r}).") from None
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot load model factory {spec!r}: {error}. Is the module on PYTHONPATH?") from error
    except SyntaxError as error:  # the user's module itself does not parse
        raise ValueError(f"Cannot load model factory {spec!r}: {module_name} has a syntax error at "
                         f"{error.filename}:{error.lineno}: {error.msg}. Fix the module, then run again.") from error
    except Exception as error:  # the user's module fails as it runs: its own error, one line
        raise ValueError(f"Cannot load model factory {spec!r}: importing {module_name} raised "
                         f"{type(error).__name__}: {error}. Fix the module, then run again.") from error
    if not callable(factory):
        raise ValueError(f"Model factory {spec!r} is not callable.")
    return factory


def build(spec: str, **kwargs: int) -> nn.Module:
    """The model ``spec`` names (see ``load_factory``), built with ``kwargs``.

    Raises:
        ValueError: the factory raised (its error named, with the arguments it received),
            returned something that is not an ``nn.Module``, or a model without parameters.
    """
    factory = load_factory(spec)
    arguments = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    try:
        model = factory(**kwargs)
    except SystemExit as exit_:  # it would end ampkit itself, with its code and no message
        raise ValueError(f"Model factory {spec!r} called sys.exit({exit_.code!r}) (called as {spec}({arguments})): "
                         "a factory returns a model; raise an exception to refuse.") from None
    except Exception as error:
        raise ValueError(f"Model factory {spec!r} raised {type(error).__name__}: {error} (called as "
                         f"{spec}({arguments}); a factory receives num_classes= for images, vocab_size= and "
                         "context= for text).") from error
    if not isinstance(model, nn.Module):
        raise ValueError(f"Model factory {spec!r} returned a {type(model).__name__}, not a torch.nn.Module.")
    if not any(True for _ in model.parameters()):
        raise ValueError(f"The model from {spec!r} has no parameters: there is nothing to train.")
    return model


class ModelMistake(ValueError):
    """What ampkit found wrong with a user's model (its output, its factory): already one line."""


def check_output(spec: str, output: object, classes: int, targets: tuple[int, ...] | None = None) -> torch.Tensor:
    """``output`` if it is a tensor of per-class scores in its last dimension, one row per target
    (``targets``: the targets' shape, where given), else ValueError."""
    if not isinstance(output, torch.Tensor):
        raise ModelMistake(f"The model from {spec!r} returned a {type(output).__name__}; ampkit compare needs one "
                         "tensor of class scores (logits). Wrap the model to return that tensor.")
    if output.shape[-1] != classes:
        raise ModelMistake(f"The model from {spec!r} returned {output.shape[-1]} scores per sample; the data has "
                         f"{classes} classes. Build its last layer with the num_classes / vocab_size it receives.")
    if targets is not None and tuple(output.shape[:-1]) != targets:
        raise ModelMistake(f"The model from {spec!r} returned scores of shape {tuple(output.shape)} for targets of shape "
                         f"{targets}: one row of {classes} scores per target is needed. Does its forward keep the "
                         "batch dimension (no flatten across samples, no mean over the batch)?")
    return output
