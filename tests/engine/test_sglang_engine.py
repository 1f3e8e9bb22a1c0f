"""SGLang 0.5.23's real Engine serving TEV end to end on this CPU (no GPU, no fakes of SGLang).

Each Engine runs in its own process with the CPU harness (``sglang_tev.testing.sglang_cpu``: stand-ins for
sgl_kernel's CPU ops only) and this project's ``--attention-backend tev_cpu``. SGLang's scheduler,
tokenizer manager, detokenizer, model runner, memory pools, radix cache, sampling info and the
TEV worker run as installed. One Engine per setting, shared by the tests of that setting.

Reference: HF ``generate(do_sample=False)`` of the same target in bf16 (the Engine's dtype), and
SGLang's own plain decoding.
"""

from __future__ import annotations

import pytest
import torch

from engine_checks import (  # noqa: F401
    MAX_NEW,
    PROMPTS,
    TIE,
    assert_matches_hf,
    assert_rounds_agree,
    assert_same_ids,
    check_first_two_tokens,
    chi_square_p,
    first_two_law,
    greedy_params,
    ids_of,
)
from sglang_tev.testing.sglang_cpu.hosts import (
    DRAFT,
    TARGET,
    plain_kwargs,
    require_sglang,
    tev_kwargs,
)

require_sglang()

# ---------------------------------------------------------------------- plain decoding
RADIX_TAILS = ["\n        self.items.append(item)", "\n        pass", "\n"]


@pytest.fixture(scope="module")
def radix_prompts(tokenizer):
    head = tokenizer(PROMPTS[2]).input_ids
    return head, [head + tokenizer(t).input_ids for t in RADIX_TAILS]


@pytest.fixture(scope="module")
def plain_refs(hosts, prompt_ids, tokenizer, radix_prompts):
    """Every SGLang plain-decoding reference of this module, from one Engine that is then closed
    (an idle Engine still costs CPU here)."""
    eng = hosts.get("plain", plain_kwargs())
    greedy = ids_of(eng.generate(prompt_ids, greedy_params(MAX_NEW)))
    cases = _stop_cases(tokenizer, greedy)
    stops = eng.generate([prompt_ids[i] for i, _ in cases], [sp for _, sp in cases])
    radix = ids_of(eng.generate(radix_prompts[1], greedy_params([24] * len(RADIX_TAILS))))
    hosts.close("plain")
    return {"greedy": greedy, "stop_cases": cases, "stops": stops, "radix": radix}


@pytest.fixture(scope="module")
def plain_greedy(plain_refs):
    return plain_refs["greedy"]


def test_plain_sglang_equals_hf(plain_greedy, hf_greedy, prompt_ids, hf_model):
    assert_matches_hf(plain_greedy, hf_greedy, prompt_ids, hf_model, "SGLang plain decoding vs HF generate")


# ---------------------------------------------------------------------- TEV, N = 9
def _tev9(hosts):
    # deterministic inference: per-request sampling_seed drives SGLang's sampler and TEV's uniforms
    return hosts.get(
        "tev9", tev_kwargs(9, attention_backend="tev_cpu", enable_deterministic_inference=True, max_running_requests=48)
    )


def test_tev9_greedy_batch_equals_plain_and_hf(hosts, prompt_ids, plain_greedy, hf_greedy, hf_model):
    out = _tev9(hosts).generate(prompt_ids, greedy_params(MAX_NEW))
    assert_same_ids(ids_of(out), plain_greedy, prompt_ids, hf_model, "TEV N=9 vs SGLang plain")
    assert_matches_hf(ids_of(out), hf_greedy, prompt_ids, hf_model, "TEV N=9 vs HF")
    rounds = [r["meta_info"]["tev_accept_length"] for r in out]
    # the emitted tokens per round add up to the output, and rounds did accept drafts
    for r, o in zip(rounds, out):
        assert sum(r) >= len(o["output_ids"]) - 1 and all(1 <= a <= 9 for a in r)
    assert max(max(r) for r in rounds) >= 3


def test_tev9_requests_arriving_while_others_decode(hosts, prompt_ids, plain_greedy, hf_model):
    jobs = [
        {"delay": 0.4 * i, "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
        for i, (ids, n) in enumerate(zip(prompt_ids, MAX_NEW))
    ]
    out = _tev9(hosts).call("staggered", jobs=jobs)
    assert_same_ids(ids_of(out), plain_greedy, prompt_ids, hf_model, "TEV N=9, staggered arrivals vs plain")


def test_tev9_seeded_request_reproduces_exactly(hosts, prompt_ids):
    """A seeded request gives the same tokens when sent again, alone or in the same batch.

    Across different batch compositions this also needs batch-invariant kernels (SGLang's
    deterministic mode turns them on on a GPU; on this CPU the harness skips them): TEV's sample
    is a function of the tree, the target law and the uniforms, and bf16 rounding of a batched
    draft forward can reorder near-tied draft candidates and so change the tree."""
    eng = _tev9(hosts)
    sp = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 32, "sampling_seed": 1234}
    alone = eng.generate([prompt_ids[0]], [sp])[0]["output_ids"]
    assert eng.generate([prompt_ids[0]], [sp])[0]["output_ids"] == alone
    others = [{"temperature": 1.0, "max_new_tokens": 20, "sampling_seed": s} for s in (1, 2, 3)]
    ids = [prompt_ids[3], prompt_ids[0], prompt_ids[5], prompt_ids[1]]
    batch = ids_of(eng.generate(ids, [others[0], sp, others[1], others[2]]))
    assert ids_of(eng.generate(ids, [others[0], sp, others[1], others[2]])) == batch
    other_seed = eng.generate([prompt_ids[0]], [dict(sp, sampling_seed=4321)])[0]["output_ids"]
    assert other_seed != alone  # the seed, not the prompt alone, fixes the output


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.7}, {"temperature": 1.0, "top_p": 0.8}, {"temperature": 1.0, "top_k": 12}],
    ids=["temperature", "top_p", "top_k"],
)
def test_tev9_first_two_sampled_tokens_follow_the_target_law(hosts, prompt_ids, hf_model, params):
    """400 seeded requests (distinct sampling_seed: SGLang's seeded sampler draws the first
    token, TEV's seeded uniforms the second) against the exact law of the first two tokens."""
    check_first_two_tokens(_tev9(hosts), prompt_ids[4], hf_model, params, seeded=True)


def test_tev9_min_p_under_deterministic_inference_is_refused_and_the_engine_serves_on(hosts, prompt_ids, plain_greedy, hf_model):
    """This Engine runs with deterministic inference, where SGLang's own seeded sampler asserts on
    min-p and its scheduler exits (plain decoding too, seen on this harness): TEV's admission
    refuses the request by name, and the Engine serves the next one."""
    from sglang_tev.testing.sglang_cpu.hosts import EngineHost

    eng = _tev9(hosts)
    with pytest.raises(EngineHost.Error, match="min_p=0.05 with --enable-deterministic-inference"):
        eng.generate([prompt_ids[0]], [{"temperature": 1.0, "min_p": 0.05, "max_new_tokens": 8}])
    out = eng.generate([prompt_ids[0]], greedy_params(MAX_NEW[:1]))
    assert_same_ids(ids_of(out), plain_greedy[:1], prompt_ids, hf_model, "after a refused request")


def test_tev9_mixed_batch_keeps_greedy_rows_exact(hosts, prompt_ids, plain_greedy, hf_model):
    eng = _tev9(hosts)
    sps, ids = [], []
    for i, (p, n) in enumerate(zip(prompt_ids, MAX_NEW)):
        ids.append(p)
        sps.append({"temperature": 0, "max_new_tokens": n})
        ids.append(p)
        sps.append({"temperature": 1.0, "top_k": 40, "max_new_tokens": n, "sampling_seed": i})
    out = eng.generate(ids, sps)
    assert_same_ids(ids_of(out[0::2]), plain_greedy, prompt_ids, hf_model, "greedy rows of a mixed batch vs plain")


def _stop_cases(tokenizer, plain_ids):
    """Stops that fall inside TEV's accepted blocks: a stop token id and a stop string taken from
    the middle of plain greedy outputs, max_new_tokens 1 and 2, ignore_eos."""
    cases = []
    for i in (0, 2, 4):
        out = plain_ids[i]
        cases.append((i, {"temperature": 0, "max_new_tokens": 40, "stop_token_ids": [out[9]]}))
        text = tokenizer.decode(out[6:9])
        if text.strip():
            cases.append((i, {"temperature": 0, "max_new_tokens": 40, "stop": [text]}))
    for i in (1, 3):
        cases.append((i, {"temperature": 0, "max_new_tokens": 1}))
        cases.append((i, {"temperature": 0, "max_new_tokens": 2}))
        cases.append((i, {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}))
    return cases


def test_tev9_stops_end_where_plain_decoding_ends(hosts, prompt_ids, plain_refs):
    cases, want = plain_refs["stop_cases"], plain_refs["stops"]
    got = _tev9(hosts).generate([prompt_ids[i] for i, _ in cases], [sp for _, sp in cases])
    for (i, sp), g, w in zip(cases, got, want):
        assert g["output_ids"] == w["output_ids"], (i, sp)
        assert g["text"] == w["text"], (i, sp)
        assert g["meta_info"]["completion_tokens"] == w["meta_info"]["completion_tokens"], (i, sp)
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], (i, sp)
    # the cases really stopped early (not at max_new_tokens) where they were meant to
    reasons = [w["meta_info"]["finish_reason"]["type"] for w in want]
    assert reasons.count("stop") >= 4, reasons


# ---------------------------------------------------------------------- TEV, N = 65
def _tev65(hosts):
    hosts.close("tev9")
    return hosts.get("tev65", tev_kwargs(65))


def test_tev65_greedy_batch_equals_plain_and_hf(hosts, prompt_ids, plain_greedy, hf_greedy, hf_model):
    out = _tev65(hosts).generate(prompt_ids, greedy_params(MAX_NEW))
    assert_same_ids(ids_of(out), plain_greedy, prompt_ids, hf_model, "TEV N=65 vs SGLang plain")
    assert_matches_hf(ids_of(out), hf_greedy, prompt_ids, hf_model, "TEV N=65 vs HF")


def test_tev65_shared_prefix_hits_radix_cache(hosts, radix_prompts, plain_refs, hf_model):
    eng = _tev65(hosts)
    head, prompts = radix_prompts
    first = eng.generate(prompts, greedy_params([24] * len(prompts)))
    again = eng.generate(prompts, greedy_params([24] * len(prompts)))
    cached = [r["meta_info"].get("cached_tokens", 0) for r in again]
    assert min(cached) >= len(head) - 1, cached  # the radix cache served the shared prefix
    assert ids_of(first) == ids_of(again)
    assert_same_ids(ids_of(again), plain_refs["radix"], prompts, hf_model, "TEV with radix-cache hits vs plain")


def test_tev65_first_two_sampled_tokens_follow_the_min_p_law(hosts, prompt_ids, hf_model):
    """min-p on the N = 65 Engine, unseeded (SGLang's own seeded sampler refuses min-p on this
    path: ``srt/layers/sampler.py`` asserts "With sampling seed, multinomial_with_seed will provide
    wrong results", in plain decoding too)."""
    check_first_two_tokens(_tev65(hosts), prompt_ids[4], hf_model, {"temperature": 1.0, "min_p": 0.05}, seeded=False)


def test_runtimes_agree_round_by_round(hosts, prompt_ids, hf_model):
    """SGLang's TEV and the transformers runtime, same prompts, budget 64, bf16, greedy: the same
    tokens, and wherever both start a round at the same position, the same round.

    The two runtimes start differently: SGLang samples the first token in its prefill and roots
    its first tree at it; the transformers runtime roots its first tree at the last prompt token.
    So their round boundaries differ until both happen to start a round at the same position;
    there they hold the same committed context and root, build the same tree and accept the same
    path. Every such round is compared. The drafter's bf16 scores are computed by two codebases
    (SGLang's DFlash model and this project's), so a near-tie among the last nodes a budget admits
    can change a tree and its accept length without changing a token (seen on an AVX-512 CPU: one
    round of prompt 0); after such a round the boundaries meet again later. So at least 85 % of
    the rounds both start at one position must agree: a wrong position, mask or KV commit
    disagrees on nearly every round."""
    from sglang_tev.hf.runtime import SpeculativeGenerator

    out = _tev65(hosts).generate(prompt_ids, greedy_params(MAX_NEW))
    gen = SpeculativeGenerator.from_pretrained(TARGET, DRAFT, dtype=torch.bfloat16)  # the drafter SGLang serves here
    runs = [gen.generate(p, method="tev", budget=64, max_new_tokens=n) for p, n in zip(prompt_ids, MAX_NEW)]
    # the tokens: equal up to a bf16 near-tie (the two runtimes' model code rounds differently)
    assert_same_ids([list(r.token_ids) for r in runs], ids_of(out), prompt_ids, hf_model, "transformers runtime vs SGLang")
    assert_rounds_agree(out, runs, prompt_ids, min_same=20)


def test_startup_log_is_clean(hosts):
    """The two start-up warnings of the first tried run are gone: DFlash's block-size mismatch
    (TEV sizes the drafter's block itself) and the deprecated supports_overlap=False."""
    log = open(_tev65(hosts).log.name, errors="replace").read()
    assert "block size mismatch" not in log and "supports_overlap=False" not in log


# ---------------------------------------------------------------------- other verifiers
@pytest.mark.parametrize("verifier", ["predraw", "sequential"])
def test_other_verifiers_greedy_and_mixed(hosts, prompt_ids, plain_greedy, hf_model, verifier):
    hosts.close("tev65")
    for name in ("predraw", "sequential"):
        if name != verifier:
            hosts.close(name)
    eng = hosts.get(verifier, tev_kwargs(17), env={"SGLANG_TEV_VERIFIER": verifier})
    out = eng.generate(prompt_ids, greedy_params(MAX_NEW))
    assert_same_ids(ids_of(out), plain_greedy, prompt_ids, hf_model, f"{verifier} N=17 vs plain")
    # greedy rows next to sampled rows: the verifier runs with per-row temperatures
    mixed = eng.generate(
        prompt_ids[:4] * 2,
        greedy_params(MAX_NEW[:4]) + [{"temperature": 1.0, "max_new_tokens": n} for n in MAX_NEW[:4]],
    )
    assert_same_ids(ids_of(mixed[:4]), plain_greedy[:4], prompt_ids, hf_model, f"{verifier}: greedy rows of a mixed batch")
    hosts.close(verifier)


# ---------------------------------------------------------------------- load-adaptive trees
@pytest.mark.parametrize("mode", ["auto", "auto-ragged"])
def test_auto_budget_keeps_plain_decodings_tokens_and_the_law(hosts, prompt_ids, plain_greedy, hf_model, mode):
    """SGLANG_TEV_BUDGET=auto / auto-ragged with capacity N = 17: each round's width comes from the
    planner (calibration first: the capacity, plain decoding, a middle width; under auto-ragged
    each request's tree then cut to its own size, verified in one ragged forward), and greedy
    rows, in a greedy batch or next to sampled rows, keep plain decoding's tokens; every round
    comes back with its budget; the seeded first two tokens follow the target law."""
    for name in list(hosts.hosts):
        hosts.close(name)
    env = {"SGLANG_TEV_BUDGET": mode}
    if mode == "auto-ragged":
        # the harness cuts tree rounds to per-request sizes (SGLANG_TEV_RAGGED_CUTS): the planner's
        # own cuts follow measured seconds, and a loaded machine may make none in a short test
        env["SGLANG_TEV_RAGGED_CUTS"] = "1"
    eng = hosts.get(mode, tev_kwargs(17), env=env)
    out = eng.generate(prompt_ids, greedy_params(MAX_NEW))
    assert_same_ids(ids_of(out), plain_greedy, prompt_ids, hf_model, f"{mode} (N=17) vs plain")
    budgets = [b for o in out for b in o["meta_info"]["tev_budget"]]
    assert all(len(o["meta_info"]["tev_budget"]) == o["meta_info"]["spec_verify_ct"] for o in out)
    # 0: plain steps (SGLang's DECODE forward), calibrated right after the capacity
    assert 0 in budgets and len(set(budgets)) >= 2 and all(0 <= b <= 16 for b in budgets), sorted(set(budgets))
    if mode == "auto":  # one width per round, from the grid
        assert set(budgets) <= {0, 2, 4, 8, 16}, sorted(set(budgets))
    else:  # tev_cpu takes ragged verifies: requests' trees cut to their own sizes, off the width grid
        assert set(budgets) - {0, 2, 4, 8, 16}, sorted(set(budgets))
    mixed = eng.generate(
        prompt_ids[:4] * 2,
        greedy_params(MAX_NEW[:4]) + [{"temperature": 1.0, "max_new_tokens": n} for n in MAX_NEW[:4]],
    )
    assert_same_ids(ids_of(mixed[:4]), plain_greedy[:4], prompt_ids, hf_model, f"{mode}: greedy rows of a mixed batch")
    check_first_two_tokens(eng, prompt_ids[4], hf_model, {"temperature": 1.0, "top_p": 0.8}, seeded=True)
    hosts.close(mode)


# ---------------------------------------------------------------------- negative control
def test_negative_control_tree_mask_ignored_fails(hosts, prompt_ids, plain_greedy):
    """The same greedy test with the CPU backend told to ignore the tree mask must fail: the
    tests above really exercised the mask."""
    eng = hosts.get("ignore-mask", tev_kwargs(65), env={"SGLANG_TEV_CPU_ATTN_IGNORE_MASK": "1"})
    out = eng.generate(prompt_ids, greedy_params(MAX_NEW))
    bad = [i for i, (g, w) in enumerate(zip(ids_of(out), plain_greedy)) if g != w]
    assert len(bad) >= 3, f"ignoring the tree mask changed only prompts {bad}"
