"""Penalties and ``min_new_tokens`` served exactly by TEV through SGLang 0.5.23's real Engine on
this CPU (``sglang_tev/srt/penalties.py``), against SGLang's own plain decoding.

Two Engines, one at a time (each in its own process, ``sglang_tev.testing.sglang_cpu``): plain decoding gives
its references and is closed, then TEV (N = 17, deterministic inference for ``sampling_seed``)
serves the same requests in one batch mixing every case, and 400 seeded sampled requests per case.
Greedy: equal ids up to bf16 near-ties of the PENALISED law (``assert_same_ids`` with a model that
applies SGLang's penalty math to HF's logits). Sampled: the first two tokens against the exact
penalised law (the second token's penalties count the first), by chi-square.

Without TEV's per-node penalties (SGLang's own DFLASH verify drops them, and TEV refused them
before issue 25) every penalised greedy output here equals the unpenalised one: the tests assert
that the penalties change the text.

SGLang's repetition scaling is ``torch.compile``d (inductor: ~50 s of CPU per process here); both
Engines run with ``TORCHDYNAMO_DISABLE=1``, i.e. the same function eagerly.
"""

from __future__ import annotations


import pytest
import torch

from sglang_tev.testing.sglang_cpu.hosts import EngineHost, plain_kwargs, require_sglang, tev_kwargs

require_sglang()
from engine_checks import EOS, TIE, PenalisedModel, assert_same_ids, chi_square_p, penalise  # noqa: F401

ENV = {"TORCHDYNAMO_DISABLE": "1"}
PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "# Parse command-line arguments\nimport argparse\n\nparser = argparse.ArgumentParser(",
    "def read_lines(path):\n    with open(path) as f:",
]
MAX_NEW = 40
MIN_NEW = 24
SAMPLED_PROMPT = "#" * 30
"""The sampled tests' prompt: its continuations repeat their first token often (~25 % at T = 1),
so 400 samples tell the penalised law from the unpenalised one (p < 1e-12 in simulations)."""

# greedy cases: sampling params (the stop token of the min_new_tokens cases is filled per prompt)
CASES = {
    "frequency": {"frequency_penalty": 1.0},
    "presence": {"presence_penalty": 1.0},
    "repetition": {"repetition_penalty": 1.3},
    "stop": {"stop_token_ids": "STOP"},  # the reference min_new_tokens must change
    "min_new_tokens": {"min_new_tokens": MIN_NEW, "stop_token_ids": "STOP"},
    "freq+pres+min_new": {"frequency_penalty": 0.6, "presence_penalty": 0.4, "min_new_tokens": MIN_NEW, "stop_token_ids": "STOP"},
    "rep+min_new": {"repetition_penalty": 1.2, "min_new_tokens": MIN_NEW, "stop_token_ids": "STOP"},
}
ALL_FOUR = {"frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.5, "min_new_tokens": MIN_NEW,
            "stop_token_ids": "STOP"}  # fmt: skip
"""Repetition with frequency/presence: SGLang's non-overlap plain decoding (the reference Engine's
mode on CPU) applies its penalizers in the iteration order of a set of classes
(``sampling_batch_info.py:276-284``), which changes between processes; TEV uses the overlap-mode
order (additive, then repetition). This case is checked token by token against that order
computed here."""


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    """This module's own PROMPTS (not the engine tests')."""
    return [tokenizer(p).input_ids for p in PROMPTS]


def requests(prompt_ids, stops, case):
    """(input_ids, sampling params) of one case for every prompt (greedy, MAX_NEW tokens)."""
    sps = []
    for s in stops:
        sp = {"temperature": 0, "max_new_tokens": MAX_NEW, **case}
        if sp.get("stop_token_ids") == "STOP":
            sp["stop_token_ids"] = [s]
        sps.append(sp)
    return list(prompt_ids), sps


def stop_tokens(unpenalised):
    """Per prompt, a token that unpenalised greedy decoding emits within its first 6 tokens (never
    the first): as a stop id it ends that output early, unless min_new_tokens holds it back."""
    return [next(t for t in out[1:6] if t != EOS) for out in unpenalised]


def batch_of_cases(prompt_ids, stops):
    names, ids, sps = [], [], []
    for name, case in [("none", {})] + list(CASES.items()) + [("all four", ALL_FOUR)]:
        i, s = requests(prompt_ids, stops, case)
        names += [name] * len(i)
        ids += i
        sps += s
    return names, ids, sps


def by_case(names, outputs):
    out = {}
    for n, o in zip(names, outputs):
        out.setdefault(n, []).append(o)
    return out


@pytest.fixture(scope="module")
def plain_refs(prompt_ids):
    """SGLang plain decoding: unpenalised greedy, then every case (one batch); the Engine is closed
    before TEV's starts. With overlap scheduling OFF: SGLang 0.5.23's plain decoding under
    overlap feeds its penalizers a lagging token (``ScheduleBatch.cumulate_penalty_output_tokens``
    reads ``req.output_ids[-1]`` before the previous step's result is processed,
    ``schedule_batch.py:3715-3734``), so its frequency / presence / repetition penalties are off
    by a step (seen: frequency + presence diverge from the exact penalised greedy at token 9,
    while overlap-off plain decoding and TEV with overlap on follow it exactly)."""
    eng = EngineHost(plain_kwargs(max_running_requests=48, disable_overlap_schedule=True), env=ENV)
    try:
        unpenalised = [o["output_ids"] for o in eng.generate(prompt_ids, [{"temperature": 0, "max_new_tokens": MAX_NEW}] * len(prompt_ids))]
        stops = stop_tokens(unpenalised)
        names, ids, sps = batch_of_cases(prompt_ids, stops)
        cases = by_case(names, eng.generate(ids, sps))
    finally:
        eng.close()
    return {"unpenalised": unpenalised, "stops": stops, "cases": cases}


@pytest.fixture(scope="module")
def tev():
    eng = EngineHost(
        tev_kwargs(17, attention_backend="tev_cpu", enable_deterministic_inference=True, max_running_requests=48), env=ENV
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tev_cases(tev, plain_refs, prompt_ids):
    names, ids, sps = batch_of_cases(prompt_ids, plain_refs["stops"])
    return by_case(names, tev.generate(ids, sps)), sps


def ids_of(outs):
    return [o["output_ids"] for o in outs]


def test_plain_decoding_references_are_penalised(plain_refs):
    """The references can tell: every case changes plain decoding's text (min_new_tokens: against
    the same stop id without it), on every prompt."""
    unpen, cases = plain_refs["unpenalised"], plain_refs["cases"]
    assert ids_of(cases["none"]) == unpen
    for name in CASES:
        base = ids_of(cases["stop"]) if "min_new" in name else unpen
        if name == "stop":
            assert all(len(o) <= 6 for o in ids_of(cases["stop"])), ids_of(cases["stop"])
            continue
        for i, (got, b) in enumerate(zip(ids_of(cases[name]), base)):
            assert got != b, f"{name} does not change plain decoding on prompt {i}"
            assert len(got) >= (MIN_NEW if "min_new" in name else 32), (name, i, got)


@pytest.mark.parametrize("name", list(CASES))
def test_tev_greedy_with_penalties_equals_plain_decoding(name, tev_cases, plain_refs, prompt_ids, hf_model):
    cases, sps = tev_cases
    got = ids_of(cases[name])
    want = ids_of(plain_refs["cases"][name])
    params = [sp for sp, n in zip(sps, batch_of_cases(prompt_ids, plain_refs["stops"])[0]) if n == name]
    assert_same_ids(got, want, prompt_ids, PenalisedModel(hf_model, prompt_ids, params), f"TEV vs plain, {name}", max_flips=1)
    if name != "stop":
        # visible without per-node penalties: TEV's own penalised text differs from its unpenalised one
        base = ids_of(cases["stop"]) if "min_new" in name else ids_of(cases["none"])
        assert sum(g != b for g, b in zip(got, base)) >= len(got) - 1, f"{name}: TEV's output ignores the penalty"
    if "min_new" in name:
        for g, sp in zip(got, params):
            assert len(g) >= MIN_NEW and EOS not in g[:MIN_NEW] and not set(sp["stop_token_ids"]) & set(g[:MIN_NEW])
    # the rounds accepted drafts, so nodes below the root (path counts) decided tokens
    rounds = [r for o in cases[name] for r in o["meta_info"]["tev_accept_length"]]
    assert sum(rounds) / len(rounds) >= 1.5 and max(rounds) >= 3, rounds


def greedy_misses(model, prompt, out, params):
    """Teacher-forced check of a greedy output under the penalised HF target law: for each
    position where ``out`` is not the argmax, the logit gap (0 where it is)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(out)]
    gaps = []
    for k, t in enumerate(out):
        x = penalise(logits[k], out[:k], params)
        gaps.append(float(x.max() - x[t]))
    return gaps


def test_tev_greedy_all_four_penalties_follow_sglangs_overlap_order(tev_cases, plain_refs, prompt_ids, hf_model):
    """Frequency + presence + repetition + min_new_tokens: every token of TEV's output (teacher
    forced on its own prefix) is the argmax of the HF target's law with SGLang's penalties in its
    overlap-mode order (additive first, then repetition), up to bf16 near-ties. (Greedy outputs
    here do not tell the two orders apart: with either order the other law's argmax is within a
    near-tie. The order itself is checked bit for bit against SGLang's sampler code in
    ``tests/srt/test_srt_penalties.py``.)"""
    cases, sps = tev_cases
    params = [sp for sp, n in zip(sps, batch_of_cases(prompt_ids, plain_refs["stops"])[0]) if n == "all four"]
    got = ids_of(cases["all four"])
    ties = []
    for i, (p, o, sp) in enumerate(zip(prompt_ids, got, params)):
        assert len(o) == MAX_NEW or o[-1] in {EOS, *sp["stop_token_ids"]}, (i, o)
        assert len(o) >= MIN_NEW, (i, o)
        gaps = greedy_misses(hf_model, p, o, sp)
        assert max(gaps) <= TIE, (i, gaps)
        ties += [(i, k, g) for k, g in enumerate(gaps) if g > 0]
    assert len(ties) <= 4, ties  # bf16 near-ties between SGLang's and HF's model code
    assert sum(g != b for g, b in zip(got, ids_of(cases["none"]))) >= len(got) - 1


def penalised_first_two_law(model, prompt, params, n):
    """Exact law of the first two tokens with SGLang's penalties at temperature 1: the first
    token's law has no output to count; the second's counts the first. {(x1, x2): p} for every x1
    with n * p(x1) >= 1."""
    with torch.no_grad():
        p1 = torch.softmax(penalise(model(torch.tensor([prompt])).logits[0, -1], [], params).double(), -1)
        firsts = [int(t) for t in torch.nonzero(p1 * n >= 1).flatten()]
        rows = model(torch.tensor([prompt + [t] for t in firsts])).logits[:, -1]
    law = {}
    for i, t in enumerate(firsts):
        p2 = torch.softmax(penalise(rows[i], [t], params).double(), -1)
        for u in torch.nonzero(p2 > 0).flatten().tolist():
            law[(t, u)] = float(p1[t] * p2[u])
    return law


@pytest.mark.parametrize(
    "params",
    [{"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"repetition_penalty": 1.3}],
    ids=["frequency+presence", "repetition"],
)
def test_tev_first_two_sampled_tokens_follow_the_penalised_law(params, tev, tokenizer, hf_model):
    """400 seeded requests at temperature 1: SGLang's sampler draws the first token (prefill),
    TEV's first round the second, under penalties counting the first. The same test against the
    unpenalised law must fail (the penalties move the law enough for 400 samples to tell)."""
    n = 400
    prompt = tokenizer(SAMPLED_PROMPT).input_ids
    sps = [dict(params, temperature=1.0, max_new_tokens=2, ignore_eos=True, sampling_seed=20_000 + i) for i in range(n)]
    out = tev.generate([prompt] * n, sps)
    samples = [tuple(o["output_ids"][:2]) for o in out]
    assert all(len(s) == 2 for s in samples)
    assert all(len(o["meta_info"].get("tev_accept_length", [])) >= 1 for o in out)  # token 2: a TEV round
    assert len(set(samples)) > 3  # really sampled
    law = penalised_first_two_law(hf_model, prompt, params, n)
    p = chi_square_p(samples, law)
    assert p > 1e-6, f"chi-square p = {p:.2e}"
    unpenalised = penalised_first_two_law(hf_model, prompt, {}, n)
    assert chi_square_p(samples, unpenalised) < 1e-6  # the check has the power to see a dropped penalty
