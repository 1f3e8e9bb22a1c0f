"""Median latency of each verifier's decision (paper §6.2 / Appendix D.1 setting).

The tree is fixed per budget (built by DDTree from random draft logits at depth 15), and the
target logits of the 1 + B tree nodes are random. What is timed is one ``verify_tree`` call with
``validate=False``: processed target law, the method's decision, path and bonus. The target forward
and the KV commit are excluded.

    python benchmarks/verifier.py                       # CPU (and CUDA when present)
    python benchmarks/verifier.py --budgets 64 --vocabs 151936 --device cuda --repeats 200

Prints a table and writes JSON, by default to ``bench-results/verifier-<device>-<UTC date-time>.json``
under the current directory, so a rerun never replaces the committed
``benchmarks/results/verifier-cpu.json``; an existing ``--out`` is refused unless ``--overwrite``
(to update the committed file: ``--out benchmarks/results/verifier-cpu.json --overwrite``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import sglang_tev
from sglang_tev import SamplingParams, build_ddtree, verify_tree


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn, device: str, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="32,64,128")
    ap.add_argument("--vocabs", default="32000,151936")
    ap.add_argument("--temperatures", default="1.0")
    ap.add_argument("--methods", default="tev,predraw,sequential,greedy")
    ap.add_argument("--device", default=None, help="cpu, cuda, or both (default: cpu, plus cuda when present)")
    ap.add_argument("--dtype", default=None, help="target logits dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench-results/verifier-<device>-<UTC date-time>.json); with several "
                    "devices, <device> is inserted before the suffix")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)

    devices = [args.device] if args.device else (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    budgets = [int(x) for x in args.budgets.split(",")]
    vocabs = [int(x) for x in args.vocabs.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    methods = args.methods.split(",")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())

    def out_path(device: str) -> str:
        if args.out is None:
            return os.path.join("bench-results", f"verifier-{device}-{stamp}.json")
        if len(devices) == 1:
            return args.out
        root, ext = os.path.splitext(args.out)
        return f"{root}-{device}{ext}"

    for device in devices:  # checked before anything is measured
        if os.path.exists(out_path(device)) and not args.overwrite:
            print(f"{ap.prog}: error: argument --out: {out_path(device)} exists; pass --overwrite to replace it "
                  "(the default output never replaces a file)", file=sys.stderr)
            return 2
    for device in devices:
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
        repeats = args.repeats or (15 if device == "cpu" else 200)
        rows = []
        g = torch.Generator(device="cpu").manual_seed(0)
        for V in vocabs:
            for B in budgets:
                draft = torch.randn(1, 15, V, generator=g) * 4
                tree = build_ddtree(draft.to(device), B, torch.tensor([0], device=device))
                logits = (torch.randn(1, 1 + B, V, generator=g) * 4).to(device=device, dtype=dtype)
                for T in temps:
                    for m in methods:
                        t_eff = 0.0 if m == "greedy" else T
                        sp = SamplingParams(temperature=t_eff)
                        gen = torch.Generator(device=device).manual_seed(1)

                        def call():
                            return verify_tree(tree, logits, m, sampling=sp, generator=gen, validate=False)

                        us = time_call(call, device, repeats, warmup=3)
                        rows.append(dict(device=device, vocab=V, budget=B, temperature=t_eff, method=m, median_us=round(us, 1)))
                        print(f"{device:5s} V={V:<7d} B={B:<4d} T={t_eff:<4} {m:11s} {us:10.1f} us", flush=True)
        meta = dict(
            torch=torch.__version__,
            sglang_tev=sglang_tev.__version__,
            python=platform.python_version(),
            machine=platform.machine(),
            processor=platform.processor() or platform.machine(),
            cpu_threads=torch.get_num_threads(),
            gpu=torch.cuda.get_device_name() if device.startswith("cuda") else None,
            dtype=str(dtype),
            repeats=repeats,
        )
        out = out_path(device)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)
        # short table last
        print(f"\nverifier decision, median us ({device}, {dtype}, {meta['cpu_threads']} threads, torch {torch.__version__})")
        print(f"{'V':>7} {'B':>4} {'T':>4} " + " ".join(f"{m:>11}" for m in methods))
        for V in vocabs:
            for B in budgets:
                for T in temps:
                    cells = []
                    for m in methods:
                        want_t = 0.0 if m == "greedy" else T
                        r = next(r for r in rows if r["vocab"] == V and r["budget"] == B and r["method"] == m and r["temperature"] == want_t)
                        cells.append(f"{r['median_us']:>11.0f}")
                    print(f"{V:>7} {B:>4} {T:>4} " + " ".join(cells))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
