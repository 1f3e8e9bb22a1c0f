"""The drafter a run starts from: warm-started from ``draft_init`` or freshly initialised (seeded)
with the target's dimensions, checked to fit the target."""

from __future__ import annotations

import os
from typing import Mapping

import torch

from ..draft.dflash import DFlashConfig, DFlashDraftModel, build_target_layer_ids
from .config import ConfigError, DraftArchConfig, TrainConfig
from .target import text_config

__all__ = ["build_drafter"]


def _mask_token_id(cfg: TrainConfig, tokenizer) -> int:
    if cfg.draft is not None and cfg.draft.mask_token_id is not None:
        return cfg.draft.mask_token_id
    mid = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mid is None:
        raise ConfigError("draft.mask_token_id", "is not set and the target's tokenizer has no "
                                                 "mask token; set it explicitly")
    return int(mid)


def build_drafter(cfg: TrainConfig, target, tokenizer) -> DFlashDraftModel:
    """The drafter to train, float32: warm-started from ``draft_init`` or freshly initialised.

    Fresh init (``draft:``): Qwen3 dims of the target unless overridden; Linear weights
    ~ N(0, init_std²) from a generator seeded by ``seed``, norms 1. DFlash2 (``draft.architecture:
    DFlash2DraftModel``): the convs start as the identity (``base_kernel`` tap 0 = 1, zero kernel
    projection) and the selector's ``successor_codebook`` at zero (scores = the unary logits; the
    predecessor codebook and hidden projection random), so step 0 drafts as the backbone alone.
    Raises ``ValueError`` naming the key when the drafter does not fit the target.
    """
    tcfg = text_config(target)
    if cfg.draft_init is not None:
        if not os.path.isdir(cfg.draft_init):
            raise FileNotFoundError(f"draft_init: no drafter directory at {cfg.draft_init!r}")
        try:
            draft = DFlashDraftModel.from_pretrained(cfg.draft_init, dtype=torch.float32)
            draft.validate_against_target(tcfg)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError("draft_init", str(e)) from None
        return draft
    arch = cfg.draft or DraftArchConfig()
    n_target = int(tcfg.num_hidden_layers)
    ids = arch.target_layer_ids or build_target_layer_ids(n_target, arch.num_hidden_layers)
    heads = arch.num_attention_heads or int(tcfg.num_attention_heads)
    fields = {
        "hidden_size": int(tcfg.hidden_size),
        "intermediate_size": arch.intermediate_size or int(tcfg.intermediate_size),
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": arch.num_key_value_heads or int(getattr(tcfg, "num_key_value_heads", None) or heads),
        "head_dim": arch.head_dim or int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads),
        "num_target_layers": n_target,
        "mask_token_id": _mask_token_id(cfg, tokenizer),
        "target_layer_ids": tuple(ids),
        "block_size": arch.block_size or cfg.block_size or 16,
        "rms_norm_eps": float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(tcfg),
        "max_position_embeddings": int(getattr(tcfg, "max_position_embeddings", 32768)),
        "vocab_size": int(tcfg.vocab_size),
        "architecture": arch.architecture,
        "conv_kernel_size": arch.conv_kernel_size,
        "conv_group_size": arch.conv_group_size,
        "selector_rank": arch.selector_rank,
        "selector_top_k": arch.selector_top_k,
        "output_multiplier": arch.output_multiplier,
        "final_logit_softcapping": arch.final_logit_softcapping,
    }
    try:
        dcfg = DFlashConfig(**fields)
        dcfg.validate_against_target(tcfg)
    except ValueError as e:
        raise ConfigError("draft", str(e)) from None
    draft = DFlashDraftModel(dcfg)
    g = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(".base_kernel"):  # DFlash2 conv: the identity (tap 0 = 1), as SGLang's init
                p.zero_()[:, 0] = 1.0
            elif name.endswith(("_conv.kernel_projection.weight", "successor_codebook")):
                # zero: the conv starts as the identity and the selector's scores as the unary logits
                # (the bilinear term is 0), so a fresh DFlash2 drafter drafts as its backbone
                p.zero_()
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * arch.init_std)
            else:
                p.fill_(1.0)
    return draft


def _rope_theta(tcfg) -> float:
    params = getattr(tcfg, "rope_parameters", None)
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(getattr(tcfg, "rope_theta", None) or 10000.0)
