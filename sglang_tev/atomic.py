"""Atomic writes (stdlib only): a reader (or a rerun after a kill) sees a file or directory whole —
the old version or the new one, never a half-written one.

Everything is written beside its destination under another name, fsynced, and published by one
``os.replace`` (atomic on one filesystem), after which the parent directory is fsynced so the
rename itself is durable. Used by the trainer's checkpoints, the rollout and continuation caches,
the drafter's ``save_pretrained``, the bench and tune JSONs, the native helper build, the
benchmarks and ``scripts/build_tiny_code.py``.

- :func:`atomic_write`: a file from text, bytes or a writer function.
- :func:`atomic_path`: a file written by anything that takes a path (a compiler, a library);
  the context manager yields the temporary path and publishes it on a clean exit.
- :func:`atomic_dir`: a directory; the context manager yields an empty temporary directory beside
  the target and publishes it (:func:`publish_dir`) on a clean exit.
- :func:`publish_dir`: move a fully written directory into place, replacing an old one only
  once the new one is there (the old one is put back if that fails).

Temporary names start with ``.tmp-`` / ``.old-`` (directories) or end in ``.tmp`` (files), so a
cleanup after a kill can recognise them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

__all__ = ["fsync_dir", "fsync_file", "atomic_path", "atomic_write", "atomic_dir", "publish_dir", "check_writable_file"]


def check_writable_file(path: str | os.PathLike) -> Path:
    """Make sure :func:`atomic_write` can publish a file at ``path`` later: the parent folder is
    created, ``path`` is not a directory, and a temporary file can be created and removed beside
    it. For commands that measure for minutes before they write.

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.
    Raises:
        ValueError saying why (the caller names its argument); nothing is left behind.
    """
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        raise ValueError(f"{path} is a directory, not a file")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"cannot write beside {path} ({e})") from None
    return p


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


def fsync_file(path: str | os.PathLike) -> None:
    """fsync a regular file's contents (written by someone else, e.g. a library given its path)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, *, tmp: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; on a clean exit it is fsynced and renamed
    to ``path`` (and the parent fsynced).

    ``tmp`` defaults to ``<path>.tmp``; give a unique name where processes may write the same
    path at once. On any failure (in the block or in the publish) the temporary file is removed,
    the previous ``path`` is untouched and the error propagates.
    """
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(path.name + ".tmp")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], None], *,
                 tmp: str | os.PathLike | None = None) -> Path:
    """Write ``path`` whole or not at all.

    data: text (UTF-8), bytes, or a function that writes to the open binary file (e.g.
    ``lambda f: torch.save(obj, f)``). It goes to ``tmp`` (default ``<path>.tmp`` beside it; give
    a unique name where processes may write the same path at once), is flushed and fsynced, one
    ``os.replace`` puts it at ``path`` and the parent directory is fsynced. On any failure the
    temporary file is removed, the previous ``path`` is untouched and the error propagates.
    Returns ``path``.
    """
    path = Path(path)
    with atomic_path(path, tmp=tmp) as t:
        with open(t, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
    return path


def _fsync_tree(root: Path) -> None:
    """fsync every regular file under ``root``, then every directory (deepest first)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                fsync_file(p)
        fsync_dir(dirpath)


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


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a new empty directory beside ``final`` (``.tmp-<name>-<random>``) to write into; on a
    clean exit everything in it is fsynced and :func:`publish_dir` puts it at ``final`` (an
    existing ``final`` is replaced only then, and restored if the rename fails). On any failure the
    temporary directory is removed, ``final`` is left as it was and the error propagates. The
    parent of ``final`` must exist.
    """
    final = Path(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
