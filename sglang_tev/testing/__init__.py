"""Fixtures shared by the test suite and ``scripts/gpu_check.py``: the exact-law oracle
(:mod:`.exact_law`), the fused-TEV kernel cases (:mod:`.triton_cases`), the small random model
pair with its plain-decoding reference (:mod:`.models`), a counter of host syncs
(:mod:`.host_sync`) and a CPU stand-in for CUDA-graph capture and replay (:mod:`.graph_replay`). Never imported by the package itself;
needs the ``test`` extra (scipy)."""
