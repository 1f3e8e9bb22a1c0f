"""`SpeculativeGenerator.from_pretrained`: the shipped pair by name, and a quiet stderr."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from sglang_tev.hf import assets
from sglang_tev.hf.runtime import SpeculativeGenerator

SHIPPED = Path(__file__).resolve().parents[2] / "sglang_tev" / "assets" / "tiny-code"
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def explicit():
    return SpeculativeGenerator.from_pretrained(SHIPPED / "target", SHIPPED / "draft2", device="cpu")


def test_shipped_pair_by_default_and_by_name(explicit):
    want = explicit.generate(PROMPT, budget=16, max_new_tokens=24).token_ids
    for args in [(), ("tiny-code",)]:
        gen = SpeculativeGenerator.from_pretrained(*args, device="cpu")
        assert gen.drafter is not None and gen.tokenizer is not None
        assert gen.config._name_or_path == str(SHIPPED / "target")
        assert gen.generate(PROMPT, budget=16, max_new_tokens=24).token_ids == want
    assert assets.shipped_pair() == (SHIPPED / "target", SHIPPED / "draft2")


def test_shipped_target_with_another_drafter_or_none(tmp_path):
    gen = SpeculativeGenerator.from_pretrained("tiny-code", SHIPPED / "draft", device="cpu")
    assert gen.drafter is not None
    gen = SpeculativeGenerator.from_pretrained("tiny-code", False, device="cpu")  # False: no drafter
    assert gen.drafter is None
    with pytest.raises(FileNotFoundError, match="draft: no model directory at"):
        SpeculativeGenerator.from_pretrained("tiny-code", tmp_path / "nope", device="cpu")


def test_a_local_directory_named_like_the_pair_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-code").mkdir()  # not a model: the local path is taken, as HF does, and refused
    with pytest.raises(ValueError, match="target: cannot load a causal LM from 'tiny-code'"):
        SpeculativeGenerator.from_pretrained("tiny-code", None, device="cpu")


def test_missing_shipped_pair_says_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "ASSETS_DIR", tmp_path / "tiny-code")
    with pytest.raises(FileNotFoundError, match="the shipped model pair is not installed at .*pass target="):
        SpeculativeGenerator.from_pretrained()


@pytest.mark.parametrize("enabled", [True, False])
def test_no_weight_loading_progress_bars(capfd, enabled):
    """transformers' 'Loading weights' bar stays off stderr; the caller's setting is restored."""
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        capfd.readouterr()
        SpeculativeGenerator.from_pretrained(SHIPPED / "target", SHIPPED / "draft", device="cpu")
        err = capfd.readouterr().err
        assert "Loading weights" not in err and "%|" not in err, err
        assert hf_logging.is_progress_bar_enabled() is enabled
    finally:
        hf_logging.enable_progress_bar()
