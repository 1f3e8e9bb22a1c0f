"""Greedy (argmax-follow) verification: exact only at temperature < 1e-5."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from ._common import argmax_last, follow_tokens

NUM_UNIFORMS = 0
"""Greedy uses no randomness."""


def greedy_verify(tree: DraftTree, scores: torch.Tensor):
    """Follow the target argmax from the root; the bonus is the argmax at the exit node.

    Args:
        tree: draft trees, N nodes.
        scores: float [b, N, V], target logits (or any scores with the same argmax, such as the
            processed law at T < 1e-5).
    Returns:
        (exit_node int64 [b], bonus int64 [b]).
    Ties in the argmax go to the lowest id. No host sync; no loop over depths.
    """
    top = argmax_last(scores)  # [b, N]
    exit_node = follow_tokens(tree, top)
    bonus = torch.gather(top, 1, exit_node.unsqueeze(1)).squeeze(1)
    return exit_node, bonus
