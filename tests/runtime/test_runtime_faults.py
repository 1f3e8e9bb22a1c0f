"""Issue 11 items 1-5 on the batched runtime: attention windows, non-finite logits, ids past the
tokenizer, state after a stop, generation controls at every node (and no budget below a stop)."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch
from exact_law import chi_square_pvalue
from runtime_helpers import PROMPTS, BatchFixedDrafter, CharTokenizer
from sglang_tev.testing.models import V, plain_greedy, qwen3, randomize
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from sglang_tev import SamplingParams, processed_probs
from sglang_tev.hf import round as hf_round
from sglang_tev.hf import runtime as rt
from sglang_tev.testing.drafters import OracleDrafter
from sglang_tev.hf.runtime import NonFiniteLogitsError, Request, SpeculativeGenerator, cache_kwargs
from sglang_tev.hf.masks import attention_layout

METHODS = ["tev", "predraw", "sequential", "greedy", "chain", "autoregressive"]


# ------------------------------------------------------------------ 1. windows
def windowed_qwen3(seed, **over):
    cfg = Qwen3Config(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, max_position_embeddings=512, attn_implementation="sdpa",
                      tie_word_embeddings=False, **over)
    return randomize(Qwen3ForCausalLM(cfg), seed)


@pytest.mark.parametrize("over", [
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
], ids=["all-sliding", "mixed"])
def test_sliding_window_targets_equal_plain_decoding(over):
    """Window 8, prompt of 6 tokens, 32 greedy tokens: every method equals transformers' own plain
    decoding (which keeps only the window per sliding layer); a batch of ragged rows too."""
    tgt = windowed_qwen3(5, **over)
    assert "sliding_attention" in tgt.config.layer_types
    prompt = [3, 17, 29, 41, 5, 8]
    ref = plain_greedy(tgt, prompt, 32)
    gen = SpeculativeGenerator(tgt, OracleDrafter(tgt, V, accuracy=0.9, block_size=8, seed=1))
    for method in METHODS:
        res = gen.generate(prompt, method=method, budget=16, max_new_tokens=32, ignore_eos=True)
        assert res.token_ids == ref, method
    other = [60, 2, 2, 9, 33, 71, 80, 14, 1, 44, 12, 7, 7]
    res = gen.generate([prompt, other], budget=16, max_new_tokens=32, ignore_eos=True)
    assert [r.token_ids for r in res] == [ref, plain_greedy(tgt, other, 32)]


def test_unservable_attention_layout_is_refused_up_front():
    cfg = types.SimpleNamespace(layer_types=["full_attention", "chunked_attention"], sliding_window=None)
    with pytest.raises(ValueError, match="chunked_attention"):
        attention_layout(cfg)
    cfg = types.SimpleNamespace(layer_types=["sliding_attention"], sliding_window=None)
    with pytest.raises(ValueError, match="sliding_window"):
        attention_layout(cfg)
    mistral_like = types.SimpleNamespace(sliding_window=4096)
    assert attention_layout(mistral_like).windows == {"sliding_attention": 4096}


# ------------------------------------------------------------------ 2. non-finite logits
@pytest.fixture(scope="module")
def target():
    return qwen3(0)


def poison(tgt, node, n_nodes):
    """NaN in the logits row of tree node ``node`` of every tree forward of width ``n_nodes``."""

    def hook(_m, _inp, out):
        if out.dim() == 3 and out.shape[1] == n_nodes:
            out = out.clone()
            out[:, node] = float("nan")
        return out

    return tgt.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("node,sampled", [(16, False), (16, True), (0, False)], ids=["junk-branch", "junk-sampled", "root"])
def test_non_finite_logits_raise_naming_round_and_node(target, node, sampled):
    """One NaN row on a tree node, even on a branch that would not be accepted, or on the root of
    a greedy round, stops the call with an error naming the round and the node — never output."""
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.9, block_size=8, seed=1))
    handle = poison(target, node, 17)
    sampling = SamplingParams(temperature=1.0) if sampled else None
    try:
        with pytest.raises(NonFiniteLogitsError, match=rf"round 0, prompt 0, tree node {node}\b"):
            gen.generate(PROMPTS[0], budget=16, max_new_tokens=20, sampling=sampling, ignore_eos=True)
    finally:
        handle.remove()
    res = gen.generate(PROMPTS[0], budget=16, max_new_tokens=20, ignore_eos=True)  # fine again afterwards
    assert res.token_ids == plain_greedy(target, PROMPTS[0], 20)


# ------------------------------------------------------------------ 3. ids past the tokenizer
class SmallTokenizer(CharTokenizer):
    """Knows ids [0, 50) only, as a tokenizer shorter than the model's padded embedding table."""

    def __len__(self):
        return 50

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i % 26) for i in ids if i < 50)


def test_ids_past_the_tokenizer_warn_once_and_are_counted(target):
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.9, block_size=6), tokenizer=SmallTokenizer())
    ref = plain_greedy(target, PROMPTS[1], 40)
    past = sorted(set(t for t in ref if t >= 50))
    assert past  # the random target emits some of them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = gen.generate(PROMPTS[1], budget=8, max_new_tokens=40, ignore_eos=True)
    ours = [w for w in caught if "past the tokenizer" in str(w.message)]
    assert len(ours) == 1 and str(past) in str(ours[0].message)
    assert res.token_ids == ref  # the law is plain decoding's: those ids are emitted
    assert res.unknown_token_ids == [t for t in ref if t >= 50]
    assert len(res.text) == len(ref) - len(res.unknown_token_ids)


# ------------------------------------------------------------------ 4. state after a stop
def test_counters_and_state_after_a_stop(target):
    prompt = PROMPTS[0]
    ref = plain_greedy(target, prompt, 200)
    stop = ref[37]
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=1.0, block_size=8))
    res = gen.generate(prompt, method="tev", budget=8, max_new_tokens=200, stop_token_ids=[stop], ignore_eos=True)
    assert res.token_ids == ref[: ref.index(stop) + 1]
    last = res.rounds[-1]
    assert last.emitted <= last.verified_accept_len  # the stop cut the accepted path itself
    assert all(r.accept_len <= r.emitted <= r.accept_len + 1 for r in res.rounds)
    assert sum(r.emitted for r in res.rounds) == len(res.token_ids)
    assert res.accept_len_mean == pytest.approx(sum(r.accept_len for r in res.rounds) / len(res.rounds))
    assert res.tau <= 1 + res.accept_len_mean
    # generator state: the committed tokens are prompt + output; KV of all but the last is cached
    assert gen.committed[0].tolist() == prompt + res.token_ids
    assert gen.past_len == gen.committed.shape[1] - 1
    want = DynamicCache(config=target.config)
    with torch.no_grad():
        target(gen.committed[:, :-1], **cache_kwargs(target, want))
    for (k, v), w in zip(gen.cache.row_kv(0, gen.past_len), want.layers):
        torch.testing.assert_close(k, w.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, w.values, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ 5. controls
def controlled(logits, prompt, out, rep=1.0, freq=0.0, pres=0.0, bias=None, proc=None):
    """Plain decoding's processed logits [V] after prompt + out (the reference)."""
    ids = torch.tensor([prompt + out])
    x = logits.clone().view(1, -1)
    if rep != 1.0:
        x = RepetitionPenaltyLogitsProcessor(rep)(ids, x)
    if out:
        cnt = torch.bincount(torch.tensor(out), minlength=x.shape[-1]).to(x.dtype)
        x = x - freq * cnt - pres * (cnt > 0).to(x.dtype)
    if bias:
        for t, b in bias.items():
            x[0, t] += b
    if proc is not None:
        x = proc(ids, x)
    return x[0]


def plain_controlled_greedy(model, prompt, n, **kw):
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(controlled(logits, prompt, out, **kw).argmax()))
    return out


def no_repeat_last(input_ids, scores):
    """A path-dependent user processor: the last token may not come again."""
    scores = scores.clone()
    scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = float("-inf")
    return scores


CONTROLS = dict(rep=1.4, freq=0.6, pres=0.4, bias={5: 1.5, 9: -2.0}, proc=no_repeat_last)


def test_controls_greedy_equal_plain_decoding_with_them(target):
    prompt = PROMPTS[1]
    ref = plain_controlled_greedy(target, prompt, 40, **CONTROLS)
    assert ref != plain_greedy(target, prompt, 40)  # the controls change the output
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.8, block_size=6, seed=2))
    kw = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4, logit_bias={5: 1.5, 9: -2.0},
              logits_processor=no_repeat_last)
    for method in ["tev", "predraw", "chain", "autoregressive"]:
        res = gen.generate(prompt, method=method, budget=16, max_new_tokens=40, ignore_eos=True, **kw)
        assert res.token_ids == ref, method
    res = gen.generate([prompt, PROMPTS[0]], budget=16, max_new_tokens=40, ignore_eos=True, **kw)
    assert res[0].token_ids == ref


def test_controls_sampled_law_of_first_two_tokens():
    """Penalties and bias at every node with the node's own prefix: the first two tokens follow
    plain sampling's law with the same controls (chi-square, alpha 1e-6)."""
    vocab = 8
    tgt = qwen3(7, vocab=vocab, layers=1)
    prompt = [1, 5, 2, 5]
    sp = SamplingParams(temperature=1.0, top_k=6)
    kw = dict(rep=1.8, freq=1.0, pres=0.5, bias={3: 1.0})
    with torch.no_grad():
        l1 = tgt(torch.tensor([prompt])).logits[0, -1].double()
        p1 = processed_probs(controlled(l1, prompt, [], **kw).view(1, -1), sp)[0]
        p2 = torch.stack([processed_probs(controlled(tgt(torch.tensor([prompt + [a]])).logits[0, -1].double(), prompt, [a],
                                                     **kw).view(1, -1), sp)[0] for a in range(vocab)])
    exact = (p1[:, None] * p2).numpy()
    gen = SpeculativeGenerator(tgt, BatchFixedDrafter(vocab, 4, seed=2))
    counts = np.zeros((vocab, vocab))
    accepted = 0
    for c in range(100):
        reqs = [Request(prompt, sp, seed=c * 40 + i, max_new_tokens=2, ignore_eos=True,
                        controls=rt.Controls(1.8, 1.0, 0.5, {3: 1.0})) for i in range(40)]
        for r in gen.generate_batch(reqs, method="tev", budget=6):
            counts[r.token_ids[0], r.token_ids[1]] += 1
            accepted += r.rounds[0].accept_len
    assert accepted / 4000 > 0.3
    assert chi_square_pvalue(counts, exact) > 1e-6


def test_no_budget_below_a_stop_token(target, monkeypatch):
    """With EOS stopping generation, the builder never expands a node whose token is a stop;
    with ignore_eos it does (same drafter, which loves that token)."""
    stop = 7
    logits = torch.zeros(1, 5, V)
    logits[:, :, stop] = 6.0  # the stop token ranks first at every depth

    class StopLover(BatchFixedDrafter):
        def __init__(self):
            self.logits, self.block_size = logits, 6

    trees = []
    real = hf_round.build_ddtree

    def spy(*a, **k):
        t = real(*a, **k)
        trees.append(t)
        return t

    monkeypatch.setattr(hf_round, "build_ddtree", spy)
    def nodes_below_stop():
        below = 0
        for t in trees:
            par_tok = t.tokens.gather(1, t.parents.clamp(min=0))
            below += int((t.valid[:, 1:] & (t.parents[:, 1:] > 0) & (par_tok[:, 1:] == stop)).sum())
        return below

    monkeypatch.setattr(hf_round, "build_ddtree", spy)
    gen = SpeculativeGenerator(target, StopLover())
    target.generation_config.eos_token_id = stop
    try:
        gen.generate(PROMPTS[1], budget=16, max_new_tokens=12)  # EOS stops
        assert trees and nodes_below_stop() == 0
        trees.clear()
        gen.generate(PROMPTS[1], budget=16, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop])
        assert trees and nodes_below_stop() == 0
        trees.clear()
        gen.generate(PROMPTS[1], budget=16, max_new_tokens=12, ignore_eos=True)  # nothing stops: expanded
        assert nodes_below_stop() > 0
    finally:
        target.generation_config.eos_token_id = None


def test_bad_controls(target):
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, block_size=4))
    for kw, match in [(dict(repetition_penalty=0.0), "repetition_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                      (dict(logit_bias={V: 1.0}), "logit_bias"), (dict(logit_bias={1: float("inf")}), "logit_bias"),
                      (dict(logits_processor=3), "logits_processor")]:
        with pytest.raises(ValueError, match=match):
            gen.generate([1, 2, 3], **kw)


# ------------------------------------------------------------------ issue 19: concurrent calls
def test_concurrent_calls_on_one_generator_are_serialised(target):
    """Three threads share one generator (a DFlash drafter over its static context cache): each of
    their 5 calls returns exactly what the same call returns alone, and afterwards the generator's
    state (committed, past_len, the cache) describes its last call. A call made from inside a
    running call (a stream callback) is refused as busy instead of deadlocking or corrupting."""
    import threading

    from sglang_tev.testing.models import dflash_for

    from sglang_tev.hf.drafters import DFlashDrafter

    gen = SpeculativeGenerator(target, DFlashDrafter(dflash_for(target), target))
    calls = [dict(prompt=PROMPTS[0], max_new_tokens=40),
             dict(prompt=[PROMPTS[1], PROMPTS[2]], max_new_tokens=[30, 20]),  # a batch
             dict(prompt=PROMPTS[2], max_new_tokens=35, sampling=SamplingParams(temperature=0.8), seed=3)]

    def call(i):
        res = gen.generate(**calls[i], budget=8, ignore_eos=True)
        return [r.token_ids for r in res] if isinstance(res, list) else res.token_ids

    alone = [call(i) for i in range(3)]
    got: list[list] = [[], [], []]
    errors = []
    start = threading.Barrier(3)

    def worker(i):
        start.wait()
        for _ in range(5):
            try:
                got[i].append(call(i))
            except Exception as e:  # noqa: BLE001 - any failure is the defect under test
                errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert got == [[a] * 5 for a in alone]
    last = gen.generate(PROMPTS[0], budget=8, max_new_tokens=40, ignore_eos=True)
    assert last.token_ids == alone[0]
    assert gen.committed[0].tolist() == PROMPTS[0] + last.token_ids and gen.past_len == gen.committed.shape[1] - 1
    want = DynamicCache(config=target.config)
    with torch.no_grad():
        target(gen.committed[:, :-1], **cache_kwargs(target, want))
    for (k, v), w in zip(gen.cache.row_kv(0, gen.past_len), want.layers):
        torch.testing.assert_close(k, w.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, w.values, rtol=1e-4, atol=1e-5)
    # re-entry from the same thread (a stream callback) is refused, and the outer call finishes intact
    inner = []

    def stream(ids):
        if not inner:
            with pytest.raises(RuntimeError, match="busy"):
                gen.generate(PROMPTS[1], max_new_tokens=3)
            inner.append(ids)

    res = gen.generate(PROMPTS[0], budget=8, max_new_tokens=40, ignore_eos=True, stream=stream)
    assert inner and res.token_ids == alone[0]
