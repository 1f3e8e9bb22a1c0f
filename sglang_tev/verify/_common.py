"""Pieces shared by the verifiers: inverse-CDF draws and the child-following walk."""

from __future__ import annotations

import torch

from .. import execution
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
    """The exit node of the walk from the root along ``chosen_child``, without a walk.

    Args:
        chosen_child: int64 [b, N], the child a verifier moves to from each node, or -1 to exit.
    Returns:
        int64 [b], the exit node.

    A node is reached iff every edge on its root path is the one chosen at its parent; the
    reached nodes form one chain and, since parents precede children, the exit (the deepest) is
    the largest reached index. A fixed number of ops over the ancestor mask [b, N, N] (no loop
    over depths, no host sync).
    """
    want = torch.gather(chosen_child, 1, tree.parents.clamp(min=0))  # the child each node's parent chose
    idx = torch.arange(tree.num_nodes, device=tree.device)
    return _deepest_reached(tree, tree.valid & (want == idx))


def follow_tokens(tree: DraftTree, token_per_node: torch.Tensor) -> torch.Tensor:
    """The exit node of the walk that moves from each node to its child carrying
    ``token_per_node`` [b, N] (int64) and exits where no child does (argmax-follow, predraw).

    Returns:
        int64 [b]. Siblings carry distinct tokens, so the walk is unique; same cost as :func:`follow`.
    """
    want = torch.gather(token_per_node, 1, tree.parents.clamp(min=0))  # the token each node's parent wants
    return _deepest_reached(tree, tree.valid & (tree.tokens == want))


def _deepest_reached(tree: DraftTree, edge_taken: torch.Tensor) -> torch.Tensor:
    """int64 [b]: the deepest node whose root path uses only taken edges (``edge_taken`` bool
    [b, N]: the edge into each node is taken; the root's entry is ignored)."""
    blocked = ~edge_taken
    blocked[:, 0] = False
    reached = ~(tree.ancestor_mask & blocked.unsqueeze(1)).any(-1)  # [b, N]
    idx = torch.arange(tree.num_nodes, device=tree.device)
    return torch.where(reached, idx, torch.zeros_like(idx)).amax(-1)


def _numpy_view(x: torch.Tensor):
    """A zero-copy NumPy view of a CPU float32 / float64 tensor without grad, else None: NumPy's
    vectorised argmax is the cheaper one there (measured 5 us against torch's 150 us for
    [17, 4096] on the development VM). Both return the first maximum (and the first NaN, if any)."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad
            and execution.current().numpy_argmax):
        return x.numpy()
    return None


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """int64 ``x.shape[:-1]``: argmax over the last dimension, ties to the lowest index (NumPy on
    CPU, see :func:`_numpy_view`; ``torch.argmax`` elsewhere)."""
    xn = _numpy_view(x)
    if xn is None:
        return x.argmax(-1)
    import numpy as np

    return torch.from_numpy(np.ascontiguousarray(np.argmax(xn, axis=-1)).astype(np.int64, copy=False))


def argmax_and_max(x: torch.Tensor) -> tuple[list, list]:
    """Per row of ``x`` [..., V]: the argmax (as :func:`argmax_last`) and the value there, which
    is the row's max (NaN if the row holds a NaN), as nested lists."""
    xn = _numpy_view(x)
    if xn is None:
        top = x.argmax(-1)
        return top.tolist(), x.gather(-1, top.unsqueeze(-1)).squeeze(-1).float().tolist()
    import numpy as np

    top = np.argmax(xn, axis=-1)
    return top.tolist(), np.take_along_axis(xn, top[..., None], -1)[..., 0].tolist()
