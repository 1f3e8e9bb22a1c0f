"""Random trees, the exit/bonus law enumerated from target continuations, chi-square: the exactness
oracle of the tests (DESIGN §7) and of scripts/gpu_check.py."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from sglang_tev import DraftTree


def random_tree(rng: np.random.Generator, n_nodes: int, vocab: int, width: int | None = None, max_children: int | None = None):
    """A random prefix-closed tree as (parents list, tokens list); siblings carry distinct tokens.

    Each node's parent is uniform over the earlier nodes with fewer than ``max_children`` children;
    its token is uniform over the tokens its parent's other children do not carry."""
    max_children = vocab if max_children is None else max_children
    parents, tokens = [-1], [int(rng.integers(vocab))]
    used: dict[int, set] = {0: set()}
    for i in range(1, n_nodes):
        while True:
            p = int(rng.integers(i))
            if len(used[p]) < max_children:
                break
        # the k-th free token of p, k uniform (the draw rng.choice(free list) makes), in
        # O(children) rather than O(vocab): usable at V = 151936 (scripts/gpu_check.py)
        a = int(rng.integers(vocab - len(used[p])))
        for x in sorted(used[p]):
            if x > a:
                break
            a += 1
        used[p].add(a)
        used[i] = set()
        parents.append(p)
        tokens.append(a)
    return parents, tokens


def stack_trees(trees, width: int) -> DraftTree:
    """Pad (parents, tokens) lists to ``width`` nodes and batch them."""
    b = len(trees)
    parents = torch.zeros(b, width, dtype=torch.int64)
    tokens = torch.zeros(b, width, dtype=torch.int64)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for r, (p, t) in enumerate(trees):
        n = len(p)
        parents[r, :n] = torch.tensor(p)
        tokens[r, :n] = torch.tensor(t)
        valid[r, :n] = True
    parents[:, 0] = -1
    return DraftTree.from_parents(parents, tokens, valid)


def enumerate_exit_law(parents: list[int], tokens: list[int], probs: np.ndarray) -> np.ndarray:
    """Exact law of (exit node, bonus token) for ONE tree, by following target continuations.

    Independent of the library's exit law: walks every continuation Z token by token. At node v,
    token a moves to the child carrying a, otherwise the continuation leaves the tree at v with
    next token a.

    Args:
        probs: float64 [N, V], the (processed) target law at every node.
    Returns:
        float64 [N, V]: Pr(exit node = v, bonus = a).
    """
    n, v = probs.shape[0], probs.shape[1]
    children = {i: {} for i in range(len(parents))}
    for i in range(1, len(parents)):
        children[parents[i]][tokens[i]] = i
    out = np.zeros((n, v))

    def walk(node: int, mass: float):
        for a in range(v):
            pa = mass * probs[node, a]
            if pa == 0.0:
                continue
            if a in children[node]:
                walk(children[node][a], pa)
            else:
                out[node, a] += pa

    walk(0, 1.0)
    return out


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are merged into one cell.

    Counts in cells of zero expected probability make the p-value 0 (an impossible outcome).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    p = np.asarray(expected_probs, dtype=np.float64).ravel()
    total = counts.sum()
    if np.any(counts[p <= 0] > 0):
        return 0.0
    exp = p * total
    big = exp >= 5
    obs_c = list(counts[big])
    exp_c = list(exp[big])
    small_exp = exp[~big & (p > 0)].sum()
    small_obs = counts[~big & (p > 0)].sum()
    if small_exp > 0:
        obs_c.append(small_obs)
        exp_c.append(small_exp)
    if len(obs_c) < 2:
        return 1.0
    obs_c, exp_c = np.array(obs_c), np.array(exp_c)
    exp_c *= obs_c.sum() / exp_c.sum()
    return float(stats.chisquare(obs_c, exp_c).pvalue)
