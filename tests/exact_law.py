"""``from exact_law import ...`` in tests/: the oracle lives in :mod:`sglang_tev.testing.exact_law`
(shared with scripts/gpu_check.py)."""

from sglang_tev.testing.exact_law import chi_square_pvalue, enumerate_exit_law, random_tree, stack_trees

__all__ = ["random_tree", "stack_trees", "enumerate_exit_law", "chi_square_pvalue"]
