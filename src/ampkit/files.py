"""Files ampkit writes: atomically, and where its per-machine cache lives."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file in its directory, then rename it into place,
    so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A suffix even where ``path`` has none: torch.save's zip writer refuses a dot-file without one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix or ".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes the file private (0600); results and caches are not secrets
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_dir() -> Path:
    """Where ampkit keeps per-machine measurements.

    ``$AMPKIT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ampkit``, else ``~/.cache/ampkit``.
    """
    if os.environ.get("AMPKIT_CACHE_DIR"):
        return Path(os.environ["AMPKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ampkit"
