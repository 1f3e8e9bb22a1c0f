"""`sglang-tev generate` with several prompts / --prompts-file / --batch-size, and `bench
--batch-sizes`: output order = input order, every text equal to its batch-1 run, batch records."""

from __future__ import annotations

import json

import pytest

from sglang_tev.cli import main
from sglang_tev.hf.bench import run_bench
from sglang_tev.hf.runtime import SpeculativeGenerator
from tiny_pair import build_pair

PROMPTS = ["def wrap(text, width):\n", "import os\n", "class Node:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"), max_positions=512)


@pytest.fixture(scope="module")
def ref(pair):
    return SpeculativeGenerator.from_pretrained(*pair, device="cpu")


def run(capsys, pair, *args):
    rc = main(["generate", "--target", str(pair[0]), "--draft", str(pair[1]), "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_several_prompts_in_input_order(capsys, pair, ref, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": PROMPTS[2]}) + "\n")
    rc, out, err = run(capsys, pair, PROMPTS[0], PROMPTS[1], "--prompts-file", str(f), "--batch-size", "2",
                       "--budget", "8", "--max-new-tokens", "12", "--ignore-eos", "--repetition-penalty", "1.2")
    assert rc == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2]
    for x, p in zip(lines, PROMPTS):
        want = ref.generate(p, budget=8, max_new_tokens=12, ignore_eos=True, repetition_penalty=1.2)
        assert x["token_ids"] == want.token_ids and x["text"] == want.text
    assert "3 prompts" in err.strip().splitlines()[-1] and "tok/s over the batch" in err


def test_generate_batch_bad_inputs(capsys, pair, tmp_path):
    rc, _, err = run(capsys, pair, PROMPTS[0], PROMPTS[1], "--batch-size", "0")
    assert rc == 2 and "--batch-size" in err
    rc, _, err = run(capsys, pair, "--prompts-file", str(tmp_path / "none.jsonl"))
    assert rc == 2 and "--prompts-file" in err
    rc, _, err = run(capsys, pair)
    assert rc == 2 and "PROMPT" in err


def test_bench_batch_sizes_records(pair, ref, tmp_path):
    recs = run_bench(ref, PROMPTS, budgets=[8], temperatures=[0.0], max_new_tokens=10, methods=["autoregressive", "tev"],
                     output_dir=tmp_path / "out", progress=False, warmup=False, batch_sizes=[1, 2, 3], ignore_eos=True)
    for r in recs:
        assert [b["batch_size"] for b in r["batch"]] == [1, 2, 3]
        for b in r["batch"]:
            assert b["tokens_per_s"] > 0 and b["new_tokens"] == 30 and len(b["tau_per_row"]) == 3
            assert b["overhead_ms_per_row_round"] >= 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved[1]["batch"][2]["tau_per_row"] == recs[1]["batch"][2]["tau_per_row"]
    assert (tmp_path / "out" / "batch_tokens_per_s.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="batch_sizes"):
        run_bench(ref, PROMPTS, budgets=[8], temperatures=[0.0], max_new_tokens=4, methods=["tev"], batch_sizes=[0])
