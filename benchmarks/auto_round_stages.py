"""Where an auto round's time goes, against fixed budgets and plain decoding, in one process.

For one prompt batch (the README prompt at batch 1, else the first HumanEval prompts), every mode
in ``--modes`` (``plain``, ``auto`` or a fixed budget) generates ``--max-new-tokens`` tokens, EOS
ignored, the modes interleaved ``--repeats`` times after one warm-up each (auto's cost table and
calibration carry over between its runs, as in a server). Per run: tokens/s, and per (budget,
tree nodes) of its rounds the median of each round stage the runtime times (``draft``, ``build`` —
under auto this includes the planner's cut —, ``tree_forward``, ``verify``, ``commit``; ms), so a
gap between auto and the fixed budget it converges to reads as draft, cut, forward or verify time.

    python benchmarks/auto_round_stages.py --modes 8,plain,auto --repeats 3 --max-new-tokens 384 \\
        --output benchmarks/results/auto-round-stages-cpu.json

Wall times move with the machine; compare modes within a repeat. The plan cache is the user's
(``SGLANG_TEV_CACHE`` points it elsewhere; ``--no-plan-cache`` starts auto from nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path


def _mode(text: str):
    if text in ("plain", "auto"):
        return text
    try:
        b = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a mode is plain, auto or a budget >= 1, got {text!r}") from None
    if b < 1:
        raise argparse.ArgumentTypeError(f"a fixed budget must be >= 1, got {b}")
    return b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="8,plain,auto", help="comma list of plain, auto and fixed budgets")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-plan-cache", action="store_true", help="auto starts from nothing")
    p.add_argument("--output", type=Path, default=None, help="JSON of every run")
    args = p.parse_args(argv)
    try:
        modes = [_mode(x.strip()) for x in args.modes.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(f"argument --modes: {e}")
    if not modes:
        p.error("argument --modes: at least one mode")
    for name in ("batch_size", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("argument --threads: must be >= 1 (leave it out for torch's default)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error("argument --temperature: a finite number >= 0")
    if args.output is not None:
        from sglang_tev.atomic import check_writable_file

        try:
            check_writable_file(args.output)
        except (ValueError, OSError) as e:
            p.error(f"argument --output: {e}")

    import torch

    from sglang_tev.hf.datasets import load_prompts
    from sglang_tev.hf.runtime import SpeculativeGenerator
    from sglang_tev.machine import machine_info
    from sglang_tev.sampling import SamplingParams

    prompts = (["def fibonacci(n):"] if args.batch_size == 1 else
               [x.text if hasattr(x, "text") else x for x in load_prompts("humaneval")])
    if args.batch_size > len(prompts):
        p.error(f"argument --batch-size: at most {len(prompts)} (the HumanEval prompts), got {args.batch_size}")
    prompts = prompts[:args.batch_size]
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = SpeculativeGenerator.from_pretrained(**({"plan_cache": False} if args.no_plan_cache else {}))
    sp = SamplingParams(temperature=args.temperature)

    def run(mode, seed):
        kw = dict(sampling=sp, seed=seed, max_new_tokens=args.max_new_tokens, ignore_eos=True, chat_template=False)
        if mode == "plain":
            kw["method"] = "autoregressive"
        else:
            kw["budget"] = mode
        t0 = time.perf_counter()
        res = gen.generate(prompts if args.batch_size > 1 else prompts[0], **kw)
        dt = time.perf_counter() - t0
        res = res if isinstance(res, list) else [res]
        rounds = res[0].rounds or []  # each row records the rounds it took part in: the first row's are read
        stages = defaultdict(lambda: defaultdict(list))
        for r in rounds:
            for k, v in (r.stage_ms or {}).items():
                stages[(r.budget, r.tree_nodes)][k].append(v)
        return {"mode": mode, "tokens_per_s": sum(len(x.token_ids) for x in res) / dt, "rounds": len(rounds),
                "stages_ms": {f"{b}/{n}": {"rounds": len(st["draft"]),
                                           **{k: round(statistics.median(v), 3) for k, v in st.items()}}
                              for (b, n), st in sorted(stages.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))}}

    for m in modes:
        run(m, 10_000)  # warm-up
    runs = []
    for i in range(args.repeats):
        for m in modes:
            r = run(m, i)
            r["repeat"] = i
            runs.append(r)
            big = {k: v for k, v in r["stages_ms"].items() if v["rounds"] >= 5}
            print(f"repeat {i} {str(m):>5}: {r['tokens_per_s']:7.1f} tok/s  {r['rounds']} rounds", file=sys.stderr)
            for k, v in big.items():
                print(f"      budget/nodes {k:>7}: " + ", ".join(f"{s} {x}" for s, x in v.items()), file=sys.stderr)
    ref = modes[0]
    print(f"\ntokens/s ratio to {ref} per repeat (median):")
    for m in modes[1:]:
        rs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in
              zip([r for r in runs if r["mode"] == m], [r for r in runs if r["mode"] == ref])]
        print(f"  {m}: {', '.join(f'{x:.2f}' for x in rs)} (median {statistics.median(rs):.2f})")
    if args.output is not None:
        from sglang_tev.atomic import atomic_write

        atomic_write(args.output, json.dumps({"command": " ".join([sys.executable, *sys.argv]), "machine": machine_info("cpu_model", "cpu_count", "cpu_bf16", "platform", "python", "torch", "transformers", "torch_threads"),
                                        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
                                        "batch_size": args.batch_size, "temperature": args.temperature,
                                        "max_new_tokens": args.max_new_tokens, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
