"""Pieces shared by the verifiers: inverse-CDF draws and the child-following walk."""

from __future__ import annotations

import torch

from ..tree import DraftTree


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row by inverse CDF in vocabulary-id order.

    Args:
        probs: float [..., V], non-negative, positive total per row (need not be normalised).
        u: float64 [...], uniforms in [0, 1).
    Returns:
        int64 [...]: the first id whose cumulative mass exceeds ``u * total``. A zero-probability
        token has an empty interval and is never returned.

    The comparison runs in float64 so that ``u * total < total`` holds exactly.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    x = (u.to(torch.float64) * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def follow(tree: DraftTree, chosen_child: torch.Tensor) -> torch.Tensor:
    """Walk from the root along ``chosen_child`` for ``tree.max_depth`` static steps.

    Args:
        chosen_child: int64 [b, N], the child a verifier moves to from each node, or -1 to exit.
    Returns:
        int64 [b], the exit node.
    """
    b = tree.batch_size
    cur = torch.zeros(b, dtype=torch.int64, device=tree.device)
    for _ in range(tree.max_depth):
        nxt = torch.gather(chosen_child, 1, cur.unsqueeze(1)).squeeze(1)
        cur = torch.where(nxt >= 0, nxt, cur)
    return cur


def child_with_token(tree: DraftTree, token_per_node: torch.Tensor) -> torch.Tensor:
    """int64 [b, N]: the valid child of each node whose token equals ``token_per_node`` [b, N], else -1.

    Siblings carry distinct tokens, so at most one child matches.
    """
    b, n = tree.parents.shape
    par = tree.parents.clamp(min=0)
    want = torch.gather(token_per_node, 1, par)  # the token each node's parent wants
    match = tree.valid & (tree.tokens == want)
    match[:, 0] = False
    idx = torch.arange(n, device=tree.device).expand(b, n)
    out = torch.full((b, n), -1, dtype=torch.int64, device=tree.device)
    return out.scatter_reduce_(1, par, torch.where(match, idx, torch.full_like(idx, -1)), reduce="amax")
