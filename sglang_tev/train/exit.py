"""ExitTrain's tree side (paper §5, App. C; DESIGN §6): the drafter's own inference trees per
training anchor, scored by the frozen target under their real tree-parent contexts.

Per step, for the anchors ``a`` of a batch (the block root is ``x_a``, as at inference):

1. :func:`anchor_trees` — ``build_ddtree`` on the detached DFlash block logits (the same builder
   and budget as inference); trees of invalid anchors are cut to their root;
2. :func:`score_trees` — ONE frozen-target pass per chunk of anchors that reuses the KV of the
   sequence forward: every non-root node is an extra query row at position ``a + depth(v)`` that
   sees ``x[0..a]`` and its tree ancestors (itself included); the root's row is the sequence's own
   row at ``a``. Returns the canonical exit law (:func:`sglang_tev.tree.exit_law`) of every tree
   under the target law (temperature 1 unless ``loss.exit.temperature`` says otherwise), never a
   ``[trees, N, V]`` tensor of all anchors at once;
3. :func:`exit_weights` / :func:`weights_from_law` — the detached per-node weights of
   :func:`sglang_tev.train.losses.exit_loss` (``exit``: ``w(v) = P(v)·rho(v)``, the paper's;
   ``prefix``: reachability ``P(v)`` rescaled to the same total, the paper's §6.2 control;
   ``reach``: plain ``P(v)``, the reference recipes' ``P_tgt``; ``exit_depth``:
   ``P(v)·rho(v)·depth(v)``, the reference code's ``exit`` option).

The target law the weights are computed from is the target's softmax at ``temperature``
(:func:`target_law`; 1.0 by default, as the reference code — the paper does not state it; below
1e-5 the greedy one-hot law).

The tree code is the core's (``build_ddtree``, ``exit_law``, ``DraftTree.ancestor_mask``).
Letters: b sequences, S tokens, n anchors per sequence, T = b·n trees, N = 1 + budget nodes,
H draft rows (depths 1..H), V vocabulary.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..draft.ddtree import build_ddtree
from ..spec import TREE_MODES
from ..draft.lattice import build_lattice_tree, selector_chain
from ..tree import DraftTree, ExitLaw, additive_mask, exit_law

__all__ = ["EXIT_MODES", "TREE_MODES", "target_law", "exit_weights", "weights_from_law", "anchor_trees", "take_trees",
           "tree_query_mask", "kv_reuse_forward", "iter_tree_logits", "score_trees",
           "check_tree_support", "default_anchors_per_forward"]

EXIT_MODES = ("exit", "prefix", "reach", "exit_depth")
# TREE_MODES (sglang_tev.spec): ``marginal`` = DDTree over the per-depth draft logits;
# ``lattice`` = the lattice DDTree over a DFlash2 selector's candidate lattice; ``chain`` = the
# greedy chain (the selector's greedy walk with a lattice, else the per-depth argmax).


def target_law(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The target law ExitTrain's weights (and ``eval-drafter``'s metric) are computed from.

    Args:
        logits: float [..., V] target logits (upcast to float32; float64 stays float64).
        temperature: >= 0. 1.0 is ``softmax(logits)`` exactly as computed before this option
            existed (bit for bit); any other value is the runtime's processed law
            (:func:`sglang_tev.sampling.processed_probs`): ``softmax(logits / T)``, and below 1e-5
            the greedy one-hot law at the argmax (ties: lowest id).
    Returns:
        probs [..., V], float32 (float64 for float64 logits).
    Raises:
        ValueError naming ``temperature`` when it is negative or not finite.
    """
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature == 1.0:
        return torch.softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    from ..sampling import SamplingParams, processed_probs

    flat = logits.reshape(-1, logits.shape[-1])
    return processed_probs(flat, SamplingParams(temperature=float(temperature))).view(logits.shape)


def weights_from_law(tree: DraftTree, law: ExitLaw, mode: str, include_horizon_leaves: bool = True,
                     horizon: int | None = None) -> torch.Tensor:
    """Per-node weights of the exit-guided loss from an already computed exit law.

    Args:
        tree: the draft trees (N nodes).
        law: ``exit_law(tree, p)``.
        mode: ``"exit"``: ``w(v) = P(v)·rho(v)`` (paper Eq. 14); ``"prefix"``: the reachability
            control of §6.2, ``P(v)`` rescaled per tree so that it sums to what the exit weights
            sum to over the same nodes — ``(1 - w(root)) / C_p`` with every node included;
            ``"reach"``: plain ``P(v)`` (the reference recipes' ``dted_weight_type: P_tgt``,
            without their 1e-4 floor on each edge probability); ``"exit_depth"``:
            ``P(v)·rho(v)·depth(v)`` (the reference code's ``exit`` weight type).
        include_horizon_leaves: False zeroes the nodes at depth ``horizon`` (hard-horizon leaves,
            where ``rho = 1`` makes ``w = P``: "deep reach" credit rather than missing coverage).
        horizon: the maximum draft depth H; required when ``include_horizon_leaves`` is False.
    Returns:
        float [b, N] (the law's dtype), detached; 0 at the root and at padded nodes.
    Raises:
        ValueError naming ``mode`` or ``horizon``.
    """
    if mode not in EXIT_MODES:
        raise ValueError(f"mode must be one of {EXIT_MODES}, got {mode!r}")
    keep = tree.valid & (tree.depth > 0)
    if not include_horizon_leaves:
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon must be an int >= 1 when include_horizon_leaves is False, got {horizon!r}")
        keep = keep & (tree.depth != horizon)
    zero = torch.zeros_like(law.w)
    w = torch.where(keep, law.w, zero).detach()
    if mode == "exit":
        return w
    if mode == "exit_depth":
        return w * tree.depth.to(w.dtype)
    P = torch.where(keep, law.P, zero).detach()
    if mode == "reach":
        return P
    p_sum, w_sum = P.sum(1, keepdim=True), w.sum(1, keepdim=True)
    scale = torch.where(p_sum > 0, w_sum / torch.where(p_sum > 0, p_sum, torch.ones_like(p_sum)), zero[:, :1])
    return P * scale


def exit_weights(tree: DraftTree, target_probs: torch.Tensor, mode: str, include_horizon_leaves: bool = True,
                 horizon: int | None = None) -> torch.Tensor:
    """Detached per-node weights of ExitTrain's loss (paper Eq. 13-14, §6.2).

    Args:
        tree: the draft trees, N nodes (node 0 the root).
        target_probs: float [b, N, V], the target law at every node (:func:`target_law`).
        mode, include_horizon_leaves, horizon: as :func:`weights_from_law`.
    Returns:
        float [b, N] (float64 for float64 input, else float32), no grad. The root's weight is 0
        (it has no incoming draft edge); ``exit`` weights over non-root nodes sum to
        ``1 - w(root)``, ``prefix`` weights to the same total, ``reach`` weights to ``C_p`` and
        ``exit_depth`` weights to ``C_p`` as well (``Σ_v w(v)·depth(v) = C_p``, Eq. 6) when the
        horizon leaves are included.
    Raises:
        ValueError naming the argument (``target_probs`` shape/device, ``mode``, ``horizon``).
    """
    with torch.no_grad():
        law = exit_law(tree, target_probs.detach())
    return weights_from_law(tree, law, mode, include_horizon_leaves, horizon)


def take_trees(tree: DraftTree, idx: torch.Tensor) -> DraftTree:
    """The trees at rows ``idx`` (int64 [m]) of a batch, as a new :class:`DraftTree`."""
    return DraftTree(tree.parents[idx], tree.tokens[idx], tree.valid[idx], tree.depth[idx],
                     tree.ancestor_mask[idx], tree.max_depth)


def anchor_trees(draft_logits: torch.Tensor, budget: int, root_tokens: torch.Tensor,
                 keep: torch.Tensor | None = None, *, lattice=None, mode: str = "marginal") -> DraftTree:
    """The drafter's inference trees for a batch of anchors (no grad).

    Args:
        draft_logits: float [T, H, V], DFlash block logits, row d-1 = depth d (detached here).
        budget: non-root nodes per tree (the inference budget B; unused by ``chain``).
        root_tokens: int64 [T], ``x_a`` per anchor.
        keep: bool [T] or None; a False anchor's tree is cut to its root (no valid non-root node,
            so it adds nothing to the loss or its denominator).
        lattice: a :class:`~sglang_tev.draft.dflash2.SelectorLattice` of the same T blocks
            (``candidate_ids`` [T, H, k], ``transition_logq`` [T, H, k, k]); needed by ``lattice``,
            used by ``chain`` when given (the selector's greedy walk).
        mode: one of :data:`TREE_MODES`.
    Returns:
        :class:`DraftTree` with N = 1 + budget (``chain``: 1 + H).
    Raises:
        ValueError naming ``mode``: unknown, or ``lattice`` without a lattice.
    """
    if mode not in TREE_MODES:
        raise ValueError(f"mode: expected one of {TREE_MODES}, got {mode!r}")
    if mode == "lattice" and lattice is None:
        raise ValueError("mode: 'lattice' needs the drafter's selector lattice (a DFlash2 drafter with a selector)")
    with torch.no_grad():
        if mode == "marginal":
            tree = build_ddtree(draft_logits.detach().float(), budget, root_tokens, validate=False)
        elif mode == "lattice":
            tree = build_lattice_tree(lattice.candidate_ids, lattice.transition_logq.detach().float(), budget,
                                      root_tokens, validate=False)
        elif lattice is not None:
            tree = selector_chain(lattice.candidate_ids, lattice.transition_logq.detach().float(), root_tokens,
                                  0.0, validate=False)
        else:  # the argmax chain: a one-candidate lattice
            top = draft_logits.detach().argmax(-1, keepdim=True)                      # [T, H, 1]
            tree = selector_chain(top, torch.zeros(*top.shape, 1, device=top.device), root_tokens, 0.0,
                                  validate=False)
    if keep is None:
        return tree
    valid = tree.valid & keep[:, None]
    valid[:, 0] = True
    parents = torch.where(valid, tree.parents, torch.zeros_like(tree.parents))
    parents[:, 0] = -1
    return DraftTree.from_parents(parents, tree.tokens, valid, validate=False)


def tree_query_mask(tree: DraftTree, anchors: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Attention mask of the tree rows over ``[sequence (S) | tree rows]`` (bool, True = attend).

    Args:
        tree: the trees of ``c`` anchors per sequence for ``b`` sequences, row ``bi*c + j`` the
            tree of ``anchors[bi, j]``; N nodes each.
        anchors: int64 [b, c].
        seq_len: S.
    Returns:
        bool [b, 1, c*(N-1), S + c*(N-1)]. Row (j, v) (non-root node v of anchor j) sees sequence
        columns ``0..a_j`` (the root ``x_a`` and its context) and the non-root nodes of its own
        tree that are ancestors of v or v itself; other anchors' trees never.
    """
    b, c = anchors.shape
    n = tree.num_nodes - 1
    dev = anchors.device
    ctx = torch.arange(seq_len, device=dev) <= anchors[..., None]                  # [b, c, S]
    ctx = ctx[:, :, None, :].expand(b, c, n, seq_len).reshape(b, c * n, seq_len)
    anc = tree.ancestor_mask[:, 1:, 1:].reshape(b, c, n, n)                         # [b, c, n, n]
    eye = torch.eye(c, dtype=torch.bool, device=dev)
    blocks = anc[:, :, :, None, :] & eye[None, :, None, :, None]                    # [b, c, n, c, n]
    return torch.cat([ctx, blocks.reshape(b, c * n, c * n)], -1)[:, None]


def default_anchors_per_forward(batch: int, seq_len: int, budget: int, max_mask_elements: int = 1 << 26) -> int:
    """Anchors per tree forward (at least 1): tree rows per forward at most ``seq_len`` (the
    masked attention then costs at most twice the sequence's own columns per row), and the
    additive mask ``b x R x (S + R)`` (R = c·B rows) under ``max_mask_elements`` (default 64 Mi
    elements: 256 MiB in float32)."""
    # largest R with R * (S + R) <= M / b, then whole anchors of B rows each
    r = (-seq_len + math.sqrt(seq_len * seq_len + 4 * max_mask_elements / batch)) / 2
    b = max(budget, 1)
    return max(1, min(int(r // b), seq_len // b))


def check_tree_support(target) -> None:
    """Raise ``ValueError`` when ``target`` cannot score trees with a custom 4-D mask over a reused
    KV cache: sliding-window or non-full attention layers (the mask has no window and the cache
    would keep only the window), or an attention implementation that ignores 4-D masks."""
    cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    types = getattr(cfg, "layer_types", None) or []
    bad = sorted({t for t in types if t != "full_attention"})
    if bad or getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise ValueError(f"target: its attention layers {bad or ['sliding window']} cannot take ExitTrain's "
                         "tree mask over the sequence's KV cache; use a full-attention target or loss.exit.mode=none")
    impl = getattr(target.config, "_attn_implementation", None)
    if impl not in (None, "sdpa", "eager"):
        raise ValueError(f"target: attention implementation {impl!r} does not take a 4-D tree mask; "
                         "load it with sdpa or eager")


def kv_reuse_forward(decoder, seq_cache) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``forward_rows`` for :func:`score_trees` on a transformers decoder (``model.get_decoder()``).

    seq_cache: the ``DynamicCache`` of the sequence forward (keys 0..S-1). Each call runs the
    decoder over the extra query rows on a fresh cache holding copies of the sequence K/V, so no
    call sees (or keeps) another's rows and the sequence cache is never cropped.
    """
    from transformers import DynamicCache

    from ..compat import cache_kwargs

    def forward_rows(tokens, positions, mask):
        cache = DynamicCache()
        for i, layer in enumerate(seq_cache.layers):
            cache.update(layer.keys, layer.values, i)
        return decoder(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                       **cache_kwargs(decoder, cache)).last_hidden_state
    return forward_rows


@torch.no_grad()
def iter_tree_logits(
    forward_rows: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    last_hidden: torch.Tensor,
    tree: DraftTree,
    anchors: torch.Tensor,
    anchors_per_forward: int | None = None,
    mask_dtype: torch.dtype = torch.float32,
):
    """Target logits of every tree node, one chunk of anchors per target forward (DESIGN §6).

    Args:
        forward_rows: ``(tokens int64 [b, R], positions int64 [b, R], mask float [b, 1, R, S + R])
            -> final-normed hidden [b, R, H]``: the target decoder over extra query rows that reuse
            the sequence forward's KV (keys 0..S-1) and must not keep the rows' KV
            (:func:`kv_reuse_forward`).
        lm_head: the target's LM head.
        last_hidden: [b, S, H], the sequence forward's final-normed hidden states; the root of
            anchor a is scored by row a (its prediction of x_{a+1}).
        tree: trees of all anchors, row ``bi*n + j`` for ``anchors[bi, j]``; N nodes.
        anchors: int64 [b, n].
        anchors_per_forward: chunk size c over anchors (None: :func:`default_anchors_per_forward`).
        mask_dtype: dtype of the additive mask (the target's compute dtype).
    Yields:
        ``(rows int64 [b*c], trees DraftTree [b*c, N], logits [b*c, N, V])`` per chunk: node v of
        the tree of anchor a is scored on ``x[0..a] ‖ π(v)`` at position ``a + depth(v)``.
    """
    b, n = anchors.shape
    S, N = last_hidden.shape[1], tree.num_nodes
    c = anchors_per_forward or default_anchors_per_forward(b, S, N - 1)
    dev = anchors.device
    root_logits = lm_head(last_hidden.gather(1, anchors[..., None].expand(b, n, last_hidden.shape[-1])))  # [b, n, V]
    for j0 in range(0, n, c):
        j1 = min(n, j0 + c)
        m = j1 - j0
        rows = (torch.arange(b, device=dev)[:, None] * n + torch.arange(j0, j1, device=dev)).reshape(-1)
        sub = take_trees(tree, rows)
        if N == 1:  # budget 0: the root's law is all there is, and no query row is left to run
            yield rows, sub, root_logits[:, j0:j1, None].reshape(b * m, 1, -1)
            continue
        anc = anchors[:, j0:j1]
        tokens = sub.tokens[:, 1:].reshape(b, m * (N - 1))
        positions = (anc[..., None] + sub.depth[:, 1:].reshape(b, m, N - 1)).reshape(b, m * (N - 1))
        hidden = forward_rows(tokens, positions, additive_mask(tree_query_mask(sub, anc, S), mask_dtype))                                   # [b, m*(N-1), H]
        logits = torch.cat([root_logits[:, j0:j1, None], lm_head(hidden).reshape(b, m, N - 1, -1)], 2)
        yield rows, sub, logits.reshape(b * m, N, -1)


@torch.no_grad()
def score_trees(forward_rows, lm_head, last_hidden: torch.Tensor, tree: DraftTree, anchors: torch.Tensor,
                anchors_per_forward: int | None = None, mask_dtype: torch.dtype = torch.float32,
                temperature: float = 1.0) -> ExitLaw:
    """Exit law of every anchor's tree under the frozen target (paper §5).

    Arguments as :func:`iter_tree_logits`; ``temperature``: the target law's, as
    :func:`target_law` (1.0: softmax in float32, the reference code's law). The
    law of each chunk is computed as soon as its logits exist, so at most one chunk's
    ``[b*c, N, V]`` is alive. Returns :class:`ExitLaw` with [T, N] tensors (coverage [T]),
    T = b·n, row order of ``tree``. Raises ``ValueError`` naming ``temperature``.
    """
    target_law(torch.zeros(1, 1), temperature)  # checks it before any forward
    parts = [(rows, exit_law(sub, target_law(logits.float(), temperature), validate=False))
             for rows, sub, logits in iter_tree_logits(forward_rows, lm_head, last_hidden, tree, anchors,
                                                       anchors_per_forward, mask_dtype)]
    order = torch.cat([r for r, _ in parts]).argsort()
    return ExitLaw(*(torch.cat([getattr(law, f) for _, law in parts])[order] for f in ("P", "rho", "w", "coverage")))
