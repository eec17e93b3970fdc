"""Atomic files: write a temporary file beside the target, fsync, rename over it. Stdlib only.

Used for every piece of state a crash must not tear: the run's state.json, registry entries,
job records, rendered scripts, checkpoint manifests and pointers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# tempfile is imported where used: `hpcrl status` imports this module and must start fast.


def fsync_dir(path) -> None:
    """Make a rename in `path` durable (best effort: some filesystems refuse fsync on a directory)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def atomic_write_text(path, text: str, mode: int | None = None) -> None:
    """Write via a temporary file in the same directory, fsync, rename over `path`."""
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n")
