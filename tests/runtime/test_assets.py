"""The shipped tiny-code pair (sglang_tev/assets/tiny-code): loads, fits, decodes exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_pair import plain_greedy

from sglang_tev.cli import default_model_paths
from sglang_tev.hf.runtime import SpeculativeGenerator

pytestmark = pytest.mark.slow  # minutes here: scripts/run_tests.sh --fast leaves it out

ASSETS = Path(__file__).resolve().parents[2] / "sglang_tev" / "assets" / "tiny-code"
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@pytest.fixture(scope="module")
def gen():
    target, draft = default_model_paths()
    assert Path(target) == ASSETS / "target" and Path(draft) == ASSETS / "draft2"  # the DFlash2 drafter
    return SpeculativeGenerator.from_pretrained(target, draft, device="cpu")


def test_files_are_small_bf16_safetensors():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total <= 25 * 2**20, total
    from safetensors import safe_open

    for part in ("target", "draft", "draft-base", "draft2"):
        with safe_open(str(ASSETS / part / "model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    cfg = json.loads((ASSETS / "draft" / "config.json").read_text())
    assert cfg["block_size"] == 16 and cfg["architectures"] == ["DFlashDraftModel"]


def test_default_drafter_is_the_exittrain_fine_tune_of_draft_base():
    """draft/ is draft-base/ continued by the build's exittrain stage: same architecture, other
    weights, and its metrics record the ExitTrain recipe and the before/after held-out 1 + C_p."""
    cfgs = [json.loads((ASSETS / d / "config.json").read_text()) for d in ("draft", "draft-base")]
    assert cfgs[0] == cfgs[1]
    assert (ASSETS / "draft" / "model.safetensors").read_bytes() != (ASSETS / "draft-base" / "model.safetensors").read_bytes()
    m = json.loads((ASSETS / "draft" / "metrics.json").read_text())
    assert m["exittrain"]["exit_mode"] == "exit" and m["exittrain"]["exit_temperature"] == 0.0
    assert m["heldout_block_len"]["T0"] > m["before"]["heldout_block_len"]["T0"]
    assert "exittrain" not in json.loads((ASSETS / "draft-base" / "metrics.json").read_text())


def test_greedy_identical_to_plain_decoding(gen):
    ids = gen.encode(PROMPT)
    ref = plain_greedy(gen.target, ids, 96)
    taus = {}
    for method in ("tev", "predraw", "chain"):
        res = gen.generate(ids, method=method, budget=32, max_new_tokens=96, ignore_eos=True)
        assert res.token_ids == ref, method
        taus[method] = res.tau
    assert taus["tev"] > 2.0, taus  # the trained drafter is genuinely accepted (2.59 measured)


def test_readme_command_runs():
    p = subprocess.run([sys.executable, "-m", "sglang_tev.cli", "generate", "--max-new-tokens", "48", "def fibonacci(n):"],
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().strip() and "tau" in p.stderr.decode()


def test_the_dflash2_drafter_drafts_lattice_trees_and_keeps_greedy_exact():
    """draft2/ (the build's opt-in draft2 stage): a DFlash2 checkpoint in z-lab's layout with a
    conv and a trained selector; the runtime drafts lattice trees from it by default, greedy output
    is plain decoding's, and its rounds accept drafts."""
    cfg = json.loads((ASSETS / "draft2" / "config.json").read_text())
    d2 = cfg["dflash_config"]  # z-lab / SGLang read the DFlash2 keys there
    assert cfg["architectures"] == ["DFlash2DraftModel"] and d2["selector_top_k"] == 16 and d2["conv_kernel_size"] == 2
    m = json.loads((ASSETS / "draft2" / "metrics.json").read_text())
    assert m["steps"] == json.loads((ASSETS / "draft-base" / "metrics.json").read_text())["steps"]  # same steps
    gen2 = SpeculativeGenerator.from_pretrained(ASSETS / "target", ASSETS / "draft2", device="cpu")
    assert gen2.has_selector and gen2.resolve_draft_mode("auto") == "lattice"
    prompt = "def add(a, b):\n"
    # a fixed budget: under "auto" the planner reads wall time, and on a loaded machine may choose
    # plain rounds (tau 1), which says nothing about the drafter
    res = gen2.generate(prompt, budget=32, max_new_tokens=48, ignore_eos=True)
    plain = gen2.generate(prompt, method="autoregressive", max_new_tokens=48, ignore_eos=True)
    assert res.token_ids == plain.token_ids and res.tau > 1.5
