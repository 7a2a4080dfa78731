"""The third hostile sweep (issue 40), beyond its named cases: what a hostile user or a failing machine does to
checkpoints (sharded and single-file), optimizer states in fewer bits, precision plans, recompute budgets and
block-scaled numerics. Each case passes when the outcome is clean: the result is right, or a clear error (its
type and the words that say the fix) leaves the model, the optimizer and the files as they were. No case may lose
data or be silently wrong.

Faults: a real SIGKILL of a process saving a checkpoint at each step of the save (sharded: before DCP writes, after
its first file, before the checksums, at each of the two renames, before the old folder is removed; single-file:
during the write, before and after the rename), a full disk (simulated), and a read-only folder: simulated, and real
(the writer runs without the capability by which root ignores permissions)."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit.distributed.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int = 0) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- A real SIGKILL at each step of a save --------------------------------------------------------------------

# The saving process: a checkpoint of step 1 exists; it saves step 2 and is killed (SIGKILL: no cleanup runs) at the
# named point, through a patch that kills just before (or after) the call that would be that point.
_KILLER = textwrap.dedent('''
    import os, signal, shutil, sys
    from pathlib import Path
    import torch
    from torch.distributed.checkpoint import filesystem
    import ampkit
    from ampkit.distributed.sharded_checkpoint import save_sharded_checkpoint

    kind, point, path = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    torch.manual_seed(2)
    model = torch.nn.Linear(8, 8)
    if kind == "sharded":
        real_write, real_rename, real_text, real_rmtree = (filesystem.FileSystemWriter.write_data, Path.rename,
                                                           Path.write_text, shutil.rmtree)
        renames = []
        def write_data(self, *args, **kwargs):
            if point == "before-dcp":
                die()
            result = real_write(self, *args, **kwargs)
            if point == "after-first-file":
                die()
            return result
        def rename(self, target):
            if self.parent == path.parent:
                renames.append(self)
                if point == f"rename-{len(renames)}":
                    die()
            return real_rename(self, target)
        def write_text(self, *args, **kwargs):
            if point == "before-checksums" and self.name == "ampkit.json":
                die()
            return real_text(self, *args, **kwargs)
        def rmtree(*args, **kwargs):
            if point == "before-removing-the-old":
                die()
            return real_rmtree(*args, **kwargs)
        filesystem.FileSystemWriter.write_data = write_data
        Path.rename, Path.write_text, shutil.rmtree = rename, write_text, rmtree
        save_sharded_checkpoint(path, model, extra={"step": 2})
    else:
        real_save, real_replace = torch.save, os.replace
        def save(obj, f, *args, **kwargs):
            if point == "during-the-write":
                with open(f, "wb") as half:
                    half.write(b"PK\\x03\\x04 half a file")
                die()
            return real_save(obj, f, *args, **kwargs)
        def replace(src, dst):
            if point == "before-the-rename":
                die()
            real_replace(src, dst)
            if point == "after-the-rename":
                die()
        torch.save, os.replace = save, replace
        ampkit.save_checkpoint(path, model=model, extra={"step": 2})
    print("not killed")
''')

SHARDED_POINTS = ["before-dcp", "after-first-file", "before-checksums", "rename-1", "rename-2",
                  "before-removing-the-old"]
FILE_POINTS = ["during-the-write", "before-the-rename", "after-the-rename"]


@pytest.mark.parametrize("kind, point", [("sharded", p) for p in SHARDED_POINTS] + [("file", p) for p in FILE_POINTS])
def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint_loadable(kind: str, point: str,
                                                                                  tmp_path: Path) -> None:
    path = tmp_path / ("run" if kind == "sharded" else "last.pt")
    torch.manual_seed(1)
    old = nn.Linear(8, 8)
    torch.manual_seed(2)
    new = nn.Linear(8, 8)
    if kind == "sharded":
        save_sharded_checkpoint(path, old, extra={"step": 1})
    else:
        ampkit.save_checkpoint(path, model=old, extra={"step": 1})
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", _KILLER, kind, point, str(path)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -9, (done.returncode, done.stdout, done.stderr[-2000:])  # it was killed there
    loaded = nn.Linear(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a save stopped between its renames is put back, said so
        if kind == "sharded":
            extra = load_sharded_checkpoint(path, loaded)
        else:
            extra = ampkit.load_checkpoint(path, model=loaded)
    expected = {1: old, 2: new}[extra["step"]]
    assert _same(_weights(loaded), _weights(expected))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != path.name]
    if kind == "file":
        assert all(name.startswith(".last-") for name in leftovers)  # at most a temporary beside it, hidden


# -- A full disk and a read-only folder -----------------------------------------------------------------------

def _no_space(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _read_only(*args: object, **kwargs: object) -> None:
    raise PermissionError(errno.EACCES, "Permission denied")


def test_save_checkpoint_on_a_full_disk_keeps_the_previous_file_and_leaves_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _model()
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, extra={"step": 1})
    monkeypatch.setattr(torch, "save", _no_space)
    with pytest.raises(OSError, match="No space left on device"):
        ampkit.save_checkpoint(tmp_path / "last.pt", model=model, extra={"step": 2})
    monkeypatch.undo()
    assert ampkit.load_checkpoint(tmp_path / "last.pt", model=model) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_save_checkpoint_into_a_read_only_folder_raises_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    model, _ = _model()
    monkeypatch.setattr(tempfile, "mkstemp", _read_only)
    with pytest.raises(PermissionError, match="Permission denied"):
        ampkit.save_checkpoint(tmp_path / "last.pt", model=model)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_save_into_a_read_only_folder_raises_a_runtime_error_and_keeps_the_previous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import filesystem

    model, optimizer = _model()
    save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra={"step": 1})
    monkeypatch.setattr(filesystem.FileSystemWriter, "write_data", _read_only)
    with pytest.raises(RuntimeError, match=r"Saving the sharded checkpoint .* failed, the previous one \(if any\) is "
                                           r"as it was: .*Permission denied.*Check that the folder is writable"):
        save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra={"step": 2})
    monkeypatch.undo()
    assert load_sharded_checkpoint(tmp_path / "run", model, optimizer) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_sharded_save_whose_checksums_cannot_be_written_keeps_the_previous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = _model()
    save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra={"step": 1})
    real = Path.write_text

    def full_at_the_checksums(self: Path, *args: object, **kwargs: object) -> int:
        if self.name == "ampkit.json":
            _no_space()
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", full_at_the_checksums)
    with pytest.raises(OSError, match="No space left on device"):
        save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra={"step": 2})
    monkeypatch.undo()
    assert load_sharded_checkpoint(tmp_path / "run", model, optimizer) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_a_plan_saved_on_a_full_disk_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(tmp_path)
    before = plan.read_text()
    loaded = ampkit.PrecisionPlan.load(plan)
    monkeypatch.setattr(Path, "write_text", _no_space)
    with pytest.raises(OSError, match="No space left on device"):
        loaded.save(tmp_path / "other.json")
    with pytest.raises(OSError, match="No space left on device"):
        loaded.save(plan, overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"] and plan.read_text() == before


# A real read-only folder: the writer runs without the right to write there. As root (this machine), permissions
# bind only once the capability that overrides them is dropped (setpriv); as another user a mode of 0o555 does.
_READ_ONLY_WRITER = textwrap.dedent('''
    import json, sys, warnings
    import torch
    import ampkit
    from ampkit.distributed.sharded_checkpoint import save_sharded_checkpoint
    warnings.simplefilter("ignore", UserWarning)  # DCP's note that it runs in one process
    folder, plan = sys.argv[1], ampkit.PrecisionPlan.load(sys.argv[2])
    model = torch.nn.Linear(8, 8)
    writes = {"save_checkpoint over a file": lambda: ampkit.save_checkpoint(f"{folder}/last.pt", model=model),
              "save_checkpoint into a new folder": lambda: ampkit.save_checkpoint(f"{folder}/new/last.pt", model=model),
              "save_sharded_checkpoint over a checkpoint": lambda: save_sharded_checkpoint(f"{folder}/run", model),
              "save_sharded_checkpoint beside it": lambda: save_sharded_checkpoint(f"{folder}/run2", model),
              "PrecisionPlan.save over a plan": lambda: plan.save(f"{folder}/plan.json", overwrite=True)}
    outcomes = {}
    for name, write in writes.items():
        try:
            write()
            outcomes[name] = "written"
        except BaseException as error:  # DCP raises BaseExceptions: the case fails unless it is a plain error
            outcomes[name] = f"{type(error).__name__}: {error}"
    print(json.dumps(outcomes))
''')


def _without_write_permission() -> list[str]:
    if os.geteuid() != 0:
        return []
    if not Path("/usr/bin/setpriv").exists():
        pytest.skip("running as root without setpriv: no way to make a folder read-only to this process")
    dropped = "-dac_override,-dac_read_search"
    return ["/usr/bin/setpriv", f"--bounding-set={dropped}", f"--inh-caps={dropped}"]


def test_saves_into_a_real_read_only_folder_are_refused_and_leave_every_file_as_it_was(tmp_path: Path) -> None:
    folder = tmp_path / "run-dir"
    folder.mkdir()
    torch.manual_seed(1)
    old = nn.Linear(8, 8)
    ampkit.save_checkpoint(folder / "last.pt", model=old, extra={"step": 1})
    save_sharded_checkpoint(folder / "run", old, extra={"step": 1})
    plan_source = _plan(tmp_path)
    (folder / "plan.json").write_text(plan_source.read_text())
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    for path in [folder, folder / "run"]:
        path.chmod(0o555)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run([*_without_write_permission(), sys.executable, "-c", _READ_ONLY_WRITER, str(folder),
                               str(plan_source)], env=env, capture_output=True, text=True, timeout=120)
    finally:
        for path in [folder, folder / "run"]:
            path.chmod(0o755)
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = json.loads(done.stdout.splitlines()[-1])
    for name, outcome in outcomes.items():  # a plain error naming the folder, nothing written
        assert outcome.split(":")[0] in ("PermissionError", "RuntimeError"), (name, outcome)
        assert "Permission denied" in outcome and "run-dir" in outcome, (name, outcome)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    loaded = nn.Linear(8, 8)
    assert ampkit.load_checkpoint(folder / "last.pt", model=loaded) == {"step": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's note that it runs in one process
        assert load_sharded_checkpoint(folder / "run", loaded) == {"step": 1}
    assert _same(_weights(loaded), _weights(old))


# -- Sharded checkpoints misused ------------------------------------------------------------------------------

def _saved(tmp_path: Path, optimizer: bool = True) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model, opt = _model()
    _step(model, opt)
    save_sharded_checkpoint(tmp_path / "run", model, opt if optimizer else None, extra={"step": 1})
    return tmp_path / "run", model, opt


def _unchanged_after(call: Callable[[nn.Module, torch.optim.Optimizer], object], error: type[BaseException],
                     match: str) -> None:
    """``call`` on a fresh model and optimizer that has stepped raises ``error`` matching ``match``, and leaves
    both as they were."""
    model, optimizer = _model(seed=5)
    _step(model, optimizer)
    weights, state = _weights(model), copy.deepcopy(optimizer.state_dict())
    with pytest.raises(error, match=match):
        call(model, optimizer)
    assert _same(weights, _weights(model))
    after = optimizer.state_dict()
    assert all(torch.equal(after["state"][i][k], v) for i, s in state["state"].items() for k, v in s.items())


SHARDED_MISUSE = {
    "load from a path that does not exist": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(tmp / "nowhere", m, o), FileNotFoundError,
        r"No sharded checkpoint at .*nowhere: pass the folder save_sharded_checkpoint wrote"),
    "load from a file": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_file(tmp), m, o), FileNotFoundError, r"it is a file: use load_checkpoint"),
    "load from an empty folder": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_folder(tmp), m, o), RuntimeError, r"has no .metadata"),
    "load an optimizer the checkpoint lacks": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_saved(tmp, optimizer=False)[0], m, o), RuntimeError,
        r"was saved without an optimizer"),
    "load an object the checkpoint lacks": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_saved(tmp)[0], m, o, scaler=ampkit.DynamicLossScaler()), RuntimeError,
        r"has no state for \['scaler'\]"),
    "load a truncated .metadata": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_cut(_saved(tmp)[0] / ".metadata"), m, o), RuntimeError,
        r"run"),
    "load a checkpoint whose shard file is gone": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_gone(_saved(tmp)[0]), m, o), RuntimeError, r"run"),
    "load into a wider model": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_saved(tmp)[0], *_wider()), RuntimeError,
        r"could not be read into this model, nothing was changed"),
    "load a single-file checkpoint as a sharded one": lambda tmp: (
        lambda m, o: load_sharded_checkpoint(_single(tmp), m, o), FileNotFoundError, r"it is a file"),
    "load a sharded checkpoint as a single file": lambda tmp: (
        lambda m, o: ampkit.load_checkpoint(_saved(tmp)[0], model=m, optimizer=o), FileNotFoundError,
        r"it is a folder"),
}


def _file(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("mine")
    return tmp / "notes.txt"


def _folder(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def _cut(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path.parent


def _gone(path: Path) -> Path:
    next(path.glob("*.distcp")).unlink()
    return path


def _wider() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, torch.optim.AdamW(model.parameters())


def _single(tmp: Path) -> Path:
    model, optimizer = _model()
    ampkit.save_checkpoint(tmp / "last.pt", model=model, optimizer=optimizer)
    return tmp / "last.pt"


@pytest.mark.parametrize("case", list(SHARDED_MISUSE))
def test_a_misused_sharded_checkpoint_is_refused_and_changes_nothing(case: str, tmp_path: Path) -> None:
    call, error, match = SHARDED_MISUSE[case](tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's note that it runs in one process
        _unchanged_after(call, error, match)


@pytest.mark.parametrize("bad, error, match", [
    ({"lr": __import__("numpy").float32(0.1)}, ValueError, r"extra\['lr'\] is a numpy.float32"),
    ({"path": Path("x")}, ValueError, r"extra\['path'\] is a pathlib"),
])
def test_a_sharded_save_with_an_unloadable_extra_writes_nothing(bad: dict, error: type, match: str,
                                                                tmp_path: Path) -> None:
    model, optimizer = _model()
    with pytest.raises(error, match=match):
        save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra=bad)
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_save_over_a_file_or_with_a_stateless_object_writes_nothing(tmp_path: Path) -> None:
    model, optimizer = _model()
    (tmp_path / "run").write_text("mine")
    with pytest.raises(ValueError, match=r"is a file; a sharded checkpoint is a folder"):
        save_sharded_checkpoint(tmp_path / "run", model, optimizer)
    with pytest.raises(TypeError, match=r"counter=int has no state_dict\(\)"):
        save_sharded_checkpoint(tmp_path / "other", model, optimizer, counter=3)
    assert (tmp_path / "run").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["run"]


# -- Optimizer states in fewer bits, across checkpoints and formats ------------------------------------------

pytest.importorskip("torchao.optim")


@pytest.fixture()
def eager_torchao():  # type: ignore[no-untyped-def]
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _with_states(states: str | None, level: str = "O1", seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = _model(seed)
    return ampkit.initialize(model, optimizer, level, torch.bfloat16, compute="native", states=states)


@pytest.mark.parametrize("saved, loaded", [("8bit", None), (None, "8bit"), ("4bit", "8bit"), ("bf16", "fp8"),
                                           ("fp8", "bf16")])
def test_a_sharded_checkpoint_of_one_format_is_refused_by_another_naming_it(
        saved: str | None, loaded: str | None, tmp_path: Path, eager_torchao: None) -> None:
    """Another format's optimizer has other state and group keys: DCP refused, saying to load it into the model it
    was saved from. Refused first, naming both formats and the fix; nothing changes. The same format resumes."""
    model, optimizer = _with_states(saved)
    for step in range(2):
        _step(model, optimizer, step)
    save_sharded_checkpoint(tmp_path / "run", model, optimizer, extra={"step": 2})
    names = {None: "as given"}
    _unchanged_after_with(lambda: _with_states(loaded, seed=1),
                          lambda m, o: load_sharded_checkpoint(tmp_path / "run", m, o), RuntimeError,
                          rf"kept AdamW's moments as '{names.get(saved, saved)}', this one keeps them as "
                          rf"'{names.get(loaded, loaded)}'.*states=")
    same, same_optimizer = _with_states(saved, seed=1)
    assert load_sharded_checkpoint(tmp_path / "run", same, same_optimizer) == {"step": 2}
    assert _same(_weights(same), _weights(model))


def _unchanged_after_with(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]],
                          call: Callable[[nn.Module, torch.optim.Optimizer], object], error: type[BaseException],
                          match: str) -> None:
    """``_unchanged_after`` on the model and optimizer ``make`` builds."""
    from ampkit.optim.states import snapshot

    model, optimizer = make()
    _step(model, optimizer)
    weights, state = _weights(model), snapshot(optimizer.state_dict())
    with pytest.raises(error, match=match):
        call(model, optimizer)
    assert _same(weights, _weights(model))
    after = optimizer.state_dict()
    for index, saved in state["state"].items():
        for key, value in saved.items():
            now = after["state"][index][key]
            assert torch.equal(_plain(now), _plain(value)) if isinstance(value, torch.Tensor) else now == value, key


def _plain(value: torch.Tensor) -> torch.Tensor:
    """A state's values as a plain tensor (torchao's dequantized)."""
    return value.dequantize() if hasattr(value, "dequantize") and hasattr(value, "codes") else value


def test_a_single_file_checkpoint_of_8bit_moments_refuses_to_load_into_float32_adamw(tmp_path: Path,
                                                                                     eager_torchao: None) -> None:
    """At O1 the optimizer is torchao's own, whose state dict holds 8-bit tensors: torch's AdamW would take them
    as moments. Refused, naming the format, before anything changes."""
    model, optimizer = _with_states("8bit")
    _step(model, optimizer)
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer)
    _unchanged_after(lambda m, o: ampkit.load_checkpoint(tmp_path / "last.pt", model=m, optimizer=o), RuntimeError,
                     r"'optimizer' kept AdamW's moments as '8bit', this one keeps them as 'as given'.*states='8bit'")


def test_o2_moments_of_another_format_are_refused_through_save_checkpoint(tmp_path: Path,
                                                                          eager_torchao: None) -> None:
    model, optimizer = _with_states("4bit", "O2")
    _step(model, optimizer)
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer)
    other, other_optimizer = _with_states("bf16", "O2", seed=1)
    weights = _weights(other)
    with pytest.raises(RuntimeError, match=r"kept AdamW's moments as '4bit', this one keeps them as 'bf16'"):
        ampkit.load_checkpoint(tmp_path / "last.pt", model=other, optimizer=other_optimizer)
    assert _same(weights, _weights(other))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_stepped_low_bit_optimizer_rolls_back_to_a_checkpoint(level: str, tmp_path: Path,
                                                                eager_torchao: None) -> None:
    """load_checkpoint copies each object's state first (to put it back if a later object refuses): torchao's states
    have no deepcopy, and a rollback of a trained run raised NotImplementedError."""
    model, optimizer = _with_states("8bit", level)
    _step(model, optimizer, 0)
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer, extra={"step": 1})
    weights = _weights(model)
    _step(model, optimizer, 1)
    assert ampkit.load_checkpoint(tmp_path / "last.pt", model=model, optimizer=optimizer) == {"step": 1}
    assert _same(_weights(model), weights)
    scaler = ampkit.DynamicLossScaler()
    ampkit.save_checkpoint(tmp_path / "other.pt", model=model, optimizer=optimizer, scaler=scaler)
    _step(model, optimizer, 2)
    trained = _weights(model)
    broken = torch.load(tmp_path / "other.pt", weights_only=True)
    broken["states"]["scaler"]["version"] = 99  # the last object refuses: the first two are put back
    torch.save(broken, tmp_path / "other.pt")
    with pytest.raises(RuntimeError, match=r"loading 'scaler' failed, nothing was changed"):
        ampkit.load_checkpoint(tmp_path / "other.pt", model=model, optimizer=optimizer, scaler=scaler)
    assert _same(_weights(model), trained)
    _step(model, optimizer, 3)  # its states still work


@pytest.mark.parametrize("states", ["8bit", "bf16"])
def test_low_bit_moments_with_a_frozen_layer_a_scheduler_and_a_float16_scaler(states: str,
                                                                               eager_torchao: None) -> None:
    """A frozen first layer (no gradient: no state), LambdaLR over torchao's tensor learning rate, and float16 at
    O2 with ampkit's dynamic scaler (an overflow skips the step): the moments exist for what trains only, the rate
    follows the schedule, the skipped step changes nothing."""
    model, optimizer = _model()
    model[0].requires_grad_(False)
    model, optimizer = ampkit.initialize(model, optimizer, "O2", torch.float16, compute="native", states=states)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    scaler = ampkit.DynamicLossScaler(init_scale=2.0**16)
    for step in range(3):
        loss = model(torch.randn(8, 64)).float().pow(2).mean()
        scaler.scale(loss * (1e30 if step == 1 else 1.0)).backward()  # step 1 overflows
        weights = _weights(model)
        stepped = scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step == 1:
            assert not stepped and _same(weights, _weights(model))
        elif stepped:
            scheduler.step()
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.25)
    masters = optimizer.master_params
    assert masters[0] not in optimizer.state and masters[2] in optimizer.state


def test_torch_amp_grad_scaler_unscales_into_torchao_s_optimizer(eager_torchao: None) -> None:
    model, optimizer = _with_states("8bit", "O1")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    reference, reference_optimizer = _with_states("8bit", "O1")
    x = torch.randn(8, 64)
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaler.step(optimizer)
    reference(x).float().pow(2).mean().backward()
    reference_optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("states, message", [
    ("8BIT", r"Unknown states '8BIT'. Choose one of"), (8, r"Unknown states 8. Choose one of"),
    ("", r"Unknown states ''. Choose one of"),
])
def test_a_malformed_states_value_is_refused_by_initialize_and_the_estimate(states: object, message: str) -> None:
    model, optimizer = _model()
    with pytest.raises(ValueError, match=message):
        ampkit.initialize(model, optimizer, "O2", states=states)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        ampkit.estimate_memory(model, torch.randn(2, 64), "O2", states=states)  # type: ignore[arg-type]
    assert model[0].weight.dtype == torch.float32 and getattr(model, "_ampkit_opt_level", None) is None


def test_states_on_a_gpt_with_a_tied_head_keep_one_moment_per_weight(eager_torchao: None) -> None:
    from ampkit.experiment.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=256, context=16, d_model=64, n_layers=1, n_heads=2)
    tokens = torch.randint(0, 256, (2, 16))
    estimate = ampkit.estimate_memory(model, tokens, "O2", states="8bit").mixed
    model, optimizer = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), "O2", torch.bfloat16,
                                         compute="native", states="8bit")
    model(tokens).float().pow(2).mean().backward()
    optimizer.step()
    assert len(optimizer.state) == len(list(model.parameters()))  # the tied weight once
    counted = estimate.weights + estimate.gradients + estimate.master_weights + estimate.optimizer_states
    assert counted <= ampkit.measured_state_bytes(model, optimizer) <= counted + 4 * len(optimizer.state)


def test_low_bit_moments_at_o3_with_float32_gradients_step_the_rounded_sum(eager_torchao: None) -> None:
    """O3's float32 gradients are rounded to bfloat16 for the step and come back after it, also for torchao's
    optimizer."""
    model, optimizer = _model()
    model, optimizer = ampkit.initialize(model, optimizer, "O3", torch.bfloat16, compute="native", states="8bit",
                                         grad_dtype="fp32")
    model(torch.randn(8, 64)).float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    assert all(p.grad.dtype == torch.float32 and torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


# -- Precision plans ------------------------------------------------------------------------------------------

def _plan(tmp: Path) -> Path:
    """A plan for ``_model()``'s first linear in mxfp8, as ``ampkit tune`` writes it (made by hand: tuning takes
    seconds)."""
    from ampkit.planning.precision_plan import LayerChoice, PrecisionPlan, fingerprint

    model, _ = _model()
    layers = (LayerChoice("0", (64, 128), "mxfp8", "hand-made"), LayerChoice("2", (128, 64), "bf16", "hand-made"))
    plan = PrecisionPlan(model="Sequential", fingerprint=fingerprint(model), base="bf16", objective="time",
                         tolerance=0.01, layers=layers, predicted_loss_change=0.0, measured_loss_change=0.0,
                         backed_off=(), predicted_saving=0.0, emulated=True, tune_s=0.0)
    data = plan.to_dict()
    path = tmp / "plan.json"
    path.write_text(json.dumps(data))
    return path


def _edited(tmp: Path, edit: Callable[[dict], object]) -> Path:
    path = _plan(tmp)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


PLAN_CASES = {
    "a plan file that does not exist": (lambda tmp: tmp / "none.json", r"Cannot read the precision plan"),
    "a plan that is not JSON": (lambda tmp: _written(tmp, "{not json"), r"Cannot read the precision plan"),
    "a plan of another version": (lambda tmp: _edited(tmp, lambda d: d.update(version=99)),
                                  r"is not a version-\d+ precision plan \(version 99\)"),
    "a plan whose layers are not a list": (lambda tmp: _edited(tmp, lambda d: d.update(layers=7)), r"is damaged"),
    "a plan whose layer lacks its format": (lambda tmp: _edited(tmp, lambda d: d["layers"][0].pop("format")),
                                            r"is damaged"),
    "a plan naming a format ampkit lacks": (lambda tmp: _edited(tmp, lambda d: d["layers"][0].update(format="fp2")),
                                            r"0's format 'fp2' is none a linear is lowered to"),  # at load now
    "a plan naming a layer the model lacks": (lambda tmp: _edited(tmp, lambda d: d["layers"][0].update(name="9")),
                                              r"names 9, which Sequential does not have"),
    "a plan of another model": (lambda tmp: _edited(tmp, lambda d: d.update(fingerprint="0" * 16)),
                                r"made for another model"),
}


def _written(tmp: Path, text: str) -> Path:
    (tmp / "plan.json").write_text(text)
    return tmp / "plan.json"


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_a_bad_plan_is_refused_and_the_model_is_unchanged(case: str, tmp_path: Path) -> None:
    make, match = PLAN_CASES[case]
    model, _ = _model()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=match):
        ampkit.PrecisionPlan.load(make(tmp_path)).apply(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]
    assert _same(_weights(model), _weights(before))


def test_a_plan_applied_twice_is_refused_the_second_time(tmp_path: Path) -> None:
    plan = ampkit.PrecisionPlan.load(_plan(tmp_path))
    model, _ = _model()
    plan.apply(model)
    kinds = [type(m).__name__ for m in model.modules()]
    with pytest.raises(ValueError, match=r"BlockScaledLinear"):
        plan.apply(model)
    assert [type(m).__name__ for m in model.modules()] == kinds


def test_compare_refuses_a_plan_for_another_model_before_any_run(tmp_path: Path) -> None:
    from ampkit.experiment import settings

    with pytest.raises(ValueError, match=r"plan.json' was made for another model \(Sequential\); model='mlp' has "
                                         r"other linears: make a plan for it with `ampkit tune --model mlp`"):
        settings.plan(model="mlp", precision_plan=str(_plan(tmp_path)), steps=2)


# -- Recompute budgets and block-scaled numerics --------------------------------------------------------------

@pytest.mark.parametrize("budget, match", [
    ("0", r"is invalid"), (-1, r"is invalid"), ("abc", r"is unreadable"), (1.5, r"above 1|fraction"),
    (True, r"is invalid"), (float("nan"), r"is invalid"), ("64XB", r"is unreadable"),
])
def test_a_bad_recompute_budget_is_refused_before_anything_runs(budget: object, match: str) -> None:
    model, _ = _model()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match=match):
        ampkit.plan_recompute(model, torch.randn(4, 64), budget)  # type: ignore[arg-type]
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]


@pytest.mark.parametrize("format", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("values", ["huge", "tiny", "zeros", "mixed"])
def test_block_scaled_values_stay_finite_for_any_finite_input(format: str, values: str) -> None:
    x = {"huge": torch.full((4, 32), 3e38), "tiny": torch.full((4, 32), 1e-40), "zeros": torch.zeros(4, 32),
         "mixed": torch.tensor([3e38, 1e-40, 0.0, -1.0] * 32).reshape(4, 32)}[values]
    y = ampkit.fake_quantize(x, format)
    assert torch.isfinite(y).all()
    if values == "zeros":
        assert torch.equal(y, x)
    assert (y.abs() <= x.abs().amax(dim=-1, keepdim=True) * 1.5 + 1e-30).all()  # no value blown up


@pytest.mark.parametrize("format", ["mxfp8", "nvfp4"])
def test_a_non_finite_input_stays_visible_through_block_scaled_formats(format: str) -> None:
    """inf and NaN are not quantized into finite numbers that hide them: the block carries a non-finite value."""
    x = torch.ones(2, 32)
    x[0, 3], x[1, 5] = math.inf, math.nan
    y = ampkit.fake_quantize(x, format)
    assert not torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).all()


# -- FSDP2 on one rank, tune, and compositions ----------------------------------------------------------------

@pytest.mark.parametrize("options, match", [
    (dict(opt_level="O5"), r"Unknown opt_level: 'O5'"),
    (dict(opt_level="O2", dtype="fp8"), r"fp8"),
    (dict(opt_level="O2", reduce_dtype="int8"), r"reduce_dtype"),
    (dict(opt_level="O1", keep_float32=[nn.Embedding]), r"keep_float32= applies at O2 only"),
])
def test_fully_shard_refuses_bad_settings_before_any_change(options: dict, match: str, one_rank: None) -> None:
    from ampkit.distributed import fully_shard

    model, _ = _model()
    before = _weights(model)
    with pytest.raises(ValueError, match=match):
        fully_shard(model, **options)
    assert _same(before, _weights(model)) and all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())


@pytest.mark.parametrize("level, update, states, match", [
    ("O1", "plain", "int8", r"Unknown states 'int8'"),
    ("O3", "kahan", "8bit", r"states='8bit' with update='kahan'"),
    ("O3", "plain", "fp32", r"states='fp32' at O3 with update='plain'"),
    ("O1", "stochastic", None, r"update='stochastic' applies at O3 only"),
])
def test_prepare_optimizer_refuses_a_format_the_shards_cannot_keep(level: str, update: str, states: str | None,
                                                                   match: str, one_rank: None) -> None:
    from ampkit.distributed import fully_shard, prepare_optimizer

    model = fully_shard(_model()[0], opt_level=level, dtype=torch.bfloat16, compute="native")
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=match):
        prepare_optimizer(model, optimizer, update=update, states=states)
    assert not optimizer.state and type(optimizer) is torch.optim.AdamW


def test_sharded_8bit_moments_save_and_resume_on_one_rank(tmp_path: Path, one_rank: None,
                                                           eager_torchao: None) -> None:
    from ampkit.distributed import fully_shard, prepare_optimizer

    def setup(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = fully_shard(_model(seed)[0], opt_level="O2", dtype=torch.bfloat16, compute="native")
        return model, prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), states="8bit")

    model, optimizer = setup(0)
    _step(model, optimizer, 0)
    save_sharded_checkpoint(tmp_path / "run", model, optimizer)
    _step(model, optimizer, 1)
    resumed, resumed_optimizer = setup(1)
    load_sharded_checkpoint(tmp_path / "run", resumed, resumed_optimizer)
    _step(resumed, resumed_optimizer, 1)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


@pytest.mark.parametrize("options, error, match", [
    (dict(batches=[]), ValueError, r"batches"),
    (dict(formats=("fp2", "bf16")), ValueError, r"fp2"),
    (dict(tolerance=-1.0), ValueError, r"tolerance"),
    (dict(objective="speed"), ValueError, r"objective"),
])
def test_tune_refuses_bad_arguments_before_measuring(options: dict, error: type, match: str) -> None:
    model, _ = _model()
    batches = [(torch.randn(4, 64), torch.randint(0, 64, (4,))) for _ in range(4)]
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(error, match=match):
        ampkit.tune(model, **{"batches": batches, **options})
    assert [type(m) for m in model.modules()] == kinds


def test_compare_refuses_an_unknown_compile_mode_and_states_with_fp32_alone() -> None:
    from ampkit.experiment import settings

    with pytest.raises(ValueError, match=r"Unknown compile mode 'sometimes'"):
        settings.plan(model="mlp", compile="sometimes", steps=2)
    with pytest.raises(ValueError, match=r"ignores .*states=\['bf16'\]"):
        settings.plan(model="mlp", precisions=["fp32"], states=["bf16"], steps=2)


@pytest.mark.slow  # an inductor compile of the model
def test_a_compiled_o2_model_with_8bit_moments_trains_as_the_eager_one(eager_torchao: None) -> None:
    """torch.compile of the model composes with torchao's moments (the optimizer steps outside the graph)."""
    eager, eager_optimizer = _with_states("8bit", "O2")
    model, optimizer = _with_states("8bit", "O2")
    compiled = torch.compile(model)
    with torch.compiler.set_stance("default"):
        for step in range(2):
            _step(compiled, optimizer, step)
    for step in range(2):
        _step(eager, eager_optimizer, step)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


# -- Issue 65: what a sweep by other hands still found --------------------------------------------------------

@pytest.mark.parametrize("level, options", [
    ("O3", {"reshard_after_forward": 2}),  # the sweep's two cases: the shards were DTensors after the refusal
    ("O2", {"keep_float32": [nn.LayerNorm], "reshard_after_forward": 3}),
    ("O1", {"reshard_after_forward": 2}),  # and two more of the same kind
    ("O2", {"blocks": [nn.Linear], "reshard_after_forward": 4}),
])
def test_a_reshard_size_torch_refuses_part_way_is_refused_first_and_the_model_is_unchanged(
        level: str, options: dict, one_rank: None) -> None:
    from ampkit.distributed import fully_shard

    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    before = {n: (type(p), p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"reshard_after_forward=\d is no group size to reshard to: a factor of the 1 "
                                         r"shards, one of \[1\]"):
        fully_shard(model, opt_level=level, dtype=torch.bfloat16, **options)
    assert {n: (type(p), p.dtype) for n, p in model.named_parameters()} == {n: b[:2] for n, b in before.items()}
    assert all(torch.equal(p, before[n][2]) for n, p in model.named_parameters())
    assert getattr(model, "_ampkit_opt_level", None) is None


@pytest.mark.parametrize("point", SHARDED_POINTS)
def test_the_save_after_one_killed_at_any_step_publishes_and_leaves_nothing_hidden(point: str, tmp_path: Path) -> None:
    """Killed between its renames, a save left the previous checkpoint as a hidden sibling (and the new one beside
    it); the next save wrote its own and kept both for good. Now it puts the newest back first, then supersedes it:
    one folder, the latest save's."""
    path = tmp_path / "run"
    torch.manual_seed(1)
    save_sharded_checkpoint(path, nn.Linear(8, 8), extra={"step": 1})
    done = subprocess.run([sys.executable, "-c", _KILLER, "sharded", point, str(path)],
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -9, (done.returncode, done.stderr[-2000:])
    torch.manual_seed(3)
    latest = nn.Linear(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        save_sharded_checkpoint(path, latest, extra={"step": 3})
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
    loaded = nn.Linear(8, 8)
    assert load_sharded_checkpoint(path, loaded) == {"step": 3} and _same(_weights(loaded), _weights(latest))


def test_a_sharded_checkpoints_extra_comes_back_as_save_checkpoints_does(tmp_path: Path) -> None:
    """A tensor failed the save (JSON); tuples came back as lists and int keys as strings, silently."""
    extra = {"best": torch.tensor([0.5, 0.25]), "shape": (2, 3), 7: "seven", "nested": {"pair": (1, "a")},
             "step": 10, "none": None}
    model = nn.Linear(4, 4)
    save_sharded_checkpoint(tmp_path / "run", model, extra=extra)
    ampkit.save_checkpoint(tmp_path / "last.pt", model=model, extra=extra)
    for back in (load_sharded_checkpoint(tmp_path / "run", model), ampkit.load_checkpoint(tmp_path / "last.pt",
                                                                                          model=model)):
        assert back.keys() == extra.keys() and torch.equal(back["best"], extra["best"])
        assert {k: v for k, v in back.items() if k != "best"} == {k: v for k, v in extra.items() if k != "best"}
        assert type(back["shape"]) is tuple and type(back["nested"]["pair"]) is tuple


def test_an_extra_value_that_would_not_load_back_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    save_sharded_checkpoint(tmp_path / "run", model, extra={"step": 1})
    listing = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for bad in ({"fn": lambda: 1}, {"model": model}):
        with pytest.raises(ValueError, match=r"extra\['(fn|model)'\]"):
            save_sharded_checkpoint(tmp_path / "run", model, extra=bad)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == listing
    assert load_sharded_checkpoint(tmp_path / "run", model) == {"step": 1}


def _plan_file(tmp_path: Path, edit: Callable[[dict], None]) -> Path:
    model, _ = _model()
    batches = [(torch.randn(4, 64), torch.randint(0, 64, (4,))) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ampkit.tune(model, batches, formats=("fp8", "bf16"), include=["0", "2"])
    data = plan.to_dict()
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["layers"].append(dict(d["layers"][0], format="fp8")), r"0 is listed twice: a plan gives each linear "
                                                                       r"one format"),  # the first was ignored
    (lambda d: d.__setitem__("base", "fp32"), r"base 'fp32' is not a 16-bit format"),  # ran mislabelled settings
    (lambda d: d["layers"][0].__setitem__("format", "int4"), r"0's format 'int4' is none a linear is lowered to: "
                                                             r"choose one of \['fp8'"),  # was about mixed dtypes
    (lambda d: d.__setitem__("objective", "speed"), r"objective 'speed' is not 'time' or 'memory'"),
    (lambda d: d["layers"][1].__setitem__("format", "FP8"), r"2's format 'FP8' is none a linear is lowered to"),
])
def test_a_plan_edited_by_hand_is_refused_at_load_naming_the_entry(edit: Callable[[dict], None], match: str,
                                                                   tmp_path: Path) -> None:
    path = _plan_file(tmp_path, edit)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=match):
        ampkit.PrecisionPlan.load(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("target", ["1", ""])
def test_a_plan_lowering_what_is_no_linear_says_only_linears_are_lowered(target: str, tmp_path: Path) -> None:
    """A ReLU was "a ReLU already", as if converted; the model itself (name '') the same."""
    def edit(data: dict) -> None:
        data["layers"][0] = dict(data["layers"][0], name=target, format="fp8")

    model, _ = _model()
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=r"a plan lowers linears only \(nn.Linear, transformers' Conv1D\)"):
        ampkit.PrecisionPlan.load(_plan_file(tmp_path, edit)).apply(model)
    assert [type(m) for m in model.modules()] == kinds


@pytest.mark.parametrize("levels", [["O2"], ["O3"], ["O2", "O3"]])
def test_compare_refuses_a_plan_with_opt_levels_that_leave_out_the_tuned_runs_o1(levels: list[str],
                                                                                  tmp_path: Path) -> None:
    """compare --opt-level O2 --plan p.json ran the tuned setting at O1 without a word."""
    from ampkit.experiment import settings

    path = tmp_path / "plan.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = [(torch.randn(8, 64), torch.randint(0, 10, (8,))) for _ in range(4)]
        from ampkit.experiment.models import build
        ampkit.tune(build("mlp", in_features=64, num_classes=10), batches).save(path)
    with pytest.raises(ValueError, match=r"the tuned run trains at O1, as tune measured it. Add 'O1' to the opt levels"):
        settings.plan(model="mlp", precisions=["bf16"], opt_levels=levels, precision_plan=str(path), steps=2)


@pytest.mark.parametrize("options, match", [
    ({"formats": None}, r"formats=None: None is not a format"),  # TypeError inside tune.py
    ({"formats": 8}, r"formats=8: 8 is not a format"),
    ({"batches": [(torch.randn(0, 64), torch.randint(0, 64, (0,)))] * 3}, r"batches \[0, 1, 2\] hold no samples"),
    ({"batches": [(torch.randn(4, 64), torch.randint(0, 64, (4,))), (torch.randn(0, 64), torch.randint(0, 64, (0,))),
                  (torch.randn(4, 64), torch.randint(0, 64, (4,)))]}, r"batches \[1\] hold no samples"),
])
def test_tune_refuses_what_it_raised_on_inside(options: dict, match: str) -> None:
    model, _ = _model()
    batches = [(torch.randn(4, 64), torch.randint(0, 64, (4,))) for _ in range(4)]
    with pytest.raises(ValueError, match=match):  # an amax RuntimeError from torch for empty batches
        ampkit.tune(model, **{"batches": batches, **options})


def test_tune_reads_a_generator_of_batches_once_and_measures_on_all_of_them() -> None:
    model, _ = _model()
    batches = [(torch.randn(4, 64), torch.randint(0, 64, (4,))) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # objective="memory": the choice rests on bytes, not on timings that differ run to run
        from_list = ampkit.tune(copy.deepcopy(model), batches, include=["0", "2"], objective="memory")
        from_generator = ampkit.tune(copy.deepcopy(model), (b for b in batches), include=["0", "2"],
                                     objective="memory")
    strip = lambda plan: [(layer.name, layer.format, layer.loss_change) for layer in plan.layers]  # noqa: E731
    assert strip(from_generator) == strip(from_list)


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_converting_ampkits_own_pure16_optimizer_again_says_it_is_ampkits(update: str, one_rank: None) -> None:
    """prepare_optimizer(update='kahan') on its own result said "needs SGD or AdamW, got SGD"."""
    from ampkit.distributed import fully_shard, prepare_optimizer

    model = fully_shard(nn.Sequential(nn.Linear(8, 8)), opt_level="O3", dtype=torch.bfloat16)
    optimizer = prepare_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), update=update)
    with pytest.raises(ValueError, match=rf"update='{update}': the optimizer is already a pure 16-bit one \("):
        prepare_optimizer(model, optimizer, update=update)
    plain = nn.Linear(8, 8)
    _, converted = ampkit.initialize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), "O3", torch.bfloat16,
                                     update=update)
    with pytest.raises(ValueError, match=r"is already a pure 16-bit one"):
        ampkit.optim.pure16.pure16_optimizer(converted, update)


@pytest.mark.parametrize("format", ["mxfp4", pytest.param("mxfp8", marks=pytest.mark.slow),
                                    pytest.param("nvfp4", marks=pytest.mark.slow)])  # about 15 s each
def test_block_scaled_linears_compile_with_dynamic_shapes_as_they_run_eagerly(format: str) -> None:
    """torch.compile(dynamic=True) of a model with two block-scaled linears or more failed dynamo's assertion
    "lift_tracked_freevar_to_input should not be called on root SubgraphTracer": a float constant read inside one
    layer's autograd.Function was reused by the next one's (block_scaled.element_type)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):  # the first and last stay high precision: two block-scaled linears between them
        layers += [nn.Linear(64, 64), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    ampkit.convert_to_block_scaled(model, ampkit.BlockScaledRecipe(format))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, dynamic=True, backend="aot_eager")
    with torch.compiler.set_stance("default"):
        for batch in (8, 12, 5):  # a batch size the first graph did not see: one graph for them all
            x = torch.randn(batch, 64)
            out, expected = compiled(x), eager(x)  # one training forward each: NVFP4's draws count them
            out.sum().backward()
            expected.sum().backward()
            assert torch.equal(out, expected)
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad)
