"""Greedy (argmax-follow) verification, exact only at temperature < 1e-5: the tensor walk
(:func:`greedy_verify`, any device, no host sync) and the host walk for small CPU batches
(:func:`greedy_on_host`, in C when the native helper is built). Both give equal outputs; the
fused Triton TEV kernel decides greedy rows inside the kernel."""

from __future__ import annotations

import torch

from ..native import native
from ..tree import DraftTree
from ._common import argmax_and_max, argmax_last, follow_tokens
from .output import VerifyOutput, first_nonfinite

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


# Greedy verification of small CPU trees (b x N up to execution.current().host_walk_max_nodes)
# walks the tree on the host, as the DDTree reference does: one argmax pass, then a dictionary
# walk over the tree's lists; larger batches and every other device use greedy_verify. Equal outputs.


def greedy_on_host(tree: DraftTree, logits: torch.Tensor) -> VerifyOutput:
    """Argmax-follow with the walk in Python: on CPU each small tensor op costs more than this
    whole walk (caches are cold after the target forward). Keeps the lists (and the first valid
    node whose row max, read at its argmax, is not finite) for :meth:`VerifyOutput.host`; tensors
    are built only if read."""
    b, n = tree.batch_size, tree.num_nodes
    cover_dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    fn = native("greedy_follow") if logits.dtype == torch.float32 else None
    if fn is not None:  # the same walk in one C call (sglang_tev/native/host_ops.c)
        x, par, tok, val = (t if t.is_contiguous() else t.contiguous()
                            for t in (logits, tree.parents, tree.tokens, tree.valid))
        out = torch.empty(b, 2 * n + 4, dtype=torch.int64)
        if fn(x.data_ptr(), b, n, x.shape[-1], par.data_ptr(), tok.data_ptr(), val.data_ptr(), out.data_ptr()) != 0:
            raise MemoryError("the native greedy walk could not allocate its scratch")
        rows = out.tolist()
        acc = [h[2 * n] for h in rows]
        return VerifyOutput.from_host(([h[: a + 1] for h, a in zip(rows, acc)], [h[n: n + a + 1] for h, a in zip(rows, acc)],
                                        acc, [h[2 * n + 1] for h in rows], [float(a) for a in acc],
                                        [h[2 * n + 2] for h in rows], [h[2 * n + 3] for h in rows]), n, cover_dt)
    top, row_max = argmax_and_max(logits)
    parents, tokens = tree.host()
    paths, path_tokens, acc, bonus = [], [], [], []
    for r in range(b):
        par, tok, tp = parents[r], tokens[r], top[r]
        child = {(par[i] << 32) | tok[i]: i for i in range(1, len(par))}
        cur, path = 0, [0]
        nxt = child.get(tp[0])  # the root's key: (0 << 32) | token
        while nxt is not None:
            path.append(nxt)
            cur = nxt
            nxt = child.get((cur << 32) | tp[cur])
        paths.append(path)
        path_tokens.append([tok[i] for i in path])
        acc.append(len(path) - 1)
        bonus.append(tp[cur])
    return VerifyOutput.from_host((paths, path_tokens, acc, bonus, [float(a) for a in acc],
                                    [len(p) for p in parents],
                                    [first_nonfinite(m, len(p)) for m, p in zip(row_max, parents)]), n, cover_dt)
