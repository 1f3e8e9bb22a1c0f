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
and writes both with one scatter per buffer (context padding that falls on the block's slots is
sent to the buffers' last slot, which is never read, so no read slot is a target twice).
RoPE cos/sin come from a table built per generation call, as does the MASK token's embedding.

DFlash2 (issue 28): the conv runs in every layer over the block and the logit transform on the
full vocabulary; :meth:`StaticDFlashDrafter.draft_rows` returns those logits (the "marginal"
draft mode), :meth:`StaticDFlashDrafter.draft_lattice_rows` the same forward's candidate-selector
lattice (the "lattice" mode: lattice trees and the selector chain, ``hf/round.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..draft.dflash import DFlashDraftModel
from ..draft.dflash2 import SelectorLattice

__all__ = ["StaticDFlashDrafter"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``dflash._apply_rope`` with the sign of the rotation folded into ``sin_signed`` (= sin with
    its first half negated): the same products and sum, one op fewer. x: [b, h, T, d]; cos,
    sin_signed: [b, 1, T, d]."""
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

class StaticDFlashDrafter:
    """:class:`~sglang_tev.hf.drafters.BatchDrafter` for a :class:`DFlashDraftModel`.

    Args:
        model: the drafter.
        target: the HF causal LM whose ``get_input_embeddings()`` and ``get_output_embeddings()``
            (LM head) the drafter uses.
    """

    max_rows = None
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
        context padding that would land on a block slot is sent there by the fused scatter."""
        self._pending = None
        cfg = self.model.config
        dtype = self.model.fc.weight.dtype
        shape = (rows, cfg.num_key_value_heads, max_len + self.block_size + 1, cfg.head_dim)
        if not self.keys or self.keys[0].shape != shape or self.keys[0].device != torch.device(device):
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.model.layers]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.model.layers]
        self._tables_key = None  # rebuilt for every call: the embedding may have changed in between
        self._tables(device, dtype)

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
        idx = positions[:, None, :, None]
        for layer, kb, vb in zip(m.layers, self.keys, self.values):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).view(b, t, attn.num_kv_heads, attn.head_dim)).transpose(1, 2)
            k = _rotate(k, cos, sin)
            v = attn.v_proj(ctx).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            kb[rows].scatter_(2, idx.expand_as(k), k)
            vb[rows].scatter_(2, idx.expand_as(v), v)

    # ------------------------------------------------------------------ draft
    @property
    def has_selector(self) -> bool:
        """True for a DFlash2 drafter with a candidate selector (``selector_rank`` /
        ``selector_top_k`` in its config): :meth:`draft_lattice_rows` is available."""
        return getattr(self.model, "candidate_selector", None) is not None

    @torch.inference_mode()
    def draft_rows(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, tokens: torch.Tensor,
                   depth: int, max_root_pos: int) -> torch.Tensor:
        """float32 [b, depth, V]: row j = draft logits of depth j + 1 (see the module docstring);
        for a DFlash2 drafter with its conv in every layer over the block (the block is the whole
        sequence here) and the logit transform on the full vocabulary (the "marginal" draft mode:
        the selector is not run).

        A context deferred by :meth:`add_context` for the same ``rows`` is projected here, fused
        with the block ([context ; block] rows per layer); one for other rows is written first."""
        return self._head(self._draft_hidden(rows, roots, root_pos, depth, max_root_pos))

    @torch.inference_mode()
    def draft_lattice_rows(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, tokens: torch.Tensor,
                           depth: int, max_root_pos: int) -> SelectorLattice:
        """The DFlash2 selector's candidate lattice of one round ("lattice" and selector-chain modes).

        Same forward as :meth:`draft_rows` (arguments as there), then the candidate selector on
        the final-normed hidden states and the transformed logits
        (:meth:`~sglang_tev.draft.dflash2.CandidateSelector.lattice`, the root as slot 0's
        predecessor): the same lattice as
        :meth:`~sglang_tev.draft.dflash.DFlashDraftModel.draft_lattice` on one row.

        Returns:
            :class:`~sglang_tev.draft.dflash2.SelectorLattice` with ``candidate_ids`` int64
            [b, depth, k], ``unary_logq`` / ``transition_logq`` float32 ([b, depth, k] /
            [b, depth, k, k]), k = ``selector_top_k``.
        Raises:
            ValueError: the drafter has no candidate selector (DFlash v1).
        """
        if not self.has_selector:
            raise ValueError("draft_mode: this drafter has no candidate selector (DFlash v1); use the marginal mode")
        hidden = self._draft_hidden(rows, roots, root_pos, depth, max_root_pos)
        return self.model.candidate_selector.lattice(hidden, self._head(hidden), roots)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Transformed draft logits float32 [b, depth, V] of final-normed hidden states."""
        head_w = getattr(self.lm_head, "weight", None)
        if isinstance(head_w, torch.Tensor):
            h = h.to(head_w.dtype)
        return self.model.transform_logits(self.lm_head(h).float())  # DFlash2: multiplier + softcap (v1: identity)

    def _draft_hidden(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, depth: int,
                      max_root_pos: int) -> torch.Tensor:
        """The block forward: final-normed hidden states [b, depth, H] of slots 1 .. depth."""
        m = self.model
        b, k_blk = roots.shape[0], depth + 1
        dtype = m.fc.weight.dtype
        pending = self._pending
        if pending is not None and pending[0] != rows:
            self._flush()
            pending = None
        self._pending = None
        self._tables(roots.device, dtype)
        slots = self.keys[0].shape[2]
        kv_len = max_root_pos + k_blk
        if kv_len > slots - 1:
            raise ValueError(f"max_root_pos + depth + 1 = {kv_len} exceeds the buffers' {slots - 1} readable slots")
        rp = root_pos.view(b, 1)
        pos = rp + self._arange[:k_blk]  # [b, K'] block positions
        if pending is not None:
            features, ctx_pos = _joined(pending[1], pending[2])
            ctx = m.hidden_norm(m.fc(features.to(dtype)))  # [b, T, H]
            t = ctx.shape[1]
            # context slots at or past the root are padding; the block owns them: send them to the
            # never-read last slot so that one scatter writes context and block without duplicates
            keep = (ctx_pos < rp) & _last_writes(ctx_pos)  # (deferred writes to one slot: the last wins)
            idx = torch.cat([torch.where(keep, ctx_pos, slots - 1), pos], dim=1)  # [b, T + K']
        else:
            ctx, t, idx = None, 0, pos
        cos, sin = self._rope(idx)  # [b, 1, T + K', d]; padding rows get the last slot's (unread)
        cos_q, sin_q = cos[:, :, t:], sin[:, :, t:]
        n = t + k_blk
        # a row sees its context [0, root_pos) and its block [root_pos, root_pos + K')
        mask = None
        if b > 1:
            mask = self._arange[:kv_len] < (root_pos.view(b, 1, 1, 1) + k_blk)  # [b, 1, 1, kv_len]
        one_slice = b == 1 and ctx is None  # block only, contiguous: a slice copy
        sidx = None if one_slice else idx[:, None, :, None]
        h = torch.cat([self.embed(roots.view(b, 1)).to(dtype), self._mask_embed.expand(b, depth, -1)], dim=1)
        conv = m.layers[0].attention_conv is not None  # DFlash2: conv around attention and MLP, in the block
        for layer, kb, vb in zip(m.layers, self.keys, self.values):
            attn = layer.self_attn
            nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
            x = layer.input_layernorm(h)
            if conv:
                x, delta = layer.attention_conv.prepare(x)
            q = attn.q_norm(attn.q_proj(x).view(b, k_blk, nh, hd)).transpose(1, 2)
            q = _rotate(q, cos_q, sin_q)
            kv_in = x if ctx is None else torch.cat([ctx, x], dim=1)  # [b, T + K', H]
            k = attn.k_norm(attn.k_proj(kv_in).view(b, n, nkv, hd)).transpose(1, 2)
            k = _rotate(k, cos, sin)
            v = attn.v_proj(kv_in).view(b, n, nkv, hd).transpose(1, 2)
            kr, vr = kb[rows], vb[rows]
            if one_slice:
                kr[:, :, max_root_pos: kv_len] = k
                vr[:, :, max_root_pos: kv_len] = v
            else:
                kr.scatter_(2, sidx.expand_as(k), k)
                vr.scatter_(2, sidx.expand_as(v), v)
            out = F.scaled_dot_product_attention(q, kr[:, :, :kv_len], vr[:, :, :kv_len], attn_mask=mask,
                                                 scale=hd ** -0.5, enable_gqa=nh != nkv)
            a = attn.o_proj(out.transpose(1, 2).reshape(b, k_blk, -1))
            if conv:
                h = h + layer.attention_conv.finish(a, delta)
                x, delta = layer.mlp_conv.prepare(layer.post_attention_layernorm(h))
                h = h + layer.mlp_conv.finish(layer.mlp(x), delta)
            else:
                h = h + a
                h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.norm(h[:, 1:])  # row-wise: the root slot's output is not needed

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
