"""What the Engine and server tests check, shared by the modules of this folder: the Engine
tests' prompts and lengths, greedy ids equal up to bf16 near-ties, round-by-round agreement with
the transformers runtime, and the first-two-token law by chi-square."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_tev.testing.sglang_cpu import engine_prompts
from sglang_tev.testing.sglang_cpu.hosts import first_divergence

PROMPTS = engine_prompts()
MAX_NEW = [48, 40, 32, 24, 48, 17, 33, 9, 40]


def greedy_params(max_new):
    return [{"temperature": 0, "max_new_tokens": n} for n in max_new]


def ids_of(results):
    return [r["output_ids"] for r in results]


TIE = 0.25
"""Largest HF logit gap (bf16 target) between two tokens that bf16 rounding may swap: two bf16
steps at |logit| ~ 16. SGLang's model code and HF's round differently, and one batch shape
differently from another (SGLang's CPU path is not batch-invariant), so a near-tie can flip
between any two runs; anything wider is a real difference."""


def assert_same_ids(got, want, prompts, model, what, max_flips=None):
    """Equal ids, except that sequences may first differ at a near-tie of the bf16 target's law
    (HF logits at that point, gap <= :data:`TIE`); the rest of such a sequence follows another
    prefix and is not compared. Lengths must agree where no flip happened.

    The gap check is the test: a bug that makes a sequence diverge lands on a near-tie only if the
    divergence happens to fall on one of the few tied positions (~1 % of these tokens). How many
    near-ties flip depends on batch shapes, which depend on the scheduler's timing (two exact ties
    flipped between TEV and plain under a loaded machine), so ``max_flips`` (default: a third of
    the sequences, at least 2) only bounds a bug that would systematically choose tied tokens."""
    if max_flips is None:
        max_flips = max(2, len(want) // 3)
    flips = []
    for i, (g, w) in enumerate(zip(got, want)):
        k = first_divergence(g, w)
        if k is None:
            continue
        assert k < min(len(g), len(w)), f"{what}: prompt {i} stops at another length ({len(g)} vs {len(w)})"
        with torch.no_grad():
            logits = model(torch.tensor([list(prompts[i]) + w[:k]])).logits[0, -1].float()
        gap = abs(float(logits[w[k]] - logits[g[k]]))
        assert gap <= TIE, f"{what}: prompt {i} token {k}: {w[k]} vs {g[k]}, logit gap {gap:.3f} > {TIE}"
        flips.append((i, k, round(gap, 4)))
    assert len(flips) <= max_flips, f"{what}: near-tie flips {flips}"
    assert len(got) == len(want)


def assert_matches_hf(got, want, prompt_ids, model, what):
    """SGLang ids equal HF's, up to near-tie flips (see :func:`assert_same_ids`)."""
    assert_same_ids(got, want, prompt_ids, model, what)


def round_agreement(out, runs, prompt_ids):
    """Compare SGLang's TEV rounds (``out``: Engine results with ``meta_info.tev_accept_length``)
    with the transformers runtime's (``runs``: :class:`GenerationResult` s) wherever both start a
    round at the same position; returns (prompts with at least one such round, rounds that agree,
    [(prompt, HF round, SGLang round, HF emitted, SGLang emitted)] that do not).

    SGLang samples the first token in its prefill and roots its first tree at it (position
    len(prompt)); the transformers runtime roots its first tree at the last prompt token
    (len(prompt) - 1). Prompts whose tokens differ (a near-tie flip) are skipped: their later
    rounds follow other contexts. The last round of each side is left out: SGLang reports the
    verifier's block, which the scheduler then cuts at max_new_tokens; the runtime reports what it
    emitted after the cut."""
    aligned, same, differ = 0, 0, []
    for i, (o, res) in enumerate(zip(out, runs)):
        if list(res.token_ids) != o["output_ids"]:
            continue
        n = len(prompt_ids[i])
        sgl = o["meta_info"]["tev_accept_length"]  # tokens emitted per round, root at n + sum(before)
        hf = [r.emitted for r in res.rounds]  # first root: the last prompt token, at n - 1
        sgl_starts = {n + sum(sgl[:k]): k for k in range(len(sgl))}
        hf_starts = {n - 1 + sum(hf[:j]): j for j in range(len(hf))}
        pairs = [(hf_starts[q], sgl_starts[q]) for q in sorted(set(hf_starts) & set(sgl_starts))]
        pairs = [(j, k) for j, k in pairs if j < len(hf) - 1 and k < len(sgl) - 1]
        aligned += bool(pairs)
        for j, k in pairs:
            if hf[j] == sgl[k]:
                same += 1
            else:
                differ.append((i, j, k, hf[j], sgl[k]))
    return aligned, same, differ


def assert_rounds_agree(out, runs, prompt_ids, *, min_same, min_aligned=3, share=0.85):
    """At least ``min_aligned`` prompts start a round at the same position in both runtimes, and
    of all such rounds at least ``min_same`` and at least ``share`` accept the same number of
    tokens (see :func:`round_agreement`; the allowance is for bf16 near-ties in the drafter's
    scores, which the two codebases round differently)."""
    aligned, same, differ = round_agreement(out, runs, prompt_ids)
    assert aligned >= min_aligned, f"only {aligned} prompts ever started a round at the same position"
    assert same >= min_same and same >= share * (same + len(differ)), (
        f"{same} rounds agree; (prompt, HF round, SGLang round, HF, SGLang): {differ}")
    return aligned, same, differ


def first_two_law(model, prompt, sampling, counts_n):
    """Exact law of the first two tokens under ``sampling`` (this project's processed law, which
    equals SGLang's sampler order): {(x1, x2): p}, for every x1 with n * p(x1) >= 1."""
    from sglang_tev.sampling import processed_probs

    with torch.no_grad():
        p1 = processed_probs(model(torch.tensor([prompt])).logits[:, -1].float(), sampling)[0].double()
        firsts = [int(t) for t in torch.nonzero(p1 * counts_n >= 1).flatten()]
        rows = torch.tensor([prompt + [t] for t in firsts])
        p2 = processed_probs(model(rows).logits[:, -1].float(), sampling).double()
    law = {}
    for i, t in enumerate(firsts):
        for u in torch.nonzero(p2[i] > 0).flatten().tolist():
            law[(t, u)] = float(p1[t] * p2[i, u])
    return law


def chi_square_p(samples, law):
    """Pearson chi-square p-value of ``samples`` (list of (x1, x2)) against ``law``; cells with
    expected count < 5 are merged into one (with all the mass the law does not list)."""
    from collections import Counter

    from scipy.stats import chisquare

    n = len(samples)
    counts = Counter(samples)
    big = {c: p for c, p in law.items() if n * p >= 5}
    obs = [counts.get(c, 0) for c in big]
    exp = [n * p for p in big.values()]
    rest_obs = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp >= 1e-9:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        assert rest_obs == 0, "samples outside the law's support"
    exp = [e * n / sum(exp) for e in exp]
    return chisquare(obs, exp).pvalue


def check_first_two_tokens(eng, prompt, model, params, seeded):
    from sglang_tev import SamplingParams

    n = 400
    sps = [dict(params, max_new_tokens=2, ignore_eos=True) for _ in range(n)]
    if seeded:
        for i, sp in enumerate(sps):
            sp["sampling_seed"] = 10_000 + i
    out = eng.generate([prompt] * n, sps)
    samples = [tuple(o["output_ids"][:2]) for o in out]
    assert all(len(s) == 2 for s in samples)
    # the second token comes out of TEV's first round (its exit node / bonus), not the prefill
    assert all(len(o["meta_info"].get("tev_accept_length", [])) >= 1 for o in out)
    sampling = SamplingParams(
        temperature=params["temperature"], top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0), min_p=params.get("min_p", 0.0)
    )
    law = first_two_law(model, prompt, sampling, n)
    p = chi_square_p(samples, law)
    assert p > 1e-6, f"chi-square p = {p:.2e}"
    assert len(set(samples)) > 3  # really sampled


class PenalisedModel:
    """The HF target whose last-position logits carry a case's penalties (for the near-tie check
    of ``assert_same_ids``): the outputs are what follows the prompt of ``prompts`` it extends."""

    def __init__(self, model, prompts, params):
        self.model, self.prompts, self.params = model, prompts, params

    def __call__(self, ids):
        seq = ids[0].tolist()
        (i,) = [i for i, p in enumerate(self.prompts) if seq[: len(p)] == list(p)]
        out = self.model(ids).logits.clone()
        out[0, -1] = penalise(out[0, -1], seq[len(self.prompts[i]) :], self.params[i])
        return SimpleNamespace(logits=out)


EOS = 0  # the tiny target's eos (SGLang's min-new-tokens penalizer holds it back too)


def penalise(logits, outputs, params):
    """SGLang's penalties (``sampling/penaltylib``) on one row of logits after ``outputs`` (the
    generated tokens; the prompt never counts): frequency, presence and min-new-tokens added, then
    repetition scaling."""
    x = logits.float().clone()
    counts = torch.zeros_like(x)
    for t in outputs:
        counts[t] += 1
    seen = counts > 0
    p = params.get("repetition_penalty", 1.0)
    x -= params.get("frequency_penalty", 0.0) * counts + params.get("presence_penalty", 0.0) * seen.float()
    if len(outputs) < params.get("min_new_tokens", 0):
        x[list({EOS, *params.get("stop_token_ids", [])})] = float("-inf")
    return torch.where(seen, torch.where(x < 0, x * p, x / p), x)
