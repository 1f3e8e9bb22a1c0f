"""Counts the host syncs of every TEV decode step in an SGLang scheduler process (tests only; an
observer: it changes no result).

With ``SGLANG_TEV_SYNC_PROBE=<file>`` (and the harness on ``PYTHONPATH``: ``sitecustomize`` loads
this module), ``TEVWorker._tev_decode`` runs inside
:class:`sglang_tev.testing.host_sync.HostSyncCounter` (CPU emulation: an op on a CPU tensor
counts as if it were on the GPU) and each step appends one JSON line to ``<file>``::

    {"bs": 3, "events": [["read", "sglang_tev/srt/worker.py", 301], ...]}

(paths from ``sglang_tev/`` or ``sglang/`` on). The probe also puts the round on its GPU code
path, which is what is being counted: the level-wise DDTree builder with the static depth bound
(not the CPU heap and its exact-depth read), the verifier's device walk (not the CPU host walk),
torch argmax (not the NumPy view): ``sglang_tev.testing.host_sync.gpu_code_paths``.
"""

from __future__ import annotations

import json

from sglang_tev import env as tev_env

ENV = tev_env.SYNC_PROBE
_gpu_paths = None


def _short(path: str) -> str:
    for root in ("sglang_tev/", "sglang/", "tests/"):
        i = path.rfind("/" + root)
        if i >= 0:
            return path[i + 1 :]
    return path


def _wrap_worker(mod) -> None:
    from sglang_tev.testing.host_sync import HostSyncCounter, gpu_code_paths

    global _gpu_paths
    # kept for the rest of the process (a dropped context manager would restore the CPU paths
    # when it is garbage-collected)
    _gpu_paths = gpu_code_paths()
    _gpu_paths.__enter__()
    out = tev_env.get(ENV)
    orig = mod.TEVWorker._tev_decode

    def _tev_decode(self, batch, *args, **kwargs):
        with HostSyncCounter(include=("sglang_tev/", "sglang/", "tests/")) as counter:
            result = orig(self, batch, *args, **kwargs)
        events = [[e.op, _short(e.file), e.line] for e in counter.events]
        with open(out, "a") as f:
            f.write(json.dumps({"bs": len(batch.seq_lens), "events": events}) + "\n")
        return result

    mod.TEVWorker._tev_decode = _tev_decode


def install() -> None:
    """Wrap the worker's decode step when ``SGLANG_TEV_SYNC_PROBE`` names a file."""
    if not tev_env.get(ENV):
        return
    import sys

    from . import harness

    sys.meta_path.insert(0, harness.PostImport({"sglang_tev.srt.worker": _wrap_worker}))


def read(path: str) -> list:
    """The probe's records, one per decode step, in order."""
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]
