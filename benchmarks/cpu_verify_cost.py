"""What a verify forward of M tokens costs against one token, on this CPU, in fp32 and bf16.

Speculative decoding pays off when verifying a tree of M nodes costs little more than one plain
decoding step. On a GPU (and on a CPU with native bf16: ``avx512_bf16`` / ``amx_bf16``) that holds
for the shipped tiny pair up to M in the tens; on a CPU without native bf16 (e.g. an AVX2-only
EPYC) oneDNN runs bf16 GEMMs through conversions and the cost grows with M far faster than in
fp32, so every speculative mode of a bf16 CPU server loses to plain decoding for a reason a GPU
does not share. This script measures it with the shipped target in HF transformers: the median
wall time of one forward of M new tokens after a cached context (``--context``, default 200 tokens), one thread (the CPU
servers run with ``OMP_NUM_THREADS=1``).

Usage (from the repository root, on a quiet machine)::

    python benchmarks/cpu_verify_cost.py [--tokens 1,4,17,33,65] [--repeats 12] [--threads 1] \\
        [--output benchmarks/results/cpu-verify-cost.json]

Prints one row per dtype: ms at each M and the ratio to M = 1; the JSON adds the machine, the
CPU's bf16 flags, versions and the command.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,17,33,65", help="comma list of M (new tokens per forward)")
    ap.add_argument("--repeats", type=int, default=12, help="forwards timed per M; the median is kept (>= 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU servers run one)")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the M new ones")
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        tokens = [int(x) for x in args.tokens.split(",")]
    except ValueError:
        ap.error(f"argument --tokens: not a comma list of integers: {args.tokens!r}")
    if not tokens or min(tokens) < 1 or 1 not in tokens:
        ap.error("argument --tokens: positive integers, including 1 (the ratios are to M = 1)")
    tokens = sorted(set(tokens))
    if args.repeats < 3:
        ap.error("argument --repeats: at least 3 (a median)")
    if args.threads < 1:
        ap.error(f"argument --threads: at least 1, got {args.threads}")
    if args.context < 1:
        ap.error(f"argument --context: at least 1 cached token, got {args.context}")
    if args.output is not None:  # refused before minutes of measuring, not after
        from sglang_tev.atomic import check_writable_file

        try:
            check_writable_file(args.output)
        except ValueError as e:
            ap.error(f"argument --output: {e}")

    import torch
    from transformers import AutoModelForCausalLM

    from sglang_tev.hf.assets import ASSETS_DIR
    from sglang_tev.machine import machine_info

    torch.set_num_threads(args.threads)
    target = Path(ASSETS_DIR) / "target"
    limit = json.loads((target / "config.json").read_text()).get("max_position_embeddings")
    if limit and args.context + max(tokens) > limit:
        ap.error(f"argument --context: {args.context} + {max(tokens)} new tokens exceeds the target's {limit} positions")
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
        vocab = model.config.vocab_size
        ctx = torch.randint(0, vocab, (1, args.context), generator=gen)
        ms = {}
        with torch.inference_mode():
            cache = model(ctx, use_cache=True).past_key_values
            for m in tokens:
                x = torch.randint(0, vocab, (1, m), generator=gen)
                times = []
                for _ in range(args.repeats):
                    kv = copy.deepcopy(cache)  # every forward sees the same cached context
                    t0 = time.perf_counter()
                    model(x, past_key_values=kv, use_cache=True)
                    times.append(time.perf_counter() - t0)
                ms[m] = statistics.median(times) * 1e3
        rows[dtype] = {"ms": ms, "x_one_token": {m: ms[m] / ms[1] for m in tokens}}
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info("cpu_model", "cpu_count", "cpu_bf16", "platform", "python", "torch", "transformers"),
        "threads": args.threads, "context": args.context, "repeats": args.repeats, "tokens": tokens, "rows": rows,
    }
    print(f"CPU bf16 flags: {result['machine']['cpu_bf16'] or 'none'}; {args.threads} thread(s), {args.context}-token context")
    print(f"{'dtype':>9} " + " ".join(f"{'M=' + str(m):>16}" for m in tokens))
    for dtype, r in rows.items():
        print(f"{dtype:>9} " + " ".join(f"{r['ms'][m]:7.1f} ms ({r['x_one_token'][m]:4.1f}x)" for m in tokens))
    if args.output:
        from sglang_tev.atomic import atomic_write

        atomic_write(args.output, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
