"""Every torch private that ampkit uses, one wrapper each.

Private torch API is a loan: these names can move in any release. Each one is taken here, and nowhere else,
with the torch versions it was checked on and what ampkit does where it is missing: a fallback (said once, with
a ``TorchVersionWarning``), or a clear RuntimeError from the feature that needs it, at its first call. Nothing is
looked up at import in a way that could fail: ``import ampkit`` works on any torch. ``missing()`` lists what the
running torch lacks; ``tests/test_torch_shim.py`` fails on any, so a torch release that moves one fails a test
instead of switching a feature off silently.

Checked on the torch releases CI tests, ``CHECKED`` (pyproject.toml's ``[tool.ampkit] tested-torch``;
``tests/test_torch_versions.py`` keeps the two equal): ``tests/test_torch_shim.py`` runs on each. A range
in a docstring below is where the name was found; where releases differ, the wrapper says how.
This module imports nothing of ampkit. None of dynamo's privates is used: ampkit's own code that torch.compile must
not trace carries torch's public marks where it is defined (``torch.compiler.disable`` and its kin).
"""

from __future__ import annotations

import functools
import importlib
import types
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch.fx import operator_schemas

# The torch releases every private below was checked on (CI tests each).
CHECKED = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
_CHECKED_ON = f"torch {', '.join(CHECKED[:-1])} and {CHECKED[-1]}"


class TorchVersionWarning(RuntimeWarning):
    """A torch private that ampkit uses is missing from this torch: the feature falls back."""


_warned: set[str] = set()


def fallback_once(name: str, what_happens: str) -> None:
    """Say once (``TorchVersionWarning``) that this torch lacks ``name`` and what ampkit does instead."""
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"torch {torch.__version__} lacks {name}, which ampkit was checked with ({_CHECKED_ON}): "
                      f"{what_happens}.", TorchVersionWarning, stacklevel=3)


def at_least(major: int, minor: int) -> bool:  # the running torch is release major.minor or later
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def _lookup(path: str) -> Any:
    """The object at ``path`` (``torch._foreach_copy_``), or None where this torch lacks it."""
    obj: Any = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _module(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class _Absent(types.ModuleType):
    """Stands for a private torch module this torch lacks: any use names it."""

    def __getattr__(self, attribute: str) -> Any:
        raise RuntimeError(f"ampkit needs {self.__name__}.{attribute}, which torch {torch.__version__} lacks "
                           f"(ampkit was checked on {_CHECKED_ON}): find_nonfinite and the recompute planner's "
                           "measurement cannot run here; the rest of ampkit can.")


# The dispatch-mode machinery: TorchDispatchMode is documented, its module, torch.utils._python_dispatch, is not
# (2.4-2.15.0). find_nonfinite's mode and the recompute planner's op recorder subclass it; without it they refuse at
# their first call, naming the module.
_dispatch = _module("torch.utils._python_dispatch") or _Absent("torch.utils._python_dispatch")
if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode
elif isinstance(_dispatch, _Absent):
    class TorchDispatchMode:  # a base class that refuses to be entered
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            _dispatch.TorchDispatchMode  # raises, naming the module
else:
    TorchDispatchMode = _dispatch.TorchDispatchMode

# An ATen op overload, as the dispatcher hands kernels (``torch.ops.aten.mm.default``); for annotations only.
OpOverload: TypeAlias = Any


def is_mutable(overload: Any) -> bool:
    """Whether an op overload writes to an argument (``out=``, in-place, a batch norm's running statistics): its
    schema, through torch.fx's public ``get_signature_for_torch_op`` (marked not backward compatible: checked on
    every release CI tests, 2.11-2.15.0)."""
    _, schemas = operator_schemas.get_signature_for_torch_op(overload, return_schemas=True)
    if not schemas:
        raise RuntimeError(f"torch {torch.__version__} gives no schema for {overload} (ampkit was checked on "
                           f"{_CHECKED_ON}): a policy cannot tell whether it writes to an argument; leave it out.")
    return bool(schemas[0].is_mutable)


def is_compiling() -> bool:
    """Whether torch.compile is at work in the calling thread: dynamo's trace or AOTAutograd's. Not
    ``torch.compiler.is_compiling()``: from 2.13 on it is one flag for the process, true in every thread while one
    compiles. dynamo's trace folds ``is_dynamo_compiling()``; AOTAutograd's runs in the thread's tracing context
    (``torch._guards.TracingContext.try_get``, 2.11-2.15.0, thread-local)."""
    if torch.compiler.is_dynamo_compiling():
        return True
    context = _tracing_context()
    return context is not None and context.try_get() is not None


@functools.cache  # looked up once: is_compiling() runs at every float32-computed linear
def _tracing_context() -> Any:
    return getattr(_module("torch._guards"), "TracingContext", None)


def amp_unscale_(tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: GradScaler's fused unscale and inf/NaN check
    (2.4-2.15.0)."""
    fused = _lookup("torch._amp_foreach_non_finite_check_and_unscale_")
    if fused is not None:
        fused(tensors, found_inf, inv_scale)
        return
    fallback_once("torch._amp_foreach_non_finite_check_and_unscale_", "gradients are unscaled one tensor at a time")
    for t in tensors:  # torch's arithmetic: flag any inf/NaN; multiply by the float32 inverse scale in float32 (float64
        # for float64), round once to the gradient's dtype (the scale rounded to 16 bits first: 2**-25 is 0 in fp16)
        found_inf.add_((~torch.isfinite(t)).any().to(found_inf.dtype)).clamp_(max=1.0)
        t.copy_(t.to(torch.promote_types(t.dtype, torch.float32)) * inv_scale)


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``torch._foreach_copy_``: one fused, converting copy of many tensors (2.4-2.15.0)."""
    fused = _lookup("torch._foreach_copy_")
    if fused is None:
        fallback_once("torch._foreach_copy_", "tensors are copied one at a time")
        for target, source in zip(targets, sources):
            target.copy_(source)
        return
    fused(targets, sources)


_NEEDED: dict[str, Callable[[], object]] = {
    "torch.utils._python_dispatch": lambda: None if isinstance(_dispatch, _Absent) else _dispatch,
    "torch._guards.TracingContext.try_get": lambda: getattr(_module("torch._guards"), "TracingContext").try_get,
    "torch._amp_foreach_non_finite_check_and_unscale_": lambda: torch._amp_foreach_non_finite_check_and_unscale_,
    "torch._foreach_copy_": lambda: torch._foreach_copy_,
}


def missing() -> list[str]:
    """The privates above that the running torch lacks (empty on a supported torch)."""
    absent = []
    for name, get in _NEEDED.items():
        try:
            if get() is None:
                absent.append(name)
        except (AttributeError, ImportError):
            absent.append(name)
    return absent


# Checked once, at import, against the running torch: one warning naming what is missing (each feature
# then says what it does without it, at its first call).
if absent := missing():
    warnings.warn(f"torch {torch.__version__} lacks {', '.join(absent)}, which ampkit was checked with "
                  f"({_CHECKED_ON}); the features that need them fall back or refuse at their first call, saying so.",
                  TorchVersionWarning, stacklevel=2)
