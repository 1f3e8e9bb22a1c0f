"""A DFlash2 drafter with trained weights for tests and benchmarks: the shipped tiny-code drafter
re-dressed as a DFlash2 checkpoint (no DFlash2 checkpoint can be downloaded here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["DFLASH2_TEST_KEYS", "shipped_as_dflash2"]

DFLASH2_TEST_KEYS = dict(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=8,
                         output_multiplier=0.9, final_logit_softcapping=40.0)
"""The DFlash2 keys written into ``dflash_config`` (hidden size 256: 8 conv groups of 32)."""


def shipped_as_dflash2(out_dir, seed: int = 0):
    """The shipped tiny-code drafter (DFlash v1, trained) re-dressed as a ``DFlash2BeamDraftModel``
    checkpoint in z-lab's layout: its weights, a near-identity conv (small random taps and
    projections), a random selector (the model's own initialisation), a non-neutral but
    order-preserving logit transform (:data:`DFLASH2_TEST_KEYS`). Acceptance stays that of a
    trained drafter, so a runtime's positions, compaction and context gathering are exercised.

    Args:
        out_dir: folder to write ``draft2/`` into (created).
        seed: the conv's random taps and projections.
    Returns:
        (target dir, the DFlash2 draft dir, the float32 model written there).
    Raises:
        RuntimeError if the v1 weights do not cover every tensor but the conv and the selector.
    """
    from ..draft.dflash import DFlashConfig, DFlashDraftModel
    from ..hf.assets import ASSETS_DIR

    # the shipped DFlash (v1) drafter, not the default drafter (which is DFlash2 already)
    target_dir, draft_dir = Path(ASSETS_DIR) / "target", Path(ASSETS_DIR) / "draft"
    cfg = json.loads((Path(draft_dir) / "config.json").read_text())
    cfg["architectures"] = ["DFlash2BeamDraftModel"]
    cfg["dflash_config"].update(DFLASH2_TEST_KEYS)
    v1 = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32)
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    missing, unexpected = model.load_state_dict(v1.state_dict(), strict=False)
    if unexpected or not all("conv" in n or "candidate_selector" in n for n in missing):
        raise RuntimeError(f"re-dressing the shipped drafter: unexpected {unexpected}, missing {missing}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 1:].copy_(0.02 * torch.randn(conv.base_kernel[:, 1:].shape, generator=g))
                conv.kernel_projection.weight.copy_(0.002 * torch.randn(conv.kernel_projection.weight.shape, generator=g))
    out = Path(out_dir) / "draft2"
    model.save_pretrained(out)
    return Path(target_dir), out, model
