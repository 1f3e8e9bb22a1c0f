"""The DFlash drafter over a static, preallocated context cache with per-row lengths.

Same math as :meth:`~sglang_tev.draft.dflash.DFlashDraftModel.draft_logits` (z-lab
``dflash_generate`` draft step; the drafter's own modules are called, nothing is re-weighted):
context features -> ``fc`` -> ``hidden_norm`` -> per-layer K/V (k_norm + RoPE) written once at
their positions; one block ``[root, MASK x H]`` per row attends, bidirectionally, to its row's
context and the block. Rows of different lengths share one forward: per layer the keys and values
live in ``[rows, kv_heads, max_len + K + 1, head_dim]`` buffers (slot = position) and a mask
hides everything past a row's context + block. The block's own K/V are written at the block's
slots (past the context) and are overwritten by the next round's context; no crop.

Besides the matmuls, every small op costs (tens of microseconds in situ on a CPU), so, as the
DDTree reference does, a round's new context is not projected on its own: :meth:`add_context`
defers a short context (at most ``block_size`` positions, a commit's accepted path) and the next
:meth:`StaticDFlashDrafter.draft_rows` over the same rows projects the context rows and the block
rows with one ``k_proj`` / ``v_proj`` / ``k_norm`` / RoPE per layer over ``[context ; block]``
and writes both with one indexed write per buffer (context padding that falls on the block's slots is
sent to the buffers' last slot, which is never read, so no read slot is a target twice).
RoPE cos/sin come from a table built per generation call, as does the MASK token's embedding.

DFlash2: the conv runs in every layer over the block and the logit transform on the
full vocabulary; :meth:`StaticDFlashDrafter.draft_rows` returns those logits (the "marginal"
draft mode), :meth:`StaticDFlashDrafter.draft_lattice_rows` the same forward's candidate-selector
lattice (the "lattice" mode: lattice trees and the selector chain, ``hf/round.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..draft.dflash import DFlashDraftModel, rms_norm
from ..draft.dflash2 import SelectorLattice, grouped_causal_conv
from .static_cache import row_grid, write_slots

__all__ = ["StaticDFlashDrafter"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``dflash._apply_rope`` with the sign of the rotation folded into ``sin_signed`` (= sin with
    its first half negated): the same products and sum, one op fewer. x: [..., d] with cos and
    sin_signed broadcast to it ([b, h, T, d] with [b, 1, T, d]; [b, T, h, d] with [b, T, 1, d])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin_signed



MAX_DEFERRED = 64
"""Context tokens a drafter defers at most (plain decoding rounds of ``budget="auto"`` add one each)."""


def _joined(features: list, positions: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A deferred context's pieces as one ``(features [b, T, F], positions [b, T])``."""
    if len(features) == 1:
        return features[0], positions[0]
    return torch.cat(features, 1), torch.cat(positions, 1)


def _last_writes(positions: torch.Tensor) -> torch.Tensor:
    """bool [b, T]: entry j of a row is the last one written to its position (no later j' of the
    row has the same position). Deferred contexts of several rounds may write one slot twice."""
    t = positions.shape[1]
    if t <= 1:
        return torch.ones_like(positions, dtype=torch.bool)
    same = positions.unsqueeze(2) == positions.unsqueeze(1)                 # [b, T, T]
    later = torch.ones(t, t, dtype=torch.bool, device=positions.device).triu(1)
    return ~(same & later).any(2)


class _LayerWeights:
    """One drafter layer's weights as the block forward reads them: q/k/v in one matrix, gate/up
    in one, q_norm and k_norm as one [heads, d] scale (CPU, where the draft forward is op-bound;
    on other devices the separate matrices, so no weight is held twice); DFlash2's conv weights
    read once (the conv itself is :func:`~sglang_tev.draft.dflash2.grouped_causal_conv`)."""

    __slots__ = ("ln_in", "ln_post", "qkv", "qk_norm", "o", "gu", "down", "conv_a", "conv_m", "eps")

    def __init__(self, layer, fuse: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.eps = layer.input_layernorm.eps
        self.ln_in, self.ln_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        w = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        self.qkv = torch.cat(w) if fuse else w
        self.qk_norm = torch.cat([attn.q_norm.weight.expand(nh, hd), attn.k_norm.weight.expand(nkv, hd)])
        self.o = attn.o_proj.weight
        w = (mlp.gate_proj.weight, mlp.up_proj.weight)
        self.gu = torch.cat(w) if fuse else w
        self.down = mlp.down_proj.weight
        self.conv_a = self.conv_m = None  # DFlash2: (kernel projection, base kernel [2, taps, H], taps, groups, group size)
        if layer.attention_conv is not None:
            self.conv_a, self.conv_m = ((c.kernel_projection.weight, c.base_kernel.to(self.o.dtype), c.taps, c.groups,
                                         c.group_size) for c in (layer.attention_conv, layer.mlp_conv))


def _linear_cat(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ w.T`` for a fused matrix, or the separate matrices' outputs concatenated."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return torch.cat([F.linear(x, wi) for wi in w], dim=-1)


def _conv_prepare(x: torch.Tensor, conv) -> tuple[torch.Tensor, torch.Tensor]:
    """``GroupedCausalConv.prepare`` from :class:`_LayerWeights`' conv weights (no module call):
    (x convolved with side 0, side-1 coefficients [b, T, taps, G])."""
    proj, base, taps, groups, group_size = conv
    delta = F.linear(x, proj).view(*x.shape[:-1], 2, taps, groups)
    return grouped_causal_conv(x, base[0], delta[:, :, 0], group_size), delta[:, :, 1]


def _conv_finish(y: torch.Tensor, delta: torch.Tensor, conv) -> torch.Tensor:
    """``GroupedCausalConv.finish``: the sublayer output convolved with side 1."""
    return grouped_causal_conv(y, conv[1][1], delta, conv[4])


class StaticDFlashDrafter:
    """:class:`~sglang_tev.hf.drafters.BatchDrafter` for a :class:`DFlashDraftModel`.

    Args:
        model: the drafter.
        target: the HF causal LM whose ``get_input_embeddings()`` and ``get_output_embeddings()``
            (LM head) the drafter uses.
    """

    max_rows = None
    partial_slots = True  # draft_rows / draft_lattice_rows take slots= (the depths wanted)
    reads_tokens = False  # roots and context features only: the runtime need not keep a token buffer

    def __init__(self, model: DFlashDraftModel, target) -> None:
        self.model = model.eval()
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.block_size = model.block_size
        self.target_layer_ids = tuple(model.target_layer_ids)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # a deferred add_context: (rows, [features], [positions], tokens), concatenated once when written
        self._pending: tuple[slice, list, list, int] | None = None
        self._tables_key = None
        self._cos = self._sin = self._arange = self._mask_embed = None
        self._layer_weights: list[_LayerWeights] = []
        self._weights_key = None

    # ------------------------------------------------------------------ per-call tables
    def _tables(self, device, dtype) -> None:
        """RoPE cos and sign-folded sin [S, head_dim] for every slot position ``0 .. S-1``
        (``dflash._rope``'s values: default RoPE, computed in float32, cast to ``dtype``),
        ``arange(S)`` and the MASK token's embedding [1, 1, H]; built by :meth:`start`, rebuilt
        when the buffers' slot count, device or dtype change."""
        slots = self.keys[0].shape[2]
        key = (slots, torch.device(device), dtype)
        if self._tables_key == key:
            return
        cfg = self.model.config
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device,
                                                          dtype=torch.float) / cfg.head_dim))
        self._arange = torch.arange(slots, device=device)
        freqs = self._arange[:, None].float() * inv_freq  # [S, d/2]
        self._cos = torch.cat([freqs, freqs], dim=-1).cos().to(dtype)
        sin = freqs.sin()
        self._sin = torch.cat([-sin, sin], dim=-1).to(dtype)
        with torch.inference_mode():
            mask_id = torch.tensor([[cfg.mask_token_id]], dtype=torch.int64, device=device)
            self._mask_embed = self.embed(mask_id).to(dtype)
        self._tables_key = key

    def _rope(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sign-folded sin [b, 1, T, head_dim] of slot positions ``index`` int64 [b, T]."""
        return self._cos[index][:, None], self._sin[index][:, None]

    def start(self, rows: int, max_len: int, device) -> None:
        """New generation call: drops a deferred context (the last call's rows are done; a new
        row's prefill writes its whole context), then (re)allocates the buffers
        ``[rows, kv_heads, max_len + K + 1, head_dim]`` per layer; the last slot is never read:
        context padding that would land on a block slot is sent there by the fused write."""
        self._pending = None
        cfg = self.model.config
        dtype = self.model.fc.weight.dtype
        shape = (rows, cfg.num_key_value_heads, max_len + self.block_size + 1, cfg.head_dim)
        if not self.keys or self.keys[0].shape != shape or self.keys[0].device != torch.device(device):
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.model.layers]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.model.layers]
        self._tables_key = None  # rebuilt for every call: the embedding may have changed in between
        self._tables(device, dtype)
        self._weights(torch.device(device))

    def _weights(self, device: torch.device) -> None:
        """The block forward's :class:`_LayerWeights`, rebuilt by :meth:`start` when a parameter
        was replaced or changed in place since the last call (a training step between
        evaluations; within one generation call the weights are fixed)."""
        key = (device, tuple((p.data_ptr(), p._version) for p in self.model.parameters()))
        if key != self._weights_key:
            with torch.no_grad():
                self._layer_weights = [_LayerWeights(layer, fuse=device.type == "cpu") for layer in self.model.layers]
            self._weights_key = key

    # ------------------------------------------------------------------ context
    def add_context(self, rows: slice, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Context features float [b, T, F] (target layer outputs, concatenated) of ``rows``, to be
        projected to every layer's context K/V at ``positions`` int64 [b, T].

        Deferred when ``T <= block_size`` (a commit's path): the tensors are kept (not copied;
        the caller must not modify them) and the next :meth:`draft_rows` over the same ``rows``
        projects them together with its block. Any other call that reads or moves the buffers
        (:meth:`move_row`, :meth:`context_kv`, :meth:`start`, another ``add_context``, or a
        ``draft_rows`` over other rows) writes them first. A longer context (a prefill) is
        written now, so its cost stays with the prefill.

        Plain decoding rounds of ``budget="auto"`` (one token each, no draft) add to the deferred
        context of the same rows instead, up to :data:`MAX_DEFERRED` tokens, so the projection
        runs once, batched, with the next draft; where two deferred writes hit one position
        (a padded path slot that a later commit fills) the later one wins, as in a cache."""
        short = features.dim() == 3 and features.shape[1] <= self.block_size
        p = self._pending
        if short and p is not None and p[0] == rows and p[3] + features.shape[1] <= MAX_DEFERRED \
                and p[1][0].shape[0] == features.shape[0]:
            p[1].append(features)  # one cat when written, not one per plain round
            p[2].append(positions)
            self._pending = (rows, p[1], p[2], p[3] + features.shape[1])
            return
        self._flush()
        if short:
            self._pending = (rows, [features], [positions], features.shape[1])
        else:
            self._write_context(rows, features, positions)

    def _flush(self) -> None:
        """Write a deferred context now."""
        if self._pending is not None:
            rows, feats, pos, _ = self._pending
            self._pending = None
            self._write_context(rows, *_joined(feats, pos))

    @torch.inference_mode()
    def _write_context(self, rows: slice, features: torch.Tensor, positions: torch.Tensor) -> None:
        """The unfused context projection: fc -> hidden_norm -> per layer k_proj/v_proj/k_norm/RoPE,
        scattered at ``positions`` [b, T]."""
        m = self.model
        dtype = m.fc.weight.dtype
        self._tables(features.device, dtype)
        ctx = m.hidden_norm(m.fc(features.to(dtype)))
        b, t, _ = ctx.shape
        positions = torch.where(_last_writes(positions), positions, self.keys[0].shape[2] - 1)  # never-read slot
        cos, sin = self._rope(positions)
        grid = row_grid(positions)
        for layer, kb, vb in zip(m.layers, self.keys, self.values):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(b, t, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
            k = _rotate(k, cos, sin)
            v = attn.v_proj(ctx).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            write_slots(kb[rows], positions, k, grid)
            write_slots(vb[rows], positions, v, grid)

    # ------------------------------------------------------------------ draft
    @property
    def has_selector(self) -> bool:
        """True for a DFlash2 drafter with a candidate selector (``selector_rank`` /
        ``selector_top_k`` in its config): :meth:`draft_lattice_rows` is available."""
        return getattr(self.model, "candidate_selector", None) is not None

    @torch.inference_mode()
    def draft_rows(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, tokens: torch.Tensor,
                   depth: int, max_root_pos: int, slots: int | None = None) -> torch.Tensor:
        """float32 [b, slots, V]: row j = draft logits of depth j + 1 (see the module docstring);
        for a DFlash2 drafter with its conv in every layer over the block (the block is the whole
        sequence here) and the logit transform on the full vocabulary (the "marginal" draft mode:
        the selector is not run).

        ``slots`` (default ``depth``, at most ``depth``): the depths whose logits are wanted. The
        block is always ``depth + 1`` tokens (attention inside it is bidirectional, so every
        depth's logits depend on the whole block); a tree of budget B reaches depth B at most,
        so the runtime asks for ``min(B, depth)`` and the head and the last layer's queries skip
        the rest. The logits of the depths computed are those of ``slots=depth`` up to float32
        rounding (the matmuls run over fewer rows).

        A context deferred by :meth:`add_context` for the same ``rows`` is projected here, fused
        with the block ([context ; block] rows per layer); one for other rows is written first.

        Raises:
            ValueError: ``depth`` outside ``1 .. block_size - 1``, ``slots`` outside ``1 .. depth``
                (or not an int); the block past the buffers.
            RuntimeError: :meth:`start` was never called.
        """
        return self._head(self._draft_hidden(rows, roots, root_pos, depth, max_root_pos, slots))

    @torch.inference_mode()
    def draft_lattice_rows(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, tokens: torch.Tensor,
                           depth: int, max_root_pos: int, slots: int | None = None) -> SelectorLattice:
        """The DFlash2 selector's candidate lattice of one round ("lattice" and selector-chain modes).

        Same forward as :meth:`draft_rows` (arguments as there, ``slots`` included), then the
        candidate selector on the final-normed hidden states and the transformed logits
        (:meth:`~sglang_tev.draft.dflash2.CandidateSelector.lattice`, the root as slot 0's
        predecessor): the same lattice as
        :meth:`~sglang_tev.draft.dflash.DFlashDraftModel.draft_lattice` on one row (its first
        ``slots`` slots).

        Returns:
            :class:`~sglang_tev.draft.dflash2.SelectorLattice` with ``candidate_ids`` int64
            [b, slots, k], ``unary_logq`` / ``transition_logq`` float32 ([b, slots, k] /
            [b, slots, k, k]), k = ``selector_top_k``.
        Raises:
            ValueError: the drafter has no candidate selector (DFlash v1); ``slots`` as in
            :meth:`draft_rows`.
        """
        if not self.has_selector:
            raise ValueError("draft_mode: this drafter has no candidate selector (DFlash v1); use the marginal mode")
        hidden = self._draft_hidden(rows, roots, root_pos, depth, max_root_pos, slots)
        return self.model.candidate_selector.lattice(hidden, self._head(hidden), roots)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Transformed draft logits float32 [b, depth, V] of final-normed hidden states."""
        head_w = getattr(self.lm_head, "weight", None)
        if isinstance(head_w, torch.Tensor):
            h = h.to(head_w.dtype)
        return self.model.transform_logits(self.lm_head(h).float())  # DFlash2: multiplier + softcap (v1: identity)

    def _draft_hidden(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, depth: int,
                      max_root_pos: int, slots: int | None = None) -> torch.Tensor:
        """The block forward: final-normed hidden states [b, slots, H] of block slots 1 .. slots.

        The layers' own modules are not called: their weights are read from
        :class:`_LayerWeights` (q/k/v and gate/up fused on CPU, q_norm and k_norm as one scale),
        so a layer is a few dozen ops (the forward is op-bound on CPU). The last layer runs its
        queries, o_proj and MLP over block slots 0 .. slots only (its keys and values cover the
        whole block; the conv is causal, so the slots kept do not read the ones dropped)."""
        m = self.model
        if not self.keys:
            raise RuntimeError("the drafter has no buffers: call start(rows, max_len, device) first")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= self.block_size - 1:
            raise ValueError(f"depth: expected an int in 1 .. block_size - 1 = {self.block_size - 1}, got {depth!r}")
        b, k_blk = roots.shape[0], depth + 1
        slots = depth if slots is None else slots
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= depth:
            raise ValueError(f"slots: expected an int in 1 .. depth = {depth}, got {slots!r}")
        dtype = m.fc.weight.dtype
        pending = self._pending
        if pending is not None and pending[0] != rows:
            self._flush()
            pending = None
        self._pending = None
        self._tables(roots.device, dtype)
        n_slots = self.keys[0].shape[2]
        kv_len = max_root_pos + k_blk
        if kv_len > n_slots - 1:
            raise ValueError(f"max_root_pos + depth + 1 = {kv_len} exceeds the buffers' {n_slots - 1} readable slots")
        rp = root_pos.view(b, 1)
        pos = rp + self._arange[:k_blk]  # [b, K'] block positions
        if pending is not None:
            features, ctx_pos = _joined(pending[1], pending[2])
            ctx = m.hidden_norm(m.fc(features.to(dtype)))  # [b, T, H]
            t = ctx.shape[1]
            # context slots at or past the root are padding; the block owns them: send them to the
            # never-read last slot so that one indexed write covers context and block without duplicates
            keep = (ctx_pos < rp) & _last_writes(ctx_pos)  # (deferred writes to one slot: the last wins)
            idx = torch.cat([torch.where(keep, ctx_pos, n_slots - 1), pos], dim=1)  # [b, T + K']
        else:
            ctx, t, idx = None, 0, pos
        # cos / sin [b, T + K', 1, d] in the [b, tokens, heads, d] layout; padding rows get the
        # last slot's (unread)
        cos, sin = self._cos[idx][:, :, None], self._sin[idx][:, :, None]
        n = t + k_blk
        # a row sees its context [0, root_pos) and its block [root_pos, root_pos + K')
        mask = None
        if b > 1:
            mask = self._arange[:kv_len] < (root_pos.view(b, 1, 1, 1) + k_blk)  # [b, 1, 1, kv_len]
        one_slice = b == 1 and ctx is None  # block only, contiguous: a slice copy
        grid = None if one_slice else row_grid(idx)
        h = torch.cat([self.embed(roots.view(b, 1)).to(dtype), self._mask_embed.expand(b, depth, -1)], dim=1)
        last = len(self._layer_weights) - 1
        for li, (lw, kb, vb) in enumerate(zip(self._layer_weights, self.keys, self.values)):
            attn = m.layers[li].self_attn
            nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
            x = rms_norm(h, lw.ln_in, lw.eps)
            if lw.conv_a is not None:
                x, delta = _conv_prepare(x, lw.conv_a)
            kv_in = x if ctx is None else torch.cat([ctx, x], dim=1)  # [b, T + K', H]
            qkv = _linear_cat(kv_in, lw.qkv).view(b, n, nh + 2 * nkv, hd)
            qk = _rotate(rms_norm(qkv[:, :, : nh + nkv], lw.qk_norm, lw.eps), cos, sin)  # q_norm, k_norm, RoPE
            # the last layer's outputs are read at block slots 0 .. slots only
            q_len = slots + 1 if li == last else k_blk
            q = qk[:, t: t + q_len, :nh].transpose(1, 2)
            k = qk[:, :, nh:].transpose(1, 2)
            v = qkv[:, :, nh + nkv:].transpose(1, 2)
            kr, vr = kb[rows], vb[rows]
            if one_slice:
                kr[:, :, max_root_pos: kv_len] = k
                vr[:, :, max_root_pos: kv_len] = v
            else:
                write_slots(kr, idx, k, grid)
                write_slots(vr, idx, v, grid)
            out = F.scaled_dot_product_attention(q, kr[:, :, :kv_len], vr[:, :, :kv_len], attn_mask=mask,
                                                 scale=hd ** -0.5, enable_gqa=nh != nkv)
            a = F.linear(out.transpose(1, 2).reshape(b, q_len, -1), lw.o)
            if q_len < k_blk:
                h = h[:, :q_len]
            if lw.conv_a is not None:
                h = h + _conv_finish(a, delta[:, :q_len], lw.conv_a)
                x, delta = _conv_prepare(rms_norm(h, lw.ln_post, lw.eps), lw.conv_m)
                h = h + _conv_finish(self._mlp(x, lw), delta, lw.conv_m)
            else:
                h = h + a
                h = h + self._mlp(rms_norm(h, lw.ln_post, lw.eps), lw)
        return m.norm(h[:, 1: slots + 1])  # row-wise: the root slot's output is not needed

    @staticmethod
    def _mlp(x: torch.Tensor, lw: _LayerWeights) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x))`` with gate and up in one matrix."""
        g, u = _linear_cat(x, lw.gu).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, lw.down)

    # ------------------------------------------------------------------ buffers
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row ``src``'s first ``length`` context positions become row ``dst``'s (after writing a
        deferred context)."""
        self._flush()
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]

    def context_kv(self, row: int, length: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(k, v)`` [1, kv_heads, length, head_dim] of one row's cached context (tests);
        a deferred context is written first."""
        self._flush()
        return self.keys[layer][row: row + 1, :, :length], self.values[layer][row: row + 1, :, :length]
