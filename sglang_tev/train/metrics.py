"""Drafter metrics at given anchors: per-depth accuracy and CE on held-out data, and the expected
block length ``1 + C_p`` of the drafter's own trees with where their exit mass lies — the one
tree-metric pipeline (:func:`tree_breakdowns`) behind the trainer's evaluation and
``sglang-tev eval-drafter`` (:mod:`.drafter_eval`).

Tree metric, per anchor ``a`` (root ``x_a``): the drafter's block logits -> the inference builder's
budget-B tree (:func:`.exit.anchor_trees`) -> the frozen target's law at temperature T on every
node ``x_{<=a} ‖ π(v)`` (:func:`laws_by_temperature`, every temperature from ONE tree pass) -> the
canonical exit law (paper §3) split by node kind and depth (:func:`exit_breakdown`). ``1 + C_p``
is the exact expected block length of a saturated exact verifier there (paper Theorem 1).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..draft.dflash import extract_context_features
from ..compat import cache_kwargs
from ..tree import DraftTree, ExitLaw, exit_law
from .data import TokenDataset, collate, valid_anchor_positions
from ..spec import resolve_draft_mode
from .exit import TREE_MODES, anchor_trees, iter_tree_logits, kv_reuse_forward, target_law
from .losses import block_logits, depth_stats, stats_to_metrics

__all__ = ["BREAKDOWN_KEYS", "TreeBreakdown", "exit_breakdown", "laws_by_temperature", "tree_breakdowns",
           "evaluate", "resolve_tree_mode", "draft_blocks"]

BREAKDOWN_KEYS = ("block_len", "w_root", "w_inner", "w_cut", "w_horizon")


@dataclass(frozen=True)
class TreeBreakdown:
    """Where the target mass leaves each tree (every field [T] float64 unless noted).

    block_len: ``1 + C_p`` (expected block length of a saturated exact verifier).
    w_root: exit mass at the root (no first-depth draft token taken).
    w_inner: at non-root nodes that have drafted children (partly covered next token).
    w_cut: at non-root leaves above the horizon (depth < H: the budget stopped expanding them).
    w_horizon: at leaves at the maximum draft depth H (the block's end).
    w_depth: [T, H + 1], exit mass by depth 0..H. ``w_root + w_inner + w_cut + w_horizon = 1``
    and ``Σ_d w_depth[:, d] = 1`` per tree (up to rounding).
    """

    block_len: torch.Tensor
    w_root: torch.Tensor
    w_inner: torch.Tensor
    w_cut: torch.Tensor
    w_horizon: torch.Tensor
    w_depth: torch.Tensor


def exit_breakdown(tree: DraftTree, law: ExitLaw, horizon: int) -> TreeBreakdown:
    """Split each tree's exit law (paper Lemma 1) by node kind and depth.

    Args:
        tree: T trees (N nodes, depths <= ``horizon``).
        law: ``exit_law`` of those trees.
        horizon: H, the drafter's maximum draft depth (block size - 1), >= 1.
    Returns:
        :class:`TreeBreakdown`, float64.
    Raises:
        ValueError naming ``horizon`` when it is < 1 or below the trees' depth.
    """
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1 or tree.max_depth > horizon:
        raise ValueError(f"horizon must be an int >= max(1, tree depth {tree.max_depth}), got {horizon!r}")
    w = law.w.double()
    nonroot = tree.valid.clone()
    nonroot[:, 0] = False
    has_child = tree.child_mask().any(-1)
    zero = torch.zeros_like(w)
    at_h = nonroot & (tree.depth == horizon)
    inner = nonroot & has_child & ~at_h
    cut = nonroot & ~has_child & ~at_h
    depth = torch.where(tree.valid, tree.depth, torch.zeros_like(tree.depth))
    w_depth = torch.zeros(w.shape[0], horizon + 1, dtype=w.dtype, device=w.device).scatter_add_(
        1, depth, torch.where(tree.valid, w, zero))
    return TreeBreakdown(1.0 + law.coverage.double(), w[:, 0], torch.where(inner, w, zero).sum(1),
                         torch.where(cut, w, zero).sum(1), torch.where(at_h, w, zero).sum(1), w_depth)


@torch.no_grad()
def laws_by_temperature(forward_rows, lm_head, last_hidden: torch.Tensor, tree: DraftTree, anchors: torch.Tensor,
                        temperatures: Sequence[float], anchors_per_forward: int | None = None,
                        mask_dtype: torch.dtype = torch.float32) -> list[ExitLaw]:
    """:func:`sglang_tev.train.exit.score_trees` at several temperatures from ONE tree pass:
    ``[ExitLaw]`` in the order of ``temperatures`` (each law as ``score_trees`` gives it)."""
    for t in temperatures:
        target_law(torch.zeros(1, 1), t)  # a bad temperature fails before any forward
    parts = [[] for _ in temperatures]
    rows_all = []
    for rows, sub, logits in iter_tree_logits(forward_rows, lm_head, last_hidden, tree, anchors,
                                              anchors_per_forward, mask_dtype):
        rows_all.append(rows)
        lg = logits.float()
        for i, t in enumerate(temperatures):
            parts[i].append(exit_law(sub, target_law(lg, t), validate=False))
    order = torch.cat(rows_all).argsort()
    return [ExitLaw(*(torch.cat([getattr(law, f) for law in ps])[order] for f in ("P", "rho", "w", "coverage")))
            for ps in parts]


def resolve_tree_mode(draft, mode: str = "auto") -> str:
    """The tree mode a drafter is measured / trained in: ``auto`` = ``lattice`` for a drafter with a
    DFlash2 candidate selector, else ``marginal``; otherwise ``mode`` itself (one of
    :data:`~.exit.TREE_MODES`). Raises :class:`~sglang_tev.spec.SpecError` naming ``mode`` for an unknown one, or
    ``lattice`` on a drafter without a selector."""
    has_selector = getattr(draft.config, "selector_rank", None) is not None
    return resolve_draft_mode(mode, has_selector, arg="mode", modes=("auto", *TREE_MODES),
                              lattice_error="'lattice' needs a DFlash2 drafter with a candidate selector "
                                            "(selector_rank / selector_top_k)")


def draft_blocks(draft, embed, head, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                 keep: torch.Tensor, block_size: int, mode: str = "marginal", forward_train=None):
    """A drafter's training-time block forward at ``anchors`` (identical to its inference draft):
    ``(logits float32 [b, n, K-1, V] (DFlash2: transformed), labels int64 [b, n, K-1], lattice)``
    with ``lattice`` the selector's :class:`~sglang_tev.draft.dflash2.SelectorLattice` over the
    ``b·n`` blocks (rows ``[b·n, K-1, k]``) when ``mode`` is ``lattice``, or ``chain`` on a drafter
    with a selector; else None. ``forward_train``: the (possibly DDP-wrapped) training forward
    (default ``draft.forward_train``)."""
    fwd = draft.forward_train if forward_train is None else forward_train
    logits, labels, hidden = block_logits(fwd, embed, head, features, ids, anchors, keep, block_size,
                                          draft.config.mask_token_id, transform=draft.transform_logits,
                                          return_hidden=True)
    lattice = None
    if mode in ("lattice", "chain") and getattr(draft.config, "selector_rank", None) is not None:
        T = anchors.numel()
        lattice = draft.candidate_selector.lattice(hidden.reshape(T, block_size - 1, -1),
                                                   logits.reshape(T, block_size - 1, -1),
                                                   ids.gather(1, anchors).reshape(-1))
    return logits, labels, lattice


@torch.no_grad()
def tree_breakdowns(draft_logits: torch.Tensor, budget: int, roots: torch.Tensor, keep: torch.Tensor,
                    forward_rows, lm_head, last_hidden: torch.Tensor, anchors: torch.Tensor,
                    temperatures: Sequence[float], anchors_per_forward: int | None = None,
                    mask_dtype: torch.dtype = torch.float32, autocast: dict | None = None, *,
                    lattice=None, mode: str = "marginal") -> list[TreeBreakdown]:
    """The tree metric of a drafter at a batch of anchors, per temperature.

    Args:
        draft_logits: float [T, H, V], the drafter's block logits (row d-1 = depth d), T = b·n.
        budget: the DDTree budget B; roots: int64 [T], ``x_a``; keep: bool [T] (a False anchor's
            tree is its root alone: mask its rows out of any mean).
        forward_rows, lm_head, last_hidden, anchors, anchors_per_forward, mask_dtype: the target's
            tree pass, as :func:`.exit.iter_tree_logits` (``anchors`` int64 [b, n]).
        temperatures: target-law temperatures.
        autocast: ``torch.autocast`` keyword arguments for the target's tree pass (None: the
            caller's autocast state).
        lattice, mode: how the block becomes a tree (:func:`.exit.anchor_trees`; ``lattice``: the
            DFlash2 selector lattice of the T blocks).
    Returns:
        ``[TreeBreakdown]`` with [T] rows, in the order of ``temperatures``.
    """
    tree = anchor_trees(draft_logits, budget, roots, keep, lattice=lattice, mode=mode)
    with torch.autocast(**autocast) if autocast is not None else contextlib.nullcontext():
        laws = laws_by_temperature(forward_rows, lm_head, last_hidden, tree, anchors, temperatures,
                                   anchors_per_forward, mask_dtype)
    return [exit_breakdown(tree, law, draft_logits.shape[1]) for law in laws]


@torch.no_grad()
def evaluate(draft, target, data: TokenDataset, *, block_size: int | None = None,
             stride: int = 4, max_windows: int | None = None, batch_size: int = 4,
             sep_ids: Sequence[int] = (), device: torch.device | None = None,
             autocast_dtype: torch.dtype | None = None, exit_budget: int | None = None,
             temperatures: Sequence[float] = (0.0, 1.0), tree_mode: str = "auto") -> dict:
    """Held-out per-depth top-1 accuracy and CE of a drafter against its target's data, and the
    expected block length ``1 + C_p`` of its trees there (the metric of ``sglang-tev eval-drafter``).

    Deterministic anchors: every valid position ``a`` (rule of :mod:`.data`) with
    ``(a - 1) % stride == 0``, in the first ``max_windows`` samples spread evenly over ``data``
    (all when None). Returns :func:`~.losses.stats_to_metrics`: ``acc``/``ce`` lists for depths
    1..K-1 (CE in nats), ``acc_mean``, ``ce_mean``, ``anchors``, ``accept_len_data``, plus
    ``windows`` and ``tokens``. With ``exit_budget`` (a DDTree budget B), also, per temperature T
    of ``temperatures``: ``block_len_T<T>`` (mean ``1 + C_p`` of the drafter's budget-B tree at
    those anchors under the target's law at T, :func:`tree_breakdowns`) and ``w_root_T<T>`` (mean
    exit mass at the root); keys like ``block_len_T0``, ``block_len_T1``. ``tree_mode``: how the
    block becomes a tree (:func:`resolve_tree_mode`; ``auto``: the selector lattice for a DFlash2
    drafter). A drafter with a candidate selector also gets ``sel_recall`` (label among the top-k
    candidates), ``sel_acc`` and ``unary_acc`` (teacher-forced top-1 of the selector's row after
    the true predecessor vs of the logits, over the covered slots; :func:`~.losses.selector_loss`).
    """
    from .losses import selector_loss

    K = block_size or draft.config.block_size
    mode = resolve_tree_mode(draft, tree_mode)
    has_selector = getattr(draft.config, "selector_rank", None) is not None
    sel_sums = torch.zeros(4, dtype=torch.float64)
    device = device or next(draft.parameters()).device
    n = len(data)
    idx = list(range(n)) if max_windows is None or max_windows >= n else \
        [i * n // max_windows for i in range(max_windows)]
    pad = sep_ids[0] if sep_ids else 0
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    decoder = target.get_decoder()
    was_training = draft.training
    draft.eval()
    total = None
    tokens = 0
    temps = [float(t) for t in temperatures] if exit_budget is not None else []
    tree_sums = torch.zeros(len(temps), 2, dtype=torch.float64)
    amp = dict(device_type=device.type, dtype=autocast_dtype or torch.bfloat16,
               enabled=autocast_dtype is not None)
    for start in range(0, len(idx), batch_size):
        ids, lmask = collate(data, idx[start:start + batch_size], pad)
        ids, lmask = ids.to(device), lmask.to(device)
        tokens += int(lmask.sum())
        b, S = ids.shape
        valid = valid_anchor_positions(ids, lmask, K, sep_ids)
        anchors = torch.arange(1, max(S - K + 1, 1), stride, device=device)[None].expand(b, -1)
        if anchors.shape[1] == 0:
            continue
        keep = valid.gather(1, anchors)
        cache = None
        if temps:
            from transformers import DynamicCache
            cache = DynamicCache()
        with torch.autocast(**amp):
            out = decoder(input_ids=ids, output_hidden_states=True, use_cache=cache is not None,
                          **(cache_kwargs(decoder, cache) if cache is not None else {}))
            feats = extract_context_features(out.hidden_states, draft.config.target_layer_ids)
            logits, labels, hidden = block_logits(draft.forward_train, embed, head, feats, ids, anchors, keep, K,
                                                  draft.config.mask_token_id, transform=draft.transform_logits,
                                                  return_hidden=True)
        lattice = None
        if has_selector:
            _, st = selector_loss(draft.candidate_selector, hidden.float(), logits, ids.gather(1, anchors), labels,
                                  keep[..., None].float().expand_as(labels))
            sel_sums += st.cpu()
            if mode in ("lattice", "chain"):
                lattice = draft.candidate_selector.lattice(hidden.reshape(-1, K - 1, hidden.shape[-1]).float(),
                                                           logits.reshape(-1, K - 1, logits.shape[-1]),
                                                           ids.gather(1, anchors).reshape(-1))
        st = depth_stats(logits, labels, keep)
        total = st if total is None else total + st
        if temps and bool(keep.any()):
            kept = keep.reshape(-1)
            mask_dtype = autocast_dtype or next(target.parameters()).dtype
            brs = tree_breakdowns(logits.reshape(-1, K - 1, logits.shape[-1]), exit_budget,
                                  ids.gather(1, anchors).reshape(-1), kept, kv_reuse_forward(decoder, cache),
                                  head, out.last_hidden_state, anchors, temps, mask_dtype=mask_dtype, autocast=amp,
                                  lattice=lattice, mode=mode)
            for i, br in enumerate(brs):
                tree_sums[i, 0] += br.block_len[kept].sum().cpu()
                tree_sums[i, 1] += br.w_root[kept].sum().cpu()
    draft.train(was_training)
    if total is None:
        raise ValueError(f"data: {data.source} has no valid anchor for block size {K}")
    out = stats_to_metrics(total)
    out.update(windows=len(idx), tokens=tokens)
    if has_selector:
        tot, cov, sel, uni = sel_sums.tolist()
        out.update(sel_recall=cov / tot if tot else math.nan, sel_acc=sel / cov if cov else math.nan,
                   unary_acc=uni / cov if cov else math.nan)
    for i, t in enumerate(temps):
        a = out["anchors"]
        out[f"block_len_T{t:g}"] = float(tree_sums[i, 0]) / a if a else math.nan
        out[f"w_root_T{t:g}"] = float(tree_sums[i, 1]) / a if a else math.nan
    return out
