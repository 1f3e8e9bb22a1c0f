"""Exactness of the exit law and of every verifier (DESIGN §7).

For small vocabularies the law of (exit node, bonus token) is enumerated from target
continuations (tests/exact_law.py, independent of the library). The library's exit law and
residual must reproduce it exactly; each verifier's Monte-Carlo frequencies over ~20k batched
rows per tree must pass a chi-square test at alpha = 1e-6, and the mean block length must match
1 + coverage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from exact_law import random_tree, stack_trees

from sglang_tev import SamplingParams, exit_law, processed_probs, residual_probs, verify_tree
from exact_law import METHODS, check_exact, repeat_tree

def make_case(seed: int, vocab: int, sizes: list[int], scale: float = 2.0):
    """A padded batch of random trees of different sizes with random float64 target logits."""
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, n, vocab) for n in sizes]
    width = max(sizes)
    tree = stack_trees(trees, width)
    logits = torch.from_numpy(rng.normal(size=(len(sizes), width, vocab)) * scale)
    return trees, tree, logits


SAMPLINGS = {
    "T1": SamplingParams(),
    "T0.6": SamplingParams(temperature=0.6),
    "T1.5": SamplingParams(temperature=1.5),
    "top_k2": SamplingParams(top_k=2),
    "top_p0.7": SamplingParams(top_p=0.7),
    "min_p0.2": SamplingParams(min_p=0.2),
    "top_k3_top_p0.8": SamplingParams(temperature=0.9, top_k=3, top_p=0.8),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_verifiers_match_enumerated_law(name):
    seed = list(SAMPLINGS).index(name)
    vocab = [4, 5, 6, 8, 4, 6, 8][seed]
    # three trees of different sizes in one padded batch
    trees, tree, logits = make_case(100 + seed, vocab, sizes=[9, 5, 12])
    check_exact(trees, tree, logits, SAMPLINGS[name], seed=seed)


def test_per_row_sampling_tensors():
    trees, tree, logits = make_case(7, 6, sizes=[8, 10])
    sampling = SamplingParams(
        temperature=torch.tensor([0.5, 1.3], dtype=torch.float64), top_k=torch.tensor([0, 3]), top_p=torch.tensor([0.9, 1.0])
    )
    check_exact(trees, tree, logits, sampling, rows=10_000)


def test_top_k_at_most_drafted_children_gives_zero_rho():
    """top-k <= #drafted children at a node whose children hold the top tokens: rho = 0 there."""
    # root has children tokens 0, 1, 2; node 1 (token 0) has children 3, 1
    parents = [-1, 0, 0, 0, 1, 1]
    tokens = [7, 0, 1, 2, 3, 1]
    vocab = 6
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(1, 6, vocab)))
    logits[0, 0, [0, 1]] += 6.0  # root: top-2 are drafted children 0 and 1
    logits[0, 1, [3, 1]] += 6.0  # node 1: top-2 are its drafted children
    tree = stack_trees([(parents, tokens)], 6)
    sampling = SamplingParams(top_k=2)
    law = exit_law(tree, processed_probs(logits, sampling))
    assert float(law.rho[0, 0]) == 0.0 and float(law.rho[0, 1]) == 0.0
    assert float(law.w[0, 0]) == 0.0
    check_exact([(parents, tokens)], tree, logits, sampling)


def test_greedy_all_methods_follow_argmax():
    trees, tree, logits = make_case(11, 5, sizes=[10, 7, 3])
    # make the argmax path go deep: boost each node's first child token
    for r, (parents, tokens) in enumerate(trees):
        for i in range(1, len(parents)):
            if i == min(j for j in range(1, len(parents)) if parents[j] == parents[i]):
                logits[r, parents[i], tokens[i]] += 5.0
    sampling = SamplingParams(temperature=0.0)
    outs = {m: verify_tree(tree, logits, m, sampling=sampling, generator=torch.Generator().manual_seed(1)) for m in METHODS + ["greedy"]}
    for r, (parents, tokens) in enumerate(trees):
        # brute-force argmax follow
        children = {i: {} for i in range(len(parents))}
        for i in range(1, len(parents)):
            children[parents[i]][tokens[i]] = i
        cur = 0
        while int(logits[r, cur].argmax()) in children[cur]:
            cur = children[cur][int(logits[r, cur].argmax())]
        for m, out in outs.items():
            assert int(out.exit_node[r]) == cur, m
            assert int(out.bonus[r]) == int(logits[r, cur].argmax()), m
    assert int(outs["greedy"].accept_len.max()) >= 2


def test_uniforms_are_the_only_randomness():
    trees, tree, logits = make_case(5, 6, sizes=[10, 6])
    for method, u in [("tev", 2), ("predraw", 10), ("sequential", 10)]:
        uni = torch.rand(2, u, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        a = verify_tree(tree, logits, method, uniforms=uni, generator=torch.Generator().manual_seed(1))
        b = verify_tree(tree, logits, method, uniforms=uni, generator=torch.Generator().manual_seed(2))
        assert torch.equal(a.path, b.path) and torch.equal(a.bonus, b.bonus)


def test_tev_inverse_cdf_uses_uniforms_as_documented():
    """u0 picks the exit node by inverse CDF over w in node order; u1 the bonus over p^res in id order."""
    trees, tree, logits = make_case(9, 5, sizes=[7])
    probs = processed_probs(logits, SamplingParams())
    law = exit_law(tree, probs)
    cdf = law.w[0].cumsum(0)
    for u0 in [0.0, 0.3, 0.77, 0.999]:
        want_node = int((cdf > u0 * cdf[-1]).nonzero()[0])
        res = residual_probs(tree, probs, torch.tensor([want_node]))[0]
        rc = res.cumsum(0)
        for u1 in [0.0, 0.5, 0.99]:
            want_tok = int((rc > u1 * rc[-1]).nonzero()[0])
            out = verify_tree(tree, logits, "tev", uniforms=torch.tensor([[u0, u1]], dtype=torch.float64))
            assert int(out.exit_node[0]) == want_node and int(out.bonus[0]) == want_tok


def test_padded_logits_are_ignored():
    trees, tree, logits = make_case(13, 6, sizes=[4, 9])
    dirty = logits.clone()
    dirty[0, 4:] = float("nan")  # tree 0 has 4 valid nodes
    for method in METHODS:
        u = torch.rand(2, 2 if method == "tev" else 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        a = verify_tree(tree, logits, method, uniforms=u)
        b = verify_tree(tree, dirty, method, uniforms=u)
        assert torch.equal(a.path, b.path) and torch.equal(a.bonus, b.bonus)


def test_logits_processor_hook_changes_the_law():
    trees, tree, logits = make_case(17, 5, sizes=[6])
    ban = 2

    def no_token_2(lg, tr):
        lg = lg.clone()
        lg[..., ban] = float("-inf")
        return lg

    big = repeat_tree(tree, 2000)
    out = verify_tree(big, logits.repeat(2000, 1, 1), "tev", logits_processor=no_token_2, generator=torch.Generator().manual_seed(0))
    assert not bool((out.bonus == ban).any())
    path_tokens = big.tokens.gather(1, out.path.clamp(min=0))[:, 1:]
    assert not bool(((path_tokens == ban) & (out.path[:, 1:] >= 0)).any())


@pytest.mark.parametrize("seed", range(6))
def test_loop_free_follow_equals_a_walk(seed):
    """follow / follow_tokens (read off the ancestor mask) = the walk from the root, on ragged
    padded batches; and the CPU argmax keeps ties at the lowest id (as torch.argmax)."""
    from sglang_tev.verify._common import argmax_last, follow, follow_tokens

    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(1, 14)) for _ in range(5)]
    trees = [random_tree(rng, s, 4, max_children=3) for s in sizes]
    tree = stack_trees(trees, 14)
    b, n = tree.parents.shape
    chosen = torch.from_numpy(rng.integers(-1, n, size=(b, n)))
    want_tok = torch.from_numpy(rng.integers(0, 4, size=(b, n)))
    for r, (parents, tokens) in enumerate(trees):
        children = {i: {} for i in range(len(parents))}
        for i in range(1, len(parents)):
            children[parents[i]][tokens[i]] = i
        cur = 0  # walk by the chosen child (only a real child of cur counts)
        while int(chosen[r, cur]) in children[cur].values():
            cur = int(chosen[r, cur])
        assert int(follow(tree, chosen)[r]) == cur
        cur = 0
        while int(want_tok[r, cur]) in children[cur]:
            cur = children[cur][int(want_tok[r, cur])]
        assert int(follow_tokens(tree, want_tok)[r]) == cur
    x = torch.from_numpy(rng.integers(0, 3, size=(3, 5, 7)).astype(np.float32))  # many exact ties
    for dt in (torch.float32, torch.float64):
        assert torch.equal(argmax_last(x.to(dt)), x.to(dt).argmax(-1))
    assert torch.equal(argmax_last(x[:, ::2, 1:]), x[:, ::2, 1:].argmax(-1))  # strided view


@pytest.mark.parametrize("walk", ["native", "numpy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_host_walk_equals_tensor_walk(monkeypatch, walk, dtype):
    """On CPU small batches walk the tree on the host (in C for float32 logits, else NumPy +
    Python); the tensor walk (large batches, GPU) gives the same outputs, and
    VerifyOutput.host() reads the same decision and row maxima from either."""
    import dataclasses

    from sglang_tev import execution
    import sglang_tev.verify.greedy as greedy_mod

    if walk == "numpy":
        monkeypatch.setattr(greedy_mod, "native", lambda name: None)
    elif dtype == torch.float32 and greedy_mod.native("greedy_follow") is None:
        pytest.skip("no C compiler here")  # test_ddtree fails in that case when one exists
    trees, tree, logits = make_case(5, 6, sizes=[12, 1, 9, 5])
    logits = logits.to(dtype)
    for r, (parents, tokens) in enumerate(trees):  # a deep argmax path: boost first children
        for i in range(1, len(parents)):
            if i == min(j for j in range(1, len(parents)) if parents[j] == parents[i]):
                logits[r, parents[i], tokens[i]] += 5.0
    logits[0, 0, :] = logits[0, 0, :].max()  # a row of ties: the lowest id wins
    greedy = SamplingParams(temperature=0.0)

    def both(x):
        with execution.use(host_walk_max_nodes=4096):
            h = verify_tree(tree, x, "tev", sampling=greedy, validate=False)
        with execution.use(host_walk_max_nodes=0):
            d = verify_tree(tree, x, "tev", sampling=greedy, validate=False)
        assert h.decided_on_host and not d.decided_on_host
        return h, d

    host, dev = both(logits)
    for f in ("path", "accept_len", "bonus", "exit_node", "coverage"):
        assert torch.equal(getattr(host, f), getattr(dev, f)), f
        assert getattr(host, f).dtype == getattr(dev, f).dtype, f
    assert int(host.accept_len.max()) >= 2
    a, b = host.host(tree, check_finite=logits), dev.host(tree, check_finite=logits)
    assert a == b and a.first_nonfinite == [-1, -1, -1, -1]
    assert dataclasses.replace(a, first_nonfinite=None) == host.host(tree)
    assert a.tree_nodes == [12, 1, 9, 5]
    assert a.path_tokens == [[int(tree.tokens[r, v]) for v in p] for r, p in enumerate(a.paths)]
    bad = logits.clone()
    bad[2, 6, 1] = float("nan")  # the first non-finite valid row of each tree, on every path
    bad[2, 4, 3] = float("inf")
    bad[3, 0, :] = float("-inf")
    bad[3, 7, :] = float("nan")  # a padded row of tree 3 (5 valid nodes): ignored
    bad[1, 3, 2] = float("nan")  # padded too (1 valid node)
    bad[0, 11, 2] = float("-inf")  # one -inf in a row is fine
    outs = [o.host(tree, check_finite=bad).first_nonfinite for o in both(bad)]
    assert outs == [[-1, -1, 4, 0]] * 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["T1", "T0.6", "top_k3_top_p0.8", "min_p0.2", "rows"])
def test_root_only_tree_draws_what_the_general_path_draws(name, dtype):
    """A root-only tree (a plain decoding step under budget auto) takes TEV's one-row path: the
    exit is the root, the bonus the draw of uniforms[:, 1] from the root's law. It must equal the
    general path on the same tree with a padded second node (no child, so the same law): exit node,
    bonus and exit law, for scalar and per-row sampling parameters (greedy rows among them)."""
    from sglang_tev.tree import DraftTree
    from sglang_tev.verify.tev import tev_root_bonus, tev_verify_logits

    b, vocab = 64, 11
    sampling = SAMPLINGS.get(name) or SamplingParams(
        temperature=torch.linspace(0.0, 1.4, b, dtype=torch.float64),
        top_k=torch.arange(b) % 4, top_p=torch.linspace(0.5, 1.0, b, dtype=torch.float64),
        min_p=torch.linspace(0.0, 0.3, b, dtype=torch.float64))
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(b, 2, vocab, generator=gen, dtype=torch.float64) * 2).to(dtype)
    roots = torch.randint(0, vocab, (b,), generator=gen)
    u = torch.rand(b, 2, dtype=torch.float64, generator=gen)
    one = DraftTree.from_parents(torch.full((b, 1), -1), roots.view(b, 1))
    padded = DraftTree.from_parents(torch.tensor([[-1, 0]] * b), torch.stack([roots, roots], 1),
                                    torch.tensor([[True, False]] * b))
    ex1, bonus1, law1 = tev_verify_logits(one, logits[:, :1], sampling, u)
    ex2, bonus2, law2 = tev_verify_logits(padded, logits, sampling, u)
    assert torch.equal(ex1, torch.zeros(b, dtype=torch.int64)) and torch.equal(ex1, ex2)
    assert torch.equal(bonus1, bonus2)
    assert torch.equal(tev_root_bonus(logits[:, 0], sampling, u[:, 1]), bonus2)  # the SGLang plain step's draw
    for a, c in ((law1.P, law2.P[:, :1]), (law1.rho, law2.rho[:, :1]), (law1.w, law2.w[:, :1]),
                 (law1.coverage, law2.coverage)):
        assert a.dtype == c.dtype and torch.equal(a, c)
    # and the draw is the root's law: the bonus of every uniform is its inverse-CDF token
    probs = processed_probs(logits[:, 0].to(torch.float64), sampling)
    cdf = probs.cumsum(-1)
    lo = torch.cat([torch.zeros(b, 1, dtype=torch.float64), cdf[:, :-1]], 1).gather(1, bonus1.view(b, 1)).squeeze(1)
    hi = cdf.gather(1, bonus1.view(b, 1)).squeeze(1)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert bool(((u[:, 1] * cdf[:, -1] >= lo - tol) & (u[:, 1] * cdf[:, -1] <= hi + tol)).all())
    assert bool((probs.gather(1, bonus1.view(b, 1)) > 0).all())
