"""Crash-safe file writes: write to a temporary name in the same directory, fsync, rename."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp_path)` to produce the file, fsync it, then rename it over `path`.

    A crash at any point leaves either the old `path` or the new one, never a partial file.
    Returns `path`. Exceptions from `write` propagate after the temporary file is removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
