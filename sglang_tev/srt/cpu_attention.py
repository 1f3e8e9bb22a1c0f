"""A pure-torch attention backend for SGLang 0.5.23 that applies tree masks (CPU, or any device).

SGLang's own ``torch_native`` backend (``sglang/srt/layers/attention/torch_native_backend.py``)
cannot serve speculative decoding: on TARGET_VERIFY it reads ``extend_prefix_lens`` (unset there)
and ignores ``spec_info.custom_mask``, and its name is not an accepted draft backend. The kernels
that do apply tree masks (FlashInfer, Triton) need a GPU. :class:`TorchCPUAttnBackend` serves
every forward the TEV worker and SGLang's DFLASH run, with one ``scaled_dot_product_attention``
call per layer on padded ``[batch, heads, q, kv]`` tensors and an explicit boolean mask:

* EXTEND / MIXED (prefill, chunked prefill, radix-cache hits): request b has
  ``extend_prefix_lens[b]`` cached tokens and ``extend_seq_lens[b]`` new ones; DECODER layers are
  causal, ENCODER_ONLY layers (the DFlash drafter's) see all of the prefix and all new tokens.
* DECODE: one new token per request after ``seq_lens[b] - 1`` cached ones.
* TARGET_VERIFY (the target's tree verify, and the DFlash drafter's block forward, which SGLang
  also runs as TARGET_VERIFY on the draft runner: ``dflash_worker_v2.py:2640``): ``seq_lens[b]``
  cached tokens and N = ``spec_info.num_tokens_per_req`` (else ``draft_token_num``) new tokens per
  request, or, with a ragged verify layout (``spec_info.ragged_verify_layout``, SGLang's
  ``RaggedVerifyLayout``: per-request trees of different sizes in one forward), N_b =
  ``verify_lens_cpu[b]`` new tokens of request b, packed request after request. With
  ``spec_info.custom_mask`` set, each new token sees exactly the keys its mask row
  allows, read in SGLang's FULL layout (request b's N_b rows of ``seq_lens[b] + N_b`` bools, row-major,
  requests concatenated from offset ``sum_{j<b} N_j * (seq_lens[j] + N_j)``: the indexing of
  ``triton_backend.py:1051-1057`` and ``extend_attention.py:549-553/740-748``; prefix columns are
  read too, as FlashInfer does). Without a mask: causal within the N tokens for DECODER layers
  (DFLASH's chain verify), full within them for ENCODER_ONLY layers (the drafter's block), as
  SGLang's Triton and FlashInfer backends do.

K/V are written where ``out_cache_loc`` says (``save_kv_cache`` honoured) through the pool's own
``set_kv_buffer``; cached keys are read through ``req_to_token`` as ``torch_native`` does, the new
tokens' keys from the ``k``/``v`` arguments (from ``out_cache_loc`` when the caller passes None),
as the Triton backend does. Grouped-query attention, the layer's ``scaling`` and tanh logit
capping are served. Refused with an error naming the feature: sliding-window layers and pools,
cross-attention / encoder-decoder batches, attention sinks and other backend kwargs, scaled KV
caches, paged/HND KV layouts, and the other forward modes (DRAFT_EXTEND_V2,
SPLIT_PREFILL, DLLM_EXTEND, PREBUILT). CUDA graphs are not supported (run with them disabled).

Debug option: ``SGLANG_TEV_CPU_ATTN_IGNORE_MASK=1`` in the environment of the process that builds
the backend (every SGLang scheduler process inherits it), or ``ignore_custom_mask=True``, makes
TARGET_VERIFY ignore ``custom_mask`` (chain semantics). It exists for negative controls: a tree
verify run that still matches its reference with the mask ignored did not test the mask.

:func:`register_cpu_attention` makes the backend selectable as ``--attention-backend NAME``
(default ``"tev_cpu"``), for the target and for DFLASH-family drafts, through SGLang's public
extension points; see its docstring for the exact lines it relies on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from .. import env as _env

__all__ = [
    "DEFAULT_BACKEND_NAME",
    "ENV_IGNORE_MASK",
    "TorchCPUAttnBackend",
    "register_cpu_attention",
]

DEFAULT_BACKEND_NAME = "tev_cpu"
"""The ``--attention-backend`` name :func:`register_cpu_attention` registers by default."""

ENV_IGNORE_MASK = _env.CPU_ATTN_IGNORE_MASK
"""Set to ``1`` to make the backend ignore TARGET_VERIFY custom masks (negative controls only)."""

_SERVED_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


def _host_ints(t, name: str, n: int) -> list[int]:
    """A host list of ``n`` ints from a tensor or list (one device->host copy)."""
    if t is None:
        raise ValueError(f"TorchCPUAttnBackend: forward_batch.{name} is required and is None")
    vals = t.tolist() if isinstance(t, torch.Tensor) else list(t)
    if len(vals) != n:
        raise ValueError(f"TorchCPUAttnBackend: forward_batch.{name} has {len(vals)} entries, batch size is {n}")
    vals = [int(x) for x in vals]
    if any(x < 0 for x in vals):
        raise ValueError(f"TorchCPUAttnBackend: forward_batch.{name} has a negative entry: {vals}")
    return vals


@dataclass
class _Plan:
    """Per-forward index tensors, shared by every layer (built once per forward batch).

    Request b's keys are laid out as ``[prefix_b cached keys, q_b new keys, padding]`` in a row of
    ``kv_max``; its queries as ``[q_b new tokens, padding]`` in a row of ``q_max``.
    """

    key: tuple  # the batch fields it was built from (compared by identity)
    mode: ForwardMode
    bs: int
    q_lens: list[int]
    prefix_lens: list[int]
    q_max: int
    kv_max: int
    num_tokens: int  # sum(q_lens): rows of q / k / v
    q_dst: torch.Tensor  # int64 [T]: flat row b * q_max + i of each new token
    kv_new_dst: torch.Tensor  # int64 [T]: flat key row b * kv_max + prefix_b + i of each new token
    kv_prefix_dst: torch.Tensor  # int64 [P]: flat key row b * kv_max + j of each cached key
    kv_prefix_src: torch.Tensor  # int64 [P]: its KV-pool slot, req_to_token[req_b, j]
    tree_mask: Optional[torch.Tensor]  # bool [bs, q_max, kv_max] from custom_mask, else None
    _masks: dict

    def mask(self, causal: bool) -> torch.Tensor:
        """bool [bs, 1, q_max, kv_max], True = attend; padded query rows attend everywhere."""
        key = "tree" if self.tree_mask is not None else ("causal" if causal else "full")
        m = self._masks.get(key)
        if m is None:
            dev = self.q_dst.device
            q_len = torch.tensor(self.q_lens, device=dev).view(-1, 1, 1)
            pre = torch.tensor(self.prefix_lens, device=dev).view(-1, 1, 1)
            i = torch.arange(self.q_max, device=dev).view(1, -1, 1)
            j = torch.arange(self.kv_max, device=dev).view(1, 1, -1)
            if key == "tree":
                allowed = self.tree_mask
            elif key == "causal":
                allowed = j <= pre + i
            else:
                allowed = j < pre + q_len
            allowed = allowed & (j < pre + q_len)  # never a padded key
            m = torch.where(i < q_len, allowed, True).unsqueeze(1)
            self._masks[key] = m
        return m


class TorchCPUAttnBackend(TorchNativeAttnBackend):
    """SGLang attention backend: pure torch SDPA with explicit boolean masks, tree verify included.

    Args:
        model_runner: SGLang's ``ModelRunner`` (only ``device``, ``req_to_token_pool`` and
            ``token_to_kv_pool`` are read, as ``TorchNativeAttnBackend.__init__`` does).
        ignore_custom_mask: debug; True makes TARGET_VERIFY ignore ``spec_info.custom_mask``.
            None (default) reads :data:`ENV_IGNORE_MASK` (``0``/``1``) at construction.
    Raises:
        ValueError: :data:`ENV_IGNORE_MASK` set to something other than 0/1.
        NotImplementedError: a sliding-window (hybrid SWA) KV pool.

    Layer calls take ``q`` [T, Hq * Dqk] (or [T, Hq, Dqk]), ``k`` [T, Hkv, Dqk], ``v`` [T, Hkv, Dv]
    (any float dtype; the attention runs in q's dtype) and return [T, Hq * Dv] in q's dtype, where
    T is the batch's new-token count. Host syncs: one per forward batch, when its per-request
    lengths and mask are read (:meth:`init_forward_metadata`); none per layer.
    """

    def __init__(self, model_runner, ignore_custom_mask: Optional[bool] = None):
        super().__init__(model_runner)
        if self.use_sliding_window_kv_pool:
            raise NotImplementedError(
                "TorchCPUAttnBackend: hybrid sliding-window KV pools (SWAKVPool) are not supported"
            )
        self.ignore_custom_mask = _env.get(ENV_IGNORE_MASK) if ignore_custom_mask is None else bool(ignore_custom_mask)
        self._plan: Optional[_Plan] = None

    # ------------------------------------------------------------------ per forward
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Build the per-forward plan: lengths, gather/scatter indices and the tree mask.

        Raises:
            ValueError naming the field: inconsistent lengths, a custom mask of the wrong size or
            dtype, a mask row that allows no key.
            NotImplementedError: an unserved forward mode, encoder lengths.
        """
        self.swa_out_cache_loc = None
        self._plan = None
        if forward_batch.forward_mode.is_idle():
            return
        self._plan = self._build_plan(forward_batch)

    def _build_plan(self, fb: ForwardBatch) -> _Plan:
        mode = fb.forward_mode
        if mode not in _SERVED_MODES:
            raise NotImplementedError(
                f"TorchCPUAttnBackend serves {[m.name for m in _SERVED_MODES]}, not forward mode {mode.name}"
            )
        if fb.encoder_lens is not None:
            raise NotImplementedError("TorchCPUAttnBackend: encoder-decoder batches (encoder_lens) are not supported")
        bs = int(fb.batch_size) if fb.batch_size is not None else int(fb.req_pool_indices.shape[0])
        if int(fb.req_pool_indices.shape[0]) != bs:
            raise ValueError(
                f"TorchCPUAttnBackend: req_pool_indices has {fb.req_pool_indices.shape[0]} entries, batch_size is {bs}"
            )
        # fb.seq_lens, not seq_lens_cpu: DFLASH widens the host copy to a bound on verify/draft
        # batches (dflash_worker_v2.py:2623-2627, DFlashVerifyInput.live_seq_lens_cpu)
        seq_lens = _host_ints(fb.seq_lens, "seq_lens", bs)
        spec = fb.spec_info
        tree_flat = None
        if mode == ForwardMode.DECODE:
            if any(s < 1 for s in seq_lens):
                raise ValueError(f"TorchCPUAttnBackend: DECODE needs seq_lens >= 1 (they count the new token), got {seq_lens}")
            q_lens = [1] * bs
            prefix_lens = [s - 1 for s in seq_lens]
        elif mode == ForwardMode.TARGET_VERIFY:
            if spec is None:
                raise ValueError("TorchCPUAttnBackend: TARGET_VERIFY needs forward_batch.spec_info (the verify input)")
            ragged = getattr(spec, "ragged_verify_layout", None)
            if ragged is not None:  # per-request verify lengths (host list, else the device tensor)
                src = ragged.verify_lens_cpu if ragged.verify_lens_cpu is not None else ragged.verify_lens
                q_lens = _host_ints(src, "ragged_verify_layout.verify_lens", bs)
                if any(n < 1 for n in q_lens):
                    raise ValueError(f"TorchCPUAttnBackend: ragged verify lengths must be >= 1 (the root), got {q_lens}")
            else:
                n = int(getattr(spec, "num_tokens_per_req", -1) or -1)
                if n <= 0:
                    n = int(spec.draft_token_num)
                if n <= 0:
                    raise ValueError(f"TorchCPUAttnBackend: TARGET_VERIFY needs draft_token_num >= 1, got {n}")
                q_lens = [n] * bs
            prefix_lens = seq_lens
            if getattr(spec, "custom_mask", None) is not None and not self.ignore_custom_mask:
                tree_flat = spec.custom_mask
        else:  # EXTEND, MIXED
            prefix_src = fb.extend_prefix_lens_cpu if fb.extend_prefix_lens_cpu is not None else fb.extend_prefix_lens
            q_src = fb.extend_seq_lens_cpu if fb.extend_seq_lens_cpu is not None else fb.extend_seq_lens
            prefix_lens = _host_ints(prefix_src, "extend_prefix_lens", bs)
            q_lens = _host_ints(q_src, "extend_seq_lens", bs)
            bad = [b for b in range(bs) if prefix_lens[b] + q_lens[b] != seq_lens[b]]
            if bad:
                raise ValueError(
                    f"TorchCPUAttnBackend: seq_lens must equal extend_prefix_lens + extend_seq_lens; "
                    f"request {bad[0]}: {seq_lens[bad[0]]} != {prefix_lens[bad[0]]} + {q_lens[bad[0]]}"
                )

        dev = fb.req_pool_indices.device
        q_max = max(q_lens, default=0)
        kv_max = max((p + q for p, q in zip(prefix_lens, q_lens)), default=0)
        q_len_t = torch.tensor(q_lens, dtype=torch.int64, device=dev)
        pre_t = torch.tensor(prefix_lens, dtype=torch.int64, device=dev)
        rows = torch.arange(bs, dtype=torch.int64, device=dev)
        num_tokens = sum(q_lens)
        # new token t belongs to request qb[t] at offset qi[t]
        qb = torch.repeat_interleave(rows, q_len_t)
        q_start = torch.cumsum(q_len_t, 0) - q_len_t
        qi = torch.arange(num_tokens, dtype=torch.int64, device=dev) - q_start[qb]
        # cached key j of request pb[j'] at offset pj
        pb = torch.repeat_interleave(rows, pre_t)
        p_start = torch.cumsum(pre_t, 0) - pre_t
        pj = torch.arange(int(pre_t.sum()), dtype=torch.int64, device=dev) - p_start[pb]
        req = fb.req_pool_indices.to(torch.int64)
        r2t = self.req_to_token_pool.req_to_token
        if kv_max > r2t.shape[1]:
            raise ValueError(
                f"TorchCPUAttnBackend: a request needs {kv_max} key slots, req_to_token rows hold {r2t.shape[1]}"
            )
        kv_prefix_src = r2t[req[pb], pj].to(torch.int64)

        tree_mask = None
        if tree_flat is not None:
            tree_mask = self._full_layout_mask(tree_flat, prefix_lens, q_lens, kv_max, dev)

        return _Plan(
            key=_plan_key(fb),
            mode=mode,
            bs=bs,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            q_max=q_max,
            kv_max=kv_max,
            num_tokens=num_tokens,
            q_dst=qb * q_max + qi,
            kv_new_dst=qb * kv_max + pre_t[qb] + qi,
            kv_prefix_dst=pb * kv_max + pj,
            kv_prefix_src=kv_prefix_src,
            tree_mask=tree_mask,
            _masks={},
        )

    @staticmethod
    def _full_layout_mask(flat: torch.Tensor, prefix_lens: list[int], q_lens: list[int], kv_max: int, dev) -> torch.Tensor:
        """bool [bs, q_max, kv_max] from SGLang's FULL custom mask (True = attend): request b's
        ``q_lens[b]`` rows of ``prefix_lens[b] + q_lens[b]`` bools; False past a row or a request's rows."""
        if flat.dim() != 1:
            raise ValueError(f"TorchCPUAttnBackend: spec_info.custom_mask must be 1-D (FULL layout), got shape {tuple(flat.shape)}")
        if flat.dtype != torch.bool and flat.dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"TorchCPUAttnBackend: spec_info.custom_mask must be bool (or uint8/int8), got {flat.dtype}")
        bs = len(prefix_lens)
        n = max(q_lens)
        pre = torch.tensor(prefix_lens, dtype=torch.int64, device=dev)
        q = torch.tensor(q_lens, dtype=torch.int64, device=dev)
        row_len = pre + q
        req_len = q * row_len
        need = int(req_len.sum())
        if flat.numel() < need:
            raise ValueError(
                f"TorchCPUAttnBackend: spec_info.custom_mask has {flat.numel()} entries; the FULL layout for "
                f"seq_lens {prefix_lens} and {q_lens} tokens per request needs {need} (sum of N_b * (seq_len_b + N_b))"
            )
        start = torch.cumsum(req_len, 0) - req_len
        i = torch.arange(n, device=dev).view(1, n, 1)
        j = torch.arange(kv_max, device=dev).view(1, 1, kv_max)
        inside = (j < row_len.view(bs, 1, 1)) & (i < q.view(bs, 1, 1))
        idx = start.view(bs, 1, 1) + i * row_len.view(bs, 1, 1) + j
        idx = torch.where(inside, idx, 0)
        mask = (flat.to(dev)[idx] != 0) & inside
        empty = ~mask.any(dim=2) & (i.view(1, n) < q.view(bs, 1))
        if bool(empty.any()):
            b, r = (int(x) for x in empty.nonzero()[0])
            raise ValueError(f"TorchCPUAttnBackend: spec_info.custom_mask row {r} of request {b} allows no key")
        return mask

    def _plan_for(self, forward_batch: ForwardBatch) -> _Plan:
        plan = self._plan
        key = _plan_key(forward_batch)
        if plan is None or len(plan.key) != len(key) or any(a is not b for a, b in zip(plan.key, key)):
            # a caller that skipped init_forward_metadata for this batch, or changed its fields
            self.init_forward_metadata(forward_batch)
            plan = self._plan
        return plan

    # ------------------------------------------------------------------ per layer
    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        """EXTEND, MIXED and TARGET_VERIFY (SGLang routes TARGET_VERIFY here); see the module doc."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kwargs):
        """DECODE: one new token per request; see the module doc."""
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _check_layer(self, layer, kwargs) -> None:
        extra = sorted(name for name, val in kwargs.items() if val is not None and val is not False)
        if extra:
            raise NotImplementedError(f"TorchCPUAttnBackend: attention arguments {extra} are not supported")
        if layer.is_cross_attention:
            raise NotImplementedError(f"TorchCPUAttnBackend: cross-attention (layer {layer.layer_id}) is not supported")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError(
                f"TorchCPUAttnBackend: sliding-window attention (layer {layer.layer_id}, "
                f"window {layer.sliding_window_size}) is not supported"
            )
        for name in ("k_scale_float", "v_scale_float"):
            s = getattr(layer, name, None)
            if s is not None and float(s) != 1.0:
                raise NotImplementedError(f"TorchCPUAttnBackend: scaled KV caches ({name}={s}) are not supported")
        if getattr(layer, "xai_temperature_len", -1) not in (None, -1) and layer.xai_temperature_len > 0:
            raise NotImplementedError("TorchCPUAttnBackend: xai_temperature_len is not supported")
        if layer.tp_q_head_num % layer.tp_k_head_num != 0:
            raise ValueError(
                f"TorchCPUAttnBackend: {layer.tp_q_head_num} query heads are not a multiple of "
                f"{layer.tp_k_head_num} KV heads (layer {layer.layer_id})"
            )
        if layer.logit_cap and layer.logit_cap > 0 and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            raise NotImplementedError(
                f"TorchCPUAttnBackend: logit capping method {layer.logit_capping_method!r} is not supported (only tanh)"
            )

    def _forward(self, q, k, v, layer, fb: ForwardBatch, save_kv_cache: bool, kwargs) -> torch.Tensor:
        self._check_layer(layer, kwargs)
        plan = self._plan_for(fb)
        hq, hkv = layer.tp_q_head_num, layer.tp_k_head_num
        dqk, dv = layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, hq, dqk)
        if q3.shape[0] != plan.num_tokens:
            raise ValueError(
                f"TorchCPUAttnBackend: q has {q3.shape[0]} tokens, the {plan.mode.name} batch has {plan.num_tokens} "
                f"(lengths {plan.q_lens})"
            )
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if k_buf.dim() != 3:
            raise NotImplementedError(
                f"TorchCPUAttnBackend: KV buffers must be [slots, heads, dim], got shape {tuple(k_buf.shape)}"
            )
        if (k is None) != (v is None):
            raise ValueError("TorchCPUAttnBackend: k and v must both be given or both be None")
        loc = fb.out_cache_loc
        if (k is None or save_kv_cache) and (loc is None or loc.shape[0] != plan.num_tokens):
            raise ValueError(
                f"TorchCPUAttnBackend: out_cache_loc must hold {plan.num_tokens} slots, "
                f"got {None if loc is None else loc.shape[0]}"
            )
        if k is not None:
            k3, v3 = k.reshape(-1, hkv, dqk), v.reshape(-1, hkv, dv)
            if k3.shape[0] != plan.num_tokens or v3.shape[0] != plan.num_tokens:
                raise ValueError(
                    f"TorchCPUAttnBackend: k/v have {k3.shape[0]}/{v3.shape[0]} tokens, q has {plan.num_tokens}"
                )
            if save_kv_cache:
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_layer(fb, layer), k3, v3)
        if k is None:  # the caller wrote them already: read them back
            k3, v3 = k_buf[loc], v_buf[loc]

        dtype = q3.dtype
        bs, qm, km = plan.bs, plan.q_max, plan.kv_max
        o = q3.new_empty((plan.num_tokens, hq * dv))
        if plan.num_tokens == 0:
            return o
        keys = q3.new_zeros((bs * km, hkv, dqk))
        vals = q3.new_zeros((bs * km, hkv, dv))
        keys.index_copy_(0, plan.kv_prefix_dst, k_buf.index_select(0, plan.kv_prefix_src).to(dtype))
        vals.index_copy_(0, plan.kv_prefix_dst, v_buf.index_select(0, plan.kv_prefix_src).to(dtype))
        keys.index_copy_(0, plan.kv_new_dst, k3.to(dtype))
        vals.index_copy_(0, plan.kv_new_dst, v3.to(dtype))
        queries = q3.new_zeros((bs * qm, hq, dqk))
        queries.index_copy_(0, plan.q_dst, q3)
        queries = queries.view(bs, qm, hq, dqk).transpose(1, 2)
        keys = keys.view(bs, km, hkv, dqk).transpose(1, 2)
        vals = vals.view(bs, km, hkv, dv).transpose(1, 2)

        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        mask = plan.mask(causal)
        if layer.logit_cap and layer.logit_cap > 0:
            out = _capped_attention(queries, keys, vals, mask, layer.scaling, float(layer.logit_cap))
        else:
            out = scaled_dot_product_attention(
                queries, keys, vals, attn_mask=mask, scale=layer.scaling, enable_gqa=hq != hkv
            )
        out = out.transpose(1, 2).reshape(bs * qm, hq * dv)
        torch.index_select(out, 0, plan.q_dst, out=o)
        return o


def _plan_key(fb: ForwardBatch) -> tuple:
    spec = fb.spec_info
    return (
        fb, fb.forward_mode, fb.seq_lens, fb.req_pool_indices, fb.extend_prefix_lens, fb.extend_prefix_lens_cpu,
        fb.extend_seq_lens, fb.extend_seq_lens_cpu, spec, getattr(spec, "custom_mask", None),
        getattr(spec, "ragged_verify_layout", None),
    )  # fmt: skip


def _capped_attention(q, k, v, mask, scale, cap):
    """Softmax attention with tanh-capped logits (cap * tanh(s / cap), s = scale * q.k), float32 math."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1).float()
    v = v.repeat_interleave(rep, dim=1).float()
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v).to(q.dtype)


def _factory(runner):
    return TorchCPUAttnBackend(runner)


_factory._sglang_tev_cpu_attention = True


def register_cpu_attention(name: str = DEFAULT_BACKEND_NAME) -> str:
    """Make SGLang build :class:`TorchCPUAttnBackend` for ``--attention-backend name``.

    Idempotent; call it in every SGLang process before server args are parsed (the sglang_tev
    plugin's ``register()`` runs in each one). Relies on these SGLang 0.5.23 lines, none edited:

    * ``srt/layers/attention/attention_registry.py:46-51`` ``register_attention_backend(name)``,
      the table ``_build_full_attention_backend_from_str``
      (``srt/model_executor/model_runner_components/attention_backend_setup.py:280-283``) builds
      every runner's backend from, the DFLASH draft runner's included;
    * ``srt/arg_groups/choices.py:225`` ``add_attention_backend_choices``, the list the
      ``--attention-backend`` / ``--prefill-attention-backend`` / ``--decode-attention-backend``
      argparse choices are (``srt/arg_groups/fields/exec_.py:211/219/239``);
    * ``srt/arg_groups/choices.py:227`` ``add_draft_attention_backend_choices``, the list that
      ``_resolve_dflash_draft_attention_backend`` (``srt/arg_groups/speculative_hook.py:894``)
      and ``resolve_draft_worker_attention_backend``
      (``srt/speculative/draft_worker_common.py:51``) accept draft backends from; without it a
      DFLASH-family draft falls back to FlashInfer.

    A ``name`` SGLang already registers (e.g. ``"triton"``) is taken over only for runners on a
    CPU device (``torch.device(runner.device).type == "cpu"``); other runners still get SGLang's
    own backend. Note that SGLang special-cases some names (``"torch_native"`` and ``"triton"``
    change CUDA-graph and kernel dispatch choices), so a new name is the clean choice.

    Args:
        name: the backend name, a non-empty str without whitespace.
    Returns:
        ``name``.
    Raises:
        ValueError naming ``name`` when it is not a non-empty str without whitespace.
    """
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"register_cpu_attention: name must be a non-empty str without whitespace, got {name!r}")
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
        add_draft_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    current = ATTENTION_BACKENDS.get(name)
    if current is None:
        register_attention_backend(name)(_factory)
    elif not getattr(current, "_sglang_tev_cpu_attention", False):
        original = current

        def cpu_or_original(runner):
            if torch.device(runner.device).type == "cpu":
                return TorchCPUAttnBackend(runner)
            return original(runner)

        cpu_or_original._sglang_tev_cpu_attention = True
        cpu_or_original.__wrapped__ = original
        register_attention_backend(name)(cpu_or_original)
    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])
    if name not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([name])
    return name
