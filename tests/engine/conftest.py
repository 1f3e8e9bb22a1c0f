"""The Engine / HTTP-server tier: SGLang 0.5.23's real Engine and server on this CPU, each in a
child process with the CPU harness (:mod:`sglang_tev.testing.sglang_cpu`). Every test here is
marked ``engine``, ``sglang`` and ``slow`` (tests/conftest.py, by folder). Fixtures shared by the
modules of this folder (module scope: each module builds its own)."""

from __future__ import annotations

import pytest
from engine_checks import MAX_NEW, PROMPTS

from sglang_tev.testing.sglang_cpu.hosts import TARGET, EnginePool, hf_greedy_ids, hf_target

@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_model():
    return hf_target()


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids, hf_model):
    """HF transformers greedy decoding, one prompt at a time (no padding), bf16."""
    return hf_greedy_ids(hf_model, prompt_ids, MAX_NEW)


@pytest.fixture(scope="module")
def hosts():
    h = EnginePool()
    yield h
    h.close_all()

