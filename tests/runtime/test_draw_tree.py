"""``sglang-tev draw-tree`` (sglang_tev.train.tree_exits): the numbers drawn are the exit law of the
runtime's own first-round tree, the pictures are valid files, bad input is one line naming the
argument and writes nothing.

The exit law is checked against an enumeration of target continuations on the tree and the target
logits the transformers runtime itself produced in its first round (captured at its verify stage),
for the shipped pair's DFlash2 drafter (lattice trees) and DFlash drafter (marginal trees), at the
greedy law and at T = 0.7. The command's tests use the tiny random pair of ``tiny_pair``.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from exact_law import enumerate_exit_law
from sglang_tev.cli import main
from sglang_tev.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "sglang_tev" / "assets" / "tiny-code"
CODE = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n"


@pytest.fixture(scope="module")
def shipped():
    from sglang_tev.hf.datasets import encode_prompt
    from sglang_tev.hf.runtime import SpeculativeGenerator
    from sglang_tev.train.drafter_eval import load_models

    target, tok, drafters, names = load_models(ASSET / "target", [ASSET / "draft2", ASSET / "draft"])
    gens = {name: SpeculativeGenerator.from_pretrained(ASSET / "target", ASSET / name, dtype=torch.float32)
            for name in names}  # the dtype load_models uses
    return target, tok, drafters, names, gens, encode_prompt(CODE, tok)


class _Stop(Exception):
    pass


def runtime_first_round(gen, ids, budget, temperature, monkeypatch):
    """The runtime's first TEV round on ``ids`` (root ``ids[-1]``): its tree and the target's tree
    logits, captured at the verify stage (the round is then abandoned)."""
    from sglang_tev.hf import round as hf_round

    got = {}

    def capture(state, tree, logits, *args, **kwargs):  # (the signature may grow; the tree and logits lead)
        got["tree"], got["logits"] = tree, logits.clone()
        raise _Stop

    monkeypatch.setattr(hf_round, "verify", capture)
    with pytest.raises(_Stop):
        gen.generate(list(ids), method="tev", budget=budget, sampling=SamplingParams(temperature=temperature),
                     seed=0, max_new_tokens=64, ignore_eos=True)
    monkeypatch.undo()
    return got["tree"], got["logits"]


def target_law(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """float64 [N, V]: softmax(logits / T), or one-hot at the argmax (lowest id) at T = 0."""
    lg = logits.double().numpy()
    if temperature == 0:
        out = np.zeros_like(lg)
        out[np.arange(len(lg)), lg.argmax(-1)] = 1.0
        return out
    z = lg / temperature
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drawn_numbers_are_the_exit_law_of_the_runtimes_own_first_round(shipped, monkeypatch, temperature):
    from sglang_tev.train.tree_exits import round_trees

    target, tok, drafters, names, gens, ids = shipped
    budget = 6
    rows = round_trees(target, tok, drafters, [ids], budget=budget, temperature=temperature, names=names)
    assert [r[0].name for r in rows] == ["draft2[lattice]", "draft[marginal]"]
    deep = 0
    for r, name in zip(rows, names):
        rt = r[0]
        nodes = rt.nodes
        assert len(nodes) == budget + 1 and [n.index for n in nodes] == list(range(budget + 1))
        # the runtime's own round on the same prompt: the same tree (its drafter cache, its builder)
        tree, logits = runtime_first_round(gens[name], ids, budget, temperature, monkeypatch)
        n_valid = int(tree.valid[0].sum())
        assert n_valid == len(nodes)
        assert [n.parent for n in nodes] == tree.parents[0, :n_valid].tolist()
        assert [n.token for n in nodes] == tree.tokens[0, :n_valid].tolist()
        # the exit law by walking every target continuation through that tree, on the runtime's logits
        probs = target_law(logits[0, :n_valid], temperature)
        parents, tokens = [n.parent for n in nodes], [n.token for n in nodes]
        law = enumerate_exit_law(parents, tokens, probs)                       # [N, V]: (exit node, bonus)
        w = law.sum(1)
        P = [1.0] + [0.0] * (len(nodes) - 1)
        for v in range(1, len(nodes)):                                        # parents precede children
            P[v] = P[parents[v]] * probs[parents[v], tokens[v]]
        rho = [1.0 - sum(probs[v, tokens[u]] for u in range(1, len(nodes)) if parents[u] == v)
               for v in range(len(nodes))]
        assert nodes[0].P == 1.0 and nodes[0].depth == 0 and nodes[0].kind == "root"
        assert sum(n.w for n in nodes) == pytest.approx(1.0, abs=1e-9)
        for n in nodes:
            assert n.w == pytest.approx(n.P * n.rho, abs=1e-12)
            assert n.P == pytest.approx(P[n.index], abs=2e-4)
            assert n.rho == pytest.approx(max(rho[n.index], 0.0), abs=2e-4)
            assert n.w == pytest.approx(w[n.index], abs=2e-4)
            assert n.target_token == int(probs[n.index].argmax())
            assert n.text == tok.decode([n.token])
        # the exit node drawn is the most likely one; the target's token there the most likely bonus
        assert rt.exit_node == int(np.argmax(w)) and rt.exit_token == int(law[rt.exit_node].argmax())
        assert rt.exit_prob == pytest.approx(law[rt.exit_node].max() / w[rt.exit_node], abs=2e-4)
        assert rt.block_len == pytest.approx(1 + sum(P[1:]), abs=2e-4)
        depth = [n.depth for n in nodes]
        for d in range(rt.horizon + 1):
            assert rt.w_depth[d] == pytest.approx(sum(w[v] for v in range(len(nodes)) if depth[v] == d), abs=2e-4)
        assert sum(rt.w_kind.values()) == pytest.approx(1.0, abs=1e-9)
        assert rt.w_kind["root"] == pytest.approx(w[0], abs=2e-4)
        deep = max(deep, max(depth))
    assert deep >= 2  # trees with depth: the checks have teeth


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tiny_pair import build_pair

    root = tmp_path_factory.mktemp("drawpair")
    target, draft = build_pair(root)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def add(a, b):", "class Stack:", "import os"]))
    return target, draft, prompts


def run_cli(argv, capsys):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _svg_texts(data: bytes) -> str:
    root = ET.fromstring(data)                                              # valid XML
    assert root.tag.endswith("svg")
    return "\n".join(t for t in root.itertext())


def test_cli_writes_svg_png_html_and_json_with_the_library_numbers(pair, tmp_path, capsys):
    from sglang_tev.train.tree_exits import _fmt, token_label

    target, draft, prompts = pair
    out = tmp_path / "o"
    argv = ["draw-tree", "--target", str(target), "--draft", str(draft), "--draft", str(draft), "--prompts",
            str(prompts), "--budget", "5", "--temperature", "1", "--tree-prompt", "1", "--output",
            str(out / "tree.svg"), "--bars", str(out / "bars.png"), "--json", str(out / "n.json")]
    rc, stdout, err = run_cli(argv, capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["bars.png", "n.json", "tree.svg"]   # no temporary left
    assert (out / "bars.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads((out / "n.json").read_text())
    assert rep["rows"] == ["draft[marginal]", "draft#2[marginal]"] and rep["tree_prompt"] == 1
    a, b = (rep["rounds"][k] for k in rep["rows"])
    assert len(a) == 3 and a[1]["prompt_id"].endswith(":2")
    for ra, rb in zip(a, b):  # the same drafter twice: the same trees and numbers
        assert [n["w"] for n in ra["nodes"]] == [n["w"] for n in rb["nodes"]]
        assert ra["nodes"][0]["P"] == 1.0 and sum(n["w"] for n in ra["nodes"]) == pytest.approx(1.0, abs=1e-9)
    assert rep["mean"]["draft[marginal]"]["block_len"] == pytest.approx(np.mean([r["block_len"] for r in a]))
    # the SVG shows the drawn round's numbers, exit node and the target's token there as text
    text = _svg_texts((out / "tree.svg").read_bytes())
    shown = a[1]
    for n in shown["nodes"]:
        assert f"P {_fmt(n['P'])}  ρ {_fmt(n['rho'])}" in text and f"w {_fmt(n['w'])}" in text
        assert token_label(n["text"]) in text
    assert f"target: {token_label(shown['exit_text'])}" in text
    assert f"1 + C_p = {shown['block_len']:.3f}" in text
    assert len(stdout.splitlines()) == 2 and stdout.count("over 3 prompts") == 2
    # the same drawing as PNG and HTML (the SVG inline plus every node's numbers)
    for suffix in (".png", ".html"):
        argv2 = ["draw-tree", "--target", str(target), "--draft", str(draft), "--prompt", "def add(a, b):",
                 "--budget", "3", "--output", str(tmp_path / f"t{suffix}")]
        rc, _, err = run_cli(argv2, capsys)
        assert rc == 0, err
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "t.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<table>" in page and "exit node" in page


def test_cli_draws_the_shipped_pairs_dflash2_lattice_and_marginal_trees(tmp_path, capsys):
    rc, stdout, err = run_cli(["draw-tree", "--prompt", "def read_lines(path):", "--budget", "8", "--draft",
                               f"{ASSET / 'draft2'}@lattice,marginal", "--output", str(tmp_path / "t.svg"),
                               "--bars", str(tmp_path / "b.svg")], capsys)
    assert rc == 0, err
    assert "draft2[lattice]" in stdout and "draft2[marginal]" in stdout
    assert "draft2[lattice]" in _svg_texts((tmp_path / "t.svg").read_bytes())
    assert "exit mass by depth" in _svg_texts((tmp_path / "b.svg").read_bytes())


@pytest.fixture
def no_model_load(monkeypatch):
    import sglang_tev.train.drafter_eval as de

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before a cheap check")

    monkeypatch.setattr(de, "load_models", refuse)


BAD = [
    ([], "argument --prompt: give --prompt TEXT or --prompts FILE"),
    (["--prompt", "x", "--prompts", "{prompts}"], "argument --prompts: give --prompt TEXT or --prompts FILE, not both"),
    (["--prompt", "  "], "argument --prompt: the prompt is empty"),
    (["--prompt", "x", "--output", "{tmp}/t.jpg"], "argument --output: the file name must end in .svg, .png, .html"),
    (["--prompt", "x", "--bars", "{tmp}/b.txt"], "argument --bars: the file name must end in .svg, .png, .html"),
    (["--prompt", "x", "--json", "{tmp}/n.svg"], "argument --json: the file name must end in .json"),
    (["--prompt", "x", "--output", "{tmp}"], "is a directory"),
    (["--prompt", "x", "--output", "{tmp}/a.svg", "--bars", "{tmp}/a.svg"], "argument --bars: "),
    (["--prompt", "x", "--budget", "129"], "argument --budget: must be in [0, 128]"),
    (["--prompt", "x", "--budget", "-1"], "argument --budget: must be in [0, 128]"),
    (["--prompt", "x", "--budget", "4.5"], "argument --budget: invalid integer value"),
    (["--prompt", "x", "--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["--prompt", "x", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["--prompts", "{prompts}", "--tree-prompt", "3"], "argument --tree-prompt: must be < the 3 prompt(s)"),
    (["--prompts", "{prompts}", "--limit", "0"], "argument --limit: must be >= 1"),
    (["--prompts", "{tmp}/missing.jsonl"], "argument --prompts: "),
    (["--prompt", "x", "--draft", "{tmp}/nope"], "argument --draft: no model directory at"),
    (["--prompt", "x", "--draft-mode", "tree"], "argument --draft-mode: invalid choice"),
    (["--prompt", "x", "--draft", "{draft}@bogus"], "argument --draft: "),
]


@pytest.mark.parametrize("args,says", BAD, ids=[f"{i}_{'_'.join(a)[:24]}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_is_one_line_naming_the_argument_before_loading_and_writes_nothing(
        pair, tmp_path, capsys, no_model_load, args, says):
    target, draft, prompts = pair
    sub = {"{prompts}": str(prompts), "{tmp}": str(tmp_path), "{draft}": str(draft)}

    def fill(a):
        for k, v in sub.items():
            a = a.replace(k, v)
        return a

    has_draft = any(a == "--draft" for a in args)
    argv = ["draw-tree", "--target", str(target), *([] if has_draft else ["--draft", str(draft)]),
            "--output", str(tmp_path / "default.svg"), *[fill(a) for a in args]]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and out == "", err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglang-tev draw-tree: error: ") and fill(says) in lines[0], err
    assert list(tmp_path.iterdir()) == []


def test_errors_found_after_loading_name_their_argument_and_write_nothing(pair, tmp_path, capsys):
    target, draft, prompts = pair
    base = ["draw-tree", "--target", str(target), "--draft", str(draft), "--output", str(tmp_path / "t.svg"),
            "--bars", str(tmp_path / "b.svg")]
    # a DFlash drafter has no selector: no lattice tree
    rc, out, err = run_cli(base + ["--prompt", "x", "--draft-mode", "lattice"], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "argument --draft-mode:" in err and "selector" in err, err
    # a prompt past the target's 256 positions
    rc, out, err = run_cli(base + ["--prompt", "x = 1\n" * 200], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "argument --prompt:" in err and "positions" in err, err
    assert list(tmp_path.iterdir()) == []
