"""What ``budget="auto"`` learned, kept per machine, model pair and dtype.

A fresh process must not start from zero: the README's main job is one short ``sglang-tev
generate``, and the controller's calibration rounds (the largest tree, then plain decoding, then
the middle of the grid) are a good part of a 256-token call. So the runtime saves its cost table
(seconds per round by batch size and budget), its controllers' gains (expected accepted tokens by
budget, per target law) and its reach calibration (draft path score -> target reach, per regime)
to one JSON file, and a later process with the same key loads them and starts steady.

The key: schema version, package and torch versions, the machine (CPU model, GPU name), torch's
threads, the device type, the target's dtype, and a fingerprint of each model (its config and the
names, shapes, dtypes and float64 sums of a few tensors: a retrained drafter in the same folder
is another drafter). The file name is a hash of the key; the key is also stored in the file, and
a file whose stored key differs (a hash collision, a hand-copied file), whose schema is another,
or that does not parse is **not trusted**: it is ignored with one warning, and overwritten by the
next save. Saves are atomic (:func:`sglang_tev.atomic.atomic_write`): a killed process leaves the
old file or the new one.

Off with ``SGLANG_TEV_PLAN_CACHE=0`` or ``--no-plan-cache``; a frozen ``--cost-table`` wins over
it (nothing is loaded into, or saved from, a frozen table).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch

from .. import __version__
from .. import env as _env
from ..atomic import atomic_write
from ..planner import ReachCalibration
from ..costs import CostTable

__all__ = ["SCHEMA", "plan_cache_dir", "enabled", "model_fingerprint", "cache_key", "PlanCache"]

SCHEMA = 1
log = logging.getLogger(__name__)


def plan_cache_dir() -> Path:
    """``$SGLANG_TEV_CACHE/plan`` (unset: ``$XDG_CACHE_HOME/sglang_tev/plan``, else
    ``~/.cache/sglang_tev/plan``)."""
    base = _env.get(_env.CACHE)
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "sglang_tev")
    return Path(base) / "plan"


def enabled() -> bool:
    """``SGLANG_TEV_PLAN_CACHE`` is not turned off."""
    return bool(_env.get(_env.PLAN_CACHE))


def model_fingerprint(module) -> str | None:
    """A hex digest of a model: its config (``to_dict`` when it has one, less ``_name_or_path``:
    the same weights loaded from another folder are the same model), the name, shape and dtype of
    every parameter and buffer, and the float64 sums of the first and last two tensors (a few
    reads; weights retrained in place change it). None for no module."""
    if module is None:
        return None
    h = hashlib.sha256()
    cfg = getattr(module, "config", None)
    if cfg is not None:
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else getattr(cfg, "__dict__", cfg)
        if isinstance(d, dict):
            d = {k: v for k, v in d.items() if k != "_name_or_path"}
        h.update(json.dumps(_canonical(d), sort_keys=True).encode())
    tensors = list(module.state_dict().items()) if hasattr(module, "state_dict") else []
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    for _, t in tensors[:2] + tensors[-2:]:
        h.update(repr(float(t.detach().to(torch.float64).sum())).encode())
    return h.hexdigest()[:32]


def _canonical(x):
    """``x`` as JSON-able data that reads the same in every process: dict keys as strings, sets
    sorted, an object with ``to_dict`` by it, any other by its type's name (never its address)."""
    if isinstance(x, dict):
        return {str(k): _canonical(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((_canonical(v) for v in x), key=lambda v: json.dumps(v, sort_keys=True))
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, torch.dtype):
        return str(x)
    if hasattr(x, "to_dict"):
        return _canonical(x.to_dict())
    return f"<{type(x).__module__}.{type(x).__qualname__}>"


def _machine() -> dict:
    from ..machine import proc_cpu_model

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": proc_cpu_model() or os.uname().machine, "gpu": gpu}


def cache_key(target, drafter, dtype, device) -> dict:
    """The key a cache file is valid for (see the module docstring)."""
    return {"schema": SCHEMA, "package": __version__, "torch": torch.__version__, **_machine(),
            "threads": torch.get_num_threads(), "device": torch.device(device).type, "dtype": str(dtype),
            "target": model_fingerprint(target), "drafter": model_fingerprint(drafter)}


class PlanCache:
    """One cache file for one key.

    Args:
        key: :func:`cache_key`'s dict.
        folder: where the file lives (default :func:`plan_cache_dir`).
    """

    def __init__(self, key: dict, folder: str | os.PathLike | None = None) -> None:
        self.key = dict(key)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        self.path = Path(folder if folder is not None else plan_cache_dir()) / f"{digest}.json"
        self.refused: str | None = None  # why the last load did not trust the file

    def load(self) -> dict | None:
        """The saved state (``{"cost_table": CostTable, "gains": {...}, "calibration":
        ReachCalibration}``), or None when there is no file or it is not trusted (then
        ``self.refused`` says why, and one warning is logged)."""
        self.refused = None
        if not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text())
            if data.get("schema") != SCHEMA:
                raise ValueError(f"schema {data.get('schema')!r}, this package writes {SCHEMA}")
            if data.get("key") != self.key:
                diff = sorted(k for k in set(self.key) | set(data.get("key") or {})
                              if (data.get("key") or {}).get(k) != self.key.get(k))
                raise ValueError(f"written for another {', '.join(diff)}")
            table = CostTable.from_json(data["cost_table"], frozen=False)
            calibration = ReachCalibration.from_json(data["calibration"])
            gains = {str(k): _check_gains(v) for k, v in data["gains"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.refused = f"{self.path}: {e}"
            log.warning("plan cache not used (%s); it will be rewritten", self.refused)
            return None
        return {"cost_table": table, "gains": gains, "calibration": calibration}

    def save(self, cost_table: CostTable, gains: dict, calibration: ReachCalibration) -> None:
        """Write the state atomically (the folder is created). ``gains``: ``{name: {"inc": {budget:
        float}, "n": {budget: int}, "switch": {"batch:trees|plain": seconds}}}`` per controller
        (:func:`controller_gains`)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"schema": SCHEMA, "key": self.key, "cost_table": cost_table.to_json(), "gains": gains,
                "calibration": calibration.to_json()}
        atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True))


def _number(x) -> float:
    """A finite JSON number (not a bool) as a float, else ValueError."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"not a finite number: {x!r}")
    return float(x)


def _switch_name(batch: int, into_trees: bool) -> str:
    """A switch price's key in the cache file: ``"batch:trees"`` / ``"batch:plain"``."""
    return f"{batch}:{'trees' if into_trees else 'plain'}"


def _switch_key(name: str) -> tuple[int, bool]:
    """:func:`_switch_name` read back as the controller's ``(batch, into trees)``; ValueError for
    anything else."""
    batch, _, into = str(name).partition(":")
    if into not in ("trees", "plain") or not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"{name!r}")
    return int(batch), into == "trees"


def _check_gains(v: dict) -> dict:
    inc = {int(b): _number(x) for b, x in v["inc"].items()}
    n = {int(b): int(x) for b, x in v["n"].items()}
    if any(b < 0 or x < 0 for b, x in inc.items()) or any(x < 0 for x in n.values()):
        raise ValueError("gains out of range")
    switch = {}
    try:
        for k, x in (v.get("switch") or {}).items():  # absent in caches written before it was kept
            _switch_key(k)
            if _number(x) < 0:
                raise ValueError(f"{k!r}: {x!r}")
            switch[str(k)] = float(x)
    except (ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"switch prices out of range ({e})") from None
    return {"inc": inc, "n": n, "switch": switch}


def controller_gains(ctl) -> dict:
    """A :class:`~sglang_tev.autobudget.BudgetController`'s learned gains (and the switch prices
    its across probes pay, ``"batch:trees"`` / ``"batch:plain"``) as JSON-able dicts."""
    return {"inc": {str(b): x for b, x in ctl._inc.items()}, "n": {str(b): x for b, x in ctl._n.items()},
            "switch": {_switch_name(b, into): x for (b, into), x in ctl.switch.items()}}


def restore_gains(ctl, saved: dict) -> None:
    """Put gains saved by :func:`controller_gains` (checked by :meth:`PlanCache.load`) back into
    ``ctl``: the per-step increments, their counts, and the cumulative gains rebuilt from them."""
    ctl._inc = {int(b): float(x) for b, x in saved["inc"].items() if int(b) in ctl.grid}
    ctl._n = {int(b): int(x) for b, x in saved["n"].items() if int(b) in ctl.grid}
    ctl.switch = {_switch_key(k): float(x) for k, x in saved.get("switch", {}).items()}
    total = 0.0
    ctl.gain = {}
    for b in ctl.grid_upto(ctl.max_budget):
        if b not in ctl._inc:
            break
        total += ctl._inc[b]
        ctl.gain[b] = total
