"""Draft trees and the canonical exit law.

A batch of ``b`` draft trees is stored as fixed-width ``[b, N]`` tensors (``N = 1 + budget``).
Node 0 is the root (the last committed token); every other node carries one drafted token and
a parent with a smaller index, so parents precede children. Trees with fewer than ``N`` nodes are
*prefix-padded*: their valid nodes come first and the tail is marked ``valid=False``.

The exit law (paper §3, Eq. 2, 4, 6; Lemma 1) follows target probability mass through the tree::

    P(root) = 1,   P(u) = P(pa(u)) * p_pa(u)(x_u)        (target prefix probability, Eq. 2)
    rho(v)  = sum of p_v over tokens that are NOT drafted children of v   (local exit, Eq. 4)
    w(v)    = P(v) * rho(v)                               (probability of exiting at v)
    C_p     = sum_{u != root} P(u) = sum_v w(v) depth(v)  (target coverage, Eq. 6)

``sum_v w(v) = 1`` and ``1 + C_p`` is the expected output-block length of every saturated exact
verifier (Theorem 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DraftTree",
    "host_node_scores",
    "root_only_tree",
    "ExitLaw",
    "exit_law",
    "exit_law_from_edges",
    "residual_probs",
    "edge_probs",
    "tree_positions",
    "tree_attention_mask",
]


def _check_int_tensor(name: str, x, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A batch of prefix-closed draft trees with static width ``N``.

    Attributes (all materialised, on the device of ``parents``):
        parents: int64 [b, N]. ``parents[:, 0] == -1``; a valid node i >= 1 has
            ``0 <= parents[:, i] < i``; a padded node has parent 0.
        tokens: int64 [b, N]. ``tokens[:, 0]`` is the root token; valid siblings are distinct.
        valid: bool [b, N], a prefix mask (valid nodes first); ``valid[:, 0]`` is True.
        depth: int64 [b, N], root 0; a padded node has depth 1.
        ancestor_mask: bool [b, N, N]; ``ancestor_mask[r, i, j]`` is True when j is an ancestor of
            i or i itself. A padded node sees the root and itself. This is the tree part of the
            target's attention mask.
        max_depth: int, the largest depth of a valid node over the batch (host-side, static).

    Build with :meth:`from_parents`.
    """

    parents: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor
    depth: torch.Tensor
    ancestor_mask: torch.Tensor
    max_depth: int

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_parents(
        cls,
        parents: torch.Tensor,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        validate: bool = True,
    ) -> "DraftTree":
        """Build trees from parent pointers.

        Args:
            parents: int64 [b, N]; ``parents[:, 0] == -1``; for valid ``i >= 1``,
                ``0 <= parents[:, i] < i``. Entries of padded nodes are ignored (set to 0).
            tokens: int64 [b, N]; ``tokens[:, 0]`` is the root token; valid siblings must carry
                distinct tokens; valid tokens are >= 0. Tokens of padded nodes are ignored.
            valid: optional bool [b, N] prefix mask (None = all valid).
            validate: check every rule above (one host sync per check).

        Raises:
            ValueError naming the argument: wrong type/dtype/shape/device, root parent not -1,
            a parent that does not precede its child, a non-prefix ``valid`` mask, a negative
            token, or duplicate valid sibling tokens.

        Cost: ``O(b * N * max_depth)`` gathers plus one host sync to read ``max_depth``.
        """
        if validate:
            _check_int_tensor("parents", parents, 2)
            _check_int_tensor("tokens", tokens, 2)
            if tokens.shape != parents.shape:
                raise ValueError(
                    f"tokens must have the shape of parents {tuple(parents.shape)}, got {tuple(tokens.shape)}"
                )
            if tokens.device != parents.device:
                raise ValueError("tokens must be on the device of parents")
            if parents.shape[1] < 1:
                raise ValueError("parents must have at least one column (the root)")
        b, n = parents.shape
        dev = parents.device
        if valid is None:
            valid = torch.ones(b, n, dtype=torch.bool, device=dev)
        elif validate:
            if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
                raise ValueError("valid must be a bool tensor")
            if valid.shape != parents.shape or valid.device != dev:
                raise ValueError(
                    f"valid must have the shape and device of parents {tuple(parents.shape)}, got {tuple(valid.shape)}"
                )
        if validate:
            _validate_structure(parents, tokens, valid)

        idx = torch.arange(n, device=dev)
        par = torch.where(valid, parents, torch.zeros_like(parents))
        par[:, 0] = 0  # the root points at itself for pointer jumping

        # depth by pointer jumping: log2(N) rounds, no host sync
        depth = (idx > 0).to(torch.int64).expand(b, n).clone()  # one hop to the parent; root 0
        ptr = par.clone()
        steps = max(1, (n - 1).bit_length())
        for _ in range(steps):
            # list ranking: depth[i] counts the hops from i to ptr[i]; both double each round
            depth = depth + torch.gather(depth, 1, ptr)
            ptr = torch.gather(ptr, 1, ptr)
        depth = torch.where(valid, depth, torch.ones_like(depth))
        max_depth = int(torch.where(valid, depth, torch.zeros_like(depth)).max().item()) if n > 1 else 0

        # ancestor mask: walk max_depth steps up from every node
        anc = torch.zeros(b, n, n, dtype=torch.bool, device=dev)
        cur = idx.expand(b, n).clone()
        anc.scatter_(2, cur.unsqueeze(-1), True)
        # at least one step, so padded nodes (parent 0) mark the root even in a root-only batch
        for _ in range(max(max_depth, 1 if n > 1 else 0)):
            cur = torch.gather(par, 1, cur)
            anc.scatter_(2, cur.unsqueeze(-1), True)
        parents_out = par.clone()
        parents_out[:, 0] = -1
        tokens_out = torch.where(valid, tokens, torch.zeros_like(tokens))
        tokens_out[:, 0] = tokens[:, 0]
        return cls(parents_out, tokens_out, valid, depth, anc, max_depth)

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        return self.parents.shape[0]

    @property
    def num_nodes(self) -> int:
        """Static width N (root included, padding included)."""
        return self.parents.shape[1]

    @property
    def device(self) -> torch.device:
        return self.parents.device

    def num_valid(self) -> torch.Tensor:
        """int64 [b]: valid nodes per tree, root included."""
        return self.valid.sum(1)

    def child_mask(self) -> torch.Tensor:
        """bool [b, N, N]: ``[r, v, u]`` is True when valid u is a child of v."""
        n = self.num_nodes
        is_child = self.valid.clone()
        is_child[:, 0] = False
        par = self.parents.clamp(min=0)
        onehot = torch.nn.functional.one_hot(par, n).to(torch.bool)  # [b, u, v]
        return (onehot & is_child.unsqueeze(-1)).transpose(1, 2)

    def child_token_mask(self, vocab_size: int) -> torch.Tensor:
        """bool [b, N, V]: ``[r, v, a]`` is True when token a is a drafted child of v (the set A(v), Eq. 4)."""
        b, n = self.parents.shape
        is_child = self.valid.clone()
        is_child[:, 0] = False
        par = self.parents.clamp(min=0)
        flat = par * vocab_size + self.tokens.clamp(min=0, max=vocab_size - 1)
        # non-children write into one spare column, so no write races with a real child
        mask = torch.zeros(b, n * vocab_size + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(1, torch.where(is_child, flat, torch.full_like(flat, n * vocab_size)), True)
        return mask[:, :-1].view(b, n, vocab_size)

    def host(self) -> tuple[list[list[int]], list[list[int]]]:
        """(parents, tokens) of each tree's valid nodes as Python lists (``parents[r][0] == -1``),
        read once and cached; host-side builders fill the cache when they create the tree, so
        host-side verifiers and runtimes read it without a transfer. The tensors are the truth:
        do not modify them after calling this."""
        cached = self._cached("_host")
        if cached is None:
            n_valid = self.valid.sum(1).tolist()
            par, tok = self.parents.tolist(), self.tokens.tolist()
            cached = ([p[:m] for p, m in zip(par, n_valid)], [t[:m] for t, m in zip(tok, n_valid)])
            object.__setattr__(self, "_host", cached)
        return cached

    def with_host_lists(self, lists=None, *, reader=None) -> "DraftTree":
        """Attach the host lists :meth:`host` returns, so no transfer reads them later: ``lists`` =
        (parents, tokens) of each tree's valid nodes (as :meth:`host`), or ``reader()`` returning
        them on first use (a builder that holds them in a cheaper form). The caller vouches that
        they equal the tensors. Returns ``self``."""
        return self._attach("_host", lists, reader, "with_host_lists: give exactly one of lists and reader")

    def node_scores(self) -> list[tuple[list[float], list[float], list[int], list[int]]] | None:
        """The draft scores the builder ranked each tree's nodes by, on the host, or None when the
        builder attached none (:meth:`with_node_scores`): per tree, four lists over its valid
        non-root nodes in pop order — the path score ``sum log q`` (float, temperature 1), the
        edge's ``log q(v | parent)``, the depth (>= 1) and the parent's index in these lists
        (-1: the root). What :func:`sglang_tev.planner.node_path_scores` /
        :func:`~sglang_tev.planner.node_edge_scores` compute from the draft (equal up to the
        order of the float64 sums), without reading the draft again."""
        return self._cached("_scores")

    def with_node_scores(self, rows=None, *, reader=None) -> "DraftTree":
        """Attach :meth:`node_scores`: ``rows`` (as it returns them) or ``reader()`` returning
        them on first use. The caller (a builder) vouches that they are this tree's. Returns
        ``self``."""
        return self._attach("_scores", rows, reader, "with_node_scores: give exactly one of rows and reader")

    def prefix_caches(self, n: int):
        """The host caches already read (:meth:`node_scores`, :meth:`host`; a reader not yet
        called is not called) cut to the tree's first ``n`` nodes, each None when not read: what
        a best-first prefix of this tree (``plan.cut_tree``) carries without reading its tensors.
        Valid nodes come first in pop order and a parent before its children, so a prefix of each
        list is the prefix tree's. Raises ``ValueError`` naming ``n`` unless it is an int >= 1
        (the root)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer of at least 1 (the root), got {n!r}")
        scores, host = getattr(self, "_scores", None), getattr(self, "_host", None)
        if scores is not None:
            scores = [tuple(x[: n - 1] for x in r) for r in scores]
        if host is not None:
            host = ([p[:n] for p in host[0]], [t[:n] for t in host[1]])
        return scores, host

    # the host caches live outside the dataclass fields (a traced tree stays a plain dataclass;
    # frozen stays true of the fields): ``name`` holds the value, ``name + "_reader"`` a builder's
    # cheaper reader of it, called on first use
    _CACHES = ("_host", "_scores")

    def _cached(self, name: str):
        cached = getattr(self, name, None)
        reader = getattr(self, name + "_reader", None)
        if cached is None and reader is not None:
            cached = reader()
            object.__setattr__(self, name, cached)
        return cached

    def _attach(self, name: str, value, reader, refusal: str) -> "DraftTree":
        if (value is None) == (reader is None):
            raise ValueError(refusal)
        object.__setattr__(self, name, value)
        object.__setattr__(self, name + "_reader", reader)
        return self

    def __getstate__(self):
        # a builder's reader is a closure (not picklable); a copy reads the caches again
        drop = {n for c in self._CACHES for n in (c, c + "_reader")}
        return {k: v for k, v in self.__dict__.items() if k not in drop}

    def path(self, node: torch.Tensor) -> torch.Tensor:
        """Root-to-node paths.

        Args:
            node: int64 [b], a node index per tree.
        Returns:
            int64 [b, N]: node indices root-first, ``-1`` after the path (static width).
        """
        b, n = self.parents.shape
        on_path = torch.gather(self.ancestor_mask, 1, node.view(b, 1, 1).expand(b, 1, n)).squeeze(1)
        slot = torch.where(on_path, self.depth, torch.full_like(self.depth, n))
        out = torch.full((b, n + 1), -1, dtype=torch.int64, device=self.device)
        out.scatter_(1, slot, torch.arange(n, device=self.device).expand(b, n).clone())
        out = out[:, :n]
        # slot n collected the nodes off the path; anything after the path stays -1
        return out

    def to(self, device) -> "DraftTree":
        return DraftTree(
            self.parents.to(device),
            self.tokens.to(device),
            self.valid.to(device),
            self.depth.to(device),
            self.ancestor_mask.to(device),
            self.max_depth,
        )


def host_node_scores(path: torch.Tensor, edge: torch.Tensor, depth: torch.Tensor, parents: torch.Tensor,
                     valid: torch.Tensor) -> list[tuple[list[float], list[float], list[int], list[int]]]:
    """:meth:`DraftTree.node_scores`' rows from tensors [b, N] (root first, valid nodes a prefix):
    path and edge scores (float), depths, parents (node indices, root -1) and validity, in one
    host read."""
    host = torch.stack((path.to(torch.float64), edge.to(torch.float64), depth.to(torch.float64),
                        parents.to(torch.float64), valid.to(torch.float64))).tolist()
    rows = []
    for srow, erow, drow, prow, vrow in zip(*host):
        nv = int(sum(vrow))  # non-root node t is entry t - 1 of the lists, the root -1
        rows.append((srow[1:nv], erow[1:nv], [int(d) for d in drow[1:nv]], [int(p) - 1 for p in prow[1:nv]]))
    return rows


def _validate_structure(parents: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor) -> None:
    b, n = parents.shape
    if not bool(valid[:, 0].all()):
        raise ValueError("valid[:, 0] must be True (the root is always a node)")
    if n > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("valid must be a prefix mask: valid nodes first, padding last")
    if bool((parents[:, 0] != -1).any()):
        raise ValueError("parents[:, 0] must be -1 (node 0 is the root)")
    if n == 1:
        return
    idx = torch.arange(n, device=parents.device)
    body = valid[:, 1:]
    p = parents[:, 1:]
    bad = body & ((p < 0) | (p >= idx[1:]))
    if bool(bad.any()):
        r, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"parents must precede children: parents[{r}, {i + 1}] = {int(parents[r, i + 1])} is not in [0, {i + 1})"
        )
    if bool((body & (tokens[:, 1:] < 0)).any()):
        raise ValueError("tokens of valid nodes must be >= 0")
    # duplicate siblings: same (parent, token) among valid non-root nodes
    key_p = torch.where(body, p, torch.full_like(p, -1))
    key_t = torch.where(body, tokens[:, 1:], torch.full_like(p, -1))
    same = (key_p.unsqueeze(2) == key_p.unsqueeze(1)) & (key_t.unsqueeze(2) == key_t.unsqueeze(1))
    same &= body.unsqueeze(2) & body.unsqueeze(1)
    same &= ~torch.eye(n - 1, dtype=torch.bool, device=parents.device)
    if bool(same.any()):
        r, i, j = (int(x) for x in same.nonzero()[0])
        raise ValueError(
            f"tokens: valid siblings must carry distinct tokens; nodes {i + 1} and {j + 1} of tree {r} "
            f"share parent {int(p[r, i])} and token {int(tokens[r, i + 1])}"
        )


def root_only_tree(roots: torch.Tensor) -> DraftTree:
    """Root-only trees (a plain decoding step as a tree: nothing drafted) from int64 [b] roots,
    built without a host sync."""
    b = roots.shape[0]
    dev = roots.device
    return DraftTree(torch.full((b, 1), -1, dtype=torch.int64, device=dev), roots.view(b, 1).to(torch.int64).clone(),
                     torch.ones(b, 1, dtype=torch.bool, device=dev), torch.zeros(b, 1, dtype=torch.int64, device=dev),
                     torch.ones(b, 1, 1, dtype=torch.bool, device=dev), 0)


# ---------------------------------------------------------------------- exit law
@dataclass(frozen=True)
class ExitLaw:
    """The canonical exit law of a batch of trees (paper Lemma 1).

    Attributes (float64 when computed from float64 inputs, else float32):
        P: [b, N] target prefix probability P(v) (Eq. 2); 0 on padded nodes.
        rho: [b, N] local exit probability rho(v) (Eq. 4); 1 at a leaf; 0 on padded nodes.
        w: [b, N] exit probability w(v) = P(v) rho(v); sums to 1 per tree.
        coverage: [b] target coverage C_p = sum_{u != root} P(u) (Eq. 6) = E[accept_len].
    """

    P: torch.Tensor
    rho: torch.Tensor
    w: torch.Tensor
    coverage: torch.Tensor


def _law_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _propagate(tree: DraftTree, edge: torch.Tensor, rho: torch.Tensor) -> ExitLaw:
    """Level-wise P propagation (paper Algorithm 1, lines 3-7); ``max_depth`` static rounds."""
    valid_nonroot = tree.valid.clone()
    valid_nonroot[:, 0] = False
    edge = torch.where(valid_nonroot, edge, torch.zeros_like(edge))
    par = tree.parents.clamp(min=0)
    P = torch.zeros_like(edge)
    P[:, 0] = 1.0
    for d in range(1, tree.max_depth + 1):
        at_d = valid_nonroot & (tree.depth == d)
        P = torch.where(at_d, torch.gather(P, 1, par) * edge, P)
    rho = torch.where(tree.valid, rho, torch.zeros_like(rho))
    w = P * rho
    coverage = P[:, 1:].sum(1)
    return ExitLaw(P, rho, w, coverage)


def exit_law(tree: DraftTree, target_probs: torch.Tensor, validate: bool = True) -> ExitLaw:
    """Canonical exit law from full target distributions (paper Eq. 2, 4, 6; Lemma 1).

    Args:
        tree: the draft trees, N nodes.
        target_probs: float [b, N, V], the processed target law p_v at every node (rows of
            padded nodes are ignored). bf16/fp16 are upcast to float32; float64 stays float64.
        validate: check shapes/device (one host sync).

    ``rho(v)`` is the masked sum of p_v over tokens outside the drafted children A(v), clamped at
    0, rather than ``1 - sum``: it is exactly 0 when the children cover the support (top-k at or
    below the number of drafted children), and exact for float64 inputs.

    Returns:
        :class:`ExitLaw` (P, rho, w, coverage).
    Raises:
        ValueError naming ``target_probs`` for a wrong shape, dtype or device.
    """
    if validate:
        _check_node_tensor("target_probs", target_probs, tree, ndim=3)
    probs = target_probs.to(_law_dtype(target_probs))
    v = probs.shape[-1]
    edge = edge_probs(tree, probs)
    child_tok = tree.child_token_mask(v)
    rho = probs.masked_fill(child_tok, 0.0).sum(-1).clamp(min=0.0)
    return _propagate(tree, edge, rho)


def edge_probs(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """Edge probabilities ``p_pa(v)(x_v)`` [b, N] (root and padded entries are meaningless).

    Args:
        probs: float [b, N, V]. Returns the same dtype. One gather of N elements per tree.
    """
    b, n, v = probs.shape
    flat = tree.parents.clamp(min=0) * v + tree.tokens.clamp(min=0, max=v - 1)
    return torch.gather(probs.reshape(b, n * v), 1, flat)


def exit_law_from_edges(tree: DraftTree, edge_probs: torch.Tensor, validate: bool = True) -> ExitLaw:
    """Canonical exit law from edge probabilities only.

    Args:
        tree: the draft trees.
        edge_probs: float [b, N], ``edge_probs[:, v] = p_pa(v)(x_v)`` for v >= 1; the root entry and
            padded entries are ignored.
        validate: check shapes/device.

    ``rho(v) = max(0, 1 - sum_{u in Ch(v)} p_v(x_u))`` here, because the non-child mass is not
    available. Otherwise as :func:`exit_law`.
    """
    if validate:
        _check_node_tensor("edge_probs", edge_probs, tree, ndim=2)
    edge = edge_probs.to(_law_dtype(edge_probs))
    valid_nonroot = tree.valid.clone()
    valid_nonroot[:, 0] = False
    edge_m = torch.where(valid_nonroot, edge, torch.zeros_like(edge))
    child_sum = torch.zeros_like(edge_m).scatter_add_(1, tree.parents.clamp(min=0), edge_m)
    rho = (1.0 - child_sum).clamp(min=0.0)
    return _propagate(tree, edge, rho)


def residual_probs(tree: DraftTree, target_probs: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """Residual target distribution p_v^res at one node per tree (paper Eq. 7).

    Args:
        tree: the draft trees.
        target_probs: float [b, N, V] processed target law.
        node: int64 [b], the node v per tree.
    Returns:
        float [b, V]: p_v with v's drafted child tokens removed, renormalised; p_v itself at a
        leaf. A row whose residual mass is 0 (rho(v) = 0: v exits with probability 0) falls back
        to p_v, so a draw from it is always a valid token.
    """
    b, n, v = target_probs.shape
    probs = target_probs.to(_law_dtype(target_probs))
    p = torch.gather(probs, 1, node.view(b, 1, 1).expand(b, 1, v)).squeeze(1)
    res = p.masked_fill(_children_tokens_of(tree, node, v), 0.0)
    mass = res.sum(-1, keepdim=True)
    full = p.sum(-1, keepdim=True)
    return torch.where(mass > 0, res / torch.where(mass > 0, mass, torch.ones_like(mass)), p / full)


def _children_tokens_of(tree: DraftTree, node: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [b, V]: drafted child tokens of ``node`` [b] (A(node))."""
    b = tree.batch_size
    is_child = tree.valid & (tree.parents == node.view(b, 1))
    is_child[:, 0] = False
    tok = tree.tokens.clamp(min=0, max=vocab_size - 1)
    # non-children write into one spare column, so no write races with a real child
    mask = torch.zeros(b, vocab_size + 1, dtype=torch.bool, device=tree.device)
    mask.scatter_(1, torch.where(is_child, tok, torch.full_like(tok, vocab_size)), True)
    return mask[:, :-1]


def _check_node_tensor(name: str, x, tree: DraftTree, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    if x.dim() != ndim or tuple(x.shape[:2]) != (tree.batch_size, tree.num_nodes):
        want = f"[{tree.batch_size}, {tree.num_nodes}" + (", V]" if ndim == 3 else "]")
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if x.device != tree.device:
        raise ValueError(f"{name} must be on the tree's device {tree.device}, got {x.device}")


# ---------------------------------------------------------------------- target-pass helpers
def tree_positions(tree: DraftTree, past_len) -> torch.Tensor:
    """Position ids of the tree nodes: ``past_len + depth`` (DESIGN §3).

    Args:
        past_len: int or int64 [b], tokens whose KV is already cached (the root sits at past_len).
    Returns:
        int64 [b, N].
    """
    if isinstance(past_len, torch.Tensor):
        past_len = past_len.view(-1, 1)
    return tree.depth + past_len


def tree_attention_mask(tree: DraftTree, past_len: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention mask of the tree nodes over ``[cached context | tree]``.

    Every node sees the whole cached context, its ancestors and itself.

    Args:
        past_len: int, cached tokens (the same for the whole batch).
        dtype: None for a bool mask (True = attend); a float dtype for an additive mask
            (0 = attend, ``finfo(dtype).min`` = masked), as HF's 4-D ``attention_mask`` expects.
    Returns:
        [b, 1, N, past_len + N].
    """
    b, n = tree.parents.shape
    ctx = torch.ones(b, n, past_len, dtype=torch.bool, device=tree.device)
    mask = torch.cat([ctx, tree.ancestor_mask], dim=2).unsqueeze(1)
    return mask if dtype is None else additive_mask(mask, dtype)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = attend) as HF's additive float mask of ``dtype``: 0 where
    allowed, ``finfo(dtype).min`` where masked; same shape and device."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
