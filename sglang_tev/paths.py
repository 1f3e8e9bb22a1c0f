"""Checks on output folders before any work starts (stdlib only): the CLI's ``--output`` checks and
the trainer's ``output_dir`` use the same probe."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["creatable_dir_problem"]


def creatable_dir_problem(out: str | os.PathLike) -> str | None:
    """Why the folder ``out`` could not be created or written, or None when it can.

    Probes the nearest existing ancestor (or ``out`` itself) by making and removing a temporary
    folder there: a read-only mount or a virtual filesystem such as ``/proc`` otherwise fails only
    at the first write, after minutes of loading. Creates nothing that stays.
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
        return f"cannot create folders under {base} ({e.strerror or e})"
    return None
