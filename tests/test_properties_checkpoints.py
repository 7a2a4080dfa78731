"""Property-based sweeps (hypothesis) of damaged files (issue 40). Sharded checkpoint folders: whatever happens to
the files a save wrote (a flipped byte, a cut file, a deleted one, junk appended, a stray shard), loading either
refuses with the documented errors and leaves the model and optimizer as they were, or restores exactly the
state saved. Plan files: whatever one value becomes, the plan applies or is refused with the model unchanged.
Never another exception, never a silently different state."""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampkit.distributed.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

EXAMPLES = settings(max_examples=int(__import__("os").environ.get("AMPKIT_PROPERTY_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=list(HealthCheck), database=None)
FAULTS = ("flip", "cut", "delete", "append", "stray shard")


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for values in optimizer.state_dict()["state"].values():
        tensors += [v.clone() for v in values.values() if isinstance(v, torch.Tensor)]
    return tensors


SAVED = Path(tempfile.mkdtemp(prefix="ampkit-test-ckpt-")) / "run"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _saved_model, _saved_optimizer = _model(0)
    save_sharded_checkpoint(SAVED, _saved_model, _saved_optimizer, extra={"step": 7})
EXPECTED = _state(_saved_model, _saved_optimizer)


@EXAMPLES
@given(fault=st.sampled_from(FAULTS), which=st.integers(min_value=0), where=st.floats(0, 1), bits=st.integers(0, 7))
def test_a_damaged_folder_is_refused_unchanged_or_loads_exactly(fault: str, which: int, where: float,
                                                                 bits: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ampkit-test-ckpt-")) / "run"
    shutil.copytree(SAVED, folder)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    target = files[which % len(files)]
    data = target.read_bytes()
    at = min(int(where * len(data)), max(len(data) - 1, 0))
    if fault == "flip" and data:
        target.write_bytes(data[:at] + bytes([data[at] ^ (1 << bits)]) + data[at + 1:])
    elif fault == "cut":
        target.write_bytes(data[:at])
    elif fault == "delete":
        target.unlink()
    elif fault == "append":
        target.write_bytes(data + b"junk")
    else:
        (folder / "__1_0.distcp").write_bytes(b"\0" * 64)
    model, optimizer = _model(1)  # other values than the checkpoint's: a partial load would show
    before = _state(model, optimizer)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            extra = load_sharded_checkpoint(folder, model, optimizer)
    except (RuntimeError, FileNotFoundError):
        assert all(torch.equal(a, b) for a, b in zip(before, _state(model, optimizer)))
    else:
        assert extra == {"step": 7}
        assert all(torch.equal(a, b) for a, b in zip(EXPECTED, _state(model, optimizer)))
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)


# -- plan files ---------------------------------------------------------------------------------------------

def _plan_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))


def _plan() -> Any:
    from ampkit.planning.precision_plan import LayerChoice, PrecisionPlan, fingerprint

    model = _plan_model()
    layers = tuple(LayerChoice(name, (32, 32), "fp8" if name == "1" else "bf16", "chosen") for name in ("0", "1", "2"))
    return PrecisionPlan("Sequential", fingerprint(model), "bf16", "time", 0.01, layers, 0.0, 0.0, (), 0.0, True, 0.0)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)


@EXAMPLES
@given(path=st.lists(st.integers(min_value=0), min_size=1, max_size=4), value=JSON)
def test_a_plan_file_with_any_value_changed_loads_and_applies_or_is_refused_unchanged(path: list[int],
                                                                                      value: Any) -> None:
    """Whatever one value of a saved plan becomes, ``load`` then ``apply`` either converts the plan's layers or
    raises ValueError with the model as it was."""
    from ampkit.planning.precision_plan import PrecisionPlan

    data = _plan().to_dict()
    node: Any = data
    for step in path[:-1]:  # walk to a container, choosing keys and items by index
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys or not isinstance(node[keys[step % len(keys)]], (dict, list)):
            break
        node = node[keys[step % len(keys)]]
    keys = list(node) if isinstance(node, dict) else list(range(len(node)))
    if keys:
        node[keys[path[-1] % len(keys)]] = value
    folder = Path(tempfile.mkdtemp(prefix="ampkit-test-plan-"))
    (folder / "plan.json").write_text(json.dumps(data))
    model = _plan_model()
    before = [(name, type(m).__name__) for name, m in model.named_modules()]
    try:
        PrecisionPlan.load(folder / "plan.json").apply(model)
    except ValueError:
        assert [(name, type(m).__name__) for name, m in model.named_modules()] == before
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_plan_whose_layer_name_became_a_list_is_refused_as_damaged() -> None:
    """Hypothesis found it on torch 2.11's CI run (path [35, 1, 0], value []): ``apply`` raised TypeError
    ("unhashable type: 'list'") where the file's damage should be named."""
    from ampkit.planning.precision_plan import PrecisionPlan

    data = _plan().to_dict()
    data["layers"][1]["name"] = []
    folder = Path(tempfile.mkdtemp(prefix="ampkit-test-plan-"))
    try:
        (folder / "plan.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=r"is damaged: layer 1 has name \[\], format 'fp8', shape \[32, 32\]"):
            PrecisionPlan.load(folder / "plan.json")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
