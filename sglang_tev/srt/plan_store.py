"""What ``SGLANG_TEV_BUDGET=auto`` learned, kept across server starts.

The transformers runtime's plan cache (:mod:`sglang_tev.hf.plan_cache`) for the SGLang worker: per
target law (:data:`~sglang_tev.srt.budget.LAWS`) one file with that law's cost table (seconds per
round by batch size and width, SGLang's own per-step work included), its controller's gains and
the shared reach calibration, so a restarted server starts steady instead of calibrating every
batch size again (the capacity's round, a plain step, a middle width).

The key is the runtime's (package and torch versions, machine, threads, device, dtype, a
fingerprint of the target and of the drafter) plus what makes SGLang's rounds cost what they do:
``"runtime": "sglang"``, SGLang's version, the TP size, the target's attention backend class,
the verify layout (ragged or one width per round), the capacity N - 1, the block size K, the budgets
rounds may take and whether they replay CUDA graphs (per-width tiers). A file
written for another key, of another schema or that does not parse is ignored with one warning and
rewritten. Only rank 0 plans, so only rank 0 reads and writes. Saves are atomic, every
:data:`SAVE_EVERY` rounds (a server has no last round to save at). Off with
``SGLANG_TEV_PLAN_CACHE=0``; the folder is ``$SGLANG_TEV_CACHE/plan``.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

from ..hf import plan_cache as _cache
from .budget import LAWS, ServedBudget

__all__ = ["SAVE_EVERY", "served_key", "ServedPlanStore"]

SAVE_EVERY = 256
"""Rounds between two saves (a few kilobytes of JSON, written atomically)."""

log = logging.getLogger(__name__)


def served_key(target, drafter, dtype, device, *, tp_size: int, attn_backend, layout: str, capacity: int,
               block_size: int, grid: Sequence[int] = (), graphs: bool = False) -> dict:
    """The key a served plan cache file is valid for (module doc); one file per law adds ``"law"``.
    ``grid``: the budgets rounds may take; ``graphs``: whether rounds replay CUDA graphs (per-width
    tiers, ``graph_tiers``), which changes every width's cost."""
    import sglang

    return {**_cache.cache_key(target, drafter, dtype, device), "runtime": "sglang", "sglang": sglang.__version__,
            "tp": int(tp_size), "backend": type(attn_backend).__name__, "layout": layout,
            "capacity": int(capacity), "block_size": int(block_size), "grid": [int(b) for b in grid],
            "graphs": bool(graphs)}


class ServedPlanStore:
    """One server's plan cache: a :class:`~sglang_tev.hf.plan_cache.PlanCache` per target law.

    Args:
        key: :func:`served_key`'s dict.
        folder: where the files live (default ``$SGLANG_TEV_CACHE/plan``).
    """

    def __init__(self, key: dict, folder: str | os.PathLike | None = None) -> None:
        self.files = {law: _cache.PlanCache({**key, "law": law}, folder) for law in LAWS}
        self._warned = False

    def load_into(self, served: ServedBudget) -> list[str]:
        """Restore every law a file was trusted for into ``served`` (before its first round);
        returns those laws."""
        restored = []
        for law, f in self.files.items():
            saved = f.load()
            if saved is not None:
                served.restore(law, saved["cost_table"], saved["gains"].get("controller"), saved["calibration"])
                restored.append(law)
        return restored

    def save_from(self, served: ServedBudget) -> None:
        """Write every law whose cost table holds a tree round (what a load would accept). An
        unwritable folder is said once and never fails a round."""
        for law, table in served.cost_tables.items():
            if not any(b > 0 for row in table.seconds.values() for b in row):
                continue
            gains = served.gains(law)
            try:
                self.files[law].save(table, {} if gains is None else {"controller": gains}, served.calibration)
            except OSError as e:
                if not self._warned:
                    log.warning("TEV plan cache not saved (%s: %s)", self.files[law].path, e.strerror or e)
                    self._warned = True
