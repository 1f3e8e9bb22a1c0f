"""``sglang_tev.plan.cut_tree``: the first n nodes of a best-first tree are its budget n - 1 tree."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_tev import build_ddtree
from sglang_tev.plan import cut_tree


def test_a_cut_is_the_smaller_budgets_tree():
    logits = torch.randn(2, 7, 20, generator=torch.Generator().manual_seed(0)) * 3
    roots = torch.tensor([1, 2])
    full = build_ddtree(logits, 16, roots)
    for n in (1, 3, 9):
        cut, small = cut_tree(full, n), build_ddtree(logits, n - 1, roots) if n > 1 else None
        assert cut.num_nodes == n
        assert torch.equal(cut.tokens, full.tokens[:, :n]) and torch.equal(cut.parents, full.parents[:, :n])
        if small is not None:  # best-first: the prefix is what a smaller budget builds
            assert torch.equal(cut.tokens, small.tokens) and torch.equal(cut.parents, small.parents)
    assert cut_tree(full, 17) is full and cut_tree(full, 100) is full


def test_a_cut_reads_the_same_depths_ancestors_and_max_depth_as_a_rebuilt_tree():
    """cut_tree slices depth and the ancestor mask instead of rebuilding them: every field equals
    DraftTree.from_parents over the sliced parents, tokens and valid mask, rows with padded tails
    (a tree with fewer nodes than the width) included."""
    from sglang_tev.tree import DraftTree

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 3, generator=g) * 4
    # row 2 stops at depth 2: 3 + 9 nodes, a tree padded past its nodes
    full = build_ddtree(logits, 40, torch.tensor([0, 1, 2]), depth_limit=torch.tensor([6, 6, 2]))
    assert not bool(full.valid.all())  # padded tails are part of the case
    for n in range(1, full.num_nodes):
        cut = cut_tree(full, n)
        ref = DraftTree.from_parents(full.parents[:, :n], full.tokens[:, :n], full.valid[:, :n])
        for name in ("parents", "tokens", "valid", "depth", "ancestor_mask"):
            assert torch.equal(getattr(cut, name), getattr(ref, name)), (n, name)
        assert cut.max_depth == ref.max_depth


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None, math.inf, math.nan, "3"])
def test_a_bad_n_is_one_clear_error(bad):
    tree = build_ddtree(torch.randn(1, 7, 20), 8, torch.tensor([1]))
    with pytest.raises(ValueError, match="n must be an integer"):
        cut_tree(tree, bad)


def test_a_cut_of_a_tree_whose_host_caches_were_read_reads_no_tensor(monkeypatch):
    """Once the planner has read a tree's node scores (and the verifier its host lists), a cut
    takes its max depth from them and carries them cut (no device read: on CUDA a host sync);
    they equal what the cut tree would read, padded tails included; unread caches stay unread."""
    from sglang_tev.tree import DraftTree

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 3, generator=g) * 4
    full = build_ddtree(logits, 40, torch.tensor([0, 1, 2]), depth_limit=torch.tensor([6, 6, 2]))
    scores, host = full.node_scores(), full.host()
    for n in range(1, full.num_nodes):
        ref = DraftTree.from_parents(full.parents[:, :n], full.tokens[:, :n], full.valid[:, :n])
        ref_host = ref.host()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", lambda self: pytest.fail("cut_tree read a tensor"))
            m.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("cut_tree read a tensor"))
            cut = cut_tree(full, n)
            got_host, got = cut.host(), cut.node_scores()
        assert cut.max_depth == ref.max_depth and got_host == ref_host
        assert [tuple(map(list, r)) for r in got] == [tuple(x[: n - 1] for x in r) for r in scores]
        # the same lists the cut's own tensors give (from_parents' tree has no builder's scores)
        for r, (par, _) in zip(got, zip(*ref_host)):
            assert r[3] == [p - 1 for p in par[1:]] and len(r[0]) == len(par) - 1
    fresh = build_ddtree(logits, 40, torch.tensor([0, 1, 2]))
    assert cut_tree(fresh, 5).prefix_caches(5) == (None, None)  # nothing read: nothing carried
    assert host is not None


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None])
def test_prefix_caches_refuses_a_bad_n(bad):
    tree = build_ddtree(torch.randn(1, 7, 20), 8, torch.tensor([1]))
    tree.node_scores(), tree.host()
    with pytest.raises(ValueError, match="n must be an integer"):
        tree.prefix_caches(bad)
