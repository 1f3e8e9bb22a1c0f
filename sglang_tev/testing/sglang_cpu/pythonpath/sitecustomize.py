"""Loads the SGLang CPU test harness at interpreter start when ``SGLANG_TEV_CPU_HARNESS=1``.

Python imports ``sitecustomize`` from ``sys.path`` in every process, including the scheduler
and detokenizer SGLang spawns; ``sglang_tev.testing.sglang_cpu.harness.harness_env()`` puts this folder on
``PYTHONPATH`` for them. ``SGLANG_TEV_TP_TRACE=<folder>`` also records each process's TEV round
decisions there (``sglang_tev/testing/sglang_cpu/tp_trace.py``); ``SGLANG_TEV_SYNC_PROBE=<file>`` counts the host syncs of
each TEV decode step (``sglang_tev/testing/sglang_cpu/sync_probe.py``); ``SGLANG_TEV_PLAIN_STEPS=1``,
``SGLANG_TEV_RAGGED_CUTS=1`` and ``SGLANG_TEV_STEP_TRACE=<file>`` are
``sglang_tev/testing/sglang_cpu/step_hooks.py``.
"""

from sglang_tev import env

if env.get(env.CPU_HARNESS):
    from sglang_tev.testing.sglang_cpu import harness

    harness.install()

    if env.get(env.TP_TRACE):
        from sglang_tev.testing.sglang_cpu import tp_trace

        tp_trace.install()

    if env.get(env.SYNC_PROBE):
        from sglang_tev.testing.sglang_cpu import sync_probe

        sync_probe.install()

    if env.get(env.PLAIN_STEPS):
        from sglang_tev.testing.sglang_cpu import step_hooks

        step_hooks.install_plain_steps()

    if env.get(env.RAGGED_CUTS):
        from sglang_tev.testing.sglang_cpu import step_hooks

        step_hooks.install_ragged_cuts()

    if env.get(env.STEP_TRACE):
        from sglang_tev.testing.sglang_cpu import step_hooks

        step_hooks.install_step_trace(env.get(env.STEP_TRACE))
