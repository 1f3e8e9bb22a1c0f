"""sglang_tev.train: the dense DFlash objective, trainer, checkpoints, config and CLI.

A tiny random Qwen3 target (vocab 128, hidden 32, 3 layers) and a repetitive token stream are
written to a temp dir once per module; every run uses 1 thread (CPU results are then
bit-reproducible). The build script's draft stage is tested in tests/train/test_build_tiny_code.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel, block_train_mask
from sglang_tev.train import ConfigError, Trainer, evaluate, latest_checkpoint, load_config, train
from sglang_tev.train.__main__ import main as cli_main
from sglang_tev.train.data import (anchor_keys, batch_indices, collate, load_dataset,
                                   sample_anchors, valid_anchor_positions)
from sglang_tev.train.losses import block_logits, decay_weights, distill_loss, token_loss
from train_helpers import EOS, H, LAYERS, MASK, REPO, V, base_cfg, log_records, torchrun_two_ranks  # noqa: F401


# ---------------------------------------------------------------------------------------------
# The objective against hand-computed cases
# ---------------------------------------------------------------------------------------------

def test_decay_weights_are_exp_minus_k_minus_1_over_gamma():
    w = decay_weights(5, 2.0)
    assert w.tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])
    assert decay_weights(5, None).tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="gamma"):
        decay_weights(5, 0.0)


def test_valid_anchor_rule_hand_case():
    """K=3, separator at 5, label mask off at 8: only anchors 1, 2, 3 are valid.

    a=0: empty context; a=3: labels x4, x5 (the separator may be the last label); a=4: x5 is a
    separator inside x[a..a+K-2]; a=5: the anchor is the separator; a=6, 7: label 8 unsupervised;
    a>=8: the block leaves the sequence.
    """
    ids = torch.tensor([[7, 7, 7, 7, 7, EOS, 7, 7, 7, 7]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 8] = False
    valid = valid_anchor_positions(ids, mask, 3, [EOS])
    assert valid[0].nonzero().flatten().tolist() == [1, 2, 3]
    # the anchor's own loss mask does not matter (the prompt's last token roots round 1) ...
    mask[0, 1] = False
    assert valid_anchor_positions(ids, mask, 3, [EOS])[0].nonzero().flatten().tolist() == [1, 2, 3]
    # ... its labels' do: label 2 unsupervised removes anchor 1 (labels 2, 3)
    mask[0, 2] = False
    assert valid_anchor_positions(ids, mask, 3, [EOS])[0].nonzero().flatten().tolist() == [2, 3]
    mask[0, 1:3] = True
    # without a separator rule, 4 and 5 become valid
    assert valid_anchor_positions(ids, torch.ones_like(mask), 3)[0].nonzero().flatten().tolist() == \
        [1, 2, 3, 4, 5, 6, 7]


def test_sample_anchors_without_replacement_and_keep_mask():
    valid = torch.zeros(2, 12, dtype=torch.bool)
    valid[0, [2, 5, 9]] = True
    valid[1, 1:11] = True
    keys = anchor_keys(seed=3, step=7, batch_size=2, seq_len=12)
    anchors, keep = sample_anchors(valid, 5, keys)
    assert anchors.shape == keep.shape == (2, 5)
    assert sorted(anchors[0][keep[0]].tolist()) == [2, 5, 9] and keep[0].sum() == 3
    assert keep[1].all() and valid[1, anchors[1]].all()
    assert len(set(anchors[1].tolist())) == 5 and anchors[1].tolist() == sorted(anchors[1].tolist())
    again = sample_anchors(valid, 5, anchor_keys(seed=3, step=7, batch_size=2, seq_len=12))
    assert torch.equal(again[0], anchors)  # a pure function of (seed, step)
    other = sample_anchors(valid, 5, anchor_keys(seed=3, step=8, batch_size=2, seq_len=12))
    assert not torch.equal(other[0][1], anchors[1])
    # rank 1 of a world of 2 draws exactly rows 2..3 of the global keys
    glob = anchor_keys(seed=3, step=7, batch_size=4, seq_len=12)
    assert torch.equal(anchor_keys(seed=3, step=7, batch_size=2, seq_len=12, rank=1), glob[2:])


def test_batch_indices_cover_each_epoch_and_shard_by_rank():
    seen = [i for s in range(5) for i in batch_indices(s, 2, 5, seed=1)]
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5))
    for s in range(4):
        single = batch_indices(s, 4, 7, seed=2)
        assert batch_indices(s, 2, 7, 2, rank=0, world_size=2) + \
            batch_indices(s, 2, 7, 2, rank=1, world_size=2) == single


def test_block_logits_labels_weights_hand_computed():
    """A stub drafter returns a fixed logit table; the loss must be the hand-computed weighted
    CE in which slot k of the block anchored at a predicts x_{a+k} and slot 0 is dropped."""
    K, S, Vs, gamma = 4, 9, 5, 2.0
    ids = torch.tensor([[3, 0, 1, 2, 3, 0, 1, 2, 4]])
    anchors, keep = torch.tensor([[1, 3, 6]]), torch.tensor([[True, True, False]])
    table = torch.tensor([[[0., 1., 2., 0., 0.]] * 12]) + \
        torch.arange(12.)[None, :, None] * torch.tensor([1., 0., -1., 2., 0.5])
    table[0, 8:] = 1e4 * torch.tensor([1., -1., 1., -1., 1.])  # the invalid block: garbage
    seen = {}

    def stub_forward(features, embeds, positions, mask):
        seen.update(embeds=embeds, positions=positions, mask=mask)
        return table

    embed = lambda x: torch.nn.functional.one_hot(x, Vs).float()  # noqa: E731
    feats = torch.zeros(1, S, 2)
    logits, labels = block_logits(stub_forward, embed, torch.nn.Identity(), feats, ids, anchors,
                                  keep, K, mask_token_id=4)
    assert seen["embeds"].argmax(-1).tolist() == [[0, 4, 4, 4, 2, 4, 4, 4, 1, 4, 4, 4]]
    assert seen["positions"].tolist() == [[1, 2, 3, 4, 3, 4, 5, 6, 6, 7, 8, 9]]
    assert torch.equal(seen["mask"], block_train_mask(anchors, S, K, keep))
    assert labels.tolist() == [[[1, 2, 3], [3, 0, 1], [2, 4, 4]]]  # x_{a+k}; past S-1 clamped
    w = decay_weights(K, gamma)
    term = token_loss(logits, labels, keep[..., None].float() * w)
    num = den = 0.0
    for i, a in enumerate([1, 3]):            # valid blocks only
        for k in range(1, K):                 # slot 0 (the anchor) is never a label
            row = table[0, i * K + k].tolist()
            ce = math.log(sum(math.exp(v) for v in row)) - row[int(ids[0, a + k])]
            num += math.exp(-(k - 1) / gamma) * ce
            den += math.exp(-(k - 1) / gamma)
    assert float(term.denominator) == pytest.approx(den, rel=1e-6)
    assert float(term.numerator / term.denominator) == pytest.approx(num / den, rel=1e-6)


def test_distill_loss_hand_computed():
    """Σ_slots w · (-Σ_v p_target(v) log q_draft(v)) / Σ w, computed by hand in float64; equal to
    KL(p || q) + H(p), so it is minimal (= H(p)) exactly when the draft matches the target."""
    g = torch.Generator().manual_seed(3)
    logits, tlogits = torch.randn(2, 3, 4, 7, generator=g), torch.randn(2, 3, 4, 7, generator=g)
    w = torch.rand(2, 3, 4, generator=g)
    w[1, 2] = 0.0
    term = distill_loss(logits, tlogits, w)
    num = 0.0
    for idx in np.ndindex(2, 3, 4):
        p = [math.exp(v) for v in tlogits[idx].double().tolist()]
        p = [x / sum(p) for x in p]
        row = logits[idx].double().tolist()
        lse = math.log(sum(math.exp(v) for v in row))
        num += float(w[idx]) * -sum(pi * (v - lse) for pi, v in zip(p, row))
    assert float(term.numerator) == pytest.approx(num, rel=1e-5)
    assert float(term.denominator) == pytest.approx(float(w.sum()), rel=1e-6)
    same = distill_loss(tlogits, tlogits, w)
    ent = -(tlogits.softmax(-1) * tlogits.log_softmax(-1)).sum(-1)
    assert float(same.numerator) == pytest.approx(float((ent * w).sum()), rel=1e-5)
    assert float(term.numerator) > float(same.numerator)


def test_distill_target_logits_are_the_label_positions(tiny):
    """The target distribution used for slot k of the block anchored at a is the target's
    prediction at position a + k - 1 (the one whose data label is x_{a+k})."""
    tr = Trainer(load_config(base_cfg(tiny, "kdpos", max_steps=1, save_every=100,
                                      loss={"distill_weight": 1.0})))
    ids = torch.from_numpy(np.load(tiny / "train.npy")[:32].astype(np.int64))[None]
    with torch.no_grad():
        _, last, _ = tr._features(ids)
        full = tr.target(input_ids=ids).logits
        anchors = torch.tensor([[1, 5, 28]])
        got = tr._target_logits(last, anchors)
    K = tr.block_size
    assert got.shape == (1, 3, K - 1, V)
    for i, a in enumerate([1, 5]):
        for k in range(1, K):
            torch.testing.assert_close(got[0, i, k - 1], full[0, a + k - 1], rtol=1e-5, atol=1e-5)


def test_distill_only_training_learns_the_target(tiny):
    """token_weight 0, distill_weight 1: six steps lower the distillation loss (the soft-target
    CE against the target) on a fixed held batch."""
    cfg = base_cfg(tiny, "kd_a", max_steps=6, save_every=100,
                   loss={"token_weight": 0.0, "distill_weight": 1.0})
    tr = Trainer(load_config(cfg))
    ids = torch.from_numpy(np.load(tiny / "train.npy")[:32].astype(np.int64))[None]
    anchors, keep = torch.tensor([[2, 9, 17]]), torch.ones(1, 3, dtype=torch.bool)

    def kd_now():
        with torch.no_grad():
            feats, last, _ = tr._features(ids)
            lg, lab = block_logits(tr.draft.forward_train, tr.embed, tr.lm_head, feats, ids,
                                   anchors, keep, tr.block_size, MASK)
            t = distill_loss(lg, tr._target_logits(last, anchors), torch.ones_like(lab, dtype=torch.float))
        return float(t.numerator / t.denominator)

    before = kd_now()
    tr.run()
    assert kd_now() < before


    cfg = DFlashConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       num_target_layers=LAYERS, mask_token_id=MASK, target_layer_ids=(0, 2),
                       block_size=4, vocab_size=V)
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    emb = torch.nn.Embedding(V, H)
    head = torch.nn.Linear(H, V, bias=False)
    g = torch.Generator().manual_seed(1)
    S, a = 12, 6
    ids = torch.randint(2, V, (1, S), generator=g)
    feats = torch.randn(1, S, 2 * H, generator=g)
    anchors, keep = torch.tensor([[a]]), torch.tensor([[True]])

    def loss(f):
        with torch.no_grad():
            lg, lab = block_logits(draft.forward_train, emb, head, f, ids, anchors, keep, 4, MASK)
            t = token_loss(lg, lab, torch.ones_like(lab, dtype=torch.float))
        return float(t.numerator / t.denominator)

    base = loss(feats)
    later = feats.clone()
    later[:, a:] = torch.randn(1, S - a, 2 * H, generator=g)  # the anchor's own feature and beyond
    assert loss(later) == base
    earlier = feats.clone()
    earlier[:, a - 1] += 1.0
    assert loss(earlier) != base


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------

def test_target_frozen_drafter_trained_loss_decreases(tiny):
    tr = Trainer(load_config(base_cfg(tiny, "frozen", max_steps=30, save_every=100)))
    before_t = {k: v.clone() for k, v in tr.target.state_dict().items()}
    before_d = {k: v.clone() for k, v in tr.draft.state_dict().items()}
    assert not any(p.requires_grad for p in tr.target.parameters())
    draft_ids = {id(p) for p in tr.draft.parameters()}
    opt_ids = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    assert opt_ids == draft_ids
    res = tr.run()
    assert res.complete and res.step == 30
    for k, v in tr.target.state_dict().items():
        assert torch.equal(v, before_t[k]), k
    changed = [k for k, v in tr.draft.state_dict().items() if not torch.equal(v, before_d[k])]
    assert len(changed) == len(before_d)
    losses = [r["loss"] for r in log_records(tiny / "frozen")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    assert all(0.0 <= a <= 1.0 for a in log_records(tiny / "frozen")[-1]["acc"])


@pytest.fixture(scope="module")
def straight(tiny):
    """8 steps in one go (checkpoints every 2)."""
    res = train(base_cfg(tiny, "straight"))
    return res


def test_resume_is_bit_identical(tiny, straight):
    out = tiny / "resumed"
    first = train(base_cfg(tiny, "resumed", stop_at_step=4))
    assert not first.complete and first.step == 4 and first.final_dir is None
    assert latest_checkpoint(out).name == "step_00000004"
    with open(out / "train_log.jsonl", "a") as f:  # a killed run logged past its checkpoint
        f.write(json.dumps({"step": 5, "loss": -1.0}) + "\n")
    second = train(base_cfg(tiny, "resumed"))
    assert second.complete and second.step == 8
    a = (straight.final_dir / "model.safetensors").read_bytes()
    assert (second.final_dir / "model.safetensors").read_bytes() == a
    assert log_records(out) == log_records(straight.output_dir)
    assert [r["step"] for r in log_records(out)] == list(range(1, 9))


def test_resume_refuses_other_threads_or_config(tiny, straight):
    with pytest.raises(ConfigError, match="threads") as e:
        train(base_cfg(tiny, "straight", threads=2))
    assert e.value.key == "threads"
    with pytest.raises(ConfigError) as e:
        train(base_cfg(tiny, "straight", lr=1e-3))
    assert e.value.key == "lr" and "differs from the checkpoint" in str(e.value)
    with pytest.raises(ConfigError) as e:
        train(base_cfg(tiny, "straight", resume="never"))
    assert e.value.key == "resume"
    # the thread check can be overridden (results may then differ in the last bits)
    import shutil
    shutil.copytree(straight.output_dir, tiny / "straight_copy")
    res = train(base_cfg(tiny, "straight_copy", threads=2, allow_thread_change=True))
    assert res.complete and res.step == 8 and res.last_log is None  # nothing left to train


def test_interrupted_checkpoint_write_keeps_previous(tiny, straight, monkeypatch):
    out = tiny / "torn"
    train(base_cfg(tiny, "torn", stop_at_step=4))
    ckpt = latest_checkpoint(out)
    files = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    real_save = torch.save

    def torn_save(obj, f, *a, **k):  # half a file, then the disk "fills up"
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space"):
        train(base_cfg(tiny, "torn"))  # resumes at 4, fails writing step 6
    monkeypatch.setattr(torch, "save", real_save)
    assert latest_checkpoint(out) == ckpt
    assert {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == files
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    DFlashDraftModel.from_pretrained(ckpt / "draft")  # loadable
    res = train(base_cfg(tiny, "torn"))
    assert res.complete
    assert (res.final_dir / "model.safetensors").read_bytes() == \
        (straight.final_dir / "model.safetensors").read_bytes()


def test_export_loads_and_matches_trained_weights(tiny, straight):
    final = DFlashDraftModel.from_pretrained(straight.final_dir)
    ckpt = load_file(str(latest_checkpoint(straight.output_dir) / "draft" / "model.safetensors"))
    assert final.config.block_size == 4 and final.config.mask_token_id == MASK
    assert final.config.target_layer_ids == (0, 2) and final.config.num_target_layers == LAYERS
    for k, v in final.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, ckpt[k]), k
    assert set(os.listdir(straight.final_dir)) == {"config.json", "model.safetensors"}


def test_warm_start_from_draft_init(tiny, straight):
    cfg = base_cfg(tiny, "warm", draft_init=str(straight.final_dir), max_steps=2)
    del cfg["draft"]
    tr = Trainer(load_config(cfg))
    exported = DFlashDraftModel.from_pretrained(straight.final_dir)
    for k, v in tr.draft.state_dict().items():
        assert torch.equal(v, exported.state_dict()[k]), k
    assert tr.run().complete
    cfg["draft_init"] = str(tiny / "target")  # not a drafter
    with pytest.raises(ConfigError) as e:
        Trainer(load_config(cfg))
    assert e.value.key == "draft_init"


def test_evaluate_reports_per_depth_metrics(tiny, straight):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny / "target").eval()
    draft = DFlashDraftModel.from_pretrained(straight.final_dir)
    ds = load_dataset(tiny / "train.npy", 32)
    ev = evaluate(draft, target, ds, stride=3, max_windows=4, sep_ids=[EOS])
    assert len(ev["acc"]) == len(ev["ce"]) == 3 and ev["windows"] == 4 and ev["anchors"] > 0
    assert all(0 <= a <= 1 for a in ev["acc"]) and all(c > 0 for c in ev["ce"])
    assert ev["ce_mean"] == pytest.approx(sum(ev["ce"]) / 3, rel=1e-6)  # same count per depth
    assert 0 <= ev["accept_len_data"] <= 3
    assert evaluate(draft, target, ds, stride=3, max_windows=4, sep_ids=[EOS]) == ev


# ---------------------------------------------------------------------------------------------
# Config, data, CLI
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("bogus=1", "bogus"),
    ("loss.exit.bogus=1", "loss.exit.bogus"),
    ("draft.layers=2", "draft.layers"),
    ("seq_len=abc", "seq_len"),
    ("seq_len=1.5", "seq_len"),
    ("batch_size=0", "batch_size"),
    ("lr=-1", "lr"),
    ("lr=nan", "lr"),
    ("progress=1", "progress"),
    ("loss_decay_gamma=0", "loss_decay_gamma"),
    ("loss.exit.mode=bogus", "loss.exit.mode"),
    ("loss.exit.lambda=-0.5", "loss.exit.lambda"),
    ("dtype=fp16", "dtype"),
    ("device=tpu", "device"),
    ("betas=[0.9]", "betas"),
    ("draft.target_layer_ids=[1,x]", "draft.target_layer_ids[1]"),
    ("warmup_steps=5", "warmup_steps"),  # together with warmup_ratio below
    ("draft_init=/nonexistent", "draft"),  # together with draft below
    ("loss.distill_weight=-1", "loss.distill_weight"),
    ("loss.token_weight=0", "loss"),  # with distill_weight 0: nothing to train
    ("output_dir={file}", "output_dir"),
])
def test_config_errors_name_the_key(tiny, tmp_path, override, key):
    cfg = base_cfg(tiny, "unused")
    (tmp_path / "a_file").write_text("x")
    override = override.replace("{file}", str(tmp_path / "a_file"))
    if override.startswith("warmup_steps"):
        cfg["warmup_ratio"] = 0.1
    with pytest.raises(ConfigError) as e:
        load_config(cfg, [override])
    assert e.value.key == key and f"'{key}'" in str(e.value)


def test_config_required_keys_exit_mode_and_overrides(tiny, tmp_path):
    with pytest.raises(ConfigError, match="'max_steps': is required"):
        load_config({"target": "t", "data": "d", "output_dir": "o"})
    for mode in ("exit", "prefix"):
        cfg = load_config(base_cfg(tiny, "x"), [f"loss.exit.mode={mode}"])
        assert cfg.loss.exit.mode == mode and cfg.loss.exit.budget == 64 and cfg.loss.exit.lambda_ == 0.1
    for bad, key in [("loss.exit.lambda=-0.1", "loss.exit.lambda"), ("loss.exit.budget=0", "loss.exit.budget"), ("loss.exit.budget=5000", "loss.exit.budget"),
                     ("loss.exit.mode=tree", "loss.exit.mode"), ("loss.exit.anchors_per_forward=0",
                                                                 "loss.exit.anchors_per_forward")]:
        with pytest.raises(ConfigError) as e:
            load_config(base_cfg(tiny, "x"), ["loss.exit.mode=exit", bad])
        assert e.value.key == key
    with pytest.raises(ConfigError, match="neither") as e:
        load_config({"target": "t", "output_dir": "o", "max_steps": 1})
    assert e.value.key == "data"
    with pytest.raises(ConfigError, match="both") as e:
        load_config(base_cfg(tiny, "x"), ["rollout.prompts=p.jsonl"])
    with pytest.raises(ConfigError, match="'rollout.prompts': is required"):
        load_config(base_cfg(tiny, "x", data=None), ["rollout.max_new_tokens=8"])
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(base_cfg(tiny, "x")))  # JSON is YAML
    cfg = load_config(path, ["lr=3e-4", "loss_decay_gamma=7", "draft.target_layer_ids=[1, 2]",
                             "loss.exit.lambda=0.2", "eval_data=null", "grad_clip=null"])
    assert cfg.lr == 3e-4 and cfg.loss_decay_gamma == 7.0 and cfg.draft.target_layer_ids == [1, 2]
    assert cfg.loss.exit.lambda_ == 0.2 and cfg.grad_clip is None and cfg.draft.num_hidden_layers == 1
    assert cfg.warmup == round(0.04 * 8)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(path, ["lr"])
    with pytest.raises(FileNotFoundError, match="config"):
        load_config(tmp_path / "missing.yaml")


def test_bad_inputs_name_the_key(tiny, tmp_path):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((4, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="^data: .*1-D"):
        train(base_cfg(tiny, "bad1", data=str(bad)))
    with pytest.raises(FileNotFoundError, match="^data"):
        train(base_cfg(tiny, "bad2", data=str(tmp_path / "none.npy")))
    with pytest.raises(FileNotFoundError, match="^target"):
        train(base_cfg(tiny, "bad3", target=str(tmp_path / "none")))
    with pytest.raises(ConfigError) as e:  # the drafter's layer ids must exist in the target
        train(base_cfg(tiny, "bad4", draft={"target_layer_ids": [5], "mask_token_id": MASK}))
    assert e.value.key == "draft"
    with pytest.raises(ConfigError) as e:  # windows longer than the target's positions (256)
        train(base_cfg(tiny, "bad5", seq_len=512))
    assert e.value.key == "seq_len" and not (tiny / "bad5").exists()
    drafter = tmp_path / "drafter"
    DFlashDraftModel(DFlashConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  num_target_layers=LAYERS, mask_token_id=MASK, target_layer_ids=(0,),
                                  block_size=4, vocab_size=V)).save_pretrained(drafter)
    with pytest.raises(ValueError, match="^target: .*is a DFlash drafter"):
        train(base_cfg(tiny, "bad6", target=str(drafter)))
    assert not (tiny / "bad6").exists()
    with pytest.raises(ConfigError) as e:  # no tokenizer in the target dir: mask id is required
        train(base_cfg(tiny, "bad5", draft={"num_hidden_layers": 1}))
    assert e.value.key == "draft.mask_token_id"


def test_jsonl_text_and_chat_data(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<mask>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", mask_token="<mask>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    path = tmp_path / "d.jsonl"
    rows = [{"text": "def add(a, b):\n    return a + b\n"},
            {"messages": [{"role": "user", "content": "add?"},
                          {"role": "assistant", "content": "return a + b"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_dataset(path, 64, fast)
    assert len(ds) == 2
    assert ds.sequences[0][-1] == fast.eos_token_id and ds.loss_masks[0].all()
    ids, mask = ds.sequences[1], ds.loss_masks[1]
    assert fast.decode(ids[mask]).startswith("return a + b")
    assert "add?" in fast.decode(ids[~mask]) and not mask[:4].any()
    # a document is cut into windows; a chat is truncated, and dropped here: its first 8 tokens
    # hold no supervised label
    short = load_dataset(path, 8, fast)
    assert not mask[1:8].any()
    assert len(short) == -(-len(ds.sequences[0]) // 8) >= 2
    assert torch.equal(torch.cat(short.sequences), ds.sequences[0])
    padded_ids, padded_mask = collate(ds, [0, 1], pad_id=fast.eos_token_id)
    assert padded_ids.shape[0] == 2 and padded_mask.sum() == mask.sum() + len(ds.sequences[0])
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="data: line 1"):
        load_dataset(path, 64, fast)


def test_cli_errors_name_the_key(tiny, capsys):
    assert cli_main(["target=x", "data=y", "output_dir=z", "max_steps=1", "bogus.key=3"]) == 2
    assert "'bogus'" in capsys.readouterr().err
    assert cli_main(["target=x", "data=y", "output_dir=z", "max_steps=1",
                     "loss.exit.lambda=-1"]) == 2
    assert "loss.exit.lambda" in capsys.readouterr().err
    cfg = base_cfg(tiny, "z")
    overrides = [f"{k}={json.dumps(v)}" for k, v in cfg.items()]
    assert cli_main(["--print-config", *overrides, "lr=0.01"]) == 0
    assert "lr: 0.01" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # argparse: no config and no overrides
        cli_main([])
    assert e.value.code == 2 and "--config is required" in capsys.readouterr().err


def test_cli_end_to_end_subprocess(tiny, tmp_path):
    path = tmp_path / "run.yaml"
    import yaml
    path.write_text(yaml.safe_dump(base_cfg(tiny, "cli")))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "sglang_tev.train", "--config", str(path),
                           "max_steps=3", "export_dtype=bfloat16"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "done: 3 steps" in proc.stderr and proc.stdout == ""
    final = DFlashDraftModel.from_pretrained(tiny / "cli" / "final")
    ckpt = load_file(str(latest_checkpoint(tiny / "cli") / "draft" / "model.safetensors"))
    for k, v in final.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, ckpt[k].to(torch.bfloat16)), k
    assert len(log_records(tiny / "cli")) == 3


def test_torchrun_two_gloo_ranks_match_one_process(tiny, tmp_path):
    """2 ranks x batch 2 == 1 process x batch 4: same samples and anchors, global loss."""
    one = train(base_cfg(tiny, "ddp1", max_steps=3, batch_size=4))
    torchrun_two_ranks(base_cfg(tiny, "ddp2", max_steps=3, batch_size=2), tmp_path)
    a, b = log_records(one.output_dir), log_records(tiny / "ddp2")
    assert [r["anchors"] for r in a] == [r["anchors"] for r in b]
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["acc"] == pytest.approx(rb["acc"], abs=1e-9)
    wa = load_file(str(one.final_dir / "model.safetensors"))
    wb = load_file(str(tiny / "ddp2" / "final" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_resume_with_another_world_size_keeps_the_global_batch(tiny, tmp_path, monkeypatch):
    """Elastic resume: a checkpoint of 1 process x batch 4 resumes on 2 gloo ranks x batch 2 (and
    2 x 2 on 1 x 4) with the same global batch and sample order from the next unseen sample: the
    same anchors and, up to float summation order, the same losses and weights as the
    uninterrupted 1-process run. A world size that would change the global batch is refused
    naming the world sizes and the batch_size that resumes exactly; the note says what is kept."""
    from sglang_tev.train import trainer as tr

    ref = train(base_cfg(tiny, "ws_ref", max_steps=4, batch_size=4))
    want = log_records(ref.output_dir)
    w_ref = load_file(str(ref.final_dir / "model.safetensors"))

    def same_run(out: Path):
        got = log_records(out)
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        for ra, rb in zip(want, got):
            assert ra["anchors"] == rb["anchors"]
            assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        w = load_file(str(out / "final" / "model.safetensors"))
        for k in w_ref:
            torch.testing.assert_close(w[k], w_ref[k], rtol=1e-4, atol=1e-5)

    # 1 -> 2
    train(base_cfg(tiny, "ws12", max_steps=4, batch_size=4, stop_at_step=2))
    with monkeypatch.context() as m:  # the check runs before the target loads: no process group needed
        m.setattr(tr, "_init_distributed", lambda _dev: tr._Dist(0, 2, 0, False))
        with pytest.raises(ConfigError) as e:
            train(base_cfg(tiny, "ws12", max_steps=4, batch_size=4))
    assert e.value.key == "batch_size"
    assert "world size 1 x batch_size 4 = global batch 4" in str(e.value) and "world size 2" in str(e.value)
    assert "set batch_size=2" in str(e.value)
    proc = torchrun_two_ranks(base_cfg(tiny, "ws12", max_steps=4, batch_size=2), tmp_path)
    assert "same global batch (4)" in proc.stderr and "from sample 8 of the stream" in proc.stderr
    assert "same data" not in proc.stderr
    same_run(tiny / "ws12")
    # 2 -> 1
    torchrun_two_ranks(base_cfg(tiny, "ws21", max_steps=4, batch_size=2, stop_at_step=2), tmp_path)
    with pytest.raises(ConfigError, match="world size 2 x batch_size 2 = global batch 4.*set batch_size=4"):
        train(base_cfg(tiny, "ws21", max_steps=4, batch_size=2))
    res = train(base_cfg(tiny, "ws21", max_steps=4, batch_size=4))
    assert res.complete and res.step == 4
    same_run(tiny / "ws21")
