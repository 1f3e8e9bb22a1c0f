"""Checks on output folders before any work starts (stdlib only): the CLI's ``--output`` checks and
the trainer's ``output_dir`` use the same probe."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["creatable_dir_problem"]


def creatable_dir_problem(out: str | os.PathLike) -> str | None:
    """Why the folder ``out`` could not be created or written, or None when it can.

    Refused: ``out`` or a folder on its path is a file; a name the filesystem rejects; a place
    that cannot be written (probed by making and removing a temporary folder in the nearest
    existing ancestor: a read-only mount or a virtual filesystem such as ``/proc`` otherwise fails
    only at the first write, after minutes of loading); a missing name longer than that
    filesystem's ``PC_NAME_MAX``. Creates nothing that stays.
    """
    out = Path(out)
    try:
        blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        if out.exists() and not out.is_dir():
            return f"{out} exists and is not a directory"
        if blocker is not None:
            return f"cannot create {out}: {blocker} is not a directory"
        base = out if out.is_dir() else next((p for p in out.parents if p.exists()), Path("."))
    except OSError as e:  # e.g. a name longer than the filesystem allows
        return f"cannot use {str(out)[:80]!r}: {e.strerror or e}"
    try:
        tempfile.TemporaryDirectory(dir=base, prefix=".sglang-tev-probe-").cleanup()
    except OSError as e:
        if base == out:
            return f"cannot write to {out} ({e.strerror or e})"
        return f"cannot create folders under {base} ({e.strerror or e})"
    try:  # a name below base too long for its filesystem fails only when the run creates it
        name_max = os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = None
    missing = out.resolve().relative_to(base.resolve()).parts if name_max else ()
    if any(len(part.encode()) > name_max for part in missing):
        return f"cannot create {str(out)[:80]!r}...: a name is longer than {name_max} bytes"
    return None
