"""Loads the SGLang CPU test harness at interpreter start when ``SGLANG_TEV_CPU_HARNESS=1``.

Python imports ``sitecustomize`` from ``sys.path`` in every process, including the scheduler
and detokenizer SGLang spawns; ``tev_cpu_harness.harness_env()`` puts this folder on
``PYTHONPATH`` for them. ``SGLANG_TEV_TP_TRACE=<folder>`` also records each process's TEV round
decisions there (``tp_trace.py``); ``SGLANG_TEV_SYNC_PROBE=<file>`` counts the host syncs of
each TEV decode step (``sync_probe.py``).
"""

import os

if os.environ.get("SGLANG_TEV_CPU_HARNESS") == "1":
    import tev_cpu_harness

    tev_cpu_harness.install()

    if os.environ.get("SGLANG_TEV_TP_TRACE"):
        import tp_trace

        tp_trace.install()

    if os.environ.get("SGLANG_TEV_SYNC_PROBE"):
        import sync_probe

        sync_probe.install()
