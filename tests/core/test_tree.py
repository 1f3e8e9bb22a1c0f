"""DraftTree structure and the exit-law identities (paper Eq. 6, 24-26) under Hypothesis."""

from __future__ import annotations

import numpy as np
import torch
from exact_law import random_tree, stack_trees
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tev import DraftTree, exit_law, exit_law_from_edges
from sglang_tev.tree import tree_attention_mask, tree_positions


def reference_depth_and_ancestors(parents):
    n = len(parents)
    depth = [0] * n
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        anc[i, i] = True
        j = i
        while parents[j] >= 0:
            j = parents[j]
            anc[i, j] = True
        if i:
            depth[i] = depth[parents[i]] + 1
    return depth, anc


@settings(derandomize=True, max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), sizes=st.lists(st.integers(1, 14), min_size=1, max_size=4), vocab=st.integers(2, 8))
def test_structure_matches_reference(seed, sizes, vocab):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, n, vocab) for n in sizes]
    tree = stack_trees(trees, max(sizes))
    for r, (parents, _) in enumerate(trees):
        m = len(parents)
        depth, anc = reference_depth_and_ancestors(parents)
        assert tree.depth[r, :m].tolist() == depth
        assert np.array_equal(tree.ancestor_mask[r, :m, :m].numpy(), anc)
        # padded nodes: depth 1, see root and themselves only
        for i in range(m, tree.num_nodes):
            assert int(tree.depth[r, i]) == 1
            row = tree.ancestor_mask[r, i]
            assert bool(row[0]) and bool(row[i]) and int(row.sum()) == 2
        for node in range(m):
            path = tree.path(torch.full((tree.batch_size,), node))[r].tolist()
            want = sorted(np.nonzero(anc[node])[0].tolist(), key=lambda j: depth[j])
            assert path[: len(want)] == want and all(x == -1 for x in path[len(want):])
    assert tree.max_depth == max(max(reference_depth_and_ancestors(p)[0]) for p, _ in trees)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 16), vocab=st.integers(2, 8), sharp=st.floats(0.1, 6.0))
def test_exit_law_identities(seed, n, vocab, sharp):
    rng = np.random.default_rng(seed)
    parents, tokens = random_tree(rng, n, vocab)
    tree = stack_trees([(parents, tokens)], n + 2)  # with two padded nodes
    probs = torch.softmax(torch.from_numpy(rng.normal(size=(1, n + 2, vocab)) * sharp), -1)
    law = exit_law(tree, probs)
    P, w, depth = law.P[0], law.w[0], tree.depth[0]
    # sum w = 1
    assert abs(float(w.sum()) - 1.0) < 1e-12
    # w(v) + sum_children P(u) = P(v)
    for v in range(n):
        kids = [u for u in range(1, n) if parents[u] == v]
        assert abs(float(w[v] + P[kids].sum()) - float(P[v])) < 1e-12
    # sum over subtree(u) of w = P(u)
    anc = tree.ancestor_mask[0]
    for u in range(n):
        sub = [v for v in range(n) if bool(anc[v, u])]
        assert abs(float(w[sub].sum()) - float(P[u])) < 1e-12
    # coverage = sum_{u != root} P(u) = sum_v w(v) depth(v)
    assert abs(float(law.coverage[0]) - float(P[1:n].sum())) < 1e-12
    assert abs(float(law.coverage[0]) - float((w * depth.double()).sum())) < 1e-12
    # the edge form agrees
    edge = torch.zeros(1, n + 2, dtype=torch.float64)
    for u in range(1, n):
        edge[0, u] = probs[0, parents[u], tokens[u]]
    law2 = exit_law_from_edges(tree, edge)
    assert torch.allclose(law2.w, law.w, atol=1e-12) and torch.allclose(law2.P, law.P, atol=0)


def test_exit_law_dtypes():
    rng = np.random.default_rng(0)
    tree = stack_trees([random_tree(rng, 6, 5)], 6)
    p = torch.softmax(torch.randn(1, 6, 5), -1)
    assert exit_law(tree, p.to(torch.bfloat16)).w.dtype == torch.float32
    assert exit_law(tree, p.double()).w.dtype == torch.float64
    assert exit_law(tree, p).w.dtype == torch.float32


def test_root_only_tree():
    tree = DraftTree.from_parents(torch.tensor([[-1]]), torch.tensor([[3]]))
    law = exit_law(tree, torch.full((1, 1, 4), 0.25))
    assert tree.max_depth == 0 and float(law.w[0, 0]) == 1.0 and float(law.coverage[0]) == 0.0


def test_positions_and_attention_mask():
    tree = DraftTree.from_parents(torch.tensor([[-1, 0, 1, 0]]), torch.tensor([[9, 1, 2, 3]]))
    assert tree_positions(tree, 5).tolist() == [[5, 6, 7, 6]]
    m = tree_attention_mask(tree, 2)
    assert m.shape == (1, 1, 4, 6)
    assert m[0, 0, :, :2].all()  # everyone sees the cached context
    assert m[0, 0, 2, 2:].tolist() == [True, True, True, False]  # node 2 sees root, 1, itself
    add = tree_attention_mask(tree, 2, dtype=torch.float32)
    assert float(add[0, 0, 3, 3]) == torch.finfo(torch.float32).min and float(add[0, 0, 3, 2]) == 0.0
