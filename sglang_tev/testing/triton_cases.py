"""Fused Triton TEV cases: seeded ragged trees with logits that put exits at every depth, and the
chi-square of the kernel's (exit node, bonus) draws against the enumerated law — run by
``tests/runtime/triton_tev_cases.py`` (interpreter on CPU, or a GPU) and ``scripts/gpu_check.py``.

The kernel needs a GPU or ``TRITON_INTERPRET=1`` set before Triton is imported; this module
imports Triton only inside :func:`kernel_draws_against_law`.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import DraftTree, SamplingParams, exit_law, processed_probs
from .exact_law import chi_square_pvalue, enumerate_exit_law, random_tree, stack_trees

__all__ = ["DEVICE", "ALPHA", "MC_CASES", "MC_ROWS", "make_case", "kernel_draws_against_law"]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHA = 1e-6


def make_case(seed: int, vocab: int, sizes: list[int], width: int | None = None, deep: float = 3.0):
    """Ragged trees padded to ``width`` and float32 logits whose first child token per node is
    boosted by ``deep`` (so exits fall at every depth). Padded rows hold NaN; each valid row has
    one -inf entry that is no drafted child."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, n, vocab) for n in sizes]
    width = width or max(sizes)
    tree = stack_trees(trees, width)
    logits = torch.from_numpy(rng.normal(size=(len(sizes), width, vocab)) * 1.5).float()
    for r, (parents, tokens) in enumerate(trees):
        kids: dict[int, list[int]] = {}
        for i in range(1, len(parents)):
            kids.setdefault(parents[i], []).append(tokens[i])
        for node in range(len(parents)):
            if node in kids:
                logits[r, node, kids[node][0]] += deep
            free = vocab - 1  # the largest token that is no drafted child (O(children), not O(V))
            while free in kids.get(node, ()):
                free -= 1
            if free >= 0:
                logits[r, node, free] = float("-inf")
        logits[r, len(parents) :] = float("nan")
    return trees, tree, logits


def _repeat(t: torch.Tensor, r: int) -> torch.Tensor:
    return t.repeat_interleave(r, 0)


MC_CASES = {
    "T1": SamplingParams(),
    "top_k3_top_p0.8": SamplingParams(temperature=0.9, top_k=3, top_p=0.8),
    "min_p0.2": SamplingParams(temperature=1.3, min_p=0.2),
}
# The interpreter runs ~20 ms per tree in the exit + bonus kernels: 400 draws per case on CPU
# (a weak but real test: cells with expected count < 5 are merged), 20k on a GPU.
MC_ROWS = 20_000 if DEVICE == "cuda" else 400


def kernel_draws_against_law(name: str, rows: int = MC_ROWS) -> dict:
    """Chi-square of the kernel's (exit node, bonus) over ``rows`` draws of the ``MC_CASES[name]``
    tree against the law enumerated from target continuations (:mod:`.exact_law`).

    The row kernel runs once per distinct tree (its outputs do not depend on the uniforms); its
    per-node outputs are repeated and the exit and bonus kernels draw for every row.

    Returns:
        dict with ``pvalue``, ``accept_mean``, ``accept_bound`` (6 standard
        errors), ``coverage`` (enumerated C_p), ``kernel_coverage``, ``rows``. Also used by
        scripts/gpu_check.py (20k draws on a GPU).
    """
    from ..verify import triton_tev

    sp = MC_CASES[name]
    seed = list(MC_CASES).index(name)
    trees, tree, logits = make_case(300 + seed, 5, sizes=[6], deep=2.0)  # one tree
    launch = triton_tev._prepare(tree.to(DEVICE), logits.to(DEVICE), sp, 4)
    stats = triton_tev._launch_rows(launch)
    big_tree = DraftTree.from_parents(_repeat(tree.parents, rows), _repeat(tree.tokens, rows), _repeat(tree.valid, rows))
    big = triton_tev._prepare(big_tree.to(DEVICE), _repeat(logits, rows).to(DEVICE), sp, 4)
    big_stats = triton_tev._RowStats(*(_repeat(x, rows) for x in stats))
    u = torch.rand(2 * rows, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    ex, bonus, law = triton_tev._launch_decide(big, big_stats, u)
    ex, bonus = ex.cpu(), bonus.cpu()
    probs = processed_probs(logits.double(), sp)
    ref_law = exit_law(tree, probs)
    n, v = logits.shape[1:]
    (parents, tokens), = trees
    exact = np.zeros((n, v))
    exact[: len(parents)] = enumerate_exit_law(parents, tokens, probs[0, : len(parents)].numpy())
    counts = np.zeros((n, v))
    np.add.at(counts, (ex.numpy(), bonus.numpy()), 1)
    acc = big_tree.depth.gather(1, ex[:, None])[:, 0].double()
    return dict(rows=rows, pvalue=chi_square_pvalue(counts, exact), accept_mean=float(acc.mean()),
                accept_bound=6 * float(acc.std()) / rows**0.5 + 1e-9, coverage=float(ref_law.coverage[0]),
                kernel_coverage=float(law.coverage[0].cpu()))
