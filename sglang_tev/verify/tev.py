"""Tree Exit Verification (TEV; paper §4, Algorithm 1), torch reference.

This file is the specification of the fused kernel in :mod:`sglang_tev.verify.triton_tev`: both take
the same target logits, sampling parameters and uniforms and return the same exit node and bonus.
"""

from __future__ import annotations

import torch

from ..sampling import GREEDY_EPS, SamplingParams, processed_probs
from ..tree import DraftTree, ExitLaw, _law_dtype, _propagate, exit_law, residual_probs
from ._common import inverse_cdf

CHUNK_ELEMENTS = 1 << 20
"""On CPU, :func:`tev_verify_logits` handles about this many logits (4 MB of float32) per chunk
of node rows: each pass over a chunk stays in cache, and the allocator reuses the chunk buffer
instead of faulting in a fresh [b, N, V] one per call."""

# Uniforms (spec.num_uniforms: 2): ``uniforms[:, 0]`` draws the exit node V ~ w (inverse CDF in
# node-index order); ``uniforms[:, 1]`` draws the bonus Y ~ p_V^res (inverse CDF in vocabulary-id order).


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


def tev_verify_logits(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor):
    """TEV from target logits: one pass over the logits plus the exit row, the processed law never
    held in full.

    Same law and same use of the uniforms as :func:`tev_verify` on
    ``processed_probs(target_logits, sampling)``. The nodes are processed in chunks of rows
    (on CPU about 4 MB each, so every pass over a chunk stays in cache and no [b, N, V] buffer
    is allocated; on other devices one chunk):

    1. ``e`` = the chunk's processed law, up to a per-row factor when no truncation can be
       active (scalar temperature, top-k / top-p / min-p off: decided on the host from Python
       scalars, no sync): ``exp((x - max x) / T)``; else :func:`processed_probs` of the chunk.
    2. The drafted children's entries are read (edge mass) and set to 0 in ``e``; one sum over V
       gives every node's non-child mass ``Z_nc(v)``. ``Z(v) = Z_nc(v) +`` the children's mass
       is a sum of non-negative terms (no cancellation), and ``rho(v) = Z_nc(v) / Z(v)`` is the
       masked non-child mass of :func:`sglang_tev.exit_law`: exactly 0 when the children cover
       the support (top-k at or below the number of drafted children), not ``1 - sum``.
    3. After the exit draw, the exit row's law is recomputed from its logits (the same ops) and
       its children removed: p_V^res; p_V itself where ``Z_nc(V) = 0``, as
       :func:`sglang_tev.residual_probs` falls back.

    Args:
        tree: draft trees, N nodes.
        target_logits: float [b, N, V] (bf16 / fp16 upcast to float32; float64 stays float64).
            Rows of padded nodes are ignored (may hold NaN).
        sampling: the target law's parameters (scalars or [b] tensors).
        uniforms: float64 [b, 2] in [0, 1).
    Returns:
        (exit_node int64 [b], bonus int64 [b], law ExitLaw). No host sync.
    """
    b, n, v = target_logits.shape
    dev = target_logits.device
    dt = _law_dtype(target_logits)
    plain = _plain_temperature(sampling, v)

    def law_rows(x: torch.Tensor) -> torch.Tensor:
        return _law_rows(x, sampling, plain, dt)

    if n == 1:
        # a root-only tree (a plain decoding step under budget auto): the exit is the root with
        # probability 1 and the bonus is a draw from its law (:func:`tev_root_bonus`: the same
        # ops on the same row as below, so the same token, in one pass over the vocabulary)
        one = torch.ones(b, 1, dtype=dt, device=dev)
        bonus = tev_root_bonus(target_logits[:, 0], sampling, uniforms[:, 1])
        law = ExitLaw(one, one.clone(), one.clone(), torch.zeros(b, dtype=dt, device=dev))
        return torch.zeros(b, dtype=torch.int64, device=dev), bonus, law

    is_child = tree.valid.clone()
    is_child[:, 0] = False
    par = tree.parents.clamp(min=0)
    tok = tree.tokens.clamp(min=0, max=v - 1)
    zero = torch.zeros((), dtype=dt, device=dev)
    inf = torch.full((), float("inf"), dtype=dt, device=dev)
    child_mass = torch.zeros(b, n, dtype=dt, device=dev)  # [b, N]: e at (parent row, child token)
    z_nc = torch.empty(b, n, dtype=dt, device=dev)  # [b, N]: masked non-child mass
    step = max(1, CHUNK_ELEMENTS // max(1, b * v)) if dev.type == "cpu" else n
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        e = law_rows(target_logits[:, r0:r1])  # [b, r, V]
        ev = e.view(b, (r1 - r0) * v)
        mine = is_child & (par >= r0) & (par < r1)  # children whose parent row is in the chunk
        flat = torch.where(mine, (par - r0) * v + tok, torch.zeros_like(par))
        child_mass = torch.where(mine, torch.gather(ev, 1, flat), child_mass)
        # zero the children: amin with 0 at their entries, +inf (no-op) for every other node
        ev.scatter_reduce_(1, flat, torch.where(mine, zero, inf).expand(b, n), reduce="amin", include_self=True)
        z_nc[:, r0:r1] = e.sum(-1)
    z = z_nc + torch.zeros_like(z_nc).scatter_add_(1, par, child_mass)
    z_safe = torch.where(tree.valid, z, torch.ones_like(z))
    edge = child_mass / torch.gather(z_safe, 1, par)
    rho = (z_nc / z_safe).clamp(min=0.0)
    law = _propagate(tree, edge, rho)

    exit_node = inverse_cdf(law.w, uniforms[:, 0])
    x_exit = torch.gather(target_logits, 1, exit_node.view(b, 1, 1).expand(b, 1, v))  # [b, 1, V]
    p_exit = law_rows(x_exit).squeeze(1)  # [b, V]
    of_exit = is_child & (tree.parents == exit_node.view(b, 1))
    kids = torch.zeros(b, v + 1, dtype=torch.bool, device=dev)  # spare column for non-children
    kids.scatter_(1, torch.where(of_exit, tok, torch.full_like(tok, v)), True)
    residual = p_exit.masked_fill(kids[:, :v], 0.0)
    has_res = torch.gather(z_nc, 1, exit_node.view(b, 1)) > 0
    bonus = inverse_cdf(torch.where(has_res, residual, p_exit), uniforms[:, 1])
    return exit_node, bonus, law


def tev_root_bonus(target_logits: torch.Tensor, sampling: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """The bonus token of a root-only tree (a plain decoding step): one draw from the root's
    processed target law by inverse CDF with ``u``.

    The same ops on the same row as :func:`tev_verify_logits` on a one-node tree with
    ``uniforms[:, 1] = u``, so the same token (the exit is the root with probability 1 and the
    root has no children, so its residual is its law).

    Args:
        target_logits: float [b, V], the root's logits (bf16 / fp16 upcast to float32).
        sampling: the target law's parameters (scalars or [b] tensors); a temperature below
            1e-5 samples the argmax there (``processed_probs``).
        u: float64 [b] in [0, 1).
    Returns:
        int64 [b]. No host sync.
    """
    x = target_logits.unsqueeze(1)
    return inverse_cdf(_law_rows(x, sampling, _plain_temperature(sampling, x.shape[-1]), _law_dtype(x)).squeeze(1), u)


def _law_rows(x: torch.Tensor, sampling: SamplingParams, plain: bool, dt: torch.dtype) -> torch.Tensor:
    """Processed law of logits rows [b, r, V], up to a per-row factor; a fresh buffer. ``plain``
    (:func:`_plain_temperature`): one temperature, no truncation, so exp((x - max) / T) is it."""
    if not plain:
        return processed_probs(x, sampling)
    inv_t = 1.0 / float(sampling.temperature)
    x = x.to(dt)
    e = torch.add(x.amax(-1, keepdim=True).mul_(-inv_t), x, alpha=inv_t)  # x / T - max / T
    return e.exp_()


def _plain_temperature(sampling: SamplingParams, vocab_size: int) -> bool:
    """Host-side (no sync): a scalar temperature >= 1e-5 and no truncation stage active."""
    t, k, p, m = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    if any(isinstance(x, torch.Tensor) for x in (t, k, p, m)):
        return False
    return t >= GREEDY_EPS and not (0 < k < vocab_size) and p >= 1.0 and m <= 0.0
