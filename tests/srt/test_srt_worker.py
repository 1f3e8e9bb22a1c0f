"""``TEVWorker``'s decode round on CPU, with SGLang's GPU-only pieces replaced by small fakes.

What is real: the worker's own code (``_tev_decode`` / ``_draft_topk``), SGLang 0.5.23's
``DFlashVerifyInput``, ``DFlashDraftInputV2``, ``SamplingBatchInfo``,
``apply_dflash_verify_logits_adjustments`` and ``GenerationBatchResult``, and this project's
round functions. What is faked (GPU-only in SGLang): the draft runner's forward and
``candidate_topk`` (an oracle drafter), ``assign_extend_cache_locs_func`` (a torch gather from
``req_to_token``), the KV index translator, ``ForwardBatch``, ``prepare_for_verify`` and the
target forward: the fake target is the shipped tiny Qwen3 model reading its context FROM A
SIMULATED KV STORE (each slot holds the token whose KV it caches) plus the verify input's tree,
FULL mask and positions, and writing the tree's tokens into the window's slots. So the KV move of
the accepted path, the commit lengths, the output tokens and the next round's state all have to
be right for the output to equal plain greedy decoding.

This is a wiring check; the real forwards, attention backends and kernels run only with a CUDA GPU
(``scripts/sglang_smoke.py``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_pair import plain_greedy

from sglang_worker_fakes import FakeKV, FakeTranslator, build_tev_worker, patch_forward_plumbing  # noqa: E402
from sglang_tev.srt.meta_info import RoundLog  # noqa: E402
from sglang_tev.testing.sglang_cpu.required import require_sglang  # noqa: E402

require_sglang()

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("verifier,budget_mode", [("tev", "fixed"), ("sequential", "fixed"), ("tev", "auto"),
                                                   ("tev", "auto-ragged"), ("tev", "auto-ragged-triton")])
def test_worker_round_commits_greedy_identical_output(monkeypatch, tmp_path, verifier, budget_mode):
    """Rounds of the worker on the tiny target (fake SGLang pools and runners) commit plain greedy
    decoding's tokens and KV; with SGLANG_TEV_BUDGET=auto the width changes round to round (plain
    steps included, each as SGLang's DECODE forward) and the same holds; with
    SGLANG_TEV_BUDGET=auto-ragged on a backend that takes ragged verifies (tev_cpu) each request's
    tree has its own size, verified in one packed forward; on Triton (``auto-ragged-triton``) one
    width per round remains."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
    from transformers import AutoModelForCausalLM

    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    import sglang_tev.srt.worker as W
    from sglang_tev.costs import CostTable
    from sglang_tev.plan import RoundPlan
    from sglang_tev.srt.budget import ServedBudget
    from sglang_tev.srt.cpu_attention import TorchCPUAttnBackend
    from sglang_tev.srt.kv_headroom import required_row_extra

    target = AutoModelForCausalLM.from_pretrained(ROOT / "sglang_tev/assets/tiny-code/target", dtype=torch.float32).eval()
    V = target.config.vocab_size
    K, N, D, k = 6, 12, 5, 3
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, V, (L,), generator=g).tolist() for L in (4, 7, 2, 9)]
    bs, new_tokens = len(prompts), 20

    refs = [p + plain_greedy(target, p, new_tokens + 3 * K) for p in prompts]
    now = [0.0]  # the planner's clock under auto

    # memory: request b owns pool row pool_idx[b]; slots are a random permutation
    pool_idx = torch.tensor([3, 0, 2, 1])
    req_to_token = torch.randperm(4 * 200, generator=g).view(4, 200)
    kv = torch.full((800,), -1, dtype=torch.int64)
    for b, p in enumerate(prompts):  # prefill: the prompt's KV is cached
        kv[req_to_token[pool_idx[b], : len(p)]] = torch.tensor(p)

    def assign_locs(*, req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num, device):
        rows = [req_to_token[req_pool_indices[b], int(start_offset[b]) : int(end_offset[b])] for b in range(batch_size)]
        assert all(r.numel() == draft_token_num for r in rows)
        return torch.cat(rows)

    def oracle_topk(hidden, lm_head, kk, with_partition):
        # the fake draft "hidden" rows are already logits over the vocabulary; the head reads
        # only the depths the round's trees reach
        seen.setdefault("head_rows", []).append(hidden.shape[0] // bs)
        lse = torch.logsumexp(hidden, -1)
        vals, ids = hidden.topk(kk, -1)
        return ids, vals, lse

    def draft_forward(fb):
        # block [root, MASK x (K-1)] at positions prefix..prefix+K-1: slot j predicts the token
        # after position prefix + j, the true continuation with a margin (drafter accuracy ~85%)
        # the block: K tokens, or under auto the depths a tree of the round's budget reaches + 1
        Kb = fb.spec_info.draft_token_num
        assert fb.input_ids.numel() == bs * Kb == fb.out_cache_loc.numel() and fb.bound
        assert Kb == K if budget_mode == "fixed" else 2 <= Kb <= K
        seen.setdefault("blocks", []).append(Kb)
        # the drafter's KV holds every committed token's, plain steps' held writes included
        for b in range(bs):
            s = int(fb.positions[b * Kb])  # the root's position: the committed length
            slots = req_to_token[pool_idx[b], len(prompts[b]) : s]
            assert draft_kv[slots].tolist() == refs[b][len(prompts[b]) : s], (b, s)
        seen["drafts"] = seen.get("drafts", 0) + 1
        now[0] += 0.5e-3  # the planner's clock (below): a draft costs 0.5 ms
        logits = torch.randn(bs * Kb, V, generator=g)
        for b in range(bs):
            base = int(fb.positions[b * Kb]) + 1  # index in the full token sequence of depth 1
            for j in range(1, Kb):
                t = base + j - 1
                if t < len(refs[b]) and float(torch.rand((), generator=g)) < 0.85:
                    logits[b * Kb + j, refs[b][t]] += 8.0
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=logits))

    def prepare_for_verify(self, batch, target_worker, **kw):
        # as SGLang's: the host bound covers prefix + window; the mask matches the device seq_lens
        assert torch.equal(batch.seq_lens_cpu, seen["seq_cpu"] + self.draft_token_num)
        batch.input_ids = self.draft_token
        return SimpleNamespace(spec_info=self, out_cache_loc=batch.out_cache_loc, seq_lens=batch.seq_lens), False

    @torch.no_grad()
    def target_forward(*, batch, forward_batch, is_verify, skip_attn_backend_init=None):
        assert is_verify  # the worker samples nothing through SGLang's sampler
        if getattr(forward_batch, "forward_mode", None) == ForwardMode.DECODE:
            return decode_forward(forward_batch)
        vi, loc, seq = forward_batch.spec_info, forward_batch.out_cache_loc, forward_batch.seq_lens
        lay = vi.ragged_verify_layout  # request b's lens[b] nodes packed at indptr[b] (else N each)
        lens = [vi.draft_token_num] * bs if lay is None else list(lay.verify_lens_cpu)
        now[0] += 1e-3 * (1 + 0.1 * sum(lens))  # a forward: 1 ms + 0.1 ms a token
        assert lay is None or (budget_mode == "auto-ragged" and lay.qo_indptr_device.tolist()[-1] == sum(lens))
        indptr = [sum(lens[:b]) for b in range(bs + 1)]
        seen["indptr"], seen["ragged"] = indptr, seen.get("ragged", 0) + (len(set(lens)) > 1)
        assert vi.draft_token.numel() == loc.numel() == indptr[-1]
        logits = torch.empty(indptr[-1], V)
        start = 0
        for b in range(bs):
            s, n, o = int(seq[b]), lens[b], indptr[b]
            ctx = kv[req_to_token[pool_idx[b], :s]]  # the committed context, read from the KV store
            assert bool((ctx >= 0).all())
            if vi.custom_mask is None:  # causal, as SGLang's backends read a mask-less verify
                assert n == 1  # only a root-only round goes without one
                seen["maskless"] = seen.get("maskless", 0) + (b == 0)
                rows = torch.ones(n, s + n, dtype=torch.bool)
                rows[:, s:] = torch.ones(n, n, dtype=torch.bool).tril()
            else:
                rows = vi.custom_mask[start : start + n * (s + n)].view(n, s + n)
                start += n * (s + n)
            full = torch.zeros(s + n, s + n, dtype=torch.bool)
            full[:s, :s] = torch.ones(s, s, dtype=torch.bool).tril()
            full[s:] = rows
            add = torch.zeros(1, 1, s + n, s + n).masked_fill_(~full, torch.finfo(torch.float32).min)
            inp = torch.cat([ctx, vi.draft_token[o : o + n]]).view(1, -1)
            pos = torch.cat([torch.arange(s), vi.positions[o : o + n]]).view(1, -1)
            logits[o : o + n] = target(inp, position_ids=pos, attention_mask=add).logits[0, s:]
        kv[loc] = vi.draft_token  # the verify forward writes every node's KV into the window
        seen["draft_token"] = vi.draft_token.clone()
        # features: the row id, and the row's token (what the fake drafter KV below stores)
        hidden = torch.stack([torch.arange(indptr[-1], dtype=torch.float32), vi.draft_token.float()], dim=1)
        return SimpleNamespace(
            logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden), can_run_cuda_graph=False
        )

    @torch.no_grad()
    def decode_forward(fb):
        # SGLang's DECODE: seq_lens count the new token, positions = seq_lens - 1, causal attention
        seen["decode"] = seen.get("decode", 0) + 1
        now[0] += 1e-3 * (1 + 0.1 * bs)
        plan = translator.last_plan  # reads nothing past seq_lens, which count the token
        assert plan.read_extent == 0 and torch.equal(plan.seq_lens, fb.seq_lens)
        assert fb.capture_hidden_mode == CaptureHiddenMode.FULL and fb.seq_lens_sum == int(fb.seq_lens.sum())
        assert torch.equal(fb.seq_lens_cpu, seen["seq_cpu"] + 1) and torch.equal(fb.positions, fb.seq_lens - 1)
        logits = torch.empty(bs, V)
        for b in range(bs):
            s = int(fb.seq_lens[b]) - 1
            ctx = kv[req_to_token[pool_idx[b], :s]]
            assert bool((ctx >= 0).all())
            inp = torch.cat([ctx, fb.input_ids[b : b + 1]]).view(1, -1)
            logits[b] = target(inp).logits[0, -1]
        kv[fb.out_cache_loc] = fb.input_ids
        seen["draft_token"], seen["indptr"] = fb.input_ids.clone(), list(range(bs + 1))
        hidden = torch.stack([torch.arange(bs, dtype=torch.float32), fb.input_ids.float()], dim=1)
        return SimpleNamespace(
            logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden), can_run_cuda_graph=False
        )

    monkeypatch.setattr(W, "assign_extend_cache_locs_func", assign_locs)
    patch_forward_plumbing(monkeypatch, V, candidate_topk=oracle_topk)
    monkeypatch.setattr(DFlashVerifyInput, "prepare_for_verify", prepare_for_verify)

    appended = []
    draft_kv = torch.full((800,), -1, dtype=torch.int64)  # slot -> the token whose drafter KV it holds

    def append_draft_kv(**kw):
        # SGLang's prefix-valid writer: row r writes its first commit_lens[r] window slots
        appended.append(kw)
        loc2, lens, feats = kw["cache_loc_2d"], kw["commit_lens"], kw["target_hidden"]
        assert torch.equal(loc2.reshape(-1), kw["cache_loc"]) and feats.shape[0] == loc2.numel() == kw["positions"].numel()
        width = loc2.shape[1]
        for r in range(loc2.shape[0]):
            n = int(lens[r])
            draft_kv[loc2[r, :n]] = feats[r * width : r * width + n, 1].long()

    fake_kv = FakeKV(kv)
    translator = FakeTranslator()
    model_runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        kv_index_translator=translator,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: fake_kv, page_size=1),
        model=SimpleNamespace(lm_head=torch.nn.Linear(2, V)),
        # rows exactly as long as the plugin's headroom makes them (the worker checks on its first decode)
        model_config=SimpleNamespace(context_len=req_to_token.shape[1] - required_row_extra(N, K, 1), dtype=torch.float32),
    )
    monkeypatch.setenv("SGLANG_TEV_BUDGET", {"auto-ragged-triton": "auto-ragged"}.get(budget_mode, budget_mode))
    if budget_mode == "auto-ragged":  # rank 0 keeps what it learned (srt/plan_store.py), every 4 rounds here
        monkeypatch.setenv("SGLANG_TEV_PLAN_CACHE", "1")
        monkeypatch.setenv("SGLANG_TEV_CACHE", str(tmp_path))
        monkeypatch.setattr(W, "SAVE_EVERY", 4)
    w = build_tev_worker(monkeypatch, tree_size=N, block_size=K, max_depth=D, topk=k, verifier=verifier,
                         model_runner=model_runner, target_forward=target_forward, draft_forward=draft_forward,
                         translator=translator, append_draft_kv=append_draft_kv,
                         attention_backend=TritonAttnBackend if budget_mode.endswith("triton") else TorchCPUAttnBackend)
    assert w._round_log.interval == 40  # SGLang's default --decode-log-interval (not in these args)
    if budget_mode != "fixed":
        # the planner times rounds on a clock the fakes advance by their tokens (no wall time, no
        # machine load): its choices, ragged cuts included, are the same on any machine
        assert w._served_budget.rounds == 0
        w._served_budget = served = ServedBudget(N - 1, K, costs=CostTable(load_correction=False), clock=lambda: now[0])
        planned = served.plan

        def plan(bs_, all_greedy=True):  # every third round a 2-node tree: a draft block cut to 3 tokens
            p = planned(bs_, all_greedy)
            if served.rounds % 3 == 2:
                p = RoundPlan((2,) * bs_, p.capacity, draft_depth=2)
            return p

        served.plan = plan
    lines = []
    w._round_log = RoundLog(2, SimpleNamespace(info=lines.append))

    greedy = SamplingBatchInfo(
        temperatures=torch.ones(bs, 1), top_ps=torch.ones(bs), top_ks=torch.ones(bs, dtype=torch.int32),
        min_ps=torch.zeros(bs), is_all_greedy=True, is_any_greedy=True, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=V, device="cpu",
    )  # fmt: skip
    seq = torch.tensor([len(p) for p in prompts])
    bonus = torch.tensor([r[len(p)] for r, p in zip(refs, prompts)])  # the prefill's sampled token
    out = [[int(b)] for b in bonus]
    batch = SimpleNamespace(
        seq_lens=seq.clone(), seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), req_pool_indices=pool_idx,
        spec_info=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=seq.clone()), sampling_info=greedy,
        forward_mode=SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False), is_extend_in_batch=False,
        has_grammar=False, return_logprob=False, out_cache_loc=None,
        reqs=[SimpleNamespace(sampling_params=SimpleNamespace(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0))] * bs,  # greedy, as SGLang stores it
    )  # fmt: skip
    seen = {}
    accepts, wide = [], []  # exit depths: every round's, the rounds' of more than 3 nodes
    widths = []
    held_before = 0
    while min(len(o) for o in out) < new_tokens:
        seen["seq_cpu"] = batch.seq_lens_cpu.clone()
        roots = batch.spec_info.bonus_tokens.clone()
        res = w.forward_batch_generation(batch)
        # the scheduler's reading of a spec-v2 result (_resolve_spec_v2_tokens)
        stride = res.speculative_output_stride or res.speculative_num_draft_tokens
        assert res.speculative_num_draft_tokens == N and res.next_token_ids.numel() == bs * stride
        for b in range(bs):
            a = int(res.accept_lens[b])
            out[b] += res.next_token_ids[b * stride : b * stride + a].tolist()
        info = res.logits_output.customized_info
        wr = max(info["tev_budget"]) + 1  # this round's width: N with a fixed budget
        assert stride == wr  # rows hold the round's width (one token in a plain step)
        widths.append(wr)
        assert wr == N if budget_mode == "fixed" else 1 <= wr <= N
        held = len(w._draft_kv_pending)
        if wr == 1:  # a plain step holds its drafter-KV write (up to the cap, then all are written)
            assert (held == held_before + 1) or (held == 0 and held_before + 1 == w._draft_kv_pending.max_steps)
        else:  # a tree round wrote the held ones before its draft, then its own
            assert held == 0
            last = appended[-1]
            assert torch.equal(last["commit_lens"], res.accept_lens)
            assert last["cache_loc_2d"].shape[1] == wr
            assert torch.equal(last["positions"].view(bs, wr), batch.seq_lens.view(bs, 1) + torch.arange(wr))
            # the draft-KV rows written (the first commit_lens of each window) are the target features
            # of root + accepted drafts, in order (features are row ids here)
            for b in range(bs):
                a = int(res.accept_lens[b])
                want = [int(roots[b])] + res.next_token_ids[b * wr : b * wr + a - 1].tolist()
                rows = last["target_hidden"][b * wr : b * wr + a, 0].long()
                assert seen["draft_token"][rows].tolist() == want
                assert bool((rows >= seen["indptr"][b]).all()) and bool((rows < seen["indptr"][b + 1]).all())
        held_before = held
        assert list(info["tev_accept_length"]) == res.accept_lens.tolist()
        assert [a + 1 for a in info["tev_exit_depth"]] == res.accept_lens.tolist()
        accepts += info["tev_exit_depth"]
        wide += info["tev_exit_depth"] if wr > 3 else []
        budgets = list(info["tev_budget"])
        if budget_mode == "auto-ragged":  # each request's own tree, the widest sets the round's width
            ip = seen["indptr"]
            assert max(budgets) == wr - 1 and budgets == [ip[b + 1] - ip[b] - 1 for b in range(bs)]
        else:
            assert budgets == [wr - 1] * bs  # every request's tree filled this round's width
        assert len(list(info["tev_coverage"])) == bs  # every column read, as the scheduler does
        assert batch.seq_lens_cpu is seen["seq_cpu"] or torch.equal(batch.seq_lens_cpu, seen["seq_cpu"])  # restored
        batch.seq_lens = res.new_seq_lens.clone()
        batch.seq_lens_cpu = res.new_seq_lens.clone()
        batch.seq_lens_sum = int(batch.seq_lens.sum())
        batch.spec_info = res.next_draft_input
        assert torch.equal(batch.spec_info.bonus_tokens, torch.tensor([o[-1] for o in out]))
    for b, p in enumerate(prompts):
        assert out[b][:new_tokens] == refs[b][len(p) : len(p) + new_tokens]
        # the committed KV holds exactly the committed tokens (prompt + output minus the bonus)
        s = int(batch.seq_lens[b])
        assert kv[req_to_token[pool_idx[b], :s]].tolist() == (p + out[b])[:s]
    assert fake_kv.moves == sum(wr > 1 for wr in widths)  # a root-only round (a plain step) moves nothing
    assert seen["drafts"] == sum(wr > 1 for wr in widths)  # each checked the drafter KV first
    # the head read each block's depths; auto cut the block to what its smaller trees reach
    assert seen["head_rows"] == [kb - 1 for kb in seen["blocks"]]
    assert set(seen["blocks"]) == {K} if budget_mode == "fixed" else min(seen["blocks"]) < K, seen["blocks"]
    w._flush_draft_kv()  # what a prefill would do first: the drafter KV then holds every committed token
    for b, p in enumerate(prompts):
        s = int(batch.seq_lens[b])
        assert draft_kv[req_to_token[pool_idx[b], len(p) : s]].tolist() == (p + out[b])[len(p) : s]
    # the periodic TEV log line: every 2 rounds, over the rounds' own values
    rounds = len(accepts) // bs
    assert len(lines) == rounds // 2
    mean_acc = float(lines[0].split("accept length ")[1].split(",")[0])
    assert 1.0 <= mean_acc <= N
    if budget_mode == "fixed":
        assert f"mean budget {N - 1:.1f}" in lines[0]
    else:  # the planner's calibration runs the largest tree, then plain decoding and a middle width
        assert w._served_budget.rounds == rounds and {N, 1} <= set(widths), widths
        # root-only rounds (no graphs here) run as SGLang's DECODE forward, the others verify the tree
        assert seen.get("decode", 0) == sum(wr == 1 for wr in widths) and seen.get("maskless", 0) == 0
        # read from the target's attention backend at the first decode
        assert w._served_budget.layout == ("ragged" if budget_mode == "auto-ragged" else "padded")
        # per-request trees of different sizes went through one packed forward, only where ragged
        assert (seen.get("ragged", 0) > 0) == (budget_mode == "auto-ragged"), seen.get("ragged")
        if budget_mode == "auto-ragged":  # the plan cache holds this server's greedy law, keyed by its layout
            store = w._plan_store
            assert store.files["greedy"].key["layout"] == "ragged" and store.files["greedy"].key["tp"] == 1
            assert store.files["greedy"].load()["cost_table"].seconds[bs]
        else:
            assert w._plan_store is None
    assert sum(wide) / len(wide) >= 1.5


def test_row_temperatures_are_read_on_the_host():
    """The planner's temperature regime per request: from scalar sampling params, or from the
    requests' own params (never from the per-row device tensors); greedy (top_k <= 1) is 0."""
    from sglang_tev.sampling import SamplingParams
    from sglang_tev.planner import regime_of
    from sglang_tev.srt.round import as_float32, sampling_params_from_info
    from sglang_tev.srt.worker import _row_temperatures

    req = lambda t, k: SimpleNamespace(sampling_params=SimpleNamespace(temperature=t, top_k=k, top_p=1.0, min_p=0.0))  # noqa: E731
    reqs = [req(0.7, 1 << 30), req(1.0, 1), req(1.3, 8)]
    assert _row_temperatures(SamplingParams(temperature=0.0), reqs) == [0.0, 0.0, 0.0]
    assert _row_temperatures(SamplingParams(temperature=0.75), reqs) == [0.75] * 3

    class NoRead(torch.Tensor):  # a tensor whose values must not be read
        def tolist(self):
            raise AssertionError("the per-row temperatures were read from the device tensor")

    tensors = SamplingParams(temperature=torch.tensor([0.7, 0.0, 1.3]).as_subclass(NoRead))
    assert _row_temperatures(tensors, reqs) == [as_float32(0.7), 0.0, as_float32(1.3)]
    # a request's regime is the same alone (scalars) and in a mixed batch: both float32, as SGLang stores it
    for t in (0.15, 0.45, 0.65, 0.85, 0.7):
        shared = sampling_params_from_info(SimpleNamespace(is_all_greedy=False), [req(t, 1 << 30)] * 2)
        assert regime_of(_row_temperatures(shared, [req(t, 1 << 30)])[0]) == regime_of(
            _row_temperatures(tensors, [req(t, 1 << 30), req(1.0, 1), req(1.3, 8)])[0]), t
