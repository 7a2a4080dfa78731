"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank writes its shards.

``ampkit.save_checkpoint`` writes one file from one process; an FSDP2 model's state is DTensor shards
spread over the ranks, which DCP saves in parallel and can load into another world size (resharding:
a 2-rank checkpoint loads into 1 process, or into 4). The model's and optimizer's states come from
``torch.distributed.checkpoint.state_dict.get_state_dict`` (keys by parameter name, so they do not
depend on how the model is sharded); loss scalers, schedulers, FP8 amax histories (module buffers
and extra state) and counters travel with them. Written into a folder beside the target and renamed
into place, as ``save_checkpoint`` does for files. The folder also holds a SHA-256 of each file DCP wrote and
the model's key set (``ampkit.json``): a damaged file, or a checkpoint of another model, is refused at load with
its name, where DCP would load it silently. Every failure inside DCP (its ``CheckpointException`` is a
``BaseException``, which ``except Exception`` misses) comes out as one ``RuntimeError`` naming the folder.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampkit import _trees
from ampkit.checkpoint import check_plain, nonfinite_places, refuse_nonfinite
from ampkit.optim.states import check_same_format, dequantized, is_quantized, states_format
from ampkit.shards import local_shard

SHARDED_VERSION = 1
_SHARD = re.compile(r"__\d+_\d+\.distcp")  # a DCP shard file: rank, then file number
_META = "ampkit_sharded_checkpoint"
_SUMS = "ampkit.json"  # beside DCP's files: each file's SHA-256 and the model's keys


def _rank0_decides(value: Any) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # torchao's low-bit moments travel as float32 values (DCP cannot copy them); a load quantizes them again
    optimizer_state = _trees.map_tensors(lambda t: dequantized(t) if is_quantized(t) else t,
                                           optimizer_state)
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            extra: dict[str, Any] | None = None, allow_nonfinite: bool = False,
                            **objects: Any) -> None:
    """Save a (sharded) model, its optimizer and any other objects with DCP; every rank calls it.

    The folder is written beside ``path`` and renamed into place once every rank has written: a
    crash leaves the previous checkpoint (if any) as it was, never a half-written one.

    Args:
        path: the checkpoint folder.
        model: an FSDP2 model (``ampkit.distributed.fully_shard``), or a plain one.
        optimizer: its optimizer (optional).
        extra: plain values (epoch, step) returned by ``load_sharded_checkpoint``.
        allow_nonfinite: save a state holding an inf or a NaN (default False: every rank refuses, see Raises).
        **objects: anything with ``state_dict()`` holding the same values on every rank: loss scalers,
            LR schedulers.

    Raises:
        ValueError: an ``extra`` value that would not load back; ``path`` is a file; a weight, an optimizer state
            or an object's figure that is inf or NaN on any rank (named where it is; nothing is written).
        TypeError: an object has no ``state_dict()``.

    Example:
        >>> save_sharded_checkpoint("run/step-100", model, optimizer, scaler=scaler, extra={"step": 100})
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if path.is_file():
        raise ValueError(f"{path} is a file; a sharded checkpoint is a folder: pass a folder path (ampkit's "
                         "save_checkpoint writes single files).")
    if foreign := _not_ours(path):  # replaced, the folder's own files went with it
        raise ValueError(f"{path} holds files a sharded checkpoint does not ({', '.join(foreign[:3])}"
                         f"{' ...' if len(foreign) > 3 else ''}): saving would replace the folder and lose them. "
                         "Pass a new folder (run/step-100), or move those files out first.")
    for name, obj in objects.items():
        if not callable(getattr(obj, "state_dict", None)):
            raise TypeError(f"{name}={type(obj).__name__} has no state_dict(): pass loss scalers and schedulers by "
                            "name, and plain values in extra={...}.")
    for key, value in (extra or {}).items():
        check_plain(value, f"extra[{key!r}]")
    if not allow_nonfinite:  # every rank decides together: one refusing alone would leave the others in DCP
        everything = {"model": model, **({"optimizer": optimizer} if optimizer is not None else {}), **objects}
        local = {name: obj.state_dict() for name, obj in everything.items()}
        found = torch.tensor([float(bool(nonfinite_places(everything, local)))])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        refuse_nonfinite(everything, local, str(path), False, elsewhere=bool(found.item()))
    state = _states(model, optimizer)
    # an object whose state changes the model's layers (ampkit.Guard's raises) travels whole, read before the model
    state["objects"] = {name: _packed(obj.state_dict()) if getattr(obj, "restores_structure", False)
                        else obj.state_dict() for name, obj in objects.items()}
    state["quantized"] = _quantized_parts(optimizer)
    # One value each, not flattened by DCP: the names and the extra values are read back whole.
    state[_META] = json.dumps({"version": SHARDED_VERSION, "objects": sorted(objects),
                               "optimizer": optimizer is not None, "world_size": _world_size(),
                               "states": states_format(optimizer) if optimizer is not None else None})
    state["extra"] = _packed(dict(extra or {}))
    _recover(path)  # a save killed between its renames left the previous checkpoint aside: back first
    temporary = path.parent / _rank0_decides(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
    if _is_rank0():
        path.parent.mkdir(parents=True, exist_ok=True)
    _barrier()
    try:
        try:
            dcp.save(state, checkpoint_id=temporary)
        except _dcp_failures() as error:
            raise RuntimeError(f"Saving the sharded checkpoint {path} failed, the previous one (if any) is as it was: "
                               f"{_first_line(error)}. Check that the folder is writable and the disk has room.") from None
        _barrier()
        if _is_rank0():
            sums = {"files": {p.name: _sha256(p) for p in sorted(temporary.iterdir())},
                    "model_keys": sorted(state["model"])}
            (temporary / _SUMS).write_text(json.dumps(sums, indent=1) + "\n")
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            if path.exists():
                path.rename(old)  # the previous checkpoint stays whole until the new one is in place
            temporary.rename(path)
            # the previous checkpoint, and what a killed save of this path left beside it: its folder moved aside,
            # its unpublished or half-written new one (ampkit's own names: the new checkpoint supersedes them)
            for stale in [old, *path.parent.glob(f".{path.name}.old-*"), *path.parent.glob(f".{path.name}.partial-*")]:
                shutil.rmtree(stale, ignore_errors=True)
    except BaseException:
        if _is_rank0():
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    _barrier()


def _packed(extra: dict[str, Any]) -> bytes:
    """``extra`` as torch.save's bytes, read back by ``_unpacked`` as ``load_checkpoint`` gives it: tuples, int keys
    and tensors as they were (JSON, before, made tuples lists and keys strings, and refused tensors)."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    return buffer.getvalue()


def _unpacked(saved: bytes | str) -> dict[str, Any]:
    """``_packed``'s dict (only plain values and tensors are read: ``weights_only``); an older checkpoint's JSON."""
    if isinstance(saved, str):
        return dict(json.loads(saved))
    return dict(torch.load(io.BytesIO(saved), weights_only=True))


def _recover(path: Path) -> None:
    """Put a checkpoint back at ``path`` where a save was killed between its two renames (the previous folder moved
    aside as ``.<name>.old-*``, the new one complete as ``.<name>.partial-*``, nothing at ``path``): the newest
    complete one (its ``.metadata`` written last), with a warning. Nothing where ``path`` exists."""
    if path.exists():
        return
    complete = [p for pattern in (f".{path.name}.partial-*", f".{path.name}.old-*")
                for p in path.parent.glob(pattern) if (p / ".metadata").is_file()]
    if complete and _is_rank0():
        newest = max(complete, key=lambda p: (p / ".metadata").stat().st_mtime)
        newest.rename(path)
        for older in complete:  # the checkpoint the stopped save was replacing: it would have removed it
            if older != newest:
                shutil.rmtree(older, ignore_errors=True)
        warnings.warn(f"{path} was missing: a save was stopped between its renames. The newest complete checkpoint, "
                      f"{newest.name}, is back at {path}.", RuntimeWarning, stacklevel=3)
    _barrier()


def _not_ours(path: Path) -> list[str]:
    """The entries of an existing folder ``path`` that a save does not write (``.metadata``, ``__R_N.distcp``,
    ``ampkit.json``)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name not in (".metadata", _SUMS) and not _SHARD.fullmatch(p.name))


def load_sharded_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                            **objects: Any) -> dict[str, Any]:
    """Restore what ``save_sharded_checkpoint`` saved, on any world size; every rank calls it.

    The model may be sharded differently from the one saved (another world size, or a plain model
    in one process): DCP reads the parts each rank's shards need.

    Args:
        path: a folder written by ``save_sharded_checkpoint``.
        model: the model to restore (sharded or plain).
        optimizer: its optimizer, if the checkpoint has one.
        **objects: objects to restore by the names they were saved under.

    Returns:
        The ``extra`` values saved with it.

    Raises:
        FileNotFoundError: no checkpoint folder at ``path``.
        RuntimeError: the folder is incomplete or not ampkit's, a name or the optimizer is not in it, or
            an object refuses its state; nothing is changed (states are read into copies first).

    Note:
        The copies take the model's and optimizer's memory once more for the duration of the call.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    _recover(path)
    if not path.is_dir():
        raise FileNotFoundError(f"No sharded checkpoint at {path}{' (it is a file: use load_checkpoint)' if path.is_file() else ''}: "
                                "pass the folder save_sharded_checkpoint wrote.")
    if not (path / ".metadata").is_file():
        raise RuntimeError(f"{path} has no .metadata: it is not a complete DCP checkpoint. Resume from another one.")
    _check_files(path, None)
    meta_box: dict[str, Any] = {_META: "", "extra": b""}
    try:
        dcp.load(meta_box, checkpoint_id=path)
        meta = json.loads(meta_box[_META])
    except _dcp_failures() as error:
        raise RuntimeError(f"{path} is not an ampkit sharded checkpoint ({_first_line(error)}): write it with "
                           "save_sharded_checkpoint.") from None
    if meta.get("version") != SHARDED_VERSION:
        raise RuntimeError(f"{path} has version {meta.get('version')!r}; this ampkit reads {SHARDED_VERSION}.")
    missing = sorted(set(objects) - set(meta["objects"]))
    if missing:
        raise RuntimeError(f"{path} has no state for {missing}; it holds {meta['objects']}.")
    if optimizer is not None and not meta["optimizer"]:
        raise RuntimeError(f"{path} was saved without an optimizer: pass optimizer=None, or resume from another.")
    if optimizer is not None and meta.get("states") is not None:  # older checkpoints do not say
        check_same_format(meta["states"], optimizer, str(path))
    # The guard's raises first: the model's saved state is that of the layers it raised (put back on any failure)
    shaping = {name: obj for name, obj in objects.items() if getattr(obj, "restores_structure", False)}
    shaped = {name: obj.state_dict() for name, obj in shaping.items()}
    try:
        if shaping:
            box: dict[str, Any] = {"objects": {name: b"" for name in shaping}}
            dcp.load(box, checkpoint_id=path)
            for name, obj in shaping.items():
                obj.load_state_dict(_unpacked(box["objects"][name]))
        _load_states(path, model, optimizer, {n: o for n, o in objects.items() if n not in shaping}, meta)
    except BaseException:
        for name, obj in shaping.items():
            obj.load_state_dict(shaped[name])
        raise
    return _unpacked(meta_box["extra"])


def _load_states(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, objects: dict[str, Any],
                 meta: dict[str, Any]) -> None:
    """``load_sharded_checkpoint``'s restore of the model, the optimizer and ``objects`` (the guard's raises
    done), all or nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _check_files(path, _states(model, None)["model"])
    # Read into copies, so a failure leaves every object as it was.
    state = _trees.map_tensors(lambda t: t.detach().clone(), _states(model, optimizer))
    state["objects"] = {name: _trees.map_tensors(torch.clone, obj.state_dict())
                        for name, obj in objects.items()}
    # On the world size it was saved on, each rank's torchao low-bit states come back exactly (their codes and
    # scales); on another, quantized again from their values (blocks follow each rank's shard).
    exact = meta.get("world_size") == _world_size()
    if exact:
        state["quantized"] = {key: t.clone() for key, t in _quantized_parts(optimizer).items()}
    try:
        dcp.load(state, checkpoint_id=path)
    except _dcp_failures() as error:
        raise RuntimeError(f"{path} could not be read into this model, nothing was changed: {_first_line(error)}. "
                           "Load it into the model it was saved from (its layers, shapes and optimizer).") from None
    before = {name: obj.state_dict() for name, obj in objects.items()}
    try:  # the objects first: their load_state_dict checks what it is given, and can be put back
        for name, obj in objects.items():
            obj.load_state_dict(state["objects"][name])
    except Exception as error:
        for name, obj in objects.items():
            obj.load_state_dict(before[name])
        raise RuntimeError(f"{path}: restoring the objects failed, nothing was changed: {error}") from error
    # torchao's low-bit states (made by _states above, if the optimizer had none) take the loaded values back in
    quantized = [(param, key, value) for param, states in (optimizer.state.items() if optimizer is not None else ())
                 for key, value in states.items() if is_quantized(value)]
    set_state_dict(model, optimizer if optimizer is not None else (), model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))  # shapes and keys already matched by dcp.load
    for param, key, value in quantized:
        value.copy_(optimizer.state[param][key])  # type: ignore[union-attr]
        optimizer.state[param][key] = value  # type: ignore[union-attr]
    if exact:
        live = _quantized_parts(optimizer)
        for key, saved in state["quantized"].items():
            live[key].copy_(saved)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _quantized_parts(optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """This rank's torchao low-bit optimizer states as they are stored (each one's codes and block scales), keyed by
    rank, parameter index and state name: a plain tensor per rank, which DCP saves and loads whole.

    Their float32 values (``_states``) reshard to any world size but do not always quantize back to the same
    codes: a block whose largest value is negative has no code of -1.0 in torchao's signed 8-bit and 4-bit maps,
    so quantizing it again finds a smaller scale.
    """
    if optimizer is None:
        return {}
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {f"rank{rank}.{index}.{key}.{part}": getattr(local_shard(value), part)
            for index, param in enumerate(params) for key, value in optimizer.state.get(param, {}).items()
            if is_quantized(value) for part in ("codes", "scale")}


def _dcp_failures() -> tuple[type[BaseException], ...]:
    """What DCP raises: its ``CheckpointException`` (a ``BaseException``), and ordinary exceptions."""
    from torch.distributed.checkpoint import CheckpointException

    return (Exception, CheckpointException)


def _first_line(error: BaseException) -> str:
    """An error's message, one line (DCP's lists every rank's traceback)."""
    text = str(error).strip()
    failures = getattr(error, "failures", None)  # CheckpointException: rank -> the exception it raised
    if isinstance(failures, dict) and failures:
        rank, cause = next(iter(failures.items()))
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, its stack summary)
        text = f"rank {rank}: {type(cause).__name__}: {cause}"
    return text.splitlines()[0] if text else type(error).__name__


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_files(path: Path, model_state: dict[str, Any] | None) -> None:
    """Refuse a folder whose files differ from their SHA-256 at the save, or that lack one (``model_state`` None),
    or a checkpoint of a model with other keys than ``model_state``'s (DCP loads what the model asks for, and
    ignores the rest): rank 0 reads the files."""
    problem = _rank0_decides(_problem(path, model_state) if _is_rank0() else None)
    if problem:
        raise RuntimeError(problem)


def _problem(path: Path, model_state: dict[str, Any] | None) -> str | None:
    """What is wrong with the folder's files (``model_state`` None) or its model's keys, in words; None where
    nothing is."""
    sums_path = path / _SUMS
    if not sums_path.is_file():  # not ampkit's (refused when its metadata is read), or saved before checksums
        if model_state is None:
            warnings.warn(f"{path} has no {_SUMS}: it was saved before ampkit kept checksums, so its files cannot be "
                          "verified. Save it again to have them.", RuntimeWarning, stacklevel=4)
        return None
    try:
        sums = json.loads(sums_path.read_text())
        files = {str(name): str(digest) for name, digest in sums["files"].items()}
        saved = {str(key) for key in sums["model_keys"]}
    except (ValueError, KeyError, TypeError, AttributeError):  # bad UTF-8 and bad JSON are ValueErrors
        return f"{path} is damaged: its {_SUMS} is not the one a save writes. Resume from another checkpoint."
    if model_state is None:
        damaged = [name for name, digest in files.items()
                   if not (path / name).is_file() or _sha256(path / name) != digest]
        added = sorted(p.name for p in path.iterdir() if _SHARD.fullmatch(p.name) and p.name not in files)
        if damaged or added:
            return (f"{path} is damaged: {', '.join(damaged + added)} {'differ from' if damaged else 'are not among'} "
                    "the files the save wrote. Resume from another checkpoint.")
        return None
    keys = set(model_state)
    if keys != saved:
        return (f"{path} is a checkpoint of another model: it lacks {sorted(keys - saved)[:3]} and has "
                f"{sorted(saved - keys)[:3]} the model does not. Load it into the model it was saved from.")
    return None
