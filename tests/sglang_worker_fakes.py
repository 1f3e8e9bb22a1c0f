"""Small stand-ins for SGLang's GPU-only KV plumbing, shared by the worker-round tests
(``tests/srt/test_srt_worker.py``, ``tests/srt/test_srt_graphs.py``): a KV index translator whose plan
writes where the worker asked, and a KV pool over a simulated store (each slot holds the token
whose KV it caches), so the worker's KV moves can be checked by what the target later reads."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class FakePlan:
    def __init__(self, ids):
        self.ids = ids

    def write_ids(self, translator, **kw):
        return self.ids

    def bind(self, fb, translator):
        fb.bound = True


class FakeTranslator:
    def plan(self, *, req_pool_indices, seq_lens, seq_lens_cpu, write_virtual, read_extent):
        # a verify or draft block reads its window past seq_lens; a DECODE forward's seq_lens
        # already count its one token (read_extent 0, as SGLang's window_read_extent says)
        window = read_extent if read_extent else 1
        assert write_virtual.numel() == req_pool_indices.numel() * window
        self.last_plan = SimpleNamespace(seq_lens=seq_lens.clone(), seq_lens_cpu=seq_lens_cpu.clone(),
                                         read_extent=read_extent)
        return FakePlan(write_virtual)


class FakeKV:
    def __init__(self, store):
        self.store = store
        self.moves = 0

    def move_kv_cache(self, tgt_loc, src_loc):
        self.store[tgt_loc] = self.store[src_loc].clone()
        self.moves += 1


class FakeDraftModel(torch.nn.Module):
    """What ``TEVWorker.__init__`` reads of SGLang's draft model: its modules and ``set_block_size``."""

    def __init__(self):
        super().__init__()
        self.block_size = None

    def set_block_size(self, k):
        self.block_size = k


def build_tev_worker(monkeypatch, *, tree_size, block_size, max_depth, topk, verifier, model_runner,
                     target_forward, draft_forward, translator, append_draft_kv=None, seed=0, attention_backend=None):
    """A ``TEVWorker`` built through its own ``__init__``, with SGLang's constructor replaced by one
    that sets only what ``DFlashWorkerV2.__init__`` would (``dflash_worker_v2.py``: device, mask
    token, embeddings, the target and draft runners, the TP sync), so the worker's start-up code runs
    for real: the settings from the published server args and ``SGLANG_TEV_*`` variables, the block
    offsets, the seeded generator, the drafter's serving mode (a plain DFlash drafter)."""
    import sglang_tev.srt.worker as W

    spec = SimpleNamespace(speculative_num_draft_tokens=tree_size, speculative_dflash_block_size=block_size,
                           speculative_num_steps=max_depth)
    monkeypatch.setenv("SGLANG_TEV_TOPK", str(topk))
    monkeypatch.setenv("SGLANG_TEV_VERIFIER", verifier)
    monkeypatch.setattr(W, "get_spec", lambda: spec)
    monkeypatch.setattr(W, "get_parallel", lambda: SimpleNamespace(tp_rank=0))
    monkeypatch.setattr(W, "parse_dflash_draft_config", lambda draft_hf_config: SimpleNamespace())

    def sglang_init(self, server_args, gpu_id, nccl_port, target_worker):
        self.device = "cpu"
        self._mask_token_id = 1
        self._noise_embed_scale, self._full_embed_gpu, self._target_logits_processor = 1.0, None, None
        self.draft_parallel_layout = SimpleNamespace(tp_group=None)
        self.draft_model = FakeDraftModel()
        self._target_worker = target_worker  # BaseSpecWorker.target_worker reads it
        self.model_runner = target_worker.model_runner
        self.draft_model_runner = SimpleNamespace(forward=draft_forward, kv_index_translator=translator,
                                                  model_config=SimpleNamespace(hf_config=SimpleNamespace()))
        self._append_target_hidden_to_draft_kv_by_loc = append_draft_kv or (lambda **kw: None)
        # a one-rank TP sync that is on: the round adopts "rank 0's" decision through it (identity here)
        self._tp_sync = SimpleNamespace(enabled=lambda site: True, sync=lambda site, t: t)

    monkeypatch.setattr(W.DFlashWorkerV2, "__init__", sglang_init)
    target_worker = SimpleNamespace(model_runner=model_runner, forward_batch_generation=target_forward)
    if attention_backend is not None:  # the layout is read from the target's backend object (its type only)
        model_runner.attn_backend = object.__new__(attention_backend)
    w = W.TEVWorker(SimpleNamespace(random_seed=seed), 0, 0, target_worker)
    assert w.draft_model.block_size == block_size and w._tev_draft.mode == "marginal"
    return w


def patch_forward_plumbing(monkeypatch, vocab: int, candidate_topk=None) -> None:
    """SGLang's GPU-only forward plumbing replaced in the worker's modules (``worker.py`` runs the
    verify and DECODE forwards, ``draft_block.py`` the draft block): ``ForwardBatch`` as a plain
    namespace, no token-count tensor (it reads the published parallel config), a small embedding
    for the draft block, and ``candidate_topk`` (the drafter's head) when given."""
    import sglang_tev.srt.draft_block as D
    import sglang_tev.srt.worker as W

    for mod in (W, D):
        monkeypatch.setattr(mod, "ForwardBatch", lambda **kw: SimpleNamespace(**kw))
        monkeypatch.setattr(mod, "enable_num_token_non_padded", lambda: False)
    monkeypatch.setattr(D, "_resolve_dflash_embedding_module", lambda draft, tgt: torch.nn.Embedding(vocab, 4))
    if candidate_topk is not None:
        monkeypatch.setattr(D, "candidate_topk", candidate_topk)
