"""A linear reading a GELU's output recomputes it in backward instead of saving it.

autograd keeps a GELU's input for the GELU's own backward, so a linear that reads the
GELU's output can save nothing more and recompute that output in its backward (the same
kernel on the same 16-bit values: bit for bit). A transformer MLP then saves one
hidden-size tensor, not two. The graph inspection goes through ``ampkit._torch``: where a
torch release moves what it reads, the output is saved, as without ampkit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ampkit import _torch, _torch_tensors


def passthrough(pack_hook: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """Mark a ``saved_tensors_hooks`` pack hook that returns its tensor as it is (one that
    only looks, as ``memory.saved_bytes_of_step`` does): under it, ``_Linear`` still
    recomputes a GELU output instead of saving it (see ``gelu_input``)."""
    pack_hook._ampkit_passthrough = True  # type: ignore[attr-defined]
    return pack_hook


# The graph-node classes of ``identity_forward`` Functions. A Function's ``ctx`` is the node its output's ``grad_fn``
# is, so each forward records its own class (torch links a node to its Function only by a private attribute).
_identity_nodes: set[type] = set()


def identity_forward(cls: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Mark an autograd Function whose forward returns its first input unchanged, whole (a
    view, as a gradient rescaling does; ``AdaptiveLossScaler``'s brackets): ``_Linear`` looks
    through it for a GELU output (see ``gelu_input``)."""
    forward = cls.forward

    @functools.wraps(forward)
    def recording(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():  # while dynamo traces, ctx stands for the node
            _identity_nodes.add(type(ctx))
        return forward(ctx, *args, **kwargs)

    cls.forward = staticmethod(recording)  # type: ignore[assignment]
    return cls


def gelu_input(x: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """When ``x`` is the output of a GELU (a transformer MLP's hidden layer), possibly behind
    ``identity_forward`` Functions, the GELU's input and mode: autograd keeps that input for
    the GELU's own backward, so a linear reading ``x`` can save nothing more and recompute
    ``x`` in its backward (the same kernel on the same 16-bit values: bit for bit). None
    otherwise, or when saved-tensor hooks other than a ``passthrough`` one are active
    (offloading, checkpointing), whose unpacking during forward is theirs to decide."""
    fn = x.grad_fn
    while fn is not None and type(fn) in _identity_nodes:
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "GeluBackward0":
        return None
    base = _torch_tensors.view_base(x)  # x must be the whole output (a view through identity Functions is), not a part of it
    if base is not None and (x.shape, x.stride(), x.storage_offset()) != (base.shape, base.stride(),
                                                                         base.storage_offset()):
        return None
    hooks = _torch.saved_tensors_hooks_now()
    if hooks is not None and not getattr(hooks[0], "_ampkit_passthrough", False):
        return None
    saved = _torch.gelu_saved(fn)
    if saved is None or saved[0].dtype != x.dtype or saved[0].shape != x.shape:
        return None
    return saved
