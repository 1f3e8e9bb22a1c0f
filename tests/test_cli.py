"""`sglang-tev generate`: stdout is exactly the decoded new text, the summary line, bad inputs.

Tiny random target + DFlash drafter on disk (tests/tiny_pair.py), CPU, float32.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from sglang_tev import SamplingParams, cli
from sglang_tev.cli import TextStreamer, default_model_paths, main
from sglang_tev.hf.runtime import SpeculativeGenerator
from tiny_pair import build_pair

PROMPT = "def wrap(text, width):\n"
SUMMARY = re.compile(
    r"^\[sglang-tev\] (\d+) tokens, (\d+) rounds, tau (\d+\.\d\d), (\d+\.\d) tok/s, finish=(\w+), method=(\w+)(, .*)?$",
    re.M)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def ref(pair):
    """The runtime the CLI drives, loaded the same way: the oracle for stdout."""
    return SpeculativeGenerator.from_pretrained(*pair, device="cpu")


def run_cli(capsys, pair, *args):
    target, draft = pair
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--device", "cpu", *args])
    out, err = capsys.readouterr()
    return rc, out, err


GENERATE_CASES = [
    # (CLI args, runtime kwargs)
    ([PROMPT, "--budget", "8", "--max-new-tokens", "24"],
     dict(method="tev", budget=8, max_new_tokens=24)),
    (["--method", "chain", "--no-chat-template", "--max-new-tokens", "16", "--ignore-eos", PROMPT],
     dict(method="chain", max_new_tokens=16, ignore_eos=True, chat_template=False)),
    (["--method", "autoregressive", "--max-new-tokens", "12", "--ignore-eos", PROMPT],
     dict(method="autoregressive", max_new_tokens=12, ignore_eos=True)),
    (["--temperature", "1", "--top-k", "50", "--top-p", "0.9", "--verifier", "sequential", "--budget", "6",
      "--seed", "3", "--max-new-tokens", "20", "--ignore-eos", "--block-size", "3", PROMPT],
     dict(method="sequential", budget=6, sampling=SamplingParams(temperature=1.0, top_k=50, top_p=0.9), seed=3,
          max_new_tokens=20, ignore_eos=True, block_size=3)),
]


@pytest.mark.parametrize("args,kwargs", GENERATE_CASES, ids=["tev", "chain-nochat", "autoregressive", "sampled"])
def test_generate_stdout_is_exactly_the_new_text(capsys, pair, ref, args, kwargs):
    rc, out, err = run_cli(capsys, pair, *args)
    expected = ref.generate(PROMPT, **kwargs)
    assert rc == 0, err
    assert out == ref.tokenizer.decode(expected.token_ids, skip_special_tokens=True) == expected.text
    assert len(expected.token_ids) > 0
    m = SUMMARY.search(err)
    assert m, err
    assert int(m.group(1)) == len(expected.token_ids) and int(m.group(2)) == len(expected.rounds)
    assert float(m.group(3)) == pytest.approx(expected.tau, abs=0.006)
    assert m.group(5) == expected.finish_reason and m.group(6) == kwargs["method"]
    assert PROMPT not in out  # the prompt is not echoed


def test_generate_streams_and_stops_at_a_stop_string(capsys, monkeypatch, pair, ref):
    full = ref.generate(PROMPT, budget=8, max_new_tokens=30, ignore_eos=True)
    text = full.text
    stop = next(text[i:i + 2] for i in range(6, len(text) - 4) if "\ufffd" not in text[i:i + 2])
    expected = ref.generate(PROMPT, budget=8, max_new_tokens=30, ignore_eos=True, stop_strings=[stop])
    assert expected.finish_reason == "stop" and len(expected.token_ids) < len(full.token_ids)

    writes = []

    class Spy:
        def write(self, s):
            writes.append(s)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Spy())
    rc, _, err = run_cli(capsys, pair, "--budget", "8", "--max-new-tokens", "30", "--ignore-eos", "--stop", stop, PROMPT)
    assert rc == 0, err
    assert "".join(writes) == expected.text
    assert stop in expected.text and stop not in ref.tokenizer.decode(expected.token_ids[:-1])  # cut right after it
    assert len(writes) > 1  # streamed, not written once at the end
    assert "finish=stop" in err


def test_text_streamer_holds_back_partial_characters(pair, ref):
    tok = ref.tokenizer
    text = "naïve café 🙂 — done"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    partial = [tok.decode(ids[:i]) for i in range(1, len(ids))]
    assert any(p.endswith("\ufffd") for p in partial)  # some prefix cuts a multi-byte character
    writes = []
    s = TextStreamer(tok.decode, writes.append)
    for t in ids:
        s([t])
    assert all(not w.endswith("\ufffd") and w for w in writes)
    assert s.finish() == text and "".join(writes) == text
    # a genuine trailing replacement char is written by the final flush
    writes.clear()
    s = TextStreamer(lambda ids: "ab\ufffd"[: len(ids)], writes.append)
    for t in range(3):
        s([t])
    assert writes == ["a", "b"]
    s.finish()
    assert "".join(writes) == "ab\ufffd"


def test_generate_in_a_subprocess(pair, ref):
    target, draft = pair
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    p = subprocess.run(
        [sys.executable, "-m", "sglang_tev.cli", "generate", "--target", str(target), "--draft", str(draft),
         "--device", "cpu", "--budget", "8", "--max-new-tokens", "16", "--ignore-eos", PROMPT],
        capture_output=True, env=env, timeout=120)
    expected = ref.generate(PROMPT, budget=8, max_new_tokens=16, ignore_eos=True)
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert p.stdout.decode("utf-8") == expected.text
    assert len(SUMMARY.findall(err)) == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("[sglang-tev] 16 tokens")


BAD = [
    (["--target", "{missing}"], "--target"),
    (["--draft", "{missing}"], "--draft"),
    (["--verifier", "bogus"], "--verifier"),
    (["--method", "bogus"], "--method"),
    (["--budget", "-1"], "--budget"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--min-p", "1.5"], "--min-p"),
    (["--top-k", "2.5"], "--top-k"),
    (["--temperature", "1", "--verifier", "greedy"], "--verifier"),
    (["--temperature", "1", "--method", "chain", "--verifier", "greedy"], "--verifier"),
    (["--temperature", "1", "--method", "greedy"], "--method"),
    (["--block-size", "99"], "--block-size"),
    (["--stop", ""], "--stop"),
    (["--dtype", "int8"], "--dtype"),
    (["--device", "nonsense"], "--device"),
    (["{long}"], "PROMPT"),
]


@pytest.mark.parametrize("args,arg", BAD, ids=[b[1] + "/" + "_".join(b[0])[:20] for b in BAD])
def test_generate_bad_input_exits_2_naming_the_argument(capsys, tmp_path, pair, args, arg):
    target, draft = pair
    has_prompt = "{long}" in args
    subst = {"{missing}": str(tmp_path / "nope"), "{long}": "x " * 300}  # 623 tokens > 256 positions
    args = [subst.get(a, a) for a in args]
    base = {"--target": str(target), "--draft": str(draft)}
    for a in args:
        base.pop(a, None)
    argv = ["generate", *[x for kv in base.items() for x in kv], *args]
    if not has_prompt:
        argv.append(PROMPT)
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert f"argument {arg}" in err, err
    assert "Traceback" not in err and out == ""


def test_default_model_paths(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "ASSETS_DIR", tmp_path / "tiny-code")
    with pytest.raises(FileNotFoundError, match="no --target given and the shipped model pair is not installed at"):
        default_model_paths()
    assert main(["generate", "hello"]) == 2
    err = capsys.readouterr().err
    assert "argument --target: no --target given" in err and "Traceback" not in err
    (tmp_path / "tiny-code" / "target").mkdir(parents=True)
    (tmp_path / "tiny-code" / "draft").mkdir()
    assert default_model_paths() == (tmp_path / "tiny-code" / "target", tmp_path / "tiny-code" / "draft")


def test_no_command_and_version(capsys):
    from sglang_tev.hf.runtime import GENERATION_METHODS

    assert cli.METHODS == GENERATION_METHODS
    assert main([]) == 2
    assert main(["--version"]) == 0
    assert "sglang-tev 0.1.0" in capsys.readouterr().out


def test_text_streamer_holds_back_spaces_a_cleanup_may_remove():
    pieces = ["Hello", " ", ".", " ok"]

    def decode(ids):  # like clean_up_tokenization_spaces: " ." -> "."
        return "".join(pieces[i] for i in ids).replace(" .", ".")

    for hold, ok in [(True, True), (False, False)]:
        writes = []
        s = TextStreamer(decode, writes.append, hold_spaces=hold)
        for i in range(len(pieces)):
            s([i])
        s.finish()
        assert ("".join(writes) == "Hello. ok") is ok, writes


def test_target_without_draft_decodes_autoregressively_only(capsys, pair, ref):
    target, _ = pair
    rc = main(["generate", "--target", str(target), "--method", "autoregressive", "--max-new-tokens", "6", PROMPT])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == ref.generate(PROMPT, method="autoregressive", max_new_tokens=6).text
    rc = main(["generate", "--target", str(target), PROMPT])
    out, err = capsys.readouterr()
    assert rc == 2 and "argument --draft: --method tev needs a drafter: pass --draft DIR" in err and out == ""


def test_draft_alone_pairs_with_the_shipped_target(capsys, tmp_path):
    """--draft without --target uses the shipped target; a drafter given as --target is refused."""
    _, shipped_draft = default_model_paths()
    rc = main(["generate", "--draft", str(shipped_draft), "--max-new-tokens", "4", "def f(x):"])
    out, err = capsys.readouterr()
    assert rc == 0 and out and "Traceback" not in err, err
    rc = main(["generate", "--target", str(shipped_draft), "--method", "autoregressive", "x"])
    out, err = capsys.readouterr()
    assert rc == 2 and "argument --target:" in err and "is a DFlash drafter" in err and out == ""
    shipped_target, _ = default_model_paths()
    rc = main(["generate", "--target", str(shipped_target), "--draft", str(shipped_target), "x"])
    out, err = capsys.readouterr()
    assert rc == 2 and "argument --draft:" in err and "looks like a target model" in err and out == ""
