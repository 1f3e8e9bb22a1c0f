"""Tree Exit Verification (TEV; paper §4, Algorithm 1)."""

from __future__ import annotations

import torch

from ..tree import DraftTree, ExitLaw, exit_law, residual_probs
from ._common import inverse_cdf

NUM_UNIFORMS = 2
"""U = 2: ``uniforms[:, 0]`` draws the exit node V ~ w (inverse CDF in node-index order);
``uniforms[:, 1]`` draws the bonus Y ~ p_V^res (inverse CDF in vocabulary-id order)."""


def tev_verify(tree: DraftTree, probs: torch.Tensor, uniforms: torch.Tensor, law: ExitLaw | None = None):
    """Sample the exit node from the canonical exit law, then the bonus from its residual.

    Algorithm 1: level-wise P propagation and node-local rho (see :func:`sglang_tev.exit_law`),
    one categorical draw V ~ w over the N nodes, one draw Y ~ p_V^res (p_V at a leaf). No per-node
    categorical draws, no data-dependent host loop, no host sync.

    Args:
        tree: draft trees, N nodes.
        probs: float [b, N, V], processed target law.
        uniforms: float64 [b, 2] in [0, 1).
        law: the exit law of (tree, probs) if already computed.
    Returns:
        (exit_node int64 [b], bonus int64 [b], law ExitLaw).
    """
    if law is None:
        law = exit_law(tree, probs, validate=False)
    # Nodes with w = 0 have empty intervals and are never drawn.
    exit_node = inverse_cdf(law.w, uniforms[:, 0])
    res = residual_probs(tree, probs, exit_node)
    bonus = inverse_cdf(res, uniforms[:, 1])
    return exit_node, bonus, law
