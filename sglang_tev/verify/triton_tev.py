"""Fused Tree Exit Verification in Triton (paper §4, Algorithm 1; App. D.1).

Same inputs, outputs and use of the uniforms as the torch reference
:func:`sglang_tev.verify.tev.tev_verify_logits`, in three launches with static shapes, no host
sync and no data-dependent host loop (CUDA-graph capturable)::

    _tev_rows_kernel   grid (N, b)  one program per tree node v: reads row v of the logits once and
                                    writes the row max m(v), the kept mass Z(v), the kept non-child
                                    mass Z_nc(v) (rho(v) = Z_nc(v) / Z(v)), the truncation threshold
                                    and, for each drafted child u of v, whether x_u is kept.
    _tev_exit_kernel   grid (b,)    one program per tree: edge p_pa(u)(x_u), P level by level, w,
                                    coverage, exit node V by inverse CDF of w with uniforms[:, 0].
    _tev_bonus_kernel  grid (b,)    one program per tree: a second pass over row V only, bonus
                                    Y ~ p_V^res by inverse CDF with uniforms[:, 1].

Processed law (:func:`sglang_tev.processed_probs`, in its order): softmax(x / T), top-k, top-p,
min-p; T < 1e-5 one-hot at the argmax. A row with no truncation active is read ONCE (online max
and rescaled sums, as in flash attention). A row with top-k / top-p / min-p / per-row greedy
first reads the row for its max, then finds the exact cut of the sorted law by bisection over the
order-preserving int32 key of the logit, snapped to keys present in the row (each step one read
of that row; at most min(31, distinct logits) steps for top-k and as many for top-p), then makes
the final pass. Nothing is approximated: the kept set is the
reference's, up to float rounding of the masses compared at the cut (the reference itself compares
float32 cumulative sums). Ties at the top-p cut are resolved by token id (the reference's stable
sort); a tie rank is a running count in the final pass.

rho(v) is the non-child kept mass summed in the pass (children masked out element-wise), never
``1 - sum``: it is exactly 0 when the drafted children cover the kept support.

Logits may be bf16 / fp16 / fp32 (read in their dtype, computed in float32); masses are float32
like the reference on float32 logits, the two inverse-CDF draws compare in float64.
Rows of padded nodes are never read (they may hold NaN).

On CPU the kernels run only under ``TRITON_INTERPRET=1`` set before Triton is imported (tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..sampling import GREEDY_EPS, SamplingParams
from ..tree import DraftTree, ExitLaw

try:  # Triton is optional: the torch reference runs everywhere
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = ["triton_tev_verify", "HAS_TRITON"]

_INT32_MAX = 2**31 - 1


if HAS_TRITON:

    @triton.jit
    def _key(x):
        # order-preserving int32 key of a float32 (x + 0.0 maps -0.0 to +0.0 first, so equal
        # floats get equal keys)
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _scan_ge(row_ptr, V, tau, m, inv_t, BLOCK_V: tl.constexpr):
        """One read of a row: (count, mass) of the tokens with key >= tau (mass in units of
        exp((x - m) / T)), the smallest key >= tau and the largest key < tau."""
        cnt = tl.zeros((), dtype=tl.int32)
        mass = tl.zeros((), dtype=tl.float32)
        above = tl.full((), _INT32_MAX, tl.int32)
        below = tl.full((), -_INT32_MAX, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inb = offs < V
            x = tl.load(row_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32)
            bits = (x + 0.0).to(tl.int32, bitcast=True)  # _key(x) inlined: hot in the interpreter
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            sel = inb & (key >= tau)
            e = tl.where(sel & (x > float("-inf")), tl.exp((x - m) * inv_t), 0.0)
            cnt += tl.sum(sel.to(tl.int32), 0)
            mass += tl.sum(e, 0)
            above = tl.minimum(above, tl.min(tl.where(sel, key, _INT32_MAX), 0))
            below = tl.maximum(below, tl.max(tl.where(inb & (key < tau), key, -_INT32_MAX), 0))
        return cnt, mass, above, below

    @triton.jit
    def _kept(x, offs, inb, m, inv_t, greedy, amax, tau, jtie, tie_carry, minp):
        """Processed (unnormalised) law of one block: (e, kept, tie_carry)."""
        bits = (x + 0.0).to(tl.int32, bitcast=True)  # _key(x) inlined: hot in the interpreter
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        e = tl.where(x > float("-inf"), tl.exp((x - m) * inv_t), 0.0)
        tie = inb & (key == tau)
        tie_i = tie.to(tl.int32)
        rank = tie_carry + tl.cumsum(tie_i, 0) - tie_i  # ties before, in token-id order
        kept = inb & ((key > tau) | (tie & (rank < jtie))) & (e >= minp)
        kept = tl.where(greedy != 0, inb & (offs == amax), kept)
        e = tl.where(greedy != 0, 1.0, e)
        return e, kept, tie_carry + tl.sum(tie_i, 0)

    @triton.jit
    def _tev_rows_kernel(
        logits_ptr,  # [b, N, V] bf16 / fp16 / fp32, last dim contiguous
        stride_b,
        stride_n,
        valid_ptr,  # [b, N] int8
        tokens_ptr,  # [b, N] int64
        child_order_ptr,  # [b, N] int32: node ids sorted by parent (children lists, CSR)
        child_start_ptr,  # [b, N] int32: first slot of v's children in child_order
        child_count_ptr,  # [b, N] int32
        inv_t_ptr,  # [b] fp32, 1 / T (1 for greedy rows)
        greedy_ptr,  # [b] int8
        top_k_ptr,  # [b] int32, 0 = off
        top_p_ptr,  # [b] fp32, >= 1 = off
        min_p_ptr,  # [b] fp32, 0 = off
        m_ptr,  # out [b, N] fp32: row max of x
        z_ptr,  # out [b, N] fp32: kept mass, units exp((x - m) / T)
        znc_ptr,  # out [b, N] fp32: kept non-child mass
        tau_ptr,  # out [b, N] int32: key threshold of the kept set
        jtie_ptr,  # out [b, N] int32: how many tokens tied at tau are kept (lowest ids first)
        amax_ptr,  # out [b, N] int32: first argmax (greedy rows)
        child_kept_ptr,  # out [b, N] int8: child u's token is kept at its parent
        N,
        V,
        BLOCK_V: tl.constexpr,
    ):
        v = tl.program_id(0)
        r = tl.program_id(1)
        node = r * N + v
        if tl.load(valid_ptr + node) != 0:
            row_ptr = logits_ptr + r.to(tl.int64) * stride_b + v.to(tl.int64) * stride_n
            inv_t = tl.load(inv_t_ptr + r)
            greedy = tl.load(greedy_ptr + r).to(tl.int32)
            top_k = tl.load(top_k_ptr + r)
            top_p = tl.load(top_p_ptr + r)
            min_p = tl.load(min_p_ptr + r)
            trunc = (greedy != 0) | (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
            c_start = tl.load(child_start_ptr + node)
            c_count = tl.load(child_count_ptr + node)

            m = tl.full((), float("-inf"), tl.float32)
            amax = tl.zeros((), dtype=tl.int32)
            tau = tl.full((), -_INT32_MAX, tl.int32)  # below every key: keep all
            jtie = tl.full((), _INT32_MAX, tl.int32)
            minp = tl.zeros((), dtype=tl.float32)
            if trunc:
                # pass 1: max, first argmax, key range
                kmin = tl.full((), _INT32_MAX, tl.int32)
                kmax = tl.full((), -_INT32_MAX, tl.int32)
                for start in range(0, V, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    inb = offs < V
                    x = tl.load(row_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32)
                    bmax = tl.max(x, 0)
                    barg = tl.argmax(x, 0, tie_break_left=True).to(tl.int32) + start
                    amax = tl.where(bmax > m, barg, amax)  # strict: the first block wins ties
                    m = tl.maximum(m, bmax)
                    key = _key(x)
                    kmin = tl.minimum(kmin, tl.min(tl.where(inb, key, _INT32_MAX), 0))
                    kmax = tl.maximum(kmax, tl.max(tl.where(inb, key, -_INT32_MAX), 0))
                tau = kmin
                # Cuts by bisection over keys that snaps to the tokens' own keys: lo and hi are
                # always keys present in the row, so each read removes at least one distinct key
                # from [lo, hi] and halves the key range (<= min(31, distinct keys) reads).
                if (greedy == 0) & (top_k > 0):
                    # the k-th largest key: the largest t with count(key >= t) >= k (ties kept)
                    lo = kmin
                    hi = kmax
                    while lo < hi:
                        mid = (lo.to(tl.int64) + (hi.to(tl.int64) - lo.to(tl.int64) + 1) // 2).to(tl.int32)
                        cnt, _m, above, below = _scan_ge(row_ptr, V, mid, m, inv_t, BLOCK_V)
                        if cnt >= top_k:
                            lo = above
                        else:
                            hi = below
                    tau = lo
                if (greedy == 0) & (top_p < 1.0):
                    # top-p on the top-k law: the crossing token has the largest key t whose mass
                    # at or above it reaches top_p * Z_k
                    _c, z_k, _a, _b = _scan_ge(row_ptr, V, tau, m, inv_t, BLOCK_V)
                    target = top_p * z_k
                    lo = tau
                    hi = kmax
                    while lo < hi:
                        mid = (lo.to(tl.int64) + (hi.to(tl.int64) - lo.to(tl.int64) + 1) // 2).to(tl.int32)
                        _c, mass, above, below = _scan_ge(row_ptr, V, mid, m, inv_t, BLOCK_V)
                        if mass >= target:
                            lo = above
                        else:
                            hi = below
                    tau_p = lo
                    n_ge, _m, _a, _b = _scan_ge(row_ptr, V, tau_p, m, inv_t, BLOCK_V)
                    n_gt, m_gt, _a, _b = _scan_ge(row_ptr, V, tau_p + 1, m, inv_t, BLOCK_V)
                    n_tie = n_ge - n_gt
                    # the i-th token tied at tau_p (token-id order) is kept iff m_gt + i * eps < target
                    bits = tl.where(tau_p < 0, tau_p ^ 0x7FFFFFFF, tau_p)
                    x_tau = bits.to(tl.float32, bitcast=True)
                    eps = tl.where(x_tau > float("-inf"), tl.exp((x_tau - m) * inv_t), 0.0)
                    need = tl.where(eps > 0, tl.ceil((target - m_gt) / eps), n_tie.to(tl.float32))
                    need = tl.minimum(tl.maximum(need, 1.0), n_tie.to(tl.float32))
                    tau = tau_p
                    jtie = need.to(tl.int32)
                minp = min_p  # e_max = 1, so p >= min_p * max p  <=>  e >= min_p

            # final pass (the only one for a row without truncation: online max)
            z = tl.zeros((), dtype=tl.float32)
            znc = tl.zeros((), dtype=tl.float32)
            tie_carry = tl.zeros((), dtype=tl.int32)
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                inb = offs < V
                x = tl.load(row_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32)
                if not trunc:
                    m_new = tl.maximum(m, tl.max(x, 0))
                    scale = tl.where(m_new > float("-inf"), tl.exp((m - m_new) * inv_t), 1.0)
                    z = z * scale
                    znc = znc * scale
                    m = m_new
                e, kept, tie_carry = _kept(x, offs, inb, m, inv_t, greedy, amax, tau, jtie, tie_carry, minp)
                ek = tl.where(kept, e, 0.0)
                nonchild = inb
                for c in range(0, c_count):
                    u = tl.load(child_order_ptr + r * N + c_start + c)
                    tok = tl.load(tokens_ptr + r * N + u)
                    hit = offs == tok
                    nonchild = nonchild & (~hit)
                    tl.store(child_kept_ptr + r * N + u + offs * 0, kept.to(tl.int8), mask=hit)
                z += tl.sum(ek, 0)
                znc += tl.sum(tl.where(nonchild, ek, 0.0), 0)
            tl.store(m_ptr + node, m)
            tl.store(z_ptr + node, z)
            tl.store(znc_ptr + node, znc)
            tl.store(tau_ptr + node, tau)
            tl.store(jtie_ptr + node, jtie)
            tl.store(amax_ptr + node, amax)

    @triton.jit
    def _tev_exit_kernel(
        logits_ptr,  # [b, N, V]
        stride_b,
        stride_n,
        valid_ptr,  # [b, N] int8
        parents_ptr,  # [b, N] int64, root / padded -> 0
        tokens_ptr,  # [b, N] int64
        depth_ptr,  # [b, N] int64
        inv_t_ptr,  # [b] fp32
        greedy_ptr,  # [b] int8
        m_ptr,  # [b, N] fp32 (from _tev_rows_kernel)
        z_ptr,
        znc_ptr,
        child_kept_ptr,  # [b, N] int8
        uniforms_ptr,  # [b, 2] fp64
        P_ptr,  # out [b, N] fp32 (also the level-by-level scratch)
        rho_ptr,  # out [b, N] fp32
        w_ptr,  # out [b, N] fp32
        coverage_ptr,  # out [b] fp32
        exit_ptr,  # out [b] int64
        N,
        max_depth,
        BLOCK_N: tl.constexpr,
    ):
        r = tl.program_id(0)
        idx = tl.arange(0, BLOCK_N)
        inb = idx < N
        base = r * N
        valid = inb & (tl.load(valid_ptr + base + idx, mask=inb, other=0) != 0)
        is_child = valid & (idx > 0)
        par = tl.load(parents_ptr + base + idx, mask=inb, other=0)
        tok = tl.load(tokens_ptr + base + idx, mask=inb, other=0)
        depth = tl.load(depth_ptr + base + idx, mask=inb, other=0)
        inv_t = tl.load(inv_t_ptr + r)
        greedy = tl.load(greedy_ptr + r).to(tl.int32)

        # edge p_pa(u)(x_u) = kept * exp((x_u - m(pa)) / T) / Z(pa), as the rows kernel summed it
        x_u = tl.load(
            logits_ptr + r.to(tl.int64) * stride_b + par * stride_n + tok, mask=is_child, other=float("-inf")
        ).to(tl.float32)
        m_pa = tl.load(m_ptr + base + par, mask=is_child, other=0.0)
        z_pa = tl.load(z_ptr + base + par, mask=is_child, other=1.0)
        kept = tl.load(child_kept_ptr + base + idx, mask=is_child, other=0) != 0
        e_u = tl.where(x_u > float("-inf"), tl.exp((x_u - m_pa) * inv_t), 0.0)
        e_u = tl.where(greedy != 0, 1.0, e_u)
        edge = tl.where(is_child & kept, e_u / z_pa, 0.0)

        z_v = tl.load(z_ptr + base + idx, mask=valid, other=1.0)
        znc_v = tl.load(znc_ptr + base + idx, mask=valid, other=0.0)
        rho = tl.where(valid, tl.maximum(znc_v / z_v, 0.0), 0.0)

        # P level by level (Algorithm 1, lines 3-7): parents sit one level up, read back from P_ptr
        P = tl.where(idx == 0, 1.0, 0.0)
        tl.store(P_ptr + base + idx, P, mask=inb)
        for d in range(1, max_depth + 1):
            tl.debug_barrier()
            P_par = tl.load(P_ptr + base + par, mask=inb, other=0.0)
            P = tl.where(is_child & (depth == d), P_par * edge, P)
            tl.debug_barrier()
            tl.store(P_ptr + base + idx, P, mask=inb)
        w = P * rho
        tl.store(rho_ptr + base + idx, rho, mask=inb)
        tl.store(w_ptr + base + idx, w, mask=inb)
        tl.store(coverage_ptr + r, tl.sum(tl.where(idx > 0, P, 0.0), 0))

        # exit node: first index whose cumulative w exceeds u0 * total (float64, node order)
        cdf = tl.cumsum(w.to(tl.float64), 0)
        u0 = tl.load(uniforms_ptr + 2 * r)
        x = u0 * tl.max(cdf, 0)
        ex = tl.sum((inb & (cdf <= x)).to(tl.int64), 0)
        tl.store(exit_ptr + r, tl.minimum(ex, N - 1))

    @triton.jit
    def _tev_bonus_kernel(
        logits_ptr,  # [b, N, V]
        stride_b,
        stride_n,
        tokens_ptr,  # [b, N] int64
        child_order_ptr,  # [b, N] int32
        child_start_ptr,
        child_count_ptr,
        inv_t_ptr,  # [b] fp32
        greedy_ptr,  # [b] int8
        m_ptr,  # [b, N] fp32
        z_ptr,
        znc_ptr,
        tau_ptr,  # [b, N] int32
        jtie_ptr,
        amax_ptr,
        min_p_ptr,  # [b] fp32
        top_k_ptr,  # [b] int32
        top_p_ptr,  # [b] fp32
        uniforms_ptr,  # [b, 2] fp64
        exit_ptr,  # [b] int64
        bonus_ptr,  # out [b] int64
        N,
        V,
        BLOCK_V: tl.constexpr,
    ):
        r = tl.program_id(0)
        ex = tl.load(exit_ptr + r)
        node = r * N + ex
        row_ptr = logits_ptr + r.to(tl.int64) * stride_b + ex * stride_n
        inv_t = tl.load(inv_t_ptr + r)
        greedy = tl.load(greedy_ptr + r).to(tl.int32)
        trunc = (greedy != 0) | (tl.load(top_k_ptr + r) > 0) | (tl.load(top_p_ptr + r) < 1.0)
        trunc = trunc | (tl.load(min_p_ptr + r) > 0.0)
        minp = tl.where(trunc, tl.load(min_p_ptr + r), 0.0)
        m = tl.load(m_ptr + node)
        tau = tl.load(tau_ptr + node)
        jtie = tl.load(jtie_ptr + node)
        amax = tl.load(amax_ptr + node)
        znc = tl.load(znc_ptr + node)
        # rho(V) = 0: draw from p_V itself, as residual_probs falls back
        full_row = (znc > 0).to(tl.int32) == 0
        total = tl.where(full_row, tl.load(z_ptr + node), znc).to(tl.float64)
        target = tl.load(uniforms_ptr + 2 * r + 1) * total
        c_start = tl.load(child_start_ptr + node)
        c_count = tl.load(child_count_ptr + node)

        carry = tl.zeros((), dtype=tl.float64)
        tie_carry = tl.zeros((), dtype=tl.int32)
        found = tl.zeros((), dtype=tl.int32)
        result = tl.zeros((), dtype=tl.int64)
        last_pos = tl.zeros((), dtype=tl.int64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inb = offs < V
            x = tl.load(row_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32)
            e, kept, tie_carry = _kept(x, offs, inb, m, inv_t, greedy, amax, tau, jtie, tie_carry, minp)
            nonchild = inb
            for c in range(0, c_count):
                u = tl.load(child_order_ptr + r * N + c_start + c)
                nonchild = nonchild & (offs != tl.load(tokens_ptr + r * N + u))
            res = tl.where(kept & (nonchild | full_row), e, 0.0).to(tl.float64)
            cum = carry + tl.cumsum(res, 0)
            block_total = tl.sum(res, 0)
            cross = (found == 0) & (carry + block_total > target)
            pos = start + tl.sum((inb & (cum <= target)).to(tl.int64), 0)
            result = tl.where(cross, pos, result)
            found = tl.maximum(found, cross.to(tl.int32))
            last_pos = tl.maximum(last_pos, tl.max(tl.where(res > 0, offs, 0), 0).to(tl.int64))
            carry += block_total
        # float rounding may leave u1 * total just past the summed mass: take the last token
        tl.store(bonus_ptr + r, tl.where(found != 0, result, last_pos))


def _per_row(x, b: int, device, dtype) -> torch.Tensor:
    # a Python scalar becomes a device fill (capturable in a CUDA graph; no host-to-device copy)
    if not isinstance(x, torch.Tensor):
        return torch.full((b,), x, dtype=dtype, device=device)
    t = x.to(device)
    t = t.expand(b) if t.dim() == 0 else t
    return t.to(dtype).contiguous()


class _Launch(NamedTuple):
    """Device-side inputs shared by the three kernels (built in torch, no sync)."""

    logits: torch.Tensor  # [b, N, V], last dim contiguous
    valid8: torch.Tensor  # [b, N] int8
    parents: torch.Tensor  # [b, N] int64, root / padded -> 0
    tokens: torch.Tensor  # [b, N] int64
    depth: torch.Tensor  # [b, N] int64
    max_depth: int
    child_order: torch.Tensor  # [b, N] int32
    child_start: torch.Tensor  # [b, N] int32
    child_count: torch.Tensor  # [b, N] int32
    inv_t: torch.Tensor  # [b] fp32
    greedy: torch.Tensor  # [b] int8
    top_k: torch.Tensor  # [b] int32, 0 = off
    top_p: torch.Tensor  # [b] fp32
    min_p: torch.Tensor  # [b] fp32
    block_v: int


class _RowStats(NamedTuple):
    """Per-node outputs of ``_tev_rows_kernel``, each [b, N]."""

    m: torch.Tensor
    z: torch.Tensor
    znc: torch.Tensor
    tau: torch.Tensor
    jtie: torch.Tensor
    amax: torch.Tensor
    child_kept: torch.Tensor


def _prepare(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams, block_v: int | None) -> _Launch:
    b, n, v = target_logits.shape
    assert target_logits.dtype in (torch.bfloat16, torch.float16, torch.float32), target_logits.dtype
    if target_logits.stride(-1) != 1:
        target_logits = target_logits.contiguous()
    dev = target_logits.device
    temp = _per_row(sampling.temperature, b, dev, torch.float64)
    greedy = temp < GREEDY_EPS
    inv_t = torch.where(greedy, torch.ones_like(temp), 1.0 / temp).to(torch.float32)
    top_k = _per_row(sampling.top_k, b, dev, torch.int64)
    top_k = torch.where((top_k > 0) & (top_k < v), top_k, torch.zeros_like(top_k)).to(torch.int32)
    # children lists (CSR by parent): node ids sorted by parent, stable
    idx = torch.arange(n, device=dev)
    is_child = tree.valid & (idx > 0)
    key = torch.where(is_child, tree.parents.clamp(min=0), torch.full_like(tree.parents, n))
    counts = torch.zeros(b, n + 1, dtype=torch.int64, device=dev).scatter_add_(1, key, torch.ones_like(key))[:, :n]
    if block_v is None:
        block_v = min(4096, triton.next_power_of_2(v))
    assert block_v > 0 and block_v & (block_v - 1) == 0, "block_v must be a power of two"
    return _Launch(
        logits=target_logits,
        valid8=tree.valid.to(torch.int8),
        parents=tree.parents.clamp(min=0).contiguous(),
        tokens=tree.tokens.clamp(min=0, max=v - 1).contiguous(),  # as the reference's gathers: never read past V
        depth=tree.depth.contiguous(),
        max_depth=tree.max_depth,
        child_order=torch.argsort(key, dim=1, stable=True).to(torch.int32),
        child_start=(counts.cumsum(1) - counts).to(torch.int32),
        child_count=counts.to(torch.int32),
        inv_t=inv_t.contiguous(),
        greedy=greedy.to(torch.int8),
        top_k=top_k.contiguous(),
        top_p=_per_row(sampling.top_p, b, dev, torch.float32),
        min_p=_per_row(sampling.min_p, b, dev, torch.float32),
        block_v=block_v,
    )


def _warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def _launch_rows(a: _Launch) -> _RowStats:
    b, n, v = a.logits.shape
    dev = a.logits.device
    st = _RowStats(
        m=torch.zeros(b, n, dtype=torch.float32, device=dev),
        z=torch.zeros(b, n, dtype=torch.float32, device=dev),
        znc=torch.zeros(b, n, dtype=torch.float32, device=dev),
        tau=torch.zeros(b, n, dtype=torch.int32, device=dev),
        jtie=torch.zeros(b, n, dtype=torch.int32, device=dev),
        amax=torch.zeros(b, n, dtype=torch.int32, device=dev),
        child_kept=torch.zeros(b, n, dtype=torch.int8, device=dev),
    )
    _tev_rows_kernel[(n, b)](
        a.logits, a.logits.stride(0), a.logits.stride(1), a.valid8, a.tokens,
        a.child_order, a.child_start, a.child_count, a.inv_t, a.greedy, a.top_k, a.top_p, a.min_p,
        st.m, st.z, st.znc, st.tau, st.jtie, st.amax, st.child_kept, n, v,
        BLOCK_V=a.block_v, num_warps=_warps(a.block_v),
    )  # fmt: skip
    return st


def _launch_decide(a: _Launch, st: _RowStats, uniforms: torch.Tensor):
    b, n, v = a.logits.shape
    dev = a.logits.device
    uniforms = uniforms.contiguous()
    P = torch.empty(b, n, dtype=torch.float32, device=dev)
    rho = torch.empty_like(P)
    w = torch.empty_like(P)
    coverage = torch.empty(b, dtype=torch.float32, device=dev)
    exit_node = torch.empty(b, dtype=torch.int64, device=dev)
    sb, sn = a.logits.stride(0), a.logits.stride(1)
    _tev_exit_kernel[(b,)](
        a.logits, sb, sn, a.valid8, a.parents, a.tokens, a.depth, a.inv_t, a.greedy,
        st.m, st.z, st.znc, st.child_kept, uniforms, P, rho, w, coverage, exit_node, n, a.max_depth,
        BLOCK_N=triton.next_power_of_2(n), num_warps=4,
    )  # fmt: skip
    bonus = torch.empty(b, dtype=torch.int64, device=dev)
    _tev_bonus_kernel[(b,)](
        a.logits, sb, sn, a.tokens, a.child_order, a.child_start, a.child_count, a.inv_t, a.greedy,
        st.m, st.z, st.znc, st.tau, st.jtie, st.amax, a.min_p, a.top_k, a.top_p, uniforms,
        exit_node, bonus, n, v,
        BLOCK_V=a.block_v, num_warps=_warps(a.block_v),
    )  # fmt: skip
    return exit_node, bonus, ExitLaw(P, rho, w, coverage)


def triton_tev_verify(
    tree: DraftTree,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    uniforms: torch.Tensor,
    block_v: int | None = None,
):
    """Fused TEV: same arguments and return value as :func:`sglang_tev.verify.tev.tev_verify_logits`.

    Args:
        tree: draft trees, N nodes (ragged trees padded by ``valid``).
        target_logits: bf16 / fp16 / fp32 [b, N, V]; padded rows are never read.
        sampling: scalars or [b] tensors (per-row temperature, top-k, top-p, min-p).
        uniforms: float64 [b, 2] in [0, 1): exit draw, bonus draw.
        block_v: vocabulary tile (a power of two); default min(4096, next_pow2(V)). Tests use
            tiny tiles so that rows span several tiles.
    Returns:
        (exit_node int64 [b], bonus int64 [b], law ExitLaw with float32 P, rho, w, coverage).
        No host sync (``tree.max_depth`` is already a host int); three launches of static grid.
    Raises:
        AssertionError on a wrong dtype or shape (argument validation is :func:`verify_tree`'s).
    """
    assert HAS_TRITON, "triton is not installed"
    b = target_logits.shape[0]
    assert uniforms.dtype == torch.float64 and tuple(uniforms.shape) == (b, 2), "uniforms must be float64 [b, 2]"
    launch = _prepare(tree, target_logits, sampling, block_v)
    return _launch_decide(launch, _launch_rows(launch), uniforms)
