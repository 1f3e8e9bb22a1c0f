"""Atomic writes: a reader (or a rerun after a kill) sees a file or directory whole — the old
version or the new one, never a half-written one.

Everything is written beside its destination under another name, fsynced, and published by one
``os.replace`` (atomic on one filesystem). Used by the trainer's checkpoints, the rollout and
continuation caches and ``scripts/build_tiny_code.py``'s stages and target checkpoints.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Callable

__all__ = ["fsync_dir", "atomic_write", "publish_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (its entries: a rename inside it becomes durable); a no-op where the
    platform cannot open or fsync directories."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], None], *,
                 tmp: str | os.PathLike | None = None) -> Path:
    """Write ``path`` whole or not at all.

    data: text (UTF-8), bytes, or a function that writes to the open binary file (e.g.
    ``lambda f: torch.save(obj, f)``). It goes to ``tmp`` (default ``<path>.tmp`` beside it; give
    a unique name where processes may write the same path at once), is flushed and fsynced, and
    one ``os.replace`` puts it at ``path``. On any failure the temporary file is removed, the
    previous ``path`` is untouched and the error propagates. Returns ``path``.
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the fully written directory ``tmp`` to ``final`` (same filesystem).

    An existing ``final`` is first renamed aside (``.old-<name>-<random>`` beside it), then ``tmp``
    is renamed into place and the parent fsynced, then the old one is removed; if the second rename
    fails the old one is put back. Readers never see a half-written ``final``.
    """
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        if old is not None and not final.exists():
            os.replace(old, final)
            old = None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
