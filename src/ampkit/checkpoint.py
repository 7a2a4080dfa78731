"""Checkpoints that carry everything mixed precision training changes: written atomically, read all or nothing.

A training checkpoint needs the loss scaler and the float32 master weights as well as the model
and the optimizer (nanoGPT's forgets the scaler; a resumed fp16 run then restarts at scale 2**16
and skips its first steps). ``save_checkpoint`` stores each object's ``state_dict()`` under its
name in one file; ``load_checkpoint`` names the file and the problem when the file is missing,
empty, truncated or not ampkit's, and restores every object or none.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch

from ampkit.files import atomic_write
from ampkit.optim.states import check_same_format, snapshot, states_format
from ampkit.shards import is_sharded, local_shard

CHECKPOINT_VERSION = 1


class _Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


def _walk(value: Any, where: str, check: Any) -> None:
    """``check(leaf, where)`` on every leaf of nested lists, tuples and dicts, ``where`` naming its place."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk(item, f"{where}[{i}]", check)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{where}[{key!r}]", check)
    else:
        check(value, where)


def _plain_leaf(value: Any, where: str) -> None:
    if not isinstance(value, _PLAIN) or type(value).__module__ == "numpy":
        raise ValueError(f"{where} is a {type(value).__module__}.{type(value).__name__} ({value!r}): a checkpoint "
                         "keeps plain values (bool, int, float, str, None, tensors, and lists or dicts of them), "
                         "which load safely. Convert it first, e.g. float(value) or str(path).")


def _unsharded_leaf(value: Any, where: str) -> None:
    if is_sharded(value):
        raise ValueError(f"{where} is a DTensor (an FSDP2 shard): a file from one process would keep only this "
                         "rank's part. Save sharded models with ampkit.distributed.save_sharded_checkpoint "
                         "(every rank writes its shards; it loads on any world size).")


def check_plain(value: Any, where: str) -> None:
    """Refuse what torch.load(weights_only=True) would refuse to read back (numpy scalars, paths, objects)."""
    _walk(value, where, _plain_leaf)


def nonfinite_places(objects: dict[str, Any], states: dict[str, Any]) -> list[str]:
    """Where the states about to be saved hold an inf or a NaN: every floating tensor (a torchao low-bit state's
    inner tensors too; an FSDP2 DTensor's local shard) and every float of each object's state, but a module's
    buffers (an attention mask's -inf is its value). An optimizer's states and masters are named by their
    parameter's name where a module among ``objects`` has it: ``optimizer: exp_avg_sq of 2.weight``."""
    from torch import nn

    names = {id(p): n for obj in objects.values() if isinstance(obj, nn.Module) for n, p in obj.named_parameters()}
    found: list[str] = []
    for name, obj in objects.items():
        state = states[name]
        if isinstance(obj, nn.Module):
            buffers = {n for n, _ in obj.named_buffers()}
            _find_nonfinite({k: v for k, v in state.items() if k not in buffers}, name, found)
        elif isinstance(obj, torch.optim.Optimizer) and isinstance(state, dict):
            # a MasterWeightOptimizer's inner state and masters follow its model's parameters, in order
            params = getattr(obj, "model_params", None) or [p for g in obj.param_groups for p in g["params"]]
            label = {i: names.get(id(p), f"parameter {i}") for i, p in enumerate(params)}
            inner = state.get("optimizer", state) if "master_params" in state else state
            for index, moments in (inner.get("state") or {}).items():
                for key, value in moments.items():
                    _find_nonfinite(value, f"{name}: {key} of {label.get(index, index)}", found)
            for index, master in enumerate(state.get("master_params", [])):
                _find_nonfinite(master, f"{name}: the float32 master of {label.get(index, index)}", found)
        else:
            _find_nonfinite(state, name, found)
    return found


def _find_nonfinite(value: Any, where: str, found: list[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _find_nonfinite(item, f"{where}[{key!r}]", found)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _find_nonfinite(item, f"{where}[{i}]", found)
    elif isinstance(value, float) and not math.isfinite(value):
        found.append(where)
    elif isinstance(value, torch.Tensor):
        local = local_shard(value)
        if hasattr(local, "__tensor_flatten__") and type(local) is not torch.Tensor:  # torchao: codes and scales
            for inner in local.__tensor_flatten__()[0]:
                _find_nonfinite(getattr(local, inner), where, found)
        elif local.is_floating_point() and local.numel():
            wide = local.float() if local.element_size() == 1 else local  # FP8 codes: torch has no isfinite for them
            if not bool(torch.isfinite(wide).all()):
                found.append(where)


def save_checkpoint(path: str | Path, extra: dict[str, Any] | None = None, allow_nonfinite: bool = False,
                    **objects: _Stateful) -> None:
    """Save each object's ``state_dict()`` under its keyword name, atomically.

    The file is written beside ``path`` and renamed into place, so a crash or a full disk
    leaves the previous checkpoint as it was, never a half-written one.

    Args:
        path: the checkpoint file (its folder is created).
        extra: plain values to keep alongside (epoch, step, a metric); returned by ``load_checkpoint``.
        allow_nonfinite: save a state holding an inf or a NaN (default False: refused, see Raises).
        **objects: anything with ``state_dict()``: modules, optimizers, LR schedulers, loss scalers,
            ``MasterWeightOptimizer``.

    Raises:
        ValueError: no objects were given, or an ``extra`` value that would not load back (a numpy
            scalar, a Path: named, with the conversion to make); an FSDP2 model's DTensor state (use
            ``ampkit.distributed.save_sharded_checkpoint``); a weight, a master, an optimizer state or a
            scaler's figure that is inf or NaN (``nonfinite_places`` names them; a run resumed from such a
            checkpoint is lost): nothing is written, the previous checkpoint stays.
        TypeError: an object has no ``state_dict()`` (it is named).

    Examples:
        >>> ampkit.save_checkpoint("run/last.pt", model=model, optimizer=optimizer, scaler=scaler,
        ...                        extra={"epoch": epoch})
    """
    if not objects:
        raise ValueError("save_checkpoint needs at least one object to save: pass them by name, e.g. "
                         "save_checkpoint(path, model=model, optimizer=optimizer, scaler=scaler).")
    for name, obj in objects.items():
        if not callable(getattr(obj, "state_dict", None)):
            raise TypeError(f"{name}={type(obj).__name__} has no state_dict(): pass modules, optimizers, schedulers "
                            "and loss scalers by name, and plain values in extra={...}.")
    for key, value in (extra or {}).items():
        check_plain(value, f"extra[{key!r}]")
    states = {name: obj.state_dict() for name, obj in objects.items()}
    _walk(states, "states", _unsharded_leaf)  # FSDP2 shards: one process's file would keep one rank's part
    refuse_nonfinite(objects, states, str(path), allow_nonfinite)
    state = {
        "ampkit_checkpoint": CHECKPOINT_VERSION,
        "states": states,
        "extra": dict(extra or {}),
        # each optimizer's format of AdamW's moments (ampkit.optim.states): another format's cannot be loaded
        "formats": {name: states_format(obj) for name, obj in objects.items() if isinstance(obj, torch.optim.Optimizer)},
    }
    atomic_write(Path(path), lambda tmp: torch.save(state, tmp))


def refuse_nonfinite(objects: dict[str, Any], states: dict[str, Any], path: str, allow: bool,
                     elsewhere: bool = False) -> None:
    """Raise ValueError naming where ``states`` hold an inf or a NaN (``nonfinite_places``), unless ``allow``;
    ``elsewhere``: another rank found some (every rank refuses together)."""
    if allow:
        return
    found = nonfinite_places(objects, states)
    if found or elsewhere:
        where = f"{', '.join(found[:4])}{' ...' if len(found) > 4 else ''}" if found else "on another rank"
        raise ValueError(f"Not saving {path}: the state holds an inf or a NaN ({where}); a run resumed from it would "
                         "be lost. The previous checkpoint is as it was. Find the first non-finite value with "
                         "ampkit.find_nonfinite, or pass allow_nonfinite=True to save it anyway (to debug).")


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint's contents: ``{"ampkit_checkpoint": version, "states": {...}, "extra": {...}, "formats":
    {...}}`` (``formats``: each optimizer's format of AdamW's moments; files from before it do not have it).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        RuntimeError: the file is empty, truncated, not a torch file, or not an ampkit checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {path} does not exist{' (it is a folder)' if path.is_dir() else ''}: "
                                "pass the file save_checkpoint wrote.")
    size = path.stat().st_size
    if size == 0:
        raise RuntimeError(f"Checkpoint {path} is empty (0 bytes): it was not written completely. "
                           "Resume from an earlier checkpoint.")
    try:
        # weights_only: a checkpoint holds tensors and plain values; never run code from a file
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError... by file damage
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(f"Checkpoint {path} ({size} bytes) cannot be read: {reason}. The file is truncated or "
                           "not a torch checkpoint; resume from an earlier one.") from error
    if not isinstance(state, dict) or "ampkit_checkpoint" not in state:
        found = f"keys {sorted(map(str, state))[:8]}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise RuntimeError(f"Checkpoint {path} is not an ampkit checkpoint ({found}): write it with "
                           "ampkit.save_checkpoint, or load a plain state dict with torch.load and load_state_dict.")
    if state["ampkit_checkpoint"] != CHECKPOINT_VERSION:
        raise RuntimeError(f"Checkpoint {path} has version {state['ampkit_checkpoint']!r}; this ampkit reads "
                           f"version {CHECKPOINT_VERSION}.")
    return state


def load_checkpoint(path: str | Path, **objects: _Stateful) -> dict[str, Any]:
    """Restore each object from the state saved under its keyword name; all or nothing.

    If any object refuses its state (a scaler state from another version, a model of another
    shape), the objects already restored are put back as they were before the call, and the
    error is raised: a failed resume never leaves a half-loaded model and optimizer.

    Args:
        path: a file written by ``save_checkpoint``.
        **objects: the objects to restore, by the names they were saved under (a subset is fine).

    Returns:
        The ``extra`` values saved with the checkpoint.

    Raises:
        FileNotFoundError, RuntimeError: see ``read_checkpoint``; RuntimeError also when a name is
            not in the checkpoint (the saved names are listed).

    Note:
        To put objects back on failure, their current states are copied first: for the duration of
        the call the model and optimizer need twice their memory.
    """
    state = read_checkpoint(path)
    saved = state["states"]
    missing = sorted(set(objects) - set(saved))
    if missing:
        raise RuntimeError(f"Checkpoint {path} has no state for {missing}; it holds {sorted(saved)}. "
                           "Pass the objects by the names they were saved under.")
    for name, obj in objects.items():
        if name in state.get("formats", {}) and isinstance(obj, torch.optim.Optimizer):  # older files do not say
            check_same_format(state["formats"][name], obj, f"Checkpoint {path}: {name!r}")
        if (isinstance(obj, torch.optim.Optimizer) and not hasattr(obj, "master_params")
                and isinstance(saved[name], dict) and "master_params" in saved[name]):
            # An O2 run's optimizer resumed by a float32 one: its inner optimizer's state, kept over the masters in
            # the model's order (the masters' values are the O2 model's state dict's, which the model loads).
            saved = {**saved, name: saved[name]["optimizer"]}
    # an object whose state changes the model's layers (ampkit.Guard's raises) first: the model's state is theirs
    objects = dict(sorted(objects.items(), key=lambda item: not getattr(item[1], "restores_structure", False)))
    before = {name: snapshot(obj.state_dict()) for name, obj in objects.items()}  # torchao's states have no deepcopy
    restored: list[str] = []
    try:
        for name, obj in objects.items():
            restored.append(name)  # before the call: a load that fails halfway has changed its object too
            obj.load_state_dict(saved[name])
    except BaseException as error:
        for name in restored:
            objects[name].load_state_dict(before[name])
        if isinstance(error, Exception):
            raise RuntimeError(f"Checkpoint {path}: loading {restored[-1]!r} failed, nothing was changed: "
                               f"{error}") from error
        raise
    return dict(state["extra"])
