"""DFlash drafter (sglang_tev.draft.dflash) against the z-lab reference package `dflash` 0.1.0.

The oracle tests need `pip install --no-deps dflash==0.1.0` and skip without it. Tiny random
Qwen3 models (hidden 64, vocab 160), float32, CPU.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from sglang_tev.draft.dflash import io as dflash_io  # the module that calls save_file
from sglang_tev.draft.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    block_train_mask,
    build_target_layer_ids,
    extract_context_features,
)
from sglang_tev.hf.runtime import cache_kwargs

try:
    import dflash.model as ref_mod  # z-lab reference implementation (test oracle)
    _REF_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means "no oracle here"
    ref_mod, _REF_ERROR = None, e

needs_ref = pytest.mark.skipif(
    ref_mod is None,
    reason=f"oracle package `dflash` not importable ({_REF_ERROR!r}); "
           "install it with `pip install --no-deps dflash==0.1.0`")

V, MASK, H = 160, 159, 64
TARGET_LAYERS, LAYER_IDS, K = 4, [0, 2, 3], 6
DIMS = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-6, vocab_size=V)
RTOL, ATOL = 1e-4, 1e-5


def crop_hf_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of an HF cache (transformers >= 5.20 only accepts a
    negative count to remove)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Seeded weights large enough that every projection matters (HF init is std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):  # != 1 so q_norm/k_norm/... mix-ups show
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return module.eval()


def _target(seed: int = 1) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
                      attn_implementation="sdpa", **DIMS)
    return _randomize(Qwen3ForCausalLM(cfg), seed)


def _draft_config_dict(**overrides) -> dict:
    """A z-lab style config.json for the tiny drafter (SpecForge qwen3-4b-dflash.json keys)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": K,
        "bos_token_id": 1, "dflash_config": {"mask_token_id": MASK, "target_layer_ids": LAYER_IDS},
        "dtype": "float32", "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
        "intermediate_size": 96, "layer_types": ["full_attention"] * 2, "max_window_layers": 2,
        "model_type": "qwen3", "num_hidden_layers": 2, "num_target_layers": TARGET_LAYERS,
        "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": None,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, **DIMS,
    }
    cfg.update(overrides)
    return cfg


def _ours(seed: int = 2) -> DFlashDraftModel:
    return _randomize(DFlashDraftModel(DFlashConfig.from_dict(_draft_config_dict())), seed)


def _reference(seed: int = 2):
    cfg = Qwen3Config(intermediate_size=96, num_hidden_layers=2, num_target_layers=TARGET_LAYERS,
                      block_size=K, dflash_config={"mask_token_id": MASK,
                                                   "target_layer_ids": LAYER_IDS}, **DIMS)
    return _randomize(ref_mod.DFlashDraftModel(cfg), seed)


def _zlab_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


@pytest.fixture
def dflash_ckpt(tmp_path) -> tuple[Path, DFlashDraftModel]:
    """Our tiny drafter saved in the z-lab layout."""
    model = _ours()
    path = tmp_path / "draft"
    model.save_pretrained(path)
    return path, model


def _features(target, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return extract_context_features(out.hidden_states, LAYER_IDS)


# ---------------------------------------------------------------------------------------------
# Oracle: per-depth logits, cache contents, greedy chain generation
# ---------------------------------------------------------------------------------------------

@needs_ref
def test_parameter_names_are_the_zlab_tensor_names():
    expected = _zlab_names(2)
    assert len(expected) == 11 * 2 + 3
    assert set(_reference().state_dict()) == expected
    assert set(_ours().state_dict()) == expected


@needs_ref
def test_draft_logits_match_reference_with_incremental_cache(tmp_path):
    """Two rounds, batch 2: context appended across calls; logits and cached K/V equal the oracle."""
    target, ref = _target(), _reference()
    ref.save_pretrained(tmp_path / "ref")  # HF save of the reference = z-lab layout
    ours = DFlashDraftModel.from_pretrained(tmp_path / "ref")
    embed, head = target.model.embed_tokens, target.lm_head
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V - 1, (2, 15), generator=g)
    feats = _features(target, ids)  # [2, 15, 3H]
    P, T2 = 11, 3  # round 1: context 0..P-1, root at P; round 2: +T2 tokens, root at P+T2
    ref_cache, cache = DynamicCache(config=ref.config), ours.new_cache()
    with torch.no_grad():
        for ctx, start in ((feats[:, :P], P), (feats[:, P:P + T2], P + T2)):
            root = ids[:, start]
            block = torch.full((2, K), MASK).index_copy(1, torch.tensor([0]), root[:, None])
            pos = torch.arange(start - ctx.shape[1], start + K)[None].expand(2, -1)
            h = ref(target_hidden=ctx, noise_embedding=embed(block), position_ids=pos,
                    past_key_values=ref_cache, use_cache=True)
            expected = head(h[:, 1:]).float()
            crop_hf_cache(ref_cache, start)
            got = ours.draft_logits(embed, head, root, start, ctx, cache)
            assert got.shape == (2, K - 1, V) and got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
            assert cache.length == start
            for i in range(2):  # context K (k_norm + RoPE) and V, block K/V not kept
                k, v = cache.layer(i)
                torch.testing.assert_close(k, ref_cache.layers[i].keys, rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(v, ref_cache.layers[i].values, rtol=RTOL, atol=ATOL)
    # The root enters only through its embedding: another root changes every depth's logits.
    with torch.no_grad():
        fresh = ours.draft_logits(embed, head, ids[:, P] + 1, P, feats[:, :P], ours.new_cache())
        base = ours.draft_logits(embed, head, ids[:, P], P, feats[:, :P], ours.new_cache())
    assert not torch.allclose(fresh, base)


def _chain_generate_greedy(model, target, input_ids, max_new_tokens):
    """Greedy DFlash chain decoding, written from dflash_generate's contract (T = 0, no stops).

    Per round: draft -> per-depth argmax chain -> target forward over [root, drafts] (causal) ->
    accept while draft == target argmax -> bonus -> crop target cache; next context = target
    features of the root and accepted tokens. Returns (token ids, draft logits per round).
    """
    embed, head = target.model.embed_tokens, target.lm_head
    P = input_ids.shape[1]
    max_length = P + max_new_tokens
    tcache, dcache = DynamicCache(config=target.config), model.new_cache()
    out = target(input_ids, **cache_kwargs(target, tcache), use_cache=True, output_hidden_states=True)
    tokens = input_ids[0].tolist() + [int(out.logits[0, -1].argmax())]
    ctx = model.extract_context_features(out.hidden_states)
    start, rounds, accepts = P, [], []
    while start + 1 < max_length:
        block_size = min(model.block_size, max_length - start)
        root = torch.tensor([tokens[start]])
        logits = model.draft_logits(embed, head, root, start, ctx, dcache, block_size=block_size)
        rounds.append(logits)
        drafts = logits[0].argmax(-1)
        block = torch.cat([root, drafts])[None]
        out = target(block, position_ids=torch.arange(start, start + block_size)[None],
                     **cache_kwargs(target, tcache), use_cache=True, output_hidden_states=True)
        posterior = out.logits[0].argmax(-1)
        acc = int((drafts == posterior[:-1]).cumprod(0).sum())
        tokens = tokens[:start + 1] + drafts[:acc].tolist() + [int(posterior[acc])]
        produced = min(acc + 1, max_length - start - 1)
        accepts.append(acc)
        start += produced
        crop_hf_cache(tcache, start)
        ctx = model.extract_context_features(out.hidden_states)[:, :produced]
        assert dcache.length == start - produced  # context only, up to the old root
    return tokens[:min(start + 1, max_length)], rounds, accepts


def _fixed_point_pair(target, ref, z):
    """Target whose greedy continuation climbs x -> x+1 up to z, then repeats z; drafter drafts z.

    Gives rounds with 0 and with K-1 accepted drafts, so multi-token contexts are appended.
    """
    with torch.no_grad():
        for layer in target.model.layers:  # residual stream = token embedding at every layer
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = target.model.embed_tokens.weight
        emb.mul_(0.3)
        chain = torch.arange(z - 10, V)
        q, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(3)))
        emb[chain] = q[:len(chain)] * 8  # orthogonal rows: argmax of lm_head is exact
        succ = torch.clamp(torch.arange(V) + 1, max=z)
        target.lm_head.weight.copy_(torch.zeros(V, H).index_add_(0, succ, emb))
        for layer in ref.layers:  # small updates: mask slots stay near MASK's embedding -> z
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)


@needs_ref
@pytest.mark.parametrize("scenario", ["random", "fixed_point"])
def test_chain_generate_matches_reference_dflash_generate(tmp_path, scenario):
    target, ref = _target(), _reference()
    z = V - 4
    if scenario == "fixed_point":
        _fixed_point_pair(target, ref, z)
        prompt = torch.tensor([[5, 17, 30, z - 7]])
    else:
        prompt = torch.randint(0, V - 1, (1, 9), generator=torch.Generator().manual_seed(4))
    ref_rounds = []
    compute_logits = ref.compute_logits
    ref.compute_logits = lambda h, head: ref_rounds.append(compute_logits(h, head)) or ref_rounds[-1]
    expected = ref_mod.dflash_generate(ref, target, prompt, 27, None, return_stats=False)
    ref.save_pretrained(tmp_path / "ref")
    ours = DFlashDraftModel.from_pretrained(tmp_path / "ref")
    with torch.no_grad():
        tokens, rounds, accepts = _chain_generate_greedy(ours, target, prompt, 27)
    assert tokens == expected[0].tolist()
    assert len(rounds) == len(ref_rounds)
    for got, want in zip(rounds, ref_rounds):
        torch.testing.assert_close(got, want.float(), rtol=RTOL, atol=ATOL)
    if scenario == "fixed_point":  # precondition: both short and full rounds happened
        assert 0 in accepts and K - 1 in accepts, accepts


@needs_ref
def test_default_target_layer_ids_match_reference():
    for n_target, n_draft in [(36, 5), (32, 5), (4, 1), (48, 3), (28, 2)]:
        assert build_target_layer_ids(n_target, n_draft) == \
            ref_mod.build_target_layer_ids(n_target, n_draft)


# ---------------------------------------------------------------------------------------------
# Training path, cache, features
# ---------------------------------------------------------------------------------------------

def test_forward_train_matches_incremental_path():
    """Each block of the masked full-sequence forward equals a fresh draft_logits at its anchor."""
    target, model = _target(), _ours()
    embed, head = target.model.embed_tokens, target.lm_head
    S = 14
    ids = torch.randint(0, V - 1, (2, S), generator=torch.Generator().manual_seed(5))
    feats = _features(target, ids)
    anchors = torch.tensor([[0, 4, 9], [2, 3, S - 1]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    block_ids = torch.full((2, 3, K), MASK)
    block_ids[..., 0] = ids.gather(1, anchors)
    positions = (anchors[..., None] + torch.arange(K)).reshape(2, -1)
    mask = block_train_mask(anchors, S, K, valid)
    assert mask.shape == (2, 3 * K, S + 3 * K) and mask.dtype == torch.bool
    with torch.no_grad():
        hidden = model.forward_train(feats, embed(block_ids.reshape(2, -1)), positions, mask)
        logits = head(hidden).reshape(2, 3, K, V)[:, :, 1:]
        for b in range(2):
            for i in range(3):
                a = int(anchors[b, i])
                if not valid[b, i]:
                    assert torch.isfinite(logits[b, i]).all()
                    continue
                want = model.draft_logits(embed, head, ids[b:b + 1, a], a,
                                          feats[b:b + 1, :a], model.new_cache())
                torch.testing.assert_close(logits[b, i][None], want, rtol=RTOL, atol=ATOL)


def test_forward_train_context_is_strictly_before_anchor():
    """Changing the feature AT the anchor position leaves that block's output unchanged."""
    target, model = _target(), _ours()
    S, a = 10, 6
    feats = _features(target, torch.randint(0, V - 1, (1, S),
                                            generator=torch.Generator().manual_seed(6)))
    embeds = target.model.embed_tokens(torch.full((1, K), MASK))
    pos = (a + torch.arange(K))[None]
    mask = block_train_mask(torch.tensor([[a]]), S, K)
    with torch.no_grad():
        h1 = model.forward_train(feats, embeds, pos, mask)
        feats2 = feats.clone()
        feats2[:, a:] += 1.0
        h2 = model.forward_train(feats2, embeds, pos, mask)
        feats2[:, a - 1] += 1.0
        h3 = model.forward_train(feats2, embeds, pos, mask)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)
    assert not torch.allclose(h1, h3)
    with pytest.raises(ValueError, match="attn_mask"):
        model.forward_train(feats, embeds, pos, mask[:, :, :-1])
    with pytest.raises(ValueError, match="ctx_features"):
        model.forward_train(feats[0], embeds, pos, mask)


def test_cache_crop_then_append_equals_fresh_cache():
    target, model = _target(), _ours()
    embed, head = target.model.embed_tokens, target.lm_head
    ids = torch.randint(0, V - 1, (1, 12), generator=torch.Generator().manual_seed(8))
    feats = _features(target, ids)
    with torch.no_grad():
        cache = model.new_cache()
        model.draft_logits(embed, head, ids[:, 10], 10, feats[:, :10], cache)
        cache.crop(6)  # roll back to 6 context positions, then append 6..8
        got = model.draft_logits(embed, head, ids[:, 9], 9, feats[:, 6:9], cache)
        want = model.draft_logits(embed, head, ids[:, 9], 9, feats[:, :9], model.new_cache())
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert cache.length == 9
    for bad in (-1, 10, 2.0):
        with pytest.raises(ValueError, match="n:"):
            cache.crop(bad)


def test_draft_logits_bad_inputs():
    target, model = _target(), _ours()
    embed, head = target.model.embed_tokens, target.lm_head
    feats = torch.zeros(1, 4, len(LAYER_IDS) * H)
    root = torch.tensor([3])
    with pytest.raises(ValueError, match="root_pos"):  # cache 0 + 4 new != 5
        model.draft_logits(embed, head, root, 5, feats, model.new_cache())
    with pytest.raises(ValueError, match="block_size"):
        model.draft_logits(embed, head, root, 4, feats, model.new_cache(), block_size=1)
    with pytest.raises(ValueError, match="root_tokens"):
        model.draft_logits(embed, head, root.int(), 4, feats, model.new_cache())
    with pytest.raises(ValueError, match="ctx_features"):
        model.draft_logits(embed, head, root, 4, feats[..., :H], model.new_cache())
    with pytest.raises(ValueError, match="root_pos"):
        model.draft_logits(embed, head, root, torch.tensor([4, 4]), feats, model.new_cache())


def test_extract_context_features_reads_layer_outputs():
    hs = tuple(torch.full((1, 2, 3), float(i)) for i in range(5))  # embeddings + 4 layers
    out = extract_context_features(hs, [0, 3])
    assert out.shape == (1, 2, 6)
    assert out[0, 0].tolist() == [1.0] * 3 + [4.0] * 3
    with pytest.raises(ValueError, match="layer_ids"):
        extract_context_features(hs, [4])


# ---------------------------------------------------------------------------------------------
# Checkpoint I/O
# ---------------------------------------------------------------------------------------------

def test_save_load_roundtrip(dflash_ckpt):
    path, model = dflash_ckpt
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert set(load_file(str(path / "model.safetensors"))) == _zlab_names(2)
    loaded = DFlashDraftModel.from_pretrained(path)
    assert loaded.config == model.config
    assert loaded.config.extra["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    saved = json.loads((path / "config.json").read_text())
    assert saved["block_size"] == saved["dflash_config"]["block_size"] == K
    half = DFlashDraftModel.from_pretrained(path, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        DFlashDraftModel.from_pretrained(path, dtype=torch.int64)


def test_save_is_atomic(dflash_ckpt, monkeypatch):
    """A failure mid-save leaves the old checkpoint intact and no temporary directory behind."""
    path, model = dflash_ckpt
    other = _ours(seed=9)

    def failing_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(dflash_io, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        other.save_pretrained(path)
    assert os.listdir(path.parent) == [path.name]
    loaded = DFlashDraftModel.from_pretrained(path)
    assert torch.equal(loaded.fc.weight, model.fc.weight)
    monkeypatch.undo()
    other.save_pretrained(path)  # a successful save replaces it
    assert os.listdir(path.parent) == [path.name]
    assert torch.equal(DFlashDraftModel.from_pretrained(path).fc.weight, other.fc.weight)


def test_save_refuses_to_clobber_foreign_files(tmp_path):
    model = _ours()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("mine")
    with pytest.raises(ValueError, match="path"):
        model.save_pretrained(tmp_path / "notes")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="path"):
        model.save_pretrained(tmp_path / "file")
    with pytest.raises(FileNotFoundError, match="path"):
        model.save_pretrained(tmp_path / "missing" / "draft")


def _rewrite_weights(path: Path, edit) -> None:
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def test_from_pretrained_file_errors(dflash_ckpt, tmp_path):
    path, _ = dflash_ckpt
    with pytest.raises(FileNotFoundError, match="path"):
        DFlashDraftModel.from_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        DFlashDraftModel.from_pretrained(empty)
    (empty / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        DFlashDraftModel.from_pretrained(empty)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DFlashDraftModel.from_pretrained(path)


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("layers.1.self_attn.k_norm.weight"), "layers.1.self_attn.k_norm.weight"),
    (lambda s: s.__setitem__("lm_head.weight", torch.zeros(V, H)), "lm_head.weight"),
    (lambda s: s.__setitem__("fc.weight", torch.zeros(H, 2 * H)), "'fc.weight' has shape"),
    (lambda s: s.__setitem__("norm.weight", torch.zeros(H, dtype=torch.int32)), "norm.weight"),
])
def test_from_pretrained_tensor_errors(dflash_ckpt, edit, match):
    path, _ = dflash_ckpt
    _rewrite_weights(path, edit)
    with pytest.raises(ValueError, match=match):
        DFlashDraftModel.from_pretrained(path)


# ---------------------------------------------------------------------------------------------
# Config parsing
# ---------------------------------------------------------------------------------------------

def test_specforge_qwen3_4b_config_parses():
    """The SpecForge configs/qwen3-4b-dflash.json (the z-lab Qwen3-4B-DFlash-b16 layout)."""
    cfg = DFlashConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
        "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960,
        "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
        "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936})
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 151669, (1, 9, 17, 25, 33))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.rope_theta) == (2560, 5, 1e6)
    with torch.device("meta"):  # parameter count recorded for z-lab/Qwen3-4B-DFlash-b16
        model = DFlashDraftModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == 537_427_200
    assert len(model.state_dict()) == 58


def test_config_roundtrip_and_hf_style_config(tmp_path):
    cfg = DFlashConfig.from_dict(_draft_config_dict())
    assert DFlashConfig.from_dict(cfg.to_dict()) == cfg
    # transformers 5 stores RoPE in rope_parameters; a config saved by HF must also load
    hf_dict = Qwen3Config(intermediate_size=96, num_hidden_layers=2, num_target_layers=4,
                          dflash_config={"mask_token_id": MASK, "target_layer_ids": LAYER_IDS},
                          rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                          architectures=["DFlashDraftModel"], **DIMS).to_dict()
    parsed = DFlashConfig.from_dict(hf_dict)
    assert parsed.rope_theta == 5e5 and parsed.block_size == 16


def test_block_size_precedence():
    base = _draft_config_dict()
    assert DFlashConfig.from_dict(base).block_size == K
    nested = copy.deepcopy(base)
    nested["dflash_config"]["block_size"] = 10
    assert DFlashConfig.from_dict(nested).block_size == 10  # dflash_config wins
    del nested["block_size"]
    assert DFlashConfig.from_dict(nested).block_size == 10
    nested["dflash_config"].pop("block_size")
    assert DFlashConfig.from_dict(nested).block_size == 16  # upstream default


def test_default_target_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # TEV's Llama-3.1-8B draft
    assert build_target_layer_ids(36, 1) == [18]
    cfg = _draft_config_dict(num_target_layers=36)
    del cfg["dflash_config"]["target_layer_ids"]
    assert DFlashConfig.from_dict(cfg).target_layer_ids == (1, 33)  # 2 draft layers


@pytest.mark.parametrize("key, value", [
    ("layer_types", ["full_attention", "sliding_attention"]),
    ("use_sliding_window", True),
    ("is_causal", True),
    ("input_embedding_scale", 2.0),
    ("output_multiplier", 0.5),
    ("final_logit_softcapping", 30.0),
    ("conv_kernel_size", 4),
    ("conv_group_size", 8),
    ("selector_rank", 16),
    ("selector_top_k", 8),
    ("projector_type", "domino"),
    ("attention_sink_bias", True),
    ("attention_value_scale", 1.5),
    ("attention_bias", True),
    ("hidden_act", "gelu"),
    ("attention_dropout", 0.1),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    ("architectures", ["DFlash2DraftModel"]),
    ("model_type", "llama"),
    ("quantization_config", {"quant_method": "fp8"}),
])
def test_config_rejects_unsupported_keys(key, value):
    with pytest.raises(ValueError, match=key):
        DFlashConfig.from_dict(_draft_config_dict(**{key: value}))


@pytest.mark.parametrize("key, value", [
    ("is_causal", True), ("conv_kernel_size", 4), ("output_multiplier", 2.0), ("foo", 1)])
def test_config_rejects_unsupported_keys_in_dflash_config(key, value):
    cfg = _draft_config_dict()
    cfg["dflash_config"][key] = value
    with pytest.raises(ValueError, match=f"dflash_config.{key}"):
        DFlashConfig.from_dict(cfg)


def test_config_accepts_neutral_values():
    cfg = _draft_config_dict(is_causal=False, input_embedding_scale=1.0, output_multiplier=1,
                             final_logit_softcapping=None, conv_kernel_size=None,
                             selector_top_k=None, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 10000.0})
    cfg["dflash_config"]["mask_token"] = "<|MASK|>"
    parsed = DFlashConfig.from_dict(cfg)
    assert parsed.to_dict()["dflash_config"]["mask_token"] == "<|MASK|>"


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 4]), "target_layer_ids"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[-1]), "target_layer_ids"),
    (lambda c: c["dflash_config"].update(mask_token_id=V), "mask_token_id"),
    (lambda c: c.pop("num_target_layers"), "num_target_layers"),
    (lambda c: c.pop("head_dim"), "head_dim"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.update(block_size=1), "block_size"),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 5.0}), "rope_theta"),
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
])
def test_config_bad_values(edit, match):
    cfg = _draft_config_dict()
    edit(cfg)
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_dict(cfg)


def test_bad_target_layer_ids_in_checkpoint(dflash_ckpt):
    path, _ = dflash_ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 2, TARGET_LAYERS]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDraftModel.from_pretrained(path)


def test_validate_against_target():
    model = _ours()
    target_cfg = _target().config
    model.validate_against_target(target_cfg)
    model.validate_against_target(target_cfg.to_dict())
    for key, value, match in [("hidden_size", 128, "hidden_size"),
                              ("vocab_size", MASK, "mask_token_id"),
                              ("vocab_size", V + 8, "vocab_size"),
                              ("num_hidden_layers", 3, "target_layer_ids"),
                              ("num_hidden_layers", 5, "num_target_layers")]:
        bad = copy.deepcopy(target_cfg)
        setattr(bad, key, value)
        with pytest.raises(ValueError, match=match):
            model.validate_against_target(bad)
