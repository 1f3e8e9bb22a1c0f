"""The drafter's layers: Qwen3 RMSNorm (:func:`rms_norm`, :class:`RMSNorm`), default RoPE, the
non-causal block attention over ``[context K/V | block K/V]`` (:class:`DFlashAttention`), the SiLU
MLP and the pre-norm decoder layer (with DFlash2's grouped causal conv when configured).

Letters: b batch, T tokens, K block size, H hidden size, d head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..dflash2 import GroupedCausalConv
from .config import DFlashConfig

__all__ = ["rms_norm", "RMSNorm", "DFlashAttention", "DFlashMLP", "DFlashDecoderLayer"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm of the last dim: normalise in float32, scale by ``weight`` in ``x``'s dtype.
    ``weight`` [d], or [heads, d] over x [..., heads, d] (one scale per head: q_norm and k_norm
    in one call). torch's fused ``rms_norm``: ``x * rsqrt(mean(x^2) + eps)`` in one op instead of
    five (the draft forward is op-bound on CPU); equal to the unfused form on fp32 and bf16."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm (:func:`rms_norm` with a learned ``weight``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rope(positions: torch.Tensor, head_dim: int, theta: float,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(b, T, head_dim)`` for int64 positions ``(b, T)`` (default RoPE, as HF Qwen3).
    Package-internal: the model computes them once per forward for all layers (:mod:`.model`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # [b, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, h, T, d]; cos/sin: [b, T, d]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """Non-causal attention of block queries over ``[context K/V | block K/V]``."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        H, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V ``(b, kv_heads, T, d)`` of ``x (b, T, H)``; shared by context and block."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past_k: torch.Tensor | None, past_v: torch.Tensor | None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rope(q, cos, sin)  # [b, nh, K, d]
        k, v = self.project_kv(x, cos, sin)  # block K/V: used here, never cached
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # GQA: repeat each kv head for its query heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Qwen3 pre-norm block; with DFlash2's conv (``cfg.conv_kernel_size``) the attention and the
    MLP are each wrapped: ``conv_in(norm(h))`` -> sublayer -> ``conv_out`` (reference
    ``Qwen3DFlashDecoderLayer.forward``). The context K/V path gets no conv."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)
        self.attention_conv = self.mlp_conv = None
        if cfg.conv_kernel_size is not None:
            self.attention_conv = GroupedCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h, cos, sin, past_k, past_v, attn_mask=None, block_len: int | None = None):
        """``block_len``: tokens per block for the conv (None: the whole sequence is one block)."""
        if self.attention_conv is None:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, past_k, past_v, attn_mask)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, delta = self.attention_conv.prepare(self.input_layernorm(h), block_len)
        a = self.self_attn(x, cos, sin, past_k, past_v, attn_mask)
        h = h + self.attention_conv.finish(a, delta, block_len)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h), block_len)
        return h + self.mlp_conv.finish(self.mlp(x), delta, block_len)
