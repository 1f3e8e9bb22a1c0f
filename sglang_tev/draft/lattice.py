"""Draft trees over a DFlash2 candidate lattice, independent of any model.

A DFlash2 drafter ends in a candidate selector (z-lab ``dflash`` 0.1.0 ``CandidateSelector.select``,
``dflash/model.py:515-547``; SGLang 0.5.23 ``srt/models/dflash.py:1142-1261``, ``build_lattice``
and ``sample_path``): per block slot d (depth d + 1) K candidate tokens, and a first-order
transition law over them,

    candidate_ids [b, D, K]     int64, the candidates of slot d (distinct within a slot)
    trans_logq    [b, D, K, K]  float, trans_logq[:, d, p, c] = log q(slot d takes candidate c |
                                slot d - 1 took candidate p), normalised over c
                                (``log_softmax`` of the selector's lattice scores over the last dim)

Slot 0's predecessor is the root (the anchor / bonus token), not a candidate: its law is the ONE
row ``trans_logq[:, 0, 0, :]``; the rows ``trans_logq[:, 0, p, :]`` for p >= 1 are ignored (they
may hold anything, NaN included). This is the layout of SGLang's ``_selector_lattice``
(``srt/speculative/dflash_worker_v2.py:237-249``): ``_score_edges`` (``srt/models/dflash.py:1108-1129``)
expands the anchor over all K predecessor rows of slot 0, and ``sample_path`` (``:1202-1261``)
reads ``scores[:, 0, 0]`` only.

Three ways to draft from it, all returning the project's :class:`~sglang_tev.tree.DraftTree`, so
every verifier (TEV, predraw, sequential, greedy) runs on them unchanged:

* :func:`build_lattice_tree` -- DDTree over the lattice: best-first over paths scored by
  ``sum log q`` along the path, where a node's children are the K candidates of the next slot
  with log-q from the transition row of the node's OWN candidate index (parent-dependent child
  lists). Budget, per-tree depth limits and stop-token leaves as
  :func:`~sglang_tev.draft.ddtree.build_ddtree_topk`.
* :func:`build_marginal_tree` -- "marginal" mode: the selector ignored, the existing DDTree
  builder on per-slot log-q [b, D, K] (given unary log-q, or the lattice's exact per-slot
  marginals, :func:`lattice_marginals`).
* :func:`selector_chain` -- DFlash2's own draft: the selector's walk (greedy at T = 0, sampled at
  T > 0) as a chain tree of depth D.

Tie rule (as the DDTree builder's, per list): a node's children are ranked by (log q desc,
token id asc) within their OWN transition row; a path's rank tuple is its children's ranks along
the path; the tree is the top-``budget`` paths by (score desc, rank tuple asc), nodes in that order
(pop order). Scores are accumulated in float64, in depth order, from float32 log-probabilities.

The host heap (:func:`build_lattice_tree` with ``impl="heap"``, the default on CPU) is the DDTree
reference loop (liranringel/ddtree ``build_ddtree_tree``: pop the best path, push its next sibling
and its first child) with the first child's row looked up by candidate index. The level-wise
device implementation (``impl="levels"``, the default elsewhere) keeps the best ``budget`` of
(kept + new children) per depth in D static rounds with static shapes and no host sync
(``c_score = score + trans[:, d - 1, cand(parent), :]``, ``_keep_best`` from the DDTree builder).
"""

from __future__ import annotations

import functools
import heapq

import torch

from ..tree import DraftTree
from ..spec import GREEDY_EPS
from . import ddtree as _dd
from .ddtree import (_check_budget, _check_options, _check_roots, _host_options, _is_leaf_token, _keep_best,
                     _levels_tree, _pad_tree, _root_only, build_ddtree_topk)

__all__ = ["build_lattice_tree", "build_marginal_tree", "lattice_marginals", "selector_chain"]



# ---------------------------------------------------------------------------------------- checks
def _check_lattice(candidate_ids, trans_logq) -> tuple[int, int, int]:
    """Shapes, dtypes, devices, distinct candidates, finite normalised log-q (host syncs)."""
    if not isinstance(candidate_ids, torch.Tensor) or candidate_ids.dtype != torch.int64 or candidate_ids.dim() != 3:
        raise ValueError("candidate_ids must be an int64 tensor [b, D, K]")
    b, D, K = candidate_ids.shape
    if not isinstance(trans_logq, torch.Tensor) or not trans_logq.is_floating_point() \
            or tuple(trans_logq.shape) != (b, D, K, K):
        raise ValueError(f"trans_logq must be a floating tensor [b, D, K, K] = {[b, D, K, K]}")
    if trans_logq.device != candidate_ids.device:
        raise ValueError("trans_logq must be on the device of candidate_ids")
    if bool((candidate_ids < 0).any()):
        raise ValueError("candidate_ids must be >= 0")
    s = candidate_ids.sort(-1).values
    if bool((s[..., 1:] == s[..., :-1]).any()):
        raise ValueError("candidate_ids must be distinct within a slot")
    used = torch.cat([trans_logq[:, :1, :1].reshape(b, -1), trans_logq[:, 1:].reshape(b, -1)], 1) if D else trans_logq
    if bool((torch.isnan(used) | (used > 0)).any()):
        raise ValueError("trans_logq must hold log-probabilities: no NaN, no entry > 0 (slot 0 rows >= 1 are ignored)")
    return b, D, K


def _row_order(trans_logq: torch.Tensor, candidate_ids: torch.Tensor):
    """Each transition row ranked by (log q desc, token id asc): (sorted log q float64 [b, D, K, K],
    candidate index of each rank int64 [b, D, K, K])."""
    b, D, K = candidate_ids.shape
    lq = trans_logq.detach().to(torch.float32).to(torch.float64)
    ids = candidate_ids.view(b, D, 1, K).expand(b, D, K, K)
    o = ids.argsort(dim=-1, stable=True)
    o = o.gather(-1, lq.gather(-1, o).argsort(dim=-1, descending=True, stable=True))
    return lq.gather(-1, o), o


# ---------------------------------------------------------------------------------- lattice tree
def build_lattice_tree(
    candidate_ids: torch.Tensor,
    trans_logq: torch.Tensor,
    budget: int,
    root_tokens: torch.Tensor,
    validate: bool = True,
    *,
    depth_limit: torch.Tensor | None = None,
    leaf_tokens: torch.Tensor | None = None,
    impl: str = "auto",
) -> DraftTree:
    """Best-first DDTree over a candidate lattice: parent-dependent child lists (batched).

    A path (c_0, ..., c_{d-1}) of candidate indices (c_j of slot j) is the draft
    ``candidate_ids[:, 0, c_0], ..., candidate_ids[:, d-1, c_{d-1}]`` with score
    ``trans_logq[:, 0, 0, c_0] + sum_{j >= 1} trans_logq[:, j, c_{j-1}, c_j]``. The tree is the
    top-``budget`` paths by (score desc, rank tuple asc) among those that exist (depth <= the
    tree's limit; no stop token before the last position), each child's rank taken within its
    own transition row by (log q desc, token id asc). With every row of a slot equal (a
    parent-independent law) it is :func:`~sglang_tev.draft.ddtree.build_ddtree_topk`'s tree on
    those rows. Algorithm: the DDTree reference heap (liranringel/ddtree ``build_ddtree_tree``)
    with the first child's row ``trans_logq[:, d, c, :]`` of the popped node's candidate c; the
    selector lattice is z-lab ``dflash`` 0.1.0 ``CandidateSelector`` / SGLang 0.5.23
    ``srt/models/dflash.py`` ``build_lattice``.

    Args:
        candidate_ids: int64 [b, D, K], slot d's candidates (depth d + 1), distinct within a slot.
        trans_logq: float [b, D, K, K], ``trans_logq[:, d, p, c]`` = log q(c at slot d | candidate
            p at slot d - 1), each row normalised (entries <= 0, -inf allowed). Slot 0 uses row 0
            only (given the root); rows 1.. of slot 0 are ignored.
        budget: int >= 0, the number of non-root nodes (B).
        root_tokens: int64 [b], the root (last committed) token of each tree.
        validate: check arguments (host syncs).
        depth_limit: optional int64 [b], deepest depth per tree (<= D; None = D).
        leaf_tokens: optional int64 [b, S], tokens that get no children (stop tokens); -1 unused.
        impl: ``"heap"`` (host heap per tree: cheapest on CPU), ``"levels"`` (D static rounds over
            b x B x (1 + K) candidates, no host sync: the device path) or ``"auto"`` (heap on
            CPU, levels elsewhere). Both give identical trees.

    Returns:
        :class:`DraftTree` with N = 1 + budget nodes in pop order (parents precede children,
        scores non-increasing), padded (valid False) when fewer paths exist. ``max_depth`` is
        exact on CPU, the static bound min(D, budget) elsewhere.

    Raises:
        ValueError naming the argument: budget not an int >= 0; wrong shapes, dtypes or devices;
        negative or repeated candidate ids in a slot; NaN or positive used log-q; bad
        depth_limit / leaf_tokens; unknown ``impl``.
    """
    if validate:
        budget = _check_budget(budget)
        b, D, K = _check_lattice(candidate_ids, trans_logq)
        _check_roots(root_tokens, b, candidate_ids.device)
        _check_options(b, depth_limit, leaf_tokens)
    if impl not in ("auto", "heap", "levels"):
        raise ValueError(f"impl must be 'auto', 'heap' or 'levels', got {impl!r}")
    b, D, K = candidate_ids.shape
    if budget == 0 or D == 0 or K == 0:
        tree = _root_only(root_tokens)
        return tree if budget == 0 else _pad_tree(tree, budget)
    if _dd._use_heap(impl, trans_logq):
        return _lattice_heap(candidate_ids, trans_logq, budget, root_tokens, depth_limit, leaf_tokens)
    lq, cidx = _row_order(trans_logq, candidate_ids)
    return _lattice_levels(candidate_ids, lq, cidx, budget, root_tokens, depth_limit, leaf_tokens)


@functools.lru_cache(maxsize=32)
def _row_starts(rows_n: int, K: int):
    """Read-only int64 [rows_n, 1]: the flat index of each row's first entry (rows of K entries)."""
    import numpy as np

    out = np.arange(0, rows_n * K, K)[:, None]
    out.flags.writeable = False
    return out


def _lattice_heap(candidate_ids, trans_logq, budget, root_tokens, depth_limit, leaf_tokens) -> DraftTree:
    """One heap per tree on the host: pop the best path, push its next sibling (same row, next
    rank) and its first child (row of the popped node's candidate, rank 0). All rows are ranked at
    once in NumPy (one stable argsort; the token-id tie-break only when some row has an exact
    tie); the loop reads the ranked log q (float32, exact as Python floats) and candidate indices
    through memoryviews, without converting the b x D x K x K entries to lists (a tree reads at
    most 2 * budget of them). Flat index i of an entry: row i // K = (tree * D + slot) * K +
    parent candidate, rank i % K."""
    import numpy as np

    b, D, K = candidate_ids.shape
    KK = K * K
    rows_n = b * D * K  # rows (tree, slot, parent candidate), K entries each
    base = _row_starts(rows_n, K)
    x = trans_logq.detach().to(torch.float32).cpu().numpy().reshape(rows_n, K)
    ids = np.ascontiguousarray(candidate_ids.detach().cpu().numpy(), dtype=np.int64).reshape(-1)
    cand = np.argsort(-x, axis=-1, kind="stable")  # log q desc, ties by candidate index
    vals = x.reshape(-1)[base + cand]
    if (vals[:, 1:] == vals[:, :-1]).any():  # exact ties: rank them by token id (sort by id first)
        oid = np.argsort(ids.reshape(b * D, 1, K), axis=-1, kind="stable")
        oid = np.broadcast_to(oid, (b * D, K, K)).reshape(rows_n, K)
        by_id = x.reshape(-1)[base + oid]
        o = np.argsort(-by_id, axis=-1, kind="stable")
        vals = by_id.reshape(-1)[base + o]
        cand = oid.reshape(-1)[base + o]
    lqs = memoryview(vals.reshape(-1))
    cix = memoryview(np.ascontiguousarray(cand).reshape(-1))
    idv = memoryview(ids)
    limits, leaves = _host_options(b, D, depth_limit, leaf_tokens)
    heappop, heappush = heapq.heappop, heapq.heappush
    rows = []
    for r in range(b):
        lim, leaf = limits[r], leaves[r]
        par_l, tok_l, dep_l, path_l, edge_l = [], [], [], [], []
        rows.append((par_l, tok_l, dep_l, path_l, edge_l))
        if lim < 1:
            continue
        # item: (-score, ranks, parent node, depth, flat entry, score, parent score); slot 0: row 0
        i0 = r * D * KK
        s0 = lqs[i0]
        heap = [(-s0, (0,), 0, 1, i0, s0, 0.0)]
        cnt = 0
        while heap and cnt < budget:
            _, ranks, par, d, i, s, ps = heappop(heap)
            cnt += 1
            c = cix[i]
            q = i // KK  # tree * D + slot
            tok = idv[q * K + c]
            par_l.append(par)
            tok_l.append(tok)
            dep_l.append(d)
            path_l.append(s)
            edge_l.append(lqs[i])
            if (i + 1) % K:  # a next sibling in the same row
                sib = ps + lqs[i + 1]
                heappush(heap, (-sib, ranks[:-1] + (ranks[-1] + 1,), par, d, i + 1, sib, ps))
            if d < lim and tok not in leaf:
                i1 = (q + 1) * KK + c * K  # the next slot's row of candidate c, rank 0
                ch = s + lqs[i1]
                heappush(heap, (-ch, ranks + (0,), cnt, d + 1, i1, ch, s))
    return _dd._host_tree(rows, budget, root_tokens)


def _lattice_levels(candidate_ids, lq, cidx, budget, root_tokens, depth_limit, leaf_tokens) -> DraftTree:
    """The heap's tree level by level (static shapes, no host sync): at depth d every kept
    depth-(d-1) node with candidate c offers the K children of row ``lq[:, d-1, c]`` (ranked),
    placed right after it, so the list stays in rank-tuple preorder and ``_keep_best``'s stable
    sort reproduces the heap's tie-break."""
    b, D, K = candidate_ids.shape
    dev = candidate_ids.device
    B = budget
    limit = torch.full((b,), D, dtype=torch.int64, device=dev) if depth_limit is None else depth_limit.clamp(max=D)
    m = min(B, K)
    score = torch.full((b, B), float("-inf"), dtype=torch.float64, device=dev)
    valid = torch.zeros(b, B, dtype=torch.bool, device=dev)
    depth = torch.ones(b, B, dtype=torch.int64, device=dev)
    cand = torch.zeros(b, B, dtype=torch.int64, device=dev)  # the kept node's candidate index in its slot
    parent = torch.full((b, B), -1, dtype=torch.int64, device=dev)
    score[:, :m] = lq[:, 0, 0, :m]  # the root's children: slot 0's row 0, best first = preorder
    valid[:, :m] = (limit >= 1).unsqueeze(1)
    cand[:, :m] = cidx[:, 0, 0, :m]
    old_idx = torch.arange(B, device=dev).view(1, B, 1).expand(b, B, K)
    for d in range(2, D + 1):
        tok = candidate_ids[:, d - 2, :].gather(1, cand)  # valid where depth == d - 1
        grow = valid & (depth == d - 1) & (limit >= d).unsqueeze(1) & ~_is_leaf_token(tok, leaf_tokens)
        at = cand.unsqueeze(-1).expand(b, B, K)
        c_score = torch.cat([score.unsqueeze(-1), score.unsqueeze(-1) + lq[:, d - 1].gather(1, at)], -1)
        c_valid = torch.cat([valid.unsqueeze(-1), grow.unsqueeze(-1).expand(b, B, K)], -1)
        c_depth = torch.cat([depth.unsqueeze(-1), torch.full_like(at, d)], -1)
        c_cand = torch.cat([cand.unsqueeze(-1), cidx[:, d - 1].gather(1, at)], -1)
        c_parent = torch.cat([parent.unsqueeze(-1), old_idx], -1)  # parent as an OLD kept index
        score, valid, parent, depth, cand = _keep_best(c_score, c_valid, c_parent, c_depth, c_cand)
    tok = candidate_ids.gather(1, (depth - 1).clamp(min=0).unsqueeze(-1).expand(b, B, K)).gather(2, cand.unsqueeze(-1))
    return _levels_tree(score, valid, depth, parent, tok.squeeze(-1), root_tokens, D)


# --------------------------------------------------------------------------------- marginal mode
def lattice_marginals(trans_logq: torch.Tensor) -> torch.Tensor:
    """Per-slot marginal log-q of the lattice's Markov chain (the selector's sampled walk at T = 1).

    ``m_0 = trans_logq[:, 0, 0, :]``, ``m_d(c) = logsumexp_p (m_{d-1}(p) + trans_logq[:, d, p, c])``:
    the exact law of slot d's candidate under the walk, forgetting the path. Computed in float64.

    Args:
        trans_logq: float [b, D, K, K] (as :func:`build_lattice_tree`; slot 0 rows >= 1 ignored).
    Returns:
        float [b, D, K] in ``trans_logq``'s dtype; each row normalised when the rows are.
    Raises:
        ValueError naming ``trans_logq``: not a floating [b, D, K, K] tensor.
    """
    if not isinstance(trans_logq, torch.Tensor) or not trans_logq.is_floating_point() or trans_logq.dim() != 4 \
            or trans_logq.shape[-1] != trans_logq.shape[-2]:
        raise ValueError("trans_logq must be a floating tensor [b, D, K, K]")
    x = trans_logq.to(torch.float64)
    D = x.shape[1]
    if D == 0:
        return trans_logq.new_zeros(x.shape[:3])
    m = [x[:, 0, 0, :]]
    for d in range(1, D):
        m.append(torch.logsumexp(m[-1].unsqueeze(-1) + x[:, d], dim=1))
    return torch.stack(m, 1).to(trans_logq.dtype)


def build_marginal_tree(
    candidate_ids: torch.Tensor,
    budget: int,
    root_tokens: torch.Tensor,
    validate: bool = True,
    *,
    trans_logq: torch.Tensor | None = None,
    unary_logq: torch.Tensor | None = None,
    depth_limit: torch.Tensor | None = None,
    leaf_tokens: torch.Tensor | None = None,
    impl: str = "auto",
) -> DraftTree:
    """"Marginal" mode: the existing DDTree builder on per-slot log-q, the selector ignored.

    Exactly one source of per-slot log-q: ``unary_logq`` (given, e.g. the drafter's per-slot
    log-softmax at the candidates) or ``trans_logq`` (reduced by :func:`lattice_marginals`).
    Then :func:`~sglang_tev.draft.ddtree.build_ddtree_topk` (children of every node are slot d's
    K candidates with the same log-q, whoever the parent).

    Args:
        candidate_ids: int64 [b, D, K], distinct within a slot.
        budget, root_tokens, validate, depth_limit, leaf_tokens, impl: as :func:`build_lattice_tree`.
        trans_logq: float [b, D, K, K] or None.
        unary_logq: float [b, D, K] or None, log q of each candidate, used as given.
    Returns:
        :class:`DraftTree`, N = 1 + budget (as ``build_ddtree_topk``).
    Raises:
        ValueError naming the argument: both or neither of ``trans_logq`` / ``unary_logq``; a
        wrong shape; anything ``build_ddtree_topk`` refuses.
    """
    if (trans_logq is None) == (unary_logq is None):
        raise ValueError("give exactly one of trans_logq / unary_logq")
    if trans_logq is not None:
        if validate:
            _check_lattice(candidate_ids, trans_logq)
        logq = lattice_marginals(trans_logq)
    else:
        if validate and (not isinstance(unary_logq, torch.Tensor) or not isinstance(candidate_ids, torch.Tensor)
                         or unary_logq.shape != candidate_ids.shape):
            raise ValueError("unary_logq must be a floating tensor with the shape of candidate_ids [b, D, K]")
        logq = unary_logq
    return build_ddtree_topk(logq, candidate_ids, budget, root_tokens, validate, depth_limit=depth_limit,
                             leaf_tokens=leaf_tokens, impl=impl)


# ------------------------------------------------------------------------------- DFlash2's chain
def selector_chain(
    candidate_ids: torch.Tensor,
    trans_logq: torch.Tensor,
    root_tokens: torch.Tensor,
    temperature: float | torch.Tensor = 0.0,
    generator: torch.Generator | None = None,
    validate: bool = True,
    *,
    uniforms: torch.Tensor | None = None,
    depth_limit: torch.Tensor | None = None,
    leaf_tokens: torch.Tensor | None = None,
) -> DraftTree:
    """DFlash2's own draft: the selector's walk over the lattice as a chain tree of depth D.

    Slot d picks candidate ``c_d`` from row ``trans_logq[:, d, c_{d-1}, :]`` (slot 0: row 0):
    at T < 1e-5 the argmax (the lowest candidate index among ties, as ``torch.argmax`` in z-lab
    ``dflash`` 0.1.0 ``CandidateSelector.select`` and SGLang's ``sample_path``), else a draw from
    ``softmax(row / T)`` (the same law as upstream's ``softmax(scores / T)``: log_softmax only
    shifts a row) by inverse CDF over candidate index order with one uniform per slot,
    ``u[:, d]`` (the first index whose CDF exceeds ``u * total``, as ``sample_path``'s
    ``(u >= cdf).sum()``, SGLang 0.5.23 ``srt/models/dflash.py:1202-1261``).

    Args:
        candidate_ids: int64 [b, D, K]; trans_logq: float [b, D, K, K] (as :func:`build_lattice_tree`).
        root_tokens: int64 [b].
        temperature: float >= 0 or float [b] (per request).
        generator: draws the uniforms float64 [b, D] when ``uniforms`` is None.
        validate: check arguments (host syncs); without it no host sync is made.
        uniforms: optional float64 [b, D] in [0, 1), the only randomness when given.
        depth_limit: optional int64 [b]: nodes deeper are padding. leaf_tokens: optional int64
            [b, S]: the chain ends at the first stop token (kept as a leaf).
    Returns:
        :class:`DraftTree` with N = 1 + D: node i (1..D) is slot i - 1's pick, parent i - 1;
        cut nodes are padding. ``max_depth`` exact on CPU, D elsewhere.
    Raises:
        ValueError naming the argument: wrong shapes / dtypes / devices, a negative temperature,
        bad uniforms, depth_limit or leaf_tokens.
    """
    if validate:
        b, D, K = _check_lattice(candidate_ids, trans_logq)
        _check_roots(root_tokens, b, candidate_ids.device)
        _check_options(b, depth_limit, leaf_tokens)
        t = torch.as_tensor(temperature)
        if t.dim() > 1 or (t.dim() == 1 and tuple(t.shape) != (b,)) or bool((t < 0).any()) or bool(t.isnan().any()):
            raise ValueError(f"temperature must be a float >= 0 or a tensor [{b}] of them")
        if uniforms is not None and (not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float64
                                     or tuple(uniforms.shape) != (b, D)):
            raise ValueError(f"uniforms must be a float64 tensor [{b}, {D}]")
    b, D, K = candidate_ids.shape
    dev = candidate_ids.device
    x = trans_logq.to(torch.float64)
    if isinstance(temperature, torch.Tensor):
        T = temperature.to(device=dev, dtype=torch.float64).reshape(-1).expand(b)
        greedy = T < GREEDY_EPS
        any_sampled = True
    else:
        T = float(temperature)
        greedy = T < GREEDY_EPS
        any_sampled = not greedy
    if any_sampled and uniforms is None:
        uniforms = torch.rand(b, D, dtype=torch.float64, generator=generator, device=dev)
    pick = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    picks = []
    for d in range(D):
        row = x[:, d].gather(1, pick.unsqueeze(-1).expand(b, 1, K)).squeeze(1) if d else x[:, 0, 0]
        top = row.argmax(-1, keepdim=True)
        if any_sampled:
            Tc = T.unsqueeze(-1) if isinstance(T, torch.Tensor) else T
            if isinstance(Tc, torch.Tensor):
                Tc = Tc.clamp(min=GREEDY_EPS)
            p = torch.softmax(row / Tc, -1)
            cdf = p.cumsum(-1)
            u = uniforms[:, d: d + 1] * cdf[:, -1:]
            drawn = (cdf > u).to(torch.int8).argmax(-1, keepdim=True)  # the first index past u
            pick = torch.where(greedy.unsqueeze(-1), top, drawn) if isinstance(greedy, torch.Tensor) else drawn
        else:
            pick = top
        picks.append(pick)
    idx = torch.cat(picks, 1) if D else torch.zeros(b, 0, dtype=torch.int64, device=dev)
    toks = candidate_ids.gather(2, idx.unsqueeze(-1)).squeeze(-1)  # [b, D]
    lim = torch.full((b,), D, dtype=torch.int64, device=dev) if depth_limit is None else depth_limit.clamp(max=D)
    ar = torch.arange(1, D + 1, device=dev)
    ok = ar.unsqueeze(0) <= lim.unsqueeze(1)
    stop = _is_leaf_token(toks, leaf_tokens).to(torch.int64)
    before = stop.cumsum(1) - stop  # stop tokens strictly above node i
    ok = ok & (before == 0)
    n = 1 + D
    ones = torch.ones(b, 1, dtype=torch.int64, device=dev)
    parents = torch.cat([-ones, torch.where(ok, ar.unsqueeze(0) - 1, 0)], 1)
    tokens = torch.cat([root_tokens.view(b, 1), torch.where(ok, toks, 0)], 1)
    valid = torch.cat([ones.bool(), ok], 1)
    depth = torch.cat([ones - 1, torch.where(ok, ar.unsqueeze(0).expand(b, D), 1)], 1)
    i = torch.arange(n, device=dev)
    chain = i.view(n, 1) >= i.view(1, n)  # node i sees 0..i
    pad = (i.view(n, 1) == i.view(1, n)) | (i.view(1, n) == 0)  # a padded node: root and itself
    anc = torch.where(valid.unsqueeze(-1), chain, pad)
    max_depth = int(depth.masked_fill(~valid, 0).max()) if _dd._exact_max_depth(dev) else D
    return DraftTree(parents, tokens, valid, depth, anc, max_depth)
