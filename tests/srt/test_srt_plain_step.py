"""``TEVWorker._plain_step`` (a plain decoding step for the whole batch without the round's tree
machinery) equals the general round on root-only trees, field for field, under every target law
SGLang hands the worker: greedy, one shared temperature, truncation (top-k / top-p / min-p), mixed
greedy and sampled rows, seeded rows. SGLang's GPU-only pieces are the same fakes as
``test_srt_worker.py``'s; the target's DECODE forward is a fixed random logit table per step."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_worker_fakes import FakeKV, FakeTranslator, build_tev_worker, patch_forward_plumbing  # noqa: E402
from sglang_tev.testing.sglang_cpu.required import require_sglang  # noqa: E402

require_sglang()

V, N, K, BS = 97, 9, 4, 5


def _sampling_info(law: str, bs: int):
    """SGLang's ``SamplingBatchInfo`` and the requests' host-side parameters for ``law``."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    off = 1 << 30  # SGLang's TOP_K_ALL (top_k -1 as it stores it)
    rows = {  # (temperature, top_k, top_p, min_p) per request, as SGLang stores them (greedy: top_k 1)
        "greedy": [(1.0, 1, 1.0, 0.0)] * bs,
        "t1": [(1.0, off, 1.0, 0.0)] * bs,
        "truncated": [(0.7, 20, 0.9, 0.05)] * bs,
        "mixed": [(1.0, 1, 1.0, 0.0), (0.8, off, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1.3, 30, 0.95, 0.0), (1.0, off, 0.8, 0.0)][:bs],
        "seeded": [(1.0, off, 1.0, 0.0)] * bs,
    }[law]
    t, k, p, m = (list(x) for x in zip(*rows))
    greedy = all(kk == 1 for kk in k)
    info = SamplingBatchInfo(
        temperatures=torch.tensor(t, dtype=torch.float32).view(bs, 1), top_ps=torch.tensor(p),
        top_ks=torch.tensor(k, dtype=torch.int32), min_ps=torch.tensor(m),
        is_all_greedy=greedy, is_any_greedy=any(kk == 1 for kk in k), need_top_p_sampling=any(x < 1 for x in p),
        need_top_k_sampling=any(0 < kk < V for kk in k), need_min_p_sampling=any(x > 0 for x in m), vocab_size=V, device="cpu",
    )  # fmt: skip
    if law == "seeded":
        info.sampling_seed = torch.tensor([11, 12, 13, 14, 15][:bs], dtype=torch.int64)
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(temperature=a, top_k=b, top_p=c, min_p=d)) for a, b, c, d in rows]
    return info, reqs


def _worker(monkeypatch, pending: bool):
    """A worker whose every round is planned as a plain step, on fake pools; its DECODE forward
    returns logits drawn from a generator seeded by the step's positions (so two workers fed
    the same state see the same logits)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

    import sglang_tev.srt.worker as W
    from sglang_tev.srt.kv_headroom import required_row_extra

    req_to_token = torch.arange(BS * 100).view(BS, 100)
    appended = []

    def target_forward(*, batch, forward_batch, is_verify, skip_attn_backend_init=None):
        g = torch.Generator().manual_seed(int(forward_batch.positions.sum()) * 7 + 1)
        logits = 3 * torch.randn(BS, V, generator=g)
        logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # a tie at the argmax: the lowest id wins
        hidden = torch.stack([forward_batch.positions.float(), forward_batch.input_ids.float()], dim=1)
        return SimpleNamespace(logits_output=LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden),
                               can_run_cuda_graph=False)

    def assign_locs(*, req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num, device):
        return torch.cat([req_to_token[req_pool_indices[b], int(start_offset[b]) : int(end_offset[b])] for b in range(batch_size)])

    monkeypatch.setattr(W, "assign_extend_cache_locs_func", assign_locs)
    patch_forward_plumbing(monkeypatch, V)
    translator = FakeTranslator()
    model_runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), kv_index_translator=translator,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: FakeKV(torch.zeros(BS * 100)), page_size=1),
        model=SimpleNamespace(lm_head=torch.nn.Linear(2, V)),
        model_config=SimpleNamespace(context_len=100 - required_row_extra(N, K, 1), dtype=torch.float32),
    )  # fmt: skip
    monkeypatch.setenv("SGLANG_TEV_BUDGET", "auto")
    w = build_tev_worker(monkeypatch, tree_size=N, block_size=K, max_depth=3, topk=2, verifier="tev", model_runner=model_runner,
                         target_forward=target_forward, draft_forward=None, translator=translator,
                         append_draft_kv=lambda **kw: appended.append(kw), seed=3)
    observed = []
    w._served_budget = SimpleNamespace(plan=lambda bs, greedy: SimpleNamespace(budget=0, ragged=False),
                                       observe=lambda plan, *a: observed.append(a), rounds=1)
    w._layout_resolved = True
    if not pending:
        w._draft_kv_pending = None
    return w, appended, observed, make_draft_input_v2


@pytest.mark.parametrize("law", ["greedy", "t1", "truncated", "mixed", "seeded"])
@pytest.mark.parametrize("pending", [True, False])
def test_plain_step_equals_the_root_only_round(monkeypatch, law, pending):
    import sglang_tev.srt.worker as W

    lean, general = _worker(monkeypatch, pending), _worker(monkeypatch, pending)
    monkeypatch.setattr(general[0], "_lean_plain_step_fits", lambda batch: False)
    called = []
    real = W.TEVWorker._plain_step
    monkeypatch.setattr(W.TEVWorker, "_plain_step", lambda self, *a: called.append(self) or real(self, *a))
    info, reqs = _sampling_info(law, BS)
    make = lean[3]
    seq = torch.tensor([5, 9, 3, 12, 7])
    state = {}
    for name, (w, appended, observed, _) in (("lean", lean), ("general", general)):
        batch = SimpleNamespace(
            seq_lens=seq.clone(), seq_lens_cpu=seq.clone(), seq_lens_sum=int(seq.sum()), req_pool_indices=torch.tensor([2, 0, 4, 1, 3]),
            spec_info=make(bonus_tokens=torch.tensor([4, 8, 15, 16, 23]), new_seq_lens=seq.clone()), sampling_info=info,
            forward_mode=SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False), is_extend_in_batch=False,
            has_grammar=False, return_logprob=False, out_cache_loc=None, reqs=reqs,
        )  # fmt: skip
        published, steps, columns = [], [], []
        for _ in range(3):  # three steps: the generator's stream and the held writes carry over
            res = w.forward_batch_generation(batch, on_publish=published.append)
            stride = res.speculative_output_stride or res.speculative_num_draft_tokens
            steps.append(dict(tokens=res.next_token_ids.view(BS, stride)[:, 0].tolist(), stride=stride,
                              accept=res.accept_lens.tolist(), dtype=(res.next_token_ids.dtype, res.accept_lens.dtype),
                              seq=res.new_seq_lens.tolist(), bonus=res.next_draft_input.bonus_tokens.tolist(),
                              info={k: list(v) for k, v in res.logits_output.customized_info.items()},
                              hidden=res.logits_output.hidden_states, n=res.speculative_num_draft_tokens))
            assert res.next_token_ids.data_ptr() != res.next_draft_input.bonus_tokens.data_ptr()
            columns.append(res.logits_output.customized_info["tev_budget"])
            batch.seq_lens, batch.seq_lens_cpu = res.new_seq_lens.clone(), res.new_seq_lens.clone()
            batch.seq_lens_sum = int(batch.seq_lens.sum())
            batch.spec_info = res.next_draft_input
        held = w._draft_kv_pending.take() if pending else None
        assert len({id(c) for c in columns}) == 3  # each round's own columns (the periodic log tracks their reads)
        state[name] = dict(steps=steps, published=[p.tolist() for p in published], observed=observed, gen=w._tev_generator.get_state(),
                           held=held, appended=appended)
    assert called and all(c is lean[0] for c in called) and len(called) == 3
    a, b = state["lean"], state["general"]
    assert a["steps"] == b["steps"] and a["published"] == b["published"] and a["observed"] == b["observed"] == [(None, None)] * 3
    assert torch.equal(a["gen"], b["gen"])  # the same uniforms drawn from the worker's generator
    assert all(s["stride"] == 1 and s["n"] == N and s["hidden"] is None for s in a["steps"])
    assert all(s["info"]["tev_budget"] == [0] * BS and s["info"]["tev_accept_length"] == [1] * BS for s in a["steps"])
    if law == "greedy":  # the argmax, ties to the lowest id
        assert a["steps"][0]["tokens"][1] == 5
    if pending:
        assert a["appended"] == b["appended"] == []
        assert a["held"].keys() == b["held"].keys()
        for k in a["held"]:
            assert torch.equal(a["held"][k], b["held"][k]) and a["held"][k].dtype == b["held"][k].dtype, k
    else:
        assert len(a["appended"]) == len(b["appended"]) == 3
        for x, y in zip(a["appended"], b["appended"]):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


def test_plain_step_left_to_the_round_where_a_tree_is_needed(monkeypatch):
    """Grammar, logprobs, a baseline verifier and a target CUDA graph for the width keep the
    general round (each reads the tree's nodes, or replays a TARGET_VERIFY graph)."""
    w = _worker(monkeypatch, True)[0]
    info, reqs = _sampling_info("t1", BS)
    batch = SimpleNamespace(has_grammar=False, return_logprob=False, sampling_info=info)
    assert w._lean_plain_step_fits(batch)
    for field in ("has_grammar", "return_logprob"):
        assert not w._lean_plain_step_fits(SimpleNamespace(**dict(vars(batch), **{field: True})))
    tev = w.tev
    w.tev = dataclasses.replace(tev, verifier="sequential")
    assert not w._lean_plain_step_fits(batch)
    w.tev = tev
    w.target_worker.model_runner.decode_cuda_graph_runner = object()
    assert not w._lean_plain_step_fits(batch)
