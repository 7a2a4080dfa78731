"""Files ampkit writes: atomically, and where its per-machine cache lives."""

from __future__ import annotations

import errno
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _temporary_beside(path: Path) -> str:
    """A new empty temporary file in ``path``'s directory (created), named after it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A suffix even where ``path`` has none: torch.save's zip writer refuses a dot-file without one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix or ".tmp")
    os.close(fd)
    return tmp


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file in its directory, then rename it into place,
    so a crash never leaves a half-written file."""
    tmp = _temporary_beside(path)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes the file private (0600); results and caches are not secrets
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_new(files: dict[Path, Callable[[Path], object]]) -> None:
    """Write several new files all or nothing, never over an existing one.

    Each is written to a temporary file beside it first (a full disk fails here, before any is in
    place), then linked into place exclusively; if one of them exists by then (it appeared while the
    caller worked), the ones already placed are removed again and nothing is overwritten.

    Raises:
        FileExistsError: a target exists (named); nothing was written.
        OSError: a write failed (a full disk, say); nothing was written.
    """
    temporary: dict[Path, str] = {}
    placed: list[Path] = []
    try:
        for path, write in files.items():
            tmp = temporary[path] = _temporary_beside(path)
            write(Path(tmp))
            os.chmod(tmp, 0o644)
        for path, tmp in temporary.items():
            try:
                os.link(tmp, path)  # FileExistsError where the path exists: exclusive, unlike a rename
            except FileExistsError:
                raise
            except OSError as error:  # a file system without hard links: check, then rename (a narrow race)
                if error.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                    raise
                if path.exists():
                    raise FileExistsError(errno.EEXIST, "File exists", tmp, None, str(path)) from None
                os.replace(tmp, path)
            placed.append(path)
    except BaseException:
        for path in placed:
            path.unlink(missing_ok=True)
        raise
    finally:
        for tmp in temporary.values():
            Path(tmp).unlink(missing_ok=True)


def writable_directory(out: Path) -> Path:
    """Create ``out`` (with its parents) and check that a file can be written in it, before any work
    whose results would go there.

    Raises:
        ValueError: it cannot be created or written (``out=`` named, with the reason).
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ValueError(
            f"out='{out}' cannot hold results: {error.strerror or error}. Pass a directory you can write to."
        ) from error
    return out


def cache_dir() -> Path:
    """Where ampkit keeps per-machine measurements.

    ``$AMPKIT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ampkit``, else ``~/.cache/ampkit``.
    """
    if os.environ.get("AMPKIT_CACHE_DIR"):
        return Path(os.environ["AMPKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ampkit"


def strict_json(value: Any, path: str, found: list[str]) -> Any:
    """``value`` with every inf/NaN float replaced by None, its path added to ``found``:
    strict JSON (JavaScript's JSON.parse and others reject bare NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        found.append(f"{path}: {value}")
        return None
    if isinstance(value, dict):
        return {k: strict_json(v, f"{path}.{k}" if path else k, found) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value
