"""DFlash2 draft modes side by side in the transformers runtime (issue 28 item 2): lattice vs
marginal trees at the same budget, and the selector chain vs the per-depth argmax chain.

The drafter is the shipped tiny-code drafter (DFlash v1, trained) re-dressed as a DFlash2
checkpoint exactly as ``tests/runtime/test_dflash2.py::_shipped_as_dflash2`` does: its weights, a
near-identity grouped conv, an untrained random candidate selector (k = 8, rank 8), an
order-preserving logit transform (x0.9, softcap 40). Acceptance stays a trained drafter's, so rounds
are realistic; the selector is untrained, so tau differences between modes say nothing about
DFlash2's selector: what this measures is the cost of each mode (stage times) at equal budget.

Each of ``--runs`` passes is one :func:`sglang_tev.hf.bench.run_bench` call over every
(method, budget, T, draft mode) with ``repeats=1`` (a mode's lattice and marginal configurations
run back to back, so load bursts on a shared machine hit both); the table reports, per
configuration, the median over passes of the mean ms per round of the draft and build stages,
their sum ("drafting"), tau, and tokens/s. ``lattice / marginal`` = drafting-time ratio at the
same (method, budget, T), computed per pass then the median taken.

    OMP_NUM_THREADS=1 python benchmarks/dflash2_modes.py --threads 1 --limit 8 --runs 3 \\
        --out benchmarks/results/dflash2-modes-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def shipped_as_dflash2(out_dir: Path) -> tuple[Path, Path]:
    """(target dir, re-dressed DFlash2 draft dir) of the shipped tiny-code pair
    (``sglang_tev.testing.dflash2``, the drafter the tests use)."""
    from sglang_tev.testing.dflash2 import shipped_as_dflash2 as redress

    target_dir, draft2, _ = redress(out_dir)
    return target_dir, draft2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=8, help="HumanEval prompts (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="JSON output (default: print only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    from sglang_tev.hf.bench import run_bench
    from sglang_tev.hf.datasets import load_prompts
    from sglang_tev.hf.runtime import SpeculativeGenerator

    hf_logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp(prefix="dflash2-modes-"))
    target_dir, draft_dir = shipped_as_dflash2(tmp)
    gen = SpeculativeGenerator.from_pretrained(target_dir, draft_dir, dtype=torch.float32, device="cpu")
    prompts = load_prompts("humaneval", args.limit)
    passes = []
    for i in range(args.runs):
        t0 = time.perf_counter()
        recs = run_bench(gen, prompts, budgets=args.budgets, temperatures=args.temperatures,
                         max_new_tokens=args.max_new_tokens, methods=["chain", "tev"],
                         draft_modes=["lattice", "marginal"], repeats=1, output_dir=None, progress=False,
                         warmup=(i == 0), log=lambda m: None)
        passes.append(recs)
        print(f"pass {i + 1}/{args.runs}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    def key(r):
        return r["method"], r["budget"], r["temperature"], r["draft_mode"]

    rows = []
    for r0 in passes[0]:
        k = key(r0)
        same = [next(r for r in p if key(r) == k) for p in passes]
        med = lambda f: statistics.median(f(r) for r in same)  # noqa: E731
        rows.append({
            "method": k[0], "budget": k[1], "temperature": k[2], "draft_mode": k[3],
            "draft_ms": med(lambda r: r["stage_ms"]["draft"]), "build_ms": med(lambda r: r["stage_ms"]["build"]),
            "drafting_ms": med(lambda r: r["stage_ms"]["draft"] + r["stage_ms"]["build"]),
            "round_ms": med(lambda r: sum(r["stage_ms"].values())),
            "tau": med(lambda r: r["tau"]), "tokens_per_s": med(lambda r: r["tokens_per_s"]),
        })
    for row in rows:  # drafting-time ratio lattice / marginal, per pass, median
        if row["draft_mode"] != "lattice":
            continue
        ratios = []
        for p in passes:
            lat = next(r for r in p if key(r) == (row["method"], row["budget"], row["temperature"], "lattice"))
            mar = next(r for r in p if key(r) == (row["method"], row["budget"], row["temperature"], "marginal"))
            f = lambda r: r["stage_ms"]["draft"] + r["stage_ms"]["build"]  # noqa: E731
            ratios.append(f(lat) / f(mar))
        row["drafting_lattice_over_marginal"] = statistics.median(ratios)
        row["drafting_ratio_per_pass"] = ratios

    import transformers

    import sglang_tev
    from sglang_tev.machine import machine_info

    report = {
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info("platform", processor="cpu", cpu_count="cpu_count", torch_threads="torch_threads",
                                load_average="load_average"),
        "versions": {"sglang_tev": sglang_tev.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "settings": {"prompts": f"humaneval[:{args.limit}]", "max_new_tokens": args.max_new_tokens,
                     "budgets": args.budgets, "temperatures": args.temperatures, "runs": args.runs,
                     "block_size": gen.drafter.block_size, "selector_top_k": 8, "chat_template": True},
        "rows": rows,
    }
    head = (f"{'method':7} {'B':>3} {'T':>3} {'mode':9} {'draft ms':>9} {'build ms':>9} {'drafting':>9} "
            f"{'ratio':>6} {'round ms':>9} {'tau':>6} {'tok/s':>7}")
    print(head)
    for r in rows:
        ratio = r.get("drafting_lattice_over_marginal")
        print(f"{r['method']:7} {r['budget'] if r['budget'] is not None else '-':>3} {r['temperature']:>3g} "
              f"{r['draft_mode']:9} {r['draft_ms']:9.2f} {r['build_ms']:9.2f} {r['drafting_ms']:9.2f} "
              f"{'' if ratio is None else f'{ratio:.2f}':>6} {r['round_ms']:9.2f} {r['tau']:6.2f} {r['tokens_per_s']:7.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
