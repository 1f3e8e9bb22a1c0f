"""The exact-law oracle for tests/ (from :mod:`sglang_tev.testing.exact_law`, shared with
scripts/gpu_check.py) and the checks built on it that several tiers use: :func:`check_exact` (a
verifier's exit node and bonus token against the enumerated law, by chi-square) and
:func:`node_laws` (per-node target laws of a one-row tree from plain forwards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_tev import DraftTree, SamplingParams, exit_law, processed_probs, residual_probs, verify_tree
from sglang_tev.testing.exact_law import chi_square_pvalue, enumerate_exit_law, random_tree, stack_trees

__all__ = ["random_tree", "stack_trees", "enumerate_exit_law", "chi_square_pvalue", "check_exact", "node_laws", "repeat_tree",
           "METHODS", "ALPHA", "ROWS"]


def node_laws(target, ctx, tree, law):
    """``(parents, tokens, probs [N, V])`` of a one-row tree: per node v, ``law(logits)`` of the
    target's float64 logits after ``ctx ‖ π(v)`` from a plain forward (no tree mask involved)."""
    parents, tokens = tree.host()
    parents, tokens = parents[0], tokens[0]
    probs = []
    with torch.no_grad():
        for v in range(len(parents)):
            path, u = [], v
            while u > 0:
                path.append(tokens[u])
                u = parents[u]
            lg = target(input_ids=torch.tensor([ctx + path[::-1]])).logits[0, -1].double()
            probs.append(law(lg).numpy())
    return parents, tokens, np.stack(probs)


ALPHA = 1e-6


ROWS = 20_000


METHODS = ["tev", "predraw", "sequential"]


def repeat_tree(tree: DraftTree, r: int) -> DraftTree:
    return DraftTree.from_parents(
        tree.parents.repeat_interleave(r, 0), tree.tokens.repeat_interleave(r, 0), tree.valid.repeat_interleave(r, 0)
    )


def check_exact(trees, tree, logits, sampling, methods=METHODS, rows=ROWS, seed=0):
    b, n, v = logits.shape
    probs = processed_probs(logits, sampling)  # float64
    law = exit_law(tree, probs)
    for r, (parents, tokens) in enumerate(trees):
        m = len(parents)
        exact = enumerate_exit_law(parents, tokens, probs[r, :m].numpy())
        # exit law == enumerated law of the exit node
        np.testing.assert_allclose(law.w[r, :m].numpy(), exact.sum(1), rtol=0, atol=1e-12)
        assert float(law.w[r].sum()) == pytest.approx(1.0, abs=1e-12)
        assert float(law.w[r, m:].abs().sum()) == 0.0  # padding carries no mass
        # residual at every node with w > 0 == enumerated bonus law given that exit node
        for node in range(m):
            if exact[node].sum() > 1e-12:
                res = residual_probs(tree, probs, torch.full((b,), node))[r].numpy()
                np.testing.assert_allclose(res, exact[node] / exact[node].sum(), rtol=0, atol=1e-10)
    # Monte Carlo, every tree of the batch repeated `rows` times in one batched call
    big = repeat_tree(tree, rows)
    big_logits = logits.repeat_interleave(rows, 0)
    big_sampling = _repeat_sampling(sampling, rows)
    for method in methods:
        gen = torch.Generator().manual_seed(seed)
        out = verify_tree(big, big_logits, method=method, sampling=big_sampling, generator=gen)
        _check_outputs_consistent(big, out)
        for r, (parents, tokens) in enumerate(trees):
            m = len(parents)
            sl = slice(r * rows, (r + 1) * rows)
            exact = enumerate_exit_law(parents, tokens, probs[r, :m].numpy())
            counts = np.zeros((n, v))
            np.add.at(counts, (out.exit_node[sl].numpy(), out.bonus[sl].numpy()), 1)
            full = np.zeros((n, v))
            full[:m] = exact
            pval = chi_square_pvalue(counts, full)
            assert pval > ALPHA, f"{method}: chi-square p = {pval:.3g} on tree {r}"
            # E[1 + accept_len] = 1 + C_p
            acc = out.accept_len[sl].double()
            cov = float(law.coverage[r])
            se = float(acc.std()) / rows**0.5 + 1e-9
            assert abs(float(acc.mean()) - cov) < 6 * se, (method, float(acc.mean()), cov)
            assert float(out.coverage[sl][0]) == pytest.approx(cov, abs=1e-9)


def _repeat_sampling(s: SamplingParams, r: int) -> SamplingParams:
    def rep(x):
        return x.repeat_interleave(r) if isinstance(x, torch.Tensor) else x

    return SamplingParams(rep(s.temperature), rep(s.top_k), rep(s.top_p), rep(s.min_p))


def _check_outputs_consistent(tree: DraftTree, out):
    """path is the root-to-exit path, accept_len its depth, and the bonus is not a child token."""
    b, n = tree.parents.shape
    assert out.path.shape == (b, n) and out.path.dtype == torch.int64
    assert torch.equal(out.path[:, 0], torch.zeros(b, dtype=torch.int64))
    assert torch.equal(out.accept_len, tree.depth.gather(1, out.exit_node[:, None])[:, 0])
    length = (out.path >= 0).sum(1)
    assert torch.equal(length, out.accept_len + 1)
    last = out.path.gather(1, out.accept_len[:, None])[:, 0]
    assert torch.equal(last, out.exit_node)
    assert bool(tree.valid.gather(1, out.exit_node[:, None]).all())
    # the bonus never equals a drafted child of the exit node
    is_child = tree.valid & (tree.parents == out.exit_node[:, None])
    is_child[:, 0] = False
    clash = is_child & (tree.tokens == out.bonus[:, None])
    assert not bool(clash.any())
