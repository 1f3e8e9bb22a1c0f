"""``sglang-tev tune``: the tokens/s-optimal budget (and verifier) per batch size on this machine.

For each batch size and temperature, every budget of the grid is decoded on the same prompts with
the same model pair, interleaved (one sweep over the budgets, then the next sweep: load that
drifts over minutes touches every budget alike), after one untimed warm-up sweep. Budget 0 is
plain decoding (``method="autoregressive"``, SGLang without speculation). Per configuration the
median tokens/s over the sweeps is kept, with tau (emitted tokens per round) and the ratio to
plain decoding within each sweep (its median).

The result, per (batch size, temperature): the budget and verifier of highest median ratio to
plain decoding within a sweep (of highest median tokens/s when plain decoding is not measured),
written as SGLang's ``--speculative-num-draft-tokens N`` (N = 1 + budget; budget 0: run without
speculation) and ``SGLANG_TEV_VERIFIER``; and a frozen :class:`~sglang_tev.costs.CostTable`
(seconds per round by batch size and budget at the first temperature measured: decode time /
rounds of each median run, the prefill left out) that
``generate(budget="auto")`` / ``sglang-tev generate --cost-table`` reads instead of timing rounds
itself (then seeded sampled runs repeat exactly).

What it measures is the transformers runtime of this package on this machine, with the models
given; SGLang's round differs in its costs (its attention kernels, CUDA graphs, overlap), not in
tau (the exit law is the same core), so on a GPU server the table is a starting point for the
``--speculative-num-draft-tokens`` sweep, not its result.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Sequence

from ..atomic import atomic_write
from ..machine import machine_info
from ..costs import CostTable

__all__ = ["run_tune", "format_tune", "TUNE_BUDGETS"]

TUNE_BUDGETS = (0, 4, 8, 16, 32, 64)
"""Budgets ``sglang-tev tune`` measures by default (0 = plain decoding)."""


def _check(batch_sizes, temperatures, budgets, verifiers, max_new_tokens, repeats, n_prompts) -> None:
    from ..spec import MAX_BUDGET, VERIFIERS

    if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be ints >= 1, got {list(batch_sizes)!r}")
    if max(batch_sizes) > n_prompts:
        raise ValueError(f"batch_sizes: the largest ({max(batch_sizes)}) needs that many prompts, got {n_prompts}")
    if not temperatures or any(not (isinstance(t, (int, float)) and 0 <= t < float("inf")) for t in temperatures):
        raise ValueError(f"temperatures must be finite numbers >= 0, got {list(temperatures)!r}")
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= MAX_BUDGET for b in budgets):
        raise ValueError(f"budgets must be ints in [0, {MAX_BUDGET}], got {list(budgets)!r}")
    if not any(b > 0 for b in budgets):
        raise ValueError(f"budgets must hold at least one tree budget > 0, got {list(budgets)!r}")
    if not verifiers or any(v not in VERIFIERS for v in verifiers):
        raise ValueError(f"verifiers must be from {list(VERIFIERS)}, got {list(verifiers)!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")


def run_tune(generator, prompts: Sequence, batch_sizes: Sequence[int] = (1, 8),
             temperatures: Sequence[float] = (0.0, 1.0), budgets: Sequence[int] = TUNE_BUDGETS,
             verifiers: Sequence[str] = ("tev",), max_new_tokens: int = 128, repeats: int = 3,
             seed: int = 0, chat_template: bool = True, progress=None) -> dict:
    """Measure every (batch size, temperature, verifier, budget) and pick the best per batch size.

    Args:
        generator: a :class:`~sglang_tev.hf.runtime.SpeculativeGenerator` with a drafter.
        prompts: at least ``max(batch_sizes)`` prompts; batch size b decodes the first b as one batch.
        batch_sizes, temperatures, budgets (0 = plain decoding), verifiers (tried at T > 0 only;
            at T = 0 every exact verifier accepts the same tokens and the first is used).
        max_new_tokens: tokens per prompt (EOS ignored, so every run decodes the same length).
        repeats: timed sweeps after the warm-up sweep.
        seed: sampled runs use ``seed + sweep``, the same for every budget of a sweep.
        chat_template: apply the tokenizer's chat template to text prompts (as ``generate``).
        progress: optional callable receiving one line per measured configuration.

    Returns:
        ``{"rows": [...], "best": [...], "cost_table": CostTable.to_json()}``: one row per
        configuration (``batch``, ``temperature``, ``verifier`` (None for plain), ``budget``,
        ``speculative_num_draft_tokens`` (None for plain), ``tokens_per_s`` (median),
        ``runs``, ``tau``, ``vs_plain`` (median within-sweep ratio)); ``best``: per (batch,
        temperature) the row of highest ``vs_plain`` (highest ``tokens_per_s`` when budget 0 was
        not measured).

    Raises:
        ValueError naming the argument for bad input (nothing is run then).
    """
    from ..sampling import SamplingParams

    batch_sizes, temperatures = [int(b) for b in batch_sizes], [float(t) for t in temperatures]
    budgets, verifiers = sorted(set(budgets)), list(dict.fromkeys(verifiers))
    _check(batch_sizes, temperatures, budgets, verifiers, max_new_tokens, repeats, len(prompts))
    if generator.drafter is None:
        raise ValueError("generator: tune needs a drafter (load one with --draft)")
    table = CostTable()
    rows, best = [], []
    for bs in batch_sizes:
        batch = list(prompts[:bs])
        for t in temperatures:
            sp = SamplingParams(temperature=t)
            configs = [(None, 0)] if 0 in budgets else []
            for v in (verifiers if t > 0 else verifiers[:1]):
                configs += [(v, b) for b in budgets if b > 0]

            def run(cfg, s):
                v, b = cfg
                kw = dict(method="autoregressive") if b == 0 else dict(method=v, budget=b)
                t0 = time.perf_counter()
                res = generator.generate(batch, sampling=sp, seed=s, max_new_tokens=max_new_tokens,
                                         ignore_eos=True, chat_template=chat_template, **kw)
                dt = time.perf_counter() - t0
                n_tok = sum(len(r.token_ids) for r in res)
                n_rounds = max(len(r.rounds) for r in res)  # rows of a batch share rounds
                # seconds per round without the prefill (which plain decoding's many rounds would
                # dilute more than a tree's few): the decode time the results report
                decode = max((len(r.token_ids) / r.tokens_per_s for r in res if r.tokens_per_s > 0), default=dt)
                return n_tok / dt, n_tok / max(1, sum(len(r.rounds) for r in res)), decode / max(1, n_rounds)

            for cfg in configs:
                run(cfg, seed)  # warm-up sweep: first shapes allocate
            meas = {c: [] for c in configs}
            for i in range(repeats):
                for cfg in configs:
                    meas[cfg].append(run(cfg, seed + i))
            plain = meas.get((None, 0))
            found = []
            for (v, b), ms in meas.items():
                rate = statistics.median(m[0] for m in ms)
                per_round = statistics.median(m[2] for m in ms)
                if t == temperatures[0] and (b == 0 or v == verifiers[0]):  # one table: the first T's
                    table.set(bs, b, per_round, len(ms))
                row = {"batch": bs, "temperature": t, "verifier": v, "budget": b,
                       "speculative_num_draft_tokens": None if b == 0 else b + 1,
                       "tokens_per_s": rate, "runs": [round(m[0], 2) for m in ms],
                       "tau": statistics.median(m[1] for m in ms),
                       "seconds_per_round": per_round,
                       "vs_plain": statistics.median(m[0] / p[0] for m, p in zip(ms, plain)) if plain else None}
                found.append(row)
                if progress:
                    progress(f"batch {bs} T={t:g} {'plain' if b == 0 else f'{v} B={b}'}: {rate:.1f} tok/s, "
                             f"tau {row['tau']:.2f}")
            rows += found
            # ranked by the within-sweep ratio to plain decoding when plain ran (load that drifts
            # between sweeps cancels), else by the median tokens/s
            best.append(max(found, key=lambda r: (r["vs_plain"], r["tokens_per_s"]) if plain else r["tokens_per_s"]))
    table.frozen = True
    return {"rows": rows, "best": best, "cost_table": table.to_json()}


def format_tune(result: dict) -> str:
    """The table ``sglang-tev tune`` prints: every configuration, the best per (batch, T) starred,
    then one SGLang line per best."""
    lines = [f"{'batch':>5} {'T':>4} {'verifier':>10} {'budget':>6} {'N':>4} {'tau':>5} {'tok/s':>8} {'vs plain':>8}"]
    best = {id(r) for r in result["best"]}
    for r in result["rows"]:
        n = "-" if r["speculative_num_draft_tokens"] is None else str(r["speculative_num_draft_tokens"])
        vs = "-" if r["vs_plain"] is None else f"{r['vs_plain']:.2f}x"
        lines.append(f"{r['batch']:>5} {r['temperature']:>4g} {r['verifier'] or 'plain':>10} {r['budget']:>6} {n:>4} "
                     f"{r['tau']:>5.2f} {r['tokens_per_s']:>8.1f} {vs:>8}" + ("  *" if id(r) in best else ""))
    lines.append("")
    for r in result["best"]:
        if r["budget"] == 0:
            how = "plain decoding (no --speculative-algorithm)"
        else:
            # tune timed fixed trees: SGLang's default sizes each round's tree from the load instead
            env = ["SGLANG_TEV_BUDGET=fixed"] + ([f"SGLANG_TEV_VERIFIER={r['verifier']}"] if r["temperature"] > 0 else [])
            how = (f"--speculative-algorithm TEV --speculative-num-draft-tokens {r['speculative_num_draft_tokens']}"
                   f"  ({', '.join(env)})")
        lines.append(f"batch {r['batch']}, T={r['temperature']:g}: {how}")
    return "\n".join(lines)


def tune_meta(argv: Sequence[str], dtype: str | None = None) -> dict:
    """Command, machine, versions and the weights' dtype (``"bfloat16"``; round times are a
    dtype's: ``generate --cost-table`` warns when it loads another) recorded beside the results."""
    return {"command": " ".join(["sglang-tev", *argv]),
            **machine_info("python", machine="cpu", cores="cpu_count", threads="torch_threads", torch="torch",
                           transformers="transformers", cuda="gpu"),
            "dtype": dtype,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_tune(path: Path, result: dict, meta: dict) -> None:
    """Write the JSON (meta, rows, best, cost_table) atomically: a failed write leaves no file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"meta": meta, **result}, indent=2) + "\n")
