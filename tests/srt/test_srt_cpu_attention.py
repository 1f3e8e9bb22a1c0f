"""``sglang_tev.srt.cpu_attention.TorchCPUAttnBackend`` against per-request SDPA with explicit masks.

The backend runs on SGLang 0.5.23's real ``MHATokenToKVPool`` / ``ReqToTokenPool``,
``RadixAttention`` layers, ``ForwardBatch`` and ``DFlashVerifyInput`` (all construct on CPU).
The reference is built independently: each request's keys are the random prefix tensors the test
wrote into the pool plus the new tokens' ``k``/``v``, its boolean mask is written out per mode
(``tril`` for causal, all-True for bidirectional, prefix columns + ``DraftTree.ancestor_mask``
for trees), and ``torch.nn.functional.scaled_dot_product_attention`` runs on one request at a
time, in float64, with the KV heads repeated for GQA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sglang_tev.testing.sglang_cpu.required import require_sglang  # noqa: E402

require_sglang()

from sglang.srt.layers.radix_attention import AttentionType, RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.speculative.dflash_info import DFlashVerifyInput  # noqa: E402

from sglang_tev import build_ddtree_topk  # noqa: E402
from sglang_tev.srt.cpu_attention import (  # noqa: E402
    DEFAULT_BACKEND_NAME,
    ENV_IGNORE_MASK,
    TorchCPUAttnBackend,
    register_cpu_attention,
)
from sglang_tev.srt.round import tree_custom_mask  # noqa: E402

POOL_SLOTS = 256
MAX_CTX = 64
HEAD_DIM = 8
SCALE = 0.37


class Setup:
    """Real SGLang pools with ragged cached prefixes at scattered slots, and the reference data."""

    def __init__(self, prefix_lens, q_lens, hq=4, hkv=2, seed=0, dv=HEAD_DIM, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.hq, self.hkv, self.dv = hq, hkv, dv
        self.bs = len(prefix_lens)
        self.prefix_lens, self.q_lens = list(prefix_lens), list(q_lens)
        self.kv = MHATokenToKVPool(
            size=POOL_SLOTS, page_size=1, dtype=dtype, head_num=hkv, head_dim=HEAD_DIM, layer_num=2,
            device="cpu", enable_memory_saver=False, v_head_dim=dv,
        )  # fmt: skip
        self.r2t = ReqToTokenPool(size=self.bs + 3, max_context_len=MAX_CTX, device="cpu", enable_memory_saver=False)
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.r2t, token_to_kv_pool=self.kv)
        # requests live in scattered pool rows and scattered KV slots (slot 0 is SGLang's sink)
        self.req = torch.randperm(self.bs + 3, generator=g)[: self.bs] + 1
        slots = torch.randperm(POOL_SLOTS - 1, generator=g) + 1
        self.prefix_k, self.prefix_v, self.slots = [], [], []
        pos = 0
        for b in range(self.bs):
            n = self.prefix_lens[b] + self.q_lens[b]
            s = slots[pos : pos + n]
            pos += n
            self.r2t.req_to_token[self.req[b], :n] = s.to(self.r2t.req_to_token.dtype)
            self.slots.append(s)
            pk = torch.randn(self.prefix_lens[b], hkv, HEAD_DIM, generator=g).to(dtype)
            pv = torch.randn(self.prefix_lens[b], hkv, dv, generator=g).to(dtype)
            for layer_id in (0, 1):
                self.kv.get_key_buffer(layer_id)[s[: self.prefix_lens[b]]] = pk
                self.kv.get_value_buffer(layer_id)[s[: self.prefix_lens[b]]] = pv
            self.prefix_k.append(pk)
            self.prefix_v.append(pv)
        self.out_cache_loc = torch.cat([self.slots[b][self.prefix_lens[b] :] for b in range(self.bs)])
        t = sum(self.q_lens)
        self.q = torch.randn(t, hq * HEAD_DIM, generator=g).to(dtype)
        self.k = torch.randn(t, hkv, HEAD_DIM, generator=g).to(dtype)
        self.v = torch.randn(t, hkv, dv, generator=g).to(dtype)

    def layer(self, attn_type=AttentionType.DECODER, layer_id=1, **kw):
        return RadixAttention(
            num_heads=self.hq, head_dim=HEAD_DIM, scaling=SCALE, num_kv_heads=self.hkv, layer_id=layer_id,
            v_head_dim=self.dv, attn_type=attn_type, **kw,
        )  # fmt: skip

    def batch(self, mode, spec_info=None):
        t = sum(self.q_lens)
        if mode == ForwardMode.DECODE:
            seq = [p + 1 for p in self.prefix_lens]
        elif mode == ForwardMode.TARGET_VERIFY:
            seq = list(self.prefix_lens)
        else:
            seq = [p + q for p, q in zip(self.prefix_lens, self.q_lens)]
        fb = ForwardBatch(
            forward_mode=mode, batch_size=self.bs, input_ids=torch.zeros(t, dtype=torch.int64),
            req_pool_indices=self.req.clone(), seq_lens=torch.tensor(seq), out_cache_loc=self.out_cache_loc.clone(),
            seq_lens_sum=sum(seq), spec_info=spec_info,
        )  # fmt: skip
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            fb.extend_prefix_lens = torch.tensor(self.prefix_lens)
            fb.extend_seq_lens = torch.tensor(self.q_lens)
            fb.extend_prefix_lens_cpu = list(self.prefix_lens)
            fb.extend_seq_lens_cpu = list(self.q_lens)
        if mode == ForwardMode.TARGET_VERIFY:
            # what DFLASH does on the draft block: the host copy is a bound, not the length
            fb.seq_lens_cpu = torch.tensor(seq) + max(self.q_lens)
        return fb

    def reference(self, masks, scale=SCALE, cap=0.0):
        """float64 SDPA per request; ``masks[b]`` bool [q_b, prefix_b + q_b]."""
        out, start = [], 0
        rep = self.hq // self.hkv
        for b in range(self.bs):
            n = self.q_lens[b]
            q = self.q[start : start + n].view(n, self.hq, HEAD_DIM).transpose(0, 1).double()
            k = torch.cat([self.prefix_k[b], self.k[start : start + n]]).repeat_interleave(rep, 1).transpose(0, 1)
            v = torch.cat([self.prefix_v[b], self.v[start : start + n]]).repeat_interleave(rep, 1).transpose(0, 1)
            m = masks[b]
            assert m.shape == (n, self.prefix_lens[b] + n) and m.dtype == torch.bool
            if cap > 0:  # tanh capping is not an SDPA option: the same softmax, written out
                s = cap * torch.tanh(q @ k.double().transpose(-1, -2) * scale / cap)
                o = torch.softmax(s.masked_fill(~m, float("-inf")), -1) @ v.double()
            else:
                o = F.scaled_dot_product_attention(q, k.double(), v.double(), attn_mask=m, scale=scale)
            out.append(o.transpose(0, 1).reshape(n, self.hq * self.dv))
            start += n
        return torch.cat(out)


def causal_masks(s):
    return [torch.ones(q, p + q, dtype=torch.bool).tril(diagonal=p) for p, q in zip(s.prefix_lens, s.q_lens)]


def full_masks(s):
    return [torch.ones(q, p + q, dtype=torch.bool) for p, q in zip(s.prefix_lens, s.q_lens)]


def random_trees(bs, budget, seed, depth=4, k=3, vocab=40):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(bs, depth, vocab, generator=g) * 2, -1)
    vals, ids = lq.topk(k, -1)
    return build_ddtree_topk(vals, ids, budget, torch.randint(0, vocab, (bs,), generator=g))


def tree_masks(s, tree):
    return [torch.cat([torch.ones(s.q_lens[b], s.prefix_lens[b], dtype=torch.bool), tree.ancestor_mask[b]], 1) for b in range(s.bs)]


def flatten_full_layout(masks):
    """SGLang's FULL layout written out: each request's rows, row-major, requests concatenated."""
    return torch.cat([m.reshape(-1) for m in masks])


def verify_input(n, custom_mask):
    return DFlashVerifyInput(
        draft_token=torch.zeros(0, dtype=torch.int64), positions=torch.zeros(0, dtype=torch.int64),
        draft_token_num=n, custom_mask=custom_mask,
    )  # fmt: skip


def run(backend, s, layer, fb, save_kv_cache=True, k=None, v=None):
    backend.init_forward_metadata(fb)
    return backend.forward(
        s.q.clone(), s.k.clone() if k is None else k, s.v.clone() if v is None else v, layer, fb, save_kv_cache=save_kv_cache
    )


def assert_close(out, ref, atol=2e-5, rtol=1e-4):
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------- EXTEND / MIXED / DECODE
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_extend_causal_ragged_prefixes_writes_kv(mode, heads):
    s = Setup(prefix_lens=[5, 0, 9, 2], q_lens=[4, 6, 1, 3], hq=heads[0], hkv=heads[1], seed=1)
    backend = TorchCPUAttnBackend(s.runner)
    layer = s.layer()
    out = run(backend, s, layer, s.batch(mode))
    assert_close(out, s.reference(causal_masks(s)))
    # K/V landed where out_cache_loc says, in this layer only
    assert torch.equal(s.kv.get_key_buffer(1)[s.out_cache_loc], s.k)
    assert torch.equal(s.kv.get_value_buffer(1)[s.out_cache_loc], s.v)
    assert not s.kv.get_key_buffer(0)[s.out_cache_loc].any()


def test_extend_bidirectional_for_encoder_only_layers():
    s = Setup(prefix_lens=[3, 0, 7], q_lens=[5, 2, 4], seed=2)
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(AttentionType.ENCODER_ONLY), s.batch(ForwardMode.EXTEND))
    assert_close(out, s.reference(full_masks(s)))
    assert not torch.allclose(out.double(), s.reference(causal_masks(s)), atol=1e-3)


def test_one_plan_serves_layers_of_both_kinds():
    s = Setup(prefix_lens=[4, 1], q_lens=[3, 5], seed=3)
    backend = TorchCPUAttnBackend(s.runner)
    fb = s.batch(ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    dec = backend.forward(s.q, s.k, s.v, s.layer(layer_id=0), fb)
    enc = backend.forward(s.q, s.k, s.v, s.layer(AttentionType.ENCODER_ONLY), fb)
    assert_close(dec, s.reference(causal_masks(s)))
    assert_close(enc, s.reference(full_masks(s)))


def test_decode_batch_with_gqa():
    s = Setup(prefix_lens=[6, 0, 11, 1], q_lens=[1, 1, 1, 1], seed=4)
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(), s.batch(ForwardMode.DECODE))
    assert_close(out, s.reference(full_masks(s)))  # one query sees everything before it and itself
    assert torch.equal(s.kv.get_key_buffer(1)[s.out_cache_loc], s.k)


def test_bfloat16_as_the_cpu_engine_runs_it():
    s = Setup(prefix_lens=[6, 0, 3], q_lens=[3, 5, 2], seed=7, dtype=torch.bfloat16)
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(), s.batch(ForwardMode.EXTEND))
    assert out.dtype == torch.bfloat16
    assert_close(out, s.reference(causal_masks(s)), atol=2e-2, rtol=2e-2)  # bf16 output rounding
    assert torch.equal(s.kv.get_key_buffer(1)[s.out_cache_loc], s.k)


def test_plan_is_rebuilt_when_metadata_init_was_skipped_or_the_batch_changed():
    s = Setup(prefix_lens=[3, 4], q_lens=[2, 2], seed=8)
    backend = TorchCPUAttnBackend(s.runner)
    layer = s.layer()
    fb = s.batch(ForwardMode.EXTEND)
    assert_close(backend.forward(s.q, s.k, s.v, layer, fb), s.reference(causal_masks(s)))  # no init call
    # the same batch object, now a verify batch over the same slots: the old plan must not be reused
    t = Setup(prefix_lens=[3, 4], q_lens=[2, 2], seed=8)
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    fb.seq_lens = torch.tensor(t.prefix_lens)
    fb.spec_info = verify_input(2, None)
    assert_close(backend.forward(t.q, t.k, t.v, layer, fb), t.reference(causal_masks(t)))
    fb.spec_info = verify_input(2, flatten_full_layout(full_masks(t)))
    assert_close(backend.forward(t.q, t.k, t.v, layer, fb), t.reference(full_masks(t)))


def test_save_kv_cache_false_and_readback():
    s = Setup(prefix_lens=[2, 5], q_lens=[3, 2], seed=5)
    backend = TorchCPUAttnBackend(s.runner)
    layer = s.layer()
    ref = s.reference(causal_masks(s))
    out = run(backend, s, layer, s.batch(ForwardMode.EXTEND), save_kv_cache=False)
    assert_close(out, ref)
    assert not s.kv.get_key_buffer(1)[s.out_cache_loc].any()  # nothing written
    # k = v = None: the caller wrote them; the backend reads them back from out_cache_loc
    s.kv.get_key_buffer(1)[s.out_cache_loc] = s.k
    s.kv.get_value_buffer(1)[s.out_cache_loc] = s.v
    fb = s.batch(ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    assert_close(backend.forward(s.q, None, None, layer, fb), ref)


def test_logit_cap_and_value_head_dim():
    s = Setup(prefix_lens=[4, 2], q_lens=[3, 3], seed=6, dv=6)
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(logit_cap=0.5), s.batch(ForwardMode.EXTEND))
    assert out.shape == (6, s.hq * 6)
    assert_close(out, s.reference(causal_masks(s), cap=0.5))
    assert not torch.allclose(out.double(), s.reference(causal_masks(s)), atol=1e-3)


# ---------------------------------------------------------------------- TARGET_VERIFY
def tree_setup(seed, prefix_lens=(7, 2, 11), budget=8, padded=False):
    bs = len(prefix_lens)
    tree = random_trees(bs, budget, seed)
    if padded:  # a tree too small for the budget has padded nodes (parent 0, see root + self)
        small = build_ddtree_topk(torch.log(torch.tensor([[[0.6], [0.5]]])), torch.tensor([[[3], [4]]]), budget, torch.tensor([9]))
        assert not bool(small.valid.all())
        tree = type(tree).from_parents(
            torch.cat([tree.parents[:-1], small.parents]), torch.cat([tree.tokens[:-1], small.tokens]),
            valid=torch.cat([tree.valid[:-1], small.valid]),
        )  # fmt: skip
    n = budget + 1
    s = Setup(prefix_lens=list(prefix_lens), q_lens=[n] * bs, seed=seed)
    return s, tree, n


@pytest.mark.parametrize("seed,padded", [(10, False), (11, True), (12, False)])
@pytest.mark.parametrize("attn_type", [AttentionType.DECODER, AttentionType.ENCODER_ONLY])
def test_target_verify_random_trees_full_layout(seed, padded, attn_type):
    s, tree, n = tree_setup(seed, padded=padded)
    assert any(int(tree.depth[b].max()) < n - 1 for b in range(s.bs))  # real trees, not chains
    masks = tree_masks(s, tree)
    # the worker's producer (round.tree_custom_mask) and a plain write-out agree on the layout
    flat = tree_custom_mask(tree, torch.tensor(s.prefix_lens), sum(s.prefix_lens))
    assert torch.equal(flat, flatten_full_layout(masks))
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(attn_type), s.batch(ForwardMode.TARGET_VERIFY, verify_input(n, flat)))
    assert_close(out, s.reference(masks))
    assert torch.equal(s.kv.get_key_buffer(1)[s.out_cache_loc], s.k)


def test_target_verify_reads_prefix_columns_and_ignores_padding_past_the_layout():
    s, tree, n = tree_setup(13)
    masks = tree_masks(s, tree)
    g = torch.Generator().manual_seed(0)
    for b in range(s.bs):  # FlashInfer reads the prefix columns of the FULL layout: so does this backend
        masks[b][:, : s.prefix_lens[b]] = torch.rand(n, s.prefix_lens[b], generator=g) < 0.6
    flat = flatten_full_layout(masks)
    padded = torch.cat([flat, torch.zeros(17, dtype=torch.bool)])  # DFlashVerifyInput pads with extra entries
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(), s.batch(ForwardMode.TARGET_VERIFY, verify_input(n, padded)))
    assert_close(out, s.reference(masks))


def ragged_layout(lens, host=True):
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

    q = torch.tensor(lens, dtype=torch.int32)
    indptr = torch.nn.functional.pad(torch.cumsum(q, 0, dtype=torch.int32), (1, 0))
    return RaggedVerifyLayout(
        verify_lens=q, graph_num_tokens=sum(lens), extend_start_loc=indptr[:-1], qo_indptr_device=indptr,
        verify_lens_cpu=list(lens) if host else None, total_verify_tokens=sum(lens) if host else None,
    )  # fmt: skip


@pytest.mark.parametrize("host", [True, False])
def test_target_verify_ragged_trees_each_request_its_own_first_nodes(host):
    # per-request trees of different sizes in one forward: request b verifies the first lens[b]
    # nodes of its best-first tree, packed request after request (SGLang's RaggedVerifyLayout)
    from sglang_tev.plan import cut_tree
    from sglang_tev.srt.round import ragged_pack, tree_verify_layout

    prefix_lens, lens, budget = [7, 2, 11, 4], [9, 1, 4, 6], 8
    tree = random_trees(len(prefix_lens), budget, seed=21)
    s = Setup(prefix_lens=prefix_lens, q_lens=lens, seed=21)
    seq = torch.tensor(prefix_lens)
    pack = ragged_pack(tree, tree_verify_layout(tree, seq, sum(prefix_lens)), seq, lens, prefix_lens)
    masks = []
    for b, n in enumerate(lens):  # the reference: each request's own tree of n nodes, alone
        own = cut_tree(type(tree).from_parents(tree.parents[b : b + 1], tree.tokens[b : b + 1]), n)
        masks.append(torch.cat([torch.ones(n, prefix_lens[b], dtype=torch.bool), own.ancestor_mask[0]], 1))
    assert torch.equal(pack.custom_mask, flatten_full_layout(masks))
    assert pack.cols.tolist() == [b * (budget + 1) + i for b, n in enumerate(lens) for i in range(n)]
    # the padded layout back in one gather: own rows where packed, the request's root row past its cut
    first = [sum(lens[:b]) for b in range(len(lens))]
    assert pack.indptr.tolist() == first + [sum(lens)] and pack.indptr.dtype == torch.int32
    assert pack.expand.tolist() == [first[b] + (i if i < n else 0) for b, n in enumerate(lens) for i in range(budget + 1)]
    spec = verify_input(budget + 1, pack.custom_mask)
    spec.ragged_verify_layout = ragged_layout(lens, host)
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(), s.batch(ForwardMode.TARGET_VERIFY, spec))
    assert_close(out, s.reference(masks))
    assert torch.equal(s.kv.get_key_buffer(1)[s.out_cache_loc], s.k)
    # the mask is read per request: ignoring the layout (uniform N) is refused by size, not misread
    spec.ragged_verify_layout = None
    with pytest.raises(ValueError, match="custom_mask has"):
        backend.init_forward_metadata(s.batch(ForwardMode.TARGET_VERIFY, spec))
    spec.ragged_verify_layout = ragged_layout([9, 0, 4, 6], host=False)  # SGLang refuses it with host lengths
    with pytest.raises(ValueError, match="ragged verify lengths must be >= 1"):
        backend.init_forward_metadata(s.batch(ForwardMode.TARGET_VERIFY, spec))


def test_ragged_pack_refuses_bad_lengths():
    from sglang_tev.srt.round import ragged_pack, tree_verify_layout

    tree = random_trees(2, 4, seed=3)
    seq = torch.tensor([3, 5])
    layout = tree_verify_layout(tree, seq, 8)
    for bad in ([1], [0, 2], [2, 6]):
        with pytest.raises(ValueError, match="lens must be 2 ints in"):
            ragged_pack(tree, layout, seq, bad, [3, 5])
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        ragged_pack(tree, layout, seq, [2, 2], [3])


@pytest.mark.parametrize("attn_type,expect", [(AttentionType.DECODER, causal_masks), (AttentionType.ENCODER_ONLY, full_masks)])
def test_target_verify_without_mask(attn_type, expect):
    # DFLASH's chain verify (DECODER, causal in the block) and its draft block (ENCODER_ONLY, full)
    s = Setup(prefix_lens=[5, 0, 8], q_lens=[6, 6, 6], seed=14)
    backend = TorchCPUAttnBackend(s.runner)
    out = run(backend, s, s.layer(attn_type), s.batch(ForwardMode.TARGET_VERIFY, verify_input(6, None)))
    assert_close(out, s.reference(expect(s)))


def test_negative_control_ignoring_the_mask_fails_the_tree_test(monkeypatch):
    s, tree, n = tree_setup(10)
    masks = tree_masks(s, tree)
    flat = flatten_full_layout(masks)
    ref = s.reference(masks)
    monkeypatch.setenv(ENV_IGNORE_MASK, "1")
    backend = TorchCPUAttnBackend(s.runner)  # read at construction
    monkeypatch.delenv(ENV_IGNORE_MASK)
    assert backend.ignore_custom_mask
    out = run(backend, s, s.layer(), s.batch(ForwardMode.TARGET_VERIFY, verify_input(n, flat)))
    with pytest.raises(AssertionError):
        assert_close(out, ref)
    assert_close(out, s.reference(causal_masks(s)))  # what it computes instead: the chain
    assert not TorchCPUAttnBackend(s.runner).ignore_custom_mask
    assert TorchCPUAttnBackend(s.runner, ignore_custom_mask=True).ignore_custom_mask


def test_bad_ignore_mask_env_value(monkeypatch):
    s = Setup(prefix_lens=[1], q_lens=[1])
    monkeypatch.setenv(ENV_IGNORE_MASK, "maybe")
    with pytest.raises(ValueError, match=ENV_IGNORE_MASK):
        TorchCPUAttnBackend(s.runner)


# ---------------------------------------------------------------------- refusals
def test_bad_custom_masks_raise_before_any_write():
    s, tree, n = tree_setup(15)
    masks = tree_masks(s, tree)
    flat = flatten_full_layout(masks)
    backend = TorchCPUAttnBackend(s.runner)
    with pytest.raises(ValueError, match="custom_mask has .* needs"):
        backend.init_forward_metadata(s.batch(ForwardMode.TARGET_VERIFY, verify_input(n, flat[:-1])))
    empty = [m.clone() for m in masks]
    empty[1][3] = False
    with pytest.raises(ValueError, match="row 3 of request 1 allows no key"):
        backend.init_forward_metadata(s.batch(ForwardMode.TARGET_VERIFY, verify_input(n, flatten_full_layout(empty))))
    with pytest.raises(ValueError, match="must be 1-D"):
        backend.init_forward_metadata(s.batch(ForwardMode.TARGET_VERIFY, verify_input(n, flat.view(1, -1))))
    with pytest.raises(ValueError, match="must be bool"):
        backend.init_forward_metadata(s.batch(ForwardMode.TARGET_VERIFY, verify_input(n, flat.float())))
    assert not s.kv.get_key_buffer(1)[s.out_cache_loc].any()


def test_refusals_name_the_feature_and_leave_the_pool_unchanged():
    s = Setup(prefix_lens=[2, 3], q_lens=[2, 2], seed=16)
    backend = TorchCPUAttnBackend(s.runner)
    fb = s.batch(ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        backend.forward(s.q, s.k, s.v, s.layer(sliding_window_size=4), fb)
    with pytest.raises(NotImplementedError, match="cross-attention"):
        backend.forward(s.q, s.k, s.v, s.layer(is_cross_attention=True), fb)
    with pytest.raises(NotImplementedError, match="sinks"):
        backend.forward(s.q, s.k, s.v, s.layer(), fb, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="q has 3 tokens"):
        backend.forward(s.q[:3], s.k[:3], s.v[:3], s.layer(), fb)
    with pytest.raises(ValueError, match="k/v have 3/3 tokens"):
        backend.forward(s.q, s.k[:3], s.v[:3], s.layer(), fb)
    short = s.batch(ForwardMode.EXTEND)
    short.out_cache_loc = short.out_cache_loc[:3]
    backend.init_forward_metadata(short)
    with pytest.raises(ValueError, match="out_cache_loc must hold 4 slots, got 3"):
        backend.forward(s.q, s.k, s.v, s.layer(), short)
    with pytest.raises(ValueError, match="out_cache_loc must hold 4 slots, got 3"):
        backend.forward(s.q, None, None, s.layer(), short, save_kv_cache=False)
    assert not s.kv.get_key_buffer(1)[s.out_cache_loc].any()
    bad = s.batch(ForwardMode.EXTEND)
    bad.extend_prefix_lens_cpu = [2, 2]
    with pytest.raises(ValueError, match="seq_lens must equal extend_prefix_lens"):
        backend.init_forward_metadata(bad)
    with pytest.raises(NotImplementedError, match="DRAFT_EXTEND_V2"):
        backend.init_forward_metadata(s.batch(ForwardMode.DRAFT_EXTEND_V2))


# ---------------------------------------------------------------------- registration
def test_register_cpu_attention_makes_sglang_build_it():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.speculative.draft_worker_common import DRAFT_ATTENTION_BACKEND_CHOICES

    assert register_cpu_attention() == DEFAULT_BACKEND_NAME
    register_cpu_attention()  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count(DEFAULT_BACKEND_NAME) == 1
    assert DRAFT_ATTENTION_BACKEND_CHOICES.count(DEFAULT_BACKEND_NAME) == 1  # the list the draft worker checks
    s = Setup(prefix_lens=[1], q_lens=[1])
    assert type(ATTENTION_BACKENDS[DEFAULT_BACKEND_NAME](s.runner)) is TorchCPUAttnBackend
    for bad in ("", "tev cpu", None):
        with pytest.raises(ValueError, match="name must be"):
            register_cpu_attention(bad)


def test_register_over_an_existing_name_only_on_cpu():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    name = "tev_test_existing"
    ATTENTION_BACKENDS[name] = lambda runner: ("original", runner.device)
    try:
        register_cpu_attention(name)
        s = Setup(prefix_lens=[1], q_lens=[1])
        assert type(ATTENTION_BACKENDS[name](s.runner)) is TorchCPUAttnBackend
        assert ATTENTION_BACKENDS[name](SimpleNamespace(device="cuda:0")) == ("original", "cuda:0")
    finally:
        ATTENTION_BACKENDS.pop(name, None)
        for lst in (ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES):
            while name in lst:
                lst.remove(name)


def test_cli_accepts_the_registered_name():
    import argparse

    from sglang.srt.server_args import ServerArgs

    register_cpu_attention()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--attention-backend", DEFAULT_BACKEND_NAME])
    assert ns.attention_backend == DEFAULT_BACKEND_NAME
