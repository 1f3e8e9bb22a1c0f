"""Plain steps' held drafter-KV writes (``sglang_tev/srt/draft_kv.py: PendingDraftKV``) and when the
worker writes them (``TEVWorker._flush_draft_kv``: before a prefill / extend / idle call; before a
draft in ``tests/srt/test_srt_worker.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_tev.srt.draft_kv import PendingDraftKV


def _step(tokens, slots, positions):
    n = len(tokens)
    return (torch.tensor(tokens, dtype=torch.float32).view(n, 1).repeat(1, 3), torch.tensor(slots),
            torch.tensor(positions), torch.ones(n, dtype=torch.int32))


def _apply(write, store):
    """SGLang's prefix-valid writer on a slot -> feature store, one scatter per call (rows whose
    commit length is 0 write nothing)."""
    keep = write["commit_lens"].view(-1) > 0
    store[write["cache_loc_2d"][keep, 0]] = write["target_hidden"][keep, 0].long()


def test_held_steps_come_back_oldest_first_as_one_write_and_are_forgotten():
    held = PendingDraftKV(max_steps=8)
    assert held.take() is None and len(held) == 0
    a = _step([11, 12], [5, 9], [3, 7])
    held.add(*a)
    a[0].fill_(-1)  # the step's buffers are reused: what was held must not change
    held.add(*_step([13, 14], [6, 10], [4, 8]))
    assert len(held) == 2
    w = held.take()
    assert w["target_hidden"][:, 0].tolist() == [11, 12, 13, 14]
    assert w["cache_loc"].tolist() == [5, 9, 6, 10] and w["cache_loc_2d"].shape == (4, 1)
    assert w["positions"].tolist() == [3, 7, 4, 8] and w["commit_lens"].tolist() == [1, 1, 1, 1]
    assert held.take() is None and len(held) == 0


def test_a_later_held_write_to_the_same_slot_supersedes_the_older_one():
    # slot 9 freed after step 1 (its request finished) and given to another request in step 3
    held = PendingDraftKV()
    held.add(*_step([11, 12], [5, 9], [3, 7]))
    held.add(*_step([13], [6], [4]))
    held.add(*_step([14, 21], [7, 9], [5, 0]))
    w = held.take()
    assert w["commit_lens"].tolist() == [1, 0, 1, 1, 1]  # the first write of slot 9 is dropped
    store = torch.full((12,), -1)
    _apply(w, store)
    assert store[[5, 6, 7, 9]].tolist() == [11, 13, 14, 21]


def test_a_held_row_that_writes_nothing_supersedes_nothing():
    held = PendingDraftKV()
    held.add(*_step([11], [5], [3]))
    hidden, slots, positions, _ = _step([12], [5], [4])
    held.add(hidden, slots, positions.to(torch.int32), torch.zeros(1, dtype=torch.int32))
    w = held.take()
    assert w["commit_lens"].tolist() == [1, 0] and w["positions"].dtype == torch.int64
    store = torch.full((8,), -1)
    _apply(w, store)
    assert int(store[5]) == 11  # as writing each step at once would leave it


def test_held_writes_are_refused_where_sglang_copies_the_drafter_pool_itself(monkeypatch):
    from sglang_tev.testing.sglang_cpu.required import require_sglang

    require_sglang()
    import sglang.srt.runtime_context as rc

    from sglang_tev.srt.draft_kv import held_writes_refusal

    plain = SimpleNamespace(lilicorr=None, hicache_draft_plan=SimpleNamespace(mode=SimpleNamespace(value="none")))
    assert held_writes_refusal(plain) is None  # nothing published (no server): nothing copies the pool
    assert "lilicorr" in held_writes_refusal(SimpleNamespace(lilicorr=object()))
    fused = SimpleNamespace(lilicorr=None, hicache_draft_plan=SimpleNamespace(mode=SimpleNamespace(value="fused")))
    assert "HiCache draft plan 'fused'" in held_writes_refusal(fused)
    memory = SimpleNamespace(enable_hierarchical_cache=False, enable_unified_cache_external_linker=False)
    disagg = SimpleNamespace(disaggregation_decode_retraction_backup=None)
    monkeypatch.setattr(rc, "get_memory", lambda: memory)
    monkeypatch.setattr(rc, "get_disagg", lambda: disagg)
    assert held_writes_refusal(plain) is None
    memory.enable_hierarchical_cache = True
    assert "hierarchical KV cache" in held_writes_refusal(plain)
    memory.enable_hierarchical_cache, memory.enable_unified_cache_external_linker = False, True
    assert "hierarchical KV cache" in held_writes_refusal(plain)
    memory.enable_unified_cache_external_linker, disagg.disaggregation_decode_retraction_backup = False, "host_pool"
    assert "retraction" in held_writes_refusal(plain)


def test_full_after_max_steps_or_max_rows():
    held = PendingDraftKV(max_steps=3, max_rows=5)
    held.add(*_step([1, 2], [0, 1], [0, 0]))
    held.add(*_step([3, 4], [2, 3], [1, 1]))
    assert not held.full
    held.add(*_step([5, 6], [4, 5], [2, 2]))  # 3 steps, 6 rows
    assert held.full
    held.take()
    assert not held.full
    rows = PendingDraftKV(max_steps=10, max_rows=4)
    rows.add(*_step([1, 2, 3, 4], [0, 1, 2, 3], [0, 0, 0, 0]))
    assert rows.full


@pytest.mark.parametrize("kw", [{"max_steps": 0}, {"max_steps": True}, {"max_steps": 1.5}, {"max_rows": 0}])
def test_bad_limits_are_refused_by_name(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        PendingDraftKV(**kw)


def test_a_step_without_one_row_per_request_is_refused_and_nothing_is_held():
    held = PendingDraftKV()
    hidden, slots, positions, lens = _step([1, 2], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="one row per request"):
        held.add(hidden, slots[:1], positions, lens)
    with pytest.raises(ValueError, match="one row per request"):
        held.add(hidden.view(-1), slots, positions, lens)
    assert len(held) == 0 and held.take() is None


def test_a_prefill_or_idle_call_writes_the_held_steps_before_sglangs_branch_runs(monkeypatch):
    from sglang_tev.testing.sglang_cpu.required import require_sglang

    require_sglang()
    import sglang_tev.srt.worker as W

    calls = []
    monkeypatch.setattr(W.DFlashWorkerV2, "forward_batch_generation",
                        lambda self, batch, *a: calls.append(("sglang", len(self._draft_kv_pending))) or "prefilled")
    w = object.__new__(W.TEVWorker)
    w._draft_kv_pending = PendingDraftKV()
    w._append_target_hidden_to_draft_kv_by_loc = lambda **kw: calls.append(("write", kw["cache_loc"].tolist()))
    mode = lambda extend=False, idle=False: SimpleNamespace(is_extend=lambda: extend, is_idle=lambda: idle)  # noqa: E731
    for batch in (SimpleNamespace(forward_mode=mode(extend=True), is_extend_in_batch=False),
                  SimpleNamespace(forward_mode=mode(), is_extend_in_batch=True),
                  SimpleNamespace(forward_mode=mode(idle=True), is_extend_in_batch=False)):
        calls.clear()
        w._draft_kv_pending.add(*_step([1, 2], [4, 5], [0, 0]))
        assert w.forward_batch_generation(batch) == "prefilled"
        assert calls == [("write", [4, 5]), ("sglang", 0)]
    calls.clear()
    assert w.forward_batch_generation(SimpleNamespace(forward_mode=mode(extend=True), is_extend_in_batch=False)) == "prefilled"
    assert calls == [("sglang", 0)]  # nothing held: no write
