"""Which code path the core takes on CPU tensors: one explicit policy instead of choosers that
tests patch (torch-free).

On a CPU the core takes host shortcuts that are cheaper there and give the same results: the
DDTree / lattice builders' heap (instead of the level-wise tensor builder), the level-wise
builder's exact ``max_depth`` read back (instead of the static bound), the greedy verifier's host
walk for small trees, NumPy's argmax on zero-copy views. On a GPU none of them is taken. Tests
that count host syncs or trace graphs on CPU switch to what a GPU runs with :func:`use`
(``sglang_tev.testing.host_sync.gpu_code_paths`` does); results are equal either way (tested).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

__all__ = ["ExecutionPaths", "CPU_SHORTCUTS", "DEVICE_PATHS", "current", "use"]


@dataclass(frozen=True)
class ExecutionPaths:
    """The CPU shortcuts in force (each applies to CPU tensors only; a GPU never takes them).

    Attributes:
        heap_builder: ``impl="auto"`` DDTree / lattice builds run the host heap.
        exact_max_depth: the level-wise builder reads the trees' exact ``max_depth`` back (one host
            read; later loops over depths get shorter) instead of the static bound min(H, B).
        host_walk_max_nodes: greedy verification walks trees of at most this many nodes in all
            (b x N) on the host; below 0: never.
        numpy_argmax: argmax through a zero-copy NumPy view (5 us against torch's 150 us for
            [17, 4096] on the development VM).
    """

    heap_builder: bool = True
    exact_max_depth: bool = True
    host_walk_max_nodes: int = 4096
    numpy_argmax: bool = True


CPU_SHORTCUTS = ExecutionPaths()
"""The default: every CPU shortcut on."""

DEVICE_PATHS = ExecutionPaths(heap_builder=False, exact_max_depth=False, host_walk_max_nodes=-1, numpy_argmax=False)
"""What a GPU runs, on CPU tensors: no shortcut."""

_current = CPU_SHORTCUTS


def current() -> ExecutionPaths:
    """The policy in force (read by the builders and verifiers on each call)."""
    return _current


@contextlib.contextmanager
def use(paths: ExecutionPaths | None = None, **changes):
    """Run a block under ``paths`` (default: the current policy) with ``changes`` applied, e.g.
    ``use(DEVICE_PATHS)`` or ``use(host_walk_max_nodes=0)``; the previous policy is restored on
    exit. Not thread-safe: a process-wide switch, for tests and benchmarks."""
    global _current
    saved = _current
    _current = dataclasses.replace(paths or _current, **changes)
    try:
        yield _current
    finally:
        _current = saved
