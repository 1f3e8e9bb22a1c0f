"""SGLang 0.5.23's own DFLASH (chain drafts, block 16) on the real CPU Engine with the CPU harness.

DFLASH is the reference TEV is compared with (``benchmarks/sglang_cpu_side_by_side.py``), so it
has to serve here too: SGLang's ``DFlashWorkerV2`` with the shipped drafter, ``tev_cpu``
attention, the harness's stand-ins (``sglang_tev/testing/sglang_cpu/harness.py``). One Engine.

Reference: HF ``generate(do_sample=False)`` of the same target in bf16, as in
``tests/engine/test_sglang_engine.py`` (whose plain-decoding Engine equals it up to bf16 near-ties);
that avoids a second Engine start.
"""

from __future__ import annotations


from sglang_tev.testing.sglang_cpu.hosts import EngineHost, dflash_kwargs, require_sglang

require_sglang()

from engine_checks import MAX_NEW, assert_same_ids, greedy_params, ids_of  # noqa: E402


def test_dflash_greedy_batch_equals_plain_and_accepts_drafts(prompt_ids, hf_greedy, hf_model):
    host = EngineHost(dflash_kwargs())
    try:
        out = host.generate(prompt_ids, greedy_params(MAX_NEW))
    finally:
        host.close()
    assert_same_ids(ids_of(out), hf_greedy, prompt_ids, hf_model, "SGLang DFLASH vs HF generate (= plain decoding)")
    metas = [o["meta_info"] for o in out]
    for o, m in zip(out, metas):
        assert m["completion_tokens"] == len(o["output_ids"])
        # SGLang's count: one verify round per decode step after the prefill's token
        assert m["spec_verify_ct"] >= 1, m
        # the histogram counts rounds by accepted drafts: it adds up to the rounds and the drafts
        hist = m.get("spec_correct_drafts_histogram") or []
        assert sum(hist) == m["spec_verify_ct"], m
        assert sum(k * c for k, c in enumerate(hist)) == m["spec_num_correct_drafts"], m
    verify = sum(m["spec_verify_ct"] for m in metas)
    tokens = sum(m["completion_tokens"] for m in metas)
    per_round = 1 + sum(m["spec_num_correct_drafts"] for m in metas) / verify
    assert tokens / verify > 1.0 and per_round > 1.2, (tokens / verify, per_round)
    assert max(m["spec_accept_length"] for m in metas) > 1.5
