"""SGLang 0.5.23's HTTP server serving TEV on this CPU: ``python -m sglang.launch_server
--speculative-algorithm TEV`` on 127.0.0.1 (issue 16, "HTTP" and "audit" bullets).

Two servers per module, started once and concurrently (``sglang_tev/testing/sglang_cpu/hosts.py``): TEV at
N = 17 and SGLang's plain decoding, both bf16 with ``--attention-backend tev_cpu`` and SGLang's
built-in ``chatml`` chat template (the tiny target has none). References: HF
``generate(do_sample=False)`` of the same target in bf16 (tokens), and the plain server (what SGLang
itself serves without speculation: logprobs, grammars, logit bias, penalties).

Token comparisons use the near-tie rule of ``test_sglang_engine``: the ids are equal, or they first
differ where the two tokens' bf16 target logits are within ``TIE`` of each other.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sglang_tev.testing.sglang_cpu.hosts import TARGET, ServerHost, plain_kwargs, require_sglang, tev_kwargs

require_sglang()

from engine_checks import PROMPTS, assert_matches_hf, assert_same_ids
from sglang_tev.testing.sglang_cpu.hosts import first_divergence

TREE_SIZE = 17
CHAT_TEMPLATE = "chatml"
CHATML = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""The prompt SGLang's ``chatml`` template (``srt/parser/conversation.py``) builds for one user turn."""

EAGER = {"TORCHDYNAMO_DISABLE": "1"}
"""Environment of the servers whose logprobs are compared: the same eager functions on both."""
PLAIN_STEP_TOL = 0.07
"""Largest |logprob(TEV's plain step) - logprob(SGLang's plain decoding)| of one token: the same
DECODE forward, bitwise equal on this VM (AVX-512 with bf16); another CPU may round one bf16 logit
(|logit| <= ~17, one step 0.0625) differently in the two servers' set-ups. A wrong temperature,
penalty or row moves logprobs by far more."""
SERVED = [(0, 32), (2, 24), (4, 32), (7, 16)]
"""(index into PROMPTS, max_new_tokens) for the endpoint tests."""
CHATS = ["def f(x):", "Write a function that reverses a list."]
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
"""A request that runs for many rounds (to disconnect from or abort mid-way)."""
LOGPROB_TOL = 0.2
"""Largest |logprob(TEV) - logprob(plain)|. Both are log-softmaxes of the target's bf16 logits (|logit|
<= ~17 here, where one bf16 step is 0.0625), from a tree-verify forward vs a decode forward, which
round differently: measured up to 0.124 (two steps) over 8 prompts x 32 tokens x top-5, and up to
0.046 on the emitted tokens; plain decoding's values equal HF's bf16 log-softmax there."""


# ---------------------------------------------------------------------- servers and references
@pytest.fixture(scope="module")
def servers():
    """{"tev": ServerHost, "plain": ServerHost}, started concurrently (each ~60-90 s here)."""
    common = dict(chat_template=CHAT_TEMPLATE)
    with ThreadPoolExecutor(2) as ex:
        futures = {
            # metrics: the abort counter shows that a client's disconnect aborted its request
            "tev": ex.submit(ServerHost, tev_kwargs(TREE_SIZE, enable_metrics=True, **common)),
            # the reference without overlap scheduling: SGLang's plain decoding under overlap
            # applies penalties one step late (see tests/engine/test_sglang_penalties.py, plain_refs)
            # eager (as test_sglang_penalties.py): SGLang's repetition scaling is torch.compile'd, and
            # inductor's CPU code differs by ISA (with ATEN_CPU_CAPABILITY=avx2 its penalised law
            # moved by up to 1.1 nats here while the eager function did not)
            "plain": ex.submit(ServerHost, plain_kwargs(disable_overlap_schedule=True, **common), env=EAGER),
        }
        hosts, errors = {}, []
        for name, f in futures.items():
            try:
                hosts[name] = f.result()
            except Exception as e:  # close whatever started before failing
                errors.append(f"{name}: {e}")
    if errors:
        for h in hosts.values():
            h.close()
        raise RuntimeError("server start failed:\n" + "\n".join(errors))
    yield hosts
    for h in hosts.values():
        h.close()


@pytest.fixture(scope="module")
def tev(servers):
    return servers["tev"]


@pytest.fixture(scope="module")
def plain(servers):
    return servers["plain"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """``fn(prompt_ids, max_new) -> ids``: HF greedy decoding in bf16, one prompt at a time, cached."""
    cache = {}

    def run(ids, n):
        key = (tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                y = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0)
            cache[key] = y[0, len(ids) :].tolist()
        return cache[key]

    return run


# ---------------------------------------------------------------------- helpers
def run_all(*calls):
    """Run zero-argument callables concurrently; their results, in order."""
    with ThreadPoolExecutor(max(1, min(8, len(calls)))) as ex:
        return [f.result() for f in [ex.submit(c) for c in calls]]


def ok(server, path, body, timeout=300.0):
    """POST that must answer 200; the parsed JSON."""
    status, out = server.post(path, body, timeout=timeout)
    assert status == 200, f"{path} {json.dumps(body)[:300]} -> {status}: {str(out)[:500]}\nserver log:\n{server.tail()}"
    return out


def greedy(text, max_new, **extra):
    """A ``/generate`` body: greedy, ``max_new`` new tokens, more sampling params in ``extra``."""
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, **extra}}


def completion(prompt, max_tokens, temperature=0.0, **extra):
    """A ``/v1/completions`` body."""
    return {"model": "tev", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **extra}


def chat_request(content, max_tokens, temperature=0.0, **extra):
    """A ``/v1/chat/completions`` body with one user turn."""
    messages = [{"role": "user", "content": content}]
    return {"model": "tev", "messages": messages, "max_tokens": max_tokens, "temperature": temperature, **extra}


def loads(server) -> dict:
    """SGLang's own scheduler load report (``GET /v1/loads``, dp rank 0): ``num_used_tokens`` is
    ``max_total_num_tokens - (available + evictable)`` of the KV allocator and radix cache
    (``managers/scheduler_components/pool_stats_observer.py`` ``_get_token_info``)."""
    status, text = server.get("/v1/loads")
    assert status == 200, text
    return json.loads(text)["loads"][0]


def aborted_total(server) -> float:
    """SGLang's ``sglang:num_aborted_requests_total`` (``GET /metrics``): aborts the tokenizer
    manager sent to the scheduler for a live request (``TokenizerManager.abort_request``)."""
    status, text = server.get("/metrics")
    assert status == 200, text[:300]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sglang:num_aborted_requests_total"))


def wait_for(what, fn, timeout=60.0, server=None):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s\n{server.tail() if server else ''}"
        time.sleep(0.2)


def wait_idle(server, timeout=180.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = loads(server)
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            return state
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {state}\n{server.tail()}"
        time.sleep(0.3)


def wait_running(server, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = loads(server)
        if state["num_running_reqs"] >= 1:
            return state
        assert time.monotonic() < deadline, f"no request running after {timeout} s\n{server.tail()}"
        time.sleep(0.05)


def abort_until_done(server, rid, fut, timeout=300.0):
    """``POST /abort_request`` for ``rid`` until the request's own call returns (an abort that
    arrives before the request is registered is a no-op); that call's (status, body)."""
    deadline = time.monotonic() + timeout
    while not fut.done():
        status, body = server.post("/abort_request", {"rid": rid})
        assert status == 200, body
        assert time.monotonic() < deadline, f"request {rid} not aborted in {timeout} s\n{server.tail()}"
        time.sleep(0.2)
    return fut.result()


def assert_serves_reference(server, k, tokenizer, hf_model, hf_greedy):
    """``server`` answers ``SERVED[k]`` greedily with HF's tokens (near-tie rule)."""
    i, n = SERVED[k]
    ids = tokenizer(PROMPTS[i]).input_ids
    got = ok(server, "/generate", greedy(PROMPTS[i], n))["output_ids"]
    assert_matches_hf([got], [hf_greedy(ids, n)], [ids], hf_model, f"next request (prompt {i})")


def assert_alive(server):
    assert server.proc.poll() is None, f"server exited ({server.proc.returncode}):\n{server.tail()}"
    assert server.get("/health_generate", timeout=60)[0] == 200, server.tail()


def error_message(out) -> str:
    """SGLang's error text from a 400 body: ``{"error": {"message": ...}}`` (native routes) or
    ``{"object": "error", "message": ...}`` (OpenAI routes)."""
    if isinstance(out, dict):
        if isinstance(out.get("error"), dict):
            return str(out["error"].get("message"))
        if "message" in out:
            return str(out["message"])
    return str(out)


def assert_equal_or_tie(got, want, prompt_ids, model, what):
    """``got`` equals ``want`` up to bf16 near-tie swaps (the engine tests' rule, any number of
    prompts: neither side is HF, and a grammar may have masked HF's argmax)."""
    assert_same_ids(got, want, prompt_ids, model, what, max_flips=len(got))


def completion_text(events) -> str:
    return "".join(c.get("text") or "" for e in events for c in e.get("choices", []))


def chat_text(events) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices", []))


# ---------------------------------------------------------------------- 1. endpoints, greedy
def test_endpoints_serve_the_hf_greedy_tokens_streamed_and_not(tev, tokenizer, hf_model, hf_greedy):
    calls = []
    for i, n in SERVED:
        p = PROMPTS[i]
        body = greedy(p, n)
        oai = completion(p, n)
        calls += [
            lambda b=body: ok(tev, "/generate", b),
            lambda b=body: tev.stream("/generate", b),
            lambda b=oai: ok(tev, "/v1/completions", b),
            lambda b=oai: tev.stream("/v1/completions", b),
        ]
    for c in CHATS:
        chat = chat_request(c, 24)
        calls += [
            lambda b=chat: ok(tev, "/v1/chat/completions", b),
            lambda b=chat: tev.stream("/v1/chat/completions", b),
            lambda c=c: ok(tev, "/generate", greedy(CHATML.format(c), 24)),
        ]
    out = run_all(*calls)
    block, rest = out[: 4 * len(SERVED)], out[4 * len(SERVED) :]
    gen, gen_stream, comp, comp_stream = block[0::4], block[1::4], block[2::4], block[3::4]

    prompt_ids = [tokenizer(PROMPTS[i]).input_ids for i, _ in SERVED]
    want = [hf_greedy(ids, n) for ids, (_, n) in zip(prompt_ids, SERVED)]
    got = [g["output_ids"] for g in gen]
    assert [g["meta_info"]["prompt_tokens"] for g in gen] == [len(x) for x in prompt_ids]
    assert_matches_hf(got, want, prompt_ids, hf_model, "/generate (TEV) vs HF")
    rounds = [g["meta_info"]["tev_accept_length"] for g in gen]
    assert max(max(r) for r in rounds) >= 2, rounds  # TEV's decode rounds served these (drafts accepted)

    for k, (i, n) in enumerate(SERVED):
        g, gs, c, cs = gen[k], gen_stream[k], comp[k], comp_stream[k]
        # /generate streams cumulative text and ids: the last event is the whole answer
        assert len(gs) >= 2, f"prompt {i}: one stream event only"
        assert gs[-1]["output_ids"] == g["output_ids"] and gs[-1]["text"] == g["text"], i
        assert gs[-1]["meta_info"]["finish_reason"] == g["meta_info"]["finish_reason"], i
        # one value per verify round, streamed or not (the plugin's meta_info hooks)
        for m in (g["meta_info"], gs[-1]["meta_info"]):
            assert len(m["tev_accept_length"]) == len(m["tev_budget"]) == m["spec_verify_ct"] >= 1, (i, m)
            assert max(m["tev_budget"]) == TREE_SIZE - 1 and min(m["tev_budget"]) >= 0, (i, m["tev_budget"])
        # OpenAI completions: same text, same token count, streamed deltas add up to it
        choice = c["choices"][0]
        assert choice["text"] == g["text"], i
        assert c["usage"]["completion_tokens"] == len(g["output_ids"]), i
        assert completion_text(cs) == choice["text"], i
        reasons = [ch["finish_reason"] for e in cs for ch in e.get("choices", []) if ch.get("finish_reason")]
        assert reasons == [choice["finish_reason"]], i

    chat_ids = [tokenizer(CHATML.format(c)).input_ids for c in CHATS]
    for k, c in enumerate(CHATS):
        ch, chs, g = rest[3 * k : 3 * k + 3]
        assert ch["usage"]["prompt_tokens"] == len(chat_ids[k]) == g["meta_info"]["prompt_tokens"]
        content = ch["choices"][0]["message"]["content"]
        assert content == g["text"], c
        assert chat_text(chs) == content, c
        assert ch["usage"]["completion_tokens"] == len(g["output_ids"])
    chat_got = [rest[3 * k + 2]["output_ids"] for k in range(len(CHATS))]
    assert_matches_hf(chat_got, [hf_greedy(ids, 24) for ids in chat_ids], chat_ids, hf_model, "chat (TEV) vs HF")
    assert_alive(tev)


# ---------------------------------------------------------------------- 2. disconnect, abort
def test_client_disconnect_and_abort_leave_the_server_healthy(tev, tokenizer, hf_model, hf_greedy):
    """A streaming client that closes its connection after two events, and ``POST /abort_request``
    with a running request's ``rid``: SGLang aborts each (its abort counter moves by one, the aborted
    call ends with finish_reason ``abort``), the server goes idle, stays healthy and answers the
    next request with the right tokens."""
    body = {"text": PROMPTS[0], "sampling_params": LONG}
    aborts = aborted_total(tev)
    events = tev.stream("/generate", body, stop_after=2)  # the client goes away mid-stream
    assert len(events) == 2 and events[-1]["meta_info"]["finish_reason"] is None
    # SGLang aborts the request of a client that went away (counted only for a live request)
    wait_for("abort after the disconnect", lambda: aborted_total(tev) == aborts + 1, server=tev)
    wait_idle(tev)

    rid = f"tev-abort-{uuid.uuid4().hex}"
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(tev.post, "/generate", dict(body, rid=rid))
        running = wait_running(tev)
        # the reading the leak test relies on sees a live request's KV slots
        assert running["num_used_tokens"] > 0, running
        aborts = aborted_total(tev)
        status, out = abort_until_done(tev, rid, fut)
    assert status == 200, out
    assert aborted_total(tev) == aborts + 1
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta["finish_reason"]
    assert meta["completion_tokens"] < LONG["max_new_tokens"]
    wait_idle(tev)
    assert_alive(tev)
    assert_serves_reference(tev, 0, tokenizer, hf_model, hf_greedy)


# ---------------------------------------------------------------------- 3. invalid sampling parameters
INVALID = [
    ({"temperature": -1}, "temperature must be a non-negative finite number"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1"),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
    ({"min_p": 2}, "min_p must be in [0, 1]"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias must has keys in [0, "),
]
INVALID_OPENAI = [
    ({"temperature": -1}, "temperature must be a non-negative finite number"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
]


def test_invalid_sampling_parameters_get_http_400_and_the_server_answers_next(tev, tokenizer, hf_model, hf_greedy):
    """Out-of-range sampling parameters, on the native and the OpenAI routes: HTTP 400 with
    SGLang's own message (``SamplingParams.verify``); the server answers the next request."""
    calls = [lambda sp=sp: tev.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, **sp}}) for sp, _ in INVALID]
    calls += [lambda sp=sp: tev.post("/v1/completions", {**completion("x", 4), **sp}) for sp, _ in INVALID_OPENAI]
    out = run_all(*calls)
    for (sp, msg), (status, body) in zip(INVALID + INVALID_OPENAI, out):
        assert status == 400, (sp, status, body)
        assert msg in error_message(body), (sp, body)
    assert_alive(tev)
    assert_serves_reference(tev, 1, tokenizer, hf_model, hf_greedy)


# ---------------------------------------------------------------------- 5. the audit: logprobs
def _close(a, b, tol=LOGPROB_TOL):
    return a is not None and b is not None and abs(a - b) <= tol


def test_logprobs_equal_plain_decoding(tev, plain, tokenizer, hf_model):
    """``return_logprob`` with ``top_logprobs_num``, ``token_ids_logprob`` and prompt logprobs, and
    OpenAI ``logprobs`` on completions and chat: same tokens as plain decoding and logprobs within
    bf16 tolerance of plain decoding's."""
    native = [
        dict(greedy(PROMPTS[i], n), return_logprob=True, top_logprobs_num=3, token_ids_logprob=[273, 15], logprob_start_len=0)
        for i, n in SERVED[:3]
    ]
    comp = completion(PROMPTS[0], 24, logprobs=3)
    chat = chat_request(CHATS[0], 16, logprobs=True, top_logprobs=2)
    calls = []
    for s in (tev, plain):
        calls += [lambda s=s, b=b: ok(s, "/generate", b) for b in native]
        calls += [lambda s=s: ok(s, "/v1/completions", comp), lambda s=s: ok(s, "/v1/chat/completions", chat)]
    out = run_all(*calls)
    k = len(native) + 2
    t_out, p_out = out[:k], out[k:]

    prompt_ids = [tokenizer(b["text"]).input_ids for b in native]
    t_ids = [o["output_ids"] for o in t_out[: len(native)]]
    p_ids = [o["output_ids"] for o in p_out[: len(native)]]
    assert_equal_or_tie(t_ids, p_ids, prompt_ids, hf_model, "TEV vs plain, return_logprob")
    for j, (t, p) in enumerate(zip(t_out[: len(native)], p_out[: len(native)])):
        tm, pm = t["meta_info"], p["meta_info"]
        m = first_divergence(t["output_ids"], p["output_ids"])
        m = len(t["output_ids"]) if m is None else m
        assert len(tm["output_token_logprobs"]) == len(t["output_ids"])
        for pos in range(m):
            (tl, tid, _), (pl, pid, _) = tm["output_token_logprobs"][pos], pm["output_token_logprobs"][pos]
            assert tid == pid == t["output_ids"][pos]
            assert _close(tl, pl), (j, pos, tl, pl)
            # greedy: the emitted token is the top-1 of its own law
            assert tm["output_top_logprobs"][pos][0][1] == tid and _close(tm["output_top_logprobs"][pos][0][0], tl, 1e-4)
            assert len(tm["output_top_logprobs"][pos]) == 3
            pt = {i: v for v, i, _ in pm["output_top_logprobs"][pos]}
            for v, i, _ in tm["output_top_logprobs"][pos]:
                if i in pt:
                    assert _close(v, pt[i]), (j, pos, i, v, pt[i])
            tt = {i: v for v, i, _ in tm["output_token_ids_logprobs"][pos]}
            pp = {i: v for v, i, _ in pm["output_token_ids_logprobs"][pos]}
            assert tt.keys() == pp.keys() == {273, 15} and all(_close(tt[i], pp[i]) for i in tt), (j, pos, tt, pp)
        # prompt logprobs come from the prefill (the same forward in both servers)
        tin = [x[0] for x in tm["input_token_logprobs"][1:]]
        pin = [x[0] for x in pm["input_token_logprobs"][1:]]
        assert len(tin) == len(prompt_ids[j]) - 1 and all(_close(a, b) for a, b in zip(tin, pin))

    tc, pc = t_out[len(native)]["choices"][0], p_out[len(native)]["choices"][0]
    assert tc["text"] == pc["text"]
    tl, pl = tc["logprobs"], pc["logprobs"]
    assert tl["tokens"] == pl["tokens"] and len(tl["tokens"]) == 24
    assert all(_close(a, b) for a, b in zip(tl["token_logprobs"], pl["token_logprobs"]))
    for a, b in zip(tl["top_logprobs"], pl["top_logprobs"]):
        assert len(a) == 3 and all(_close(v, b[t]) for t, v in a.items() if t in b)

    tch, pch = t_out[-1]["choices"][0], p_out[-1]["choices"][0]
    assert tch["message"]["content"] == pch["message"]["content"]
    tcl, pcl = tch["logprobs"]["content"], pch["logprobs"]["content"]
    assert [x["token"] for x in tcl] == [x["token"] for x in pcl] and len(tcl) == 16
    assert all(_close(a["logprob"], b["logprob"]) and len(a["top_logprobs"]) == 2 for a, b in zip(tcl, pcl))
    assert_alive(tev)


# ---------------------------------------------------------------------- the audit: grammars
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
GRAMMARS = [
    ("regex [a-z]+", "def fibonacci(n):", {"regex": "[a-z]+"}, 24),
    ("regex def/class header", "def fibonacci(n):", {"regex": r"(def|class) [a-z_]+\(\w*\):"}, 32),
    ("regex return line", PROMPTS[5], {"regex": r"    (print|return)\([a-z_]+( [+*-] [a-z0-9_]+)*\)\n"}, 32),
    ("json_schema", "Answer in JSON:", {"json_schema": json.dumps(JSON_SCHEMA)}, 48),
    ("ebnf", "x = ", {"ebnf": 'root ::= "foo" | "bar" | [0-9]+'}, 24),
    ("ebnf call", "result = ", {"ebnf": 'root ::= name "(" arg ("," " " arg)* ")"\nname ::= [a-z_]+\narg ::= [a-z0-9_]+'}, 32),
    ("stop_regex", "def fibonacci(n):", {"stop_regex": r"return \w"}, 40),
]


def test_grammars_give_plain_decodings_tokens(tev, plain, tokenizer, hf_model):
    """regex, json_schema and ebnf (xgrammar, SGLang's default backend; its per-node tree mask in
    TEV) and stop_regex, greedy, all in one concurrent batch: TEV's tokens equal plain decoding's
    under the same constraint; the outputs satisfy the constraint."""
    bodies = [greedy(text, n, **c) for _, text, c, n in GRAMMARS]
    comp = completion("def fibonacci(n):", 32, regex=r"(def|class) [a-z_]+\(\w*\):")
    chat = chat_request(
        "Give a name and an age as JSON.",
        48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": JSON_SCHEMA}},
    )
    calls = []
    for s in (tev, plain):
        calls += [lambda s=s, b=b: ok(s, "/generate", b) for b in bodies]
        calls += [lambda s=s: ok(s, "/v1/completions", comp), lambda s=s: ok(s, "/v1/chat/completions", chat)]
    out = run_all(*calls)
    k = len(bodies) + 2
    t_out, p_out = out[:k], out[k:]
    prompt_ids = [tokenizer(b["text"]).input_ids for b in bodies]
    t_ids = [o["output_ids"] for o in t_out[: len(bodies)]]
    p_ids = [o["output_ids"] for o in p_out[: len(bodies)]]
    assert_equal_or_tie(t_ids, p_ids, prompt_ids, hf_model, "TEV vs plain under a grammar")
    exact = [name for (name, *_), t, p in zip(GRAMMARS, t_ids, p_ids) if t == p]
    assert len(exact) >= len(GRAMMARS) - 2, f"only {exact} equal exactly"
    for (name, _, c, _), o in zip(GRAMMARS, t_out):
        text, reason = o["text"], o["meta_info"]["finish_reason"]["type"]
        if "regex" in c and (reason == "stop" or c["regex"] == "[a-z]+"):  # a cut [a-z]+ still matches
            assert re.fullmatch(c["regex"], text), (name, text)
        if "json_schema" in c and reason == "stop":
            obj = json.loads(text)
            assert isinstance(obj["name"], str) and isinstance(obj["age"], int), text
        if "stop_regex" in c:
            assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": c["stop_regex"]}, (name, text)
    assert t_out[-2]["choices"][0]["text"] == p_out[-2]["choices"][0]["text"]
    t_chat, p_chat = t_out[-1]["choices"][0]["message"]["content"], p_out[-1]["choices"][0]["message"]["content"]
    assert t_chat == p_chat
    if t_out[-1]["choices"][0]["finish_reason"] == "stop":
        json.loads(t_chat)
    assert_alive(tev)


# ---------------------------------------------------------------------- plain steps = SGLang's decoding
@pytest.fixture(scope="module")
def plain_steps():
    """TEV with SGLANG_TEV_BUDGET=auto and every round planned as a plain step (the CPU harness's
    SGLANG_TEV_PLAIN_STEPS hook): each round runs SGLang's DECODE forward in TEV's worker."""
    from sglang_tev import env as tev_env

    host = ServerHost(tev_kwargs(TREE_SIZE, chat_template=CHAT_TEMPLATE),
                      env={tev_env.BUDGET: "auto", tev_env.PLAIN_STEPS: "1", **EAGER})
    yield host
    host.close()


def test_plain_steps_equal_sglangs_plain_decoding(plain_steps, plain):
    """A plain step inside TEV (SGLang's DECODE forward, TEV's draw, its penalties, grammar walk and
    logprobs) against SGLang's own plain decoding, one request at a time (batch 1 on both, both
    eager): the same tokens, logprobs within one bf16 step (``PLAIN_STEP_TOL``; equal on this VM),
    for logprobs, penalties with min_new_tokens, two grammars, a stop string and a one-token request."""
    bodies = [
        dict(greedy(PROMPTS[SERVED[0][0]], 24), return_logprob=True, top_logprobs_num=2, token_ids_logprob=[273, 15]),
        # additive penalties only: with repetition_penalty too SGLang's order depends on overlap
        # scheduling (tests/engine/test_sglang_penalties.py), and this reference runs without it
        greedy(PROMPTS[2], 24, frequency_penalty=0.5, presence_penalty=0.3, min_new_tokens=8),
        greedy(PROMPTS[3], 24, repetition_penalty=1.2),
        greedy(GRAMMARS[1][1], GRAMMARS[1][3], **GRAMMARS[1][2]),
        greedy(GRAMMARS[3][1], GRAMMARS[3][3], **GRAMMARS[3][2]),
        greedy(PROMPTS[4], 32, stop=["\n\n"]),
        greedy(PROMPTS[7], 1),
    ]
    for j, body in enumerate(bodies):
        for server in (plain_steps, plain):
            # the same arithmetic on both: nothing else in the batch (a request left running by an
            # earlier test would make it batch 2), and a cold prefill (the shared plain server's radix
            # cache holds these prompts from earlier tests). In the engine suite on a loaded VM the
            # logprobs once came 0.004 nats apart at token 9 without this; alone they are equal.
            wait_idle(server)
            assert server.get("/flush_cache")[0] == 200, server.tail()
        t, p = ok(plain_steps, "/generate", body), ok(plain, "/generate", body)
        assert t["output_ids"] == p["output_ids"] and t["text"] == p["text"], (j, t["text"], p["text"])
        tm, pm = t["meta_info"], p["meta_info"]
        assert tm["finish_reason"] == pm["finish_reason"], j
        budgets = tm.get("tev_budget", [])  # absent when no decode round ran (a one-token request)
        assert len(budgets) == tm.get("spec_verify_ct", 0) and set(budgets) <= {0}, (j, budgets, tm)  # all plain steps
        assert len(budgets) >= min(8, len(t["output_ids"]) - 1), (j, budgets)
        if body.get("return_logprob"):
            pairs = list(zip(tm["output_token_logprobs"], pm["output_token_logprobs"]))
            bad = [(i, a, b) for i, (a, b) in enumerate(pairs) if a[1] != b[1] or abs(a[0] - b[0]) > PLAIN_STEP_TOL]
            assert not bad, (j, bad)
            for i, (a, b) in enumerate(zip(tm["output_top_logprobs"], pm["output_top_logprobs"])):
                # the same top-k up to a bf16 near-tie at its edge: an id on one side only ranks
                # within a step of the other side's k-th
                ta, tb = {x[1]: x[0] for x in a}, {x[1]: x[0] for x in b}
                assert all(abs(ta[v] - tb[v]) <= PLAIN_STEP_TOL for v in ta.keys() & tb.keys()), (j, i, a, b)
                assert all(abs(ta[v] - b[-1][0]) <= PLAIN_STEP_TOL for v in ta.keys() - tb.keys()), (j, i, a, b)
                assert all(abs(tb[v] - a[-1][0]) <= PLAIN_STEP_TOL for v in tb.keys() - ta.keys()), (j, i, a, b)
    assert_alive(plain_steps)


def test_plain_steps_in_a_mixed_batch(plain_steps, tokenizer, hf_model, hf_greedy):
    """Plain steps for a batch of greedy and seeded sampled requests at once (the worker's lean
    plain step: no logprobs, penalties or grammars): greedy rows are the target's greedy tokens (up
    to near-tie flips), sampled rows run to their length, every round is a plain step, and each
    request's per-round meta info is complete."""
    texts = [PROMPTS[i] for i in (0, 1, 2, 3)]
    bodies = [greedy(texts[0], 20), greedy(texts[1], 20),
              greedy(texts[2], 20, temperature=1.0, top_p=0.95, sampling_seed=7, ignore_eos=True),
              greedy(texts[3], 20, temperature=0.8, top_k=30, sampling_seed=8, ignore_eos=True)]
    wait_idle(plain_steps)
    out = run_all(*[(lambda b=b: ok(plain_steps, "/generate", b)) for b in bodies])
    ids = [tokenizer(t).input_ids for t in texts[:2]]
    got = [o["output_ids"] for o in out[:2]]
    assert_matches_hf(got, [hf_greedy(i, len(g)) for i, g in zip(ids, got)], ids, hf_model, "greedy rows among plain steps")
    for o in out:
        m = o["meta_info"]
        assert set(m.get("tev_budget", [])) <= {0} and len(m["tev_budget"]) == m["spec_verify_ct"], m
        assert m["tev_accept_length"] == [1] * len(m["tev_budget"]), m
    assert all(len(o["output_ids"]) == 20 for o in out[2:])
    assert_alive(plain_steps)


# ---------------------------------------------------------------------- the audit: n > 1, refusals
def test_parallel_sampling_n_greater_than_one_is_served(tev, tokenizer, hf_model, hf_greedy):
    """``n`` = 2 on ``/generate`` (``sampling_params.n``) and on ``/v1/completions``: served; greedy
    copies carry the greedy tokens, sampled ones run to their length."""
    p = PROMPTS[SERVED[0][0]]
    ids = tokenizer(p).input_ids
    greedy_n2, sampled_n2, comp_n2, comp_greedy_n2 = run_all(
        lambda: ok(tev, "/generate", greedy(p, 16, n=2)),
        lambda: ok(tev, "/generate", greedy(p, 12, temperature=1.0, n=2, ignore_eos=True)),
        lambda: ok(tev, "/v1/completions", completion(p, 12, temperature=1.0, n=2)),
        lambda: ok(tev, "/v1/completions", completion(p, 16, n=2)),
    )
    assert isinstance(greedy_n2, list) and len(greedy_n2) == 2
    assert greedy_n2[0]["output_ids"] == greedy_n2[1]["output_ids"]
    assert_matches_hf([greedy_n2[0]["output_ids"]], [hf_greedy(ids, 16)], [ids], hf_model, "n = 2, greedy")
    assert isinstance(sampled_n2, list) and len(sampled_n2) == 2
    assert all(len(o["output_ids"]) == 12 and o["meta_info"]["finish_reason"]["type"] == "length" for o in sampled_n2)
    assert sorted(c["index"] for c in comp_n2["choices"]) == [0, 1]
    assert comp_n2["usage"]["completion_tokens"] >= 2 and all(c["text"] for c in comp_n2["choices"])
    assert [c["text"] for c in comp_greedy_n2["choices"]] == [greedy_n2[0]["text"]] * 2
    assert_alive(tev)


REFUSED = [
    ("/generate", {"return_hidden_states": True}, "not configured to return hidden states"),
    ("/v1/completions", {"return_hidden_states": True}, "not configured to return hidden states"),
    ("/generate", {"lora_path": "some-adapter"}, "LoRA is not enabled"),
    ("/v1/completions", {"lora_path": "some-adapter"}, "LoRA is not enabled"),
    ("/generate", {"custom_logit_processor": "{}"}, "not configured to enable custom logit processor"),
]


def test_options_this_server_does_not_enable_get_http_400(tev, tokenizer, hf_model, hf_greedy):
    """``return_hidden_states`` without ``--return-hidden-states-mode``, a LoRA adapter without
    ``--enable-lora``, a custom logit processor without ``--enable-custom-logit-processor``:
    SGLang refuses each at admission with its own message, and the server answers next."""

    def send(path, extra):
        if path == "/generate":
            return tev.post(path, dict(greedy("x", 4), **extra))
        return tev.post(path, {**completion("x", 4), **extra})

    out = run_all(*[lambda p=p, e=e: send(p, e) for p, e, _ in REFUSED])
    for (path, extra, msg), (status, body) in zip(REFUSED, out):
        assert status == 400 and msg in error_message(body), (path, extra, status, body)
    assert_alive(tev)
    assert_serves_reference(tev, 2, tokenizer, hf_model, hf_greedy)


def test_logit_bias_gives_plain_decodings_tokens(tev, plain):
    body = greedy("def fibonacci(n):", 24, logit_bias={"273": -100.0, "15": 3.0})
    t, p = run_all(lambda: ok(tev, "/generate", body), lambda: ok(plain, "/generate", body))
    assert 273 not in t["output_ids"]
    assert t["output_ids"] == p["output_ids"]


# ---------------------------------------------------------------------- the audit: penalties
PATH_DEPENDENT = [("frequency_penalty", 1.0), ("presence_penalty", 1.0), ("repetition_penalty", 1.3), ("min_new_tokens", 5)]
PATH_DEPENDENT_OPENAI = [("frequency_penalty", 1.0), ("presence_penalty", 1.0), ("repetition_penalty", 1.3), ("min_tokens", 5)]
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}


def test_path_dependent_sampling_options_are_served_with_plain_decodings_tokens(tev, plain, tokenizer, hf_model):
    """Penalties and ``min_new_tokens`` depend on the tokens generated so far, which differ along
    each tree path: TEV recomputes them at every node from SGLang's penalizer state plus the node's
    path (``sglang_tev/srt/penalties.py``), on the native and the OpenAI routes, with plain
    decoding's tokens up to bf16 near-ties of the penalised law (penalties make exact ties common:
    presence 1.0 on bf16 logits lands tokens on one value). Plain decoding's output changes with
    each of them (here the stop token 1098 first comes at output position 3, which
    ``min_new_tokens`` = 5 holds back), so a server that ignored them would answer with other
    tokens. (SGLang 0.5.23's DFlash-family verify drops them: ``apply_dflash_verify_logits_adjustments``
    reads ``acc_linear_penalties``, a field ``SamplingBatchInfo`` does not have, and no output
    token is ever counted; before issue 25 TEV refused them with a 400.) The Engine-level checks
    are in ``tests/engine/test_sglang_penalties.py``."""
    from engine_checks import PenalisedModel

    text = "def fibonacci(n):"
    prompt = tokenizer(text).input_ids
    extra = {"min_new_tokens": {"stop_token_ids": [1098]}, "min_tokens": {"stop_token_ids": [1098]}}
    native = [greedy(text, 40, **{o: v}, **extra.get(o, {})) for o, v in PATH_DEPENDENT]
    openai = [completion(text, 12, **{o: v}, **extra.get(o, {})) for o, v in PATH_DEPENDENT_OPENAI]
    without = [completion(text, 12, **extra.get(o, {})) for o, _ in PATH_DEPENDENT_OPENAI]  # the stop id kept
    calls = [lambda b=b: ok(tev, "/generate", b) for b in native] + [lambda b=b: ok(plain, "/generate", b) for b in native]
    calls += [lambda b=b: ok(tev, "/v1/completions", b) for b in openai] + [lambda b=b: ok(plain, "/v1/completions", b) for b in openai]
    calls += [lambda b=b: ok(plain, "/v1/completions", b) for b in without]
    calls += [lambda: ok(plain, "/generate", greedy(text, 40)), lambda: ok(tev, "/generate", greedy(text, 40, **NEUTRAL))]
    out = run_all(*calls)
    n = len(PATH_DEPENDENT)
    tev_native, plain_native, tev_openai, plain_openai, plain_without = (out[i * n : (i + 1) * n] for i in range(5))
    unpenalized, neutral = out[5 * n :]
    for (name, _), body, t, p in zip(PATH_DEPENDENT, native, tev_native, plain_native):
        assert p["output_ids"] != unpenalized["output_ids"], f"{name} does not change plain decoding here"
        model = PenalisedModel(hf_model, [prompt], [body["sampling_params"]])
        assert_same_ids([t["output_ids"]], [p["output_ids"]], [prompt], model, f"/generate {name}", max_flips=1)
    for (name, _), (internal, _), body, t, p, u in zip(
        PATH_DEPENDENT_OPENAI, PATH_DEPENDENT, openai, tev_openai, plain_openai, plain_without
    ):  # OpenAI min_tokens is SGLang's min_new_tokens
        assert p["choices"][0]["text"] != u["choices"][0]["text"], f"{name} does not change /v1/completions"
        params = {internal: body[name], **extra.get(name, {})}
        model = PenalisedModel(hf_model, [prompt], [params])
        ids = [tokenizer(r["choices"][0]["text"], add_special_tokens=False).input_ids for r in (t, p)]
        assert_same_ids([ids[0]], [ids[1]], [prompt], model, f"/v1/completions {name}", max_flips=1)
    assert neutral["output_ids"] == unpenalized["output_ids"]
    assert_alive(tev)


def test_sampled_requests_log_no_greedy_fallback_warning(tev):
    """DFlash's "falling back to greedy argmax verification" warning (dflash_worker_v2.py:2314)
    is false for TEV, which verifies the sampled law exactly; TEVWorker overrides the check."""
    ok(tev, "/generate", {"text": "x", "sampling_params": {"temperature": 0.8, "max_new_tokens": 4}})
    log = Path(tev.log.name).read_text(errors="replace")
    assert "falling back to greedy argmax verification" not in log


# ---------------------------------------------------------------------- 3b. the context-length edge
CONTEXT = 2048
"""The tiny target's context length (``max_position_embeddings``), the server's default."""


def test_requests_ending_at_the_context_length_leave_the_server_serving(tev, plain, tokenizer, hf_model, hf_greedy):
    """The requests that took the TEV server down before issue 25: greedy ``ignore_eos`` requests
    whose prompt + max tokens end at the context length (or 1-18 tokens before it), on
    ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``, and one aborted while it decodes
    there. Each is accepted and answered with plain decoding's tokens (near-tie rule). An empty
    prompt and an out-of-vocabulary input id, which SGLang's scheduler exited on, get a 400. The
    server is then alive and serves an ordinary request."""
    import argparse
    import inspect

    corpus = tokenizer(inspect.getsource(argparse)).input_ids
    gen = []
    for i, back in enumerate((0, 1, 8, 18)):
        m = 24 + 5 * i
        ids = corpus[97 * i : 97 * i + CONTEXT - back - m]
        gen.append({"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": m, "ignore_eos": True}})
    comp_ids = corpus[500 : 500 + CONTEXT - 32]
    comp = completion(comp_ids, 32, ignore_eos=True)
    content = tokenizer.decode(corpus[900 : 900 + CONTEXT - 80])
    templated = len(tokenizer(CHATML.format(content)).input_ids)
    chat = chat_request(content, CONTEXT - templated, ignore_eos=True)
    calls = [lambda b=b, s=s: ok(s, "/generate", b) for s in (tev, plain) for b in gen]
    calls += [lambda s=s: ok(s, "/v1/completions", comp) for s in (tev, plain)]
    calls += [lambda s=s: ok(s, "/v1/chat/completions", chat) for s in (tev, plain)]
    out = run_all(*calls)
    k = len(gen)
    got, want = out[:k], out[k : 2 * k]
    assert_equal_or_tie([o["output_ids"] for o in got], [o["output_ids"] for o in want], [b["input_ids"] for b in gen], hf_model, "/generate at the context edge")
    assert [len(o["output_ids"]) for o in got] == [len(o["output_ids"]) for o in want]
    for name, t, p in (("completions", out[2 * k], out[2 * k + 1]), ("chat", out[2 * k + 2], out[2 * k + 3])):
        t_ids = tokenizer(completion_text([t]) if name == "completions" else t["choices"][0]["message"]["content"]).input_ids
        p_ids = tokenizer(completion_text([p]) if name == "completions" else p["choices"][0]["message"]["content"]).input_ids
        prompt = comp_ids if name == "completions" else tokenizer(CHATML.format(content)).input_ids
        assert_equal_or_tie([t_ids], [p_ids], [prompt], hf_model, f"/v1/{name} at the context edge")
        assert t["usage"]["completion_tokens"] == p["usage"]["completion_tokens"], name

    # prompts SGLang accepts but its scheduler cannot run (it exited on each): a 400 naming why
    bad = [
        ({"text": "", "sampling_params": {"temperature": 0, "max_new_tokens": 4}}, "prompt is empty"),
        ({"input_ids": [], "sampling_params": {"max_new_tokens": 4}}, ""),
        ({"input_ids": [5, 4096, 7], "sampling_params": {"max_new_tokens": 4}}, "out-of-vocabulary token id 4096"),
    ]
    for body, why in bad:
        status, res = tev.post("/generate", body)
        assert status == 400 and why in error_message(res), (body, status, res)
    status, res = tev.post("/v1/completions", completion([9, 99999], 4))
    assert status == 400 and "out-of-vocabulary" in error_message(res), (status, res)
    assert_alive(tev)

    # an abort while a request decodes in the last positions of the context
    rid = f"tev-edge-abort-{uuid.uuid4().hex}"
    body = {"input_ids": corpus[:CONTEXT - 300], "sampling_params": {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}, "rid": rid}
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(tev.post, "/generate", body)
        wait_running(tev)
        time.sleep(1.0)
        status, res = abort_until_done(tev, rid, fut)
    assert status == 200 and res["meta_info"]["finish_reason"]["type"] in ("abort", "length"), res["meta_info"]
    wait_idle(tev)
    assert_alive(tev)
    log = Path(tev.log.name).read_text(errors="replace")
    assert "Scheduler hit an exception" not in log, tev.tail()
    assert_serves_reference(tev, 1, tokenizer, hf_model, hf_greedy)


# ---------------------------------------------------------------------- 4. no leaked KV slots
def test_kv_pool_holds_no_leaked_slots_after_mixed_traffic(tev, tokenizer, hf_model, hf_greedy):
    """After every request of this module and a burst mixing greedy, sampled, n = 2, logprobs,
    grammar, stop, streamed, disconnected and aborted requests: SGLang's own load report shows no
    KV slot in use once idle (``num_used_tokens`` = 0, i.e. free + radix-cache-evictable = the whole
    pool), and SGLang's strict idle leak check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``,
    on by default) never fired."""
    before = wait_idle(tev)
    assert before["num_used_tokens"] == 0, before  # nothing leaked by the tests above
    total = before["max_total_num_tokens"]
    rid = f"tev-burst-abort-{uuid.uuid4().hex}"

    def aborted():
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(tev.post, "/generate", {"text": PROMPTS[3], "sampling_params": LONG, "rid": rid})
            time.sleep(0.5)
            return abort_until_done(tev, rid, fut)

    calls = [lambda i=i, n=n: ok(tev, "/generate", greedy(PROMPTS[i], n)) for i, n in SERVED]
    calls += [
        lambda: ok(tev, "/generate", greedy(PROMPTS[1], 40, temperature=1.0, top_k=40)),
        lambda: ok(tev, "/v1/completions", completion(PROMPTS[6], 24, temperature=0.7, n=2)),
        lambda: ok(tev, "/generate", dict(greedy(PROMPTS[8], 24), return_logprob=True, top_logprobs_num=2)),
        lambda: ok(tev, "/generate", greedy("Answer in JSON:", 48, json_schema=json.dumps(JSON_SCHEMA))),
        lambda: ok(tev, "/generate", greedy(PROMPTS[2], 40, stop=["self"])),
        lambda: tev.stream("/v1/chat/completions", chat_request("hi", 32, temperature=1.0)),
        lambda: tev.stream("/generate", {"text": PROMPTS[4], "sampling_params": LONG}, stop_after=3),
        lambda: tev.stream("/v1/completions", completion(PROMPTS[0], 1500), stop_after=1),
        aborted,
    ]
    out = run_all(*calls)
    status, ab = out[-1]
    assert status == 200 and ab["meta_info"]["finish_reason"]["type"] == "abort", ab
    after = wait_idle(tev)
    assert after["max_total_num_tokens"] == total
    assert after["num_used_tokens"] == 0, after
    assert after["token_usage"] == 0.0, after
    assert_alive(tev)
    log = Path(tev.log.name).read_text(errors="replace")
    assert "memory leak detected" not in log and "Scheduler hit an exception" not in log, tev.tail()
    assert_serves_reference(tev, 3, tokenizer, hf_model, hf_greedy)
