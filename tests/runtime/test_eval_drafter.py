"""``sglang-tev eval-drafter`` (sglang_tev.train.drafter_eval): the exact per-position 1 + C_p
against the runtime's own rounds (TEV Monte Carlo, T = 1), against a per-node computation that
enumerates target continuations, the cluster-robust paired SE, and the command.

The shipped tiny-code pair is the model (a real drafter: trees with several accepted tokens);
the command's tests use the tiny random pair of ``tiny_pair``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from exact_law import enumerate_exit_law
from sglang_tev.sampling import SamplingParams
from sglang_tev.train.drafter_eval import cluster_se, paired_difference, sequence_block_stats
from sglang_tev.train.exit import take_trees
from sglang_tev.verify import verify_tree
from exact_law import node_laws

REPO = Path(__file__).resolve().parents[2]
ASSET = REPO / "sglang_tev" / "assets" / "tiny-code"
CODE = ("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f]\n"
        "\n\ndef count_words(text):\n    counts = {}\n    for word in text.split():\n")


@pytest.fixture(scope="module")
def shipped():
    from sglang_tev.draft.dflash import DFlashDraftModel
    from sglang_tev.hf.runtime import SpeculativeGenerator
    from sglang_tev.train.trainer import load_target

    target, tok = load_target(ASSET / "target", torch.device("cpu"), torch.float32)
    draft = DFlashDraftModel.from_pretrained(ASSET / "draft", dtype=torch.float32).eval()
    gen = SpeculativeGenerator.from_pretrained(ASSET / "target", ASSET / "draft", dtype=torch.float32)
    ids = tok(CODE, add_special_tokens=False)["input_ids"]
    return target, draft, gen, ids


class _Stop(Exception):
    pass


def runtime_round(gen, ids, budget, temperature, monkeypatch):
    """The runtime's first TEV round on the context ``ids`` (root ``ids[-1]``): its tree and the
    target's tree logits, captured at the verify stage (the round is then abandoned)."""
    from sglang_tev.hf import round as hf_round

    got = {}

    def capture(state, tree, logits, *args, **kwargs):
        got["tree"], got["logits"] = tree, logits.clone()
        raise _Stop

    monkeypatch.setattr(hf_round, "verify", capture)
    with pytest.raises(_Stop):
        gen.generate(list(ids), method="tev", budget=budget, sampling=SamplingParams(temperature=temperature),
                     seed=0, max_new_tokens=16, ignore_eos=True)
    monkeypatch.undo()
    return got["tree"], got["logits"]



def test_exact_block_length_matches_runtime_trees_per_node_enumeration_and_tev_monte_carlo(shipped, monkeypatch):
    target, draft, gen, ids = shipped
    x = torch.tensor([ids])
    anchors = torch.tensor([[12, 25, len(ids) - 2]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    stats = sequence_block_stats(target, [draft], x, anchors, keep, budgets=[4, 16], temperatures=[1.0])[0]
    for B in (4, 16):
        br = stats[(B, 1.0)]
        # the breakdown partitions the unit exit mass; C_p = Σ_v w(v)·depth(v) (Eq. 6)
        parts = br.w_root + br.w_inner + br.w_cut + br.w_horizon
        torch.testing.assert_close(parts, torch.ones_like(parts), rtol=0, atol=1e-5)
        torch.testing.assert_close(br.w_depth.sum(1), torch.ones_like(parts), rtol=0, atol=1e-5)
        depths = torch.arange(br.w_depth.shape[1], dtype=torch.float64)
        torch.testing.assert_close(br.block_len, 1 + (br.w_depth * depths).sum(1), rtol=0, atol=1e-5)
    zs = []
    for j, a in enumerate(anchors[0].tolist()):
        ctx = ids[: a + 1]
        # B = 4: each node's target law from a plain forward over x_{<=a} ‖ π(v); the exit law by
        # walking every target continuation (no library exit law)
        tree, _ = runtime_round(gen, ctx, 4, 1.0, monkeypatch)
        parents, tokens, probs = node_laws(target, ctx, tree, lambda lg: torch.softmax(lg, -1))
        law = enumerate_exit_law(parents, tokens, probs)
        depth = [0] * len(parents)
        for v in range(1, len(parents)):
            depth[v] = depth[parents[v]] + 1
        exact = 1 + float(sum(depth[v] * law[v].sum() for v in range(len(parents))))
        assert len(parents) == 5 and max(depth) >= 2
        assert float(stats[(4, 1.0)].block_len[j]) == pytest.approx(exact, abs=2e-4)
        # the breakdown: the root, nodes with drafted children, leaves above the horizon (H = 15)
        mass = law.sum(1)
        inner = sum(mass[v] for v in range(1, len(parents)) if v in parents)
        br = stats[(4, 1.0)]
        assert float(br.w_root[j]) == pytest.approx(mass[0], abs=2e-4)
        assert float(br.w_inner[j]) == pytest.approx(inner, abs=2e-4)
        assert float(br.w_cut[j]) == pytest.approx(1 - mass[0] - inner, abs=2e-4) and float(br.w_horizon[j]) == 0
        for d in range(max(depth) + 1):
            assert float(br.w_depth[j, d]) == pytest.approx(sum(mass[v] for v in range(len(parents)) if depth[v] == d),
                                                           abs=2e-4)
        if j == 0:
            continue
        # B = 16: the runtime's own round (its drafter cache, builder and tree forward), then TEV on
        # it with 8 000 seeded draws: mean accept length + 1 against the exact 1 + C_p
        tree, logits = runtime_round(gen, ctx, 16, 1.0, monkeypatch)
        value = float(stats[(16, 1.0)].block_len[j])
        acc = []
        rows = take_trees(tree, torch.zeros(1000, dtype=torch.long))
        for s in range(8):
            out = verify_tree(rows, logits.expand(1000, -1, -1), method="tev", sampling=SamplingParams(temperature=1.0),
                              generator=torch.Generator().manual_seed(s), validate=False)
            acc.append(out.accept_len.double() + 1)
        acc = torch.cat(acc)
        se = float(acc.std()) / math.sqrt(acc.numel())
        assert se > 0
        zs.append((float(acc.mean()) - value) / se)
        assert abs(zs[-1]) < 5, (a, float(acc.mean()), value, se)
    assert max(float(stats[(16, 1.0)].block_len.max()), 0) > 1.3  # trees that accept: the check has teeth


def test_cluster_se_is_calibrated_and_self_difference_is_exactly_zero():
    rng = np.random.default_rng(0)
    m = 40
    means, ses, diffs, dses = [], [], [], []
    for _ in range(400):  # prompts with their own length and level, positions correlated within a prompt
        n = rng.integers(5, 60, size=m)
        level = rng.normal(2.0, 0.4, size=m)
        a = [float(np.sum(level[i] + rng.normal(0, 0.5, n[i]))) for i in range(m)]
        b = [ai - float(np.sum(0.05 + 0.1 * rng.normal(0, 1) + rng.normal(0, 0.05, n[i]))) for i, ai in enumerate(a)]
        mean, se = cluster_se(a, n.tolist())
        d, dse = paired_difference(a, b, n.tolist())
        means.append(mean)
        ses.append(se)
        diffs.append(d)
        dses.append(dse)
    # the SE predicts the spread of the estimate over repeated prompt sets (within 15 %)
    assert np.std(means) == pytest.approx(np.mean(ses), rel=0.15)
    assert np.std(diffs) == pytest.approx(np.mean(dses), rel=0.15)
    # a naive SE over positions (ignoring the prompt clusters) would be far too small
    assert np.mean(dses) > 2 * 0.05 / math.sqrt(40 * 32)
    assert paired_difference(a, list(a), n.tolist()) == (0.0, 0.0)
    assert math.isnan(cluster_se([3.0], [2])[1])
    with pytest.raises(ValueError, match="counts"):
        cluster_se([1.0, 2.0], [1])
    with pytest.raises(ValueError, match="counts"):
        cluster_se([1.0], [0])


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tiny_pair import build_pair

    root = tmp_path_factory.mktemp("evalpair")
    target, draft = build_pair(root)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n"
                               for t in ["def add(a, b):", "class Stack:", "import os", "for i in range(3):"]))
    return target, draft, prompts


def run_cli(argv, capsys):
    from sglang_tev.cli import main

    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_same_drafter_twice_gives_zero_difference_and_reuses_the_cache(pair, tmp_path, capsys, monkeypatch):
    target, draft, prompts = pair
    out = tmp_path / "ev"
    argv = ["eval-drafter", "--target", str(target), "--draft", str(draft), "--draft", str(draft),
            "--prompts", str(prompts), "--temperatures", "0,1", "--budgets", "3,6", "--max-new-tokens", "6",
            "--output", str(out), "--no-progress"]
    rc, stdout, err = run_cli(argv, capsys)
    assert rc == 0, err
    rep = json.loads((out / "results.json").read_text())
    assert rep["drafters"] == ["draft", "draft#2"] and len(rep["results"]) == 2 * 2 * 2
    assert rep["rows"] == ["draft[marginal]", "draft#2[marginal]"] and rep["tree_modes"] == ["auto"]
    assert (out / "table.txt").read_text().strip() in stdout and (out / "exit_mass_by_depth.png").stat().st_size > 0
    for r in rep["results"]:
        assert r["positions"] > 4 * 3 and r["prompts"] == 4
        assert 1.0 <= r["block_len"] <= 4.0 and len(r["w_depth"]) == 4      # block size 4: depths 0..3
        assert sum(r["w_depth"]) == pytest.approx(1.0, abs=1e-5)
        if r["drafter"] == "draft#2[marginal]":
            assert r["diff_vs_first"]["block_len"] == 0.0 and r["diff_vs_first"]["block_len_se"] == 0.0
    # T = 0 continuations are the target's greedy ones; a rerun reuses every cached continuation
    conts = [json.loads(ln) for ln in Path(rep["continuations"]["0"]).read_text().splitlines()]
    assert len(conts) == 4 and all(1 <= len(c["response_ids"]) <= 6 for c in conts)
    import sglang_tev.train.rollout as rollout

    def no_generate(*a, **k):
        raise AssertionError("regenerated cached continuations")
    monkeypatch.setattr(rollout, "_generate", no_generate)
    rc, _, err = run_cli(argv + ["--overwrite"], capsys)
    assert rc == 0, err
    again = json.loads((out / "results.json").read_text())
    assert [r["block_len"] for r in again["results"]] == [r["block_len"] for r in rep["results"]]


def test_cli_budget_zero_is_the_root_alone(pair, tmp_path, capsys):
    """B = 0 (no tree) is a valid budget for generate and bench; here it used to crash in the
    target's tree forward. With the root alone, every exit is at the root: 1 + C_p = 1 exactly."""
    target, draft, prompts = pair
    out = tmp_path / "b0"
    rc, _, err = run_cli(["eval-drafter", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                          "--temperatures", "0,1", "--budgets", "0,3", "--max-new-tokens", "5",
                          "--output", str(out), "--no-progress"], capsys)
    assert rc == 0, err
    res = json.loads((out / "results.json").read_text())["results"]
    zero = [r for r in res if r["budget"] == 0]
    assert len(zero) == 2 and all(r["block_len"] == 1.0 and r["block_len_se"] == 0.0 for r in zero)
    assert all(r["w_root"] == pytest.approx(1.0, abs=1e-6) and r["w_cut"] == 0.0 for r in zero)
    # the random pair's drafter still leaves some T = 1 mass below the root at B = 3
    assert [r["block_len"] > 1.0 for r in res if r["budget"] == 3 and r["temperature"] == 1] == [True]


@pytest.mark.parametrize("extra, arg", [
    (["--budgets", "2000"], "--budgets"), (["--temperatures", "-1"], "--temperatures"),
    (["--temperatures", "1,1"], "--temperatures"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--limit", "0"], "--limit"), (["--max-new-tokens", "300"], "--prompts"),
])
def test_cli_bad_arguments_name_the_argument_and_write_nothing(pair, tmp_path, capsys, extra, arg):
    target, draft, prompts = pair
    out = tmp_path / "bad"
    rc, _, err = run_cli(["eval-drafter", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                          "--output", str(out), "--no-progress", *extra], capsys)
    assert rc == 2 and f"argument {arg}:" in err and "Traceback" not in err
    assert not (out / "results.json").exists()


@pytest.mark.parametrize("flag, where, says", [
    ("--cache-dir", "/proc/sglang-tev-cache", "cannot create folders under /proc"),
    ("--cache-dir", "{file}/c", "is not a directory"),
    ("--output", "{dangling}", "is a link to a missing"),
    ("--output", "{long}", "too long"),
    ("--cache-dir", "{new}/{long_name}", "longer than"),
])
def test_cli_unwritable_folders_are_refused_before_loading(pair, tmp_path, capsys, monkeypatch, flag, where, says):
    """Each used to fail only after the models loaded, with a traceback (or blamed --prompts)."""
    import sglang_tev.train.drafter_eval as de

    def no_eval(*a, **k):
        raise AssertionError("evaluate_drafters ran")
    monkeypatch.setattr(de, "evaluate_drafters", no_eval)
    target, draft, prompts = pair
    (tmp_path / "f").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    where = where.format(file=tmp_path / "f", dangling=tmp_path / "dangling", long=tmp_path / ("a" * 300),
                         new=tmp_path / "new", long_name="b" * 300)
    opts = {"--output": str(tmp_path / "out"), flag: where}
    rc, _, err = run_cli(["eval-drafter", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                          "--no-progress", *[x for kv in opts.items() for x in kv]], capsys)
    assert rc == 2 and f"argument {flag}:" in err and says in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "f"]        # nothing created


def test_cli_missing_models_and_prompts(pair, tmp_path, capsys):
    target, draft, prompts = pair
    base = ["eval-drafter", "--output", str(tmp_path / "o"), "--no-progress"]
    assert "argument --draft:" in run_cli(base + ["--target", str(target), "--prompts", str(prompts)], capsys)[2]
    assert "argument --draft:" in run_cli(base + ["--target", str(target), "--draft", str(tmp_path / "none"),
                                                  "--prompts", str(prompts)], capsys)[2]
    assert "argument --prompts:" in run_cli(base + ["--target", str(target), "--draft", str(draft),
                                                    "--prompts", str(tmp_path / "none.jsonl")], capsys)[2]
    assert "argument --draft:" in run_cli(base + ["--target", str(target), "--draft", str(target),
                                                  "--prompts", str(prompts)], capsys)[2]
    err = run_cli(base + ["--target", str(draft), "--draft", str(draft), "--prompts", str(prompts)], capsys)[2]
    assert "argument --target:" in err and "give it as the draft" in err


def test_trainer_evaluation_reports_the_same_block_length(shipped, tmp_path):
    """``evaluate(exit_budget=B)`` (the trainer's evaluation on ``eval_data``) is eval-drafter's
    metric at the evaluation's anchors."""
    from sglang_tev.train.data import collate, load_dataset, valid_anchor_positions
    from sglang_tev.train.trainer import evaluate

    target, draft, _, ids = shipped
    np.save(tmp_path / "ev.npy", np.array((ids + [0]) * 3, dtype=np.uint16))
    ds = load_dataset(tmp_path / "ev.npy", 96)
    ev = evaluate(draft, target, ds, stride=5, max_windows=2, sep_ids=[0], exit_budget=8, temperatures=[0.0, 1.0])
    K = draft.config.block_size
    sums, count = {0.0: 0.0, 1.0: 0.0}, 0
    for i in range(2):
        x, lmask = collate(ds, [i * len(ds) // 2], 0)
        anchors = torch.arange(1, x.shape[1] - K + 1, 5)[None]
        keep = valid_anchor_positions(x, lmask, K, [0]).gather(1, anchors)
        st = sequence_block_stats(target, [draft], x, anchors, keep, [8], [0.0, 1.0])[0]
        for t in sums:
            sums[t] += float(st[(8, t)].block_len[keep[0]].sum())
        count += int(keep.sum())
    assert ev["anchors"] == count > 10
    for t in sums:
        assert ev[f"block_len_T{t:g}"] == pytest.approx(sums[t] / count, rel=1e-5)
    assert ev["block_len_T0"] != ev["block_len_T1"] and 0 <= ev["w_root_T1"] <= 1


@pytest.mark.parametrize("kw, key", [
    (dict(budgets=[-1]), "budgets"), (dict(budgets=[]), "budgets"), (dict(temperatures=[float("nan")]), "temperatures"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(draft_paths=[]), "draft"), (dict(prompts=[]), "prompts"),
    (dict(output_dir=None), "cache_dir"),
])
def test_python_api_bad_inputs_name_the_argument_before_loading(kw, key, tmp_path, monkeypatch):
    import sglang_tev.train.target as target_mod
    from sglang_tev.hf.datasets import Prompt
    from sglang_tev.train.drafter_eval import evaluate_drafters

    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    args = dict(target_path=ASSET / "target", draft_paths=[ASSET / "draft"], prompts=[Prompt(id="p", text="def f():")],
                output_dir=tmp_path / "o")
    args.update(kw)
    with pytest.raises(ValueError, match=f"^{key}"):
        evaluate_drafters(**args)
    assert not (tmp_path / "o").exists()


def test_breakdown_and_temperature_errors():
    from sglang_tev.draft.ddtree import build_ddtree
    from sglang_tev.train.drafter_eval import exit_breakdown, laws_by_temperature
    from sglang_tev.tree import exit_law

    tree = build_ddtree(torch.randn(2, 3, 7), 5, torch.tensor([1, 2]))
    law = exit_law(tree, torch.softmax(torch.randn(2, 6, 7), -1))
    with pytest.raises(ValueError, match="horizon"):
        exit_breakdown(tree, law, tree.max_depth - 1)
    with pytest.raises(ValueError, match="temperature"):
        laws_by_temperature(None, None, torch.zeros(1, 4, 2), tree, torch.zeros(1, 2, dtype=torch.long), [1.0, -0.5])


def test_breakdown_of_a_hand_tree_with_a_horizon_leaf():
    """root -a-> u (depth 1) -b-> h (depth 2 = H), root -c-> l (depth 1, no children): V = 4."""
    from sglang_tev.train.drafter_eval import exit_breakdown
    from sglang_tev.tree import DraftTree, exit_law

    tree = DraftTree.from_parents(torch.tensor([[-1, 0, 1, 0]]), torch.tensor([[3, 0, 1, 2]]))
    p = torch.tensor([[[0.5, 0.0, 0.3, 0.2],      # root: a = 0 (0.5), c = 2 (0.3); exits 0.2
                       [0.1, 0.6, 0.2, 0.1],      # u: b = 1 (0.6); exits 0.4
                       [0.25, 0.25, 0.25, 0.25],  # h: horizon leaf
                       [1.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)  # l: leaf
    br = exit_breakdown(tree, exit_law(tree, p), horizon=2)
    assert float(br.w_root) == pytest.approx(0.2)
    assert float(br.w_inner) == pytest.approx(0.5 * 0.4)
    assert float(br.w_cut) == pytest.approx(0.3)
    assert float(br.w_horizon) == pytest.approx(0.5 * 0.6)
    assert br.w_depth[0].tolist() == pytest.approx([0.2, 0.2 + 0.3, 0.3])
    assert float(br.block_len) == pytest.approx(1 + 0.5 + 0.3 + 0.3)
