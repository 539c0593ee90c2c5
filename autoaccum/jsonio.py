"""Atomic writes: a reader sees the old file or the new one, never half of one, and a crash after
the write returns does not lose it (the file and its directory are fsynced)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_bytes_atomic", "write_json_atomic"]


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable. Directories cannot be opened for fsync on Windows."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> Path:
    """Write ``data`` as JSON to ``path``: temp file in the same directory, fsync, rename, fsync the
    directory. Missing parent directories are created. Returns the path."""
    return write_bytes_atomic(path, json.dumps(data, indent=1).encode())


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` as ``write_json_atomic`` does (temp file, fsync, rename, fsync of
    the directory). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # keep the original error
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path
