"""Property-based sweep (hypothesis) of damaged sharded checkpoint folders (issue 40): whatever happens to the
files a save wrote (a flipped byte, a cut file, a deleted one, junk appended, a stray shard), loading either
refuses with the documented errors and leaves the model and optimizer as they were, or restores exactly the
state saved. Never another exception, never a silently different state."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

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
