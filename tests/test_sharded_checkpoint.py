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
