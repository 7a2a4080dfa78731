"""save_sharded_checkpoint / load_sharded_checkpoint in one process, against what a user's folder and a killed
save leave behind (issue 40). The multi-rank round trips are in test_fsdp.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ampkit.distributed.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters())


def test_a_folder_holding_the_users_files_is_refused_and_kept(tmp_path: Path) -> None:
    """On main, saving into a folder that held a user's notes moved it aside and deleted it: the notes were gone."""
    model, optimizer = _model()
    run = tmp_path / "run"
    save_sharded_checkpoint(run, model, optimizer, extra={"step": 1})
    save_sharded_checkpoint(run, model, optimizer, extra={"step": 2})  # over its own checkpoint: fine
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"run holds files a sharded checkpoint does not \(notes\.txt\).*new folder"):
        save_sharded_checkpoint(run, model, optimizer, extra={"step": 3})
    assert (run / "notes.txt").read_text() == "mine"
    assert load_sharded_checkpoint(run, model, optimizer) == {"step": 2}
    assert not list(tmp_path.glob(".run.*"))  # no hidden folder left either


def test_a_save_killed_between_its_renames_leaves_a_loadable_checkpoint(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On main, a writer killed after moving the previous checkpoint aside and before renaming the new one into
    place left nothing at the path; the previous one survived as a hidden folder load never read."""
    model, optimizer = _model()
    run = tmp_path / "run"
    save_sharded_checkpoint(run, model, optimizer, extra={"step": 1})
    renames: list[Path] = []
    real_rename = Path.rename

    def killed_at_the_second(self: Path, target: Path) -> Path:
        if Path(self).parent == tmp_path:  # the save's own two renames, not DCP's inside the folder
            renames.append(self)
        if len(renames) == 2:
            raise SystemExit("killed")  # SIGKILL runs no cleanup: nor does this, with rmtree made a no-op
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_at_the_second)
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(SystemExit):
        save_sharded_checkpoint(run, model, optimizer, extra={"step": 2})
    monkeypatch.undo()
    assert not run.exists()
    with pytest.warns(RuntimeWarning, match=r"run was missing: a save was stopped between its renames"):
        assert load_sharded_checkpoint(run, model, optimizer) == {"step": 2}  # the new one, complete


def test_a_byte_flipped_in_a_saved_file_is_refused_by_name_and_nothing_changes(tmp_path: Path) -> None:
    """On main, a sharded checkpoint with one flipped byte in a weight loaded without an error."""
    model, optimizer = _model()
    save_sharded_checkpoint(tmp_path / "run", model, optimizer)
    shard = next((tmp_path / "run").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=rf"run is damaged: {shard.name} differ from the files the save wrote"):
        load_sharded_checkpoint(tmp_path / "run", model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(tmp_path: Path) -> None:
    """On main, a 2-layer model's checkpoint loaded into a 1-layer model without a word (DCP reads what the model
    asks for and ignores the rest)."""
    two = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    save_sharded_checkpoint(tmp_path / "run", two)
    one = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"checkpoint of another model: it lacks \[\] and has \['1.bias', "
                                           r"'1.weight'\] the model does not"):
        load_sharded_checkpoint(tmp_path / "run", one)


def test_other_shapes_raise_a_runtime_error_not_dcps_base_exception(tmp_path: Path) -> None:
    """On main, torch.distributed.checkpoint's CheckpointException (a BaseException) escaped: `except Exception`
    missed it and the documented RuntimeError was never raised."""
    save_sharded_checkpoint(tmp_path / "run", torch.nn.Linear(4, 4))
    wider = torch.nn.Linear(4, 8)
    with pytest.raises(RuntimeError, match=r"could not be read into this model, nothing was changed: rank 0: "
                                           r".*Load it into the model it was saved from"):
        load_sharded_checkpoint(tmp_path / "run", wider)


def test_a_failed_write_raises_a_runtime_error_and_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write failing inside DCP (a full disk, a read-only folder) escaped as CheckpointException on main."""
    from torch.distributed.checkpoint import filesystem

    model, optimizer = _model()
    save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra={"step": 1})

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", full_disk)
    with pytest.raises(RuntimeError, match=r"Saving the sharded checkpoint .*run failed, the previous one \(if any\) "
                                           r"is as it was: rank 0: OSError: .*No space left on device"):
        save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra={"step": 2})
    monkeypatch.undo()
    assert load_sharded_checkpoint(tmp_path / "run", model, optimizer) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no partial folder left
