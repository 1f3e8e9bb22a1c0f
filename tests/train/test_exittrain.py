"""ExitTrain (paper §5, App. C.2): exit weights, the exit loss, the target's tree pass on the
sequence KV, the trainer with the exit term, and target rollouts.

Tiny random Qwen3 targets (vocab 128) and, for rollouts, the shipped tiny-code target (it has a
real tokenizer). Every run uses 1 thread, so CPU results are bit-reproducible.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sglang_tev.draft.ddtree import build_ddtree
from sglang_tev.tree import DraftTree, exit_law
from sglang_tev.train import ConfigError, Trainer, load_config, train
from sglang_tev.train.__main__ import main as cli_main
from sglang_tev.train.data import load_dataset
from sglang_tev.train.exit import (anchor_trees, default_anchors_per_forward,
                                   exit_weights, iter_tree_logits, kv_reuse_forward, score_trees)
from sglang_tev.train.losses import exit_loss
from sglang_tev.train.rollout import ensure_rollouts, read_prompts
from train_helpers import REPO, V, base_cfg, log_records, torchrun_two_ranks

ASSET = REPO / "sglang_tev" / "assets" / "tiny-code"


def exit_cfg(root: Path, out: str, mode: str = "exit", **kw) -> dict:
    cfg = base_cfg(root, out, **kw)
    cfg["loss"] = {"exit": {"mode": mode, "lambda": 2.0, "budget": 6}, **cfg.get("loss", {})}
    return cfg


def ragged_trees(H: int = 4) -> DraftTree:
    """Four hand-made trees of 9 slots: full, 5 valid, root only, 7 valid (depths <= 4)."""
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 6, 5],
                            [-1, 0, 1, 2, 0, 0, 0, 0, 0],
                            [-1, 0, 0, 0, 0, 0, 0, 0, 0],
                            [-1, 0, 0, 0, 1, 4, 2, 0, 0]])
    nvalid = torch.tensor([9, 5, 1, 7])
    valid = torch.arange(9)[None] < nvalid[:, None]
    tokens = (torch.arange(9)[None] * 3 + torch.arange(4)[:, None]) % 29  # distinct per tree
    tree = DraftTree.from_parents(parents, tokens, valid)
    assert tree.max_depth <= H
    return tree


# ---------------------------------------------------------------------------------------------
# exit_loss / exit_weights
# ---------------------------------------------------------------------------------------------

def test_exit_loss_equals_naive_per_node_loop_values_and_grads():
    torch.manual_seed(0)
    tree, H, Vd = ragged_trees(), 4, 29
    z = torch.randn(4, H, Vd, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, 9, dtype=torch.float64)
    term = exit_loss(z, tree, w)
    num, den = 0.0, 0
    for t in range(4):
        for v in range(1, 9):
            if tree.valid[t, v]:
                d = int(tree.depth[t, v])
                num = num - w[t, v] * torch.log_softmax(z[t, d - 1], -1)[tree.tokens[t, v]]
                den += 1
    assert float(term.denominator) == den == 8 + 4 + 0 + 6
    torch.testing.assert_close(term.numerator, num, rtol=1e-12, atol=1e-12)
    g_fast, = torch.autograd.grad(term.numerator, z)
    g_naive, = torch.autograd.grad(num, z)
    torch.testing.assert_close(g_fast, g_naive, rtol=1e-12, atol=1e-12)
    assert not term.denominator.requires_grad
    # padded slots and the root are ignored whatever their weight
    w2 = w.clone()
    w2[~tree.valid] = 123.0
    w2[:, 0] = 77.0
    torch.testing.assert_close(exit_loss(z, tree, w2).numerator, term.numerator)
    with pytest.raises(ValueError, match="weights"):
        exit_loss(z, tree, w[:, :5])
    with pytest.raises(ValueError, match="tree"):
        exit_loss(z[:, :2], tree, w)


def test_exit_and_prefix_weights_sums_root_horizon_and_no_grad():
    torch.manual_seed(1)
    tree = ragged_trees()
    probs = torch.softmax(torch.randn(4, 9, 29, dtype=torch.float64) * 2, -1).requires_grad_()
    law = exit_law(tree, probs.detach())
    we = exit_weights(tree, probs, "exit")
    wp = exit_weights(tree, probs, "prefix")
    assert not we.requires_grad and not wp.requires_grad and we.dtype == torch.float64
    assert (we[:, 0] == 0).all() and (wp[:, 0] == 0).all()
    assert (we[~tree.valid] == 0).all() and (wp[~tree.valid] == 0).all()
    nonroot = tree.valid.clone()
    nonroot[:, 0] = False
    torch.testing.assert_close(we[nonroot], law.w[nonroot])
    torch.testing.assert_close(we.sum(1), 1 - law.w[:, 0])               # paper §5: 1 - w(root)
    torch.testing.assert_close(wp.sum(1), we.sum(1))
    scale = (1 - law.w[:, 0]) / law.coverage                               # (1 - w(root)) / C_p
    torch.testing.assert_close(wp[:2], (law.P * scale[:, None])[:2] * nonroot[:2])
    # hard-horizon leaves switched off: depth-2 nodes zeroed, the rest unchanged, sums still equal
    we2 = exit_weights(tree, probs, "exit", include_horizon_leaves=False, horizon=2)
    wp2 = exit_weights(tree, probs, "prefix", include_horizon_leaves=False, horizon=2)
    at_h = tree.depth == 2
    assert at_h.any() and (we2[at_h] == 0).all() and (wp2[at_h] == 0).all()
    torch.testing.assert_close(we2[~at_h], we[~at_h])
    torch.testing.assert_close(wp2.sum(1), we2.sum(1))
    with pytest.raises(ValueError, match="horizon"):
        exit_weights(tree, probs, "exit", include_horizon_leaves=False)
    with pytest.raises(ValueError, match="mode"):
        exit_weights(tree, probs, "none")
    with pytest.raises(ValueError, match="target_probs"):
        exit_weights(tree, probs[:, :3], "exit")


def _independent_weights(parents, tokens, probs, mode):
    """Per-node weights of one tree from an enumeration of target continuations (float64, no
    library code): w(v) = mass exiting at v, P(v) = product of edge probabilities on the path."""
    import numpy as np
    from exact_law import enumerate_exit_law

    n = len(parents)
    w = enumerate_exit_law(parents, tokens, probs).sum(1)
    P, depth = np.ones(n), np.zeros(n, dtype=int)
    for v in range(1, n):
        P[v] = P[parents[v]] * probs[parents[v], tokens[v]]
        depth[v] = depth[parents[v]] + 1
    reach = P[1:].sum()   # no node reached (possible under the greedy law): nothing to rescale
    out = {"exit": w, "reach": P, "exit_depth": w * depth,
           "prefix": P * (1 - w[0]) / reach if reach > 0 else 0 * P}[mode].copy()
    out[0] = 0.0
    return out, depth


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
@pytest.mark.parametrize("mode", ["exit", "prefix", "reach", "exit_depth"])
def test_each_weight_mode_and_temperature_against_enumerated_trees_values_and_grads(mode, temperature):
    import numpy as np
    from exact_law import random_tree, stack_trees
    from sglang_tev.train.exit import target_law

    rng = np.random.default_rng(7)
    Vs, width = 6, 9
    trees = [random_tree(rng, n, Vs) for n in (9, 6, 1, 8)]
    tree = stack_trees(trees, width)
    H = tree.max_depth
    logits = torch.from_numpy(rng.normal(0, 2, (4, width, Vs)))
    z = torch.from_numpy(rng.normal(0, 1, (4, H, Vs))).requires_grad_()
    term = exit_loss(z, tree, exit_weights(tree, target_law(logits, temperature), mode))
    num, den = torch.zeros((), dtype=torch.float64), 0
    for t, (par, tok) in enumerate(trees):
        lg = logits[t, : len(par)].numpy()
        if temperature == 0:
            probs = np.eye(Vs)[lg.argmax(-1)]
        else:
            e = np.exp(lg / temperature - (lg / temperature).max(-1, keepdims=True))
            probs = e / e.sum(-1, keepdims=True)
        wts, depth = _independent_weights(par, tok, probs, mode)
        for v in range(1, len(par)):
            num = num - float(wts[v]) * torch.log_softmax(z[t, depth[v] - 1], -1)[tok[v]]
            den += 1
    assert float(term.denominator) == den
    torch.testing.assert_close(term.numerator, num, rtol=1e-10, atol=1e-12)
    g, = torch.autograd.grad(term.numerator, z)
    g_ref, = torch.autograd.grad(num, z)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
    assert float(term.numerator) > 0


def test_temperature_one_is_the_old_softmax_bit_for_bit(qwen):
    """``loss.exit.temperature = 1`` (the default) computes exactly what the code computed before
    the option existed: ``softmax(logits.float())`` into ``exit_law`` for every chunk."""
    from transformers import DynamicCache

    from sglang_tev.hf.runtime import cache_kwargs
    from sglang_tev.train.exit import target_law

    for dt in (torch.float32, torch.bfloat16, torch.float64):
        x = (torch.randn(3, 5, 40) * 4).to(dt)
        assert torch.equal(target_law(x, 1.0), torch.softmax(x if dt == torch.float64 else x.float(), -1))
    torch.manual_seed(4)
    ids = torch.randint(2, V, (2, 24))
    anchors = torch.tensor([[3, 9, 15], [5, 11, 17]])
    tree = anchor_trees(torch.randn(6, 3, V), 7, ids.gather(1, anchors).reshape(-1))
    dec = qwen.get_decoder()
    with torch.no_grad():
        cache = DynamicCache()
        last = dec(input_ids=ids, use_cache=True, **cache_kwargs(dec, cache)).last_hidden_state
        new = score_trees(kv_reuse_forward(dec, cache), qwen.lm_head, last, tree, anchors, 2, temperature=1.0)
        parts = [(rows, exit_law(sub, torch.softmax(logits.float(), dim=-1), validate=False))
                 for rows, sub, logits in iter_tree_logits(kv_reuse_forward(dec, cache), qwen.lm_head, last,
                                                           tree, anchors, 2)]
        order = torch.cat([r for r, _ in parts]).argsort()
        for f in ("P", "rho", "w", "coverage"):
            old = torch.cat([getattr(law, f) for _, law in parts])[order]
            assert torch.equal(getattr(new, f), old), f
        cold = score_trees(kv_reuse_forward(dec, cache), qwen.lm_head, last, tree, anchors, 2, temperature=0.0)
        assert not torch.equal(cold.w, new.w)
        with pytest.raises(ValueError, match="temperature"):
            score_trees(kv_reuse_forward(dec, cache), qwen.lm_head, last, tree, anchors, 2, temperature=-1.0)


def test_anchor_trees_are_the_inference_trees_and_invalid_anchors_are_root_only():
    torch.manual_seed(2)
    logits = torch.randn(3, 4, 11)
    roots = torch.tensor([5, 6, 7])
    ref = build_ddtree(logits, 9, roots)
    tree = anchor_trees(logits.requires_grad_(), 9, roots, torch.tensor([True, False, True]))
    for t in (0, 2):
        assert torch.equal(tree.parents[t], ref.parents[t]) and torch.equal(tree.tokens[t], ref.tokens[t])
        assert torch.equal(tree.valid[t], ref.valid[t])
    assert tree.valid[1].tolist() == [True] + [False] * 9 and tree.tokens[1, 0] == 6


def test_default_chunk_bounds_rows_and_mask():
    assert default_anchors_per_forward(4, 512, 64) == 8          # rows per forward <= S
    assert default_anchors_per_forward(64, 4096, 64) == 3           # 64 x 192 x 4288 <= 64 Mi
    assert default_anchors_per_forward(64, 16384, 64) == 1          # never below one anchor
    c = default_anchors_per_forward(2, 1000, 10, max_mask_elements=100_000)   # the mask binds
    assert 2 * c * 10 * (1000 + c * 10) <= 100_000 < 2 * (c + 1) * 10 * (1000 + (c + 1) * 10)


# ---------------------------------------------------------------------------------------------
# the target's tree pass
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen(tiny):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny / "target", dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


@pytest.mark.parametrize("chunk", [1, 2, None])
def test_tree_rows_equal_plain_forward_over_each_nodes_full_prefix(qwen, chunk):
    """Node v of anchor a is scored on x[0..a] ‖ π(v) at position a + depth(v), reusing the
    sequence KV; every row equals a plain forward over that full prefix (fp32)."""
    from transformers import DynamicCache

    torch.manual_seed(3)
    ids = torch.randint(2, V, (2, 20))
    anchors = torch.tensor([[3, 9, 15], [5, 11, 17]])
    keep = torch.tensor([True, True, False, True, True, True])
    draft = torch.randn(6, 3, V)
    tree = anchor_trees(draft, 7, ids.gather(1, anchors).reshape(-1), keep)
    dec = qwen.get_decoder()
    from sglang_tev.hf.runtime import cache_kwargs
    with torch.no_grad():
        cache = DynamicCache()
        last = dec(input_ids=ids, use_cache=True, **cache_kwargs(dec, cache)).last_hidden_state
        kv_before = [layer.keys.clone() for layer in cache.layers]
        got = {}
        for rows, sub, logits in iter_tree_logits(kv_reuse_forward(dec, cache), qwen.lm_head, last,
                                                  tree, anchors, chunk):
            for i, r in enumerate(rows.tolist()):
                got[r] = (sub, i, logits[i])
        assert sorted(got) == list(range(6))
        assert [layer.keys.shape[2] for layer in cache.layers] == [20] * len(cache.layers)
        assert all(torch.equal(a, layer.keys) for a, layer in zip(kv_before, cache.layers))
        checked = 0
        for t in range(6):
            sub, i, lg = got[t]
            b, j = divmod(t, 3)
            a = int(anchors[b, j])
            for v in range(tree.num_nodes):
                if not tree.valid[t, v]:
                    continue
                path = [u for u in range(v + 1) if tree.ancestor_mask[t, v, u] and u > 0]
                seq = torch.cat([ids[b, :a + 1], tree.tokens[t, path]])
                ref = qwen(input_ids=seq[None]).logits[0, -1]
                torch.testing.assert_close(lg[v], ref, rtol=1e-4, atol=1e-5)
                checked += 1
        assert checked == 5 * 8 + 1
        law = score_trees(kv_reuse_forward(dec, cache), qwen.lm_head, last, tree, anchors, chunk)
        full = torch.stack([got[t][2] for t in range(6)])
        ref_law = exit_law(tree, torch.softmax(full, -1))
        for f in ("P", "rho", "w", "coverage"):
            torch.testing.assert_close(getattr(law, f), getattr(ref_law, f))
        assert law.coverage[2] == 0 and float(law.w[2, 0]) == pytest.approx(1.0)  # the invalid anchor's root-only tree


def test_sliding_window_target_is_refused_with_the_key(tmp_path, tiny):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
                      max_window_layers=0, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "swa")
    with pytest.raises(ConfigError) as e:
        train(exit_cfg(tiny, "swa_run", target=str(tmp_path / "swa")))
    assert e.value.key == "loss.exit.mode" and "sliding" in str(e.value)
    assert not (tiny / "swa_run").exists()
    res = train(base_cfg(tiny, "swa_dense", target=str(tmp_path / "swa"), max_steps=1))
    assert res.complete  # the dense objective needs no tree mask


# ---------------------------------------------------------------------------------------------
# trainer
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exit_straight(tiny):
    return train(exit_cfg(tiny, "ex_straight", max_steps=6))


def test_exit_run_logs_terms_coverage_and_stage_times(tiny, exit_straight):
    recs = [json.loads(ln) for ln in (tiny / "ex_straight" / "train_log.jsonl").read_text().splitlines()]
    assert len(recs) == 6
    for r in recs:
        for k in ("loss_tok", "loss_exit", "coverage", "w_root", "est_tau", "ms_draft", "ms_build",
                  "ms_tree_forward", "ms_backward"):
            assert k in r, k
        assert r["est_tau"] == pytest.approx(1 + r["coverage"]) and 0 <= r["coverage"] <= 3
        assert 0 <= r["w_root"] <= 1 and r["loss_exit"] > 0
        assert r["loss"] == pytest.approx(r["loss_tok"] + 2.0 * r["loss_exit"])


def test_exit_term_is_the_only_difference(tiny, exit_straight):
    """lambda 0 trains bit-identically to mode none; lambda > 0 changes the drafter."""
    none = train(base_cfg(tiny, "ex_none", max_steps=3))
    zero = train(exit_cfg(tiny, "ex_zero", max_steps=3, loss={"exit": {"mode": "exit", "lambda": 0.0, "budget": 6}}))
    a = (none.final_dir / "model.safetensors").read_bytes()
    assert (zero.final_dir / "model.safetensors").read_bytes() == a
    some = train(exit_cfg(tiny, "ex_some", max_steps=3))
    assert (some.final_dir / "model.safetensors").read_bytes() != a
    prefix = train(exit_cfg(tiny, "ex_prefix", mode="prefix", max_steps=3))
    assert (prefix.final_dir / "model.safetensors").read_bytes() not in (a, (some.final_dir / "model.safetensors").read_bytes())


def test_reach_exit_depth_and_greedy_law_train_differently(tiny, exit_straight):
    some = train(exit_cfg(tiny, "ex_some3", max_steps=2))
    finals = {(some.final_dir / "model.safetensors").read_bytes()}
    for name, loss in (("reach", {"mode": "reach"}), ("exit_depth", {"mode": "exit_depth"})):
        res = train(exit_cfg(tiny, f"ex_{name}", max_steps=2, loss={"exit": {"lambda": 2.0, "budget": 6, **loss}}))
        assert res.complete and res.last_log["loss_exit"] > 0
        finals.add((res.final_dir / "model.safetensors").read_bytes())
    assert len(finals) == 3
    # the same step-1 trees (same data, anchors and drafter) weighed under the greedy law instead
    cold = train(exit_cfg(tiny, "ex_t0", max_steps=1, loss={"exit": {"mode": "exit", "lambda": 2.0, "budget": 6, "temperature": 0.0}}))
    warm = log_records(some.output_dir)[0]
    assert cold.last_log["coverage"] != warm["coverage"] and cold.last_log["w_root"] != warm["w_root"]
    with pytest.raises(ConfigError) as e:
        load_config(exit_cfg(tiny, "x", loss={"exit": {"mode": "exit", "temperature": -1}}))
    assert e.value.key == "loss.exit.temperature"
    with pytest.raises(ConfigError, match="exit_depth") as e:
        load_config(exit_cfg(tiny, "x", loss={"exit": {"mode": "bogus"}}))


def test_checkpoint_written_before_the_temperature_key_resumes_at_its_default(tiny, exit_straight):
    out = tiny / "ex_old_ckpt"
    shutil.copytree(exit_straight.output_dir, out)
    for _, ck in __import__("sglang_tev.train.trainer", fromlist=["x"]).checkpoint_dirs(out):
        st = torch.load(ck / "trainer_state.pt", weights_only=False)
        del st["fingerprint"]["loss.exit.temperature"]     # as written before the key existed
        torch.save(st, ck / "trainer_state.pt")
    assert Trainer(load_config(exit_cfg(tiny, "ex_old_ckpt", max_steps=6))).step == 6
    with pytest.raises(ConfigError) as e:
        Trainer(load_config(exit_cfg(tiny, "ex_old_ckpt", max_steps=6,
                                     loss={"exit": {"mode": "exit", "lambda": 2.0, "budget": 6, "temperature": 0.5}})))
    assert e.value.key == "loss.exit.temperature"


def test_exit_resume_is_bit_identical(tiny, exit_straight):
    out = tiny / "ex_resumed"
    first = train(exit_cfg(tiny, "ex_resumed", max_steps=6, stop_at_step=3))
    assert not first.complete and first.step == 3
    second = train(exit_cfg(tiny, "ex_resumed", max_steps=6))
    assert second.complete and second.step == 6
    assert (second.final_dir / "model.safetensors").read_bytes() == \
        (exit_straight.final_dir / "model.safetensors").read_bytes()
    assert log_records(out) == log_records(exit_straight.output_dir)


def test_resume_from_another_mode_is_refused_naming_the_key(tiny, exit_straight):
    with pytest.raises(ConfigError) as e:
        train(exit_cfg(tiny, "ex_straight", mode="prefix", max_steps=6))
    assert e.value.key == "loss.exit.mode" and "draft_init" in str(e.value)
    with pytest.raises(ConfigError) as e:
        train(base_cfg(tiny, "ex_straight", max_steps=6))
    assert e.value.key.startswith("loss.exit")


def test_max_steps_grows_on_resume_with_the_schedule_rederived(tiny, exit_straight, capsys):
    shutil.copytree(exit_straight.output_dir, tiny / "ex_longer")
    capsys.readouterr()
    res = train(exit_cfg(tiny, "ex_longer", max_steps=8))
    assert res.complete and res.step == 8
    err = capsys.readouterr().err
    assert "max_steps 6 -> 8" in err and "re-derived" in err
    recs = [json.loads(ln) for ln in (tiny / "ex_longer" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 9))
    tr = Trainer(load_config(exit_cfg(tiny, "ex_longer", max_steps=8)))   # lr of step 8 on the new schedule
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(tr.scheduler.lr_lambdas[0](8) * 3e-3)
    with pytest.raises(ConfigError, match="may only grow") as e:
        train(exit_cfg(tiny, "ex_longer", max_steps=7))
    assert e.value.key == "max_steps"


def test_torchrun_two_gloo_ranks_match_one_process_with_exit_term(tiny, tmp_path):
    one = train(exit_cfg(tiny, "ex_ddp1", max_steps=2, batch_size=4))
    proc = torchrun_two_ranks(exit_cfg(tiny, "ex_ddp2", max_steps=2, batch_size=2), tmp_path)
    assert proc.stderr.count("drafter exported to") == 1 and "exported to None" not in proc.stderr
    a, b = log_records(one.output_dir), log_records(tiny / "ex_ddp2")
    for ra, rb in zip(a, b):
        for k in ("loss", "loss_tok", "loss_exit", "coverage", "w_root"):
            assert ra[k] == pytest.approx(rb[k], rel=1e-5), k
    wa = load_file(str(one.final_dir / "model.safetensors"))
    wb = load_file(str(tiny / "ex_ddp2" / "final" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_data_and_seq_len_errors_come_before_the_target_loads(tiny, tmp_path, monkeypatch):
    import sglang_tev.train.trainer as trainer_mod

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the cheap checks")
    monkeypatch.setattr(trainer_mod, "load_target", no_load)
    with pytest.raises(FileNotFoundError, match="^data"):
        train(base_cfg(tiny, "early1", data=str(tmp_path / "none.npy")))
    with pytest.raises(ConfigError) as e:
        train(base_cfg(tiny, "early2", seq_len=10_000))
    assert e.value.key == "seq_len"
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "   "}\n\n')
    with pytest.raises(ValueError, match="^rollout.prompts: .*no usable row"):
        train(base_cfg(tiny, "early3", data=None, rollout={"prompts": str(bad)}))


def test_cli_rank_one_prints_nothing(tiny, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    overrides = [f"{k}={json.dumps(v)}" for k, v in base_cfg(tiny, "rank1", max_steps=1).items()]
    assert cli_main(overrides) == 0
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------
# rollouts
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def code_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(ASSET / "target", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(ASSET / "target")


def write_prompts(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


PROMPTS = ["def add(a, b):", "class Stack:", "import os\n\ndef", "for i in range(", "    return"]


def rollout_cfg(prompts: Path, **kw):
    from sglang_tev.train.config import RolloutConfig
    d = dict(prompts=str(prompts), max_new_tokens=6, batch_size=2, temperature=1.0)
    d.update(kw)
    return RolloutConfig(**d)


def test_greedy_rollouts_equal_plain_greedy_decoding(code_target, tmp_path):
    model, tok = code_target
    cfg = rollout_cfg(write_prompts(tmp_path / "p.jsonl", PROMPTS), temperature=0.0)
    path = ensure_rollouts(model, tok, cfg, ASSET / "target", tmp_path / "out", torch.device("cpu"), progress=False)
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(5))
    for r, text in zip(rows, PROMPTS):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert r["prompt_ids"] == ids
        out = list(ids)
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([out])).logits[0, -1].argmax())
                out.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        assert r["response_ids"] == out[len(ids):], text
        assert r["finish_reason"] == ("stop" if out[-1] == tok.eos_token_id else "length")
    meta = json.loads((tmp_path / "out" / "rollouts.jsonl.meta.json").read_text())
    assert meta["temperature"] == 0.0 and meta["max_new_tokens"] == 6 and len(meta["prompts_sha256"]) == 64
    # trained on like chat data: only the response is supervised
    ds = load_dataset(path, 64, tok)
    for seq, mask, r in zip(ds.sequences, ds.loss_masks, rows):
        assert seq.tolist() == r["prompt_ids"] + r["response_ids"]
        assert mask.tolist() == [False] * len(r["prompt_ids"]) + [True] * len(r["response_ids"])


def test_rollout_cache_is_reused_completed_and_checked(code_target, tmp_path, monkeypatch):
    model, tok = code_target
    cfg = rollout_cfg(write_prompts(tmp_path / "p.jsonl", PROMPTS))
    full = ensure_rollouts(model, tok, cfg, ASSET / "target", tmp_path / "a", torch.device("cpu"), progress=False)
    text = full.read_text()
    # a run killed mid-write: 3 rows and a torn 4th line; the rerun completes it to the same file
    part_dir = tmp_path / "b"
    part_dir.mkdir()
    shutil.copy(full.with_name(full.name + ".meta.json"), part_dir / "rollouts.jsonl.meta.json")
    lines = text.splitlines(keepends=True)
    (part_dir / "rollouts.jsonl").write_text("".join(lines[:3]) + lines[3][:10])
    done = ensure_rollouts(model, tok, cfg, ASSET / "target", part_dir, torch.device("cpu"), progress=False)
    assert done.read_text() == text
    # a finished cache is reused without generating (another run pointing at it too)

    def no_generate(*a, **k):
        raise AssertionError("regenerated a finished cache")
    monkeypatch.setattr(model, "generate", no_generate)
    shared = rollout_cfg(cfg.prompts, cache=str(full))
    assert ensure_rollouts(model, tok, shared, ASSET / "target", tmp_path / "other", torch.device("cpu"),
                           progress=False) == full
    with pytest.raises(ConfigError) as e:        # other settings, same cache
        ensure_rollouts(model, tok, rollout_cfg(cfg.prompts, cache=str(full), temperature=0.7),
                        ASSET / "target", tmp_path / "other", torch.device("cpu"), progress=False)
    assert e.value.key == "rollout" and "temperature" in str(e.value)
    stray = tmp_path / "stray.jsonl"
    stray.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError) as e:
        ensure_rollouts(model, tok, rollout_cfg(cfg.prompts, cache=str(stray)), ASSET / "target",
                        tmp_path, torch.device("cpu"), progress=False)
    assert e.value.key == "rollout.cache"


def test_rollout_prompt_files_bad_rows_name_the_key(code_target, tmp_path):
    _, tok = code_target
    p = tmp_path / "p.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="^rollout.prompts: line 1: .*chat template"):
        read_prompts(p, tok)
    p.write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="^rollout.prompts: line 1"):
        read_prompts(p, tok)
    p.write_text('{"prompt": ""}\n{"messages": []}\n')
    with pytest.raises(ValueError, match="no usable row"):
        read_prompts(p, tok)
    with pytest.raises(FileNotFoundError, match="^rollout.prompts"):
        read_prompts(tmp_path / "none.jsonl", tok)
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["a", "", "b", "c"]))
    assert [t for t, _ in read_prompts(p, tok, limit=2)] == ["a", "b"]
    # pre-tokenized rows (eval-drafter writes them): used as they are
    p.write_text('{"prompt_ids": [5, 6, 7]}\n{"prompt_ids": []}\n{"prompt": "a"}\n')
    assert [ids for _, ids in read_prompts(p, tok)] == [[5, 6, 7], tok("a", add_special_tokens=False)["input_ids"]]
    for bad in ('{"prompt_ids": [1, -2]}', '{"prompt_ids": "12"}', '{"prompt_ids": [1], "prompt": "x"}'):
        p.write_text(bad + "\n")
        with pytest.raises(ValueError, match="^rollout.prompts: line 1"):
            read_prompts(p, tok)


def test_train_on_rollouts_end_to_end(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    cfg = {"target": str(ASSET / "target"), "draft_init": str(ASSET / "draft"), "output_dir": str(tmp_path / "run"),
           "max_steps": 2, "seq_len": 64, "batch_size": 2, "num_anchors": 2, "threads": 1,
           "progress": False, "tensorboard": False, "lr": 1e-4,
           "rollout": {"prompts": str(prompts), "max_new_tokens": 40, "batch_size": 5},
           "loss": {"exit": {"mode": "exit", "budget": 8}}}
    res = train(cfg)
    assert res.complete and (tmp_path / "run" / "rollouts.jsonl").exists()
    assert res.last_log["anchors"] > 0 and "loss_exit" in res.last_log


def test_data_without_a_trainable_block_is_refused(tiny, tmp_path):
    """Documents shorter than a block: no step could train anything, so the run refuses to start
    instead of logging loss 0 and exporting an unchanged drafter."""
    import numpy as np
    short = tmp_path / "short.npy"
    np.save(short, np.array([10, 20, 0, 30, 40, 0] * 20, dtype=np.uint16))   # 2-token documents
    with pytest.raises(ConfigError, match="trainable block") as e:
        train(base_cfg(tiny, "short_docs", data=str(short), max_steps=1))
    assert e.value.key == "data" and not (tiny / "short_docs" / "final").exists()
