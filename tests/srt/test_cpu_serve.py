"""``python -m sglang_tev.testing.sglang_cpu.serve``: the flags it adds to ``sglang.launch_server``
and the KV pool it sizes from the model (the HTTP server tests start every server through it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_tev.hf.assets import ASSETS_DIR
from sglang_tev.testing.sglang_cpu import serve

TARGET = str(ASSETS_DIR / "target")
GIB = 2**30


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_cpu_defaults_fill_only_what_the_user_left_out():
    argv, notes = serve.launch_argv(["--model-path", TARGET, "--dtype", "float32", "--max-running-requests=2"], 8 * GIB)
    assert _value(argv, "--device") == "cpu" and _value(argv, "--attention-backend") == "tev_cpu"
    assert "--disable-cuda-graph" in argv
    assert argv.count("--dtype") == 1 and _value(argv, "--dtype") == "float32"
    assert not any(a == "--max-running-requests" for a in argv)  # given as --flag=value
    # the shipped target: 2,048 positions, so 2 requests x 2,048 tokens
    assert _value(argv, "--max-total-tokens") == "4096"
    assert "2 requests x 2048 tokens" in notes[0]


def test_pool_is_capped_by_available_memory_and_refused_when_one_request_does_not_fit():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(TARGET)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # bf16 K and V
    available = int(3 * 2048 * per_token / serve.KV_SHARE_OF_AVAILABLE)  # room for 3 full requests
    argv, notes = serve.launch_argv(["--model-path", TARGET], available)
    assert int(_value(argv, "--max-total-tokens")) == 3 * 2048 and "capped by memory" in notes[0]
    with pytest.raises(ValueError, match="^--max-total-tokens: one request of 2048 tokens"):
        serve.launch_argv(["--model-path", TARGET], available // 4)
    # an explicit pool size is the user's: no sizing, no refusal
    argv, notes = serve.launch_argv(["--model-path", TARGET, "--max-total-tokens", "512"], 1)
    assert _value(argv, "--max-total-tokens") == "512" and notes == []


def test_missing_model_path_is_one_line_naming_it():
    r = subprocess.run([sys.executable, "-m", "sglang_tev.testing.sglang_cpu.serve", "--port", "1"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --model-path: required (the target model's folder or hub id)"]
