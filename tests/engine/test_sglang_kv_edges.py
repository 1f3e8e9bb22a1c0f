"""No request may take a TEV server down: the context-length edge and the KV-pressure paths, on
SGLang 0.5.23's real Engine on this CPU (issue 25, items 1-2).

Every decode step of the DFlash family reserves 2N KV slots past a request's committed length,
while SGLang sizes a ``req_to_token`` row as ``context_len + 4 + N`` at page size 1; before
``sglang_tev.srt.kv_headroom`` a request running into the last ``N - 4`` positions of the context
overran its row and the scheduler died (every request in flight lost). Here the end position of
greedy ``ignore_eos`` requests is swept over the last ``2N + 8`` tokens of a 256-token context for
N = 9, 17 and 65; each output must equal SGLang's plain decoding (up to bf16 near-ties, the rule of
``test_sglang_engine``), every round must stay inside the context (a shallower tree near the end),
and the Engine must serve the next request.

The N = 65 Engine runs with a small KV pool and small prefill chunks, so the same sweep and the
pressure tests below go through retraction and re-admission mid-decode, chunked prefill of prompts
that end at the context limit, radix-cache eviction, and requests that finish inside an accepted
block while others continue.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from sglang_tev.testing.sglang_cpu.hosts import plain_kwargs, require_sglang, tev_kwargs

require_sglang()

from engine_checks import assert_same_ids, ids_of

CONTEXT = 256
"""The Engines' context length (``context_length``): a small one keeps the sweep fast."""
SWEEP_SIZES = (9, 17, 65)
PRESSURE_N = 65
PRESSURE = dict(max_total_tokens=1024, chunked_prefill_size=64)
"""The N = 65 Engine's pool: ~2 full-context requests plus their 2N reserve, so a batch of long
requests cannot all stay resident; prefill chunks of 64 tokens split every prompt of the sweep."""


# ---------------------------------------------------------------------- requests
@pytest.fixture(scope="module")
def corpus(tokenizer):
    """Token ids of some standard-library source: prompts are windows of it."""
    import argparse
    import textwrap

    text = inspect.getsource(textwrap) + inspect.getsource(argparse)
    ids = tokenizer(text).input_ids
    assert len(ids) > 8 * CONTEXT
    return ids


def sweep_requests(corpus, n):
    """(prompt ids, sampling params) whose end (prompt + max_new_tokens) runs over every position
    of the last 2N + 8 tokens of the context, with 8-24 new tokens each."""
    reqs = []
    for i, end in enumerate(range(CONTEXT - 2 * n - 8, CONTEXT + 1)):
        m = 8 + (5 * i) % 17
        off = (97 * i + 13 * n) % (len(corpus) - CONTEXT)
        reqs.append((corpus[off : off + end - m], {"temperature": 0, "max_new_tokens": m, "ignore_eos": True}))
    return reqs


def pressure_requests(corpus, tokenizer):
    """Named request sets for the pressure Engine (all greedy):

    * ``long``: 20 concurrent requests of 60-120 prompt tokens and 90-130 new ones (up to the
      context end), more than the pool holds with their reserve: SGLang retracts some mid-decode
      and re-admits them later;
    * ``chunked``: prompts of 200-245 tokens (4 prefill chunks) ending exactly at the context;
    * ``radix``: 12 prompts sharing a 150-token prefix (radix hits), sent after the others have
      filled the pool (evictions);
    * ``finishing``: max_new_tokens 1-5 and stop ids taken from plain decoding, mixed with long
      requests, so requests finish inside an accepted block while their batch goes on.
    """
    out = {"long": [], "chunked": [], "radix": [], "finishing": []}
    for i in range(20):
        p = 60 + (7 * i) % 61
        m = min(CONTEXT - p, 90 + (11 * i) % 41)
        off = 31 * i
        out["long"].append((corpus[off : off + p], {"temperature": 0, "max_new_tokens": m, "ignore_eos": True}))
    for i in range(6):
        p = 200 + 9 * i  # SGLang accepts prompts of at most context - 7 tokens
        off = 1000 + 53 * i
        out["chunked"].append((corpus[off : off + p], {"temperature": 0, "max_new_tokens": CONTEXT - p, "ignore_eos": True}))
    head = corpus[2000:2150]
    for i in range(12):
        tail = corpus[2200 + 17 * i : 2200 + 17 * i + 5 + i]
        out["radix"].append((head + tail, {"temperature": 0, "max_new_tokens": 24 + i, "ignore_eos": True}))
    for i in range(12):
        off = 3000 + 41 * i
        prompt = corpus[off : off + 40 + 3 * i]
        if i % 3 == 0:
            sp = {"temperature": 0, "max_new_tokens": 1 + i % 5}
        elif i % 3 == 1:
            sp = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
        else:
            sp = {"temperature": 0, "max_new_tokens": 48}  # a stop id is added from plain decoding
        out["finishing"].append((prompt, sp))
    return out


# ---------------------------------------------------------------------- engines and references
def _generate(eng, reqs):
    return eng.generate([list(p) for p, _ in reqs], [dict(sp) for _, sp in reqs])


@pytest.fixture(scope="module")
def plain(hosts, corpus, tokenizer):
    """SGLang's plain decoding of every request of this module, from one Engine then closed:
    {"sweep": {n: results}, "pressure": {name: (requests, results)}}."""
    eng = hosts.get("plain", plain_kwargs(context_length=CONTEXT))
    sweep = {n: _generate(eng, sweep_requests(corpus, n)) for n in SWEEP_SIZES}
    sets = pressure_requests(corpus, tokenizer)
    first = _generate(eng, sets["finishing"])
    for (prompt, sp), res in zip(sets["finishing"], first):
        if "ignore_eos" not in sp and sp["max_new_tokens"] > 5 and len(res["output_ids"]) > 12:
            sp["stop_token_ids"] = [res["output_ids"][11]]  # stops inside some accepted block
    pressure = {name: (reqs, _generate(eng, reqs)) for name, reqs in sets.items()}
    hosts.close("plain")
    return {"sweep": sweep, "pressure": pressure}


def _engine(hosts, n):
    """The TEV Engine of tree size n (ctx 256); N = 65 is the pressure Engine. One alive at a time."""
    name = f"tev{n}"
    for other in list(hosts.hosts):
        if other != name:
            hosts.close(other)
    extra = dict(PRESSURE) if n == PRESSURE_N else {}
    return hosts.get(name, tev_kwargs(n, attention_backend="tev_cpu", context_length=CONTEXT, **extra))


def _log(eng) -> str:
    return Path(eng.log.name).read_text(errors="replace")


def assert_healthy(eng, hf_model, corpus):
    """The Engine is alive, its scheduler never raised, SGLang's idle leak check never fired, and
    it serves an ordinary request."""
    assert eng.proc.poll() is None, eng.tail()
    log = _log(eng)
    assert "Scheduler hit an exception" not in log and "memory leak detected" not in log, eng.tail()
    prompt = corpus[:20]
    out = eng.generate([prompt], [{"temperature": 0, "max_new_tokens": 16}])
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=0)[0, 20:]
    assert_same_ids(ids_of(out), [want.tolist()], [prompt], hf_model, "the request after")


def assert_rounds_inside_context(prompt_len, out, what):
    """Round k (root at committed length c_k) emits at most ``CONTEXT - c_k`` tokens: its tree has
    no node at a position past the context (root-only at the last position)."""
    meta = out["meta_info"]
    # every round comes back (the plugin keeps SGLang's per-token slicing from dropping rounds
    # after a send: these requests pass 50 and 100 output tokens), one value per key per round
    assert len(meta["tev_accept_length"]) == meta["spec_verify_ct"], what
    assert all(len(meta[k]) == meta["spec_verify_ct"] for k in ("tev_exit_depth", "tev_coverage", "tev_budget")), what
    assert 1 + sum(meta["tev_accept_length"]) >= len(out["output_ids"]), what  # the last round may be cut
    c = prompt_len
    for r in meta["tev_accept_length"]:
        assert 1 <= r <= CONTEXT - c, f"{what}: a round at committed length {c} emitted {r} tokens"
        c += r


# ---------------------------------------------------------------------- 1. the context edge
@pytest.mark.parametrize("n", SWEEP_SIZES)
def test_context_edge_sweep_equals_plain_decoding(hosts, plain, corpus, hf_model, n):
    """Ends swept over the last 2N + 8 positions of the context: every request accepted, decoded
    to its end with plain decoding's tokens, every round inside the context, the Engine alive."""
    reqs = sweep_requests(corpus, n)
    eng = _engine(hosts, n)
    out = _generate(eng, reqs)
    want = plain["sweep"][n]
    for (prompt, sp), o, w in zip(reqs, out, want):
        # SGLang itself stops a request one or two tokens short of the context (its max_req_len is
        # context - 1): TEV must stop where plain decoding stops
        assert len(o["output_ids"]) == len(w["output_ids"]) >= sp["max_new_tokens"] - 2, (len(prompt), sp)
        assert o["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], (len(prompt), sp)
    prompts = [p for p, _ in reqs]
    assert_same_ids(ids_of(out), ids_of(want), prompts, hf_model, f"TEV N={n} at the context edge vs plain")
    if n != PRESSURE_N:  # retraction re-prefills, which starts rounds at other positions
        for (prompt, _), o in zip(reqs, out):
            assert_rounds_inside_context(len(prompt), o, f"N={n}, prompt {len(prompt)}")
        # the sweep really built depth-capped trees: rounds rooted within the drafter's depth
        # (block 16 - 1) of the context's end
        roots = [len(p) + sum(o["meta_info"]["tev_accept_length"][:k]) for (p, _), o in zip(reqs, out) for k in range(len(o["meta_info"]["tev_accept_length"]))]
        assert sum(CONTEXT - 1 - c < 15 for c in roots) >= 10
    assert_healthy(eng, hf_model, corpus)


# ---------------------------------------------------------------------- 2. KV pressure
def test_pool_pressure_retracts_and_readmits_with_plain_decodings_tokens(hosts, plain, corpus, hf_model):
    """More long requests than the pool holds: SGLang retracts some mid-decode (its own warning
    says so) and re-admits them; with chunked prefill at the context limit in the same burst.
    Outputs equal plain decoding, the Engine stays healthy and leaks nothing."""
    eng = _engine(hosts, PRESSURE_N)
    reqs, want = [], []
    for name in ("long", "chunked"):
        r, w = plain["pressure"][name]
        reqs += r
        want += w
    out = _generate(eng, reqs)
    assert "KV cache pool is full. Retract requests." in _log(eng), "no retraction happened: the test lost its point"
    assert [len(o["output_ids"]) for o in out] == [len(w["output_ids"]) for w in want]
    assert_same_ids(ids_of(out), ids_of(want), [p for p, _ in reqs], hf_model, "TEV under pool pressure vs plain")
    assert_healthy(eng, hf_model, corpus)


def test_radix_eviction_and_requests_finishing_inside_a_block(hosts, plain, corpus, hf_model):
    """A shared-prefix group (radix hits) sent while the pool is full of other requests (their
    cached prefixes are evicted), together with requests that stop after 1-5 tokens or at a stop
    id inside an accepted block while long ones go on: plain decoding's tokens, finish reasons
    and lengths."""
    eng = _engine(hosts, PRESSURE_N)
    reqs, want = [], []
    for name in ("long", "radix", "finishing"):
        r, w = plain["pressure"][name]
        reqs += r
        want += w
    out = _generate(eng, reqs)
    assert_same_ids(ids_of(out), ids_of(want), [p for p, _ in reqs], hf_model, "TEV radix + finishing vs plain")
    for (prompt, sp), o, w in zip(reqs, out, want):
        if o["output_ids"] == w["output_ids"]:
            assert o["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], sp
    n_long = len(plain["pressure"]["long"][0])
    radix = out[n_long : n_long + len(plain["pressure"]["radix"][0])]
    assert max(o["meta_info"].get("cached_tokens", 0) for o in radix) >= 100, "the shared prefix never hit the radix cache"
    stops = [o for (_, sp), o in zip(reqs, out) if "stop_token_ids" in sp]
    assert stops and all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in stops)
    assert_healthy(eng, hf_model, corpus)
