"""The project's native host helpers (``host_ops.c``), for every CPU hot path that many small
tensor ops would slow down: the DDTree builder (``draft/ddtree.py``), the greedy walk
(``verify/greedy.py``) and the transformers runtime's one-row KV move, tree-mask update and
feature gather (``hf/``); built on first use with the system compiler.

On CPU every small tensor or NumPy op costs tens of microseconds right after a model forward
(its weights have evicted the caches), so a builder made of many small ops loses to one native
call. This module compiles ``host_ops.c`` (plain C, no Python headers, about a second) into
a per-user cache directory and calls it through :mod:`ctypes`. Where that is not possible (no C
compiler, a read-only cache, ``SGLANG_TEV_NATIVE=0`` / ``false`` / ``off``), the functions here
return None and the callers stay in Python: both give identical outputs (``tests/core/test_ddtree.py``,
``tests/core/test_verify_exact.py``, ``tests/runtime/test_hf_batch.py``).

Cache directory: ``$SGLANG_TEV_CACHE`` or ``$XDG_CACHE_HOME/sglang_tev`` (default
``~/.cache/sglang_tev``); the library's name carries a hash of the source, so an upgrade rebuilds
it (older builds are removed; a file that does not load is rebuilt). Compiler: ``$CC`` (may carry
arguments: ``"ccache gcc"``) or the first of ``cc``, ``gcc``, ``clang`` on ``PATH``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile

from .. import env as _env
from ..atomic import atomic_path

__all__ = ["native", "native_builder", "HMAX"]

HMAX = 64
"""Deepest depth the C builder takes (``HMAX`` in the C source)."""

_log = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_ops.c")
_lib = None
_tried = False


def _cache_dir() -> str:
    base = _env.get(_env.CACHE)  # None when unset or empty
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "sglang_tev")
    return base


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)  # "ccache gcc", "gcc -std=c99"
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _disabled() -> bool:
    return not _env.get(_env.NATIVE)


def _build() -> ctypes.CDLL | None:
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib_path = os.path.join(out_dir, f"host_ops-{digest}.so")
    if os.path.exists(lib_path):
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError:  # a truncated or foreign file under our name: build it again
            _log.info("sglang_tev: %s does not load; rebuilding it", lib_path)
            os.remove(lib_path)
            lib = None
    else:
        lib = None
    if lib is None:
        cc = _compiler()
        if cc is None:
            _log.info("sglang_tev: no C compiler found; the host helpers run in Python")
            return None
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)  # unique: concurrent builders
        os.close(fd)
        with atomic_path(lib_path, tmp=tmp):  # build beside the target, then rename: never half a file
            subprocess.run([*cc, "-O3", "-shared", "-fPIC", "-o", tmp, _SOURCE, "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.chmod(tmp, 0o755)  # readable by others sharing the cache
        for old in os.listdir(out_dir):  # builds of older sources
            if old.startswith(("host_ops-", "ddtree_host-")) and old.endswith(".so") and old != os.path.basename(lib_path):
                try:
                    os.remove(os.path.join(out_dir, old))
                except OSError:
                    pass
        lib = ctypes.CDLL(lib_path)
    fn = lib.ddtree_build
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    g = lib.greedy_follow
    g.restype = ctypes.c_int64
    g.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 4
    mv = lib.kv_move
    mv.restype = None
    mv.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    mu = lib.mask_update
    mu.restype = None
    mu.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_float]
    gr = lib.gather_rows
    gr.restype = None
    gr.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


def native(name: str):
    """One C helper of ``host_ops.c`` by name (``ddtree_build``, ``greedy_follow``, ``kv_move``,
    ``mask_update``, ``gather_rows``), or None where the library cannot be built or is disabled
    (``SGLANG_TEV_NATIVE=0`` / ``false`` / ``no`` / ``off``, read at the first call). Built and
    loaded once per process; failures are logged at INFO level and never raised (the callers'
    Python paths take over)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if not _disabled():
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as e:
                _log.info("sglang_tev: could not build the native host helpers (%s); they run in Python", e)
                _lib = None
    return None if _lib is None else getattr(_lib, name)


def native_builder():
    """The C ``ddtree_build`` function, or None (see :func:`native`)."""
    return native("ddtree_build")
