"""The drafter's context KV, written for every layer at once (imports sglang only inside functions).

After every round the drafter must hold the KV of each committed token: per draft layer, K and V
projected from the target's captured features, K through the layer's RMSNorm and RoPE
(``DFlashAttention.kv_proj_only`` / ``apply_k_norm`` / ``apply_k_rope``, SGLang 0.5.23
``srt/models/dflash.py:430-467``). SGLang's per-layer path does this with ~10 tensor operations a
layer (RoPE also rotates a dummy query); on a plain step of the CPU server that was ~9 % of the
step (``docs/benchmarks.md``, "A plain step inside TEV").

Both writers below compute the same thing once for all layers: one GEMM against the layers'
stacked K/V weights (the layout of SGLang's ``FusedKVMaterializeHelper``,
``kernels/ops/speculative/fused_kv_materialize.py:242-335``), then the norm and RoPE of every
layer's K together, then one KV-pool write per layer.

* CUDA / ROCm / XPU: SGLang's helper (its Triton kernel ``_fused_norm_rope_kernel_stacked``), what
  DFLASH itself runs there; TEV had kept the per-layer path since its first worker.
* Elsewhere (the CPU server): :class:`TorchStackedKV`, the same stages in torch, with the per-layer
  path's elementwise operations and dtypes (norm in float32, RoPE in the cache's dtype).

A drafter the stacked layout does not fit (SGLang's own checks: a quantized or biased ``qkv_proj``,
non-unit KV scales, GPT-J RoPE, a model that sets ``supports_fused_context_kv = False``, layers of
different shapes) keeps SGLang's per-layer path; the reason is logged once at start-up.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch

__all__ = ["TorchStackedKV", "stacked_kv_refusal", "install_context_kv_writer"]

logger = logging.getLogger(__name__)


def stacked_kv_refusal(draft_model) -> Optional[str]:
    """Why the stacked writer cannot serve ``draft_model`` (SGLang's ``DFlashDraftModel``), or None.

    The conditions are those of SGLang's fused path (``DFlashWorkerV2._init_fused_kv_helper``,
    ``dflash_worker_v2.py:1000-1094``) plus what the torch stages assume: a plain RMSNorm on K.
    """
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.speculative.dflash_utils import can_dflash_use_fused_qkv_proj

    layers = list(getattr(draft_model, "layers", []))
    if not layers:
        return "the drafter has no layers"
    if not getattr(draft_model, "supports_fused_context_kv", True):
        return f"{type(draft_model).__name__} prepares each layer's context itself (supports_fused_context_kv is False)"
    first = layers[0].self_attn
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        ok, reason = can_dflash_use_fused_qkv_proj(attn.qkv_proj)
        if not ok:
            return f"layer {i}: {reason}"
        for name in ("k_scale", "v_scale"):
            s = getattr(attn.attn, name, None)
            if s is not None and not math.isclose(float(s), 1.0):
                return f"layer {i}: {name} = {float(s)} (only unit KV scales are stacked)"
        if getattr(attn, "v_scale", None) is not None:
            return f"layer {i}: V is scaled after its projection"
        rope = attn.rotary_emb
        if not bool(getattr(rope, "is_neox_style", True)):
            return f"layer {i}: GPT-J style RoPE"
        if (int(attn.num_kv_heads), int(attn.head_dim), int(getattr(rope, "rotary_dim", attn.head_dim))) != (
            int(first.num_kv_heads), int(first.head_dim), int(getattr(first.rotary_emb, "rotary_dim", first.head_dim))
        ):
            return f"layer {i}: KV heads, head size or rotary size differ from layer 0's"
        if rope is not first.rotary_emb and not (
            rope.cos_sin_cache.shape == first.rotary_emb.cos_sin_cache.shape
            and torch.equal(rope.cos_sin_cache, first.rotary_emb.cos_sin_cache)
        ):
            return f"layer {i}: its RoPE table differs from layer 0's"
        norm = attn.k_norm
        if type(norm) is not RMSNorm or getattr(norm, "variance_size_override", None) is not None or getattr(
                norm, "cast_x_before_out_mul", False):
            return f"layer {i}: the K norm ({type(norm).__name__}) is not a plain RMSNorm"
    return None


class TorchStackedKV:
    """The drafter's context K/V of every layer from one GEMM, in torch (any device).

    Args:
        layers: the draft model's decoder layers (``layer.self_attn`` a ``DFlashAttention``), accepted
            by :func:`stacked_kv_refusal`.
        max_position: the largest position it will see (the target's context plus a block); the
            RoPE table is grown to it once. A position past the table raises ``IndexError`` (SGLang
            then keeps its per-layer path for good).
    Attributes:
        weight_t: [hidden, L * 2 * kv_size], the layers' K/V rows of ``qkv_proj`` stacked, transposed.
        k_norm_weight: [L, 1, 1, head_dim]; eps: float32 [L, 1, 1, 1].
    """

    def __init__(self, layers, max_position: int | None = None) -> None:
        attns = [layer.self_attn for layer in layers]
        a0 = attns[0]
        grow = getattr(a0.rotary_emb, "_ensure_cos_sin_cache_length", None)
        if max_position is not None and grow is not None and a0.rotary_emb.cos_sin_cache.shape[0] <= max_position:
            # once, here: a per-call check would read the positions on the host every round
            # (SGLang's fused helper sizes its table the same way, from context + block)
            grow(int(max_position))
        self.n_layers, self.num_kv_heads, self.head_dim = len(attns), int(a0.num_kv_heads), int(a0.head_dim)
        self.rotary_emb = a0.rotary_emb
        self.rotary_dim = int(getattr(self.rotary_emb, "rotary_dim", self.head_dim))
        kv = [a.qkv_proj.weight[a.q_size : a.q_size + 2 * a.kv_size] for a in attns]  # [2 * kv_size, hidden] each
        self.weight_t = torch.cat(kv, dim=0).t().contiguous()
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns]).view(self.n_layers, 1, 1, self.head_dim)
        self.eps = torch.tensor([float(a.k_norm.variance_epsilon) for a in attns], dtype=torch.float32,
                                device=self.weight_t.device).view(self.n_layers, 1, 1, 1)

    def kv(self, ctx_hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V of every layer.

        Args:
            ctx_hidden: [T, hidden], the projected target features (``project_target_hidden``).
            positions: int64 [T], each token's position.
        Returns:
            (k, v), each [L, T, kv_heads, head_dim] in ``ctx_hidden``'s dtype.
        """
        t, L, h, d = ctx_hidden.shape[0], self.n_layers, self.num_kv_heads, self.head_dim
        if t == 0:
            empty = ctx_hidden.new_empty((L, 0, h, d))
            return empty, empty
        proj = torch.mm(ctx_hidden.to(self.weight_t.dtype), self.weight_t)  # [T, L * 2 * h * d]
        kv = proj.view(t, L, 2, h, d).permute(2, 1, 0, 3, 4).contiguous()  # [2, L, T, h, d], layer-major
        k, v = kv[0], kv[1]
        dtype = k.dtype
        # RMSNorm.forward_native: float32, x * rsqrt(mean(x^2) + eps), times the weight, back to dtype
        kf = k.to(torch.float32)
        kf = kf * torch.rsqrt(kf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        k = (kf * self.k_norm_weight).to(dtype)
        # neox RoPE on the first rotary_dim channels (RotaryEmbedding.forward_native), once for all layers
        cos, sin = self.rotary_emb.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, rot / 2] each
        cos = cos.view(1, t, 1, -1).to(dtype)
        sin = sin.view(1, t, 1, -1).to(dtype)
        r = self.rotary_dim
        x1, x2 = k[..., : r // 2], k[..., r // 2 : r]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if r < d:
            parts.append(k[..., r:])
        return torch.cat(parts, dim=-1), v

    def materialize(self, ctx_hidden: torch.Tensor, positions: torch.Tensor,
                    write_layer_kv: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """SGLang's helper's interface (``FusedKVMaterializeHelper.materialize``): computes every
        layer's K/V and hands layer ``l``'s ([T, kv_heads, head_dim] each) to ``write_layer_kv``."""
        if ctx_hidden.shape[0] == 0:
            return
        k, v = self.kv(ctx_hidden, positions.reshape(-1).to(torch.int64))
        for layer in range(self.n_layers):
            write_layer_kv(layer, k[layer], v[layer])


def install_context_kv_writer(worker) -> str:
    """Give ``worker`` (a ``DFlashWorkerV2``) the stacked writer for its device; returns what it
    now uses, for the start-up log. SGLang's ``_append_target_hidden_to_draft_kv_by_loc`` calls the
    writer (``_fused_kv_helper``) when ``_use_fused_kv_materialize`` is set, and falls back to its
    per-layer path for good if the writer raises."""
    from sglang.srt.utils import is_cuda, is_hip, is_xpu

    built = getattr(worker, "_fused_kv_helper", None)  # SGLang's __init__ builds its own on CUDA
    worker._use_fused_kv_materialize, worker._fused_kv_helper = False, None
    refusal = stacked_kv_refusal(worker.draft_model)
    if refusal is not None:
        return f"per-layer (SGLang's path; the stacked writer does not fit: {refusal})"
    if is_cuda() or is_hip() or is_xpu():
        worker._use_fused_kv_materialize = True
        worker._fused_kv_helper = built
        if built is None:
            worker._init_fused_kv_helper()  # SGLang's own checks; it logs and disables on any failure
        if worker._fused_kv_helper is not None:
            return "stacked (SGLang's fused Triton norm + RoPE)"
        return "per-layer (SGLang's path; its fused helper refused, see above)"
    if torch.device(getattr(worker, "device", "cpu")).type != "cpu":
        # other accelerators (NPU, ...) keep SGLang's per-layer path, which has their branches
        return f"per-layer (SGLang's path on {torch.device(worker.device).type})"
    try:
        max_position = int(worker.target_worker.model_runner.model_config.context_len) + int(worker.block_size)
    except AttributeError:
        max_position = None
    worker._fused_kv_helper = TorchStackedKV(worker.draft_model.layers, max_position)
    worker._use_fused_kv_materialize = True
    return "stacked (torch)"
