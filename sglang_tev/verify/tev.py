"""Tree Exit Verification (TEV; paper §4, Algorithm 1), torch reference.

This file is the specification of the fused kernel in :mod:`sglang_tev.verify.triton_tev`: both take
the same target logits, sampling parameters and uniforms and return the same exit node and bonus.
"""

from __future__ import annotations

import torch

from ..sampling import GREEDY_EPS, SamplingParams, processed_probs
from ..tree import DraftTree, ExitLaw, _propagate, exit_law, residual_probs
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


def tev_verify_logits(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor):
    """TEV from target logits with one pass over ``[b, N, V]`` after the processed law.

    Same law and same use of the uniforms as :func:`tev_verify` on
    ``processed_probs(target_logits, sampling)``; faster because it never builds a ``[b, N, V]``
    child mask and never normalises the law:

    1. ``e`` = the processed law up to a per-row factor: ``exp((x - max x) / T)`` when no
       truncation can be active (scalar temperature, top-k / top-p / min-p off: decided on the
       host from Python scalars, no sync), else :func:`processed_probs`. ``e`` is a fresh buffer.
    2. The drafted children's entries are read (edge mass) and then set to 0 in ``e`` in place;
       one sum over V then gives every node's non-child mass ``Z_nc(v)``. ``Z(v) = Z_nc(v) +``
       the children's mass is a sum of non-negative terms (no cancellation), and
       ``rho(v) = Z_nc(v) / Z(v)`` is the masked non-child mass of :func:`sglang_tev.exit_law`:
       exactly 0 when the children cover the support (top-k at or below the number of drafted
       children), not ``1 - sum``.
    3. The exit node's row of ``e`` (children already zeroed) is the unnormalised residual
       p_V^res; where ``Z_nc(V) = 0`` the children are put back (p_V itself, as
       :func:`sglang_tev.residual_probs` falls back).

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
    dt = torch.float64 if target_logits.dtype == torch.float64 else torch.float32
    if _plain_temperature(sampling, v):
        x = target_logits.to(dt)
        inv_t = 1.0 / float(sampling.temperature)
        # e = x / T - max(x) / T in one fresh buffer, then exp in place (large passes dominate on CPU)
        e = torch.add(x.amax(-1, keepdim=True).mul_(-inv_t), x, alpha=inv_t)
        e.exp_()
    else:
        e = processed_probs(target_logits, sampling)  # fresh [b, N, V]
    ev = e.view(b, n * v)
    is_child = tree.valid.clone()
    is_child[:, 0] = False
    par = tree.parents.clamp(min=0)
    flat = par * v + tree.tokens.clamp(min=0, max=v - 1)  # [b, N]: (parent row, child token)
    zero = torch.zeros((), dtype=dt, device=e.device)
    child_mass = torch.where(is_child, torch.gather(ev, 1, flat), zero)  # [b, N], unnormalised
    # zero the children's entries: amin with 0 at child positions, with +inf (no-op) elsewhere, so
    # a padded node aliasing a child position cannot undo the write
    keep = torch.where(is_child, zero, torch.full_like(child_mass, float("inf")))
    ev.scatter_reduce_(1, flat, keep, reduce="amin", include_self=True)
    z_nc = e.sum(-1)  # [b, N], masked non-child mass
    z = z_nc + torch.zeros_like(z_nc).scatter_add_(1, par, child_mass)
    z_safe = torch.where(tree.valid, z, torch.ones_like(z))
    edge = child_mass / torch.gather(z_safe, 1, par)
    rho = (z_nc / z_safe).clamp(min=0.0)
    law = _propagate(tree, edge, rho)

    exit_node = inverse_cdf(law.w, uniforms[:, 0])
    row = torch.gather(e, 1, exit_node.view(b, 1, 1).expand(b, 1, v)).squeeze(1)  # [b, V] residual
    # p_V itself where the residual is empty (rho(V) = 0): put V's children back
    of_exit = is_child & (tree.parents == exit_node.view(b, 1))
    tok = tree.tokens.clamp(min=0, max=v - 1)
    full = row.scatter_add(1, tok, torch.where(of_exit, child_mass, zero))
    res = torch.where((torch.gather(z_nc, 1, exit_node.view(b, 1)) > 0), row, full)
    bonus = inverse_cdf(res, uniforms[:, 1])
    return exit_node, bonus, law


def _plain_temperature(sampling: SamplingParams, vocab_size: int) -> bool:
    """Host-side (no sync): a scalar temperature >= 1e-5 and no truncation stage active."""
    t, k, p, m = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    if any(isinstance(x, torch.Tensor) for x in (t, k, p, m)):
        return False
    return t >= GREEDY_EPS and not (0 < k < vocab_size) and p >= 1.0 and m <= 0.0
