"""SGLang 0.5.23 plugin: ``--speculative-algorithm TEV`` (DFlash draft + DDTree + TEV verify).

Importing this package does not import sglang. Modules:

* ``plugin`` — the ``sglang.srt.plugins`` entry point, ``register()``;
* ``config`` — TEV settings on existing server args and ``SGLANG_TEV_*`` (no sglang import);
* ``algo`` — ``TevAlgo(CustomSpecAlgo)`` (imports sglang);
* ``round`` — one decode round's tensor logic in SGLang's layouts (pure torch);
* ``worker`` — ``TEVWorker(DFlashWorkerV2)`` (imports sglang; runs only with a CUDA GPU).

See ``docs/sglang.md``.
"""
