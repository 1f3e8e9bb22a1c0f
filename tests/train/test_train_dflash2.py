"""Training DFlash2 drafters (issue 28 item 4): the selector objective, ExitTrain over lattice
trees, fresh init, the trainer end to end, and its export in z-lab's layout loading in the
reference package ``dflash`` 0.1.0 and in SGLang 0.5.23's DFlash2 modules.

Losses are checked against naive per-slot / per-node loops; the trainer on the tiny random Qwen3
target of tests/train/test_train.py (1 thread: CPU results are bit-reproducible).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from sglang_tev.draft.dflash import DFlashDraftModel
from sglang_tev.draft.dflash2 import CandidateSelector
from sglang_tev.draft.lattice import build_lattice_tree
from sglang_tev.train import ConfigError, Trainer, load_config, train
from sglang_tev.train.losses import lattice_exit_loss, selector_loss

from train_helpers import base_cfg, log_records

DFLASH2 = {"architecture": "DFlash2DraftModel", "conv_kernel_size": 2, "conv_group_size": 8,
           "selector_rank": 8, "selector_top_k": 4, "output_multiplier": 1.5, "final_logit_softcapping": 20.0}


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _selector(seed=0, hidden=12, vocab=40, rank=5, k=4, zero_successor=False):
    torch.manual_seed(seed)
    sel = CandidateSelector(hidden, vocab, rank, k)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 0.7)
        if zero_successor:
            sel.successor_codebook.zero_()
    return sel


# ---------------------------------------------------------------------------------------- losses
def test_teacher_forced_scores_are_the_lattice_rows():
    sel = _selector()
    b, D, V = 3, 5, 40
    hidden, logits = torch.randn(b, D, 12), torch.randn(b, D, V) * 2
    roots = torch.randint(0, V, (b,))
    lat = sel.lattice(hidden, logits, roots)
    for d in range(D):
        unary = logits[:, d].gather(-1, lat.candidate_ids[:, d])
        for p in range(sel.top_k):
            pred = roots if d == 0 else lat.candidate_ids[:, d - 1, p]
            got = sel.teacher_forced_scores(hidden[:, d], unary, lat.candidate_ids[:, d], pred)
            torch.testing.assert_close(got, lat.scores[:, d, p], rtol=1e-5, atol=1e-5)


def _naive_selector_loss(sel, hidden, logits, roots, labels, weights, target_logits=None, gold="strict"):
    b, n, D, _ = logits.shape
    num = den = 0.0
    tot = cov = hs = hu = 0.0
    for i in range(b):
        for j in range(n):
            for d in range(D):
                w = float(weights[i, j, d])
                top = logits[i, j, d].topk(sel.top_k)
                cand, unary = top.indices.tolist(), top.values
                gold_tok = int(labels[i, j, d])
                pred = int(roots[i, j]) if d == 0 else int(labels[i, j, d - 1])
                covered = gold_tok in cand
                tot += w
                if target_logits is None and gold == "insert" and not covered:
                    cand[-1] = gold_tok
                    unary = torch.cat([unary[:-1], logits[i, j, d, gold_tok].view(1)])
                s = []
                for c, u in zip(cand, unary):
                    bil = (sel.predecessor_codebook[pred] * sel.hidden_projection(hidden[i, j, d])
                           * sel.successor_codebook[c]).sum()
                    s.append(u + bil)
                s = torch.stack(s)
                logp = torch.log_softmax(s, -1)
                if covered:
                    cov += w
                    hs += w * (cand[int(s.argmax())] == gold_tok)
                    hu += w * (cand[0] == gold_tok)
                if target_logits is not None:
                    p = torch.softmax(target_logits[i, j, d], -1)[cand]
                    num = num + w * float(-(p / p.sum() * logp).sum())
                    den += w
                elif gold_tok in cand:
                    num = num + w * float(-logp[cand.index(gold_tok)])
                    den += w
    return num, den, [tot, cov, hs, hu]


@pytest.mark.parametrize("mode", ["strict", "insert", "target"])
def test_selector_loss_matches_a_naive_loop(mode):
    sel = _selector(1)
    b, n, D, V = 2, 3, 4, 40
    torch.manual_seed(3)
    hidden, logits = torch.randn(b, n, D, 12), torch.randn(b, n, D, V) * 1.5
    labels = torch.randint(0, V, (b, n, D))
    labels[0, 0] = logits[0, 0].argmax(-1)                       # some covered slots, some not
    labels[1, 1, :2] = logits[1, 1, :2].topk(3, -1).indices[:, 2]
    roots = torch.randint(0, V, (b, n))
    weights = torch.rand(b, n, D)
    weights[1, 2] = 0.0                                          # a dropped anchor
    tl = torch.randn(b, n, D, V) if mode == "target" else None
    gold = "insert" if mode == "insert" else "strict"
    term, stats = selector_loss(sel, hidden, logits, roots, labels, weights, target_logits=tl, gold=gold)
    num, den, st = _naive_selector_loss(sel, hidden, logits, roots, labels, weights, tl, gold)
    assert float(term.numerator) == pytest.approx(num, rel=1e-5)
    assert float(term.denominator) == pytest.approx(den, rel=1e-6)
    assert stats.tolist() == pytest.approx(st, rel=1e-6)
    assert 0 < st[1] < st[0]                                     # the case mixes covered and missed slots
    if mode == "strict":
        assert den < float(weights.sum())                        # missed slots carry no selector loss
    else:
        assert den == pytest.approx(float(weights.sum()))


def test_selector_loss_errors_name_the_argument():
    sel = _selector()
    x = torch.randn(1, 1, 2, 12), torch.randn(1, 1, 2, 40)
    with pytest.raises(ValueError, match="gold"):
        selector_loss(sel, *x, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, 2, dtype=torch.long),
                      torch.ones(1, 1, 2), gold="replace")


def test_selector_gradient_reaches_the_backbone_logits_and_every_selector_parameter():
    sel = _selector(2)
    logits = (torch.randn(1, 2, 3, 40) * 2).requires_grad_()
    hidden = torch.randn(1, 2, 3, 12, requires_grad=True)
    labels = logits.detach().argmax(-1)
    term, _ = selector_loss(sel, hidden, logits, torch.zeros(1, 2, dtype=torch.long), labels, torch.ones(1, 2, 3))
    term.numerator.backward()
    for t in (logits, hidden, *sel.parameters()):
        assert t.grad is not None and float(t.grad.abs().sum()) > 0


def test_lattice_exit_loss_matches_a_naive_loop():
    sel = _selector(4, k=3)
    T, D, V = 4, 4, 40
    torch.manual_seed(5)
    hidden, logits = torch.randn(T, D, 12), torch.randn(T, D, V) * 2
    roots = torch.randint(0, V, (T,))
    lat = sel.lattice(hidden, logits, roots)
    tree = build_lattice_tree(lat.candidate_ids, lat.transition_logq.detach(), 9, roots)
    weights = torch.rand(tree.parents.shape)
    term = lattice_exit_loss(lat.transition_logq, lat.candidate_ids, tree, weights)
    num, den = 0.0, 0
    for t in range(T):
        for v in range(1, tree.parents.shape[1]):
            if not tree.valid[t, v]:
                continue
            d, par = int(tree.depth[t, v]), int(tree.parents[t, v])
            c = lat.candidate_ids[t, d - 1].tolist().index(int(tree.tokens[t, v]))
            p = 0 if d == 1 else lat.candidate_ids[t, d - 2].tolist().index(int(tree.tokens[t, par]))
            num -= float(weights[t, v]) * float(lat.transition_logq[t, d - 1, p, c])
            den += 1
    assert int(tree.max_depth) >= 3 and den > T                  # branching, deep trees
    assert float(term.numerator) == pytest.approx(num, rel=1e-5)
    assert float(term.denominator) == den
    term.numerator.backward()
    assert float(sel.successor_codebook.grad.abs().sum()) > 0


# ---------------------------------------------------------------------------------------- trainer
def _cfg(tiny, out, **kw):
    cfg = base_cfg(tiny, out, **kw)
    cfg["draft"] = {**cfg["draft"], **DFLASH2}
    return cfg


def test_fresh_dflash2_drafter_starts_as_its_backbone(tiny):
    tr = Trainer(load_config(_cfg(tiny, "d2init", max_steps=1)))
    d = tr.draft
    assert d.config.is_dflash2 and d.config.conv_kernel_size == 2 and d.config.selector_top_k == 4
    for layer in d.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
            assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
    sel = d.candidate_selector
    assert not sel.successor_codebook.any() and sel.predecessor_codebook.any()
    # the selector's scores are the (transformed) unary logits: its greedy walk is the argmax chain
    h, lg = torch.randn(2, 3, d.config.hidden_size), torch.randn(2, 3, d.config.vocab_size)
    lat = sel.lattice(h, lg, torch.tensor([3, 4]))
    torch.testing.assert_close(lat.scores, lg.topk(4, -1).values[:, :, None, :].expand(2, 3, 4, 4))


def test_dflash2_training_trains_conv_selector_and_backbone_with_lattice_exit_terms(tiny):
    cfg = _cfg(tiny, "d2run", max_steps=6, save_every=3, eval_data=str(tiny / "train.npy"), eval_every=3,
               eval_windows=2, eval_budget=8, loss={"token_weight": 1.0, "distill_weight": 0.5,
                                                    "selector": {"weight": 1.0, "labels": "target"},
                                                    "exit": {"mode": "exit", "lambda": 2.0, "budget": 8}})
    tr = Trainer(load_config(cfg))
    assert tr.exit_tree == "lattice"
    before = {k: v.clone() for k, v in tr.draft.state_dict().items()}
    res = tr.run()
    tr.close()
    assert res.complete
    after = DFlashDraftModel.from_pretrained(res.final_dir)
    assert after.config.is_dflash2 and after.config.output_multiplier == 1.5
    moved = {k for k, v in after.state_dict().items() if not torch.equal(v, before[k])}
    for name in ("layers.0.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
                 "candidate_selector.successor_codebook", "candidate_selector.predecessor_codebook",
                 "candidate_selector.hidden_projection.weight", "layers.0.self_attn.q_proj.weight", "fc.weight"):
        assert name in moved, name
    recs = log_records(res.output_dir)
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert {"loss_tok", "loss_distill", "loss_selector", "loss_exit", "sel_recall", "sel_acc",
                "unary_acc", "coverage"} <= set(r)
        assert 0 <= r["sel_recall"] <= 1 and math.isfinite(r["loss_selector"]) and r["loss_selector"] > 0
    ev = [json.loads(x) for x in (res.output_dir / "eval_log.jsonl").read_text().splitlines()]
    assert {"sel_recall", "sel_acc", "unary_acc", "block_len_T0", "block_len_T1"} <= set(ev[-1])
    assert 1.0 <= ev[-1]["block_len_T0"] <= 1 + cfg["block_size"] - 1


def test_dflash2_resume_is_bit_identical(tiny):
    kw = dict(max_steps=4, save_every=2, loss={"selector": {"weight": 1.0, "gold": "insert"},
                                               "exit": {"mode": "exit", "lambda": 1.0, "budget": 6}})
    straight = train(_cfg(tiny, "d2straight", **kw))
    train(_cfg(tiny, "d2resumed", stop_at_step=2, **kw))
    resumed = train(_cfg(tiny, "d2resumed", **kw))
    a = DFlashDraftModel.from_pretrained(straight.final_dir).state_dict()
    b = DFlashDraftModel.from_pretrained(resumed.final_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s",) and not k.startswith("ms_")}
                        for r in rs]
    assert strip(log_records(straight.output_dir)) == strip(log_records(resumed.output_dir))


def test_dflash2_config_errors_name_the_key(tiny, tmp_path):
    bad = _cfg(tiny, "d2bad")
    bad["draft"]["conv_group_size"] = 7                          # does not divide hidden 32
    with pytest.raises(ConfigError, match="conv_group_size"):
        Trainer(load_config(bad))
    v1 = base_cfg(tiny, "d2v1", loss={"exit": {"mode": "exit", "tree": "lattice"}})
    with pytest.raises(ConfigError, match="loss.exit.tree"):
        Trainer(load_config(v1))
    with pytest.raises(ConfigError, match="loss.selector.gold"):
        load_config(_cfg(tiny, "d2bad2", loss={"selector": {"gold": "maybe"}}))
    assert not (tiny / "d2bad").exists() and not (tiny / "d2v1").exists()   # nothing written


def test_trained_export_loads_in_the_reference_and_in_sglang(tiny):
    res = train(_cfg(tiny, "d2export", max_steps=2, export_dtype="bfloat16"))
    path = res.final_dir
    ref_mod = pytest.importorskip("dflash.model", reason="install with `pip install --no-deps dflash==0.1.0`")
    ref, info = ref_mod.DFlash2DraftModel.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    torch.testing.assert_close(ref.candidate_selector.successor_codebook.weight,
                               ours.candidate_selector.successor_codebook)
    from sglang_tev.testing.sglang_cpu.required import require_sglang

    require_sglang()
    import sglang.srt.models.dflash as sg
    from safetensors.torch import load_file
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    cfg = json.loads((path / "config.json").read_text())
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    assert (parsed.conv_kernel_size, parsed.selector_top_k, parsed.output_multiplier) == (2, 4, 1.5)
    stored = load_file(str(path / "model.safetensors"))
    c = ours.config
    sel = sg.CandidateSelector(hidden_size=c.hidden_size, vocab_size=c.vocab_size, state_rank=8, top_k=4)
    pre = "candidate_selector."
    sel.load_state_dict({k[len(pre):]: v for k, v in stored.items() if k.startswith(pre)}, strict=True)
    conv = sg.DFlashGroupedConv(c.hidden_size, c.block_size, 2, 8)
    pre = "layers.0.mlp_conv."
    conv.load_state_dict({k[len(pre):]: v for k, v in stored.items() if k.startswith(pre)}, strict=True)


def test_torchrun_two_gloo_ranks_match_one_process_with_the_selector_and_lattice_exit_terms(tiny, tmp_path):
    """The selector's parameters are used outside the DDP-wrapped block forward (the selector and
    lattice-exit terms): their gradients must still be averaged over ranks, so 2 ranks x batch 2
    end with the weights of 1 process x batch 4 (a rank-local selector gradient would not)."""
    from safetensors.torch import load_file
    from train_helpers import torchrun_two_ranks

    kw = dict(max_steps=3, loss={"selector": {"weight": 1.0}, "exit": {"mode": "exit", "lambda": 1.0, "budget": 6}})
    one = train(_cfg(tiny, "d2ddp1", batch_size=4, **kw))
    torchrun_two_ranks(_cfg(tiny, "d2ddp2", batch_size=2, **kw), tmp_path)
    a, b = log_records(one.output_dir), log_records(tiny / "d2ddp2")
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["sel_acc"] == pytest.approx(rb["sel_acc"], abs=1e-9)
    wa = load_file(str(one.final_dir / "model.safetensors"))
    wb = load_file(str(tiny / "d2ddp2" / "final" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5, msg=k)


def test_the_clis_tree_mode_choices_are_the_trainers():
    """The CLI keeps its own list (parsing does not import torch); it must name the same modes."""
    from sglang_tev.cli import TREE_MODE_CHOICES
    from sglang_tev.train.exit import TREE_MODES

    assert TREE_MODE_CHOICES == ("auto", *TREE_MODES)
