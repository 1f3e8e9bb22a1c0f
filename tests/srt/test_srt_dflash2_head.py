"""TEV's DFlash2 draft head in SGLang (``sglang_tev/srt/dflash2.py``, the worker's lattice branch,
``round.build_lattice_trees``, the graph-head gate), without an Engine.

Oracles: our z-lab-checked DFlash2 pieces (``sglang_tev/draft/dflash2.py``, parity with ``dflash``
0.1.0 in tests/runtime/test_dflash2.py) on a random tiny checkpoint exported in z-lab's layout and loaded
strictly into SGLang 0.5.23's own ``CandidateSelector``; the lattice tree builder
(``sglang_tev/draft/lattice.py``, brute-force checked in tests/runtime/test_lattice.py). SGLang's
``torch.compile``'d ``_score_edges`` runs as its Python body here (no inductor build); the Engine
test (tests/engine/test_sglang_dflash2_engine.py) runs the compiled one.
"""

from __future__ import annotations

import json
import types
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from sglang_tev.testing.sglang_cpu.required import require_sglang

require_sglang()

import sglang.srt.models.dflash as sg  # noqa: E402
import sglang.srt.runtime_context as rc  # noqa: E402
from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config  # noqa: E402

from sglang_tev.draft.dflash2 import transform_logits as ours_transform  # noqa: E402
from sglang_tev.draft.lattice import build_lattice_tree  # noqa: E402
from sglang_tev.srt import dflash2 as D2  # noqa: E402
from sglang_tev.srt.config import read_dflash2_mode, validate_server_args  # noqa: E402
from sglang_tev.srt.round import build_lattice_trees, build_trees  # noqa: E402
from dflash2_helpers import H, K, RANK, TAPS, TOL, TOPK, V, _ours  # noqa: E402


def _orig(fn):
    return getattr(fn, "_torchdynamo_orig_callable", fn)


@pytest.fixture()
def tp1(monkeypatch):
    """What the runtime context publishes on one rank (``candidate_topk`` reads ``tp_size``); the
    selector's top-k takes SGLang's torch branch (``_radix_topk``, srt/models/dflash.py:66-70: the
    installed CUDA FlashInfer wheel refuses CPU tensors); ``_score_edges`` runs as its body."""
    parallel = SimpleNamespace(tp_size=1, tp_rank=0)
    monkeypatch.setattr(sg, "_flashinfer_top_k", None)
    monkeypatch.setattr(sg, "get_parallel", lambda: parallel)
    monkeypatch.setattr(rc, "get_parallel", lambda: parallel)
    monkeypatch.setattr(sg, "_score_edges", _orig(sg._score_edges))
    return parallel


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(our DFlash2 model, its config dict, SGLang's parsed config, SGLang's CandidateSelector
    loaded strictly from our exported tensors, the target head [V, H])."""
    model = _ours(seed=5)
    path = tmp_path_factory.mktemp("d2head") / "draft"
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    stored = load_file(str(path / "model.safetensors"))
    sel = sg.CandidateSelector(hidden_size=H, vocab_size=V, state_rank=RANK, top_k=TOPK)
    pre = "candidate_selector."
    sel.load_state_dict({k[len(pre):]: v for k, v in stored.items() if k.startswith(pre)}, strict=True)
    lm_head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(0.4 * torch.randn(V, H, generator=torch.Generator().manual_seed(9)))
    lm_head.org_vocab_size = V
    return model, cfg, parse_dflash_draft_config(draft_hf_config=cfg), sel.eval(), lm_head


def _sglang_draft_model(cfg, sel, lm_head):
    """The parts of SGLang's ``DFlash2DraftModel`` that ``_selector_lattice`` calls, bound to its own
    methods (``compute_candidates``, ``_transform_unary_logits``: srt/models/dflash.py:1284-1302)."""
    dm = SimpleNamespace(candidate_selector=sel, lm_head=lm_head, draft_config=cfg)
    dm._transform_unary_logits = types.MethodType(sg.DFlash2DraftModel._transform_unary_logits, dm)
    dm.compute_candidates = types.MethodType(sg.DFlash2DraftModel.compute_candidates, dm)
    return dm


# ---------------------------------------------------------------------------------------------
# start-up: served or refused
# ---------------------------------------------------------------------------------------------

def test_mode_variable_is_read_and_checked():
    assert read_dflash2_mode({}) is None and read_dflash2_mode({"SGLANG_TEV_DFLASH2_MODE": " "}) is None
    assert read_dflash2_mode({"SGLANG_TEV_DFLASH2_MODE": "Marginal"}) == "marginal"
    with pytest.raises(ValueError, match="SGLANG_TEV_DFLASH2_MODE"):
        read_dflash2_mode({"SGLANG_TEV_DFLASH2_MODE": "walk"})
    # refused before any model loads, with the server args
    sa = SimpleNamespace(device="cpu", speculative_draft_model_path="x")
    with pytest.raises(ValueError, match="SGLANG_TEV_DFLASH2_MODE"):
        validate_server_args(sa, {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_TEV_DFLASH2_MODE": "selector"})


def test_each_feature_is_served_or_refused(exported):
    _, cfg, parsed, sel, _ = exported
    d2 = SimpleNamespace(candidate_selector=sel, lilicorr=None)
    s = D2.resolve_draft_serving(d2, parsed, {})
    assert (s.mode, s.conv, s.selector_top_k) == ("lattice", TAPS, TOPK)
    assert (s.output_multiplier, s.final_logit_softcapping) == (cfg["dflash_config"]["output_multiplier"],
                                                               cfg["dflash_config"]["final_logit_softcapping"])
    assert s.transformed and not s.plain and "lattice tree" in s.describe()
    m = D2.resolve_draft_serving(d2, parsed, {"SGLANG_TEV_DFLASH2_MODE": "marginal"})
    assert m.mode == "marginal" and "IGNORED" in m.describe() and "full-vocabulary" in m.describe()
    # a DFlash v1 drafter: today's path (neutral transform: SGLang's own candidate_topk is the head)
    v1 = D2.resolve_draft_serving(SimpleNamespace(candidate_selector=None, lilicorr=None),
                                  parse_dflash_draft_config(draft_hf_config={"num_hidden_layers": 1}), {})
    assert v1.mode == "marginal" and v1.plain and v1.marginal_topk_fn(sg.candidate_topk) is sg.candidate_topk
    # conv + transform, no selector: marginal with the transform
    noselect = parse_dflash_draft_config(draft_hf_config={"num_hidden_layers": 1, "dflash_config": dict(
        conv_kernel_size=3, conv_group_size=8, output_multiplier=0.5)})
    ns = D2.resolve_draft_serving(SimpleNamespace(candidate_selector=None, lilicorr=None), noselect, {})
    assert ns.mode == "marginal" and ns.conv == 3 and ns.transformed and not ns.plain
    assert ns.marginal_topk_fn(sg.candidate_topk) is not sg.candidate_topk
    with pytest.raises(ValueError, match="SGLANG_TEV_DFLASH2_MODE=lattice needs a DFlash2 candidate selector"):
        D2.resolve_draft_serving(SimpleNamespace(candidate_selector=None, lilicorr=None), noselect,
                                 {"SGLANG_TEV_DFLASH2_MODE": "lattice"})
    with pytest.raises(ValueError, match="LiLiCorr head"):
        D2.resolve_draft_serving(SimpleNamespace(candidate_selector=None, lilicorr=object()), noselect, {})
    with pytest.raises(ValueError, match="Domino projector"):
        D2.resolve_draft_serving(SimpleNamespace(candidate_selector=None, lilicorr=None),
                                 SimpleNamespace(is_domino=True, projector_type="domino"), {})


# ---------------------------------------------------------------------------------------------
# the heads
# ---------------------------------------------------------------------------------------------

def test_transformed_topk_is_the_transformed_full_vocabulary_law(exported, tp1):
    """marginal mode: ids / vals - lse = top-k of log_softmax(transform(h W^T)) over the full
    vocabulary (z-lab's compute_logits transform), = our SelectorLattice's unary_logq."""
    model, cfg, parsed, _, lm_head = exported
    g = torch.Generator().manual_seed(3)
    h = torch.randn(7, H, generator=g)
    mult, cap = parsed.output_multiplier, parsed.final_logit_softcapping
    ids, vals, lse = D2.transformed_candidate_topk(h, lm_head, TOPK, with_partition=True, output_multiplier=mult,
                                                   final_logit_softcapping=cap)
    full = torch.log_softmax(ours_transform(lm_head(h), mult, cap), -1)
    want_vals, want_ids = full.topk(TOPK, -1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(vals - lse.unsqueeze(-1), want_vals, **TOL)
    # the untransformed law differs (the control: the transform is not a no-op here)
    raw = torch.log_softmax(lm_head(h), -1).gather(-1, ids)
    assert (raw - want_vals).abs().max() > 1e-2
    # without partition: SGLang's radix top-k of the same transformed logits
    ids2, vals2, lse2 = D2.transformed_candidate_topk(h, lm_head, TOPK, output_multiplier=mult,
                                                      final_logit_softcapping=cap)
    assert lse2 is None and torch.equal(ids2, ids) and torch.allclose(vals2, vals)
    # our SelectorLattice's unary law (z-lab semantics) at the same candidates
    with torch.no_grad():
        lat = model.candidate_selector.lattice(h.view(1, 7, H), model.transform_logits(lm_head(h)).view(1, 7, V),
                                               torch.zeros(1, dtype=torch.int64))
    assert torch.equal(lat.candidate_ids[0], ids)
    torch.testing.assert_close(lat.unary_logq[0], vals - lse.unsqueeze(-1), **TOL)


def test_marginal_head_with_transform_compiles_without_a_graph_break(exported, tp1):
    """The folded marginal head (graphs.TevDraftHead with the transformed top-k) is one graph:
    no host sync, so it can sit in the draft graph like the v1 head."""
    from sglang_tev.srt.graphs import TevDraftHead

    _, _, parsed, _, lm_head = exported
    serving = D2.DraftServing(mode="marginal", output_multiplier=parsed.output_multiplier,
                              final_logit_softcapping=parsed.final_logit_softcapping)
    head = TevDraftHead(lm_head=lm_head, block_size=K, topk=TOPK, max_bs=4, device="cpu",
                        topk_fn=serving.marginal_topk_fn(sg.candidate_topk))
    hidden = torch.randn(3 * K, H, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            head(hidden)
            want = [t.clone() for t in head.read(3)]
            head.logq.zero_()
            torch.compile(head.__call__, fullgraph=True, backend="eager")(hidden)
        assert torch.equal(head.read(3)[1], want[1]) and torch.allclose(head.read(3)[0], want[0])
    finally:
        torch._dynamo.reset()


def test_lattice_head_is_sglangs_lattice_normalised_and_equals_ours(exported, tp1):
    """selector_lattice_from_hidden on SGLang's CandidateSelector (our exported tensors, its own
    compute_candidates with the top-k-only transform) = our z-lab-checked SelectorLattice:
    same candidates, transition_logq = log_softmax(scores); block row 0 (the anchor) is skipped."""
    model, _, parsed, sel, lm_head = exported
    dm = _sglang_draft_model(parsed, sel, lm_head)
    bs = 3
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(bs * K, H, generator=g)
    anchor = torch.randint(0, V, (bs,), generator=g)
    with torch.no_grad():
        cand, tlq = D2.selector_lattice_from_hidden(hidden, K, dm, anchor)
        pred = hidden.view(bs, K, H)[:, 1:]
        lat = model.candidate_selector.lattice(pred, model.transform_logits(lm_head(pred)), anchor)
    assert cand.dtype == torch.int64 and cand.shape == (bs, K - 1, TOPK)
    assert tlq.dtype == torch.float32 and tlq.shape == (bs, K - 1, TOPK, TOPK)
    assert torch.equal(cand, lat.candidate_ids)
    torch.testing.assert_close(tlq, lat.transition_logq, **TOL)
    torch.testing.assert_close(tlq.exp().sum(-1), torch.ones(bs, K - 1, TOPK), **TOL)
    # the selector matters: rows of a slot differ (a parent-dependent law, not per-slot marginals)
    assert (tlq[:, 1:, 0] - tlq[:, 1:, 1]).abs().max() > 1e-2
    # one graph (no host sync, no Python fallback): the head can run between replays without a sync
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            c2, t2 = torch.compile(lambda h, a: D2.selector_lattice_from_hidden(h, K, dm, a), fullgraph=True,
                                   backend="eager")(hidden, anchor)
        assert torch.equal(c2, cand) and torch.allclose(t2, tlq, atol=1e-6)
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------------------------

def _random_lattice(b=3, D=5, k=4, seed=0, independent=False):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.stack([torch.randperm(50, generator=g)[:k] for _ in range(D)]) for _ in range(b)])
    scores = 2 * torch.randn(b, D, k, k, generator=g)
    if independent:
        scores = scores[:, :, :1].expand(b, D, k, k).clone()
    return cand.to(torch.int64), torch.log_softmax(scores, -1)


def test_lattice_trees_cap_depth_and_equal_the_builder():
    cand, tlq = _random_lattice()
    roots = torch.tensor([7, 8, 9])
    caps = torch.tensor([4, 0, 2])
    tree = build_lattice_trees(cand, tlq, 10, roots, max_depth=3, depth_cap=caps)
    want = build_lattice_tree(cand[:, :3], tlq[:, :3], 10, roots, depth_limit=caps.clamp(0, 3))
    for f in ("parents", "tokens", "valid", "depth"):
        assert torch.equal(getattr(tree, f), getattr(want, f)), f
    depth = torch.where(tree.valid, tree.depth, 0)
    assert depth[0].max() == 3 and depth[1].max() == 0 and depth[2].max() == 2
    with pytest.raises(ValueError, match="max_depth"):
        build_lattice_trees(cand, tlq, 10, roots, max_depth=6)
    with pytest.raises(ValueError, match="depth_cap"):
        build_lattice_trees(cand, tlq, 10, roots, max_depth=3, depth_cap=caps.to(torch.int32))


def test_lattice_trees_reduce_to_ddtree_on_parent_independent_rows_and_differ_otherwise():
    """Negative control of the lattice mode: with every row of a slot equal the lattice tree is the
    DDTree of those rows (build_trees); with the selector's parent-dependent rows it is not."""
    roots = torch.tensor([1, 2, 3])
    cand, tlq = _random_lattice(independent=True, seed=2)
    a = build_lattice_trees(cand, tlq, 12, roots, max_depth=5)
    b = build_trees(tlq[:, :, 0], cand, 12, roots, max_depth=5)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    cand, tlq = _random_lattice(seed=2)
    a = build_lattice_trees(cand, tlq, 12, roots, max_depth=5)
    b = build_trees(tlq[:, :, 0], cand, 12, roots, max_depth=5)
    assert not (torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents))


# ---------------------------------------------------------------------------------------------
# the graph-head gate
# ---------------------------------------------------------------------------------------------

def test_graph_head_is_eager_for_the_lattice_and_transformed_for_marginal(exported, monkeypatch):
    import sglang.srt.environ as E

    from sglang_tev.srt.graphs import TevDraftHead, build_tev_draft_head

    _, _, parsed, _, lm_head = exported
    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(tp_rank=0, tp_size=1))
    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(
        graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(bs=[1, 2, 4])))))
    monkeypatch.setattr(E.envs.SGLANG_DFLASH_EAGER_DRAFT_SAMPLER, "get", lambda: False)
    worker = SimpleNamespace(
        target_worker=SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(lm_head=lm_head))),
        block_size=K, tev=SimpleNamespace(topk=TOPK), device="cpu",
        _tev_draft=D2.DraftServing(mode="lattice", conv=TAPS, selector_top_k=TOPK,
                                   output_multiplier=parsed.output_multiplier,
                                   final_logit_softcapping=parsed.final_logit_softcapping),
    )
    assert build_tev_draft_head(worker) is None  # the lattice head stays eager: no selector walk folded
    worker._tev_draft = D2.DraftServing(mode="marginal", output_multiplier=parsed.output_multiplier,
                                        final_logit_softcapping=parsed.final_logit_softcapping)
    head = build_tev_draft_head(worker)
    assert isinstance(head, TevDraftHead) and head.topk_fn.func is D2.transformed_candidate_topk
    assert head.topk_fn.keywords["output_multiplier"] == parsed.output_multiplier
    worker._tev_draft = D2.DraftServing(mode="marginal")  # a v1 drafter: SGLang's candidate_topk, as before
    assert build_tev_draft_head(worker).topk_fn is sg.candidate_topk


def test_config_check_refuses_before_any_model_loads(exported):
    """``TevAlgo.handle_server_args`` -> ``check_draft_features``: the refusals read from the
    drafter's config alone (the worker repeats them on the loaded model)."""
    _, cfg, _, _, _ = exported
    D2.check_draft_config(cfg, {})  # DFlash2 with a selector: served
    D2.check_draft_config(cfg, {"SGLANG_TEV_DFLASH2_MODE": "lattice"})
    noselect = {**cfg, "architectures": ["DFlashDraftModel"]}  # SGLang builds no selector for it
    D2.check_draft_config(noselect, {})
    with pytest.raises(ValueError, match="needs a DFlash2 candidate selector"):
        D2.check_draft_config(noselect, {"SGLANG_TEV_DFLASH2_MODE": "lattice"})
    with pytest.raises(ValueError, match="LiLiCorr head"):
        D2.check_draft_config({**cfg, "architectures": ["LiLiCorrDraftModel"]}, {})
    domino = {**cfg, "dflash_config": {**cfg["dflash_config"], "projector_type": "domino", "gru_hidden_dim": 8,
                                       "shift_label": True, "pure_draft_prefix_len": 1,
                                       "emb_dim": 8}}
    with pytest.raises(ValueError, match="Domino projector"):
        D2.check_draft_config(domino, {})
