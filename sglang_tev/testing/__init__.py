"""Fixtures shared by the test suite and ``scripts/gpu_check.py``: the exact-law oracle
(:mod:`.exact_law`), the fused-TEV kernel cases (:mod:`.triton_cases`) and the small random model
pair with its plain-decoding reference (:mod:`.models`). Never imported by the package itself;
needs the ``test`` extra (scipy)."""
