"""Sequential residual verification (EAGLE-style tree decoding; paper Appendix A.4.2)."""

from __future__ import annotations

import torch

from ..tree import DraftTree, edge_probs, residual_probs
from ._common import follow, inverse_cdf


# Uniforms (spec.num_uniforms: U = N): ``uniforms[:, 0]`` draws the bonus from the exit node's residual (inverse CDF); ``uniforms[:, c]`` (c >= 1) is the acceptance test of child node c.


def sequential_verify(tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor):
    """Test the children of each reached node in index (pop) order; remove rejected mass.

    At a node v whose children u_1..u_k (index order) carry p_j = p_v(x_j) and
    M_{j-1} = p_1 + ... + p_{j-1}, child u_j is accepted when the earlier ones were rejected and
    ``uniform[u_j] * (1 - M_{j-1}) < p_j`` (conditional acceptance p_j / (1 - M_{j-1}), Eq. 49).
    If every child is rejected, the bonus is drawn from g^(k) = p_v^res (Eq. 53).

    The per-node decisions are computed for all nodes at once and the reached chain is read off
    the ancestor mask (:func:`~sglang_tev.verify._common.follow`), so there is no walk at all.

    Args:
        tree: draft trees, N nodes.
        probs: float [b, N, V], processed target law.
        uniforms: float64 [b, N] in [0, 1).
    Returns:
        (exit_node int64 [b], bonus int64 [b]). No host sync.
    """
    b, n, v = probs.shape
    dt = torch.float64
    par = tree.parents.clamp(min=0)
    is_child = tree.valid.clone()
    is_child[:, 0] = False
    edge = edge_probs(tree, probs).to(dt)
    edge = torch.where(is_child, edge, torch.zeros_like(edge))
    # M before each child: mass of earlier siblings (smaller index, same parent)
    idx = torch.arange(n, device=probs.device)
    same_parent = (par.unsqueeze(2) == par.unsqueeze(1)) & is_child.unsqueeze(1) & is_child.unsqueeze(2)
    earlier = same_parent & (idx.view(1, 1, n) < idx.view(1, n, 1))  # [b, c, c'] c' before c
    m_before = (earlier.to(dt) * edge.unsqueeze(1)).sum(-1)
    passed = is_child & (uniforms.to(dt) * (1.0 - m_before).clamp(min=0.0) < edge)
    # chosen child of each node = the first passing child in index order
    cand = torch.where(passed, idx.expand(b, n), torch.full((b, n), n, dtype=torch.int64, device=probs.device))
    first = torch.full((b, n), n, dtype=torch.int64, device=probs.device).scatter_reduce_(1, par, cand, reduce="amin")
    chosen = torch.where(first < n, first, torch.full_like(first, -1))
    exit_node = follow(tree, chosen)
    res = residual_probs(tree, probs, exit_node)
    bonus = inverse_cdf(res, uniforms[:, 0])
    return exit_node, bonus
