"""Small stand-ins for SGLang's GPU-only KV plumbing, shared by the worker-round tests
(``tests/srt/test_srt_worker.py``, ``tests/srt/test_srt_graphs.py``): a KV index translator whose plan
writes where the worker asked, and a KV pool over a simulated store (each slot holds the token
whose KV it caches), so the worker's KV moves can be checked by what the target later reads."""

from __future__ import annotations


class FakePlan:
    def __init__(self, ids):
        self.ids = ids

    def write_ids(self, translator, **kw):
        return self.ids

    def bind(self, fb, translator):
        fb.bound = True


class FakeTranslator:
    def plan(self, *, req_pool_indices, seq_lens, seq_lens_cpu, write_virtual, read_extent):
        assert write_virtual.numel() == req_pool_indices.numel() * read_extent
        return FakePlan(write_virtual)


class FakeKV:
    def __init__(self, store):
        self.store = store
        self.moves = 0

    def move_kv_cache(self, tgt_loc, src_loc):
        self.store[tgt_loc] = self.store[src_loc].clone()
        self.moves += 1
