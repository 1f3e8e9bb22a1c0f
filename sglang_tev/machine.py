"""What machine a measurement ran on (stdlib only; torch and transformers are imported only when a
field that needs them is asked for).

:func:`machine_info` builds the dict that bench, tune, eval-drafter and the benchmarks record
beside their results. Each caller keeps the key names its result files already use: a positional
field is recorded under its own name, a keyword ``key="field"`` records ``field`` under ``key``::

    machine_info("platform", "cpu_count", "python")        # {"platform": ..., "cpu_count": ..., ...}
    machine_info(cores="cpu_count", threads="torch_threads")  # {"cores": ..., "threads": ...}

Fields (:data:`FIELDS`):

- ``node``: host name; ``platform``: ``platform.platform()``; ``system``: ``"<system> <release>"``
- ``processor``: ``platform.processor()`` as is (may be empty); ``arch``: ``platform.machine()``;
  ``cpu``: the processor, else the architecture; ``cpu_model``: the ``model name`` of
  ``/proc/cpuinfo``, else ``cpu``
- ``cpu_count``: ``os.cpu_count()``; ``load_average``: ``os.getloadavg()``
- ``cpu_bf16``: the CPU's native-bf16 flags in ``/proc/cpuinfo`` (``avx512_bf16``, ``amx_bf16``),
  sorted; empty where it has none (then bf16 GEMMs run through conversions: a bf16 verify forward
  of M tokens costs far more than one of 1, ``docs/benchmarks.md``) or where there is no cpuinfo
- ``python``: the Python version
- ``torch``, ``transformers``: versions; ``torch_threads``: ``torch.get_num_threads()``;
  ``gpu``: the name of CUDA device 0, or None without CUDA; ``cuda_version``: ``torch.version.cuda``
"""

from __future__ import annotations

import os
import platform
from typing import Any, Callable

__all__ = ["FIELDS", "machine_info", "proc_cpu_model", "cpu_bf16_flags"]


def _cpuinfo_value(key: str) -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (after its colon, stripped), or
    None where there is no such line or no cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def proc_cpu_model() -> str | None:
    """The ``model name`` line of ``/proc/cpuinfo``, or None where there is none."""
    return _cpuinfo_value("model name")


def cpu_bf16_flags() -> list[str]:
    """The native-bf16 flags (``avx512_bf16``, ``amx_bf16``) of ``/proc/cpuinfo``'s first
    ``flags`` line, sorted; ``[]`` where it has none or there is no cpuinfo."""
    flags = (_cpuinfo_value("flags") or "").split()
    return sorted(x for x in flags if x in ("avx512_bf16", "amx_bf16"))


def _cpu() -> str:
    return platform.processor() or platform.machine()


def _torch():
    import torch

    return torch


def _gpu():
    torch = _torch()
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


FIELDS: dict[str, Callable[[], Any]] = {
    "node": platform.node,
    "platform": platform.platform,
    "system": lambda: f"{platform.system()} {platform.release()}",
    "processor": platform.processor,
    "arch": platform.machine,
    "cpu": _cpu,
    "cpu_model": lambda: proc_cpu_model() or _cpu(),
    "cpu_count": os.cpu_count,
    "cpu_bf16": cpu_bf16_flags,
    "load_average": os.getloadavg,
    "python": platform.python_version,
    "torch": lambda: _torch().__version__,
    "transformers": _transformers_version,
    "torch_threads": lambda: _torch().get_num_threads(),
    "gpu": _gpu,
    "cuda_version": lambda: _torch().version.cuda,
}


def machine_info(*fields: str, **renamed: str) -> dict[str, Any]:
    """``{name: value}`` for each field in ``fields`` (recorded under its own name) and each
    ``key=field`` in ``renamed`` (recorded under ``key``), in the order given. Raises
    ``ValueError`` naming an unknown field."""
    wanted = [(f, f) for f in fields] + list(renamed.items())
    unknown = [f for _, f in wanted if f not in FIELDS]
    if unknown:
        raise ValueError(f"fields: unknown machine field(s) {unknown}; known: {sorted(FIELDS)}")
    return {key: FIELDS[f]() for key, f in wanted}
