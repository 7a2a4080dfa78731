"""A linear reading a GELU's output recomputes it in backward instead of saving it.

autograd keeps a GELU's input for the GELU's own backward, so a linear that reads the
GELU's output can save that input instead and recompute the output in its backward (the
same kernel on the same 16-bit values: bit for bit). A transformer MLP then saves one
hidden-size tensor, not two.

Where float32 compute runs ``linear``, the region registers a kernel for ``gelu`` as well
(``precision/kernels.py``): torch's own GELU, which also notes each output's input and
mode here (``recording``). Reading them back off autograd's graph node would need its
saved tensors, which torch keeps private, and would unpack them during the forward under
others' saved-tensor hooks; the linear saves the input it found through
``save_for_backward``, so such hooks (offloading, checkpointing) pack it as any other.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ampkit import _torch, _torch_tensors

# What each live GELU output was computed from, by the output's id: (the output, its input, the input's count of
# in-place writes then, the approximation mode). An entry goes with its output, or when the GELU's backward starts:
# it holds the input no longer than the GELU's graph node does. Not a weak reference to the input: torch does not
# always keep a tensor's Python object while autograd holds the tensor, so whether the linear found the input came
# to depend on the garbage collector, and a non-reentrant checkpoint's recompute must decide as its forward did (it
# hands the recomputed tensors back by order, and a GELU's input and output look alike to its metadata check: a
# forward that saved the input and a recompute that saved the output gave wrong gradients, silently).
_computed_from: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int, str]] = {}


def recording(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel``, the Autocast-key kernel of ``aten::gelu``, also noting what each output with a gradient was
    computed from. Outputs of a cast input (a policy that lists ``gelu``) and of a trace are not noted."""

    @functools.wraps(kernel)
    def gelu(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = kernel(x, *args, **kwargs)
        # Not while torch.compile traces in this thread (torch 2.11's is_compiling() is false in AOTAutograd's trace)
        if out.requires_grad and out.dtype == x.dtype and not _torch.is_compiling():
            key = id(out)
            noted = weakref.ref(out, lambda noted: _forget(key, noted))
            _computed_from[key] = (noted, x, _torch_tensors.version(x), kwargs.get("approximate", "none"))
            out.grad_fn.register_prehook(lambda _: _forget(key, noted))  # the hook holds no tensor
        return out

    return gelu


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
    """When ``x`` is the whole output of a GELU that ``recording`` noted (a transformer MLP's
    hidden layer), possibly behind ``identity_forward`` Functions, and neither it nor the GELU's
    input was written since (a write to ``x`` gives it another ``grad_fn``): the GELU's input
    and mode. autograd keeps that input for the GELU's own backward, so a linear reading ``x``
    can save it instead and recompute ``x`` in its backward. None otherwise."""
    fn = x.grad_fn
    while fn is not None and type(fn) in _identity_nodes:
        fn = fn.next_functions[0][0]
    if fn is None or fn.name() != "GeluBackward0":
        return None
    base = _torch_tensors.view_base(x)  # x must be the whole output (a view through identity Functions is), not a part of it
    if base is not None and (x.shape, x.stride(), x.storage_offset()) != (base.shape, base.stride(),
                                                                         base.storage_offset()):
        return None
    out = x if base is None else base
    found = _computed_from.get(id(out))
    if found is None or found[0]() is not out:
        return None
    _, source, version, approximate = found
    if _torch_tensors.version(source) != version or source.dtype != x.dtype or source.shape != x.shape:
        return None
    return source, approximate


def _forget(key: int, noted: weakref.ref[torch.Tensor]) -> None:
    if key in _computed_from and _computed_from[key][0] is noted:  # not a later output's that took the same id
        del _computed_from[key]
