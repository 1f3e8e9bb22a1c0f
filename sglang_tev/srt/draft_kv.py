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

__all__ = ["TorchStackedKV", "PendingDraftKV", "held_writes_refusal", "stacked_kv_refusal", "install_context_kv_writer"]

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


class PendingDraftKV:
    """The drafter-KV writes of plain decoding steps, held until the drafter next needs its KV.

    A plain step (``SGLANG_TEV_BUDGET=auto``, budget 0) drafts nothing, yet each committed token's
    drafter K/V must be in the pool before the next draft forward reads it. Written one token per
    request per step, that write was ~0.65 ms of an ~11 ms plain step on the CPU server (the
    target's features through the drafter's ``fc`` projection, then every layer's K/V); held and
    written at once, a streak of plain steps pays it about once. The worker (``worker.py``) flushes
    the held writes, in the order they were made, before any of its own calls reads or writes the
    drafter's pool: before a round that drafts, before every prefill / extend / idle call, and
    once :attr:`full`. Where SGLang itself copies the drafter's pool outside the worker (the
    hierarchical KV cache's host backups and load-backs), nothing is held
    (:func:`held_writes_refusal`).

    Why the pool stays right: a slot freed between steps (a finished, aborted or retracted
    request) and given to another request is written by its new owner later than by the held
    write: in a call that flushes first, or in a later plain step, whose write is held behind it
    and supersedes it (:meth:`take` drops the older of two held writes to one slot: one scatter
    with a repeated index has no defined winner on CUDA). And what the drafter's KV holds never
    changes what a request emits: drafts only propose, the verifier decides (a stale drafter KV
    could cost accept length, never exactness).

    Args:
        max_steps: plain steps held at most before :attr:`full` (an integer >= 1).
        max_rows: rows (requests x steps) held at most before :attr:`full` (an integer >= 1): the
            held features are [rows, F] in the target's dtype (F = captured layers x hidden size:
            40 KiB a row for five layers of a 4096-wide bf16 target).
    Raises:
        ValueError naming ``max_steps`` or ``max_rows``.
    """

    def __init__(self, max_steps: int = 32, max_rows: int = 1024) -> None:
        for name, value in (("max_steps", max_steps), ("max_rows", max_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        self.max_steps, self.max_rows = max_steps, max_rows
        self._held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._rows = 0

    def __len__(self) -> int:
        """Plain steps held."""
        return len(self._held)

    @property
    def full(self) -> bool:
        """Whether :attr:`max_steps` steps or :attr:`max_rows` rows are held (the worker then flushes)."""
        return len(self._held) >= self.max_steps or self._rows >= self.max_rows

    def add(self, target_hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
            commit_lens: torch.Tensor) -> None:
        """Hold one plain step's write (copies: the step's buffers may be reused, e.g. a replayed
        CUDA graph's outputs).

        Args:
            target_hidden: [bs, F], the step's captured target features (one row per request).
            cache_loc: int [bs], each request's slot in the drafter pool's id space.
            positions: int [bs]; commit_lens: int [bs], 1 per request (0 leaves its row unwritten).
        Raises:
            ValueError when the four do not have one row per request.
        """
        n = int(cache_loc.numel())
        if target_hidden.ndim != 2 or target_hidden.shape[0] != n or positions.numel() != n or commit_lens.numel() != n:
            raise ValueError(
                f"one row per request expected: target_hidden {tuple(target_hidden.shape)}, cache_loc {n}, "
                f"positions {positions.numel()}, commit_lens {commit_lens.numel()}")
        self._held.append((target_hidden.clone(), cache_loc.reshape(-1).clone(),
                           positions.reshape(-1).to(torch.int64, copy=True), commit_lens.reshape(-1).clone()))
        self._rows += n

    def take(self) -> dict | None:
        """Everything held, as one prefix-valid write, oldest first, and forget it.

        Returns:
            None when nothing is held, else the keyword arguments of SGLang's
            ``DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc``: ``target_hidden`` [R, F],
            ``cache_loc`` int [R], ``cache_loc_2d`` [R, 1] (one window of width 1 per held row),
            ``positions`` int64 [R], ``commit_lens`` [R] (0 for a row a later held row that writes
            the same slot supersedes; a row held with 0 writes nothing and supersedes nothing), R
            the rows of all held steps. No host read.
        """
        if not self._held:
            return None
        hidden, locs, positions, lens = (torch.cat(x) for x in zip(*self._held))
        self._held, self._rows = [], 0
        if len(locs) > 1:
            # a stable sort keeps a slot's writes in held order: each but the last is superseded
            # (a row that writes nothing gets a key of its own, below every slot id)
            key = torch.where(lens > 0, locs.to(torch.int64),
                              -1 - torch.arange(len(locs), device=locs.device, dtype=torch.int64))
            order = torch.sort(key, stable=True).indices
            ranked = key[order]
            superseded = torch.zeros_like(lens, dtype=torch.bool)
            superseded[order[:-1]] = ranked[:-1] == ranked[1:]
            lens = lens.masked_fill(superseded, 0)
        return {"target_hidden": hidden, "cache_loc": locs, "cache_loc_2d": locs.view(-1, 1),
                "positions": positions, "commit_lens": lens}


def held_writes_refusal(worker) -> Optional[str]:
    """Why ``worker``'s (a ``TEVWorker``'s) plain steps must write the drafter's KV at once rather
    than hold it (:class:`PendingDraftKV`), or None.

    Held writes are right while only the worker touches the drafter's pool. SGLang also copies that
    pool outside the worker when its hierarchical KV cache, its external cache linker or a host-pool
    retraction backup is on (``BaseSpecWorker._build_hicache_draft_plan``, SGLang 0.5.23
    ``speculative/base_spec_worker.py:270-341``): a backup could read a slot before its held write
    lands, and a load-back could be overwritten by a stale one. SGLang's lilicorr draft head also
    anchors on every write. Read at start-up (the published server arguments) and again at the
    first decode (the draft plan the scheduler builds after the worker).
    """
    if getattr(worker, "lilicorr", None) is not None:
        return "SGLang's lilicorr draft head anchors on every drafter-KV write"
    mode = getattr(getattr(worker, "hicache_draft_plan", None), "mode", None)
    mode = getattr(mode, "value", mode)
    if mode is not None and str(mode) != "none":
        return f"SGLang backs the drafter's KV pool up to host memory outside the worker (HiCache draft plan {mode!r})"
    from sglang.srt.runtime_context import get_disagg, get_memory

    try:
        memory = get_memory()
    except ValueError:  # not published: no server arguments (the worker tests' fakes)
        memory = None
    if memory is not None and (getattr(memory, "enable_hierarchical_cache", False)
                               or getattr(memory, "enable_unified_cache_external_linker", False)):
        return "the hierarchical KV cache backs the drafter's pool up to host memory outside the worker"
    try:
        disagg = get_disagg()
    except ValueError:
        disagg = None
    if getattr(disagg, "disaggregation_decode_retraction_backup", None) == "host_pool":
        return "retraction backs the drafter's pool up to host memory outside the worker"
    return None
