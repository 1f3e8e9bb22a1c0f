"""The runtime tests' small random model pair — a Qwen3 target and a DFlash drafter fitting it,
float32, seeded — with their ragged prompts, and :func:`plain_greedy`, the plain-decoding
reference every speculative output is compared to (tests/test_hf_*.py, scripts/gpu_check.py)."""

from __future__ import annotations

import torch

__all__ = ["V", "RAGGED", "randomize", "qwen3", "dflash_for", "plain_greedy"]

V = 96
# ragged prompts (lengths 5, 11, 1, 17) of the batched runtime tests
RAGGED = [[3, 17, 29, 41, 5], [60, 2, 2, 9, 33, 71, 80, 14, 1, 44, 12], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]


def randomize(module, seed, std=0.3):
    """Every parameter redrawn from a generator seeded by ``seed``: norm weights 1 + 0.1·N(0, 1), the
    rest std·N(0, 1); returns the module in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight") else std * torch.randn(p.shape, generator=g))
    return module.eval()


def qwen3(seed=0, vocab=V, layers=3, max_pos=512):
    """A random ``Qwen3ForCausalLM`` (hidden 48, 4/2 heads of 12, untied head, sdpa)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, max_position_embeddings=max_pos, attn_implementation="sdpa", tie_word_embeddings=False)
    return randomize(Qwen3ForCausalLM(cfg), seed)


def dflash_for(target, seed=1, block_size=6, **over):
    """A random one-layer DFlash drafter fitting ``target`` (z-lab config keys; ``over`` overrides
    them); mask token ``vocab - 1``, target layers ``[0, last]``."""
    from ..draft.dflash import DFlashConfig, DFlashDraftModel

    tc = target.config
    d = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=tc.hidden_size, intermediate_size=64,
             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
             rope_theta=10000.0, max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size,
             block_size=block_size, num_target_layers=tc.num_hidden_layers,
             dflash_config=dict(mask_token_id=tc.vocab_size - 1, target_layer_ids=[0, tc.num_hidden_layers - 1]))
    d.update(over)
    return randomize(DFlashDraftModel(DFlashConfig.from_dict(d)), seed)


def plain_greedy(model, prompt, n, stops=()) -> list[int]:
    """Reference: plain target greedy decoding with a DynamicCache on the model's device; the ``n``
    new ids (fewer when a token of ``stops`` comes first, which is kept)."""
    from transformers import DynamicCache

    from ..compat import cache_kwargs

    out = []
    dev = next(model.parameters()).device
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([list(prompt)], device=dev), **cache_kwargs(model, cache)).logits[0, -1]
        for _ in range(n):
            t = int(logits.argmax())
            out.append(t)
            if t in stops:
                break
            logits = model(torch.tensor([[t]], device=dev), **cache_kwargs(model, cache)).logits[0, -1]
    return out
