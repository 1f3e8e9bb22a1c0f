"""DFlash2 drafters (issue 28, first part): config, conv, logit transform, candidate selector and
checkpoints against z-lab's reference package `dflash` 0.1.0 (``dflash/model.py``:
``DFlash2DraftModel``, ``GroupedDynamicCausalConv``, ``CandidateSelector``, ``compute_logits``).

Tiny random DFlash2 configs, float32, CPU. The reference's conv breaks on blocks shorter than its
taps (a shape error in ``F.pad``): those cases are asserted to raise there and compared on the
positions the reference can compute. ``dflash_generate`` is not called (it would synchronise CUDA
for its stats); its draft step (model forward + ``propose``) is run piecewise.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from sglang_tev import build_ddtree, build_ddtree_topk
from sglang_tev.draft.dflash import DFlashConfig, DFlashDraftModel, block_train_mask, extract_context_features
from sglang_tev.draft.dflash2 import (
    GroupedCausalConv,
    grouped_causal_conv,
    path_q_rows,
    selector_walk,
    transform_logits,
)
from dflash2_helpers import CAP, DFLASH2, GROUP, H, K, LAYER_IDS, MASK, MULT, RANK, TAPS, TOL, TOPK, V, _config_dict, _ours, _randomize, _runtime_dflash2, _shipped_as_dflash2, _target

try:
    import dflash.model as ref_mod  # z-lab reference (test oracle)
    _REF_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means "no oracle here"
    ref_mod, _REF_ERROR = None, e

needs_ref = pytest.mark.skipif(ref_mod is None, reason=f"oracle package `dflash` not importable ({_REF_ERROR!r}); "
                                                       "install it with `pip install --no-deps dflash==0.1.0`")

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, our DFlash2 drafter, the reference loaded from our exported checkpoint); skips
    the tests that use it when the oracle package is not installed."""
    if ref_mod is None:
        pytest.skip(f"oracle package `dflash` not importable ({_REF_ERROR!r}); install it with "
                    "`pip install --no-deps dflash==0.1.0`")
    ours = _ours()
    path = tmp_path_factory.mktemp("d2") / "draft"
    ours.save_pretrained(path)
    ref, info = ref_mod.DFlash2DraftModel.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return _target(), ours, ref.eval()


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel"])
def test_config_parses_dflash2_keys_in_dflash_config_or_top_level(arch):
    a = DFlashConfig.from_dict(_config_dict(arch))
    b = DFlashConfig.from_dict(_config_dict(arch, top_level=True))
    assert a == b and a.is_dflash2 and a.architecture == arch
    assert (a.conv_kernel_size, a.conv_group_size, a.selector_rank, a.selector_top_k) == (TAPS, GROUP, RANK, TOPK)
    assert (a.output_multiplier, a.final_logit_softcapping) == (MULT, CAP)
    back = DFlashConfig.from_dict(json.loads(json.dumps(a.to_dict())))
    assert back == a and back.to_dict()["architectures"] == [arch]
    assert {k: back.to_dict()["dflash_config"][k] for k in DFLASH2} == DFLASH2  # where SGLang reads them


def test_config_optional_conv_and_neutral_transform():
    cfg = DFlashConfig.from_dict(_config_dict(conv_kernel_size=0, conv_group_size=0, output_multiplier=None,
                                              final_logit_softcapping=0))
    assert cfg.conv_kernel_size is None and cfg.output_multiplier == 1.0 and cfg.final_logit_softcapping is None
    model = DFlashDraftModel(cfg)
    assert model.layers[0].attention_conv is None and hasattr(model, "candidate_selector")
    x = torch.randn(3, 7)
    assert model.transform_logits(x) is x


@pytest.mark.parametrize("edit, match", [
    (dict(conv_group_size=None), "conv_group_size"),
    (dict(conv_kernel_size=None), "conv_kernel_size"),
    (dict(conv_kernel_size=-2), "conv_kernel_size"),
    (dict(conv_kernel_size=2.5), "conv_kernel_size"),
    (dict(conv_group_size=7), "conv_group_size"),  # does not divide hidden 64
    (dict(selector_top_k=None), "selector_top_k"),
    (dict(selector_rank=None, selector_top_k=None), "selector_rank"),
    (dict(selector_top_k=V + 1), "selector_top_k"),
    (dict(selector_rank=True), "selector_rank"),
    (dict(output_multiplier=0.0), "output_multiplier"),
    (dict(output_multiplier=-1.0), "output_multiplier"),
    (dict(output_multiplier=float("inf")), "output_multiplier"),
    (dict(output_multiplier="2"), "output_multiplier"),
    (dict(final_logit_softcapping=-3.0), "final_logit_softcapping"),
    (dict(final_logit_softcapping="30"), "final_logit_softcapping"),
])
def test_config_rejects_bad_dflash2_fields(edit, match):
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_dict(_config_dict(**edit))


def test_config_rejects_other_dflash2_inputs():
    cfg = _config_dict()
    del cfg["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        DFlashConfig.from_dict(cfg)
    cfg = _config_dict()
    cfg["selector_rank"] = RANK * 2  # top level disagrees with dflash_config
    with pytest.raises(ValueError, match="selector_rank"):
        DFlashConfig.from_dict(cfg)
    for key, value in (("projector_type", "domino"), ("input_embedding_scale", 2.0),
                       ("attention_value_scale", 1.5), ("is_causal", True)):
        cfg = _config_dict()
        cfg["dflash_config"][key] = value
        with pytest.raises(ValueError, match=key):
            DFlashConfig.from_dict(cfg)
    # v1 architecture: DFlash2 keys stay refused (SGLang's v1 model ignores the selector and the transform)
    for key in DFLASH2:
        with pytest.raises(ValueError, match=key):
            DFlashConfig.from_dict(_config_dict("DFlashDraftModel", **{k: None for k in DFLASH2 if k != key}))
    with pytest.raises(ValueError, match="architectures"):
        DFlashConfig.from_dict(_config_dict("DFlash3DraftModel"))
    base = DFlashConfig.from_dict(_config_dict())
    with pytest.raises(ValueError, match="conv_kernel_size.*needs a DFlash2 architecture"):  # direct, v1 arch
        DFlashConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "architecture": "DFlashDraftModel"})


def test_checkpoint_round_trip_and_missing_weights(tmp_path):
    ours = _ours()
    ours.save_pretrained(tmp_path / "d")
    back = DFlashDraftModel.from_pretrained(tmp_path / "d")
    assert back.config == ours.config
    for name, t in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    from safetensors.torch import load_file, save_file
    stored = load_file(str(tmp_path / "d" / "model.safetensors"))
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight", "layers.1.attention_conv.base_kernel",
                 "layers.0.mlp_conv.kernel_projection.weight"):
        assert name in stored
    assert stored["layers.0.mlp_conv.base_kernel"].shape == (2, TAPS, H)
    assert stored["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * TAPS * H // GROUP, H)
    assert stored["candidate_selector.predecessor_codebook"].shape == (V, RANK)
    del stored["layers.1.mlp_conv.base_kernel"]
    save_file(stored, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp_conv.base_kernel"):
        DFlashDraftModel.from_pretrained(tmp_path / "d")


# ---------------------------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------------------------

def _conv_pair(seed=3):
    ours = _randomize(GroupedCausalConv(H, TAPS, GROUP), seed, std=0.3)
    ref = ref_mod.GroupedDynamicCausalConv(H, TAPS, GROUP)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _both_sides(conv, x, y, **kw):
    out, delta = conv.prepare(x, **kw)
    return out, conv.finish(y, delta, **kw)


@needs_ref
def test_conv_matches_reference_and_restarts_at_each_block():
    ours, ref = _conv_pair()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3 * K, H, generator=g), torch.randn(2, 3 * K, H, generator=g)
    with torch.no_grad():
        one = _both_sides(ours, x[:, :K], y[:, :K])
        for a, b in zip(one, _both_sides(ref, x[:, :K], y[:, :K])):
            torch.testing.assert_close(a, b, **TOL)
        # three blocks in one call == the reference on each block alone (kernel restarts)
        got = _both_sides(ours, x, y, block_len=K)
        want = [torch.cat(t, 1) for t in zip(*(_both_sides(ref, x[:, i:i + K], y[:, i:i + K]) for i in range(0, 3 * K, K)))]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
        # ... and not the conv run across the boundary, which reads the previous block
        across = _both_sides(ours, x, y)
        for a, b in zip(got, across):
            torch.testing.assert_close(a[:, :K], b[:, :K], **TOL)
            assert (a[:, K:K + TAPS - 1] - b[:, K:K + TAPS - 1]).abs().amin(-1).gt(1e-4).all()
            torch.testing.assert_close(a[:, K + TAPS - 1:2 * K], b[:, K + TAPS - 1:2 * K], **TOL)


@needs_ref
def test_conv_on_blocks_shorter_than_the_taps():
    ours, ref = _conv_pair(seed=4)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, K, H, generator=g), torch.randn(2, K, H, generator=g)
    with torch.no_grad():
        long_ref = _both_sides(ref, x, y)
        for n in range(1, TAPS + 1):
            short = _both_sides(ours, x[:, :n], y[:, :n])  # defined for every length
            for a, b in zip(short, long_ref):  # causal: the first n outputs of a longer block
                torch.testing.assert_close(a, b[:, :n], **TOL)
            if n >= TAPS - 1:
                for a, b in zip(short, _both_sides(ref, x[:, :n], y[:, :n])):
                    torch.testing.assert_close(a, b, **TOL)
            else:  # the reference's F.pad shape breaks once a tap offset exceeds the block
                with pytest.raises(RuntimeError):
                    _both_sides(ref, x[:, :n], y[:, :n])
        # blocks of 2 (< taps) in one call: each block only sees its own two tokens
        got = _both_sides(ours, x, y, block_len=2)
        for i in range(0, K, 2):
            for a, b in zip(got, _both_sides(ours, x[:, i:i + 2], y[:, i:i + 2])):
                torch.testing.assert_close(a[:, i:i + 2], b, **TOL)
    with pytest.raises(ValueError, match="delta"):
        grouped_causal_conv(x, torch.zeros(TAPS, H), torch.zeros(2, K, TAPS, 3), GROUP)


# ---------------------------------------------------------------------------------------------
# Model, transformed logits, selector
# ---------------------------------------------------------------------------------------------

def _round_inputs(target, seed=7, b=2, t=15):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (b, t), generator=g)
    with torch.no_grad():
        feats = extract_context_features(target(ids, output_hidden_states=True).hidden_states, LAYER_IDS)
    return ids, feats


def _ref_block(ref, target, ids, feats, start, cache, n_ctx, k=K):
    """The reference's draft step of dflash_generate: hidden of slots 1..k-1, transformed logits."""
    b = ids.shape[0]
    block = torch.full((b, k), MASK)
    block[:, 0] = ids[:, start]
    pos = torch.arange(start - n_ctx, start + k)[None].expand(b, -1)
    h = ref(target_hidden=feats, noise_embedding=target.model.embed_tokens(block), position_ids=pos,
            past_key_values=cache, use_cache=True)[:, 1 - k:]
    remove = cache.get_seq_length() - start
    if remove > 0:
        cache.crop(-remove)
    return h, ref.compute_logits(h, target.lm_head)


@needs_ref
def test_transformed_logits_match_reference_over_two_rounds(pair):
    target, ours, ref = pair
    embed, head = target.model.embed_tokens, target.lm_head
    ids, feats = _round_inputs(target)
    P, T2 = 9, 3
    ref_cache, cache = DynamicCache(config=ref.config), ours.new_cache()
    with torch.no_grad():
        for ctx, start in ((feats[:, :P], P), (feats[:, P:P + T2], P + T2)):
            _, want = _ref_block(ref, target, ids, feats=ctx, start=start, cache=ref_cache, n_ctx=ctx.shape[1])
            got = ours.draft_logits(embed, head, ids[:, start], start, ctx, cache)
            torch.testing.assert_close(got, want, **TOL)
        # the transform acts: |logits| <= cap, and differs from the untransformed head
        assert got.abs().max() <= CAP
        raw = ours.draft_logits(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache())
    plain = copy.deepcopy(ours)
    object.__setattr__(plain.config, "output_multiplier", 1.0)
    object.__setattr__(plain.config, "final_logit_softcapping", None)
    with torch.no_grad():
        untransformed = plain.draft_logits(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache())
    torch.testing.assert_close(raw, transform_logits(untransformed, MULT, CAP), **TOL)
    assert (raw - untransformed).abs().max() > 0.5
    # the conv matters: the same weights without it give other logits
    noconv = copy.deepcopy(ours)
    for layer in noconv.layers:
        layer.attention_conv = layer.mlp_conv = None
    with torch.no_grad():
        assert (noconv.draft_logits(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache()) - raw).abs().max() > 0.1


@needs_ref
def test_short_final_block_where_the_reference_fails(pair):
    """dflash_generate shortens the last block near max_new_tokens. A block of 2 tokens (< taps - 1)
    breaks the reference's conv; ours drafts it (finite, and not the full block's slot: attention
    is bidirectional inside the block). At 3 = taps - 1 tokens both run and agree."""
    target, ours, ref = pair
    embed, head = target.model.embed_tokens, target.lm_head
    ids, feats = _round_inputs(target, seed=8)
    P = 10
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            _ref_block(ref, target, ids, feats[:, :P], P, DynamicCache(config=ref.config), P, k=2)
        short = ours.draft_logits(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache(), block_size=2)
        full = ours.draft_logits(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache())
        _, ref3 = _ref_block(ref, target, ids, feats[:, :P], P, DynamicCache(config=ref.config), P, k=3)
        ours3 = ours.draft_logits(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache(), block_size=3)
    assert short.shape == (2, 1, V) and torch.isfinite(short).all()
    torch.testing.assert_close(ours3, ref3, **TOL)  # 3 = taps - 1: the shortest block the reference runs
    # attention is bidirectional inside the block, so the slot differs from the full block's slot 1
    assert not torch.allclose(short[:, 0], full[:, 0])


def _record_ref_scores(monkeypatch):
    """Wrap the reference's _sampling_probs so that select's T > 0 score rows are recorded."""
    seen = []
    real = ref_mod._sampling_probs

    def spy(logits, temperature, *a, **kw):
        seen.append(logits[:, 0].clone())  # select passes scores[:, None]: [b, 1, k]
        return real(logits, temperature, *a, **kw)

    monkeypatch.setattr(ref_mod, "_sampling_probs", spy)
    return seen


def _align(ids, values):
    """Sort the last dim by candidate id, so both implementations' candidate orders agree."""
    order = ids.argsort(-1)
    return ids.gather(-1, order), values.gather(-1, order)


@needs_ref
@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_selector_matches_reference(pair, monkeypatch, temperature):
    """Candidates, unary values, selector scores along the walk, the greedy walk (T = 0) and the
    q rows of a sampled walk (T > 0) equal the reference's CandidateSelector.select."""
    target, ours, ref = pair
    embed, head = target.model.embed_tokens, target.lm_head
    ids, feats = _round_inputs(target, seed=9, b=3)
    P = 12
    seen = _record_ref_scores(monkeypatch)
    with torch.no_grad():
        h, ref_logits = _ref_block(ref, target, ids, feats[:, :P], P, DynamicCache(config=ref.config), P)
        torch.manual_seed(5)
        path, ref_cand, ref_q = ref.candidate_selector.select(h, ref_logits, ids[:, P], temperature)
        logits, lat = ours.draft_lattice(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache())
    b, D = 3, K - 1
    assert lat.candidate_ids.shape == (b, D, TOPK) and lat.transition_logq.shape == (b, D, TOPK, TOPK)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    got_ids, _ = _align(lat.candidate_ids, lat.candidate_ids)
    assert torch.equal(got_ids, ref_cand.sort(-1).values)
    # unary log q: the full-vocabulary marginal at the candidates; descending
    torch.testing.assert_close(lat.unary_logq, torch.log_softmax(ref_logits, -1).gather(-1, lat.candidate_ids), **TOL)
    assert (lat.unary_logq[..., :-1] >= lat.unary_logq[..., 1:]).all()
    # transition rows: log_softmax of the scores; slot 0's rows are one law (given the anchor)
    torch.testing.assert_close(lat.transition_logq, torch.log_softmax(lat.scores, -1))
    torch.testing.assert_close(lat.scores[:, 0, 1:], lat.scores[:, 0, :1].expand(-1, TOPK - 1, -1))
    bilinear = lat.scores - (lat.unary_logq + torch.logsumexp(logits, -1, keepdim=True))[:, :, None, :]
    assert bilinear.abs().max() > 0.5  # the selector is not the marginal
    # indices of the reference's path in our candidate order
    idx = (lat.candidate_ids == path[..., None]).float().argmax(-1)
    assert torch.equal(lat.candidate_ids.gather(-1, idx[..., None])[..., 0], path)
    if temperature == 0:
        tokens, indices, q = selector_walk(lat, 0.0)
        assert torch.equal(tokens, path) and torch.equal(indices, idx)
        assert ref_q is None and torch.equal(q, torch.nn.functional.one_hot(idx, TOPK).float())
        # greedy walk != the per-slot argmax chain somewhere: the transitions steer it
        assert not torch.equal(path, lat.candidate_ids[..., 0])
        return
    # the recorded reference score rows along its sampled path == our lattice rows there
    assert len(seen) == D
    prev = torch.cat([torch.zeros_like(idx[:, :1]), idx[:, :-1]], 1)
    for d in range(D):
        ours_row = lat.scores[torch.arange(b), d, prev[:, d]]
        _, a = _align(lat.candidate_ids[:, d], ours_row)
        _, r = _align(ref_cand[:, d], seen[d])
        torch.testing.assert_close(a, r, **TOL)
    q = path_q_rows(lat, idx, temperature)
    _, qa = _align(lat.candidate_ids, q)
    _, qr = _align(ref_cand, ref_q)
    torch.testing.assert_close(qa, qr, **TOL)


def test_selector_walk_samples_the_transition_rows(pair):
    """At T > 0 the walk's slot-0 and (slot 0 -> slot 1) frequencies follow the q rows; uniforms
    given = the only randomness; bad inputs named."""
    target, ours, _ = pair
    ids, feats = _round_inputs(target, seed=10, b=1)
    with torch.no_grad():
        _, lat = ours.draft_lattice(target.model.embed_tokens, target.lm_head, ids[:, 9], 9, feats[:, :9],
                                    ours.new_cache())
    n, T = 6000, 1.3
    big = type(lat)(*(t.expand(n, *t.shape[1:]) for t in (lat.candidate_ids, lat.unary_logq, lat.scores,
                                                          lat.transition_logq)))
    tokens, idx, q = selector_walk(big, T, generator=torch.Generator().manual_seed(0))
    q0 = torch.softmax(lat.scores[0, 0, 0] / T, -1)
    freq0 = torch.bincount(idx[:, 0], minlength=TOPK).float() / n
    assert (freq0 - q0).abs().max() < 0.03
    top = int(q0.argmax())
    sel = idx[:, 0] == top
    q1 = torch.softmax(lat.scores[0, 1, top] / T, -1)
    freq1 = torch.bincount(idx[sel, 1], minlength=TOPK).float() / sel.sum()
    assert (freq1 - q1).abs().max() < 0.05
    torch.testing.assert_close(q[sel][:, 1], q1.expand(int(sel.sum()), -1))
    u = torch.rand(n, K - 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a = selector_walk(big, T, uniforms=u)
    b = selector_walk(big, T, uniforms=u, generator=torch.Generator().manual_seed(99))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="uniforms"):
        selector_walk(big, T, uniforms=u[:, :2])
    with pytest.raises(ValueError, match="temperature"):
        selector_walk(big, -1.0)
    with pytest.raises(ValueError, match="temperature"):
        path_q_rows(big, idx, 0.0)
    with pytest.raises(ValueError, match="anchor_ids"):
        ours.candidate_selector.lattice(torch.zeros(1, 2, H), torch.zeros(1, 2, V), torch.zeros(1, dtype=torch.int32))


def test_marginal_mode_tree_equals_the_unary_topk_tree(pair):
    """build_ddtree on the transformed logits == build_ddtree_topk on the lattice's unary log q
    (budget <= selector_top_k, so no per-depth list needs more than k candidates)."""
    target, ours, _ = pair
    ids, feats = _round_inputs(target, seed=11, b=2)
    with torch.no_grad():
        logits, lat = ours.draft_lattice(target.model.embed_tokens, target.lm_head, ids[:, 8], 8, feats[:, :8],
                                         ours.new_cache())
    a = build_ddtree(logits, TOPK, ids[:, 8])
    b = build_ddtree_topk(lat.unary_logq, lat.candidate_ids, TOPK, ids[:, 8])
    assert torch.equal(a.parents, b.parents) and torch.equal(a.tokens, b.tokens)
    assert int(a.valid.sum()) == 2 * (TOPK + 1)


def test_forward_train_restarts_the_conv_per_block(pair):
    """The training forward over two blocks == each block drafted alone on its context."""
    target, ours, _ = pair
    ids, feats = _round_inputs(target, seed=12, b=1, t=14)
    anchors = torch.tensor([[5, 9]])
    emb = target.model.embed_tokens
    blocks = torch.full((1, 2, K), MASK)
    blocks[..., 0] = ids[0, anchors[0]]
    pos = (anchors[..., None] + torch.arange(K)).reshape(1, -1)
    with torch.no_grad():
        h = ours.forward_train(feats, emb(blocks.reshape(1, -1)), pos, block_train_mask(anchors, 14, K))
        for i, a in enumerate(anchors[0].tolist()):
            want = ours.forward(feats[:, :a], torch.arange(a), emb(blocks[:, i]), pos[:, i * K:(i + 1) * K])
            torch.testing.assert_close(h[:, i * K:(i + 1) * K], want, **TOL)
        with pytest.raises(ValueError, match="block_embeds"):
            ours.forward_train(feats, emb(blocks.reshape(1, -1))[:, :-1], pos[:, :-1],
                               block_train_mask(anchors, 14, K)[:, :-1, :-1])


# ---------------------------------------------------------------------------------------------
# Transformers runtime, marginal mode: the DFlash2 drafter's transformed marginals into DDTree
# ---------------------------------------------------------------------------------------------

def test_static_runner_equals_the_model_on_ragged_rows():
    """hf/dflash_runner's fused batched draft (conv in every layer, logit transform) == the
    one-sequence DFlashDraftModel.draft_logits, over ragged rows, commits and a row move."""
    from runtime_helpers import Sim

    from sglang_tev.testing.models import qwen3

    target = qwen3(0)
    sim = Sim((target, _runtime_dflash2(target)), [5, 12, 8], seed=4)
    got = sim.draft()
    assert got.abs().max() <= 2.5  # the softcap reached the runtime's logits
    for accepted in [[0, 4, 2], [5, 0, 1]]:
        sim.commit(accepted)
        sim.draft()
    sim.retire(0)
    sim.draft()


def test_generate_greedy_with_a_dflash2_drafter_equals_plain_decoding(tmp_path, capsys):
    """`sglang-tev generate` with a DFlash2 checkpoint: stdout == plain greedy decoding's text,
    and the runtime (from_pretrained) decodes 200 tokens identical to plain greedy with tau >= 2."""
    from sglang_tev.cli import main
    from sglang_tev.hf.runtime import SpeculativeGenerator
    from sglang_tev.testing.models import plain_greedy

    target_dir, draft_dir, model = _shipped_as_dflash2(tmp_path)
    gen = SpeculativeGenerator.from_pretrained(target_dir, draft_dir, dtype=torch.float32, device="cpu")
    assert gen.drafter.model.config.architecture == "DFlash2BeamDraftModel"
    assert gen.drafter.model.layers[1].mlp_conv is not None
    prompt = "def merge_sorted(a, b):\n"
    ids = gen.tokenizer(prompt)["input_ids"]
    res = gen.generate(ids, method="tev", budget=16, max_new_tokens=200, ignore_eos=True)
    assert res.token_ids == plain_greedy(gen.target, ids, 200)
    assert res.tau >= 2.0, res.tau
    rc = main(["generate", "--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu",
               "--no-chat-template", "--ignore-eos", "--max-new-tokens", "40", "--budget", "8", prompt])
    out, err = capsys.readouterr()
    assert rc == 0, err
    want = plain_greedy(gen.target, ids, 40)
    assert out == gen.tokenizer.decode(want, skip_special_tokens=True)


def test_lattice_feeds_the_lattice_tree_builder(pair):
    """Our SelectorLattice is the layout of draft/lattice.py (issue 28 item 2): its selector_chain
    on transition_logq walks as selector_walk (greedy, and sampled with the same uniforms), and
    build_lattice_tree accepts it (validated rows)."""
    from sglang_tev.draft.lattice import build_lattice_tree, selector_chain

    target, ours, _ = pair
    ids, feats = _round_inputs(target, seed=13, b=3)
    root = ids[:, 10]
    with torch.no_grad():
        _, lat = ours.draft_lattice(target.model.embed_tokens, target.lm_head, root, 10, feats[:, :10],
                                    ours.new_cache())
    u = torch.rand(3, K - 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for T in (0.0, 0.9):
        chain = selector_chain(lat.candidate_ids, lat.transition_logq, root, T, uniforms=u)
        tokens, _, _ = selector_walk(lat, T, uniforms=u)
        assert torch.equal(chain.tokens[:, 1:], tokens) and torch.equal(chain.tokens[:, 0], root)
    tree = build_lattice_tree(lat.candidate_ids, lat.transition_logq, 12, root)
    assert tree.tokens.shape == (3, 13) and bool(tree.valid.all())
    # its first node is slot 0's most likely candidate given the root
    assert torch.equal(tree.tokens[:, 1], lat.candidate_ids[:, 0].gather(1, lat.transition_logq[:, 0, 0].argmax(-1, keepdim=True))[:, 0])
