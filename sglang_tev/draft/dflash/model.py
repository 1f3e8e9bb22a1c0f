"""The DFlash drafter module, :class:`DFlashDraftModel` (z-lab ``DFlashDraftModel``,
``dflash/model.py``): the layer stack, its forward paths and checkpoint loading / saving.

* :meth:`~DFlashDraftModel.forward` — one block against the cached context (appends the new
  context K/V to a :class:`~sglang_tev.draft.dflash.cache.DFlashDraftCache`);
* :meth:`~DFlashDraftModel.draft_logits` / :meth:`~DFlashDraftModel.draft_lattice` — one round's
  per-depth draft logits (and DFlash2's selector lattice) through the target's embedding and LM head;
* :meth:`~DFlashDraftModel.forward_train` — many blocks against one teacher-forced context,
  under :func:`~sglang_tev.draft.dflash.inputs.block_train_mask`;
* :meth:`~DFlashDraftModel.from_pretrained` / :meth:`~DFlashDraftModel.save_pretrained` — the
  z-lab checkpoint (files: :mod:`sglang_tev.draft.dflash.io`).

Letters: b batch, K block size, T context tokens, H hidden size, V vocabulary,
n = len(target_layer_ids).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..dflash2 import CandidateSelector, SelectorLattice, transform_logits
from .cache import DFlashDraftCache
from .config import DFlashConfig
from .inputs import extract_context_features
from .io import WEIGHTS_NAME, read_checkpoint, write_checkpoint
from .layers import DFlashDecoderLayer, RMSNorm, _rope

__all__ = ["DFlashDraftModel"]


def _positions(pos: torch.Tensor, b: int, t: int, name: str, device: torch.device) -> torch.Tensor:
    """Broadcast ``(t,)`` or ``(b, t)`` integer positions to int64 ``(b, t)``."""
    if not isinstance(pos, torch.Tensor) or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor of shape ({t},) or ({b}, {t})")
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[1] != t or pos.shape[0] not in (1, b):
        raise ValueError(f"{name}: expected shape ({t},) or ({b}, {t}), got {tuple(pos.shape)}")
    return pos.to(device=device, dtype=torch.long).expand(b, t)


class DFlashDraftModel(nn.Module):
    """DFlash drafter (z-lab ``DFlashDraftModel``, ``dflash/model.py``) with z-lab tensor names.

    Parameters (exactly the safetensors names): ``layers.{i}.{input_layernorm,
    post_attention_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``fc.weight (H, n*H)``, ``hidden_norm.weight``, ``norm.weight``.

    DFlash2 (``config.is_dflash2``) adds ``layers.{i}.{attention,mlp}_conv.base_kernel
    (2, taps, H)`` and ``layers.{i}.{attention,mlp}_conv.kernel_projection.weight (2*taps*G, H)``
    when ``conv_kernel_size`` is set, and ``candidate_selector.{predecessor,successor}_codebook
    (V, r)`` + ``candidate_selector.hidden_projection.weight (r, H)``
    (:mod:`sglang_tev.draft.dflash2`); its draft logits go through the logit transform.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if config.selector_rank is not None:
            self.candidate_selector = CandidateSelector(H, config.vocab_size, config.selector_rank,
                                                        config.selector_top_k)

    # -- conveniences -------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def new_cache(self) -> DFlashDraftCache:
        """An empty context cache for this drafter."""
        return DFlashDraftCache(self.config.num_hidden_layers)

    def validate_against_target(self, target_config: Any) -> None:
        """See :meth:`DFlashConfig.validate_against_target`."""
        self.config.validate_against_target(target_config)

    def extract_context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """:func:`extract_context_features` with this drafter's ``target_layer_ids``."""
        return extract_context_features(hidden_states, self.config.target_layer_ids)

    # -- forward paths ------------------------------------------------------------------------
    def _project_context(self, ctx_features: torch.Tensor, ctx_positions: torch.Tensor,
                         b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V ``(b, kv_heads, T, d)`` of ``ctx_features (b, T, n*H)``."""
        n_in = self.fc.in_features
        if ctx_features.dim() != 3 or ctx_features.shape[0] != b or ctx_features.shape[2] != n_in:
            raise ValueError(f"ctx_features: expected ({b}, T, {n_in}), got "
                             f"{tuple(ctx_features.shape)}")
        dtype = self.fc.weight.dtype
        pos = _positions(ctx_positions, b, ctx_features.shape[1], "ctx_positions",
                         ctx_features.device)
        ctx = self.hidden_norm(self.fc(ctx_features.to(dtype)))  # [b, T, H], shared by all layers
        cos, sin = _rope(pos, self.config.head_dim, self.config.rope_theta, dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, ctx_features: torch.Tensor | None, ctx_positions: torch.Tensor | None,
                block_embeds: torch.Tensor, block_positions: torch.Tensor,
                cache: DFlashDraftCache | None = None) -> torch.Tensor:
        """One draft forward over a block, appending the new context to ``cache``.

        Parameters
        ----------
        ctx_features : ``(b, T_new, n*H)`` target features of the context tokens not yet cached
            (:func:`extract_context_features`), or None / ``T_new = 0`` for none.
        ctx_positions : int ``(T_new,)`` or ``(b, T_new)`` absolute positions of those tokens
            (normally ``cache.length + arange(T_new)``); ignored when ``ctx_features`` is None.
        block_embeds : ``(b, K, H)`` target embeddings of the block tokens.
        block_positions : int ``(K,)`` or ``(b, K)`` absolute positions of the block.
        cache : context cache; the new context K/V are appended (it then holds the context
            only), the block K/V are used transiently. None: attend to the new context only.

        Returns ``(b, K, H)`` final-normed hidden states, in the drafter's dtype (inputs are cast
        to it). Raises ``ValueError`` naming the argument on shape mismatches.
        """
        if block_embeds.dim() != 3 or block_embeds.shape[2] != self.config.hidden_size:
            raise ValueError(f"block_embeds: expected (b, K, {self.config.hidden_size}), got "
                             f"{tuple(block_embeds.shape)}")
        b, K, _ = block_embeds.shape
        dtype = self.fc.weight.dtype
        new_kv = None
        if ctx_features is not None and ctx_features.shape[1] > 0:
            new_kv = self._project_context(ctx_features, ctx_positions, b)
        if cache is not None:
            if new_kv is not None:
                cache.extend(new_kv)
            past = [cache.layer(i) for i in range(len(self.layers))]
        else:
            past = new_kv if new_kv is not None else [(None, None)] * len(self.layers)
        pos = _positions(block_positions, b, K, "block_positions", block_embeds.device)
        cos, sin = _rope(pos, self.config.head_dim, self.config.rope_theta, dtype)
        h = block_embeds.to(dtype)
        for layer, (past_k, past_v) in zip(self.layers, past):
            h = layer(h, cos, sin, past_k, past_v, block_len=K)
        return self.norm(h)

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """DFlash2's logit transform (``output_multiplier``, then ``final_logit_softcapping``) on
        draft logits of any shape; the identity for DFlash v1. See
        :func:`sglang_tev.draft.dflash2.transform_logits`."""
        return transform_logits(logits, self.config.output_multiplier, self.config.final_logit_softcapping)

    def draft_logits(self, target_embed: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                     target_lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                     root_tokens: torch.Tensor, root_pos: int | torch.Tensor,
                     new_ctx_features: torch.Tensor | None, cache: DFlashDraftCache | None,
                     block_size: int | None = None) -> torch.Tensor:
        """Per-depth draft logits of one round (z-lab ``dflash_generate`` draft step).

        Builds the block ``[root, MASK x (K-1)]`` at positions ``root_pos .. root_pos + K - 1``,
        embeds it with the target embedding, runs :meth:`forward` (appending
        ``new_ctx_features`` at positions ``root_pos - T_new .. root_pos - 1``) and applies the
        target LM head to slots ``1 .. K-1``.

        Parameters
        ----------
        target_embed : target token embedding (e.g. ``target.model.embed_tokens``).
        target_lm_head : target LM head (e.g. ``target.lm_head``).
        root_tokens : int64 ``(b,)`` the last committed token (not yet seen by the target).
        root_pos : int or int64 ``(b,)`` position of the root (= committed length).
        new_ctx_features : ``(b, T_new, n*H)`` features of the committed tokens not yet in
            ``cache`` (the previous round's accepted path, root included), or None.
        cache : context cache; after the call it holds positions ``[0, root_pos)``.
        block_size : K (default ``config.block_size``); smaller near ``max_new_tokens``.

        Returns float32 ``(b, K-1, V)``: row ``j`` = draft logits of depth ``j + 1`` at
        position ``root_pos + j + 1`` (DFlash2: after :meth:`transform_logits`, on the full
        vocabulary, as z-lab ``compute_logits``). Raises ``ValueError`` naming the argument on bad
        shapes, ``block_size < 2``, or (for an int ``root_pos``) ``cache.length + T_new != root_pos``.
        No host sync. Call under ``torch.inference_mode()`` when no gradient is wanted.
        """
        hidden = self._draft_hidden(target_embed, root_tokens, root_pos, new_ctx_features, cache, block_size)
        return self._head(target_lm_head, hidden)

    def _head(self, target_lm_head, hidden: torch.Tensor) -> torch.Tensor:
        head_w = getattr(target_lm_head, "weight", None)
        if isinstance(head_w, torch.Tensor):
            hidden = hidden.to(head_w.dtype)
        return self.transform_logits(target_lm_head(hidden).float())

    def draft_lattice(self, target_embed: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                      target_lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                      root_tokens: torch.Tensor, root_pos: int | torch.Tensor,
                      new_ctx_features: torch.Tensor | None, cache: DFlashDraftCache | None,
                      block_size: int | None = None) -> tuple[torch.Tensor, SelectorLattice]:
        """One DFlash2 round's draft: (transformed logits float32 ``(b, K-1, V)``, the selector's
        :class:`~sglang_tev.draft.dflash2.SelectorLattice` over slots 1 .. K-1 with the root as
        slot 0's predecessor). Arguments and errors as :meth:`draft_logits`; also ``ValueError``
        when the drafter has no selector. Reference: z-lab ``dflash_generate`` draft step +
        ``DFlash2DraftModel.propose``."""
        if self.config.selector_rank is None:
            raise ValueError("draft_lattice: this drafter has no candidate selector (DFlash v1)")
        hidden = self._draft_hidden(target_embed, root_tokens, root_pos, new_ctx_features, cache, block_size)
        logits = self._head(target_lm_head, hidden)
        return logits, self.candidate_selector.lattice(hidden, logits, root_tokens)

    def _draft_hidden(self, target_embed, root_tokens, root_pos, new_ctx_features, cache,
                      block_size) -> torch.Tensor:
        """Final-normed hidden states ``(b, K-1, H)`` of slots 1 .. K-1 (see :meth:`draft_logits`)."""
        K = self.config.block_size if block_size is None else block_size
        if isinstance(K, bool) or not isinstance(K, int) or K < 2:
            raise ValueError(f"block_size: must be an int >= 2, got {block_size!r}")
        if root_tokens.dim() != 1 or root_tokens.dtype != torch.long:
            raise ValueError(f"root_tokens: expected int64 (b,), got {root_tokens.dtype} "
                             f"{tuple(root_tokens.shape)}")
        b, dev = root_tokens.shape[0], root_tokens.device
        t_new = 0 if new_ctx_features is None else new_ctx_features.shape[1]
        if isinstance(root_pos, torch.Tensor):
            if root_pos.shape != (b,):
                raise ValueError(f"root_pos: expected an int or shape ({b},), got "
                                 f"{tuple(root_pos.shape)}")
            base = root_pos.to(device=dev, dtype=torch.long)[:, None]
        else:
            cached = cache.length if cache is not None else 0
            if isinstance(root_pos, bool) or not isinstance(root_pos, int) or \
                    root_pos != cached + t_new:
                raise ValueError(f"root_pos: {root_pos!r} must equal the cached context length "
                                 f"({cached}) + new context tokens ({t_new})")
            base = torch.full((1, 1), root_pos, device=dev, dtype=torch.long)
        block_ids = torch.full((b, K), self.config.mask_token_id, device=dev, dtype=torch.long)
        block_ids[:, 0] = root_tokens
        block_pos = base + torch.arange(K, device=dev)  # [b or 1, K]
        ctx_pos = base - t_new + torch.arange(t_new, device=dev)  # [b or 1, T_new]
        hidden = self.forward(new_ctx_features, ctx_pos, target_embed(block_ids), block_pos, cache)
        return hidden[:, 1:]

    def forward_train(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor,
                      block_positions: torch.Tensor, attn_mask: torch.Tensor,
                      ctx_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence training forward: many blocks against one teacher-forced context.

        Parameters
        ----------
        ctx_features : ``(b, S, n*H)`` target features of the whole sequence.
        block_embeds : ``(b, M, H)`` target embeddings of the concatenated blocks
            (``M = n_blocks * K``; block ``i`` = ``[x_a, MASK x (K-1)]`` for its anchor ``a``).
        block_positions : int ``(b, M)`` (block ``i``: ``a .. a + K - 1``).
        attn_mask : bool ``(b or 1, M, S + M)`` (True = attend) or additive float, over keys
            ``[context S | blocks M]``; :func:`block_train_mask` builds the DFlash one.
        ctx_positions : int ``(S,)`` or ``(b, S)``; default ``arange(S)``.

        Returns ``(b, M, H)`` final-normed hidden states (apply the target LM head to slots
        ``1..K-1`` of each block). Differentiable; no cache involved. With DFlash2's conv the
        blocks are ``config.block_size`` tokens each (the conv restarts at each); ``ValueError``
        (argument ``block_embeds``) when ``M`` is not a multiple of it.
        """
        if ctx_features.dim() != 3:
            raise ValueError(f"ctx_features: expected (b, S, n*H), got {tuple(ctx_features.shape)}")
        b, s, _ = ctx_features.shape
        if block_embeds.dim() != 3 or block_embeds.shape[0] != b:
            raise ValueError(f"block_embeds: expected ({b}, M, H), got {tuple(block_embeds.shape)}")
        m = block_embeds.shape[1]
        if self.config.conv_kernel_size is not None and m % self.config.block_size:
            raise ValueError(f"block_embeds: M={m} is not a multiple of block_size="
                             f"{self.config.block_size} (the DFlash2 conv runs per block)")
        if attn_mask.dim() != 3 or attn_mask.shape[0] not in (1, b) or \
                tuple(attn_mask.shape[1:]) != (m, s + m):
            raise ValueError(f"attn_mask: expected ({b} or 1, {m}, {s + m}), got "
                             f"{tuple(attn_mask.shape)}")
        if ctx_positions is None:
            ctx_positions = torch.arange(s, device=ctx_features.device)
        dtype = self.fc.weight.dtype
        ctx_kv = self._project_context(ctx_features, ctx_positions, b)
        pos = _positions(block_positions, b, m, "block_positions", block_embeds.device)
        cos, sin = _rope(pos, self.config.head_dim, self.config.rope_theta, dtype)
        mask = attn_mask[:, None]  # [b, 1, M, S+M]: same mask for every head
        if mask.dtype != torch.bool:
            mask = mask.to(dtype)
        h = block_embeds.to(dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask, block_len=self.config.block_size)
        return self.norm(h)


    # -- checkpoint I/O -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> "DFlashDraftModel":
        """Load a z-lab layout checkpoint (``config.json`` + ``model.safetensors``).

        ``dtype`` None keeps the stored dtype. Raises ``FileNotFoundError`` (argument ``path``)
        when the directory or either file is missing; ``ValueError`` naming the key/tensor for
        invalid config keys, missing/unexpected/misshapen tensors, or a non-float ``dtype``.
        """
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype: expected a floating torch.dtype or None, got {dtype!r}")
        config, state = read_checkpoint(path)
        with torch.device("meta"):  # no random init of weights that are overwritten anyway
            model = cls(config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{WEIGHTS_NAME}: missing tensors {missing}, unexpected tensors "
                             f"{unexpected}")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"{WEIGHTS_NAME}: tensor {name!r} has shape "
                                 f"{tuple(state[name].shape)}, expected {shape}")
            if not state[name].dtype.is_floating_point:
                raise ValueError(f"{WEIGHTS_NAME}: tensor {name!r} has dtype {state[name].dtype}")
        model.load_state_dict(state, strict=True, assign=True)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        return model.eval()

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` + ``model.safetensors`` (z-lab names) atomically.

        Both files are written to a temporary directory beside ``path`` and renamed into place;
        an existing checkpoint at ``path`` is replaced only after the new one is complete (on
        failure the old one is left intact and the temporary directory removed). Raises
        ``FileNotFoundError`` if the parent directory is missing and ``ValueError`` if ``path`` is
        a file or a directory holding files other than a checkpoint (never deleted).
        (:func:`sglang_tev.draft.dflash.io.write_checkpoint`; ``config.json`` records the
        weights' dtype.)
        """
        write_checkpoint(path, self.config, self.state_dict(), self.fc.weight.dtype)
