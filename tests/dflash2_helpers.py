"""The small DFlash2 configuration the DFlash2 tests share (tests/runtime/test_dflash2.py,
tests/srt/test_sglang_dflash2.py, tests/srt/test_srt_dflash2_head.py, tests/runtime/test_hf_dflash2.py):
its sizes and keys, a seeded random drafter (:func:`_ours`) and target, a drafter fitting the runtime
tests' qwen3, and the shipped drafter re-dressed as DFlash2."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel

V, MASK, H = 160, 159, 64
TARGET_LAYERS, LAYER_IDS, K = 4, [0, 2, 3], 6
TAPS, GROUP, RANK, TOPK = 4, 8, 8, 5
MULT, CAP = 0.7, 3.0
DIMS = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=V)
TOL = dict(rtol=1e-4, atol=1e-5)
DFLASH2 = dict(conv_kernel_size=TAPS, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOPK,
               output_multiplier=MULT, final_logit_softcapping=CAP)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "codebook" in name:  # large enough that the selector's bilinear term matters
                p.copy_(0.6 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return module.eval()


def _config_dict(arch="DFlash2DraftModel", top_level=False, **dflash2) -> dict:
    d2 = {**DFLASH2, **dflash2}
    cfg = {
        "architectures": [arch], "model_type": "qwen3", "hidden_act": "silu", "intermediate_size": 96,
        "num_hidden_layers": 2, "num_target_layers": TARGET_LAYERS, "block_size": K,
        "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS}, **DIMS,
    }
    (cfg if top_level else cfg["dflash_config"]).update({k: v for k, v in d2.items() if v is not None})
    return cfg


def _ours(seed: int = 2, **dflash2) -> DFlashDraftModel:
    return _randomize(DFlashDraftModel(DFlashConfig.from_dict(_config_dict(**dflash2))), seed)


def _target(seed: int = 1) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(intermediate_size=128, num_hidden_layers=TARGET_LAYERS, attn_implementation="sdpa", **DIMS)
    return _randomize(Qwen3ForCausalLM(cfg), seed, std=0.3)



def _runtime_dflash2(target, seed=3):
    """A random DFlash2 drafter fitting the runtime tests' qwen3 (hidden 48: 6 conv groups of 8)."""
    from sglang_tev.testing.models import dflash_for

    tc = target.config
    return dflash_for(target, seed=seed, block_size=6, num_hidden_layers=2, architectures=["DFlash2DraftModel"],
                      dflash_config=dict(mask_token_id=tc.vocab_size - 1, target_layer_ids=[0, tc.num_hidden_layers - 1],
                                         conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=4,
                                         output_multiplier=0.8, final_logit_softcapping=2.5))


def _shipped_as_dflash2(tmp_path):
    """The shipped drafter re-dressed as DFlash2 (``sglang_tev.testing.dflash2``)."""
    from sglang_tev.testing.dflash2 import shipped_as_dflash2

    return shipped_as_dflash2(tmp_path)
