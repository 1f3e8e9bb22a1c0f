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
    from sglang_tev.cli import common  # default_model_paths reads ASSETS_DIR there

    monkeypatch.setattr(common, "ASSETS_DIR", tmp_path / "tiny-code")
    with pytest.raises(FileNotFoundError, match="no --target given and the shipped model pair is not installed at"):
        default_model_paths()
    assert main(["generate", "hello"]) == 2
    err = capsys.readouterr().err
    assert "argument --target: no --target given" in err and "Traceback" not in err
    (tmp_path / "tiny-code" / "target").mkdir(parents=True)
    (tmp_path / "tiny-code" / "draft2").mkdir()
    assert default_model_paths() == (tmp_path / "tiny-code" / "target", tmp_path / "tiny-code" / "draft2")


def test_no_command_and_version(capsys):
    from sglang_tev.hf.runtime import GENERATION_METHODS, MAX_BUDGET

    assert cli.METHODS == GENERATION_METHODS and cli.MAX_BUDGET == MAX_BUDGET
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


# ---------------------------------------------------------------------------------------------- the CLI as a Unix tool

def _cli_cmd(pair, *args):
    target, draft = pair
    return [sys.executable, "-m", "sglang_tev.cli", "generate", "--target", str(target), "--draft", str(draft),
            "--device", "cpu", *args]


def test_closed_stdout_exits_quietly_like_a_unix_tool(pair):
    """`generate ... | head -n 2`: once the reader is gone, stop at the first failed write, no
    BrokenPipeError traceback, exit status 128 + SIGPIPE as a shell reports for `yes | head`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    p = subprocess.Popen(_cli_cmd(pair, "--budget", "8", "--max-new-tokens", "64", "--ignore-eos", PROMPT),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # the reader is gone before the first write: deterministic EPIPE
    err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert rc == 141, err
    assert err == "", err  # not even the summary line: like `yes`, the tool just ends


def test_pipe_into_head_has_no_traceback():
    """The README's pair through a real shell pipe (head reads two lines and exits)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    cmd = (f"{sys.executable} -m sglang_tev.cli generate --device cpu --max-new-tokens 256 --ignore-eos "
           "'def fibonacci(n):' | head -n 2")
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, env=env, timeout=180)
    err = p.stderr.decode()
    assert p.returncode == 0 and len(p.stdout.decode().splitlines()) <= 2
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err


class _Tty:
    """A terminal stand-in: both streams write into one shared screen."""

    def __init__(self, screen, tty=True):
        self.screen, self.tty = screen, tty

    def write(self, s):
        self.screen.append(s)
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_summary_starts_on_its_own_line_on_a_terminal(monkeypatch, pair, ref, tty):
    expected = ref.generate(PROMPT, budget=8, max_new_tokens=12, ignore_eos=True)
    assert expected.text and not expected.text.endswith("\n")
    screen = []
    monkeypatch.setattr(sys, "stdout", _Tty(screen, tty))
    monkeypatch.setattr(sys, "stderr", _Tty(screen, tty))
    target, draft = pair
    rc = main(["generate", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--budget", "8",
               "--max-new-tokens", "12", "--ignore-eos", PROMPT])
    assert rc == 0
    shown = "".join(screen)
    # on a terminal a newline goes to stderr first; a file or pipe gets exactly the text
    assert shown.startswith(expected.text + ("\n[sglang-tev] " if tty else "[sglang-tev] ")), shown


def test_prompt_from_stdin(monkeypatch, capsys, pair, ref):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    rc, out, err = run_cli(capsys, pair, "--budget", "8", "--max-new-tokens", "16", "-")
    assert rc == 0, err
    assert out == ref.generate(PROMPT, budget=8, max_new_tokens=16).text
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc, out, err = run_cli(capsys, pair, "-")
    assert rc == 2 and "argument PROMPT: stdin is empty" in err and out == ""


def test_prompts_from_a_file(capsys, tmp_path, pair, ref):
    import json

    prompts = [PROMPT, "class Stack:\n", "import os\n"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[:2]) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": prompts[2]}], "id": "last"}) + "\n")
    txt = tmp_path / "p.txt"
    txt.write_text("def f(x):\n\nclass A:\n")  # one prompt per non-empty line
    for path, want, ids in [(jsonl, prompts, ["p.jsonl:1", "p.jsonl:2", "last"]),
                            (txt, ["def f(x):", "class A:"], ["p.txt:1", "p.txt:3"])]:
        rc, out, err = run_cli(capsys, pair, "--budget", "8", "--max-new-tokens", "10", "--prompts-file", str(path))
        assert rc == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        assert [r["id"] for r in rows] == ids
        for r, p in zip(rows, want):
            exp = ref.generate(p, budget=8, max_new_tokens=10)
            assert r["text"] == exp.text and r["new_tokens"] == len(exp.token_ids)
            assert r["finish_reason"] == exp.finish_reason and r["rounds"] == len(exp.rounds)
        assert err.count("[sglang-tev]") == 1 and f"{len(want)} prompts" in err, err
    rc, out, err = run_cli(capsys, pair, "--prompts-file", str(tmp_path / "none.jsonl"))
    assert rc == 2 and "argument --prompts-file:" in err and "no such file" in err
    (tmp_path / "blank.txt").write_text("\n \n")
    rc, out, err = run_cli(capsys, pair, "--prompts-file", str(tmp_path / "blank.txt"))
    assert rc == 2 and "argument --prompts-file:" in err and "no prompts" in err


def test_help_has_examples(capsys):
    for cmd in ("generate", "bench"):
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert "examples:" in out and f"sglang-tev {cmd} " in out.split("examples:")[1]
    assert main(["--help"]) == 0
    assert "examples:" in capsys.readouterr().out


ONE_LINE = [
    (["generate", "--budget", "abc", "x"], "argument --budget: expected 'auto' or an integer, got 'abc'"),
    (["generate", "--temperature", "hot", "x"], "argument --temperature: invalid float value: 'hot'"),
    (["generate", "--verifier", "bogus", "x"], "argument --verifier: invalid choice: 'bogus'"),
    (["generate", "--budget", "-1", "x"], "argument --budget: must be >= 0, got -1"),
    (["generate"], "argument PROMPT: give a prompt, '-' to read it from stdin, or --prompts-file FILE"),
    (["generate", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "--budgets", "a,b", "--dataset", "humaneval"], "argument --budgets: expected 'auto' or an integer, got 'a'"),
    (["bench"], "the following arguments are required: --dataset"),
    (["bogus"], "argument COMMAND: invalid choice: 'bogus'"),
]


@pytest.mark.parametrize("argv,says", ONE_LINE, ids=["_".join(a)[:30] for a, _ in ONE_LINE])
def test_every_bad_value_is_one_line_and_status_2(capsys, argv, says):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err  # no usage block
    prog = "sglang-tev" if argv[0] == "bogus" else f"sglang-tev {argv[0]}"
    assert lines[0].startswith(f"{prog}: error: ") and says in lines[0], err


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before a cheap check")

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", refuse)


CHEAP = [
    (["--budget", "2000"], "argument --budget: must be <= 1024"),
    (["--block-size", "99"], "argument --block-size: must be in [2, 4] (the drafter's block size), got 99"),
    (["--block-size", "1"], "argument --block-size: must be >= 2"),
    (["--target", "{missing}"], "argument --target: no model directory at"),
    (["--draft", "{missing}"], "argument --draft: no model directory at"),
    (["--prompt-is-empty"], "argument PROMPT: the prompt is empty"),
]


@pytest.mark.parametrize("args,says", CHEAP, ids=[c[0][0] + "_" + c[0][-1] for c in CHEAP])
def test_cheap_checks_run_before_any_model_load(capsys, tmp_path, pair, no_model_load, args, says):
    target, draft = pair
    opts = {"--target": str(target), "--draft": str(draft)}
    empty = args == ["--prompt-is-empty"]
    args = [] if empty else [str(tmp_path / "nope") if a == "{missing}" else a for a in args]
    for a in args:
        opts.pop(a, None)
    rc = main(["generate", *[x for kv in opts.items() for x in kv], *args, "" if empty else PROMPT])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", err
    assert says in err and len(err.splitlines()) == 1, err
    assert "target: target:" not in err and "draft: draft:" not in err and "--target: target" not in err


@pytest.mark.parametrize("args, flag", [
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--repetition-penalty", "nan"], "--repetition-penalty"),
    (["--presence-penalty", "nan"], "--presence-penalty"),
    (["--frequency-penalty", "5"], "--frequency-penalty"),
])
def test_penalty_errors_name_their_flag(capsys, pair, args, flag):
    rc, out, err = run_cli(capsys, pair, *args, "x")
    assert rc == 2 and out == "" and f"argument {flag}:" in err and "PROMPT" not in err


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--batch-sizes", "0"], "argument --batch-sizes: must be integers >= 1, got [0]"),
        (["--methods", "greedy", "--temperatures", "1"], "argument --methods: 'greedy' is exact only at temperature 0"),
    ],
)
def test_bench_checks_run_before_any_model_load(capsys, no_model_load, extra, says):
    rc = main(["bench", "--dataset", "humaneval", *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and says in err, err
