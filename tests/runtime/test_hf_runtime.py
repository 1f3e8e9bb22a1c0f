"""The transformers runtime: greedy identity, KV/draft-cache invariants, stops, sampling law, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from exact_law import chi_square_pvalue
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from sglang_tev import SamplingParams, processed_probs
from sglang_tev.hf.drafters import DFlashDrafter
from sglang_tev.testing.drafters import OracleDrafter
from sglang_tev.hf.runtime import SpeculativeGenerator, cache_kwargs
from sglang_tev.testing.models import V, dflash_for, plain_greedy, qwen3, randomize
from runtime_helpers import CharTokenizer, FixedDrafter, PROMPTS

pytestmark = pytest.mark.slow  # minutes here: scripts/run_tests.sh --fast leaves it out


def llama(seed=0):
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa")
    return randomize(LlamaForCausalLM(cfg), seed)


@pytest.fixture(scope="module")
def target():
    return qwen3(0)


@pytest.mark.parametrize("budget", [1, 8, 64])
def test_greedy_identical_to_plain_decoding_with_oracle(target, budget):
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.85, block_size=8, seed=budget))
    for prompt in PROMPTS:
        ref = plain_greedy(target, prompt, 200)
        for method in ["tev", "predraw", "sequential", "greedy", "chain"]:
            res = gen.generate(prompt, method=method, budget=budget, max_new_tokens=200, ignore_eos=True)
            assert res.token_ids == ref, (method, budget, prompt)
            if budget >= 8 and method != "chain":
                assert res.accept_len_mean >= 2.0, (method, res.accept_len_mean)
            assert sum(r.emitted for r in res.rounds) == 200
    res = gen.generate(PROMPTS[0], method="autoregressive", max_new_tokens=50, ignore_eos=True)
    assert res.token_ids == plain_greedy(target, PROMPTS[0], 50) and res.tau == 1.0


def test_greedy_identical_llama_target():
    tgt = llama(3)
    gen = SpeculativeGenerator(tgt, OracleDrafter(tgt, V, accuracy=0.8, block_size=6, seed=1))
    res = gen.generate(PROMPTS[1], method="tev", budget=16, max_new_tokens=200, ignore_eos=True)
    assert res.token_ids == plain_greedy(tgt, PROMPTS[1], 200)
    assert res.accept_len_mean >= 2.0


def test_kv_cache_equals_plain_forward_after_many_rounds(target):
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.7, block_size=8, seed=3))
    res = gen.generate(PROMPTS[1], method="tev", budget=16, max_new_tokens=120, ignore_eos=True,
                       sampling=SamplingParams(temperature=0.8, top_p=0.95), seed=4)
    assert len(res.rounds) > 10 and max(r.accept_len for r in res.rounds) >= 3
    committed = gen.committed
    assert gen.past_len == committed.shape[1] - 1  # the last token is the next root, not cached
    ref = DynamicCache(config=target.config)
    with torch.no_grad():
        target(committed[:, :-1], **cache_kwargs(target, ref))
    for (k, v), want in zip(gen.cache.row_kv(0, gen.past_len), ref.layers):
        assert k.shape == want.keys.shape
        torch.testing.assert_close(k, want.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, want.values, rtol=1e-4, atol=1e-5)


def test_dflash_drafter_context_is_the_accepted_features(target):
    """Greedy identity with a (random) DFlash drafter run over the static context cache; at every
    draft call its context holds exactly the target features of positions [0, root position),
    and its logits equal the one-sequence DFlashDraftModel.draft_logits on the same context."""
    dm = dflash_for(target)
    gen = SpeculativeGenerator(target, DFlashDrafter(dm, target))
    drafter = gen.drafter
    seen = []
    real_draft = drafter.draft_rows

    def checked(rows, roots, root_pos, tokens, depth, max_root_pos, **kw):
        out = real_draft(rows, roots, root_pos, tokens, depth, max_root_pos, **kw)
        seen.append((int(root_pos[0]), roots[0].item(), out.clone(), depth))
        return out

    drafter.draft_rows = checked
    res = gen.generate(PROMPTS[1], method="tev", budget=16, max_new_tokens=60, ignore_eos=True)
    assert res.token_ids == plain_greedy(target, PROMPTS[1], 60)
    root_pos, root, logits, depth = seen[-1]
    committed = torch.tensor((PROMPTS[1] + res.token_ids)[: root_pos + 1])
    assert int(committed[-1]) == root
    with torch.no_grad():
        hs = target(committed[None, :root_pos], output_hidden_states=True).hidden_states
        feats = dm.extract_context_features(hs)
        want = dm._project_context(feats, torch.arange(root_pos), 1)
        cache = dm.new_cache()
        ref_logits = dm.draft_logits(target.get_input_embeddings(), target.get_output_embeddings(), committed[-1:],
                                     root_pos, feats, cache, block_size=depth + 1)
    for layer in range(len(dm.layers)):
        k_got, v_got = drafter.context_kv(0, root_pos, layer)
        torch.testing.assert_close(k_got, want[layer][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v_got, want[layer][1], rtol=1e-4, atol=1e-5)
    # the runtime asks for the depths the round's trees can reach (slots=): the first ones
    torch.testing.assert_close(logits, ref_logits[:, : logits.shape[1]], rtol=1e-4, atol=1e-4)


def test_stop_tokens_and_max_new_tokens(target):
    prompt = PROMPTS[0]
    ref = plain_greedy(target, prompt, 200)
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=1.0, block_size=8))
    # a stop token that plain decoding meets mid-way, most likely inside an accepted block
    stop = ref[37]
    first = ref.index(stop)
    res = gen.generate(prompt, method="tev", budget=8, max_new_tokens=200, stop_token_ids=[stop], ignore_eos=True)
    assert res.token_ids == ref[: first + 1] and res.finish_reason == "stop"
    assert any(r.emitted < r.accept_len + 1 for r in res.rounds)  # the block really was cut
    for n in [1, 2, 7, 13]:
        res = gen.generate(prompt, method="tev", budget=8, max_new_tokens=n, ignore_eos=True)
        assert res.token_ids == ref[:n] and res.finish_reason == "length"
    # EOS from the generation config stops unless ignore_eos
    target.generation_config.eos_token_id = stop
    try:
        res = gen.generate(prompt, method="predraw", budget=8, max_new_tokens=200)
        assert res.token_ids == ref[: first + 1]
    finally:
        target.generation_config.eos_token_id = None


def test_stop_strings_cut_inside_a_block(target):
    prompt = PROMPTS[2]
    ref = plain_greedy(target, prompt, 120)
    text = CharTokenizer().decode(ref)
    stop = text[50:53]
    end = text.index(stop) + len(stop)  # characters == tokens here
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=1.0, block_size=8), tokenizer=CharTokenizer())
    res = gen.generate(prompt, method="tev", budget=8, max_new_tokens=120, stop_strings=[stop], ignore_eos=True)
    assert res.token_ids == ref[:end] and res.text.endswith(stop) and res.finish_reason == "stop"


def test_stop_string_check_decodes_a_bounded_window(target):
    """The per-token stop-string check decodes O(len(stop)) tokens, not the whole output, and
    still finds a stop string completed late in a long output."""
    prompt = PROMPTS[2]
    ref = plain_greedy(target, prompt, 160)
    text = CharTokenizer().decode(ref)
    stop = text[140:145]
    end = text.index(stop) + len(stop)
    lengths = []

    class Counting(CharTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=1.0, block_size=8), tokenizer=Counting())
    lengths.clear()
    res = gen.generate(prompt, method="tev", budget=8, max_new_tokens=160, stop_strings=[stop], ignore_eos=True)
    assert res.token_ids == ref[:end] and res.finish_reason == "stop"
    checks = lengths[:-1]  # the last decode is the final text
    assert checks and max(checks) <= 4 * len(stop) + 8


def test_position_limit_caps_depth():
    tgt = qwen3(5, max_pos=40)
    gen = SpeculativeGenerator(tgt, OracleDrafter(tgt, V, accuracy=1.0, block_size=8))
    prompt = list(range(1, 31))
    res = gen.generate(prompt, method="tev", budget=8, max_new_tokens=100, ignore_eos=True)
    assert res.finish_reason == "position_limit"
    assert len(prompt) + len(res.token_ids) == 41  # positions 0..39 cached or fed, plus one bonus
    assert res.token_ids == plain_greedy(tgt, prompt, 11)


@pytest.mark.parametrize(
    "method,sampling",
    [("tev", SamplingParams(temperature=1.0, top_k=5, top_p=0.9)), ("predraw", SamplingParams(temperature=0.8, top_p=0.8)),
     ("sequential", SamplingParams(temperature=1.2, top_k=4))],
)
def test_sampling_law_of_first_two_tokens(method, sampling):
    """The law of the first two new tokens, computed exactly from V target forwards, against
    ~4k sampled generations (chi-square, alpha 1e-6)."""
    vocab = 8
    tgt = qwen3(7, vocab=vocab, layers=1)
    prompt = [1, 5, 2]
    with torch.no_grad():
        p1 = processed_probs(tgt(torch.tensor([prompt])).logits[:, -1].double(), sampling)[0]
        seqs = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = processed_probs(tgt(seqs).logits[:, -1].double(), sampling)
    exact = (p1[:, None] * p2).numpy()
    gen = SpeculativeGenerator(tgt, FixedDrafter(vocab, 4, seed=2))
    n = 4000
    counts = np.zeros((vocab, vocab))
    accepted = 0
    for s in range(n):
        res = gen.generate(prompt, method=method, budget=6, sampling=sampling, seed=s, max_new_tokens=2, ignore_eos=True)
        counts[res.token_ids[0], res.token_ids[1]] += 1
        accepted += res.rounds[0].accept_len
    assert accepted / n > 0.3  # the tree, not only bonus tokens, produced many of the samples
    assert chi_square_pvalue(counts, exact) > 1e-6


def test_bad_inputs(target, tmp_path):
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, block_size=4))
    cases = [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(method="beam"), "method must be one of"),
        (dict(verifier="beam", method="chain"), "verifier must be one of"),
        (dict(budget=-1), "budget must be .auto. or an int >= 0"),
        (dict(block_size=9), "block_size"),
        (dict(method="greedy", sampling=SamplingParams(temperature=1.0)), "greedy"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            gen.generate([1, 2, 3], **kw)
    with pytest.raises(ValueError, match="prompt has 513 tokens"):
        gen.generate([1] * 513)
    with pytest.raises(ValueError, match="prompt must hold"):
        gen.generate([])
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeGenerator(target).generate([1, 2], method="tev")
    # missing / invalid paths
    with pytest.raises(FileNotFoundError, match="target"):
        SpeculativeGenerator.from_pretrained(tmp_path / "nope")
    target.save_pretrained(tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="draft"):
        SpeculativeGenerator.from_pretrained(tmp_path / "t", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises((ValueError, FileNotFoundError), match="draft|config"):
        SpeculativeGenerator.from_pretrained(tmp_path / "t", tmp_path / "empty")
    with pytest.raises(ValueError, match="target"):
        SpeculativeGenerator.from_pretrained(tmp_path / "empty")


@pytest.mark.parametrize(
    "over,match",
    [(dict(hidden_size=32, head_dim=8), "hidden"),
     (dict(vocab_size=V + 4), "vocab"),
     (dict(dflash_config=dict(mask_token_id=V + 3, target_layer_ids=[0, 1])), "mask"),
     (dict(dflash_config=dict(mask_token_id=V - 1, target_layer_ids=[0, 3])), "target_layer_ids")],
)
def test_drafter_target_mismatch(target, tmp_path, over, match):
    target.save_pretrained(tmp_path / "t")
    try:
        dm = dflash_for(target, **over)
    except ValueError as e:  # caught at config time already
        assert match in str(e)
        return
    dm.save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match=match):
        SpeculativeGenerator.from_pretrained(tmp_path / "t", tmp_path / "d")
    with pytest.raises(ValueError, match=match):
        SpeculativeGenerator(target, DFlashDrafter(dm, target))


def test_from_pretrained_roundtrip_bf16(target, tmp_path):
    target.save_pretrained(tmp_path / "t")
    dflash_for(target).save_pretrained(tmp_path / "d")
    gen = SpeculativeGenerator.from_pretrained(tmp_path / "t", tmp_path / "d", dtype=torch.bfloat16)
    assert gen.target.dtype == torch.bfloat16
    res = gen.generate(PROMPTS[0], method="tev", budget=8, max_new_tokens=20, ignore_eos=True)
    assert len(res.token_ids) == 20
    gen32 = SpeculativeGenerator.from_pretrained(tmp_path / "t", tmp_path / "d")
    res32 = gen32.generate(PROMPTS[0], method="tev", budget=8, max_new_tokens=40, ignore_eos=True)
    assert res32.token_ids == plain_greedy(target, PROMPTS[0], 40)


def test_budget_cap_and_no_cache_rename_warning(target):
    import warnings as _w

    from sglang_tev.hf.runtime import MAX_BUDGET

    gen = SpeculativeGenerator(target, OracleDrafter(target, V, block_size=4))
    with pytest.raises(ValueError, match=f"budget must be <= {MAX_BUDGET}"):
        gen.generate([1, 2, 3], budget=MAX_BUDGET + 1)
    with _w.catch_warnings(record=True) as caught:
        _w.simplefilter("always")
        gen.generate([1, 2, 3], budget=4, max_new_tokens=4, ignore_eos=True)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_cache_kwargs_follows_the_forward_signature():
    """The KV-cache keyword is the one the model's forward declares (``cache`` in transformers
    releases that renamed it, ``past_key_values`` before)."""

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    c = object()
    assert cache_kwargs(New(), c) == {"cache": c}
    assert cache_kwargs(Old(), c) == {"past_key_values": c}
    assert New()(None, **cache_kwargs(New(), c)) is c and Old()(None, **cache_kwargs(Old(), c)) is c
