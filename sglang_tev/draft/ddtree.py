"""DDTree: best-first draft-tree construction from per-depth draft marginals.

Reference algorithm (liranringel/ddtree ``build_ddtree_tree``, also hsj576/TEV): with per-depth
top-k lists sorted best first, a heap pops the prefix of highest cumulative score
``sum_d log q_d(x_d)``, records it as the next node, and pushes its next sibling (same parent,
next rank) and its first child (next depth, rank 0), until ``budget`` non-root nodes are popped.
Heap ties are broken by the rank tuple, lexicographically (a prefix before its extensions).

Because a pushed prefix never beats the one just popped, the pop order is the sort of all
prefixes by ``(score desc, rank tuple asc)`` and the tree is the top-``budget`` prefixes. The
implementations give identical trees: on the host, the heap itself (per tree, with the depth and
ancestor rows filled as nodes pop: the cheapest on CPU); on an accelerator, a level-wise search
without a heap (at depth d append the k children of every kept depth-(d-1) node and keep the best
``budget`` of kept + new; lists are held in rank-tuple preorder, so a stable sort by score
reproduces the heap's tie-break) in H static rounds with no host sync.

From full draft logits on CPU (:func:`build_ddtree`) the host heap needs no per-depth top-k over
the vocabulary: only tokens whose "best chain to the depth above, then this token" score reaches
a lower bound of the budget-th tree score can be nodes (:func:`_ranked_survivors`), and one C
call (``sglang_tev/native/host_ops.c``, built on first use; :mod:`sglang_tev.native`) finds them and runs the heap.

Options used by the runtime: a per-tree depth limit (tokens left, position limit) and leaf tokens
(stop tokens get no children: nothing below a stop is ever emitted, so no budget is spent there).

Per depth, ties between equal log-probabilities rank the lower token id first. Scores are
accumulated in float64 from float32 log-probabilities.
"""

from __future__ import annotations

import heapq

import torch

from .. import execution
from ..tree import DraftTree, host_node_scores
from ..native import HMAX, native_builder

__all__ = ["build_ddtree", "build_ddtree_topk", "build_ddtree_reference", "draft_topk"]


def _check_budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an int, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    return budget


def _check_roots(root_tokens, b: int, device) -> None:
    if not isinstance(root_tokens, torch.Tensor) or root_tokens.dtype != torch.int64:
        raise ValueError("root_tokens must be an int64 tensor [b]")
    if tuple(root_tokens.shape) != (b,):
        raise ValueError(f"root_tokens must have shape [{b}], got {tuple(root_tokens.shape)}")
    if root_tokens.device != device:
        raise ValueError("root_tokens must be on the device of the draft tensors")


def _check_options(b0: int, depth_limit, leaf_tokens) -> None:
    if depth_limit is not None and (not isinstance(depth_limit, torch.Tensor) or depth_limit.dtype != torch.int64
                                    or tuple(depth_limit.shape) != (b0,)):
        raise ValueError(f"depth_limit must be an int64 tensor [{b0}]")
    if leaf_tokens is not None and (not isinstance(leaf_tokens, torch.Tensor) or leaf_tokens.dtype != torch.int64
                                    or leaf_tokens.dim() != 2 or leaf_tokens.shape[0] != b0):
        raise ValueError(f"leaf_tokens must be an int64 tensor [{b0}, S]")


def _canonical_order(lq: torch.Tensor, ids: torch.Tensor):
    """Sort each depth's list by (log-prob desc, token id asc)."""
    o = ids.argsort(dim=-1, stable=True)
    lq, ids = lq.gather(-1, o), ids.gather(-1, o)
    o = lq.argsort(dim=-1, descending=True, stable=True)
    return lq.gather(-1, o), ids.gather(-1, o)


def _root_only(root_tokens: torch.Tensor) -> DraftTree:
    b = root_tokens.shape[0]
    parents = torch.full((b, 1), -1, dtype=torch.int64, device=root_tokens.device)
    return DraftTree.from_parents(parents, root_tokens.view(b, 1).clone(), validate=False)


def build_ddtree_topk(
    topk_logprobs: torch.Tensor,
    topk_ids: torch.Tensor,
    budget: int,
    root_tokens: torch.Tensor,
    validate: bool = True,
    *,
    depth_limit: torch.Tensor | None = None,
    leaf_tokens: torch.Tensor | None = None,
    impl: str = "auto",
) -> DraftTree:
    """Best-first DDTree from per-depth top-k lists (batched).

    Args:
        topk_logprobs: float [b, H, k], log q_d of the listed tokens, normalised over the full
            vocabulary (row j is depth j + 1). Any order; ranked here by (log-prob desc, id asc).
        topk_ids: int64 [b, H, k], distinct ids within a row.
        budget: int >= 0, the number of non-root nodes (B).
        root_tokens: int64 [b], the root (last committed) token of each tree.
        validate: check arguments (host syncs).
        depth_limit: optional int64 [b], the deepest depth each tree may reach (<= H); the
            runtime caps it by the tokens left and the position limit. None = H.
        leaf_tokens: optional int64 [b, S], token ids that get no children (stop tokens: a
            continuation below one is never emitted); -1 entries are unused. None = none.
        impl: ``"heap"`` (a host heap per tree, the reference's own algorithm: cheapest on CPU),
            ``"levels"`` (H static rounds over b x budget x (1 + k) candidates, no host loop
            that depends on the data and no host sync: the GPU path) or ``"auto"`` (heap on
            CPU, levels elsewhere). Both give identical trees.

    Returns:
        :class:`DraftTree` with N = 1 + budget nodes in pop order (parents precede children,
        scores non-increasing); trees with fewer than ``budget`` reachable prefixes are padded.
        Depth <= min(H, depth_limit). ``max_depth`` is exact on CPU; on other devices it is the
        static bound min(H, budget) (no host sync; deeper loops only do no-op rounds).

    Raises:
        ValueError naming the argument: budget not an int >= 0; wrong shapes, dtypes or devices;
        NaN or +inf log-probabilities; unknown ``impl``.
    """
    if validate:
        budget = _check_budget(budget)
        if not isinstance(topk_logprobs, torch.Tensor) or not topk_logprobs.is_floating_point() or topk_logprobs.dim() != 3:
            raise ValueError("topk_logprobs must be a floating tensor [b, H, k]")
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype != torch.int64 or topk_ids.shape != topk_logprobs.shape:
            raise ValueError(f"topk_ids must be int64 with the shape of topk_logprobs {tuple(topk_logprobs.shape)}")
        if topk_ids.device != topk_logprobs.device:
            raise ValueError("topk_ids must be on the device of topk_logprobs")
        _check_roots(root_tokens, topk_logprobs.shape[0], topk_logprobs.device)
        if bool((torch.isnan(topk_logprobs) | (topk_logprobs == float("inf"))).any()):
            raise ValueError("topk_logprobs contains NaN or +inf")
        _check_options(topk_logprobs.shape[0], depth_limit, leaf_tokens)
    if impl not in ("auto", "heap", "levels"):
        raise ValueError(f"impl must be 'auto', 'heap' or 'levels', got {impl!r}")
    b, H, k = topk_logprobs.shape
    if budget == 0 or H == 0 or k == 0:
        tree = _root_only(root_tokens)
        if budget == 0:
            return tree
        return _pad_tree(tree, budget)
    if _use_heap(impl, topk_logprobs):
        import numpy as np

        lq = topk_logprobs.detach().to(torch.float32).cpu().numpy()
        idn = topk_ids.detach().cpu().numpy()
        o = np.lexsort((idn, -lq), axis=-1)  # (log-prob desc, id asc)
        lq_l = np.take_along_axis(lq, o, -1).astype(np.float64).tolist()
        id_l = np.take_along_axis(idn, o, -1).tolist()
        return _build_heap(lq_l, id_l, budget, root_tokens, depth_limit, leaf_tokens)
    lq, ids = _canonical_order(topk_logprobs.to(torch.float32).to(torch.float64), topk_ids)
    return _build_levels(lq, ids, budget, root_tokens, depth_limit, leaf_tokens)


def _use_heap(impl: str, x: torch.Tensor) -> bool:
    """The host heap: asked for, or ``auto`` on CPU tensors while the execution policy allows it."""
    return impl == "heap" or (impl == "auto" and x.device.type == "cpu" and execution.current().heap_builder)


def _host_options(b: int, H: int, depth_limit, leaf_tokens) -> tuple[list[int], list[set]]:
    limits = [H] * b if depth_limit is None else [min(H, int(x)) for x in depth_limit.tolist()]
    leaves = [set()] * b if leaf_tokens is None else [set(x for x in row if x >= 0) for row in leaf_tokens.tolist()]
    return limits, leaves


def _is_leaf_token(tok: torch.Tensor, leaf_tokens: torch.Tensor | None) -> torch.Tensor:
    """bool, shape of ``tok`` [b, ...]: the token is one of its tree's leaf tokens."""
    if leaf_tokens is None or leaf_tokens.shape[1] == 0:
        return torch.zeros_like(tok, dtype=torch.bool)
    lt = leaf_tokens.view(leaf_tokens.shape[0], *([1] * (tok.dim() - 1)), leaf_tokens.shape[1])
    return (tok.unsqueeze(-1) == lt).any(-1)


def _build_heap(lq_rows, id_rows, budget, root_tokens, depth_limit, leaf_tokens) -> DraftTree:
    """One heap per tree on the host, as the DDTree reference (``build_ddtree_tree``): pop the best
    prefix, push its next sibling and its first child. Ties are broken by the rank tuple; a
    sibling's score is its parent's score + log q (as :func:`build_ddtree_reference`).

    ``lq_rows[r][j]`` / ``id_rows[r][j]``: Python lists, the ranked candidates of tree r at depth
    j + 1 (log q as floats, best first; ids). Rows may be shorter than others, or empty, when
    the caller has proven the missing entries cannot enter the tree (:func:`_ranked_survivors`)."""
    b = len(lq_rows)
    H = len(lq_rows[0]) if b else 0
    limits, leaves = _host_options(b, H, depth_limit, leaf_tokens)
    heappop, heappush = heapq.heappop, heapq.heappush
    rows = []
    for r in range(b):
        lim, leaf, lqr, idr = limits[r], leaves[r], lq_rows[r], id_rows[r]
        par_l, tok_l, dep_l, path_l, edge_l = [], [], [], [], []
        rows.append((par_l, tok_l, dep_l, path_l, edge_l))
        if lim < 1 or not lqr[0]:
            continue
        # item: (-score, ranks, parent node, depth, rank, score, parent score)
        heap = [(-lqr[0][0], (0,), 0, 1, 0, lqr[0][0], 0.0)]
        cnt = 0
        while heap and cnt < budget:
            _, ranks, par, d, rk, s, ps = heappop(heap)
            cnt += 1
            tok = idr[d - 1][rk]
            row = lqr[d - 1]
            par_l.append(par)
            tok_l.append(tok)
            dep_l.append(d)
            path_l.append(s)
            edge_l.append(row[rk])
            if rk + 1 < len(row):
                sib = ps + row[rk + 1]
                heappush(heap, (-sib, ranks[:-1] + (rk + 1,), par, d, rk + 1, sib, ps))
            if d < lim and tok not in leaf and lqr[d]:
                ch = s + lqr[d][0]
                heappush(heap, (-ch, ranks + (0,), cnt, d + 1, 0, ch, s))
    return _host_tree(rows, budget, root_tokens)


def _host_tree(rows, budget: int, root_tokens: torch.Tensor) -> DraftTree:
    """The :class:`DraftTree` of host-built trees (shared by the host heaps, here and in
    :mod:`sglang_tev.draft.lattice`). ``rows[r] = (parents, tokens, depths, path scores,
    edge log q)``: Python lists of tree r's non-root nodes in pop order (parents as node indices,
    root = 0, parents precede children), at most ``budget`` each; the rest is padding. The
    ancestor rows are filled on the host; the scores are attached
    (:meth:`~sglang_tev.tree.DraftTree.with_node_scores`)."""
    import numpy as np

    b = len(rows)
    n = 1 + budget
    dev = root_tokens.device
    parents = np.zeros((b, n), dtype=np.int64)
    tokens = np.zeros((b, n), dtype=np.int64)
    depth = np.ones((b, n), dtype=np.int64)
    valid = np.zeros((b, n), dtype=np.bool_)
    anc = np.zeros((b, n, n), dtype=np.bool_)
    parents[:, 0], depth[:, 0], valid[:, 0] = -1, 0, True
    anc[:, np.arange(n), np.arange(n)] = True
    anc[:, 1:, 0] = True  # padded nodes see the root and themselves
    tokens[:, 0] = root_tokens.cpu().numpy()
    max_depth = 0
    roots = tokens[:, 0].tolist()
    host = ([[-1] for _ in range(b)], [[t] for t in roots])
    for r, (par_l, tok_l, dep_l, _, _) in enumerate(rows):
        cnt = len(par_l)
        if not cnt:
            continue
        host[0][r].extend(par_l)
        host[1][r].extend(tok_l)
        parents[r, 1: cnt + 1] = par_l
        tokens[r, 1: cnt + 1] = tok_l
        depth[r, 1: cnt + 1] = dep_l
        valid[r, : cnt + 1] = True
        max_depth = max(max_depth, max(dep_l))
        anc_r = anc[r]
        for i, p in enumerate(par_l, 1):  # parents precede children: copy the parent's row
            anc_r[i, :i] = anc_r[p, :i]
    t = lambda x: torch.from_numpy(x).to(dev)  # noqa: E731
    # DraftTree.host(): the lists, without reading the tensors back
    tree = DraftTree(t(parents), t(tokens), t(valid), t(depth), t(anc), max_depth).with_host_lists(host)
    # read only by the planner's refine (auto): a fixed budget's round never builds these rows
    return tree.with_node_scores(reader=lambda: [(path_l, edge_l, dep_l, [p - 1 for p in par_l])
                                                 for par_l, _, dep_l, path_l, edge_l in rows])


SURVIVOR_GROUP = 64
"""Tokens per vocabulary group of :func:`_ranked_survivors`' bound (group maxima are its candidates)."""


def _ranked_survivors(logq: torch.Tensor, budget: int, depth_limit, leaf_tokens):
    """Per tree and depth, the ranked candidates that can enter the tree: the heap's input,
    without a per-depth top-k over the vocabulary (the Python twin of ``native/host_ops.c``).

    ``logq``: float32 [b, H, V], the draft log-probabilities (``log_softmax`` of the logits).
    Let m_j be the best log q at depth j, P_d = m_1 + ... + m_d (the best depth-d score) and
    Y(d, x) = P_{d-1} + log q_d(x), the score of "best chain to depth d - 1, then x". A tree
    node (d, x) scores at most Y(d, x) and at least s_B, the budget-th best score; any budget
    allowed prefixes give a lower bound L <= s_B. Here they are the maxima of Y over groups of
    ``SURVIVOR_GROUP`` tokens (token t in group t mod V/G; rows past a depth limit, or below a
    leaf token on the chain, are left out of the bound). So only tokens with Y(d, x) >= L can be
    tree nodes: a prefix of each depth's ranked list, found by scanning only the groups whose
    maximum reaches L. The heap on these lists pops exactly the nodes it pops on full top-k lists
    (log q summed in float64 in the heap's order, so the bound holds in floating point; a 1e-6
    relative margin keeps borderline entries anyway). Ranking within a depth: (log q desc, id
    asc), each list capped at min(budget, V) entries.

    Returns (lq_rows, id_rows) as :func:`_build_heap` takes them.
    """
    import numpy as np

    x = logq.detach().to(torch.float32).cpu()
    if bool(torch.isnan(x).any()):  # as the C builder: a NaN log q reads as -inf
        x = torch.nan_to_num(x, nan=float("-inf"))
    b, H, V = x.shape
    k = min(budget, V)
    G = SURVIVOR_GROUP
    if V % G:  # pad to whole groups; -inf never survives a finite bound, and padding is cut below
        x = torch.cat([x, x.new_full((b, H, G - V % G), float("-inf"))], -1)
    x = x.contiguous()
    ng = x.shape[-1] // G
    gmax = x.view(b, H, G, ng).amax(-2)  # [b, H, ng]: group j = tokens j, j + ng, j + 2 ng, ...
    xn, gq = x.numpy(), gmax.numpy()
    m = gq.max(-1).astype(np.float64)  # best log q per depth, as the heap sees it
    pprev = np.zeros((b, H), dtype=np.float64)
    pprev[:, 1:] = np.cumsum(m[:, :-1], -1)  # P_{d-1}, summed in the heap's order
    limits, leaves = _host_options(b, H, depth_limit, leaf_tokens)
    rows_ok = np.arange(H)[None, :] < np.array(limits)[:, None]  # depth j + 1 <= limit
    bound_ok = rows_ok
    if leaf_tokens is not None:
        bound_ok = rows_ok.copy()
        chain = np.argmax(xn, axis=-1).tolist()  # the chain's tokens (lowest id among ties)
        for r in range(b):
            hit = [j for j in range(H) if chain[r][j] in leaves[r]]
            if hit:  # prefixes through the chain's first leaf token do not exist
                bound_ok[r, hit[0] + 1:] = False
    y_grp = gq.astype(np.float64) + pprev[..., None]  # Y at each group's maximum
    flat = np.where(bound_ok[..., None], y_grp, -np.inf).reshape(b, -1)
    if flat.shape[1] >= budget:
        bound = -np.partition(-flat, budget - 1, axis=1)[:, budget - 1]
    else:
        bound = np.full(b, -np.inf)
    thr = bound - 1e-6 * (1.0 + np.abs(np.where(np.isfinite(bound), bound, 0.0)))
    cand = np.flatnonzero((y_grp >= thr[:, None, None]) & rows_ok[..., None])  # (r * H + j) * ng + g
    row, gi = np.divmod(cand, ng)  # row = r * H + j
    cols = gi[:, None] + ng * np.arange(G)  # [c, G] token ids of each candidate group
    lq = xn.reshape(-1)[(row * x.shape[-1])[:, None] + cols]  # float32 log q
    keep = (lq.astype(np.float64) + pprev.reshape(-1)[row][:, None] >= thr[row // H][:, None]) & (cols < V)
    ci, cg = np.nonzero(keep)
    srow, stok, slq = row[ci], cols[ci, cg], lq[ci, cg]
    order = np.lexsort((stok, -slq, srow))
    bounds = np.searchsorted(srow[order], np.arange(b * H + 1)).tolist()
    slq_l = slq[order].astype(np.float64).tolist()
    stok_l = stok[order].tolist()
    lq_rows, id_rows = [], []
    for r in range(b):
        lr, ir = [], []
        for j in range(H):
            lo = bounds[r * H + j]
            hi = min(bounds[r * H + j + 1], lo + k)
            lr.append(slq_l[lo:hi])
            ir.append(stok_l[lo:hi])
        lq_rows.append(lr)
        id_rows.append(ir)
    return lq_rows, id_rows


def _build_native(fn, logq: torch.Tensor, budget: int, root_tokens, depth_limit, leaf_tokens) -> DraftTree:
    """:func:`_build_heap` on :func:`_ranked_survivors`' lists in one C call (``native/host_ops.c``;
    its bound is the exact budget-th best Y rather than group maxima, so its lists can be shorter;
    the tree is the same). CPU tensors only."""
    import ctypes

    b, H, V = logq.shape
    n = 1 + budget
    x = logq if logq.is_contiguous() else logq.contiguous()  # (attribute checks: cheaper than no-op calls)
    if depth_limit is None:  # a ctypes array: no tensor op for the common case
        limits = (ctypes.c_int64 * b)(*([H] * b))
        limits_ptr = ctypes.addressof(limits)
    else:
        limits = depth_limit.to(torch.int64).contiguous()
        limits_ptr = limits.data_ptr()
    leaves = None if leaf_tokens is None else leaf_tokens.to(torch.int64).contiguous()
    roots = root_tokens if root_tokens.dtype == torch.int64 and root_tokens.is_contiguous() else \
        root_tokens.to(torch.int64).contiguous()
    ints = torch.empty(3, b, n, dtype=torch.int64)  # parents | tokens | depth
    counts = torch.empty(b, dtype=torch.int64)
    valid = torch.empty(b, n, dtype=torch.bool)  # bool is one byte holding 0 / 1, as C writes it
    anc = torch.empty(b, n, n, dtype=torch.bool)
    parents, tokens, depth = ints
    md = fn(x.data_ptr(), b, H, V, budget, limits_ptr, None if leaves is None else leaves.data_ptr(),
            0 if leaves is None else leaves.shape[1], roots.data_ptr(), parents.data_ptr(), tokens.data_ptr(),
            depth.data_ptr(), valid.data_ptr(), anc.data_ptr(), counts.data_ptr())
    if md < 0:
        raise MemoryError(f"the native DDTree builder failed (status {md})")
    tree = DraftTree(parents, tokens, valid, depth, anc, int(md))

    def host_lists():  # DraftTree.host() in two reads (parents and tokens share one buffer)
        (par, tok), m = ints[:2].tolist(), counts.tolist()
        return [p[: c] for p, c in zip(par, m)], [t[: c] for t, c in zip(tok, m)]

    # every node's edge log q at its (depth, token), gathered now: the reader keeps [b, N], not log q
    edge_t = x.view(b, H * V).gather(1, (depth - 1).clamp(min=0) * V + tokens.clamp(min=0))

    def node_scores():  # paths summed as the heap sums them
        edges, (par, dep), m = edge_t.tolist(), ints[::2].tolist(), counts.tolist()
        rows = []
        for e, p, d, c in zip(edges, par, dep, m):
            e, p = e[1:c], [q - 1 for q in p[1:c]]
            path = []
            for j in range(len(e)):
                path.append((0.0 if p[j] < 0 else path[p[j]]) + e[j])
            rows.append((path, e, d[1:c], p))
        return rows

    return tree.with_host_lists(reader=host_lists).with_node_scores(reader=node_scores)


def _build_levels(lq, ids, budget, root_tokens, depth_limit, leaf_tokens) -> DraftTree:
    """The heap's tree without a heap: because a pushed prefix never beats the one just popped,
    the pop order is the sort of all prefixes by (score desc, rank tuple asc). Level by level,
    append the k children of every kept depth-(d-1) node and keep the best ``budget`` of kept +
    new; lists stay in rank-tuple preorder, so a stable sort by score is the heap's tie-break.
    H static rounds, no host sync."""
    b, H, k = lq.shape
    dev = lq.device
    B = budget
    neg_inf = float("-inf")
    limit = torch.full((b,), H, dtype=torch.int64, device=dev) if depth_limit is None else depth_limit.clamp(max=H)

    # Kept list (capacity B, rank-tuple preorder). Depth 1: the root's k children.
    m = min(B, k)
    score = torch.full((b, B), neg_inf, dtype=torch.float64, device=dev)
    valid = torch.zeros(b, B, dtype=torch.bool, device=dev)
    depth = torch.ones(b, B, dtype=torch.int64, device=dev)
    rank = torch.zeros(b, B, dtype=torch.int64, device=dev)
    parent = torch.full((b, B), -1, dtype=torch.int64, device=dev)
    # lists are sorted best first, so the first m ranks are the best m, already in preorder
    score[:, :m] = lq[:, 0, :m]
    valid[:, :m] = (limit >= 1).unsqueeze(1)
    rank[:, :m] = torch.arange(m, device=dev)

    slot_j = torch.arange(1 + k, device=dev)  # 0 = the kept node itself, j >= 1 = child rank j-1
    old_idx = torch.arange(B, device=dev).view(1, B, 1).expand(b, B, 1 + k)
    for d in range(2, H + 1):
        tok = ids[:, d - 2, :].gather(1, rank)  # valid where depth == d - 1
        grow = valid & (depth == d - 1) & (limit >= d).unsqueeze(1) & ~_is_leaf_token(tok, leaf_tokens)
        c_score = torch.empty(b, B, 1 + k, dtype=torch.float64, device=dev)
        c_score[:, :, 0] = score
        c_score[:, :, 1:] = score.unsqueeze(-1) + lq[:, d - 1, :].unsqueeze(1)
        c_valid = torch.empty(b, B, 1 + k, dtype=torch.bool, device=dev)
        c_valid[:, :, 0] = valid
        c_valid[:, :, 1:] = grow.unsqueeze(-1)
        c_depth = torch.where(slot_j == 0, depth.unsqueeze(-1), torch.full_like(depth.unsqueeze(-1), d))
        c_rank = torch.where(slot_j == 0, rank.unsqueeze(-1), (slot_j - 1).expand(b, B, 1 + k))
        c_parent = torch.where(slot_j == 0, parent.unsqueeze(-1), old_idx)  # parent as an OLD kept index
        score, valid, parent, depth, rank = _keep_best(c_score, c_valid, c_parent, c_depth, c_rank)

    tok = ids.gather(1, (depth - 1).clamp(min=0).unsqueeze(-1).expand(b, B, k)).gather(2, rank.unsqueeze(-1)).squeeze(-1)
    return _levels_tree(score, valid, depth, parent, tok, root_tokens, H)


def _keep_best(c_score, c_valid, c_parent, *fields):
    """One level of the level-wise search (shared with :mod:`sglang_tev.draft.lattice`): from the
    candidates [b, B, 1 + k] (slot 0 = a kept node, slots 1.. = its new children, so the flattened
    list is in rank-tuple preorder), keep the best B by (valid, score desc), ties by preorder
    position, back in preorder. ``c_parent`` holds OLD kept indices (-1 = the root); returned
    parents are NEW kept indices. Returns (score, valid, parent, *fields), each [b, B]."""
    b, B, m = c_score.shape
    dev = c_score.device
    flat = lambda x: x.reshape(b, B * m)  # noqa: E731
    c_score, c_valid, c_parent = flat(c_score), flat(c_valid), flat(c_parent)
    chosen = _best_stable(c_score, c_valid)[:, :B].sort(dim=1).values  # preorder positions of the new kept list
    new_of_cand = torch.full((b, B * m), -1, dtype=torch.int64, device=dev)
    new_of_cand.scatter_(1, chosen, torch.arange(B, device=dev).expand(b, B).clone())
    new_of_old = new_of_cand.view(b, B, m)[:, :, 0]
    par_old = c_parent.gather(1, chosen)
    parent = torch.where(par_old >= 0, new_of_old.gather(1, par_old.clamp(min=0)), par_old)
    return (c_score.gather(1, chosen), c_valid.gather(1, chosen), parent,
            *(flat(x).gather(1, chosen) for x in fields))


def _levels_tree(score, valid, depth, parent, tok, root_tokens, H: int) -> DraftTree:
    """The :class:`DraftTree` of a level-wise search's kept list (shared with
    :mod:`sglang_tev.draft.lattice`): ``score`` float64, ``valid`` bool, ``depth`` / ``parent`` /
    ``tok`` int64, all [b, B] in rank-tuple preorder (``parent`` a kept index, -1 = the root).
    Nodes go out in pop order: a stable sort by (valid, score desc). No host sync unless
    :func:`_exact_max_depth` says so."""
    b, B = score.shape
    dev = score.device
    order = _best_stable(score, valid)
    pos_of_kept = torch.empty_like(order).scatter_(1, order, torch.arange(B, device=dev).expand(b, B).clone())
    valid_o, depth_o, parent_o, tok_o = (x.gather(1, order) for x in (valid, depth, parent, tok))
    parent_node = torch.where(parent_o >= 0, pos_of_kept.gather(1, parent_o.clamp(min=0)) + 1, torch.zeros_like(parent_o))
    ones = torch.ones(b, 1, dtype=torch.int64, device=dev)
    parents = torch.cat([-ones, torch.where(valid_o, parent_node, 0)], 1)
    tokens = torch.cat([root_tokens.view(b, 1), torch.where(valid_o, tok_o, 0)], 1)
    valid_all = torch.cat([ones.bool(), valid_o], 1)
    depth_all = torch.cat([ones - 1, torch.where(valid_o, depth_o, 1)], 1)
    # ancestor mask: walk up min(H, B) static steps (parents precede children, so no cycles)
    n = 1 + B
    par = parents.clamp(min=0)
    anc = torch.zeros(b, n, n, dtype=torch.bool, device=dev)
    cur = torch.arange(n, device=dev).expand(b, n).clone()
    anc.scatter_(2, cur.unsqueeze(-1), True)
    for _ in range(min(H, B)):
        cur = torch.gather(par, 1, cur)
        anc.scatter_(2, cur.unsqueeze(-1), True)
    max_depth = int(depth_all.masked_fill(~valid_all, 0).max()) if _exact_max_depth(dev) else min(H, B)
    tree = DraftTree(parents, tokens, valid_all, depth_all, anc, max_depth)

    def node_scores():  # read only if asked (one host read): the edge is the path's last step
        path = torch.cat([torch.zeros_like(score[:, :1]), torch.where(valid_o, score.gather(1, order), 0.0)], 1)
        if not bool(torch.isfinite(path).all()):
            return None  # below a -inf node the edge is not the path's step: read from the draft
        return host_node_scores(path, path - path.gather(1, par), depth_all, parents, valid_all)

    return tree.with_node_scores(reader=node_scores)


def _exact_max_depth(device: torch.device) -> bool:
    """Whether :func:`_build_levels` reads the trees' exact ``max_depth`` back (one host read: on
    CPU, where it costs nothing and later loops over depths get shorter) or uses the static bound
    min(H, budget) (elsewhere: no host sync), as :mod:`sglang_tev.execution` says."""
    return device.type == "cpu" and execution.current().exact_max_depth


def _best_stable(score: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64, shape of ``score`` [b, M]: positions sorted by (valid first, score desc), ties by
    position (two stable sorts; a valid -inf score still precedes an invalid slot)."""
    key = torch.where(valid, score, torch.full_like(score, float("-inf")))
    order = key.argsort(dim=1, descending=True, stable=True)
    return order.gather(1, (~valid).gather(1, order).to(torch.int8).argsort(dim=1, stable=True))


def _pad_tree(tree: DraftTree, budget: int) -> DraftTree:
    b = tree.batch_size
    dev = tree.device
    parents = torch.cat([tree.parents, torch.zeros(b, budget, dtype=torch.int64, device=dev)], 1)
    tokens = torch.cat([tree.tokens, torch.zeros(b, budget, dtype=torch.int64, device=dev)], 1)
    valid = torch.cat([tree.valid, torch.zeros(b, budget, dtype=torch.bool, device=dev)], 1)
    return DraftTree.from_parents(parents, tokens, valid, validate=False)


def draft_topk(draft_logits: torch.Tensor, k: int):
    """Per-depth top-k of the untempered draft law.

    Args:
        draft_logits: float [b, H, V].
        k: list width, 1 <= k <= V.
    Returns:
        (topk_logprobs float32 [b, H, k], topk_ids int64 [b, H, k]); log-probs normalised over
        the full vocabulary. Which of several tokens tied exactly at the k-th boundary enters the
        list follows ``torch.topk``.
    """
    logq = torch.log_softmax(draft_logits.to(torch.float32), dim=-1)  # the host builders' log q too
    vals, ids = torch.topk(logq, k, dim=-1)
    return vals, ids


def build_ddtree(draft_logits: torch.Tensor, budget: int, root_tokens: torch.Tensor, validate: bool = True, *,
                 depth_limit: torch.Tensor | None = None, leaf_tokens: torch.Tensor | None = None,
                 impl: str = "auto") -> DraftTree:
    """Best-first DDTree from full draft logits: log q = ``log_softmax`` in float32, then on CPU
    (``impl`` "auto" / "heap") the host heap on the candidates :func:`_ranked_survivors` proves
    sufficient (in one C call when it is built; else in Python), elsewhere :func:`draft_topk` +
    :func:`build_ddtree_topk`. The same tree either way, except which of several tokens tied
    exactly at the k-th place of a depth's list is kept: the host paths keep the lowest ids,
    ``torch.topk`` any (such a token enters the tree only through another exact tie).

    Args:
        draft_logits: float [b, H, V], untempered per-depth draft logits (row j = depth j + 1);
            -inf entries allowed.
        budget: int >= 0, non-root nodes; the per-depth list width is k = min(budget, V).
        root_tokens: int64 [b].
        validate: check arguments (host syncs).
        depth_limit, leaf_tokens, impl: as :func:`build_ddtree_topk`.
    Returns:
        :class:`DraftTree` with N = 1 + budget.
    Raises:
        ValueError naming the argument: budget not an int >= 0; wrong shape/dtype/device; NaN or
        +inf logits; a row of only -inf.
    """
    if validate:
        budget = _check_budget(budget)
        if not isinstance(draft_logits, torch.Tensor) or not draft_logits.is_floating_point() or draft_logits.dim() != 3:
            raise ValueError("draft_logits must be a floating tensor [b, H, V]")
        _check_roots(root_tokens, draft_logits.shape[0], draft_logits.device)
        if bool((torch.isnan(draft_logits) | (draft_logits == float("inf"))).any()):
            raise ValueError("draft_logits contains NaN or +inf")
        if bool((draft_logits == float("-inf")).all(-1).any()):
            raise ValueError("draft_logits has a row whose entries are all -inf")
        _check_options(draft_logits.shape[0], depth_limit, leaf_tokens)
    if budget == 0:
        return _root_only(root_tokens)
    if impl not in ("auto", "heap", "levels"):
        raise ValueError(f"impl must be 'auto', 'heap' or 'levels', got {impl!r}")
    if _use_heap(impl, draft_logits) and draft_logits.shape[1] > 0:
        b = draft_logits.shape[0]  # the host paths (C included) read b entries: shapes checked even unvalidated
        if depth_limit is not None and tuple(depth_limit.shape) != (b,):
            raise ValueError(f"depth_limit must be an int64 tensor [{b}], got shape {tuple(depth_limit.shape)}")
        if leaf_tokens is not None and (leaf_tokens.dim() != 2 or leaf_tokens.shape[0] != b):
            raise ValueError(f"leaf_tokens must be an int64 tensor [{b}, S], got shape {tuple(leaf_tokens.shape)}")
        if tuple(root_tokens.shape) != (b,):
            raise ValueError(f"root_tokens must have shape [{b}], got {tuple(root_tokens.shape)}")
        x = draft_logits if draft_logits.dtype == torch.float32 else draft_logits.to(torch.float32)
        logq = torch.log_softmax(x.detach(), dim=-1)  # as draft_topk
        fn = native_builder() if logq.device.type == "cpu" and logq.shape[1] <= HMAX else None
        if fn is not None:
            return _build_native(fn, logq, budget, root_tokens, depth_limit, leaf_tokens)
        lq_rows, id_rows = _ranked_survivors(logq, budget, depth_limit, leaf_tokens)
        return _build_heap(lq_rows, id_rows, budget, root_tokens, depth_limit, leaf_tokens)
    k = min(budget, draft_logits.shape[-1])
    vals, ids = draft_topk(draft_logits, k)
    return build_ddtree_topk(vals, ids, budget, root_tokens, validate=False, depth_limit=depth_limit,
                             leaf_tokens=leaf_tokens, impl=impl)


def build_ddtree_reference(topk_logprobs, topk_ids, budget: int, root_token: int, upstream_arithmetic: bool = False,
                           depth_limit: int | None = None, leaf_tokens=()):
    """Heap reference for ONE tree (tests only), following the DDTree reference loop.

    Args:
        topk_logprobs: float [H, k]; topk_ids: int64 [H, k] (ranked here like the batched builder).
        budget: non-root nodes. root_token: int.
        upstream_arithmetic: compute a sibling's score as ``logw - lq[r] + lq[r + 1]`` as the
            reference code does, instead of ``parent score + lq[r + 1]``.
        depth_limit: deepest depth (None = H). leaf_tokens: ids that get no children.
    Returns:
        (parents list[int] of length 1 + n, tokens list[int] of length 1 + n), n <= budget.
    """
    lq, ids = _canonical_order(
        torch.as_tensor(topk_logprobs).to(torch.float32).to(torch.float64).unsqueeze(0), torch.as_tensor(topk_ids).unsqueeze(0)
    )
    lq, ids = lq[0].tolist(), ids[0].tolist()
    H = len(lq)
    k = len(lq[0]) if H else 0
    limit = H if depth_limit is None else min(H, depth_limit)
    leaf = set(int(t) for t in leaf_tokens)
    parents, tokens = [-1], [int(root_token)]
    if budget <= 0 or limit <= 0 or k == 0:
        return parents, tokens
    # item: (-score, ranks, parent_node, depth, rank, score, parent_score)
    heap = [(-lq[0][0], (0,), 0, 1, 0, lq[0][0], 0.0)]
    while heap and len(parents) - 1 < budget:
        _, ranks, par, d, r, s, ps = heapq.heappop(heap)
        node = len(parents)
        parents.append(par)
        tokens.append(int(ids[d - 1][r]))
        if r + 1 < k:
            sib = s - lq[d - 1][r] + lq[d - 1][r + 1] if upstream_arithmetic else ps + lq[d - 1][r + 1]
            heapq.heappush(heap, (-sib, ranks[:-1] + (r + 1,), par, d, r + 1, sib, ps))
        if d < limit and tokens[-1] not in leaf:
            ch = s + lq[d][0]
            heapq.heappush(heap, (-ch, ranks + (0,), node, d + 1, 0, ch, s))
    return parents, tokens
