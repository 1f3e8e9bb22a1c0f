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


# ---------------------------------------------------------------------- the default dtype
def _checkpoint(tmp_path, stored: str | None) -> Path:
    """A target directory whose config.json stores ``stored`` as its dtype (None: no dtype)."""
    import json

    cfg = json.loads((SHIPPED / "target" / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    if stored is not None:
        cfg["dtype"] = stored
    d = tmp_path / f"t-{stored}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("stored,flags,want", [
    ("bfloat16", ["avx512_bf16"], "bfloat16"),
    ("bfloat16", ["amx_bf16", "avx512_bf16"], "bfloat16"),
    ("float16", ["amx_bf16"], "bfloat16"),
    ("bfloat16", [], "float32"),      # no native bf16: every bf16 GEMM converts, float32 is faster
    ("float32", ["avx512_bf16"], "float32"),
    (None, ["avx512_bf16"], "float32"),
])
def test_default_dtype_on_cpu_follows_the_checkpoint_where_the_cpu_has_native_bf16(tmp_path, monkeypatch,
                                                                                   stored, flags, want):
    import torch

    from sglang_tev import machine
    from sglang_tev.hf.runtime import default_dtype

    monkeypatch.setattr(machine, "cpu_bf16_flags", lambda: list(flags))
    assert default_dtype(_checkpoint(tmp_path, stored), torch.device("cpu")) == getattr(torch, want)
    assert default_dtype(SHIPPED / "target", torch.device("cuda")) == torch.bfloat16
    # an unreadable config is the loader's error to give, not this function's
    assert default_dtype(tmp_path / "nowhere", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("flags", [[], ["avx512_bf16"]])
def test_from_pretrained_loads_both_models_in_the_default_dtype(monkeypatch, flags):
    import torch

    from sglang_tev import machine

    monkeypatch.setattr(machine, "cpu_bf16_flags", lambda: list(flags))
    gen = SpeculativeGenerator.from_pretrained(device="cpu")  # the shipped pair is stored in bf16
    want = torch.bfloat16 if flags else torch.float32
    assert gen.target.dtype == want
    assert {p.dtype for p in gen.drafter.model.parameters()} == {want}
    # an explicit dtype wins over the default
    gen = SpeculativeGenerator.from_pretrained(device="cpu", dtype=torch.float32)
    assert gen.target.dtype == torch.float32


@pytest.mark.parametrize("stored", ["bf16", "torch.bfloat16", "auto"])
def test_default_dtype_reads_float32_for_a_dtype_transformers_cannot_read(tmp_path, monkeypatch, stored):
    """transformers raises on such a config (AttributeError); the default is float32 and the loader
    then gives its own error. A device given as a string is read as one."""
    import torch

    from sglang_tev import machine
    from sglang_tev.hf.runtime import default_dtype

    monkeypatch.setattr(machine, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    assert default_dtype(_checkpoint(tmp_path, stored), "cpu") == torch.float32
    assert default_dtype(SHIPPED / "target", "cpu") == torch.bfloat16
