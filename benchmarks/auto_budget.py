#!/usr/bin/env python
"""``--budget auto`` against plain decoding and fixed budgets (issue 29), on the shipped pair.

One process, the generator loaded once; every configuration is warmed up once (untimed; auto's
controller and cost table then carry over, as in a server or a long session), then ``--runs``
interleaved sweeps time each configuration in turn (same minute, in an order shuffled per sweep), and the median tokens/s per
configuration is reported with the budgets auto chose. Batch 1: the README's prompt. Batch b > 1:
the first b HumanEval prompts decoded as one batch.

    python benchmarks/auto_budget.py --out benchmarks/results/auto-budget-cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSON results")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--budgets", default="auto,4,8,16,32,64")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="the sweeps' order (shuffled per sweep)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights dtype (default: the runtime's, hf.runtime.default_dtype)")
    args = p.parse_args(argv)

    import torch

    from sglang_tev.hf.datasets import load_prompts
    from sglang_tev.hf.runtime import SpeculativeGenerator
    from sglang_tev.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.from_pretrained(dtype=None if args.dtype is None else getattr(torch, args.dtype))
    readme = "def fibonacci(n):"
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    he = [x.text if hasattr(x, "text") else x for x in load_prompts("humaneval")][:max(sizes)]
    budgets = ["plain"] + [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    rows = []
    for bs in sizes:
        prompts = [readme] if bs == 1 else he[:bs]
        for t in [float(x) for x in args.temperatures.split(",")]:
            sp = SamplingParams(temperature=t)

            def run(b, seed):
                kw = dict(sampling=sp, seed=seed, max_new_tokens=args.max_new_tokens, ignore_eos=True,
                          chat_template=False)
                kw.update(method="autoregressive") if b == "plain" else kw.update(budget=b)
                t0 = time.perf_counter()
                res = gen.generate(prompts if bs > 1 else prompts[0], **kw)
                dt = time.perf_counter() - t0
                res = res if isinstance(res, list) else [res]
                return sum(len(r.token_ids) for r in res) / dt, res

            for b in budgets:
                run(b, 10_000)  # warm-up (auto: its controller and costs carry over)
            rates = {b: [] for b in budgets}
            chosen = {b: Counter() for b in budgets}
            taus = {b: [] for b in budgets}
            plain_share = []  # per timed auto run: the share of its rounds that were plain decoding
            order = random.Random(args.seed)
            for i in range(args.runs):
                sweep = list(budgets)
                order.shuffle(sweep)  # no configuration always runs first or right after another
                for b in sweep:
                    rate, res = run(b, i)
                    rates[b].append(rate)
                    rounds = [r for x in res for r in x.rounds]
                    taus[b].append(sum(r.emitted for r in rounds) / max(1, len(rounds)))
                    if b == "auto":
                        chosen[b].update(r.budget for r in rounds)
                        plain_share.append(sum(r.budget == 0 for r in rounds) / max(1, len(rounds)))
            fixed = [b for b in budgets if b != "auto"]
            best_fixed = max(fixed, key=lambda b: statistics.median(rates[b]))
            for b in budgets:
                med = statistics.median(rates[b])
                # the ratio within each sweep (same minute), then its median: load that drifts
                # between sweeps cancels
                ratios = [x / y for x, y in zip(rates[b], rates["plain"])]
                paired = statistics.median(ratios)
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [paired, paired, paired]
                rows.append({"batch": bs, "temperature": t, "budget": b, "tokens_per_s": med,
                             "runs": [round(x, 1) for x in rates[b]], "vs_plain": paired,
                             "vs_plain_iqr": [q[0], q[2]],
                             "tau": statistics.median(taus[b]),
                             "budgets_chosen": dict(sorted(chosen[b].items())) if b == "auto" else None,
                             "best_fixed": best_fixed if b == "auto" else None,
                             "plain_share_per_run": [round(x, 3) for x in plain_share] if b == "auto" else None,
                             "vs_best_fixed": statistics.median(x / y for x, y in zip(rates[b], rates[best_fixed]))
                             if b == "auto" else None})
                print(f"batch {bs} T={t:g} {str(b):>6}: {med:7.1f} tok/s  x{paired:.2f} plain (IQR {q[0]:.2f}-{q[2]:.2f})  tau "
                      f"{statistics.median(taus[b]):.2f}" + (f"  x{rows[-1]['vs_best_fixed']:.2f} best fixed ({best_fixed})  chose "
                                                         f"{dict(chosen[b].most_common(6))}; plain rounds per run {[round(x, 2) for x in plain_share]}"
                                                         if b == "auto" else ""),
                      flush=True)
    from sglang_tev.machine import machine_info
    meta = {"command": " ".join([sys.executable, *sys.argv]),
            **machine_info(machine="cpu", cores="cpu_count", threads="torch_threads", torch="torch",
                           transformers="transformers", cpu_model="cpu_model", cpu_bf16="cpu_bf16"),
            "dtype": gen.dtype_name,
            "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
