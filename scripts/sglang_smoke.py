#!/usr/bin/env python
"""GPU smoke test of the SGLang plugin: ``sglang.Engine`` with and without TEV.

Needs a CUDA GPU and ``pip install "sglang-tev[sglang]"``. For each of: no speculation, DFLASH
(SGLang's linear block) and TEV, it starts an ``sglang.Engine`` on the given models (default: the
small pair shipped in ``sglang_tev/assets/tiny-code``), runs

1. a greedy batch of ``--batch`` prompts: TEV's (and DFLASH's) output token ids must equal the
   no-speculation ids for every prompt;
2. a batch of ``--batch`` requests with mixed sampling parameters (temperature 0 / 0.6 / 1.0,
   top-k, top-p, min-p, seeds, a regex grammar, a logit bias): every request must finish;

and prints tau (SGLang's ``spec_accept_length``: mean tokens per verify round) and tokens/s per
mode, plus TEV's per-request metrics when present. Exit code 0 when every check passes, 1 when
one fails, 2 when no CUDA GPU or sglang is available.

    python scripts/sglang_smoke.py
    python scripts/sglang_smoke.py --target Qwen/Qwen3-4B --draft z-lab/Qwen3-4B-DFlash-b16 --budget 64

This script is the only check of the worker's GPU path (``sglang_tev/srt/worker.py``); CI has no
GPU (see docs/sglang.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "sglang_tev" / "assets" / "tiny-code"

PROMPTS = [
    "def fibonacci(n):",
    "def quicksort(xs):",
    "class Stack:\n    def __init__(self):",
    "def read_lines(path):\n    with open(path) as f:",
    "import os\n\ndef walk_files(root):",
    "def binary_search(a, x):",
    "def merge(a, b):\n    out = []",
    "def is_prime(n):",
]


def mixed_sampling(n: int, seed: int) -> list[dict]:
    base = [
        dict(temperature=0.0),
        dict(temperature=0.6, top_p=0.9),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.8, min_p=0.05),
        dict(temperature=1.0, top_k=50, top_p=0.8, sampling_seed=seed),
        dict(temperature=0.7, regex="[a-z_ ]+\\("),  # a grammar: per-node vocabulary masks
        dict(temperature=0.9, logit_bias={"0": -100.0}),
        dict(temperature=1.2, top_p=0.95, sampling_seed=seed + 1),
    ]
    return [base[i % len(base)] for i in range(n)]


def run_mode(name: str, args, prompts: list[str]) -> dict:
    import sglang

    kwargs = dict(
        model_path=args.target,
        mem_fraction_static=args.mem_fraction,
        attention_backend=args.attention_backend,
        random_seed=args.seed,
        log_level="warning",
        tp_size=args.tp,
    )
    if name == "DFLASH":
        kwargs.update(speculative_algorithm="DFLASH", speculative_draft_model_path=args.draft)
    elif name == "TEV":
        kwargs.update(
            speculative_algorithm="TEV",
            speculative_draft_model_path=args.draft,
            speculative_num_draft_tokens=args.budget + 1,
        )
        if args.block_size:
            kwargs["speculative_dflash_block_size"] = args.block_size
        if args.max_depth:
            kwargs["speculative_num_steps"] = args.max_depth
    engine = sglang.Engine(**kwargs)
    try:
        greedy = dict(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
        engine.generate(prompts[:1], greedy)  # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(prompts, greedy)
        dt = time.perf_counter() - t0
        # token ids when SGLang returns them, else the text (never compare two missing values)
        ids = [o.get("output_ids") if o.get("output_ids") is not None else o["text"] for o in outs]
        toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
        taus = [o["meta_info"].get("spec_accept_length") for o in outs]
        mixed = [dict(s, max_new_tokens=args.max_new_tokens) for s in mixed_sampling(len(prompts), args.seed)]
        t1 = time.perf_counter()
        mouts = engine.generate(prompts, mixed)
        mdt = time.perf_counter() - t1
        mtoks = sum(o["meta_info"]["completion_tokens"] for o in mouts)
        mtaus = [o["meta_info"].get("spec_accept_length") for o in mouts]
        tev_meta = {k: v for k, v in mouts[0]["meta_info"].items() if "tev_" in k or k == "customized_info"}
        return dict(
            mode=name,
            greedy_ids=ids,
            greedy_texts=[o["text"] for o in outs],
            greedy_tok_s=toks / dt,
            greedy_tau=_mean(taus),
            mixed_finished=all(o["meta_info"].get("finish_reason") is not None for o in mouts),
            mixed_tok_s=mtoks / mdt,
            mixed_tau=_mean(mtaus),
            tev_meta_example=tev_meta,
        )
    finally:
        engine.shutdown()


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ASSETS / "target"))
    p.add_argument("--draft", default=str(ASSETS / "draft"))
    p.add_argument("--budget", type=int, default=64, help="B drafted nodes per tree (N = B + 1)")
    p.add_argument("--block-size", type=int, default=None, help="drafter block (default: the drafter's config)")
    p.add_argument("--max-depth", type=int, default=None, help="max tree depth (default: block size - 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--attention-backend", default="flashinfer", choices=["flashinfer", "triton"])
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="none,DFLASH,TEV", help="comma-separated subset of none,DFLASH,TEV")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    try:
        import sglang  # noqa: F401
        import torch
    except ImportError as e:
        print(f"sglang is not installed ({e}); pip install 'sglang-tev[sglang]'", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU: this smoke test needs one (the plugin's CPU logic is checked by pytest)", file=sys.stderr)
        return 2
    from sglang_tev.srt.plugin import register

    register()  # SGLang's load_plugins() does this too when the package is installed

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = {m: run_mode(m, args, prompts) for m in modes}

    ok = True
    print(f"target {args.target}\ndraft  {args.draft}\nbudget {args.budget}, batch {args.batch}, max_new_tokens {args.max_new_tokens}, "
          f"GPU {torch.cuda.get_device_name(0)}, sglang {sglang.__version__}, torch {torch.__version__}")  # fmt: skip
    print(f"{'mode':8s} {'greedy tau':>10s} {'greedy tok/s':>13s} {'mixed tau':>10s} {'mixed tok/s':>12s}  checks")
    for m, r in results.items():
        checks = []
        if m != "none" and "none" in results:
            diverged = [
                (i, first_divergence(a, b)) for i, (a, b) in enumerate(zip(r["greedy_ids"], results["none"]["greedy_ids"])) if a != b
            ]
            checks.append("greedy identical" if not diverged else f"greedy DIFFERS in {len(diverged)} prompts (prompt, token): {diverged}")
            ok &= not diverged
        checks.append("mixed batch finished" if r["mixed_finished"] else "mixed batch DID NOT FINISH")
        ok &= r["mixed_finished"]
        fmt = lambda x: f"{x:10.2f}" if x is not None else f"{'-':>10s}"  # noqa: E731
        print(f"{m:8s} {fmt(r['greedy_tau'])} {r['greedy_tok_s']:13.1f} {fmt(r['mixed_tau'])} {r['mixed_tok_s']:12.1f}  {'; '.join(checks)}")
    if "TEV" in results and results["TEV"]["tev_meta_example"]:
        print("TEV meta_info of request 0 (per round):", json.dumps(results["TEV"]["tev_meta_example"], default=str)[:2000])
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
