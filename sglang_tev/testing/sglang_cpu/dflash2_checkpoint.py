"""Random DFlash2 checkpoints for the SGLang Engine tests (tests only; nothing here imports sglang).

:func:`write_shipped_as_dflash2` re-dresses the shipped tiny-code drafter (DFlash v1, trained on the
tiny-code target) as a DFlash2 checkpoint in z-lab's layout, as ``tests/runtime/test_dflash2.py``
``_shipped_as_dflash2`` does for the transformers runtime: its trained weights, a near-identity
grouped conv (small random taps and projections), a random candidate selector whose bilinear term
is large enough to reorder the candidates, and a non-neutral but order-preserving logit transform.
The drafter stays a trained one (trees get accepted), while the selector makes its lattice law
differ from its marginals.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel
from sglang_tev.hf.assets import ASSETS_DIR

ASSETS = ASSETS_DIR
DRAFT = ASSETS / "draft"

DFLASH2_KEYS = dict(conv_kernel_size=3, conv_group_size=32, selector_rank=8, selector_top_k=8,
                    output_multiplier=0.9, final_logit_softcapping=40.0)
"""The DFlash2 keys written into ``dflash_config`` (hidden size 256: 8 conv groups of 32)."""


def write_shipped_as_dflash2(path, *, architecture: str = "DFlash2DraftModel", seed: int = 0,
                             codebook_std: float = 0.6, extra_config: dict | None = None, **keys) -> Path:
    """Write the shipped drafter re-dressed as DFlash2 to ``path`` (created); returns ``path``.

    Args:
        path: output folder (``config.json`` + ``model.safetensors``, z-lab's names).
        architecture: ``architectures[0]`` written to the config; ``DFlashDraftModel`` with
            ``selector_rank=None`` gives a DFlash2-style drafter without a selector (conv and
            transform only: the selector keys and tensors are left out).
        seed: the random conv taps / projections / selector.
        codebook_std: std of the selector's predecessor / successor codebooks.
        extra_config: more ``dflash_config`` entries written verbatim (e.g. a key TEV refuses).
        **keys: overrides of :data:`DFLASH2_KEYS`; a value None drops the key.
    """
    path = Path(path)
    cfg = json.loads((DRAFT / "config.json").read_text())
    # ours parses DFlash2 keys only under a DFlash2 architecture; the requested one is written after
    cfg["architectures"] = ["DFlash2DraftModel"]
    d2 = {**DFLASH2_KEYS, **keys}
    drop_selector = d2.get("selector_rank") is None
    if drop_selector:  # ours needs a selector under a DFlash2 architecture: built, then removed below
        d2.update(selector_rank=DFLASH2_KEYS["selector_rank"], selector_top_k=DFLASH2_KEYS["selector_top_k"])
    cfg["dflash_config"].update({k: v for k, v in d2.items() if v is not None})
    v1 = DFlashDraftModel.from_pretrained(DRAFT, dtype=torch.float32)
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    missing, unexpected = model.load_state_dict(v1.state_dict(), strict=False)
    assert not unexpected and all("conv" in n or "candidate_selector" in n for n in missing), (missing, unexpected)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is None:
                    continue
                conv.base_kernel[:, 1:].copy_(0.02 * torch.randn(conv.base_kernel[:, 1:].shape, generator=g))
                conv.kernel_projection.weight.copy_(0.002 * torch.randn(conv.kernel_projection.weight.shape, generator=g))
        sel = getattr(model, "candidate_selector", None)
        if sel is not None:
            for name, p in sel.named_parameters():
                std = codebook_std if "codebook" in name else 0.15
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    c = json.loads((path / "config.json").read_text())
    c["architectures"] = [architecture]
    if drop_selector:
        from safetensors.torch import load_file, save_file

        for key in ("selector_rank", "selector_top_k"):
            c["dflash_config"].pop(key, None)
            c.pop(key, None)
        weights = load_file(str(path / "model.safetensors"))
        save_file({k: v for k, v in weights.items() if not k.startswith("candidate_selector.")},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
    c.setdefault("dflash_config", {}).update(extra_config or {})
    (path / "config.json").write_text(json.dumps(c, indent=2))
    return path
