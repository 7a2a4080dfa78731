"""ampkit/_trees.py against torch's own pytree (``torch.utils._pytree``, what torch.compile and torch.func walk
with): the same leaves in the same order, the same containers rebuilt, on every container ampkit walks."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as torch_pytree

from ampkit import _trees


class Pair(NamedTuple):
    first: torch.Tensor
    second: object


def _values() -> list[object]:
    t = torch.arange(3.0)
    return [
        t,
        (t, 1, None, "text"),
        [t, [t * 2, (t * 3,)], {"b": t, "a": 2.5}],
        collections.OrderedDict(z=t, y=[t, t]),
        Pair(t, {"inner": (t,)}),
        torch.max(torch.ones(2, 3), dim=1),  # torch.return_types.max
        {"kwargs": {"dim": 1, "keepdim": True}, "args": (t, slice(0, 2))},
        [],
        {},
    ]


@pytest.mark.parametrize("index", range(len(_values())))
def test_the_leaves_are_torchs_in_its_order(index: int) -> None:
    value = _values()[index]
    assert _identities(_trees.leaves(value)) == _identities(torch_pytree.tree_leaves(value))


@pytest.mark.parametrize("index", range(len(_values())))
def test_flatten_then_unflatten_rebuilds_what_torchs_rebuilds(index: int) -> None:
    value = _values()[index]
    leaves, spec = _trees.flatten(value)
    torch_leaves, torch_spec = torch_pytree.tree_flatten(value)
    assert _identities(leaves) == _identities(torch_leaves)
    doubled = [leaf * 2 if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    ours, theirs = _trees.unflatten(doubled, spec), torch_pytree.tree_unflatten(doubled, torch_spec)
    assert type(ours) is type(theirs) and repr(ours) == repr(theirs)


@pytest.mark.parametrize("index", range(len(_values())))
def test_map_tensors_is_torchs_tree_map_only(index: int) -> None:
    value = _values()[index]
    ours = _trees.map_tensors(lambda t: t + 1, value)
    theirs = torch_pytree.tree_map_only(torch.Tensor, lambda t: t + 1, value)
    assert type(ours) is type(theirs) and repr(ours) == repr(theirs)
    assert repr(value) == repr(_values()[index])  # the input's containers untouched


def test_the_spec_holds_no_leaf() -> None:
    # Float32Compute keeps the spec for its backward: it must not keep the call's tensors alive
    t = torch.ones(4)
    leaves, spec = _trees.flatten(([t], {"x": t}))
    assert [leaf is t for leaf in leaves] == [True, True]
    held, todo = [], [spec]
    while todo:  # every field of every spec in the tree
        node = todo.pop()
        if node is not None:
            held += [node.kind, *(node.keys or ())]
            todo += node.children
    assert held and not any(isinstance(value, torch.Tensor) for value in held)


def test_a_dict_subclass_keeps_what_it_carries() -> None:
    counts = collections.defaultdict(list, {"a": torch.ones(1)})
    mapped = _trees.map_tensors(lambda t: t * 3, counts)
    assert isinstance(mapped, collections.defaultdict) and mapped.default_factory is list
    assert mapped["a"].item() == 3.0 and counts["a"].item() == 1.0


def test_a_transformers_model_output_is_walked_and_rebuilt() -> None:
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.ones(2), hidden_states=(torch.zeros(1),))
    assert _identities(_trees.leaves(out)) == _identities(torch_pytree.tree_leaves(out))
    mapped = _trees.map_tensors(lambda t: t + 1, out)
    assert type(mapped) is type(out) and mapped.last_hidden_state.tolist() == [2.0, 2.0]
    assert mapped.hidden_states[0].item() == 1.0 and out.last_hidden_state.tolist() == [1.0, 1.0]


def _identities(leaves: list[object]) -> list[object]:
    return [id(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
