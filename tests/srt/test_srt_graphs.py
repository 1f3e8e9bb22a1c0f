"""TEV's CUDA-graph path (``sglang_tev.srt.graphs`` and the worker's graph branches) on CPU.

Nobody can capture a CUDA graph here (no GPU), so this checks what can be checked without one:

* the ``get_spec_info`` / ``create_dummy_verify_input`` AROUND hooks, applied through SGLang's own
  ``HookRegistry`` wrapper to SGLang's real functions on stub runners: a TEV target runner's
  capture carries the static mask, TEV's draft runner and other algorithms are untouched (and
  SGLang's unhooked result for TEV has NO mask: the hook is what makes the capture masked);
* the folded draft head: static buffers, SGLang's real capture tail hook, no random draw, and
  ``torch.compile(fullgraph=True)`` of it with SGLang's real ``candidate_topk`` (no graph break,
  so no host sync inside the would-be captured region); a head with a host sync breaks the
  graph (the negative control);
* a replay emulation of the whole worker round: a draft "graph" (static buffers, batch padded to
  the bucket, the folded head as tail hook) and a target "graph" at the level of SGLang's
  ``can_run_graph`` / ``load_batch`` (static max-size buffers reused across rounds, bs 3 padded to
  4 with buckets 1/2/4/8, ``seq_lens`` = fill value 1 for padded rows, the live mask copied into a
  static buffer read through ``mask_indptr`` as Triton does) gives the same tokens and accept
  lengths as the eager path, equal to plain greedy decoding.

The real capture and replay (Triton, FlashInfer) are checked by ``scripts/sglang_smoke.py`` on a GPU.
"""

from __future__ import annotations

import inspect
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_pair import plain_greedy

from sglang_worker_fakes import FakeKV, FakeTranslator, build_tev_worker, patch_forward_plumbing  # noqa: E402
from sglang_tev.testing.sglang_cpu.required import require_sglang  # noqa: E402

require_sglang()

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def algos():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_tev.srt.plugin import register

    register()
    return {name: SpeculativeAlgorithm.from_string(name) for name in ("TEV", "DFLASH", "EAGLE")}


def _stub_runner(algo, *, is_draft, width, backend="TritonAttnBackend", max_bs=4, fill=1):
    """A ``DecodeCudaGraphRunner`` with only what ``get_spec_info`` reads."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    runner = object.__new__(DecodeCudaGraphRunner)
    runner.model_runner = SimpleNamespace(spec_algorithm=algo, is_draft_worker=is_draft, attn_backend=type(backend, (), {})())
    runner.captured_req_width = width
    runner.ragged_verify_mode = False
    # as DecodeInputBuffers allocates it (buffers.py:171-174)
    runner.buffers = SimpleNamespace(custom_mask=torch.ones((max_bs * fill + max_bs * width) * width, dtype=torch.bool))
    return runner


def _hooked(original, hook):
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    return _wrap_fn(original, hook, HookType.AROUND)  # what HookRegistry.apply_hooks installs


# ---------------------------------------------------------------------- target verify capture
@pytest.mark.parametrize("backend", ["TritonAttnBackend", "FlashInferAttnBackend"])
def test_target_capture_of_a_tev_runner_carries_the_static_mask(algos, backend):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from sglang_tev.srt.graphs import _around_get_spec_info

    N = 12
    original = inspect.unwrap(DecodeCudaGraphRunner.get_spec_info)
    runner = _stub_runner(algos["TEV"], is_draft=False, width=N, backend=backend)
    # SGLang alone captures a TEV (DFLASH-family) target verify WITHOUT a mask on these backends
    assert original(runner, 4 * N).custom_mask is None
    spec = _hooked(original, _around_get_spec_info)(runner, 4 * N)
    assert isinstance(spec, DFlashVerifyInput)
    assert spec.custom_mask is runner.buffers.custom_mask
    assert spec.draft_token_num == spec.num_tokens_per_req == N
    assert spec.capture_hidden_mode == CaptureHiddenMode.FULL
    # the static mask covers the largest capture: bs * N rows of (fill 1 + N)
    assert spec.custom_mask.numel() >= 4 * N * (1 + N) and bool(spec.custom_mask.all())


def test_draft_runner_and_other_algorithms_are_left_alone(algos):
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    from sglang_tev.srt.graphs import _around_get_spec_info

    original = inspect.unwrap(DecodeCudaGraphRunner.get_spec_info)
    hooked = _hooked(original, _around_get_spec_info)
    # TEV's draft runner (width K): DFLASH's mask-less input, hidden capture off
    draft = hooked(_stub_runner(algos["TEV"], is_draft=True, width=6), 2 * 6)
    assert draft.custom_mask is None and draft.draft_token_num == 6
    assert draft.capture_hidden_mode == CaptureHiddenMode.NULL
    # a DFLASH server's target: SGLang's own result (no mask on Triton), unchanged
    dflash = hooked(_stub_runner(algos["DFLASH"], is_draft=False, width=16), 16)
    assert dflash.custom_mask is None and dflash.draft_token_num == 16
    # any other algorithm: whatever SGLang returns, the very object
    sentinel = object()
    for name in ("EAGLE", "DFLASH"):
        for is_draft in (False, True):
            runner = _stub_runner(algos[name], is_draft=is_draft, width=4)
            assert _hooked(lambda self, n: sentinel, _around_get_spec_info)(runner, 4) is sentinel


def test_a_non_dflash_result_for_a_tev_target_is_an_error(algos):
    from sglang_tev.srt.graphs import _around_get_spec_info

    runner = _stub_runner(algos["TEV"], is_draft=False, width=4)
    with pytest.raises(RuntimeError, match="expects SGLang 0.5.23's DFlashVerifyInput"):
        _around_get_spec_info(lambda self, n: None, runner, 4)


def test_warmup_dummy_states_tev_widths_and_mask(algos, monkeypatch):
    import sglang.srt.speculative.spec_info as S

    from sglang_tev.srt.graphs import _around_dummy_verify_input

    N, K = 12, 6
    monkeypatch.setattr(S, "get_spec_config", lambda: SimpleNamespace(speculative_num_draft_tokens=N))
    original = inspect.unwrap(S.create_dummy_verify_input)
    hooked = _hooked(original, _around_dummy_verify_input)
    mask = torch.ones(4 * N * (1 + N), dtype=torch.bool)
    # SGLang's DFLASH branch: no mask, and width N even for the draft runner
    assert original(algos["TEV"], mask, K, True).draft_token_num == N
    target = hooked(algos["TEV"], mask, N, False)
    assert target.custom_mask is mask and target.num_tokens_per_req == N
    draft = hooked(algos["TEV"], mask, K, True)
    assert draft.custom_mask is None and draft.num_tokens_per_req == draft.draft_token_num == K
    plain = hooked(algos["DFLASH"], mask, N, False)
    assert plain.custom_mask is None and plain.draft_token_num == N


def test_plugin_registers_the_hooks_on_targets_that_exist(algos, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import sglang_tev.srt.graphs as G

    # plugin.register() (the algos fixture) registered both hooks with SGLang's registry
    for target, hook in ((G._GET_SPEC_INFO, G._around_get_spec_info), (G._DUMMY_VERIFY_INPUT, G._around_dummy_verify_input)):
        assert (HookType.AROUND, hook) in [(t, h) for t, h, _ in HookRegistry._hooks[target]]
    # the targets resolve, with the signatures the hooks are written for
    owner, attr = G._GET_SPEC_INFO.rsplit(".", 1)
    assert list(inspect.signature(getattr(pkgutil.resolve_name(owner), attr)).parameters) == ["self", "num_tokens"]
    owner, attr = G._DUMMY_VERIFY_INPUT.rsplit(".", 1)
    params = list(inspect.signature(getattr(pkgutil.resolve_name(owner), attr)).parameters)
    assert params == ["spec_algorithm", "custom_mask", "num_tokens_per_req", "is_draft_worker"]
    # idempotent
    seen = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, t, h, k=HookType.AFTER, **kw: seen.append(t)))
    monkeypatch.setattr(G, "_installed", False)
    G.install_graph_hooks()
    G.install_graph_hooks()
    assert seen == [G._GET_SPEC_INFO, G._DUMMY_VERIFY_INPUT]


# ---------------------------------------------------------------------- bucket padding
def test_padded_batch_size_follows_the_captured_buckets():
    from sglang_tev.srt.graphs import graph_padded_batch_size

    runner = SimpleNamespace(capture_bs=[1, 2, 4, 8], disable_padding=False)
    assert [graph_padded_batch_size(b, runner) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert graph_padded_batch_size(3, None) is None
    exact = SimpleNamespace(capture_bs=[1, 2, 4, 8], disable_padding=True)
    assert graph_padded_batch_size(3, exact) is None and graph_padded_batch_size(4, exact) == 4


def test_pad_tree_mask_appends_true_segments_of_the_padded_rows():
    from sglang_tev.srt.graphs import pad_tree_mask

    N = 3
    mask = torch.rand(N * (5 + N) + N * (2 + N)) < 0.5  # two requests, seq_lens 5 and 2
    out = pad_tree_mask(mask, 2, 4, N, fill_seq_len=1)
    assert out.numel() == mask.numel() + 2 * N * (1 + N)
    assert torch.equal(out[: mask.numel()], mask) and bool(out[mask.numel() :].all())
    assert pad_tree_mask(mask, 2, 2, N, 1) is mask
    with pytest.raises(ValueError, match="padded_bs 1 < bs 2"):
        pad_tree_mask(mask, 2, 1, N, 1)
    with pytest.raises(ValueError, match="1-D bool"):
        pad_tree_mask(mask.int(), 2, 4, N, 1)


# ---------------------------------------------------------------------- draft head
def _logits_topk(hidden, lm_head, k, with_partition):
    """candidate_topk's contract on rows that already are logits."""
    vals, ids = hidden.topk(k, -1)
    return ids, vals, torch.logsumexp(hidden, -1)


def test_draft_head_writes_static_buffers_through_sglangs_tail_hook():
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.speculative.draft_worker_common import make_draft_sampler_capture_hook

    from sglang_tev.srt.graphs import TevDraftHead, draft_topk_from_hidden

    K, k, V, max_bs = 4, 3, 20, 8
    head = TevDraftHead(lm_head=None, block_size=K, topk=k, max_bs=max_bs, device="cpu", topk_fn=_logits_topk)
    assert head.logq.shape == head.ids.shape == (max_bs, K - 1, k)
    assert head.logq.dtype == torch.float32 and head.ids.dtype == torch.int64
    ptrs = (head.logq.data_ptr(), head.ids.data_ptr())
    hook = make_draft_sampler_capture_hook(head)
    g = torch.Generator().manual_seed(1)
    for live, padded in ((3, 4), (1, 1), (5, 8)):
        hidden = torch.randn(padded * K, V, generator=g)  # the replay runs the padded bucket
        rng = torch.get_rng_state()
        hook(None, LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden), SimpleNamespace(input_ids=None), padded * K)
        assert torch.equal(torch.get_rng_state(), rng)  # no random draw inside the captured region
        logq, ids = head.read(live)
        want_logq, want_ids = draft_topk_from_hidden(hidden[: live * K], K, None, k, _logits_topk)
        assert torch.equal(ids, want_ids) and torch.equal(logq, want_logq)
        # log-probabilities over the full vocabulary: depth d of request b, from row b*K + d
        full = torch.log_softmax(hidden.view(padded, K, V)[:live, 1:], -1)
        assert torch.allclose(logq, full.gather(-1, ids), atol=1e-5)
        assert (head.logq.data_ptr(), head.ids.data_ptr()) == ptrs  # addresses a graph bakes in


def test_draft_head_reads_only_the_depths_asked_and_refuses_others():
    """``depth`` D: the first D depths of the whole block's head, exactly (no row past D goes
    through the LM head); a depth outside [1, K - 1] is one error naming it."""
    from sglang_tev.srt.graphs import draft_topk_from_hidden

    K, k, V = 6, 3, 20
    hidden = torch.randn(2 * K, V, generator=torch.Generator().manual_seed(3))
    rows = []

    def counting_topk(h, lm_head, kk, with_partition):
        rows.append(h.shape[0])
        return _logits_topk(h, lm_head, kk, with_partition)

    full = draft_topk_from_hidden(hidden, K, None, k, counting_topk)
    for d in (1, 3, K - 1):
        logq, ids = draft_topk_from_hidden(hidden, K, None, k, counting_topk, depth=d)
        assert logq.shape == ids.shape == (2, d, k)
        assert torch.equal(logq, full[0][:, :d]) and torch.equal(ids, full[1][:, :d])
    assert rows == [2 * (K - 1), 2, 2 * 3, 2 * (K - 1)]
    for bad in (0, K, -1, 2.5, True):
        with pytest.raises(ValueError, match="depth"):
            draft_topk_from_hidden(hidden, K, None, k, _logits_topk, depth=bad)


def test_draft_block_is_cut_only_where_it_may_be():
    """Under auto a round's draft block is cut to the depths its trees reach + 1; a fixed tree,
    lattice mode, a drafter with a block convolution and a draft runner with CUDA graphs keep K."""
    from sglang_tev.srt.draft_block import DraftBlockMixin, block_cut_refusal

    class Conv(torch.nn.Module):
        taps, block_size = 2, 8

    def worker(mode="marginal", conv=False, graphs=False):
        w = DraftBlockMixin()
        w.tev, w.block_size, w._block_cut = SimpleNamespace(max_depth=7), 8, None
        w._tev_draft = SimpleNamespace(mode=mode)
        w.draft_model = torch.nn.Sequential(Conv() if conv else torch.nn.Identity())
        w.draft_model_runner = SimpleNamespace(decode_cuda_graph_runner=object() if graphs else None)
        return w

    w = worker()
    assert block_cut_refusal(w) is None
    assert [w._draft_extent(b, cut=True) for b in (1, 2, 6, 7, 16)] == [(2, 1), (3, 2), (7, 6), (8, 7), (8, 7)]
    assert [w._draft_extent(b, cut=False) for b in (2, 16)] == [(8, 2), (8, 7)]  # fixed: the whole block
    with pytest.raises(ValueError, match="budget"):
        w._draft_extent(0, cut=True)
    for kw, why in (({"mode": "lattice"}, "lattice"), ({"conv": True}, "convolution"), ({"graphs": True}, "graphs")):
        w = worker(**kw)
        assert why in block_cut_refusal(w)
        assert w._draft_extent(2, cut=True) == (8, 2)


def test_draft_head_compiles_without_a_graph_break(monkeypatch):
    """``fullgraph=True``: one graph, so no host sync and no Python fallback in the head, with
    SGLang's real ``candidate_topk`` (tp = 1, dense head; its CPU top-k + log-sum-exp branch)."""
    import sglang.srt.models.dflash as D

    from sglang_tev.srt.graphs import TevDraftHead

    parallel = SimpleNamespace(tp_size=1)
    monkeypatch.setattr(D, "get_parallel", lambda: parallel)  # what the runtime context publishes
    K, k, H, V = 4, 3, 8, 40
    lm_head = torch.nn.Linear(H, V, bias=False)
    lm_head.org_vocab_size = V
    head = TevDraftHead(lm_head=lm_head, block_size=K, topk=k, max_bs=8, device="cpu", topk_fn=D.candidate_topk)
    hidden = torch.randn(3 * K, H)
    torch._dynamo.reset()
    with torch.no_grad():
        head(hidden)
        want = [t.clone() for t in head.read(3)]
        head.logq.zero_()
        head.ids.zero_()
        torch.compile(head.__call__, fullgraph=True, backend="eager")(hidden)
        assert torch.equal(head.read(3)[1], want[1]) and torch.allclose(head.read(3)[0], want[0])

        def syncing_topk(h, lm, kk, with_partition):
            ids, vals, lse = D.candidate_topk(h, lm, kk, with_partition=with_partition)
            if bool(lse.max() > 0):  # a branch on a device value: a device-to-host read
                vals = vals - 1.0
            return ids, vals, lse

        bad = TevDraftHead(lm_head=lm_head, block_size=K, topk=k, max_bs=8, device="cpu", topk_fn=syncing_topk)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="(?i)data-dependent|graph break|unsupported"):
            torch.compile(bad.__call__, fullgraph=True, backend="eager")(hidden)
    torch._dynamo.reset()


# ---------------------------------------------------------------------- replay emulation
def _bucket(bs, buckets):
    return next(b for b in buckets if b >= bs)


class DraftGraph:
    """The draft runner's captured forward, replayed: live inputs copied into static max-size
    buffers, the padded bucket run, the folded head as SGLang's capture tail hook; the output is
    a view of the static hidden buffer sliced to the live rows (``execute``, ``:2020-2050``)."""

    def __init__(self, drafter, head, *, K, V, buckets):
        from sglang.srt.speculative.draft_worker_common import make_draft_sampler_capture_hook

        self.drafter, self.K, self.buckets = drafter, K, buckets
        max_tokens = max(buckets) * K
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64)
        self.hidden = torch.zeros(max_tokens, V)
        self.tail = make_draft_sampler_capture_hook(head)
        self.replays = 0

    def forward(self, fb):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        raw, pad = fb.batch_size, _bucket(fb.batch_size, self.buckets)
        n, m = raw * self.K, pad * self.K
        self.input_ids[:n].copy_(fb.input_ids)  # padded rows keep stale values, as SGLang's slots do
        self.positions[:n].copy_(fb.positions)
        view = SimpleNamespace(input_ids=self.input_ids[:m], positions=self.positions[:m], batch_size=pad)
        self.hidden[:m].copy_(self.drafter(view))
        self.tail(None, LogitsProcessorOutput(next_token_logits=None, hidden_states=self.hidden[:m]), view, m)
        self.replays += 1
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=self.hidden[:n]), can_run_graph=True)


class TargetGraph:
    """The target's verify graph at the level of SGLang's ``DecodeCudaGraphRunner``:
    ``can_run_graph`` (width and bs), ``load_batch`` (bucket padding, static slots with
    ``seq_lens`` = fill value for padded rows, the live mask copied into the static mask buffer as
    Triton's ``_update_target_verify_buffers`` does, ``mask_indptr`` over the padded rows) and a
    replay that runs every padded row and returns the live rows' logits."""

    seq_len_fill_value = 1
    disable_padding = False

    def __init__(self, model, kv, req_to_token, *, N, V, ctx, buckets):
        self.model, self.kv, self.req_to_token, self.N, self.V = model, kv, req_to_token, N, V
        self.captured_req_width = N  # SGLang's name for the width it was captured at
        self.capture_bs, self.max_bs = buckets, max(buckets)
        t = self.max_bs * N
        self.input_ids = torch.zeros(t, dtype=torch.int64)
        self.positions = torch.zeros(t, dtype=torch.int64)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64)
        self.seq_lens = torch.full((self.max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        self.mask = torch.zeros(self.max_bs * N * (ctx + N), dtype=torch.bool)  # stale False: a missing pad shows
        self.logits = torch.zeros(t, V)
        self.loads = 0
        self.attn_backend = object()  # its own backend (graph_tiers builds one per tier)

    def can_run_graph(self, fb):
        return fb.spec_info.num_tokens_per_req == self.N and fb.batch_size <= self.max_bs

    def load_batch(self, fb):
        raw, pad = fb.batch_size, _bucket(fb.batch_size, self.capture_bs)
        n = raw * self.N
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.req_pool_indices[:raw].copy_(fb.req_pool_indices)
        self.req_pool_indices[raw:pad].zero_()
        self.seq_lens[:raw].copy_(fb.seq_lens)
        self.seq_lens[raw:pad].fill_(self.seq_len_fill_value)
        live = fb.spec_info.custom_mask
        self.mask[: live.numel()] = live
        seg = self.N * (self.seq_lens[:pad] + self.N)
        self.mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), seg.cumsum(0)])
        # the live mask must hold a segment for every row the replay runs (padded ones included)
        assert int(self.mask_indptr[-1]) <= live.numel(), "mask not padded for the graph's bucket"
        self.raw, self.pad = raw, pad
        self.loads += 1

    @torch.no_grad()
    def replay(self):
        N = self.N
        for r in range(self.pad):
            s = int(self.seq_lens[r])
            ctx = self.kv[self.req_to_token[self.req_pool_indices[r], :s]]
            rows = self.mask[int(self.mask_indptr[r]) : int(self.mask_indptr[r + 1])].view(N, s + N)
            tok = self.input_ids[r * N : (r + 1) * N] if r < self.raw else torch.zeros(N, dtype=torch.int64)
            pos = self.positions[r * N : (r + 1) * N] if r < self.raw else torch.full((N,), s, dtype=torch.int64)
            self.logits[r * N : (r + 1) * N] = _tree_logits(self.model, ctx.clamp(min=0), tok, pos, rows)
        assert bool(torch.isfinite(self.logits[: self.pad * N]).all())  # padded rows attend to something too
        return self.logits[: self.raw * N]


def _tree_logits(model, ctx, tokens, positions, rows):
    s, n = ctx.numel(), tokens.numel()
    full = torch.zeros(s + n, s + n, dtype=torch.bool)
    full[:s, :s] = torch.ones(s, s, dtype=torch.bool).tril()
    full[s:] = rows
    add = torch.zeros(1, 1, s + n, s + n).masked_fill_(~full, torch.finfo(torch.float32).min)
    inp = torch.cat([ctx, tokens]).view(1, -1)
    pos = torch.cat([torch.arange(s), positions]).view(1, -1)
    return model(inp, position_ids=pos, attention_mask=add).logits[0, s:]


def _run_worker(monkeypatch, graphs: bool, tiers: bool = False):
    """Decode 16 tokens for 3 requests through ``TEVWorker._tev_decode`` with SGLang's GPU-only
    pieces faked; ``graphs`` replays the draft and target "graphs" above, else runs eagerly;
    ``tiers`` (with ``graphs``): ``SGLANG_TEV_BUDGET=auto`` with a target "graph" per tree-size tier
    (``graph_tiers.GraphTiers``), the width changing round to round."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
    from transformers import AutoModelForCausalLM

    import sglang_tev.srt.worker as W
    from sglang_tev.costs import CostTable
    from sglang_tev.srt.budget import ServedBudget
    from sglang_tev.srt.graph_tiers import GraphTiers, tier_sizes
    from sglang_tev.srt.graphs import TevDraftHead
    from sglang_tev.srt.kv_headroom import required_row_extra

    target = AutoModelForCausalLM.from_pretrained(ROOT / "sglang_tev/assets/tiny-code/target", dtype=torch.float32).eval()
    V = target.config.vocab_size
    K, N, D, k, buckets = 6, 12, 5, 3, [1, 2, 4, 8]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, V, (L,), generator=g).tolist() for L in (4, 7, 2)]
    bs, new_tokens = len(prompts), 16
    refs = [p + plain_greedy(target, p, new_tokens + 3 * K) for p in prompts]

    pool_idx = torch.tensor([2, 0, 1])
    req_to_token = torch.randperm(3 * 200, generator=g).view(3, 200)
    kv = torch.full((600,), -1, dtype=torch.int64)
    for b, p in enumerate(prompts):
        kv[req_to_token[pool_idx[b], : len(p)]] = torch.tensor(p)
    ctx = req_to_token.shape[1] - required_row_extra(N, K, 1)

    def assign_locs(*, req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num, device):
        return torch.cat([req_to_token[req_pool_indices[b], int(start_offset[b]) : int(end_offset[b])] for b in range(batch_size)])

    calls = {"eager_topk": 0, "head_topk": 0}

    def eager_topk(hidden, lm_head, kk, with_partition):
        calls["eager_topk"] += 1
        return _logits_topk(hidden, lm_head, kk, with_partition)

    def head_topk(hidden, lm_head, kk, with_partition):
        calls["head_topk"] += 1
        return _logits_topk(hidden, lm_head, kk, with_partition)

    def drafter(fb):
        # deterministic: depth j of a block proposes the true continuation except where
        # (position + request) % 4 == 0, so trees are deep but not always right
        n_rows = fb.input_ids.numel()
        now[0] += 0.5e-3
        logits = torch.sin(torch.arange(n_rows * V, dtype=torch.float32)).view(n_rows, V)
        for b in range(min(fb.batch_size, bs)):
            base = int(fb.positions[b * K]) + 1
            for j in range(1, K):
                t = base + j - 1
                if t < len(refs[b]) and (t + b) % 4 != 0:
                    logits[b * K + j, refs[b][t]] += 8.0
        return logits

    def draft_forward(fb):
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=drafter(fb)))  # eager: no can_run_graph

    graph = TargetGraph(target, kv, req_to_token, N=N, V=V, ctx=ctx, buckets=buckets) if graphs else None
    sizes = tier_sizes(N) if tiers else ()
    tier_graphs = {w: graph if w == N else TargetGraph(target, kv, req_to_token, N=w, V=V, ctx=ctx, buckets=buckets)
                   for w in sizes}  # fmt: skip
    now = [0.0]  # under tiers, the planner's clock: the fakes advance it by their tokens

    def prepare_for_verify(self, batch, target_worker, **kw):
        # as SGLang's (dflash_info.py:66-133): can_run_graph, then load_batch when it can
        batch.input_ids = self.draft_token
        fb = SimpleNamespace(
            batch_size=len(batch.seq_lens), spec_info=self, input_ids=self.draft_token, positions=self.positions,
            seq_lens=batch.seq_lens, req_pool_indices=batch.req_pool_indices, out_cache_loc=batch.out_cache_loc,
        )  # fmt: skip
        runner = target_worker.model_runner.decode_cuda_graph_runner
        fb.graph = bool(runner is not None and runner.can_run_graph(fb))
        if fb.graph:
            runner.load_batch(fb)
        return fb, fb.graph

    @torch.no_grad()
    def target_forward(*, batch, forward_batch, is_verify, skip_attn_backend_init):
        fb = forward_batch
        vi = fb.spec_info
        now[0] += 1e-3 + 1e-4 * vi.draft_token_num * bs
        if fb.graph:
            # the runner ModelRunner.forward reads at forward time (the tier bound for this round)
            runner = model_runner.decode_cuda_graph_runner
            assert runner.N == vi.draft_token_num and (runner is graph or tiers)
            assert model_runner.attn_backend is runner.attn_backend  # what runs outside the graph reads it
            logits = runner.replay().clone()
        else:
            assert not tiers, "a tier width ran eagerly"
            logits = torch.empty(bs * N, V)
            start = 0
            for b in range(bs):
                s = int(fb.seq_lens[b])
                rows = vi.custom_mask[start : start + N * (s + N)].view(N, s + N)
                start += N * (s + N)
                c = kv[req_to_token[fb.req_pool_indices[b], :s]]
                logits[b * N : (b + 1) * N] = _tree_logits(target, c, vi.draft_token[b * N : (b + 1) * N], vi.positions[b * N : (b + 1) * N], rows)
        kv[fb.out_cache_loc] = vi.draft_token
        hidden = torch.arange(bs * vi.draft_token_num, dtype=torch.float32).view(-1, 1).repeat(1, 2)
        return SimpleNamespace(logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden), can_run_cuda_graph=fb.graph)

    monkeypatch.setattr(W, "assign_extend_cache_locs_func", assign_locs)
    patch_forward_plumbing(monkeypatch, V, candidate_topk=eager_topk)
    monkeypatch.setattr(DFlashVerifyInput, "prepare_for_verify", prepare_for_verify)

    translator = FakeTranslator()
    model_runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        kv_index_translator=translator,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: FakeKV(kv), page_size=1),
        model=SimpleNamespace(lm_head=torch.nn.Linear(2, V)),
        model_config=SimpleNamespace(context_len=ctx),
        decode_cuda_graph_runner=graph,
        attn_backend=graph.attn_backend if graph is not None else object(),
    )
    head = dgraph = None
    if graphs:
        head = TevDraftHead(lm_head=None, block_size=K, topk=k, max_bs=max(buckets), device="cpu", topk_fn=head_topk)
        dgraph = DraftGraph(drafter, head, K=K, V=V, buckets=buckets)
        forward = dgraph.forward
    else:
        forward = draft_forward
    if tiers:
        monkeypatch.setenv("SGLANG_TEV_BUDGET", "auto")
    w = build_tev_worker(monkeypatch, tree_size=N, block_size=K, max_depth=D, topk=k, verifier="tev",
                         model_runner=model_runner, target_forward=target_forward, draft_forward=forward,
                         translator=translator)
    if head is not None:
        w._draft_sampler = head  # what init_cuda_graphs installs (dflash_worker_v2.py:884-998)
    if tiers:  # what init_cuda_graphs sets up after capture_tiers (a clock the fakes advance: same choices anywhere)
        w._served_budget = ServedBudget(N - 1, K, costs=CostTable(load_correction=False), clock=lambda: now[0])
        w._graph_tiers = GraphTiers(model_runner, tier_graphs)
        w._served_budget.use_grid(w._graph_tiers.budgets)

    greedy = SamplingBatchInfo(
        temperatures=torch.ones(bs, 1), top_ps=torch.ones(bs), top_ks=torch.ones(bs, dtype=torch.int32),
        min_ps=torch.zeros(bs), is_all_greedy=True, is_any_greedy=True, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=V, device="cpu",
    )  # fmt: skip
    seq = torch.tensor([len(p) for p in prompts])
    bonus = torch.tensor([r[len(p)] for r, p in zip(refs, prompts)])
    out = [[int(b)] for b in bonus]
    batch = SimpleNamespace(
        seq_lens=seq.clone(), seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), req_pool_indices=pool_idx,
        spec_info=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=seq.clone()), sampling_info=greedy,
        forward_mode=SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False), is_extend_in_batch=False,
        has_grammar=False, return_logprob=False, out_cache_loc=None,
        reqs=[SimpleNamespace(sampling_params=SimpleNamespace(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0))] * bs,  # greedy, as SGLang stores it
    )  # fmt: skip
    rounds, widths = [], []
    ptrs = (head.logq.data_ptr(), head.ids.data_ptr()) if head is not None else None
    while min(len(o) for o in out) < new_tokens:
        res = w.forward_batch_generation(batch)
        assert res.can_run_cuda_graph is graphs
        stride = res.speculative_output_stride or res.speculative_num_draft_tokens  # as SGLang reads it
        assert res.speculative_num_draft_tokens == N and res.next_token_ids.numel() == bs * stride
        for b in range(bs):
            a = int(res.accept_lens[b])
            out[b] += res.next_token_ids[b * stride : b * stride + a].tolist()
        rounds.append(res.accept_lens.tolist())
        widths.append(res.logits_output.customized_info["tev_budget"][0] + 1)
        batch.seq_lens = res.new_seq_lens.clone()
        batch.seq_lens_cpu = res.new_seq_lens.clone()
        batch.seq_lens_sum = int(batch.seq_lens.sum())
        batch.spec_info = res.next_draft_input
    if tiers:
        # every round replayed the target tier of its width (plain steps: the width-1 tier), every
        # tree round the draft graph; the widths changed
        assert {w: g.loads for w, g in tier_graphs.items()} == {w: widths.count(w) for w in sizes}
        assert dgraph.replays == calls["head_topk"] == sum(w > 1 for w in widths) and calls["eager_topk"] == 0
        assert len(set(widths)) >= 3 and 1 in widths, widths
    elif graphs:
        # every round replayed both graphs, the head ran inside the draft graph only, and the
        # static buffers never moved
        assert graph.loads == dgraph.replays == calls["head_topk"] == len(rounds) and calls["eager_topk"] == 0
        assert (head.logq.data_ptr(), head.ids.data_ptr()) == ptrs
    else:
        assert calls["eager_topk"] == len(rounds) and calls["head_topk"] == 0
    return [o[:new_tokens] for o in out], [r[len(p) : len(p) + new_tokens] for r, p in zip(refs, prompts)], rounds


def test_graph_replay_emulation_matches_eager_and_plain_greedy(monkeypatch):
    """bs 3 replays the bucket-4 graphs (buckets 1/2/4/8): same tokens and the same accept lengths
    round by round as the eager path, both equal to plain greedy decoding; drafts are accepted
    (mean accepted drafts >= 1.5), so positions, the mask and the KV moves all matter."""
    got_graph, refs, rounds_graph = _run_worker(monkeypatch, graphs=True)
    monkeypatch.undo()
    got_eager, refs_eager, rounds_eager = _run_worker(monkeypatch, graphs=False)
    assert got_graph == refs and got_eager == refs_eager == refs
    assert rounds_graph == rounds_eager
    accepted = [a - 1 for r in rounds_graph for a in r]
    assert sum(accepted) / len(accepted) >= 1.5


def test_graph_tiers_replay_each_rounds_width_and_keep_plain_greedy(monkeypatch):
    """SGLANG_TEV_BUDGET=auto with a target graph per tree-size tier (1, 5, 9 and N = 12 here): the
    width changes round to round (plain steps included), each round replays the tier of its width
    (the runner bound on the model runner while the forward runs; none runs eagerly), and the
    tokens are plain greedy decoding's."""
    got, refs, _ = _run_worker(monkeypatch, graphs=True, tiers=True)
    assert got == refs
