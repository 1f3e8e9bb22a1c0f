"""The transformers runtime drafting DFlash2 trees over the selector lattice (issue 28 item 2).

Draft modes (``SpeculativeGenerator.generate(..., draft_mode=...)``, ``--draft-mode``):
``lattice`` (the default for a drafter with a selector: ``build_lattice_tree`` over the selector's
transition rows; with ``method="chain"`` the selector's own chain, ``selector_chain``) and
``marginal`` (the transformed per-depth marginals into ``build_ddtree``; with ``method="chain"``
the per-depth argmax chain). Greedy output = plain greedy decoding in every mode (ragged batch,
stop tokens, 200 tokens on the re-dressed shipped drafter, tau >= 2); the first two sampled tokens
follow the exact target law (chi-square) in the lattice and chain modes; the runtime's trees are
the one-sequence model's lattice trees, and differ from the marginal trees (negative control);
``bench`` reports per-mode stage times. CPU, float32, one thread.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from exact_law import chi_square_pvalue
from runtime_helpers import exact_two_token_law

import sglang_tev.hf.round as hf_round
from sglang_tev import SamplingParams, build_ddtree
from sglang_tev.draft.dflash import extract_context_features
from sglang_tev.draft.dflash2 import selector_walk
from sglang_tev.draft.lattice import build_lattice_tree
from sglang_tev.hf.bench import format_table, run_bench
from sglang_tev.hf.drafters import DFlashDrafter
from sglang_tev.hf.records import Request
from sglang_tev.hf.runtime import SpeculativeGenerator
from sglang_tev.testing.models import RAGGED, dflash_for, plain_greedy, qwen3
from dflash2_helpers import K, _runtime_dflash2, _shipped_as_dflash2

N_TOKENS = 200


@pytest.fixture(scope="module")
def shipped2(tmp_path_factory):
    """(generator over the re-dressed shipped DFlash2 drafter, its target dir, its draft dir)."""
    target_dir, draft_dir, _ = _shipped_as_dflash2(tmp_path_factory.mktemp("shipped2"))
    gen = SpeculativeGenerator.from_pretrained(target_dir, draft_dir, dtype=torch.float32, device="cpu")
    return gen, target_dir, draft_dir


@pytest.fixture(scope="module")
def tiny():
    """A random qwen3 target (V = 96) and a random DFlash2 drafter for it (k = 4, K = 6)."""
    target = qwen3(0)
    return target, _runtime_dflash2(target)


def _record_trees(monkeypatch):
    """Wrap round.build: every round's (drafted, tree) is appended to the returned list."""
    seen = []
    real = hf_round.build

    def spy(state, drafted, roots, depth_cap):
        tree = real(state, drafted, roots, depth_cap)
        seen.append((drafted, tree))
        return tree

    monkeypatch.setattr(hf_round, "build", spy)
    return seen


# ------------------------------------------------------------------------------------- greedy
def test_greedy_equals_plain_decoding_in_every_mode(shipped2):
    """Ragged batch of three prompts, 200 tokens: every mode x method equals plain greedy
    decoding; the trained (re-dressed) drafter keeps mean accept_len >= 2 on the lattice trees."""
    gen, _, _ = shipped2
    prompts = ["def merge_sorted(a, b):\n", "class Stack:\n    def __init__(self):",
               "import os\n\ndef walk(path):\n    # list every file"]
    ids = [gen.tokenizer(p)["input_ids"] for p in prompts]
    refs = [plain_greedy(gen.target, p, N_TOKENS) for p in ids]
    assert gen.has_selector and gen.resolve_draft_mode("auto", "tev") == "lattice"
    runs = [("lattice", m) for m in ("tev", "chain", "predraw", "sequential", "greedy")]
    runs += [("marginal", "tev"), ("marginal", "chain")]
    acc = {}
    for mode, method in runs:
        res = gen.generate(ids, method=method, budget=16, max_new_tokens=N_TOKENS, ignore_eos=True, draft_mode=mode)
        for r, ref in zip(res, refs):
            assert r.token_ids == ref, (mode, method)
        acc[(mode, method)] = sum(r.accept_len for x in res for r in x.rounds) / sum(len(x.rounds) for x in res)
    assert acc[("lattice", "tev")] >= 2.0, acc
    assert acc[("lattice", "chain")] >= 1.0, acc  # the chain is deep: positions and compaction are exercised


def test_greedy_stops_depth_caps_and_batch_on_a_random_drafter(tiny, monkeypatch):
    """Random tiny DFlash2 drafter, ragged prompts (lengths 5, 11, 1, 17) in batches of 2 (refills
    and row moves), max_new_tokens that cap the depth, two stop tokens: one from a greedy
    continuation (it cuts the output) and one the drafter proposes often with children below it
    (it must become a leaf). Every mode's output = plain greedy (cut after a stop, inclusive); no
    stop token has children in any tree of any mode."""
    target, drafter = tiny
    gen = SpeculativeGenerator(target, DFlashDrafter(drafter, target))
    seen = _record_trees(monkeypatch)
    gen.generate(RAGGED, method="tev", budget=8, max_new_tokens=23, ignore_eos=True, draft_mode="lattice")
    inner = {}
    for _, tree in seen:  # tokens of nodes that have children in the unstopped lattice trees
        for i in range(tree.parents.shape[0]):
            for v in set(tree.parents[i][tree.valid[i]].tolist()) - {-1, 0}:
                inner[int(tree.tokens[i, v])] = inner.get(int(tree.tokens[i, v]), 0) + 1
    cut = plain_greedy(target, RAGGED[1], 12)[9]
    leaf = max((t for t in inner if t != cut), key=inner.get)
    stops = {cut, leaf}
    refs = [plain_greedy(target, p, 23, stops=stops) for p in RAGGED]
    assert any(len(r) < 23 for r in refs)  # a stop cuts at least one row
    for mode in ("lattice", "marginal"):
        for method in ("tev", "chain", "sequential"):
            seen.clear()
            res = gen.generate(RAGGED, method=method, budget=8, max_new_tokens=23, stop_token_ids=sorted(stops),
                               ignore_eos=True, draft_mode=mode, batch_size=2)
            for r, ref in zip(res, refs):
                assert r.token_ids == ref, (mode, method)
            stopped = caps = 0
            for _, tree in seen:
                for i in range(tree.parents.shape[0]):
                    valid = tree.valid[i]
                    stop_nodes = {v for v in range(1, valid.shape[0]) if valid[v] and int(tree.tokens[i, v]) in stops}
                    assert not stop_nodes & set(tree.parents[i][valid].tolist()), ("a stop token got children", mode,
                                                                                   method)
                    stopped += bool(stop_nodes)
                caps += int(tree.depth.masked_fill(~tree.valid, 0).max()) < 5
            assert caps > 0, (mode, method)  # rows near max_new_tokens get shallower trees
            if method != "chain" or mode == "lattice":
                assert stopped > 0, (mode, method)  # the leaf rule was exercised


# ----------------------------------------------------------------- the runtime's trees are the model's
def _one_sequence_lattice(target, drafter, prompt):
    """The model's own draft of the first round of ``prompt`` (context = prompt[:-1], root = its
    last token): (transformed logits [1, K-1, V], SelectorLattice)."""
    with torch.no_grad():
        hs = target(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
        feats = extract_context_features(hs, drafter.target_layer_ids)
        return drafter.draft_lattice(target.get_input_embeddings(), target.get_output_embeddings(),
                                     torch.tensor([prompt[-1]]), len(prompt) - 1, feats, drafter.new_cache())


def test_first_round_trees_are_the_models_and_lattice_differs_from_marginal(tiny, monkeypatch):
    """Batched ragged rows, first round: the runtime's lattice tree = build_lattice_tree on the
    one-sequence model's lattice, its selector chain = selector_walk's greedy walk, its marginal
    tree = build_ddtree on the model's transformed logits; and (negative control) the lattice and
    marginal trees differ, as do the selector chain and the per-depth argmax chain."""
    target, drafter = tiny
    gen = SpeculativeGenerator(target, DFlashDrafter(drafter, target))
    seen = _record_trees(monkeypatch)
    B = 10
    first = {}
    for mode in ("lattice", "marginal"):
        for method in ("tev", "chain"):
            seen.clear()
            gen.generate(RAGGED, method=method, budget=B, max_new_tokens=8, ignore_eos=True, draft_mode=mode)
            first[(mode, method)] = seen[0]
    differ = {"tree": 0, "chain": 0}
    for i, p in enumerate(RAGGED):
        if len(p) < 2:
            continue  # no context: the drafter reads nothing; still in the batch above
        logits, lat = _one_sequence_lattice(target, drafter, p)
        root = torch.tensor([p[-1]])
        trees = {}
        for key, want in (
            (("lattice", "tev"), build_lattice_tree(lat.candidate_ids, lat.transition_logq, B, root)),
            (("marginal", "tev"), build_ddtree(logits, B, root)),
        ):
            drafted, tree = first[key]
            got = (tree.parents[i], tree.tokens[i], tree.valid[i])
            assert torch.equal(got[0], want.parents[0]) and torch.equal(got[1], want.tokens[0]), key
            assert torch.equal(got[2], want.valid[0]), key
            trees[key] = got
        drafted, _ = first[("lattice", "tev")]
        torch.testing.assert_close(drafted.transition_logq[i], lat.transition_logq[0], rtol=1e-4, atol=1e-5)
        walk, _, _ = selector_walk(lat, 0.0)
        chain = first[("lattice", "chain")][1]
        assert torch.equal(chain.tokens[i, 1:], walk[0]) and torch.equal(chain.parents[i], torch.arange(-1, 5))
        argmax = first[("marginal", "chain")][1]
        assert torch.equal(argmax.tokens[i, 1:], logits[0].argmax(-1))
        differ["tree"] += not torch.equal(trees[("lattice", "tev")][1], trees[("marginal", "tev")][1]) or \
            not torch.equal(trees[("lattice", "tev")][0], trees[("marginal", "tev")][0])
        differ["chain"] += not torch.equal(chain.tokens[i], argmax.tokens[i])
    assert differ["tree"] >= 2 and differ["chain"] >= 1, differ


# --------------------------------------------------------------------------------- sampled law
def _law_pair(vocab=8):
    tgt = qwen3(7, vocab=vocab, layers=1)
    tc = tgt.config
    drafter = dflash_for(tgt, seed=5, block_size=4, num_hidden_layers=1, architectures=["DFlash2DraftModel"],
                         dflash_config=dict(mask_token_id=vocab - 1, target_layer_ids=[0, tc.num_hidden_layers - 1],
                                            conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4,
                                            output_multiplier=1.5, final_logit_softcapping=6.0))
    with torch.no_grad():  # a selector whose bilinear term matters
        drafter.candidate_selector.predecessor_codebook.mul_(40)
        drafter.candidate_selector.successor_codebook.mul_(40)
    return tgt, drafter


@pytest.mark.parametrize("method,sampling", [
    ("tev", SamplingParams(temperature=1.0, top_k=5, top_p=0.9)),
    ("chain", SamplingParams(temperature=0.8)),
])
def test_sampled_law_of_first_two_tokens_lattice_and_chain(method, sampling):
    """V = 8: the law of the first two new tokens, exact from V target forwards, against 4000
    samples drawn in batches of 100 rows (chi-square, alpha 1e-6), on lattice trees (tev) and
    on the selector's sampled chain (chain, verified by tev); the drafts produced many of them."""
    vocab = 8
    tgt, drafter = _law_pair(vocab)
    prompt = [1, 5, 2]
    exact = exact_two_token_law(tgt, prompt, sampling, vocab)
    gen = SpeculativeGenerator(tgt, DFlashDrafter(drafter, tgt))
    counts = np.zeros((vocab, vocab))
    accepted, rows, calls = 0, 100, 40
    for c in range(calls):
        reqs = [Request(prompt, sampling, seed=c * rows + i, max_new_tokens=2, ignore_eos=True) for i in range(rows)]
        for r in gen.generate_batch(reqs, method=method, budget=6, draft_mode="lattice"):
            counts[r.token_ids[0], r.token_ids[1]] += 1
            accepted += r.rounds[0].accept_len
    assert accepted / (rows * calls) > 0.3, accepted / (rows * calls)
    assert chi_square_pvalue(counts, exact) > 1e-6


def test_sampled_chain_follows_the_row_generator(tiny, monkeypatch):
    """At T > 0 the selector chain is a sampled walk: with the same seed the same output (and the
    same chains), with other seeds other chains (not the greedy walk every time)."""
    target, drafter = tiny
    gen = SpeculativeGenerator(target, DFlashDrafter(drafter, target))
    seen = _record_trees(monkeypatch)
    sp = SamplingParams(temperature=1.5)
    a = gen.generate(RAGGED[1], method="chain", sampling=sp, seed=3, max_new_tokens=10, ignore_eos=True)
    chains_a = [t.tokens.clone() for _, t in seen]
    seen.clear()
    b = gen.generate(RAGGED[1], method="chain", sampling=sp, seed=3, max_new_tokens=10, ignore_eos=True)
    assert a.token_ids == b.token_ids and all(torch.equal(x, t.tokens) for x, (_, t) in zip(chains_a, seen))
    firsts = set()
    for s in range(12):
        seen.clear()
        gen.generate(RAGGED[1], method="chain", sampling=sp, seed=s, max_new_tokens=2, ignore_eos=True)
        firsts.add(tuple(seen[0][1].tokens[0].tolist()))
    assert len(firsts) > 3


# ---------------------------------------------------------------------------------- bad inputs
def test_lattice_modes_refused_for_a_v1_drafter(tmp_path, capsys):
    target = qwen3(0)
    gen = SpeculativeGenerator(target, DFlashDrafter(dflash_for(target), target))
    assert not gen.has_selector and gen.resolve_draft_mode("auto", "tev") == "marginal"
    for method in ("tev", "chain"):
        with pytest.raises(ValueError, match="draft_mode 'lattice'.*candidate selector"):
            gen.generate([1, 2, 3], method=method, draft_mode="lattice", max_new_tokens=2)
    with pytest.raises(ValueError, match="draft_mode must be one of"):
        gen.generate([1, 2, 3], draft_mode="tree", max_new_tokens=2)
    # v1 in marginal / auto mode: unchanged behaviour
    assert gen.generate([1, 2, 3], method="chain", draft_mode="auto", max_new_tokens=6, ignore_eos=True).token_ids \
        == plain_greedy(target, [1, 2, 3], 6)
    from sglang_tev.cli import main

    from sglang_tev.hf.assets import ASSETS_DIR

    v1 = ["--target", str(Path(ASSETS_DIR) / "target"), "--draft", str(Path(ASSETS_DIR) / "draft")]  # DFlash v1
    rc = main(["generate", *v1, "--draft-mode", "lattice", "--device", "cpu", "--max-new-tokens", "2", "def f():"])
    err = capsys.readouterr().err
    assert rc == 2 and "argument --draft-mode" in err and "candidate selector" in err, err
    rc = main(["generate", "--draft-mode", "beam", "def f():"])
    assert rc == 2 and "--draft-mode" in capsys.readouterr().err
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    rc = main(["bench", *v1, "--dataset", str(data), "--draft-modes", "lattice", "--device", "cpu", "--output",
               str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "argument --draft-modes" in err and "candidate selector" in err, err
    rc = main(["bench", "--dataset", str(data), "--draft-modes", "lattice,beam", "--output", str(tmp_path / "o2")])
    assert rc == 2 and "--draft-modes" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- bench
def test_bench_reports_per_mode_stage_times(tiny):
    """run_bench with draft_modes lattice + marginal: one record per (method, budget, T, mode),
    each with its draft and build stage times, greedy outputs equal across modes; auto resolves
    to lattice (and runs once when listed beside it)."""
    target, drafter = tiny
    gen = SpeculativeGenerator(target, DFlashDrafter(drafter, target))
    recs = run_bench(gen, [RAGGED[0], RAGGED[1]], budgets=[8], temperatures=[0.0, 1.0], max_new_tokens=8,
                     methods=["autoregressive", "chain", "tev"], draft_modes=["auto", "lattice", "marginal"],
                     repeats=1, output_dir=None, progress=False, warmup=False, log=lambda m: None)
    keys = [(r["method"], r["budget"], r["temperature"], r["draft_mode"]) for r in recs]
    assert keys == [(m, b, T, dm) for T in (0.0, 1.0) for m, b, dm in
                    [("autoregressive", None, None), ("chain", None, "lattice"), ("chain", None, "marginal"),
                     ("tev", 8, "lattice"), ("tev", 8, "marginal")]]
    for r in recs:
        if r["method"] != "autoregressive":
            assert r["stage_ms"]["draft"] > 0 and r["stage_ms"]["build"] > 0, r
    table = format_table(recs)
    assert "lattice" in table and "marginal" in table and "build ms" in table
    with pytest.raises(ValueError, match="draft_modes: unknown"):
        run_bench(gen, [RAGGED[0]], budgets=[8], temperatures=[0.0], draft_modes=["beam"], output_dir=None)


def test_bench_cli_draft_modes_side_by_side(shipped2, tmp_path, capsys):
    """`sglang-tev bench --draft-modes lattice,marginal` on a DFlash2 checkpoint: results.json and
    the printed table hold both modes; meta.json lists them."""
    from sglang_tev.cli import main

    _, target_dir, draft_dir = shipped2
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    out = tmp_path / "bench"
    rc = main(["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu", "--dataset",
               str(data), "--methods", "chain,tev", "--budgets", "8", "--temperatures", "0", "--max-new-tokens", "12",
               "--repeats", "1", "--no-progress", "--draft-modes", "lattice,marginal", "--output", str(out),
               "--no-chat-template"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    recs = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["draft_mode"]) for r in recs] == [("chain", "lattice"), ("chain", "marginal"),
                                                              ("tev", "lattice"), ("tev", "marginal")]
    assert json.loads((out / "meta.json").read_text())["draft_modes"] == ["lattice", "marginal"]
    assert "lattice" in stdout and "marginal" in stdout
    lines = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    assert len({tuple(x["new_token_ids"]) for x in lines}) == 1  # greedy: every mode decodes the same text


# --------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("method,temperature", [("tev", 0.0), ("tev", 1.0), ("chain", 1.0)])
def test_lattice_round_makes_one_host_sync(shipped2, method, temperature):
    """On the round's GPU code path (level-wise lattice builder, selector chain without host
    reads), counted on CPU: one decision read per batched round, everything else per call."""
    from sglang_tev.testing.host_sync import HostSyncCounter, gpu_code_paths

    gen, _, _ = shipped2
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    with gpu_code_paths(), HostSyncCounter(include=("sglang_tev/",)) as c:
        results = gen.generate(prompts, method=method, budget=16, max_new_tokens=[40, 24, 32], draft_mode="lattice",
                               sampling=SamplingParams(temperature=temperature), seed=3)
    per_row = [len(r.rounds) for r in results]
    sites = c.by_site()
    decision = sum(n for (file, _, op), n in sites.items() if file.endswith("sglang_tev/verify/output.py"))
    assert max(per_row) >= 8 and max(per_row) <= decision <= sum(per_row), (per_row, c.format())
    others = {k: n for k, n in sites.items() if not k[0].endswith("sglang_tev/verify/output.py")}
    assert all(n <= 4 for n in others.values()), others


def test_shorter_block_and_static_shapes_in_lattice_mode(tiny):
    """block_size below the drafter's (fewer slots in the lattice and the chain) and fixed forward
    shapes (the CUDA-graph layout) keep greedy = plain decoding."""
    target, drafter = tiny
    gen = SpeculativeGenerator(target, DFlashDrafter(drafter, target), static_shapes=True)
    refs = [plain_greedy(target, p, 20) for p in RAGGED]
    for method in ("tev", "chain"):
        for K in (3, 6):
            res = gen.generate(RAGGED, method=method, budget=5, block_size=K, max_new_tokens=20, ignore_eos=True,
                               draft_mode="lattice")
            assert [r.token_ids for r in res] == refs, (method, K)
            assert max(x.tree_nodes for r in res for x in r.rounds) <= (6 if method == "tev" else K)
