"""DDTree builder: brute force over all prefixes, the heap reference, and tree invariants."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_tev import build_ddtree, build_ddtree_topk
from sglang_tev.draft.ddtree import build_ddtree_reference


def brute_force(lq: np.ndarray, ids: np.ndarray, budget: int, depth_limit=None, leaf=()):
    """All prefixes of the per-depth lists, sorted by (score desc, rank tuple asc); top `budget`.

    lq/ids must already be ranked (log-prob desc, id asc). Scores accumulate in float64 in
    depth order, like the builders. Prefixes deeper than ``depth_limit`` or with a ``leaf``
    token before their last position do not exist.
    """
    H, k = lq.shape
    items = []
    for d in range(1, (H if depth_limit is None else min(H, depth_limit)) + 1):
        for ranks in itertools.product(range(k), repeat=d):
            if any(int(ids[j, r]) in leaf for j, r in enumerate(ranks[:-1])):
                continue
            s = 0.0
            for j, r in enumerate(ranks):
                s = s + float(lq[j, r])
            items.append((-s, ranks))
    items.sort()
    chosen = [r for _, r in items[:budget]]
    index = {r: i + 1 for i, r in enumerate(chosen)}
    parents = [-1] + [index.get(r[:-1], 0) for r in chosen]
    tokens = [int(ids[len(r) - 1, r[-1]]) for r in chosen]
    return parents, tokens


def ranked(lq, ids):
    o = np.lexsort((ids, -lq), axis=-1)
    return np.take_along_axis(lq, o, -1), np.take_along_axis(ids, o, -1)


def tree_lists(tree, r):
    n = int(tree.valid[r].sum())
    return tree.parents[r, :n].tolist(), tree.tokens[r, :n].tolist()


@settings(derandomize=True, max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    H=st.integers(1, 4),
    k=st.integers(1, 3),
    budget=st.integers(0, 30),
    tied=st.booleans(),
    impl=st.sampled_from(["heap", "levels"]),
)
def test_equals_brute_force_with_ties(seed, H, k, budget, tied, impl):
    rng = np.random.default_rng(seed)
    b = 3
    if tied:  # a small set of values makes equal scores common
        lq = rng.choice(np.log([0.5, 0.25, 0.125]), size=(b, H, k)).astype(np.float32)
    else:
        lq = np.log(rng.dirichlet(np.ones(8), size=(b, H))[..., :k]).astype(np.float32)
    ids = np.stack([np.stack([rng.permutation(8)[:k] for _ in range(H)]) for _ in range(b)])
    roots = torch.tensor([1, 2, 3])
    tree = build_ddtree_topk(torch.from_numpy(lq), torch.from_numpy(ids).long(), budget, roots, impl=impl)
    assert tree.num_nodes == 1 + budget
    for r in range(b):
        lr, ir = ranked(lq[r].astype(np.float64), ids[r])
        p_bf, t_bf = brute_force(lr, ir, budget)
        p, t = tree_lists(tree, r)
        assert p == p_bf and t[1:] == t_bf and t[0] == r + 1
        p_ref, t_ref = build_ddtree_reference(torch.from_numpy(lq[r]), torch.from_numpy(ids[r]).long(), budget, r + 1)
        assert p == p_ref and t == t_ref


@pytest.mark.parametrize("impl", ["heap", "levels"])
def test_matches_reference_on_random_logits(impl):
    """Same nodes in the same order as the heap reference (with the reference's own sibling
    arithmetic too) at real sizes: H = 15, V = 512, budgets up to 128."""
    g = torch.Generator().manual_seed(0)
    for budget in [1, 7, 32, 64, 128]:
        logits = torch.randn(4, 15, 512, generator=g) * 3
        roots = torch.arange(4)
        tree = build_ddtree(logits, budget, roots, impl=impl)
        k = min(budget, 512)
        vals, ids = torch.topk(torch.log_softmax(logits, -1), k)
        for r in range(4):
            p, t = tree_lists(tree, r)
            for upstream in (False, True):
                ref = build_ddtree_reference(vals[r], ids[r], budget, r, upstream_arithmetic=upstream)
                assert (p, t) == ref, (budget, r, upstream)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), H=st.integers(1, 6), V=st.integers(2, 12), budget=st.integers(0, 40))
def test_invariants(seed, H, V, budget):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, H, V, generator=g) * 2
    logits[0, 0, 0] = float("-inf")  # -inf entries are valid draft logits
    tree = build_ddtree(logits, budget, torch.tensor([0, 1]))
    logq = torch.log_softmax(logits.float(), -1).double()
    for r in range(2):
        p, t = tree_lists(tree, r)
        n = len(p)
        # count: min(budget, number of prefixes)
        total = sum(V**d for d in range(1, H + 1))
        assert n - 1 == min(budget, total)
        assert bool(tree.valid[r, :n].all()) and not bool(tree.valid[r, n:].any())
        seen = set()
        scores = [0.0]
        for i in range(1, n):
            assert 0 <= p[i] < i  # parents precede children
            assert (p[i], t[i]) not in seen  # distinct sibling tokens
            seen.add((p[i], t[i]))
            d = int(tree.depth[r, i])
            assert d <= H
            scores.append(scores[p[i]] + float(logq[r, d - 1, t[i]]))
        s = scores[1:]
        assert all(a >= b for a, b in zip(s, s[1:]))  # pop order: scores non-increasing


def test_budget_zero_is_root_only():
    tree = build_ddtree(torch.randn(2, 3, 5), 0, torch.tensor([4, 2]))
    assert tree.num_nodes == 1 and tree.tokens[:, 0].tolist() == [4, 2] and tree.max_depth == 0


@settings(derandomize=True, max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), H=st.integers(1, 4), k=st.integers(1, 3), budget=st.integers(0, 30),
       impl=st.sampled_from(["heap", "levels"]))
def test_depth_limit_and_leaf_tokens_equal_brute_force(seed, H, k, budget, impl):
    """Per-tree depth limits and leaf (stop) tokens: the tree is the top-`budget` prefixes among
    those that exist (no prefix deeper than the limit, none continuing past a leaf token), for
    both implementations and the heap reference; no node ever has a leaf-token parent."""
    rng = np.random.default_rng(seed)
    b = 3
    lq = np.log(rng.dirichlet(np.ones(6), size=(b, H))[..., :k]).astype(np.float32)
    ids = np.stack([np.stack([rng.permutation(6)[:k] for _ in range(H)]) for _ in range(b)])
    limits = [int(x) for x in rng.integers(0, H + 1, size=b)]
    leaves = [[int(x) for x in rng.choice(6, size=2, replace=False)] for _ in range(b)]
    tree = build_ddtree_topk(torch.from_numpy(lq), torch.from_numpy(ids).long(), budget, torch.tensor([1, 2, 3]),
                             depth_limit=torch.tensor(limits), leaf_tokens=torch.tensor(leaves), impl=impl)
    for r in range(b):
        lr, ir = ranked(lq[r].astype(np.float64), ids[r])
        p_bf, t_bf = brute_force(lr, ir, budget, limits[r], set(leaves[r]))
        p, t = tree_lists(tree, r)
        assert p == p_bf and t[1:] == t_bf
        ref = build_ddtree_reference(torch.from_numpy(lq[r]), torch.from_numpy(ids[r]).long(), budget, r + 1,
                                     depth_limit=limits[r], leaf_tokens=leaves[r])
        assert (p, t) == ref
        assert all(t[p[i]] not in leaves[r] for i in range(1, len(p)) if p[i] > 0)


def test_heap_and_levels_give_identical_tree_tensors():
    """Every DraftTree field, the ancestor mask included, is the same for both implementations."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 64, generator=g) * 2
    logits[1, :, :40] = float("-inf")  # -inf log-probabilities inside the lists
    for budget in [1, 5, 33]:
        a = build_ddtree(logits, budget, torch.tensor([0, 1, 2]), impl="heap")
        c = build_ddtree(logits, budget, torch.tensor([0, 1, 2]), impl="levels")
        for f in ("parents", "tokens", "valid", "depth", "ancestor_mask"):
            assert torch.equal(getattr(a, f), getattr(c, f)), (budget, f)
        assert a.max_depth == c.max_depth


def test_bad_builder_options():
    v, i = torch.randn(2, 3, 4).log_softmax(-1), torch.arange(4).expand(2, 3, 4).clone()
    with pytest.raises(ValueError, match="impl"):
        build_ddtree_topk(v, i, 4, torch.tensor([0, 1]), impl="fast")
    with pytest.raises(ValueError, match="depth_limit"):
        build_ddtree_topk(v, i, 4, torch.tensor([0, 1]), depth_limit=torch.tensor([1]))
    with pytest.raises(ValueError, match="leaf_tokens"):
        build_ddtree_topk(v, i, 4, torch.tensor([0, 1]), leaf_tokens=torch.tensor([1, 2]))


def _full_ranked_heap(logq, budget, roots, limit, leaf):
    """The heap on every depth's full ranked list (log q desc, id asc), cut at min(budget, V)."""
    lqn = logq.numpy()
    ids = np.broadcast_to(np.arange(lqn.shape[-1]), lqn.shape)
    o = np.lexsort((ids, -lqn), axis=-1)[..., : min(budget, lqn.shape[-1])]
    vals = torch.from_numpy(np.take_along_axis(lqn, o, -1).copy())
    toks = torch.from_numpy(np.take_along_axis(ids, o, -1).copy())
    return build_ddtree_topk(vals, toks, budget, roots, depth_limit=limit, leaf_tokens=leaf, impl="heap")


def _random_draft_cases(n_cases: int):
    g = torch.Generator().manual_seed(7)
    for trial in range(n_cases):
        b, H = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 16, (1,), generator=g))
        V = [3, 7, 64, 100, 512, 4096][trial % 6]
        budget = [1, 2, 5, 16, 64, 130][int(torch.randint(0, 6, (1,), generator=g))]
        logits = torch.randn(b, H, V, generator=g) * [0.1, 1, 3, 10][trial % 4]
        if trial % 5 == 0:
            logits = (logits * 2).round() / 2  # exact ties within and across depths
        if trial % 7 == 0:
            logits[:, :, : V // 2] = float("-inf")
        if trial % 11 == 0:
            logits[:] = 0.0  # a flat law: every token ties
        limit = torch.randint(0, H + 1, (b,), generator=g) if trial % 3 == 0 else None
        leaf = None
        if trial % 4 == 1:  # stop tokens on the argmax chain, some slots unused
            leaf = torch.stack([logits[r].argmax(-1)[torch.randint(0, H, (2,), generator=g)] for r in range(b)])
            leaf[:, 1] = torch.where(torch.rand(b, generator=g) < 0.5, leaf[:, 1], -1)
        yield logits, budget, limit, leaf


def _assert_same_tree(a, c, what):
    for f in ("parents", "tokens", "valid", "depth", "ancestor_mask"):
        assert torch.equal(getattr(a, f), getattr(c, f)), (what, f)
    assert a.max_depth == c.max_depth, what


def test_host_builders_equal_the_heap_on_full_lists():
    """The CPU builders read only the tokens their bound lets through (the C one and its Python
    twin): their trees equal the heap's on every depth's full ranked list, with ties, -inf, flat
    laws, depth limits and stop tokens on the chain, for vocabularies off the block width."""
    import shutil

    from sglang_tev.draft import ddtree as dd
    from sglang_tev.native import native_builder

    fn = native_builder()
    if fn is None and (shutil.which("cc") or shutil.which("gcc")):
        raise AssertionError("a C compiler is here but the native DDTree builder did not build")
    for i, (logits, budget, limit, leaf) in enumerate(_random_draft_cases(240)):
        roots = torch.arange(logits.shape[0])
        logq = torch.log_softmax(logits, -1)
        ref = _full_ranked_heap(logq, budget, roots, limit, leaf)
        lq_rows, id_rows = dd._ranked_survivors(logq, budget, limit, leaf)
        _assert_same_tree(dd._build_heap(lq_rows, id_rows, budget, roots, limit, leaf), ref, ("python", i))
        if fn is not None:
            _assert_same_tree(dd._build_native(fn, logq, budget, roots, limit, leaf), ref, ("native", i))
        assert all(len(row) <= min(budget, logits.shape[-1]) for rows in lq_rows for row in rows)


def test_native_builder_off_or_unbuildable_falls_back(tmp_path):
    """SGLANG_TEV_NATIVE=0, or a compiler that fails, leaves the Python builder (same trees)."""
    import os
    import subprocess
    import sys

    code = ("import torch; from sglang_tev.native import native_builder; "
            "from sglang_tev import build_ddtree; assert native_builder() is None; "
            "t = build_ddtree(torch.randn(2, 5, 300), 9, torch.tensor([0, 1])); "
            "print(t.parents.tolist(), t.tokens.tolist())")
    base = dict(os.environ, SGLANG_TEV_CACHE=str(tmp_path / "cache"))
    outs = []
    for extra in ({"SGLANG_TEV_NATIVE": "0"}, {"CC": "false"}):
        env = dict(base, **extra)
        outs.append(subprocess.run([sys.executable, "-c", code.replace("torch.randn(2, 5, 300)",
                                    "torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(3))")],
                                   env=env, capture_output=True, text=True, check=True).stdout)
    assert outs[0] == outs[1] and outs[0].startswith("[[-1")
    g = torch.Generator().manual_seed(3)
    t = build_ddtree(torch.randn(2, 5, 300, generator=g), 9, torch.tensor([0, 1]))
    assert outs[0].strip() == f"{t.parents.tolist()} {t.tokens.tolist()}"
    assert not list((tmp_path / "cache").glob("*.so"))  # the failed build left nothing behind


def test_host_lists_of_built_trees_equal_the_tensors():
    """DraftTree.host() of trees from every builder path (native, Python heap, levels) equals
    the lists read from the tensors."""
    from sglang_tev import DraftTree

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 200, generator=g) * 3
    for impl in ("auto", "heap", "levels"):
        tree = build_ddtree(logits, 11, torch.tensor([5, 6, 7]), impl=impl, depth_limit=torch.tensor([6, 1, 0]))
        fresh = DraftTree(tree.parents, tree.tokens, tree.valid, tree.depth, tree.ancestor_mask, tree.max_depth)
        assert tree.host() == fresh.host(), impl
        assert [len(p) for p in fresh.host()[0]] == tree.valid.sum(1).tolist() == [12, 12, 1]


def test_host_builders_agree_on_nan_log_probs():
    """validate=False with NaN in the draft law (NaN reads as -inf on both host paths): the C and
    Python builders give the same tree and neither crashes."""
    from sglang_tev.draft import ddtree as dd
    from sglang_tev.native import native_builder

    fn = native_builder()
    if fn is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(5)
    for budget in (1, 7, 100):
        logq = torch.log_softmax(torch.randn(3, 4, 300, generator=g) * 3, -1)
        logq[0, 1] = float("nan")  # a whole depth
        logq[1, 0, ::7] = float("nan")  # some tokens, the first included
        logq[2, 2, 5:] = float("nan")
        roots = torch.tensor([1, 2, 3])
        lq_rows, id_rows = dd._ranked_survivors(logq, budget, None, None)
        a = dd._build_heap(lq_rows, id_rows, budget, roots, None, None)
        _assert_same_tree(dd._build_native(fn, logq, budget, roots, None, None), a, budget)
        assert int(a.valid[0].sum()) == 1 + min(budget, 300)  # depth 1 still fills the budget


def test_builder_option_shapes_are_checked_on_every_path():
    """A depth_limit / leaf_tokens / root_tokens of the wrong batch size is an error naming it, with
    validate=True and, on the C path (which would read past them), with validate=False too."""
    logits = torch.randn(4, 3, 50)
    roots = torch.arange(4)
    for kw in ({"depth_limit": torch.tensor([3])}, {"leaf_tokens": torch.tensor([[1, 2]])}):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=name):
            build_ddtree(logits, 8, roots, **kw)
        with pytest.raises(ValueError, match=name):
            build_ddtree(logits, 8, roots, validate=False, **kw)
    with pytest.raises(ValueError, match="root_tokens"):
        build_ddtree(logits, 8, torch.arange(2), validate=False)


def test_native_library_that_does_not_load_is_rebuilt(tmp_path):
    """A truncated file under the library's name is replaced by a fresh build (when a compiler
    is here), and older builds in the cache are removed."""
    import hashlib
    import os
    import shutil
    import subprocess
    import sys

    import sglang_tev.native as native_mod

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here")
    digest = hashlib.sha256(open(native_mod._SOURCE, "rb").read()).hexdigest()[:16]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"host_ops-{digest}.so").write_bytes(b"not a library")
    (cache / "host_ops-0123456789abcdef.so").write_bytes(b"an old build")
    code = "from sglang_tev.native import native_builder; assert native_builder() is not None"
    subprocess.run([sys.executable, "-c", code], env=dict(os.environ, SGLANG_TEV_CACHE=str(cache)), check=True)
    assert sorted(p.name for p in cache.iterdir()) == [f"host_ops-{digest}.so"]
    assert (cache / f"host_ops-{digest}.so").stat().st_size > 1000
