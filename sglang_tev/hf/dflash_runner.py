"""The DFlash drafter over a static, preallocated context cache with per-row lengths.

Same math as :meth:`~sglang_tev.draft.dflash.DFlashDraftModel.draft_logits` (z-lab
``dflash_generate`` draft step; the drafter's own modules are called, nothing is re-weighted):
context features -> ``fc`` -> ``hidden_norm`` -> per-layer K/V (k_norm + RoPE) written once at
their positions; one block ``[root, MASK x H]`` per row attends, bidirectionally, to its row's
context and the block. Rows of different lengths share one forward: per layer the keys and values
live in ``[rows, kv_heads, max_len + K + 1, head_dim]`` buffers (slot = position) and a mask
hides everything past a row's context + block. The block's own K/V are written after the
context and are overwritten by the next round's context; no ``torch.cat``, no crop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..draft.dflash import DFlashDraftModel, _apply_rope

__all__ = ["StaticDFlashDrafter"]


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
        self._inv_freq: torch.Tensor | None = None

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b, T, head_dim] as ``dflash._rope`` (default RoPE), its inverse frequencies
        computed once."""
        cfg = self.model.config
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=positions.device,
                                                                    dtype=torch.float) / cfg.head_dim))
        freqs = positions[..., None].float() * self._inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def start(self, rows: int, max_len: int, device) -> None:
        cfg = self.model.config
        dtype = self.model.fc.weight.dtype
        shape = (rows, cfg.num_key_value_heads, max_len + self.block_size + 1, cfg.head_dim)
        if not self.keys or self.keys[0].shape != shape or self.keys[0].device != torch.device(device):
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.model.layers]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.model.layers]

    @torch.inference_mode()
    def add_context(self, rows: slice, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Project features float [b, T, F] (target layer outputs, concatenated) to every layer's
        context K/V and write them at ``positions`` int64 [b, T]."""
        m = self.model
        dtype = m.fc.weight.dtype
        ctx = m.hidden_norm(m.fc(features.to(dtype)))
        cos, sin = self._rope(positions, dtype)
        idx = positions[:, None, :, None]
        for layer, kb, vb in zip(m.layers, self.keys, self.values):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            kb[rows].scatter_(2, idx.expand_as(k), k)
            vb[rows].scatter_(2, idx.expand_as(v), v)

    @torch.inference_mode()
    def draft_rows(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, tokens: torch.Tensor,
                   depth: int, max_root_pos: int) -> torch.Tensor:
        """float32 [b, depth, V]: row j = draft logits of depth j + 1 (see the module docstring)."""
        m = self.model
        cfg = m.config
        b, k_blk = roots.shape[0], depth + 1
        dev = roots.device
        dtype = m.fc.weight.dtype
        block = torch.full((b, k_blk), cfg.mask_token_id, dtype=torch.int64, device=dev)
        block[:, 0] = roots
        pos = root_pos.view(b, 1) + torch.arange(k_blk, device=dev)  # [b, K']
        cos, sin = self._rope(pos, dtype)
        kv_len = max_root_pos + k_blk
        # a row sees its context [0, root_pos) and its block [root_pos, root_pos + K')
        mask = None
        if b > 1:
            mask = (torch.arange(kv_len, device=dev).view(1, 1, 1, kv_len) < (pos[:, -1] + 1).view(b, 1, 1, 1))
        idx = pos[:, None, :, None]
        h = self.embed(block).to(dtype)
        for layer, kb, vb in zip(m.layers, self.keys, self.values):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_norm(attn.q_proj(x).view(b, k_blk, attn.num_heads, attn.head_dim)).transpose(1, 2)
            q = _apply_rope(q, cos, sin)
            k, v = attn.project_kv(x, cos, sin)
            kr, vr = kb[rows], vb[rows]
            kr.scatter_(2, idx.expand_as(k), k)
            vr.scatter_(2, idx.expand_as(v), v)
            out = F.scaled_dot_product_attention(q, kr[:, :, :kv_len], vr[:, :, :kv_len], attn_mask=mask,
                                                 scale=attn.head_dim ** -0.5,
                                                 enable_gqa=attn.num_heads != attn.num_kv_heads)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(b, k_blk, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = m.norm(h)[:, 1:]
        head_w = getattr(self.lm_head, "weight", None)
        if isinstance(head_w, torch.Tensor):
            h = h.to(head_w.dtype)
        return self.lm_head(h).float()

    def move_row(self, src: int, dst: int, length: int) -> None:
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]

    def context_kv(self, row: int, length: int, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(k, v)`` [1, kv_heads, length, head_dim] of one row's cached context (tests)."""
        return self.keys[layer][row: row + 1, :, :length], self.values[layer][row: row + 1, :, :length]
