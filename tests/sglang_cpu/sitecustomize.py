"""Loads the SGLang CPU test harness at interpreter start when ``SGLANG_TEV_CPU_HARNESS=1``.

Python imports ``sitecustomize`` from ``sys.path`` in every process, including the scheduler
and detokenizer SGLang spawns; ``tev_cpu_harness.harness_env()`` puts this folder on
``PYTHONPATH`` for them.
"""

import os

if os.environ.get("SGLANG_TEV_CPU_HARNESS") == "1":
    import tev_cpu_harness

    tev_cpu_harness.install()
