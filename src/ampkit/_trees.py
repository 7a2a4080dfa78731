"""Values inside containers: the leaves of tuples, lists and dicts, and the containers rebuilt around new leaves.

The containers are the built-in ones and their subclasses: named tuples, torch's return types (``torch.max``'s),
``torch.Size``, ``OrderedDict``, transformers' ``ModelOutput``. Anything else is a leaf, as in torch's own pytree for
a type nobody registered. torch's pytree is a private module, with no public one up to torch 2.15.0
(tests/test_torch_shim.py watches for one); these few containers are all ampkit walks: the calls and results of ops,
the outputs of modules, batches and state dicts (tests/test_trees.py holds each against torch's pytree). This module
imports nothing of ampkit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class Spec(NamedTuple):
    """How ``flatten`` found a container: its type, a dict's keys, and each child's spec (None: a leaf)."""

    kind: type
    keys: tuple[Any, ...] | None
    children: tuple[Spec | None, ...]


def _items(value: Any) -> list[Any] | None:
    """A container's children (a dict's values), else None: a leaf."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (tuple, list)):
        return list(value)
    return None


def _rebuilt(value: Any, items: list[Any]) -> Any:
    """``value``'s container holding ``items`` in its children's places."""
    if isinstance(value, dict):
        new = copy.copy(value)  # a subclass keeps what it carries: a defaultdict's factory, a ModelOutput's fields
        for key, item in zip(value, items):
            new[key] = item
        return new
    return _sequence(type(value), items)


def _sequence(kind: type, items: list[Any]) -> Any:
    if kind is tuple or kind is list:
        return kind(items)
    if hasattr(kind, "_fields"):  # a named tuple takes its fields one by one
        return kind(*items)
    return kind(items)  # torch's return types, torch.Size, other subclasses


def leaves(value: Any) -> list[Any]:
    """Every leaf of ``value``, depth first, a dict's in its keys' order."""
    found: list[Any] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[Any]) -> None:
    items = _items(value)
    if items is None:
        found.append(value)
        return
    for item in items:
        _collect(item, found)


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` rebuilt with ``fn`` applied to each leaf (the input's containers untouched)."""
    items = _items(value)
    if items is None:
        return fn(value)
    return _rebuilt(value, [map_leaves(fn, item) for item in items])


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` rebuilt with ``fn`` applied to each tensor leaf; the other leaves as they were."""
    return map_leaves(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, value)


def flatten(value: Any) -> tuple[list[Any], Spec | None]:
    """``value``'s leaves and the spec ``unflatten`` rebuilds it from. The spec holds types and keys only, no leaf:
    a backward may keep it without keeping the tensors."""
    found: list[Any] = []
    return found, _spec(value, found)


def _spec(value: Any, found: list[Any]) -> Spec | None:
    items = _items(value)
    if items is None:
        found.append(value)
        return None
    keys = tuple(value) if isinstance(value, dict) else None
    return Spec(type(value), keys, tuple(_spec(item, found) for item in items))


def unflatten(values: list[Any], spec: Spec | None) -> Any:
    """The value ``flatten`` gave ``spec`` for, with ``values`` as its leaves in order."""
    remaining = iter(values)
    return _build(remaining, spec)


def _build(remaining: Any, spec: Spec | None) -> Any:
    if spec is None:
        return next(remaining)
    items = [_build(remaining, child) for child in spec.children]
    if spec.keys is not None:
        return spec.kind(zip(spec.keys, items))  # dict, OrderedDict: the containers of ops' calls and results
    return _sequence(spec.kind, items)
