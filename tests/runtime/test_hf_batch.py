"""The batched runtime: ragged rows, per-row settings, refilled slots, exact per-row laws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from exact_law import chi_square_pvalue
from sglang_tev.testing.models import V, dflash_for, plain_greedy, qwen3

from sglang_tev import SamplingParams
from sglang_tev.hf.drafters import DFlashDrafter
from sglang_tev.testing.drafters import OracleDrafter
from sglang_tev.hf.runtime import Request, SpeculativeGenerator
from sglang_tev.testing.models import RAGGED
from runtime_helpers import BatchFixedDrafter, exact_two_token_law


@pytest.fixture(scope="module")
def target():
    return qwen3(0)


@pytest.mark.parametrize("drafter", ["oracle", "dflash"])
def test_greedy_batch_equals_batch_one_and_plain(target, drafter):
    """Ragged prompts with their own max_new_tokens, decoded 4 at a time and 2 at a time (finished
    rows' slots refilled), give every row exactly its batch-1 output and plain greedy decoding."""
    d = OracleDrafter(target, V, accuracy=0.85, block_size=8, seed=1) if drafter == "oracle" else DFlashDrafter(dflash_for(target), target)
    gen = SpeculativeGenerator(target, d)
    maxes = [60, 25, 80, 40]
    refs = [plain_greedy(target, p, m) for p, m in zip(RAGGED, maxes)]
    for method in ["tev", "chain", "autoregressive"]:
        for bs in [None, 2]:
            res = gen.generate(RAGGED, method=method, budget=16, max_new_tokens=maxes, ignore_eos=True, batch_size=bs)
            assert [r.token_ids for r in res] == refs, (method, bs)
            assert all(r.finish_reason == "length" for r in res)
            if method != "autoregressive" and drafter == "oracle":
                assert np.mean([x.accept_len for r in res for x in r.rounds]) >= 1.5
    one = gen.generate(RAGGED[1], method="tev", budget=16, max_new_tokens=25, ignore_eos=True)
    assert one.token_ids == refs[1]
    if drafter == "dflash":  # full blocks always: a row's trees, hence its rounds, do not depend on the batch
        batch = gen.generate(RAGGED, method="tev", budget=16, max_new_tokens=maxes, ignore_eos=True)
        for p, m, r in zip(RAGGED, maxes, batch):
            alone = gen.generate(p, method="tev", budget=16, max_new_tokens=m, ignore_eos=True)
            assert [x.emitted for x in r.rounds] == [x.emitted for x in alone.rounds]


def test_finished_rows_stop_costing_and_stops_per_row(target):
    """A row that stops early leaves the batch (later rounds have fewer rows); per-row stop tokens;
    results in input order."""
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.9, block_size=8, seed=2))
    refs = [plain_greedy(target, p, 60) for p in RAGGED]
    stop = refs[2][10]
    reqs = [Request(p, max_new_tokens=60, ignore_eos=True, stop_token_ids=[stop] if i == 2 else None)
            for i, p in enumerate(RAGGED)]
    res = gen.generate_batch(reqs, method="tev", budget=8)
    cut = refs[2].index(stop) + 1
    assert res[2].token_ids == refs[2][:cut] and res[2].finish_reason == "stop"
    for i in (0, 1, 3):
        assert res[i].token_ids == refs[i]
    rows_seen = [r.batch_rows for r in res[0].rounds]
    assert rows_seen[0] == 4 and min(rows_seen) == 3  # row 2 left the batch
    # the stop token is never expanded by the builder: count it among the last emitted only
    assert res[2].token_ids.count(stop) == 1


def test_streams_carry_the_prompt_index(target):
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.9, block_size=6, seed=3))
    got: dict[int, list[int]] = {}
    res = gen.generate(RAGGED[:3], budget=8, max_new_tokens=[9, 14, 5], ignore_eos=True,
                       stream=lambda i, ids: got.setdefault(i, []).extend(ids))
    assert [got[i] for i in range(3)] == [r.token_ids for r in res]


@pytest.mark.parametrize("method", ["tev", "sequential"])
def test_sampled_law_per_row_with_different_params_in_one_batch(method):
    """Rows with different temperatures / truncations and prompts of different lengths share each
    batch; each group's first two tokens follow its own exact law (chi-square, alpha 1e-6), and
    a greedy row in the same batches is always the argmax continuation."""
    vocab = 8
    tgt = qwen3(7, vocab=vocab, layers=1)
    groups = [([1, 5, 2], SamplingParams(temperature=1.0, top_k=5, top_p=0.9)),
              ([4, 4, 0, 6, 3], SamplingParams(temperature=0.7)),
              ([2, 3], SamplingParams(temperature=0.0))]
    exact = [exact_two_token_law(tgt, p, s, vocab) for p, s in groups[:2]]
    greedy_ref = plain_greedy(tgt, groups[2][0], 2)
    gen = SpeculativeGenerator(tgt, BatchFixedDrafter(vocab, 4, seed=2))
    counts = [np.zeros((vocab, vocab)) for _ in range(2)]
    per_call, calls = 40, 75
    accepted = 0
    for c in range(calls):
        reqs = [Request(groups[i % 3][0], groups[i % 3][1], seed=c * per_call + i, max_new_tokens=2, ignore_eos=True)
                for i in range(per_call)]
        res = gen.generate_batch(reqs, method=method, budget=6)
        for i, r in enumerate(res):
            if i % 3 == 2:
                assert r.token_ids == greedy_ref
            else:
                counts[i % 3][r.token_ids[0], r.token_ids[1]] += 1
                accepted += r.rounds[0].accept_len
    assert accepted / (2 * calls * per_call / 3) > 0.3  # the trees, not only bonus tokens, made the samples
    for cnt, ex in zip(counts, exact):
        assert chi_square_pvalue(cnt, ex) > 1e-6


def test_seeded_row_does_not_depend_on_its_neighbours(target):
    """A sampled row's tokens depend on its own seed only (and its tree, which here depends on
    nothing else): alone or beside other rows with other settings, the same."""
    gen = SpeculativeGenerator(target, BatchFixedDrafter(V, 6, seed=4))
    sp = SamplingParams(temperature=0.9, top_p=0.95)
    alone = gen.generate(RAGGED[0], budget=8, sampling=sp, seed=11, max_new_tokens=30, ignore_eos=True).token_ids
    res = gen.generate_batch([Request(RAGGED[1], sp, 5, 30, ignore_eos=True), Request(RAGGED[0], sp, 11, 30, ignore_eos=True),
                              Request(RAGGED[2], None, 0, 30, ignore_eos=True)], method="tev", budget=8)
    assert res[1].token_ids == alone


def test_batch_bad_inputs(target):
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, block_size=4))
    with pytest.raises(ValueError, match="max_new_tokens: 1 values for 2 prompts"):
        gen.generate([[1, 2], [3]], max_new_tokens=[4])
    with pytest.raises(ValueError, match="batch_size"):
        gen.generate([[1, 2], [3]], batch_size=0)
    with pytest.raises(ValueError, match="prompt must hold"):
        gen.generate([[1, 2], []])
    with pytest.raises(ValueError, match="requests"):
        gen.generate_batch([], method="tev")

    class OneSeq:
        block_size, target_layer_ids = 4, None

        def reset(self):
            pass

        def draft(self, committed, feats, depth):
            return torch.zeros(1, depth, V)

    with pytest.raises(ValueError, match="batch_size"):
        SpeculativeGenerator(target, OneSeq()).generate([[1, 2], [3]], budget=4)
    # a one-sequence drafter still works at batch size 1
    out = SpeculativeGenerator(target, OneSeq()).generate([[1, 2], [3]], budget=4, batch_size=1, max_new_tokens=5,
                                                          ignore_eos=True)
    assert [r.token_ids for r in out] == [plain_greedy(target, [1, 2], 5), plain_greedy(target, [3], 5)]


def test_static_shapes_give_identical_greedy_output(target):
    """The fixed-shape mode CUDA graphs capture (whole-cache attention, static slot buffers) runs
    eagerly on CPU with the same tokens; cuda_graphs on a CPU target is refused naming it."""
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.85, block_size=8, seed=1), static_shapes=True)
    maxes = [30, 20, 40, 25]
    res = gen.generate(RAGGED, budget=16, max_new_tokens=maxes, ignore_eos=True, batch_size=3)
    assert [r.token_ids for r in res] == [plain_greedy(target, p, m) for p, m in zip(RAGGED, maxes)]
    with pytest.raises(ValueError, match="cuda_graphs"):
        SpeculativeGenerator(target, cuda_graphs=True)


def test_kept_tree_mask_equals_the_built_mask(target, monkeypatch):
    """The tree mask kept in one buffer and updated in place equals the mask built from scratch
    (masks.tree_masks) at every round: ragged rows, slots refilled and rows moved."""
    from sglang_tev.hf.masks import KeptTreeMask, attention_layout, tree_masks
    from sglang_tev.tree import additive_mask

    kept = KeptTreeMask.update
    layout = attention_layout(target.config)
    calls = []

    def checked(self, tree, rows, kv_len):
        m = kept(self, tree, rows, kv_len)
        lens = torch.tensor([r.past_len for r in rows])
        want = tree_masks(layout, lens, tree.depth, tree.ancestor_mask, kv_len)
        assert torch.equal(m, additive_mask(want, m.dtype))
        calls.append(len(rows))
        return m

    monkeypatch.setattr(KeptTreeMask, "update", checked)
    d = OracleDrafter(target, V, accuracy=0.7, block_size=8, seed=2)
    gen = SpeculativeGenerator(target, d)
    prompts = RAGGED + [[5, 6, 7], [9] * 12]
    res = gen.generate(prompts, method="tev", budget=12, max_new_tokens=[30, 9, 41, 17, 22, 5], ignore_eos=True,
                       batch_size=3)
    assert [r.token_ids for r in res] == [plain_greedy(target, p, m) for p, m in zip(prompts, [30, 9, 41, 17, 22, 5])]
    assert len(calls) >= 8 and {2, 3} <= set(calls)  # full batches and a shrunk one


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_one_row_fast_path_equals_the_gather(monkeypatch, native, dtype):
    """StaticKVCache.compact_row (one C call on CPU, else index_select + slice copy) moves the
    same K/V as the batched gather/scatter, overlapping ranges included."""
    from sglang_tev.hf import static_cache
    from sglang_tev.hf.static_cache import StaticKVCache

    if not native:
        monkeypatch.setattr(static_cache, "native", lambda name: None)
    caches = []
    for _ in range(2):
        c = StaticKVCache(3, 24, 2, "cpu", dtype)
        c.begin(slice(0, 3), 0, 24)
        for layer in range(2):
            k = torch.randn(3, 2, 24, 4, generator=torch.Generator().manual_seed(layer))
            c.update(k.to(dtype), (k + 1).to(dtype), layer)
        caches.append(c)
    src = torch.tensor([[10, 11, 13, 16, 20]])  # slots 10 + path [0, 1, 3, 6, 10]
    caches[0].compact_row(1, src[0].tolist(), 10)
    caches[1].compact(slice(1, 2), src, torch.arange(10, 15).view(1, 5))
    assert torch.equal(caches[0].kv, caches[1].kv)
    before = StaticKVCache(3, 24, 2, "cpu", dtype)
    before.begin(slice(0, 3), 0, 24)
    for layer in range(2):
        k = torch.randn(3, 2, 24, 4, generator=torch.Generator().manual_seed(layer))
        before.update(k.to(dtype), (k + 1).to(dtype), layer)
    assert torch.equal(caches[0].kv[:, :, 1, :, 10:15], before.kv[:, :, 1, :, [10, 11, 13, 16, 20]])
    assert torch.equal(caches[0].kv[:, :, [0, 2]], before.kv[:, :, [0, 2]])  # other rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_writes_and_batched_compact_equal_an_element_by_element_reference(dtype):
    """The cache's per-row slot writes (``write_slots``, used by ``update`` and the drafter) and the
    batched commit (``compact``: rows of different lengths and paths, a shorter path moving its own
    slots onto themselves) equal a loop over (row, slot), on a sub-range of rows, other rows and
    slots untouched."""
    from sglang_tev.hf.static_cache import StaticKVCache, write_slots

    g = torch.Generator().manual_seed(0)
    buf = torch.randn(4, 2, 30, 3, generator=g).to(dtype)
    ref = buf.clone()
    slots = torch.tensor([[5, 6, 7], [20, 21, 22]])
    vals = torch.randn(2, 2, 3, 3, generator=g).to(dtype)
    write_slots(buf[1:3], slots, vals)
    for r in range(2):
        for j in range(3):
            ref[1 + r, :, slots[r, j]] = vals[r, :, j]
    assert torch.equal(buf, ref)

    c = StaticKVCache(4, 30, 2, "cpu", dtype)
    c.begin(slice(0, 4), 0, 30)
    for layer in range(2):
        k = torch.randn(4, 2, 30, 3, generator=g)
        c.update(k.to(dtype), (k - 1).to(dtype), layer)
    kv0 = c.kv.clone()
    lens = torch.tensor([[8], [15]])
    paths = [[0, 2, 5, 6], [0, 1]]  # row 2: a 2-token path padded with its own slots 2, 3
    src = lens + torch.tensor([p + list(range(len(p), 4)) for p in paths])
    dst = lens + torch.arange(4)
    c.compact(slice(1, 3), src, dst)
    want = kv0.clone()
    for r in range(2):
        for j in range(4):
            want[:, :, 1 + r, :, dst[r, j]] = kv0[:, :, 1 + r, :, src[r, j]]
    assert torch.equal(c.kv, want)
    c.begin(slice(1, 3), dst, 30)  # update() through the slots tensor: the same writes
    k = torch.randn(2, 2, 4, 3, generator=g).to(dtype)
    got_k, _ = c.update(k, k, 0)
    assert torch.equal(got_k[0, :, 8:12], k[0]) and torch.equal(got_k[1, :, 15:19], k[1])
    assert torch.equal(c.kv[0, 0, [0, 3]], want[0, 0, [0, 3]])


@pytest.mark.parametrize("native", [True, False])
def test_gather_nodes_equals_index_select(monkeypatch, native):
    """The one-row feature gather of the commit (a C copy on CPU) equals feats.index_select."""
    from sglang_tev.hf import round as hf_round

    if not native:
        monkeypatch.setattr(hf_round, "native", lambda name: None)
    feats = torch.randn(1, 9, 12)
    for nodes in ([0, 1, 4, 7], [0], [0, 2, 3, 5, 6, 8]):
        assert torch.equal(hf_round.gather_nodes(feats, nodes), feats.index_select(1, torch.tensor(nodes)))


def dynamic_rope_qwen3(seed, max_pos):
    """A tiny Qwen3 with dynamic-NTK RoPE: any forward that feeds a position >= max_pos rescales
    the rotary frequencies of the WHOLE forward (transformers' ``dynamic_rope_update``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from sglang_tev.testing.models import randomize

    cfg = Qwen3Config(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, max_position_embeddings=max_pos, attn_implementation="sdpa",
                      tie_word_embeddings=False,
                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    return randomize(Qwen3ForCausalLM(cfg), seed)


@pytest.mark.parametrize("drafter", ["oracle", "fixed"])
def test_rows_at_the_position_limit_feed_no_position_past_it(monkeypatch, drafter):
    """Max positions 32, a 29-token and a 5-token prompt in one batch: the long row reaches its last
    position while the short one still drafts. No forward of the target ever gets a position >= 32
    (padded tree nodes included), a row at its last position has a root-only tree, every valid
    node's logits equal a plain forward's, and both rows equal plain greedy decoding."""
    import copy

    from sglang_tev.hf import round as hf_round

    tgt = dynamic_rope_qwen3(3, 32)
    plain = copy.deepcopy(tgt)  # never sees a position >= 32, so its RoPE is never rescaled
    rounds = []
    orig = hf_round.tree_forward

    def spy(state, tree, inputs):
        logits, feats = orig(state, tree, inputs)
        ctx = [state.tokens[i, : r.past_len].tolist() for i, r in enumerate(state.rows)]
        rounds.append((ctx, tree, logits.clone()))
        return logits, feats

    monkeypatch.setattr(hf_round, "tree_forward", spy)
    prompts = [[(7 * i + 3) % (V - 1) for i in range(29)], [3, 17, 29, 41, 5]]
    # the oracle (its own copy: it scores continuations past the limit) accepts 2 + bonus at 28, so
    # the long row's next root sits at 31; the fixed drafter is rarely accepted (one token a round)
    d = OracleDrafter(copy.deepcopy(tgt), V, accuracy=0.9, block_size=3, seed=1) if drafter == "oracle" else BatchFixedDrafter(V, 8)
    gen = SpeculativeGenerator(tgt, d)
    fed = []  # the largest position of every target forward (prefill and tree forwards)
    tgt.model.rotary_emb.register_forward_pre_hook(lambda _m, args: fed.append(int(args[1].max())))
    res = gen.generate(prompts, method="tev", budget=6, max_new_tokens=20, ignore_eos=True)
    assert fed and max(fed) <= 31, max(fed)
    assert res[0].finish_reason == "position_limit" and len(prompts[0]) + len(res[0].token_ids) == 33
    assert res[1].finish_reason == "length"
    assert [r.token_ids for r in res] == [plain_greedy(plain, prompts[0], 4), plain_greedy(plain, prompts[1], 20)]
    at_limit = 0
    for ctx, tree, logits in rounds:
        for i, c in enumerate(ctx):
            if len(c) == 31:  # the root sits at position 31, the last one
                at_limit += 1
                assert int(tree.valid[i].sum()) == 1  # root only, as on the batch-1 path
            for v in torch.nonzero(tree.valid[i]).flatten().tolist():
                path, u = [], v
                while u >= 0:
                    path.append(int(tree.tokens[i, u]))
                    u = int(tree.parents[i, u])
                with torch.no_grad():
                    want = plain(torch.tensor([c + path[::-1]])).logits[0, -1]
                torch.testing.assert_close(logits[i, v], want, rtol=1e-4, atol=1e-4)
    assert at_limit == 1 and len(rounds) > 3
    if drafter == "oracle":
        assert [x.accept_len for x in res[1].rounds].count(2) >= 4
