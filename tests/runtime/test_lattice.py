"""Trees over a DFlash2 candidate lattice (issue 28 item 2; sglang_tev/draft/lattice.py).

The lattice builder's two implementations (host heap, level-wise device search) equal a brute
force over every path of candidate indices; the device one traces into one graph with no
data-dependent op and makes no host sync; parent-dependent child lists matter (negative controls);
the marginal mode and DFlash2's own chain do what their docstrings say; and TEV, predraw,
sequential and greedy verification stay exact on lattice-built trees (enumeration + chi-square,
DESIGN §7, with the helpers of tests/core/test_verify_exact.py).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from exact_law import chi_square_pvalue, stack_trees
from hypothesis import given, settings
from hypothesis import strategies as st
from graph_checks import REFUSED, assert_same, compiled
from exact_law import check_exact

from sglang_tev import DraftTree, SamplingParams, build_ddtree_topk, verify_tree
from sglang_tev.draft.lattice import build_lattice_tree, build_marginal_tree, lattice_marginals, selector_chain
from sglang_tev.testing.host_sync import HostSyncCounter, gpu_code_paths

TIED = np.log([1.0, 0.5, 0.25, 0.125])


# ------------------------------------------------------------------------------ brute force
def row_ranks(lq_row: np.ndarray, ids_row: np.ndarray) -> dict[int, int]:
    """{candidate index: rank} of one transition row, by (log q desc, token id asc)."""
    order = sorted(range(len(ids_row)), key=lambda c: (-float(lq_row[c]), int(ids_row[c])))
    return {c: r for r, c in enumerate(order)}


def brute_force(lq: np.ndarray, ids: np.ndarray, budget: int, depth_limit=None, leaf=()):
    """Every path of candidate indices up to the depth limit (none continuing past a leaf token),
    sorted by (score desc, rank tuple asc), the top ``budget``; scores summed in float64 in depth
    order from float32 values. lq: [D, K, K] (slot 0: row 0), ids: [D, K]."""
    D, K = ids.shape
    lq = lq.astype(np.float32).astype(np.float64)
    ranks = {(j, p): row_ranks(lq[j, p], ids[j]) for j in range(D) for p in range(K)}
    items = []
    for d in range(1, (D if depth_limit is None else min(D, depth_limit)) + 1):
        for path in itertools.product(range(K), repeat=d):
            if any(int(ids[j, c]) in leaf for j, c in enumerate(path[:-1])):
                continue
            s, rk = 0.0, []
            for j, c in enumerate(path):
                p = path[j - 1] if j else 0
                s = s + float(lq[j, p, c])
                rk.append(ranks[(j, p)][c])
            items.append((-s, tuple(rk), path))
    items.sort(key=lambda x: (x[0], x[1]))
    chosen = [p for _, _, p in items[:budget]]
    index = {p: i + 1 for i, p in enumerate(chosen)}
    parents = [-1] + [index.get(p[:-1], 0) for p in chosen]
    tokens = [int(ids[len(p) - 1, p[-1]]) for p in chosen]
    return parents, tokens


def tree_lists(tree, r):
    n = int(tree.valid[r].sum())
    return tree.parents[r, :n].tolist(), tree.tokens[r, :n].tolist()


def random_lattice(rng, b, D, K, vocab=8, tied=False, neg_inf=False):
    ids = np.stack([np.stack([rng.permutation(vocab)[:K] for _ in range(D)]) for _ in range(b)])
    if tied:  # few distinct values: equal scores across rows, depths and paths are common
        lq = rng.choice(TIED, size=(b, D, K, K))
    else:
        lq = np.log(rng.dirichlet(np.ones(K), size=(b, D, K)))
    if neg_inf:
        lq[rng.random(lq.shape) < 0.2] = -np.inf
    return torch.from_numpy(ids).long(), torch.from_numpy(lq.astype(np.float32))


def assert_same_tree(a, c, what=""):
    for f in ("parents", "tokens", "valid", "depth", "ancestor_mask"):
        assert torch.equal(getattr(a, f), getattr(c, f)), (what, f)
    assert a.max_depth == c.max_depth, what


# ------------------------------------------------------------------------------ the builder
@settings(derandomize=True, max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31), D=st.integers(1, 4), K=st.integers(1, 3), budget=st.integers(0, 40),
       tied=st.booleans(), options=st.booleans(), impl=st.sampled_from(["heap", "levels"]))
def test_equals_brute_force(seed, D, K, budget, tied, options, impl):
    """Both implementations = the brute force, with ties, -inf log-q, per-tree depth limits and
    stop tokens (no node below a stop token); the ancestor mask is the one from_parents builds."""
    rng = np.random.default_rng(seed)
    b = 3
    ids, lq = random_lattice(rng, b, D, K, tied=tied, neg_inf=seed % 5 == 0)
    limits = leaves = None
    if options:
        limits = torch.from_numpy(rng.integers(0, D + 1, size=b))
        leaves = torch.from_numpy(np.stack([rng.choice(8, size=2, replace=False) for _ in range(b)]))
        leaves[0, 1] = -1  # an unused slot
    roots = torch.tensor([5, 6, 7])
    tree = build_lattice_tree(ids, lq, budget, roots, depth_limit=limits, leaf_tokens=leaves, impl=impl)
    assert tree.num_nodes == 1 + budget
    for r in range(b):
        lim = None if limits is None else int(limits[r])
        leaf = set() if leaves is None else {int(x) for x in leaves[r] if x >= 0}
        p_bf, t_bf = brute_force(lq[r].numpy(), ids[r].numpy(), budget, lim, leaf)
        p, t = tree_lists(tree, r)
        assert p == p_bf and t[1:] == t_bf and t[0] == int(roots[r]), r
        assert all(t[p[i]] not in leaf for i in range(1, len(p)) if p[i] > 0)
    ref = DraftTree.from_parents(tree.parents, tree.tokens, tree.valid)
    assert_same_tree(tree, ref)


def test_heap_and_levels_identical_at_real_sizes():
    """D = 15 slots, K = 16 candidates (selector_top_k), budgets up to 128, depth caps and stop
    tokens on the greedy path: every DraftTree field equal."""
    rng = np.random.default_rng(1)
    for trial, budget in enumerate([1, 16, 64, 128]):
        ids, lq = random_lattice(rng, 3, 15, 16, vocab=64, tied=trial == 2)
        lq = torch.log_softmax(lq * 3, -1) if trial != 2 else lq
        limits = torch.tensor([15, 4, 0]) if trial % 2 else None
        leaves = ids[:, 2, :2].clone() if trial >= 2 else None
        a = build_lattice_tree(ids, lq, budget, torch.arange(3), depth_limit=limits, leaf_tokens=leaves, impl="heap")
        c = build_lattice_tree(ids, lq, budget, torch.arange(3), depth_limit=limits, leaf_tokens=leaves, impl="levels")
        assert_same_tree(a, c, budget)
        assert a.host() == DraftTree(a.parents, a.tokens, a.valid, a.depth, a.ancestor_mask, a.max_depth).host()
    assert a.max_depth >= 3


def test_parent_dependent_lists_change_the_tree():
    """Negative control. Slot 1 continues candidate 1 almost surely but candidate 0 only 50/50: the
    lattice tree extends candidate 1 first; the same builder on slot 1's row 0 for every parent
    (a parent-independent list, what the DDTree builder on per-slot lists does) extends candidate 0."""
    ids = torch.tensor([[[10, 11], [20, 21]]])
    lq = torch.log(torch.tensor([[[[0.6, 0.4], [0.6, 0.4]], [[0.5, 0.5], [0.99, 0.01]]]]))
    tree = build_lattice_tree(ids, lq, 3, torch.tensor([1]))
    assert tree_lists(tree, 0) == ([-1, 0, 0, 2], [1, 10, 11, 20])
    flat = lq.clone()
    flat[:, 1, 1] = flat[:, 1, 0]
    for impl in ("heap", "levels"):
        assert tree_lists(build_lattice_tree(ids, flat, 3, torch.tensor([1]), impl=impl), 0) == ([-1, 0, 0, 1], [1, 10, 11, 20])
        ddt = build_ddtree_topk(flat[:, :, 0], ids, 3, torch.tensor([1]), impl=impl)
        assert tree_lists(ddt, 0) == ([-1, 0, 0, 1], [1, 10, 11, 20])
    # on random lattices the parent-independent list gives another tree most of the time
    rng = np.random.default_rng(2)
    differ = 0
    for _ in range(20):
        ids, lq = random_lattice(rng, 1, 4, 3)
        a = build_lattice_tree(ids, lq, 12, torch.tensor([0]))
        c = build_ddtree_topk(lq[:, :, 0], ids, 12, torch.tensor([0]))
        differ += tree_lists(a, 0) != tree_lists(c, 0)
    assert differ >= 10


@settings(derandomize=True, max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), D=st.integers(1, 4), K=st.integers(1, 4), budget=st.integers(0, 30),
       impl=st.sampled_from(["heap", "levels"]))
def test_parent_independent_lattice_is_the_ddtree(seed, D, K, budget, impl):
    """Every row of a slot equal (slot 0's rows >= 1 garbage, even NaN): the lattice tree is the
    DDTree builder's tree on those rows."""
    rng = np.random.default_rng(seed)
    ids, lq = random_lattice(rng, 2, D, K, tied=seed % 2 == 0)
    rows = lq[:, :, :1].expand(2, D, K, K).clone()
    rows[:, 0, 1:] = float("nan")
    a = build_lattice_tree(ids, rows, budget, torch.tensor([3, 4]), impl=impl)
    c = build_ddtree_topk(lq[:, :, 0], ids, budget, torch.tensor([3, 4]), impl=impl)
    assert_same_tree(a, c)


def test_bad_arguments():
    ids, lq = random_lattice(np.random.default_rng(0), 2, 3, 2)
    roots = torch.tensor([0, 1])
    cases = [
        ("budget", dict(budget=-1)), ("budget", dict(budget=2.0)),
        ("candidate_ids", dict(candidate_ids=ids.int())),
        ("candidate_ids", dict(candidate_ids=torch.stack([ids[..., 0], ids[..., 0]], -1))),  # repeated in a slot
        ("candidate_ids", dict(candidate_ids=-ids - 1)),
        ("trans_logq", dict(trans_logq=lq[..., :1])),
        ("trans_logq", dict(trans_logq=lq.clamp(max=-0.1) + 0.2)),  # positive: not log-probabilities
        ("trans_logq", dict(trans_logq=torch.where(torch.arange(2) == 0, float("nan"), lq))),
        ("root_tokens", dict(root_tokens=torch.tensor([0]))),
        ("depth_limit", dict(depth_limit=torch.tensor([1]))),
        ("leaf_tokens", dict(leaf_tokens=torch.tensor([1, 2]))),
        ("impl", dict(impl="fast")),
    ]
    for name, kw in cases:
        args = dict(candidate_ids=ids, trans_logq=lq, budget=4, root_tokens=roots) | kw
        with pytest.raises(ValueError, match=name):
            build_lattice_tree(**args)
    with pytest.raises(ValueError, match="unary_logq"):
        build_marginal_tree(ids, 4, roots)
    with pytest.raises(ValueError, match="unary_logq"):
        build_marginal_tree(ids, 4, roots, trans_logq=lq, unary_logq=lq[..., 0])
    with pytest.raises(ValueError, match="unary_logq"):
        build_marginal_tree(ids, 4, roots, unary_logq=lq[:, :2, 0])
    with pytest.raises(ValueError, match="trans_logq"):
        lattice_marginals(lq[..., 0])
    with pytest.raises(ValueError, match="temperature"):
        selector_chain(ids, lq, roots, -0.5)
    with pytest.raises(ValueError, match="temperature"):
        selector_chain(ids, lq, roots, torch.ones(3))
    with pytest.raises(ValueError, match="uniforms"):
        selector_chain(ids, lq, roots, 1.0, uniforms=torch.rand(2, 3))  # float32
    # slot 0's rows >= 1 are ignored, NaN included
    bad0 = lq.clone()
    bad0[:, 0, 1] = float("nan")
    assert_same_tree(build_lattice_tree(ids, bad0, 5, roots), build_lattice_tree(ids, lq, 5, roots))


# ------------------------------------------------------------------------- the device path
def test_device_path_compiles_fullgraph_and_makes_no_host_sync():
    """Under gpu_code_paths (the choosers a CUDA device takes): build_lattice_tree (levels, with
    depth caps and stop tokens), build_marginal_tree, lattice_marginals and selector_chain (greedy,
    sampled with uniforms as an argument, per-request temperatures) trace into one graph with no
    data-dependent op, equal eager, and the eager calls make no blocking call from sglang_tev/."""
    rng = np.random.default_rng(3)
    b, D, K, B = 3, 5, 4, 12
    ids, lq = random_lattice(rng, b, D, K, vocab=16)
    roots = torch.tensor([1, 2, 3])
    caps = torch.tensor([5, 2, 0])
    leaves = ids[:, 1, :1].clone()
    u = torch.rand(b, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    temps = torch.tensor([0.0, 0.7, 1.3])
    calls = {
        "lattice": (lambda i, q, r, c, s: build_lattice_tree(i, q, B, r, False, depth_limit=c, leaf_tokens=s),
                    (ids, lq, roots, caps, leaves)),
        "lattice, no options": (lambda i, q, r: build_lattice_tree(i, q, B, r, False), (ids, lq, roots)),
        "marginal": (lambda i, q, r: build_marginal_tree(i, B, r, False, trans_logq=q), (ids, lq, roots)),
        "marginals": (lattice_marginals, (lq,)),
        "chain greedy": (lambda i, q, r, s: selector_chain(i, q, r, 0.0, validate=False, leaf_tokens=s), (ids, lq, roots, leaves)),
        "chain sampled": (lambda i, q, r, u: selector_chain(i, q, r, 0.8, validate=False, uniforms=u), (ids, lq, roots, u)),
        "chain per request": (lambda i, q, r, t, u: selector_chain(i, q, r, t, validate=False, uniforms=u, depth_limit=caps),
                              (ids, lq, roots, temps, u)),
    }
    with gpu_code_paths():
        for name, (fn, args) in calls.items():
            out = fn(*args)
            assert_same(compiled(fn)(*args), out), name
            with HostSyncCounter(include=("sglang_tev/",)) as c:
                fn(*args)
            assert c.events == [], (name, c.format())
        tree = calls["lattice"][0](*calls["lattice"][1])
        assert tree.max_depth == min(D, B)  # the static bound
    assert_same_tree(DraftTree.from_parents(tree.parents, tree.tokens, tree.valid), build_lattice_tree(
        ids, lq, B, roots, depth_limit=caps, leaf_tokens=leaves, impl="heap"))


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_the_device_checks_fail_on_the_host_path():
    """The checks are not vacuous: the CPU heap (NumPy, .tolist()) is refused by the compile check,
    the level-wise build with the exact max depth fails the data-dependent-op check, and the
    counter sees the host reads."""
    ids, lq = random_lattice(np.random.default_rng(4), 2, 3, 3)
    roots = torch.tensor([0, 1])
    with pytest.raises(REFUSED):
        compiled(lambda i, q, r: build_lattice_tree(i, q, 6, r, False))(ids, lq, roots)
    with pytest.raises(REFUSED, match="data-dependent"):
        compiled(lambda i, q, r: build_lattice_tree(i, q, 6, r, False, impl="levels"))(ids, lq, roots)
    with HostSyncCounter(include=("sglang_tev/",)) as c:
        build_lattice_tree(ids, lq, 6, roots, False)
        selector_chain(ids, lq, roots, 0.0, validate=False)
    files = {e.file.rsplit("sglang_tev/", 1)[1] for e in c.events}
    assert {"draft/lattice.py", "draft/ddtree.py"} <= files, c.format()


# -------------------------------------------------------------------- marginal mode and chain
def test_marginals_are_the_walks_law_and_marginal_mode_is_the_ddtree():
    rng = np.random.default_rng(5)
    b, D, K = 2, 3, 3
    ids, lq = random_lattice(rng, b, D, K)
    lq = torch.log_softmax(lq.double(), -1)  # rows normalised in float64: the enumeration sums whole paths
    m = lattice_marginals(lq)
    assert m.dtype == torch.float64 and m.shape == (b, D, K)
    want = np.zeros((b, D, K))
    for r in range(b):
        for path in itertools.product(range(K), repeat=D):
            pr = np.exp(sum(float(lq[r, j, path[j - 1] if j else 0, c]) for j, c in enumerate(path)))
            for j, c in enumerate(path):
                want[r, j, c] += pr
    np.testing.assert_allclose(m.exp().numpy(), want, rtol=0, atol=1e-12)
    assert lattice_marginals(lq.float()).dtype == torch.float32
    roots = torch.tensor([0, 1])
    for impl in ("heap", "levels"):
        a = build_marginal_tree(ids, 9, roots, trans_logq=lq, impl=impl)
        assert_same_tree(a, build_ddtree_topk(m, ids, 9, roots, impl=impl))
        u = torch.log_softmax(torch.randn(b, D, K, generator=torch.Generator().manual_seed(1)), -1)
        assert_same_tree(build_marginal_tree(ids, 9, roots, unary_logq=u, impl=impl),
                         build_ddtree_topk(u, ids, 9, roots, impl=impl))
    assert tree_lists(a, 0) != tree_lists(build_lattice_tree(ids, lq, 9, roots), 0)  # the selector matters here


def walk(lq, ids, pick):
    """Python walk: pick(row) -> candidate index; returns the chain's tokens."""
    toks, p = [], 0
    for j in range(ids.shape[0]):
        c = pick(lq[j, p if j else 0])
        toks.append(int(ids[j, c]))
        p = c
    return toks


def test_greedy_chain_is_the_selectors_argmax_walk():
    rng = np.random.default_rng(6)
    ids, lq = random_lattice(rng, 4, 5, 4, vocab=16, tied=True)  # ties: the lowest candidate index wins
    roots = torch.arange(4)
    tree = selector_chain(ids, lq, roots)
    assert tree.num_nodes == 6 and tree.max_depth == 5
    for r in range(4):
        want = walk(lq[r].numpy(), ids[r].numpy(), lambda row: int(np.argmax(row)))
        assert tree_lists(tree, r) == ([-1, 0, 1, 2, 3, 4], [r] + want)
    assert_same_tree(tree, DraftTree.from_parents(tree.parents, tree.tokens, tree.valid))
    # depth caps and stop tokens cut the chain (the stop token itself stays, as a leaf)
    caps = torch.tensor([5, 3, 0, 5])
    stop = tree.tokens[:, 2:3].clone()  # the chain's second token
    stop[0] = -1
    cut = selector_chain(ids, lq, roots, 0.0, depth_limit=caps, leaf_tokens=stop)
    assert cut.valid.sum(1).tolist() == [6, 3, 1, 3]
    assert_same_tree(cut, DraftTree.from_parents(cut.parents, cut.tokens, cut.valid))
    # per-request temperatures: T = 0 rows are greedy whatever the uniforms
    mixed = selector_chain(ids, lq, roots, torch.tensor([0.0, 1.0, 0.0, 1.0]), generator=torch.Generator().manual_seed(0))
    assert torch.equal(mixed.tokens[[0, 2]], tree.tokens[[0, 2]])


def test_sampled_chain_follows_the_walks_law():
    """At T = 0.7 the chain's law is prod_d softmax(row_d / T)[c_d]: chi-square over all K^D
    chains from 20k rows; the uniforms are the only randomness."""
    rng = np.random.default_rng(7)
    D, K, T, rows = 3, 3, 0.7, 20_000
    ids, lq = random_lattice(rng, 1, D, K)
    big_ids, big_lq = ids.expand(rows, D, K), lq.expand(rows, D, K, K)
    tree = selector_chain(big_ids, big_lq, torch.zeros(rows, dtype=torch.int64), T,
                          generator=torch.Generator().manual_seed(0))
    index = {int(t): c for c, t in enumerate(ids[0, 0])}, {int(t): c for c, t in enumerate(ids[0, 1])}, \
        {int(t): c for c, t in enumerate(ids[0, 2])}
    codes = [sum(index[j][int(t)] * K ** j for j, t in enumerate(row[1:])) for row in tree.tokens.tolist()]
    counts = np.bincount(codes, minlength=K ** D)
    probs = np.zeros(K ** D)
    x = lq[0].double().numpy()
    for path in itertools.product(range(K), repeat=D):
        pr = 1.0
        for j, c in enumerate(path):
            row = x[j, path[j - 1] if j else 0] / T
            e = np.exp(row - row.max())
            pr *= e[c] / e.sum()
        probs[sum(c * K ** j for j, c in enumerate(path))] = pr
    assert chi_square_pvalue(counts, probs) > 1e-6
    assert len(set(codes)) > 5
    u = torch.rand(rows, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    a = selector_chain(big_ids, big_lq, torch.zeros(rows, dtype=torch.int64), T, torch.Generator().manual_seed(2), uniforms=u)
    c = selector_chain(big_ids, big_lq, torch.zeros(rows, dtype=torch.int64), T, torch.Generator().manual_seed(3), uniforms=u)
    assert torch.equal(a.tokens, c.tokens)


# ---------------------------------------------------------------- verifiers on lattice trees
def lattice_batch(seed, vocab=6, D=3, K=3, budget=10):
    """Three lattice trees in one batch, straight from the builder (no re-stacking): unconstrained,
    depth-capped at 2, and one with stop tokens (padded: too few paths remain)."""
    rng = np.random.default_rng(seed)
    ids, lq = random_lattice(rng, 3, D, K, vocab=vocab)
    lq = torch.log_softmax(lq * 2, -1)
    leaves = torch.full((3, 4), -1)
    leaves[2] = torch.stack([ids[2, 0, 0], ids[2, 0, 1], ids[2, 1, 0], ids[2, 1, 1]])  # <= 9 paths remain
    tree = build_lattice_tree(ids, lq, budget, torch.from_numpy(rng.integers(vocab, size=3)),
                              depth_limit=torch.tensor([D, 2, D]), leaf_tokens=leaves)
    return tree, rng


def target_logits(tree, rng, vocab, boost=3.0):
    """Random float64 target logits that like the drafted children, so deep paths get accepted."""
    b, n = tree.parents.shape
    logits = torch.from_numpy(rng.normal(size=(b, n, vocab)) * 2)
    for r in range(b):
        p, t = tree_lists(tree, r)
        for i in range(1, len(p)):
            logits[r, p[i], t[i]] += boost * rng.random()
    return logits


SAMPLINGS = {
    "T1": SamplingParams(),
    "T0.6_top_k2": SamplingParams(temperature=0.6, top_k=2),
    "top_k3_top_p0.8": SamplingParams(temperature=0.9, top_k=3, top_p=0.8),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_verifiers_exact_on_lattice_trees(name):
    """TEV, predraw, sequential on lattice trees: exit law and residual = enumeration, Monte Carlo
    (20k rows per tree) passes chi-square, E[accept_len] = C_p (check_exact of test_verify_exact)."""
    seed = list(SAMPLINGS).index(name)
    tree, rng = lattice_batch(40 + seed)
    sizes = tree.valid.sum(1).tolist()
    assert sizes[0] == 11 and sizes[2] < 11 and int(tree.depth[1].max()) == 2  # padding is exercised
    trees = [tree_lists(tree, r) for r in range(3)]
    check_exact(trees, tree, target_logits(tree, rng, 6), SAMPLINGS[name], seed=seed)


def test_verifiers_exact_on_selector_chains():
    """The chain mode's trees (greedy walk, a sampled walk, one cut by a stop token)."""
    rng = np.random.default_rng(50)
    ids, lq = random_lattice(rng, 3, 4, 3, vocab=5)
    g = torch.Generator().manual_seed(0)
    tree = selector_chain(ids, lq, torch.tensor([0, 1, 2]), torch.tensor([0.0, 1.0, 1.0]), g,
                          leaf_tokens=torch.tensor([[-1], [-1], [int(ids[2, 1, 0])]]))
    trees = [tree_lists(tree, r) for r in range(3)]
    assert_same_tree(tree, stack_trees(trees, 5))
    check_exact(trees, tree, target_logits(tree, rng, 5), SamplingParams(temperature=0.8), rows=10_000)


def test_greedy_on_lattice_trees_follows_argmax():
    """T = 0: every verifier (greedy included) follows the target's argmax through the lattice tree."""
    tree, rng = lattice_batch(60)
    logits = target_logits(tree, rng, 6, boost=8.0)
    sampling = SamplingParams(temperature=0.0)
    outs = {m: verify_tree(tree, logits, m, sampling=sampling, generator=torch.Generator().manual_seed(1))
            for m in ("tev", "predraw", "sequential", "greedy")}
    for r in range(3):
        parents, tokens = tree_lists(tree, r)
        children = {i: {} for i in range(len(parents))}
        for i in range(1, len(parents)):
            children[parents[i]][tokens[i]] = i
        cur = 0
        while int(logits[r, cur].argmax()) in children[cur]:
            cur = children[cur][int(logits[r, cur].argmax())]
        for m, out in outs.items():
            assert int(out.exit_node[r]) == cur and int(out.bonus[r]) == int(logits[r, cur].argmax()), m
    assert int(outs["greedy"].accept_len.max()) >= 2
