"""The training tier: the trainer, ExitTrain, the experiment driver and the shipped pair's build
(marked ``train`` by tests/conftest.py). Fixtures shared by the modules of this folder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from train_helpers import EOS, LAYERS, H, V


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``root/target`` (random Qwen3, no tokenizer: EOS from its config) and ``root/train.npy``:
    documents cycling one 4-token pattern from a random phase, joined by EOS."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=EOS,
                      pad_token_id=EOS, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(root / "target")
    rng = np.random.default_rng(0)
    pattern = np.array([10, 20, 30, 40])
    toks = []
    for _ in range(30):
        n, phase = int(rng.integers(40, 90)), int(rng.integers(0, 4))
        toks += list(np.resize(np.roll(pattern, phase), n)) + [EOS]
    np.save(root / "train.npy", np.asarray(toks, dtype=np.uint16))
    return root
