"""The dense DFlash objective: training blocks, per-slot labels and weights, weighted CE.

Source: SpecForge ``OnlineDFlashModel`` (``specforge/algorithms/common/dflash_family_model.py``,
loss type ``dflash``) and DESIGN §6, re-derived here. For an anchor ``a`` of a sequence ``x``
the block is ``[x_a, MASK x (K-1)]`` at positions ``a .. a+K-1``; the drafter sees the target
features of ``x[0:a]`` (strictly before the anchor) and its own block bidirectionally; slot
``k = 1..K-1`` predicts ``x_{a+k}`` through the target's LM head; slot 0 is never a label.

    L_tok = Σ_{anchors, k} w_k · CE(logits_k, x_{a+k}) / Σ_{anchors, k} w_k,
    w_k = exp(-(k-1)/γ)  (1 when γ is None),   summed over valid anchors only.

Every loss term is a :class:`LossTerm` — a (numerator, denominator) pair of scalar sums over
this rank's items — and :func:`combine_terms` divides each numerator by its denominator summed
over all ranks (and accumulation steps), so the result is the global weighted mean whatever the
sharding. ExitTrain's ``exit_loss`` (paper Eq. 14: numerator Σ_v w(v)·(-log q_{d(v)}(x_v)),
denominator the number of non-root tree nodes, global) is :func:`exit_loss`, one more term.

Letters: b sequences, S tokens, n anchors per sequence, K block size, H hidden, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

__all__ = ["LossTerm", "decay_weights", "block_inputs", "block_logits", "slot_ce", "token_loss",
           "distill_loss", "exit_loss", "lattice_exit_loss", "selector_loss", "SELECTOR_LABELS", "SELECTOR_GOLD",
           "combine_terms", "depth_stats", "stats_to_metrics"]

SELECTOR_LABELS = ("data", "target")
SELECTOR_GOLD = ("strict", "insert")


class LossTerm(NamedTuple):
    """One loss term on one rank.

    numerator : float32 scalar with grad, Σ_i w_i · ℓ_i over this rank's items.
    denominator : float32 scalar without grad, Σ_i w_i (the normaliser), to be summed over ranks.
    """

    numerator: torch.Tensor
    denominator: torch.Tensor


def decay_weights(block_size: int, gamma: float | None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """float32 ``[K-1]``: ``w_k = exp(-(k-1)/gamma)`` for slots ``k = 1..K-1`` (ones if gamma is None).

    SpecForge ``loss_decay_gamma`` (its Qwen3 recipes use γ = 7). Raises ``ValueError`` for
    ``block_size < 2`` or ``gamma <= 0``.
    """
    if block_size < 2:
        raise ValueError(f"block_size: must be >= 2, got {block_size}")
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    if gamma is None:
        return torch.ones_like(k)
    if not gamma > 0:
        raise ValueError(f"gamma: must be > 0 or None, got {gamma}")
    return torch.exp(-(k - 1) / gamma)


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, positions and labels of the training blocks.

    ids : int64 ``[b, S]``; anchors : int64 ``[b, n]``.
    Returns ``block_ids int64 [b, n*K]`` (block i = ``[x_a, MASK x (K-1)]``),
    ``positions int64 [b, n*K]`` (``a .. a+K-1``) and ``labels int64 [b, n, K-1]``
    (``labels[.., k-1] = x_{a+k}``; indices past ``S-1`` are clamped — such slots belong to
    invalid anchors and must carry weight 0).
    """
    b, S = ids.shape
    n, K = anchors.shape[1], block_size
    block_ids = torch.full((b, n, K), mask_token_id, dtype=torch.long, device=ids.device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    offs = torch.arange(K, device=ids.device)
    positions = (anchors[..., None] + offs).reshape(b, n * K)
    lab_idx = (anchors[..., None] + offs[1:]).clamp(max=S - 1)            # [b, n, K-1]
    labels = ids.gather(1, lab_idx.reshape(b, -1)).reshape(b, n, K - 1)
    return block_ids.reshape(b, n * K), positions, labels


def block_logits(forward_train: Callable[..., torch.Tensor], embed: Callable, lm_head: Callable,
                 features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                 keep: torch.Tensor, block_size: int,
                 mask_token_id: int, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 return_hidden: bool = False):
    """Draft logits of every training block (one masked full-sequence forward).

    forward_train : ``DFlashDraftModel.forward_train`` (or a DDP-wrapped module with its
        signature); embed / lm_head : the target's frozen embedding and LM head.
    features : ``[b, S, n_ids*H]`` target context features (detached); ids : int64 ``[b, S]``;
    anchors : int64 ``[b, n]``; keep : bool ``[b, n]`` (False blocks attend only to themselves).
    transform : applied to the float32 logits (DFlash2's ``DFlashDraftModel.transform_logits``:
        ``output_multiplier`` then soft-capping, as at inference); None = identity (DFlash v1).
    return_hidden : also return the final-normed hidden states of slots 1..K-1 ``[b, n, K-1, H]``
        (the candidate selector's input).
    Returns ``(logits float32 [b, n, K-1, V], labels int64 [b, n, K-1])`` [``+ (hidden,)``].
    """
    from ..draft.dflash import block_train_mask

    b, S = ids.shape
    n, K = anchors.shape[1], block_size
    block_ids, positions, labels = block_inputs(ids, anchors, K, mask_token_id)
    with torch.no_grad():
        embeds = embed(block_ids)                                         # [b, n*K, H], frozen
    mask = block_train_mask(anchors, S, K, keep)                          # [b, n*K, S + n*K]
    hidden = forward_train(features, embeds, positions, mask)             # [b, n*K, H]
    hidden = hidden.reshape(b, n, K, -1)[:, :, 1:]                        # slots 1..K-1
    head_w = getattr(lm_head, "weight", None)
    if isinstance(head_w, torch.Tensor) and not torch.is_autocast_enabled(hidden.device.type):
        hidden = hidden.to(head_w.dtype)
    logits = lm_head(hidden).float()
    if transform is not None:
        logits = transform(logits)
    return (logits, labels, hidden) if return_hidden else (logits, labels)


def slot_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-slot cross-entropy in nats, float32, shape of ``labels`` (logits ``[..., V]``)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                           reduction="none").view(labels.shape)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
               ce: torch.Tensor | None = None) -> LossTerm:
    """Weighted CE of the dense DFlash objective.

    logits : float ``[..., V]``; labels : int64 ``[...]``; weights : float ``[...]`` (0 for
    excluded slots, else ``w_k``); ce : optional precomputed :func:`slot_ce` (with grad).
    Returns ``LossTerm(Σ w·CE, Σ w)``; CE in nats, computed in float32.
    """
    if ce is None:
        ce = slot_ce(logits, labels)
    return _weighted(ce, weights)


def _weighted(ce: torch.Tensor, weights: torch.Tensor) -> LossTerm:
    """``LossTerm(Σ w·ce, Σ w)`` with the denominator detached."""
    w = weights.float()
    return LossTerm((ce * w).sum(), w.sum().detach())


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor,
                 weights: torch.Tensor) -> LossTerm:
    """Weighted soft-target CE against the target's next-token distribution (distillation).

    logits : draft logits ``[..., V]``; target_logits : the target's logits predicting the
    same tokens (teacher-forced on the same prefix), ``[..., V]``, no grad; weights : float
    ``[...]`` as in :func:`token_loss`. Per slot ``-Σ_v p_target(v) log q_draft(v)`` in nats
    (= KL(p_target || q_draft) + H(p_target)), float32. Returns ``LossTerm(Σ w·CE, Σ w)``.
    The T = 0 acceptance of a draft token is "it is the target's argmax", so matching the
    target's distribution rather than the data's noisier one-hot labels is what acceptance rewards.
    """
    logq = F.log_softmax(logits.float(), dim=-1)
    p = F.softmax(target_logits.detach().float(), dim=-1)
    return _weighted(-(p * logq).sum(-1), weights)


def exit_loss(draft_logits: torch.Tensor, tree, weights: torch.Tensor) -> LossTerm:
    """ExitTrain's tree term (paper Eq. 14, evaluated as App. C.2 Eq. 66-67).

    draft_logits : float ``[b, H, V]`` with grad, the DFlash block logits of b anchors; row
        ``d-1`` is the position-wise marginal q_d shared by every node at depth d.
    tree : :class:`~sglang_tev.tree.DraftTree` of those anchors (N nodes, depths <= H).
    weights : float ``[b, N]``, detached per-node weights (:func:`sglang_tev.train.exit.exit_weights`).

    Numerator ``Σ_v weights[v]·(logsumexp(z_{d(v)}) − z_{d(v), x_v})`` over valid non-root nodes,
    as ``Σ_rows W_row·logsumexp(z_row) − Σ_v weights[v]·z_{d(v), x_v}`` with ``W_row`` the summed
    weight of a row's nodes: one log-normaliser per draft row and one gather, never a normalised
    ``[nodes, V]`` tensor. Denominator: the number of valid non-root nodes (made global over ranks
    and accumulation steps by :func:`combine_terms`). Computed in float64 for float64 logits, else
    float32. Raises ``ValueError`` naming ``weights`` or ``tree`` on shape mismatch.
    """
    b, H, V = draft_logits.shape
    if tuple(weights.shape) != tuple(tree.parents.shape) or tree.batch_size != b:
        raise ValueError(f"weights: expected [{b}, N] matching the tree {tuple(tree.parents.shape)}, "
                         f"got {tuple(weights.shape)}")
    if tree.max_depth > H:
        raise ValueError(f"tree: depth {tree.max_depth} exceeds the {H} draft rows")
    dt = torch.float64 if draft_logits.dtype == torch.float64 else torch.float32
    z = draft_logits.to(dt)
    nonroot = tree.valid & (tree.depth > 0)
    w = torch.where(nonroot, weights.detach().to(dt), torch.zeros((), dtype=dt, device=z.device))
    row = (tree.depth - 1).clamp(min=0)                                   # [b, N]
    row_w = torch.zeros(b, H, dtype=dt, device=z.device).scatter_add_(1, row, w)
    z_tok = z.reshape(b, H * V).gather(1, row * V + tree.tokens.clamp(0, V - 1))
    numerator = (row_w * torch.logsumexp(z, dim=-1)).sum() - (w * z_tok).sum()
    return LossTerm(numerator, nonroot.sum().to(dt))


def lattice_exit_loss(transition_logq: torch.Tensor, candidate_ids: torch.Tensor, tree,
                      weights: torch.Tensor) -> LossTerm:
    """ExitTrain's tree term (paper Eq. 14) on lattice trees of a DFlash2 drafter.

    transition_logq : float ``[b, H, k, k]`` with grad (:class:`~sglang_tev.draft.dflash2.SelectorLattice`);
        row p of slot d is log q(slot d's candidate | slot d-1 took candidate p); slot 0: row 0.
    candidate_ids : int64 ``[b, H, k]``, the lattice's candidates (distinct per slot).
    tree : :class:`~sglang_tev.tree.DraftTree` built on that lattice (every node's token is a
        candidate of its slot, as :func:`~sglang_tev.draft.lattice.build_lattice_tree` makes them).
    weights : float ``[b, N]``, detached per-node weights.

    The draft log-probability of node v at depth d is the lattice's, ``transition_logq[d-1,
    c(parent), c(v)]`` (c = a node's candidate index, found by its token; a depth-1 node reads row
    0): numerator ``-Σ_v weights[v]·log q(v | parent)``, denominator the number of valid non-root
    nodes, as :func:`exit_loss`. Raises ``ValueError`` naming ``weights`` or ``tree`` on mismatch.
    """
    b, H, k, _ = transition_logq.shape
    if tuple(weights.shape) != tuple(tree.parents.shape) or tree.batch_size != b:
        raise ValueError(f"weights: expected [{b}, N] matching the tree {tuple(tree.parents.shape)}, "
                         f"got {tuple(weights.shape)}")
    if tree.max_depth > H:
        raise ValueError(f"tree: depth {tree.max_depth} exceeds the {H} lattice slots")
    n = tree.parents.shape[1]
    nonroot = tree.valid & (tree.depth > 0)
    slot = (tree.depth - 1).clamp(min=0)                                          # [b, N]
    cands = candidate_ids.gather(1, slot[..., None].expand(b, n, k))              # [b, N, k]
    own = (cands == tree.tokens[..., None]).to(torch.int8).argmax(-1)             # [b, N]
    parent = own.gather(1, tree.parents.clamp(min=0))
    parent = torch.where(tree.depth > 1, parent, torch.zeros_like(parent))
    lq = transition_logq.float().reshape(b, H * k * k).gather(1, (slot * k + parent) * k + own)
    w = torch.where(nonroot, weights.detach().float(), torch.zeros((), device=lq.device))
    return LossTerm(-(w * lq).sum(), nonroot.sum().float())


def selector_loss(selector, hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor,
                  labels: torch.Tensor, weights: torch.Tensor, *, target_logits: torch.Tensor | None = None,
                  gold: str = "strict") -> tuple[LossTerm, torch.Tensor]:
    """DFlash2's candidate-selector objective, teacher-forced (SpecForge PR #772, re-derived).

    Per slot ``d`` of a block (depth d + 1) the candidates are the top-k of the slot's transformed
    draft logits and the predecessor is the TRUE token before the slot (``x_a`` for slot 0, the
    label of slot d-1 after it): the row of the lattice the selector is in when the drafter's walk
    so far was right. Scores: :meth:`~sglang_tev.draft.dflash2.CandidateSelector.teacher_forced_scores`
    (unary at the candidates + the bilinear term); the loss is a k-way cross-entropy of
    ``log_softmax(scores)``:

    * hard labels (``target_logits`` None): the label token. ``gold="strict"``: slots whose label is
      not among the candidates carry no selector loss (SpecForge's current strict top-k rule);
      ``"insert"``: the label replaces the last candidate there (PR #772's first rule), so every
      slot trains.
    * soft labels (``target_logits`` given, ``[b, n, H, V]``, the target's logits at the same slots):
      the target's law restricted to the candidates and renormalised, ``-Σ_c p̃(c) log s(c)`` —
      the distillation analogue, the conditional the lattice's row should carry.

    Args:
        selector: the drafter's :class:`~sglang_tev.draft.dflash2.CandidateSelector`.
        hidden: ``[b, n, H, Hd]`` slot hidden states; logits: float ``[b, n, H, V]`` transformed
            draft logits (with grad); roots: int64 ``[b, n]`` (``x_a``); labels: int64 ``[b, n, H]``;
            weights: float ``[b, n, H]`` (``keep · decay``, as the dense terms).
        gold: one of :data:`SELECTOR_GOLD` (hard labels only).
    Returns:
        ``(LossTerm(Σ w·CE, Σ w over contributing slots), stats float64 [4])`` with stats =
        ``[Σ w, Σ w·[label in top-k], Σ w·[label in top-k and the selector's argmax is it],
        Σ w·[label in top-k and the unary argmax is it]]`` (recall and the teacher-forced top-1 of
        the selector vs the unary head, summable over ranks).
    Raises:
        ValueError naming ``gold`` for an unknown rule.
    """
    if gold not in SELECTOR_GOLD:
        raise ValueError(f"gold: expected one of {SELECTOR_GOLD}, got {gold!r}")
    k = selector.top_k
    pred = torch.cat([roots[..., None], labels[..., :-1]], dim=-1)                 # [b, n, H]
    unary, cand = torch.topk(logits, k, dim=-1)                                    # [b, n, H, k]
    hit = cand == labels[..., None]
    covered = hit.any(-1)
    w = weights.float()
    if target_logits is None and gold == "insert":
        last = torch.zeros_like(hit)
        last[..., -1] = True
        swap = last & ~covered[..., None]
        cand = torch.where(swap, labels[..., None], cand)
        unary = torch.where(swap, logits.gather(-1, labels[..., None]), unary)
        hit = cand == labels[..., None]
    scores = selector.teacher_forced_scores(hidden, unary, cand, pred)
    logp = torch.log_softmax(scores, dim=-1)
    if target_logits is not None:
        p = torch.softmax(target_logits.detach().float(), dim=-1).gather(-1, cand)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
        ce = -(p * logp).sum(-1)
        wl = w
    else:
        ce = -(logp * hit.float()).sum(-1)
        wl = w * hit.any(-1).float()
    with torch.no_grad():
        first = torch.zeros_like(hit)
        first[..., 0] = True                    # topk is descending: index 0 is the unary argmax
        sel_top = F.one_hot(scores.argmax(-1), k).bool()
        stats = torch.stack([w.sum(), (w * covered).sum(), (w * (sel_top & hit).any(-1) * covered).sum(),
                             (w * (first & hit).any(-1) * covered).sum()]).double()
    return LossTerm((ce * wl).sum(), wl.sum().detach()), stats


def combine_terms(terms: Sequence[tuple[float, LossTerm]],
                  all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  world_size: int = 1) -> tuple[torch.Tensor, list[float]]:
    """``Σ_i λ_i · num_i / D_i`` with ``D_i`` = denominator i summed over ranks.

    terms : ``[(λ_i, LossTerm_i), ...]``; all_reduce : sums a 1-D tensor over ranks in place
    (None: single process). The returned loss is multiplied by ``world_size`` so that DDP's
    gradient averaging yields the gradient of the global mean. A zero global denominator (no
    valid item anywhere) gives that term 0. Returns ``(loss scalar, [D_i as floats])``.
    """
    dens = torch.stack([t.denominator.float() for _, t in terms])
    if all_reduce is not None:
        all_reduce(dens)
    loss = terms[0][1].numerator.new_zeros(())
    for (lam, t), d in zip(terms, dens):
        if lam:
            loss = loss + lam * t.numerator / d.clamp_min(1e-12)
    return loss * world_size, dens.tolist()


@torch.no_grad()
def depth_stats(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor,
                ce: torch.Tensor | None = None) -> torch.Tensor:
    """Sums for per-depth metrics, float64 ``[3*(K-1) + 2]``, summable over batches and ranks.

    Layout: ``[correct_1..K-1 | ce_1..K-1 | count_1..K-1 | n_anchors | Σ leading-correct]``
    where correct = argmax hits, ce = Σ CE (nats) over valid anchors, and "leading-correct" is
    the number of depths matched before the first miss (the accept length a chain would get if
    the data were the target's greedy continuation). ``ce``: optional precomputed
    :func:`slot_ce`. Turn into metrics with :func:`stats_to_metrics`.
    """
    Km1 = logits.shape[-2]
    valid = keep[..., None].expand(*keep.shape, Km1)
    hit = (logits.argmax(-1) == labels) & valid                          # [b, n, K-1]
    ce = slot_ce(logits, labels) if ce is None else ce
    ce = torch.where(valid, ce, torch.zeros_like(ce))
    lead = hit.long().cumprod(-1).sum(-1)                                 # [b, n]
    return torch.cat([hit.sum((0, 1)).double(), ce.sum((0, 1)).double(),
                      valid.sum((0, 1)).double(), keep.sum().double()[None],
                      lead[keep].sum().double()[None]])


def stats_to_metrics(stats: torch.Tensor) -> dict:
    """Metrics of :func:`depth_stats` sums: ``acc`` / ``ce`` per depth (lists, depth 1 first),
    ``acc_mean``, ``ce_mean`` (mean over all (anchor, depth) slots), ``anchors``,
    ``accept_len_data`` (mean leading-correct depths)."""
    s = stats.double().tolist()
    Km1 = (len(s) - 2) // 3
    correct, ce, count = s[:Km1], s[Km1:2 * Km1], s[2 * Km1:3 * Km1]
    anchors, lead = s[-2], s[-1]
    total = sum(count)
    return {
        "anchors": int(anchors),
        "acc": [c / n if n else math.nan for c, n in zip(correct, count)],
        "ce": [c / n if n else math.nan for c, n in zip(ce, count)],
        "acc_mean": sum(correct) / total if total else math.nan,
        "ce_mean": sum(ce) / total if total else math.nan,
        "accept_len_data": lead / anchors if anchors else math.nan,
    }

