"""``sglang-tev eval-drafter --tree-modes``: a DFlash2 drafter measured as its lattice DDTree, its
marginal DDTree and its greedy chain (sglang_tev.train.drafter_eval, issue 28).

The independent check: for a few roots, the drafter's own INFERENCE draft at that context
(``DFlashDraftModel.draft_lattice``: cache-based forward, logit transform, selector lattice), the
tree built from it by the inference builders, the target's law on every node from plain forwards
over ``x_{<=a} ‖ π(v)``, and the exit law by enumerating target continuations
(:func:`~sglang_tev.testing.exact_law.enumerate_exit_law`): its ``1 + C_p`` and exit mass by depth
must equal eval-drafter's, which runs the training-time block forward + transform + lattice.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from exact_law import enumerate_exit_law
from exact_law import node_laws
from sglang_tev.draft.ddtree import build_ddtree, build_ddtree_topk
from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel, extract_context_features
from sglang_tev.draft.dflash2 import selector_walk
from sglang_tev.draft.lattice import build_lattice_tree
from sglang_tev.train.drafter_eval import sequence_block_stats
from sglang_tev.tree import DraftTree

MODES = ["lattice", "marginal", "chain"]
DFLASH2_KEYS = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=4, selector_top_k=4,
                    output_multiplier=0.6, final_logit_softcapping=2.0)


def _dflash2_dir(root, v1_dir, scale=40.0, seed=0):
    """A random DFlash2 drafter (conv, selector, logit transform) fitting tiny_pair's target, written
    next to its v1 drafter; codebooks scaled so the selector's bilinear term matters."""
    cfg = json.loads((v1_dir / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(DFLASH2_KEYS)
    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig.from_dict(cfg))
    v1 = DFlashDraftModel.from_pretrained(v1_dir, dtype=torch.float32)
    model.load_state_dict(v1.state_dict(), strict=False)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 1:].normal_(0, 0.1)
        model.candidate_selector.predecessor_codebook.mul_(scale)
        model.candidate_selector.successor_codebook.mul_(scale)
    out = root / "draft2"
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny_pair import build_pair

    from sglang_tev.train.target import load_target

    root = tmp_path_factory.mktemp("treemodes")
    target_dir, v1_dir = build_pair(root)
    d2_dir = _dflash2_dir(root, v1_dir)
    target, _ = load_target(target_dir, torch.device("cpu"), torch.float32)
    d2 = DFlashDraftModel.from_pretrained(d2_dir, dtype=torch.float32).eval()
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["def add(a, b):", "class Stack:"]))
    return target, d2, target_dir, v1_dir, d2_dir, prompts


SMALL_V = 16


@pytest.fixture(scope="module")
def small():
    """A random qwen3 target with a 16-token vocabulary and a random DFlash2 drafter for it (K = 4,
    k = 4): trees cover much of the target's mass, so 1 + C_p is well above 1 in every mode."""
    from sglang_tev.testing.models import dflash_for, qwen3

    target = qwen3(4, vocab=SMALL_V, layers=2)
    tc = target.config
    d2 = dflash_for(target, seed=6, block_size=4, architectures=["DFlash2DraftModel"],
                    dflash_config=dict(mask_token_id=SMALL_V - 1, target_layer_ids=[0, tc.num_hidden_layers - 1],
                                       **{**DFLASH2_KEYS, "conv_group_size": 8}))
    v1 = dflash_for(target, seed=6, block_size=4)
    return target, d2, v1


def _inference_draft(target, drafter, ctx):
    """The drafter's inference draft of a round rooted at ``ctx[-1]`` (context ``ctx[:-1]``)."""
    with torch.no_grad():
        hs = target(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states
        feats = extract_context_features(hs, drafter.config.target_layer_ids)
        return drafter.draft_lattice(target.get_input_embeddings(), target.get_output_embeddings(),
                                     torch.tensor([ctx[-1]]), len(ctx) - 1, feats, drafter.new_cache())


def _chain(root, tokens):
    n = len(tokens)
    return DraftTree.from_parents(torch.arange(-1, n)[None], torch.tensor([[root, *tokens]]))


def _exact(target, ctx, tree, temperature):
    """(1 + C_p, exit mass by depth) of ``tree`` under the target's law at ``temperature``: plain
    forwards per node, exit law by enumeration."""
    parents, tokens, probs = node_laws(
        target, ctx, tree, lambda lg: torch.nn.functional.one_hot(lg.argmax(), lg.numel()).double()
        if temperature == 0 else torch.softmax(lg / temperature, -1))
    mass = enumerate_exit_law(parents, tokens, probs).sum(1)
    depth = [0] * len(parents)
    for v in range(1, len(parents)):
        depth[v] = depth[parents[v]] + 1
    by_depth = np.zeros(max(depth) + 1)
    for v, d in enumerate(depth):
        by_depth[d] += mass[v]
    return 1 + float((np.arange(len(by_depth)) * by_depth).sum()), by_depth


def _reference_trees(target, drafter, ctx, B, zero_codebook=False):
    """Each mode's tree built from the inference draft (with a zero successor codebook the lattice
    and the chain are built WITHOUT the selector: the k-renormalised top-k DDTree, the argmax chain)."""
    logits, lat = _inference_draft(target, drafter, ctx)
    root = torch.tensor([ctx[-1]])
    if zero_codebook:
        top, ids = torch.topk(logits, drafter.config.selector_top_k, dim=-1)
        return {"lattice": build_ddtree_topk(torch.log_softmax(top, -1), ids, B, root),
                "marginal": build_ddtree(logits, B, root),
                "chain": _chain(ctx[-1], logits[0].argmax(-1).tolist())}
    return {"lattice": build_lattice_tree(lat.candidate_ids, lat.transition_logq, B, root),
            "marginal": build_ddtree(logits, B, root),
            "chain": _chain(ctx[-1], selector_walk(lat, 0.0)[0][0].tolist())}


def _sequence(seed=0, n=18, vocab=SMALL_V - 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("zero_codebook", [False, True])
def test_each_mode_equals_the_inference_draft_and_plain_forwards(small, zero_codebook):
    """Two sequences in one batch, anchors in chunks of 2 (the lattice is gathered across chunks),
    budgets 2 and 6, T = 0 and 1. ``zero_codebook``: with a zero successor codebook every selector
    row is the softmax of the top-k transformed logits renormalised over the k candidates, so the
    lattice tree is ``build_ddtree_topk`` on those and the chain is the argmax chain (built here
    without the selector). It is NOT the marginal tree: that one normalises over the vocabulary,
    which lowers each depth by a constant log-mass outside the top-k (checked: they differ)."""
    target, d2, _ = small
    if zero_codebook:
        d2 = copy.deepcopy(d2)
        with torch.no_grad():
            d2.candidate_selector.successor_codebook.zero_()
    seqs = [_sequence(0), _sequence(3)]
    x = torch.tensor(seqs)
    anchors = torch.tensor([[3, 8, 12], [2, 9, 14]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    B, temps = 6, [0.0, 1.0]
    stats = sequence_block_stats(target, [d2], x, anchors, keep, [2, B], temps, draft_chunk=2, tree_modes=[MODES])
    assert len(stats) == 3
    got = dict(zip(MODES, stats))
    # chain: the same breakdown under every budget (K-1 nodes whatever B)
    assert all(got["chain"][(2, t)] is got["chain"][(B, t)] for t in temps)
    differ = {"lattice_vs_marginal": 0, "chain_vs_argmax": 0}
    values = []
    for j, (bi, a) in enumerate((bi, a) for bi in range(2) for a in anchors[bi].tolist()):
        ids = seqs[bi]
        ctx = ids[: a + 1]
        trees = _reference_trees(target, d2, ctx, B, zero_codebook)
        for mode in MODES:
            n_nodes = int(trees[mode].valid.sum())
            assert n_nodes == (d2.config.block_size if mode == "chain" else B + 1)
            for t in temps:
                value, by_depth = _exact(target, ctx, trees[mode], t)
                br = got[mode][(B, t)]
                assert float(br.block_len[j]) == pytest.approx(value, abs=1e-4), (mode, a, t)
                values.append(value)
                np.testing.assert_allclose(br.w_depth[j, : len(by_depth)].double().numpy(), by_depth, atol=1e-4)
        if not zero_codebook:
            logits, _ = _inference_draft(target, d2, ctx)
            differ["chain_vs_argmax"] += trees["chain"].tokens[0, 1:].tolist() != logits[0].argmax(-1).tolist()
        differ["lattice_vs_marginal"] += any(
            abs(float(got["lattice"][(B, t)].block_len[j]) - float(got["marginal"][(B, t)].block_len[j])) > 1e-4
            for t in temps)
    assert np.mean(values) > 1.1 and max(values) > 1.5  # trees that accept: the check has teeth
    assert differ["lattice_vs_marginal"] >= 2, differ
    if not zero_codebook:  # the selector matters: its chain is not the argmax chain
        assert differ["chain_vs_argmax"] >= 1, differ


def test_transform_matters_and_v1_modes(small):
    """Teeth of the check above: the marginal tree of the UNtransformed logits differs from the
    transformed one at some root. A v1 drafter: ``auto`` = marginal, ``chain`` = the argmax chain,
    ``lattice`` refused (ValueError naming tree_modes)."""
    target, d2, v1 = small
    ids = _sequence(1)
    differ = 0
    for a in (4, 9, 13):
        ctx = ids[: a + 1]
        logits, _ = _inference_draft(target, d2, ctx)
        root = torch.tensor([ctx[-1]])
        with torch.no_grad():  # the same draft without the logit transform
            hs = target(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states
            hidden = d2._draft_hidden(target.get_input_embeddings(), root, a,
                                      extract_context_features(hs, d2.config.target_layer_ids), d2.new_cache(), None)
            raw = target.get_output_embeddings()(hidden).float()
        torch.testing.assert_close(d2.transform_logits(raw), logits)
        t1, t2 = build_ddtree(logits, 6, root), build_ddtree(raw, 6, root)
        differ += not (torch.equal(t1.tokens, t2.tokens) and torch.equal(t1.parents, t2.parents))
    assert differ >= 1
    x = torch.tensor([ids])
    anchors = torch.tensor([[5, 10]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    auto, chain = sequence_block_stats(target, [v1], x, anchors, keep, [4], [1.0], tree_modes=[["auto", "chain"]])
    (marg,) = sequence_block_stats(target, [v1], x, anchors, keep, [4], [1.0], tree_modes=["marginal"])
    assert torch.equal(auto[(4, 1.0)].block_len, marg[(4, 1.0)].block_len)
    for j, a in enumerate(anchors[0].tolist()):
        ctx = ids[: a + 1]
        with torch.no_grad():
            hs = target(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states
            lg = v1.draft_logits(target.get_input_embeddings(), target.get_output_embeddings(), torch.tensor([ctx[-1]]),
                                 a, extract_context_features(hs, v1.config.target_layer_ids), v1.new_cache())
        value, _ = _exact(target, ctx, _chain(ctx[-1], lg[0].argmax(-1).tolist()), 1.0)
        assert float(chain[(4, 1.0)].block_len[j]) == pytest.approx(value, abs=1e-4)
    with pytest.raises(ValueError, match="^tree_modes"):
        sequence_block_stats(target, [v1], x, anchors, keep, [4], [1.0], tree_modes=["lattice"])
    with pytest.raises(ValueError, match="^tree_modes"):
        sequence_block_stats(target, [v1], x, anchors, keep, [4], [1.0], tree_modes=["beam"])
    with pytest.raises(ValueError, match="^tree_modes"):
        sequence_block_stats(target, [v1, v1], x, anchors, keep, [4], [1.0], tree_modes=["auto"])


# ---------------------------------------------------------------------------------------------- CLI
def run_cli(argv, capsys):
    from sglang_tev.cli import main

    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_tree_modes_rows_notes_and_shared_cache(models, tmp_path, capsys):
    _, _, target, v1, d2, prompts = models
    cache = tmp_path / "cache"
    base = ["eval-drafter", "--target", str(target), "--prompts", str(prompts), "--temperatures", "0,1",
            "--max-new-tokens", "4", "--cache-dir", str(cache), "--no-progress"]
    rc, stdout, err = run_cli(base + ["--draft", str(v1), "--draft", str(d2), "--tree-modes", "marginal,lattice,chain",
                                      "--budgets", "2,5", "--output", str(tmp_path / "a")], capsys)
    assert rc == 0, err
    rep = json.loads((tmp_path / "a" / "results.json").read_text())
    rows = ["draft[marginal]", "draft[chain]", "draft2[marginal]", "draft2[lattice]", "draft2[chain]"]
    assert rep["rows"] == rows and rep["drafters"] == ["draft", "draft2"]
    assert rep["tree_modes"] == ["marginal", "lattice", "chain"]
    assert rep["notes"] == ["draft: no candidate selector, tree mode 'lattice' skipped"] and "note: draft:" in err
    assert len(rep["results"]) == 2 * 2 * len(rows)
    table = (tmp_path / "a" / "table.txt").read_text()
    assert table.strip() in stdout and all(r in table for r in rows)
    assert (tmp_path / "a" / "exit_mass_by_depth.png").stat().st_size > 0
    by = {(r["drafter"], r["temperature"], r["budget"]): r for r in rep["results"]}
    for t in (0.0, 1.0):
        for name in ("draft[chain]", "draft2[chain]"):  # the chain does not depend on B
            assert by[(name, t, 2)]["block_len"] == by[(name, t, 5)]["block_len"]
        for b in (2, 5):
            r = by[("draft2[lattice]", t, b)]
            assert r["tree_mode"] == "lattice" and r["drafter_name"] == "draft2"
            assert r["diff_vs_first"]["baseline"] == "draft[marginal]" and 1.0 <= r["block_len"] <= 4.0
    # the default (auto) on the same cache: no regeneration, draft2 measured as its lattice
    files = sorted(p.name for p in cache.iterdir())
    rc, _, err = run_cli(base + ["--draft", f"{d2}@marginal", "--draft", str(d2), "--budgets", "5",
                                 "--output", str(tmp_path / "b")], capsys)
    assert rc == 0, err
    again = json.loads((tmp_path / "b" / "results.json").read_text())
    assert again["rows"] == ["draft2[marginal]", "draft2#2[lattice]"]
    assert sorted(p.name for p in cache.iterdir()) == files
    assert again["continuations"] == rep["continuations"]
    b2 = {(r["drafter"], r["temperature"]): r for r in again["results"]}
    for t in (0.0, 1.0):
        assert b2[("draft2#2[lattice]", t)]["block_len"] == pytest.approx(by[("draft2[lattice]", t, 5)]["block_len"],
                                                                         abs=1e-9)
        d = b2[("draft2#2[lattice]", t)]["diff_vs_first"]
        assert d["block_len"] == pytest.approx(by[("draft2[lattice]", t, 5)]["block_len"]
                                               - by[("draft2[marginal]", t, 5)]["block_len"], abs=1e-9)


@pytest.mark.parametrize("extra, arg, says", [
    (["--tree-modes", "beam"], "--tree-modes", "subset of auto,marginal,lattice,chain"),
    (["--tree-modes", ""], "--tree-modes", "got nothing"),
    (["--tree-modes", "lattice"], "--tree-modes", "candidate selector"),
    (["--draft", "{v1}@lattice"], "--draft", "candidate selector"),
    (["--draft", "{v1}@beam"], "--draft", "after '@'"),
])
def test_cli_bad_tree_modes_name_the_argument(models, tmp_path, capsys, extra, arg, says):
    _, _, target, v1, _, prompts = models
    extra = [e.format(v1=v1) for e in extra]
    draft = [] if "--draft" in extra else ["--draft", str(v1)]
    out = tmp_path / "bad"
    rc, _, err = run_cli(["eval-drafter", "--target", str(target), *draft, "--prompts", str(prompts),
                          "--max-new-tokens", "2", "--output", str(out), "--no-progress", *extra], capsys)
    assert rc == 2 and f"argument {arg}:" in err and says in err and "Traceback" not in err, err
    assert not (out / "results.json").exists()


def test_cli_without_draft_measures_the_default_drafter(tmp_path, capsys):
    """No --draft: the shipped default drafter (DFlash2), measured in its auto mode (lattice)."""
    from sglang_tev.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    rc = main(["eval-drafter", "--prompts", str(data), "--max-new-tokens", "6", "--budgets", "4",
               "--temperatures", "0", "--no-chat-template", "--output", str(tmp_path / "out"), "--no-progress",
               "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    rep = json.loads((tmp_path / "out" / "results.json").read_text())
    assert rep["rows"] == ["draft2[lattice]"]
