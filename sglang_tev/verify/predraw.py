"""Predraw-and-follow verification (DDTree; paper Appendix A.4.1)."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from ._common import follow_tokens, inverse_cdf


# Uniforms (spec.num_uniforms: U = N): ``uniforms[:, v]`` draws R_v ~ p_v by inverse CDF (vocabulary-id order).


def predraw_verify(tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor):
    """Draw R_v ~ p_v at every node, follow the child whose token is R_v, exit otherwise.

    The bonus token is the exit node's own draw R_V (paper Eq. 42-44: reach v with P(v), exit
    there with rho(v), bonus ~ p_v^res).

    Args:
        tree: draft trees, N nodes.
        probs: float [b, N, V], processed target law.
        uniforms: float64 [b, N] in [0, 1).
    Returns:
        (exit_node int64 [b], bonus int64 [b]). Cost: one cumulative sum over [b, N, V]. No host sync.
    """
    draws = inverse_cdf(probs, uniforms)  # [b, N]
    exit_node = follow_tokens(tree, draws)
    bonus = torch.gather(draws, 1, exit_node.unsqueeze(1)).squeeze(1)
    return exit_node, bonus
