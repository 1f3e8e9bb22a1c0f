"""A tiny random target + DFlash drafter pair on disk, for the CLI and bench tests, and
:func:`plain_greedy`, the plain-decoding reference of the runtime tests.

Target: ``Qwen3ForCausalLM`` (hidden 64, 4 layers, vocab 320, 256 positions by default) with a real byte-level
BPE tokenizer (``tokenizers``, ~300 tokens trained on stdlib source) and an optional chat template.
Drafter: a random ``DFlashDraftModel`` (2 layers, block size 4) fitting that target.
Random weights: outputs are arbitrary but deterministic; acceptance is near zero.
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import torch

from sglang_tev.testing.models import plain_greedy  # noqa: F401  (re-exported: the tests import it from here)

EOS, MASK = "<|endoftext|>", "<|mask|>"
VOCAB, HIDDEN, LAYERS, MAX_POS, BLOCK = 320, 64, 4, 256, 4


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(out: Path, chat_template: str | None = CHAT_TEMPLATE, max_positions: int = MAX_POS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    lines = inspect.getsource(textwrap).splitlines(keepends=True)[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK,
                                   clean_up_tokenization_spaces=False, model_max_length=max_positions)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def build_pair(root: Path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0,
               max_positions: int = MAX_POS) -> tuple[Path, Path]:
    """Write ``root/target`` (model + tokenizer) and ``root/draft``; return both paths.

    HumanEval prompts are 94-1044 tokens with this tokenizer (HumanEval/0, /1: 298, 388), so
    benchmarks on them need ``max_positions`` 512 or more.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel

    target, draft = Path(root) / "target", Path(root) / "draft"
    tok = build_tokenizer(target, chat_template, max_positions)
    assert len(tok) <= VOCAB
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger than HF's 0.02 init so the outputs are not all near-uniform
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(target)
    dcfg = DFlashConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": max_positions,
        "vocab_size": VOCAB, "block_size": BLOCK, "num_target_layers": LAYERS,
        "dflash_config": {"mask_token_id": tok.mask_token_id, "target_layer_ids": [0, 2]},
    })
    DFlashDraftModel(dcfg).save_pretrained(draft)
    return target, draft
