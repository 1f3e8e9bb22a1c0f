"""`sglang-tev bench` and `run_bench`: results.json schema, skipping, plots, greedy agreement.

Tiny random target + DFlash drafter on disk (tests/tiny_pair.py) with 512 positions (HumanEval/0
and /1 are 321 and 411 tokens with its tokenizer and chat template). CPU, float32, one thread.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from sglang_tev.cli import main
from sglang_tev.hf.bench import bench_configs, run_bench
from sglang_tev.hf.datasets import Prompt, encode_prompt, load_humaneval, load_jsonl, load_prompts
from sglang_tev.testing.drafters import OracleDrafter
from sglang_tev.hf.runtime import SpeculativeGenerator
from tiny_pair import build_pair

MAX_POS = 512
KEYS = {"method": str, "budget": (int, str, type(None)), "temperature": float, "draft_mode": (str, type(None)),
        "prompts": int, "new_tokens": int,
        "rounds": int, "tau": float, "accept_len_mean": float, "coverage_mean": float, "tokens_per_s": float,
        "tokens_per_s_iqr": list, "speedup": (float, type(None)), "speedup_iqr": (list, type(None)),
        "repeats": int, "repeat_spread": float, "stage_ms": dict, "skipped_prompts": int,
        "budgets_chosen": (dict, type(None))}
STAGES = {"draft", "build", "tree_forward", "verify", "commit"}
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"), max_positions=MAX_POS)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = [{"prompt": "def add(a, b):\n"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."}]},
             {"prompt": "x " * 400}]  # ~830 tokens > 512 positions: skipped
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    return path


def check_results(out_dir, configs, prompts, skipped, draft_mode="marginal"):
    """results.json: exactly one record per config with exactly KEYS; consistent with outputs.jsonl."""
    records = json.loads((out_dir / "results.json").read_text())
    assert [(r["method"], r["budget"], r["temperature"]) for r in records] == configs
    outputs = [json.loads(line) for line in (out_dir / "outputs.jsonl").read_text().splitlines()]
    assert len(outputs) == len(configs) * prompts
    for r in records:
        assert set(r) == set(KEYS), set(r) ^ set(KEYS)
        for k, t in KEYS.items():
            assert isinstance(r[k], t) and not isinstance(r[k], bool), (k, r[k])
        assert set(r["stage_ms"]) == STAGES and all(isinstance(v, float) and v >= 0 for v in r["stage_ms"].values())
        assert r["prompts"] == prompts and r["skipped_prompts"] == skipped
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0 and 0 <= r["coverage_mean"]
        assert r["tau"] == pytest.approx(1 + r["accept_len_mean"], abs=1e-9) or r["tau"] < 1 + r["accept_len_mean"]
        assert (r["budget"] is None) == (r["method"] in ("autoregressive", "chain"))
        # auto: marginal for a DFlash v1 drafter, lattice for the shipped DFlash2 one
        assert r["draft_mode"] == (None if r["method"] == "autoregressive" else draft_mode)
        mine = [o for o in outputs if (o["method"], o["budget"], o["temperature"]) == (r["method"], r["budget"], r["temperature"])]
        emitted = [e for o in mine for e in o["emitted_per_round"]]
        assert r["rounds"] == len(emitted) and r["tau"] == pytest.approx(sum(emitted) / len(emitted))
        assert r["new_tokens"] == sum(len(o["new_token_ids"]) for o in mine) == sum(emitted)
        # speed: per-prompt rate from the median of the repeats; median and quartiles over prompts
        assert all(len(o["decode_s_repeats"]) == r["repeats"] for o in mine)
        assert all(o["decode_s"] == pytest.approx(statistics.median(o["decode_s_repeats"])) for o in mine)
        rates = [len(o["new_token_ids"]) / o["decode_s"] for o in mine]
        assert r["tokens_per_s"] == pytest.approx(float(np.median(rates)))
        assert r["tokens_per_s_iqr"] == pytest.approx(list(np.percentile(rates, [25, 75])))
        if r["method"] == "autoregressive":
            assert r["speedup"] == 1.0 and r["tau"] == 1.0 and r["speedup_iqr"] == [1.0, 1.0]
        else:
            ar = [o for o in outputs if o["method"] == "autoregressive" and o["temperature"] == r["temperature"]]
            ratios = [x / (len(a["new_token_ids"]) / a["decode_s"]) for x, a in zip(rates, ar)]
            assert r["speedup"] == pytest.approx(float(np.median(ratios)))
            assert r["speedup_iqr"] == pytest.approx(list(np.percentile(ratios, [25, 75])))
    for name in ("tau_hist.png", "stage_ms.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG and len(data) > 1000
    meta = json.loads((out_dir / "meta.json").read_text())
    assert {"command", "date", "machine", "versions", "device", "dtype"} <= set(meta)
    assert {"torch", "transformers"} <= set(meta["versions"]) and meta["device"] == "cpu"
    assert not any(k.startswith("tau") for r in records for k in r if k != "tau")
    assert "target" not in meta and list(meta.values()).count(meta["target_path"]) == 1  # named once
    return records, outputs


def same_greedy_outputs(outputs):
    """At T=0 every method must emit the same tokens for a prompt (all are exact)."""
    by_prompt = defaultdict(set)
    for o in outputs:
        if o["temperature"] == 0.0:
            by_prompt[o["prompt_index"]].add(tuple(o["new_token_ids"]))
    assert by_prompt and all(len(v) == 1 for v in by_prompt.values()), by_prompt


def test_bench_cli_jsonl_skips_long_prompts(capsys, tmp_path, pair, jsonl):
    target, draft = pair
    out = tmp_path / "out"
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--dataset", str(jsonl),
               "--budgets", "4", "--temperatures", "0", "--max-new-tokens", "8", "--output", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    configs = [("autoregressive", None, 0.0), ("chain", None, 0.0), ("tev", 4, 0.0), ("predraw", 4, 0.0),
               ("sequential", 4, 0.0)]
    records, outputs = check_results(out, configs, prompts=2, skipped=1)
    same_greedy_outputs(outputs)
    assert "skipping prompt 'prompts.jsonl:3'" in err and "+ 1 > the model's 512 positions" in err
    assert "bench" in err and "30/30" in err  # the tqdm bar: 5 configs x 2 prompts x 3 repeats (default)
    assert all(r["repeats"] == 3 for r in records)
    assert re.split(r"\s{2,}", stdout.splitlines()[0].strip()) == [
        "method", "draft", "budget", "T", "tau", "accept_len", "coverage", "tok/s", "tok/s IQR", "speedup",
        "speedup IQR", "repeat spread", "draft ms", "build ms"]
    assert len(stdout.strip().splitlines()) == 2 + len(configs)
    assert [o["prompt_id"] for o in outputs[:2]] == ["prompts.jsonl:1", "prompts.jsonl:2"]
    tok = SpeculativeGenerator.from_pretrained(target, None, device="cpu").tokenizer
    msgs = json.loads(jsonl.read_text().splitlines()[1])["messages"]
    assert outputs[1]["prompt_tokens"] == len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_bench_cli_humaneval_limit(capsys, tmp_path, pair):
    target, draft = pair
    out = tmp_path / "he"
    rc = main(["bench", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--dataset", "humaneval",
               "--limit", "2", "--max-new-tokens", "8", "--budgets", "4", "--temperatures", "0", "--output", str(out),
               "--no-progress"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    configs = [(m, b, 0.0) for m, b in [("autoregressive", None), ("chain", None), ("tev", 4), ("predraw", 4),
                                        ("sequential", 4)]]
    _, outputs = check_results(out, configs, prompts=2, skipped=0)
    same_greedy_outputs(outputs)
    assert [o["prompt_id"] for o in outputs[:2]] == ["HumanEval/0", "HumanEval/1"]
    tok = SpeculativeGenerator.from_pretrained(target, None, device="cpu").tokenizer
    he = load_humaneval(2)
    assert [o["prompt_tokens"] for o in outputs[:2]] == [len(encode_prompt(p, tok)) for p in he]
    assert "|" not in err  # --no-progress: no bar


def test_bench_cli_default_output_dir(capsys, tmp_path, monkeypatch, pair):
    """Without --output the files go to bench-results/<UTC date-time>/ under the working
    directory, and stderr says where; without --target/--draft meta.json names the shipped pair."""
    from sglang_tev.cli import default_model_paths

    target, draft = default_model_paths()
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "--device", "cpu", "--dataset", "humaneval",
               "--limit", "1", "--max-new-tokens", "4", "--budgets", "4", "--temperatures", "0",
               "--methods", "autoregressive,tev", "--no-progress"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    runs = list((tmp_path / "bench-results").iterdir())
    assert len(runs) == 1 and len(runs[0].name) == len("20261130-040000")
    check_results(runs[0], [("autoregressive", None, 0.0), ("tev", 4, 0.0)], prompts=1, skipped=0, draft_mode="lattice")
    assert str(Path("bench-results") / runs[0].name / "results.json") in err
    meta = json.loads((runs[0] / "meta.json").read_text())
    assert meta["target_path"] == str(target) and meta["draft_path"] == str(draft)


def test_run_bench_api_with_an_oracle_drafter(tmp_path, pair):
    """Long accepted paths (oracle drafter): tau > 1, all T=0 outputs agree, 2 budgets x 2 temperatures."""
    base = SpeculativeGenerator.from_pretrained(pair[0], None, device="cpu")
    oracle = OracleDrafter(base.target, base.vocab_size, accuracy=0.9, block_size=5, seed=1)
    gen = SpeculativeGenerator(base.target, oracle, base.tokenizer)
    prompts = ["import os\n", Prompt(id="p1", text="class A:\n"), [5, 6, 7, 8]]
    records = run_bench(gen, prompts, budgets=[3, 6], temperatures=[0, 1], max_new_tokens=12, seed=0,
                        output_dir=tmp_path, progress=False, ignore_eos=True, log=lambda m: None, repeats=2)
    configs = bench_configs(["autoregressive", "chain", "tev", "predraw", "sequential"], [3, 6], [0.0, 1.0])
    assert len(configs) == 16
    on_disk, outputs = check_results(tmp_path, configs, prompts=3, skipped=0)
    assert on_disk == records
    same_greedy_outputs(outputs)
    assert all(len(o["new_token_ids"]) == 12 for o in outputs)
    for r in records:
        if r["method"] != "autoregressive" and r["temperature"] == 0.0:
            assert r["tau"] > 2.5, r  # the oracle proposes the greedy path, right 90% of the time per depth
    # a greedy tree verifier is accepted at T=0 only
    with pytest.raises(ValueError, match="methods: 'greedy'"):
        run_bench(gen, prompts, budgets=[3], temperatures=[1], max_new_tokens=4, methods=["greedy"], output_dir=None)
    with pytest.raises(ValueError, match="budgets must be <= 1024"):  # checked before anything is written
        run_bench(gen, prompts, budgets=[2000], temperatures=[0], max_new_tokens=4, output_dir=tmp_path / "big")
    assert not (tmp_path / "big").exists()
    r = run_bench(gen, prompts[:1], budgets=[3], temperatures=[0], max_new_tokens=4, methods=["greedy", "chain"],
                  output_dir=None, progress=False, warmup=False)
    assert [x["method"] for x in r] == ["greedy", "chain"] and all(x["speedup"] is None for x in r)


BAD = [
    (["--budgets", "-1"], "--budgets", "budgets must be >= 0"),
    (["--budgets", "a,b"], "--budgets", "'auto' or an integer"),
    (["--temperatures", "-1"], "--temperatures", ">= 0"),
    (["--methods", "tev,bogus"], "--methods", "bogus"),
    (["--limit", "0"], "--limit", ">= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens", ">= 1"),
    (["--dataset", "{missing}"], "--dataset", "nope.jsonl: no such file"),
    (["--dataset", "{badline}"], "--dataset", "bad.jsonl:2: the line has neither"),
    (["--dataset", "{notjsonl}"], "--dataset", "'humaneval' or a .jsonl file"),
    (["--dataset", "{alllong}"], "--dataset", "none of the 1 prompts is usable: each is empty or longer than the model's 512"),
    (["--dataset", "{allempty}", "--no-chat-template"], "--dataset", "none of the 1 prompts is usable: each is empty"),
    (["--target", "{missing}"], "--target", "no model directory"),
    (["--budgets", "2000"], "--budgets", "budgets must be <= 1024"),
    (["--methods", ""], "--methods", "give at least one"),
    (["--repeats", "0"], "--repeats", "must be >= 1, got 0"),
    (["--repeats", "x"], "--repeats", "invalid int value: 'x'"),
    (["--output", "{under_file}"], "--output", "is not a directory"),
    (["--output", "/proc/sglang-tev-out"], "--output", "cannot create folders under /proc"),  # before the models load
]


@pytest.mark.parametrize("args,arg,says", BAD, ids=[b[1] + "/" + "_".join(b[0])[-12:] for b in BAD])
def test_bench_bad_input_exits_2_naming_the_argument(capsys, tmp_path, pair, jsonl, args, arg, says):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "no prompt here"}\n')
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x " * 400}) + "\n")
    (tmp_path / "a_file").write_text("x")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": ""}) + "\n")
    subst = {"{allempty}": str(empty), "{missing}": str(tmp_path / "nope.jsonl"), "{badline}": str(bad), "{notjsonl}": "mtbench",
             "{alllong}": str(long), "{under_file}": str(tmp_path / "a_file" / "sub")}
    args = [subst.get(a, a) for a in args]
    opts = {"--target": str(pair[0]), "--draft": str(pair[1]), "--dataset": str(jsonl), "--output": str(tmp_path / "o"),
            "--budgets": "2", "--temperatures": "0", "--max-new-tokens": "2"}
    for a in args:
        opts.pop(a, None)
    rc = main(["bench", *[x for kv in opts.items() for x in kv], *args, "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert f"argument {arg}" in err and says in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()  # nothing written on bad input


def test_datasets(tmp_path, pair):
    tok = SpeculativeGenerator.from_pretrained(pair[0], None, device="cpu").tokenizer
    he = load_humaneval(3)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert he[0].text.startswith("from typing import List") and he[0].messages is None
    assert load_prompts("humaneval", 2) == he[:2] and len(load_prompts("HumanEval")) == 164
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "id": 7}\n\n{"messages": [{"role": "user", "content": "b"}]}\n{"prompt": "c"}\n')
    ps = load_jsonl(path)
    assert [p.id for p in ps] == ["7", "d.jsonl:3", "d.jsonl:4"] and load_prompts(path, 2) == ps[:2]
    msg = ps[1]
    with_template = encode_prompt(msg, tok)
    assert with_template == tok.apply_chat_template([{"role": "user", "content": "b"}], add_generation_prompt=True,
                                                    tokenize=True)["input_ids"]
    assert encode_prompt(msg, tok, chat_template=False) == tok("b")["input_ids"] != with_template
    two = Prompt(id="x", messages=({"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}))
    assert encode_prompt(two, tok, chat_template=False) == tok("b\n\nc")["input_ids"]
    assert encode_prompt("a", tok, chat_template=False) == tok("a")["input_ids"]
    bad = tmp_path / "bad.jsonl"
    for line, match in [('{"messages": "hi"}', "bad.jsonl:1: 'messages' must be"), ("[1]", "bad.jsonl:1: expected"),
                        ("{oops", "bad.jsonl:1: invalid JSON"), ('{"messages": [{"role": "user"}]}', "bad.jsonl:1")]:
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=match):
            load_jsonl(bad)
    with pytest.raises(ValueError, match="limit"):
        load_prompts("humaneval", 0)


def test_one_slow_pass_does_not_move_the_speed(tmp_path, pair):
    """A busy machine slows one decode 100x: the per-prompt median over repeats ignores it, and
    the row reports the median over prompts with its quartiles (a plain mean over one pass read
    this row as a fraction of its speed)."""
    gen = SpeculativeGenerator.from_pretrained(pair[0], pair[1], device="cpu")
    real = gen.generate
    calls = []

    def clocked(*a, **k):  # a fixed clock: every decode 1 s, one of them 100 s
        res = real(*a, **k)
        calls.append(k["method"])
        res.decode_s = 100.0 if (k["method"] == "tev" and calls.count("tev") == 4) else 1.0
        return res

    gen.generate = clocked
    prompts = ["import os\n", "class A:\n", "def f(x):\n"]
    records = run_bench(gen, prompts, budgets=[2], temperatures=[0], max_new_tokens=6, methods=["autoregressive", "tev"],
                        output_dir=tmp_path, progress=False, ignore_eos=True, warmup=False, repeats=3, plots=False)
    ar, tev = records
    assert tev["tokens_per_s"] == 6.0 and tev["tokens_per_s_iqr"] == [6.0, 6.0] and tev["speedup"] == 1.0
    assert tev["repeat_spread"] == 0.0 and tev["repeats"] == 3  # the median prompt's repeats agree
    outputs = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [o["decode_s_repeats"] for o in outputs if o["method"] == "tev"][1] == [100.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        run_bench(gen, prompts, budgets=[2], temperatures=[0], repeats=0)


def test_bench_refuses_to_overwrite_an_earlier_run(capsys, tmp_path, pair, jsonl, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("[]\n")
    argv = ["bench", "--target", str(pair[0]), "--draft", str(pair[1]), "--dataset", str(jsonl), "--budgets", "2",
            "--temperatures", "0", "--max-new-tokens", "2", "--methods", "autoregressive,tev", "--repeats", "1",
            "--limit", "1", "--output", str(out), "--no-progress"]

    def refuse(*a, **k):
        raise AssertionError("loaded a model before checking --output")

    with monkeypatch.context() as m:
        m.setattr(SpeculativeGenerator, "from_pretrained", refuse)
        assert main(argv) == 2
    _, err = capsys.readouterr()
    assert "argument --output:" in err and "exists and is not empty" in err and "--overwrite" in err
    assert (out / "results.json").read_text() == "[]\n" and len(list(out.iterdir())) == 1
    assert main(argv + ["--overwrite"]) == 0
    assert len(json.loads((out / "results.json").read_text())) == 2
    gen = SpeculativeGenerator.from_pretrained(pair[0], None, device="cpu")
    with pytest.raises(ValueError, match="output_dir: .* is not empty"):
        run_bench(gen, ["a"], budgets=[2], temperatures=[0], methods=["autoregressive"], output_dir=out)
    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty directory is fine
    run_bench(gen, ["a"], temperatures=[0], max_new_tokens=2, methods=["autoregressive"], output_dir=empty,
              progress=False, repeats=1, plots=False)
    assert (empty / "results.json").exists()
