"""Median latency of each verifier's decision (paper §6.2 / Appendix D.1 setting).

The tree is fixed per budget (built by DDTree from random draft logits at depth 15), and the
target logits of the 1 + B tree nodes are random. What is timed is one ``verify_tree`` call with
``validate=False`` and pre-drawn uniforms: processed target law, the method's decision, path and
bonus. The target forward and the KV commit are excluded.

Methods: ``tev`` (torch reference, ``backend="torch"``), ``tev-triton`` (the fused kernel,
``backend="triton"``; CUDA only), ``predraw``, ``sequential``, ``greedy`` (T = 0).
CPU: wall-clock median of ``--repeats`` calls, methods called round-robin. CUDA: each call is captured once in a CUDA graph
and timed with CUDA events over ``--replays`` graph replays (median over ``--repeats`` such
windows, per call); a method that cannot be captured is timed eagerly with events (``graph``
false in the JSON).

    python benchmarks/verifier.py --threads 1                        # CPU (and CUDA when present)
    python benchmarks/verifier.py --device cuda                      # B 32/64/128, V 32000/151936,
                                                                     # T 0.6/1.0, batch 1 and 8

Prints a table and writes JSON, by default to ``bench-results/verifier-<device>-<UTC date-time>.json``
under the current directory, so a rerun never replaces the committed
``benchmarks/results/verifier-cpu.json``; an existing ``--out`` is refused unless ``--overwrite``
(to update the committed file: ``--out benchmarks/results/verifier-cpu.json --overwrite``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import sglang_tev
from sglang_tev import SamplingParams, build_ddtree, num_uniforms, verify_tree
from sglang_tev.machine import machine_info


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def time_interleaved(calls: dict, repeats: int, warmup: int) -> dict:
    """CPU: median wall-clock microseconds per call of each function, calling them round-robin."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times = {m: [] for m in calls}
    for _ in range(repeats):
        for m, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(t) * 1e6 for m, t in times.items()}


def _make_call(tree, logits, m: str, temperature: float, g: torch.Generator):
    """One verify_tree call of method label ``m`` (``tev-triton`` = tev with backend triton) with
    pre-drawn uniforms; greedy runs at T = 0."""
    sp = SamplingParams(temperature=0.0 if m == "greedy" else temperature)
    method, backend = ("tev", "triton") if m == "tev-triton" else (m, "torch")
    b, n = tree.batch_size, tree.num_nodes
    uni = torch.rand(b, num_uniforms(method, n), dtype=torch.float64, generator=g).to(logits.device)
    return lambda: verify_tree(tree, logits, method, sampling=sp, uniforms=uni, validate=False, backend=backend)


def time_cuda_graph(fn, repeats: int, replays: int) -> tuple[float, bool]:
    """Median microseconds per call of ``fn`` over CUDA-graph replays (events), or eager events
    when capture fails. Returns (us, captured)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run, captured = graph.replay, True
    except Exception:  # e.g. a host sync inside fn: time it eagerly
        torch.cuda.synchronize()
        run, captured = fn, False
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            run()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(per_call), captured


def decision_case(vocab: int, budget: int, batch: int, device, dtype, g: torch.Generator):
    """The timed inputs: a DDTree of ``budget`` nodes built from random draft logits
    (float32 [batch, 15, vocab] x 4) and random target logits ``dtype`` [batch, 1 + budget, vocab] x 4
    on ``device``, drawn from the CPU generator ``g``."""
    draft = torch.randn(batch, 15, vocab, generator=g) * 4
    tree = build_ddtree(draft.to(device), budget, torch.zeros(batch, dtype=torch.int64, device=device))
    logits = (torch.randn(batch, 1 + budget, vocab, generator=g) * 4).to(device=device, dtype=dtype)
    return tree, logits


def time_decisions(tree, logits, methods, temperature: float, g: torch.Generator, repeats: int,
                   replays: int, warmup: int = 3) -> dict:
    """Median microseconds of one decision per method label (see the module docstring) on
    (tree, logits) at ``temperature`` (greedy at T = 0): on CUDA each call captured in a CUDA graph
    and timed over ``replays`` replays (:func:`time_cuda_graph`), on CPU wall clock with the
    methods called round-robin (:func:`time_interleaved`, ``warmup`` rounds first).

    Returns:
        {method: (median_us, captured_in_a_cuda_graph)}.
    """
    calls = {m: _make_call(tree, logits, m, temperature, g) for m in methods}
    if logits.is_cuda:
        return {m: time_cuda_graph(c, repeats, replays) for m, c in calls.items()}
    # round-robin over the methods, so load bursts on a shared machine hit all alike
    return {m: (us, False) for m, us in time_interleaved(calls, repeats, warmup=warmup).items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="32,64,128")
    ap.add_argument("--vocabs", default="32000,151936")
    ap.add_argument("--temperatures", default=None, help="default 1.0 on CPU, 0.6,1.0 on CUDA")
    ap.add_argument("--batches", default=None, help="trees per call; default 1 on CPU, 1,8 on CUDA")
    ap.add_argument("--methods", default=None, help="default tev,predraw,sequential,greedy (+ tev-triton on CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--replays", type=int, default=50, help="CUDA: graph replays per timing window")
    ap.add_argument("--device", default=None, help="cpu, cuda, or both (default: cpu, plus cuda when present)")
    ap.add_argument("--dtype", default=None, help="target logits dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=None,
                    help="JSON path (default bench-results/verifier-<device>-<UTC date-time>.json); with several "
                    "devices, <device> is inserted before the suffix")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)

    devices = [args.device] if args.device else (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(x) for x in args.budgets.split(",")]
    vocabs = [int(x) for x in args.vocabs.split(",")]
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
        cuda = device.startswith("cuda")
        temps = [float(x) for x in (args.temperatures or ("0.6,1.0" if cuda else "1.0")).split(",")]
        batches = [int(x) for x in (args.batches or ("1,8" if cuda else "1")).split(",")]
        methods = (args.methods or ("tev,tev-triton,predraw,sequential,greedy" if cuda else "tev,predraw,sequential,greedy")).split(",")
        dtype = getattr(torch, args.dtype) if args.dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
        repeats = args.repeats or (15 if device == "cpu" else 20)
        rows = []
        g = torch.Generator(device="cpu").manual_seed(0)
        for V in vocabs:
            for B in budgets:
                for nb in batches:
                    tree, logits = decision_case(V, B, nb, device, dtype, g)
                    for T in temps:
                        # greedy ignores T: time it once
                        ms = [m for m in methods if not (m == "greedy" and T != temps[0])]
                        timed = time_decisions(tree, logits, ms, T, g, repeats, args.replays)
                        for m, (us, captured) in timed.items():
                            t_eff = 0.0 if m == "greedy" else T
                            rows.append(
                                dict(device=device, vocab=V, budget=B, batch=nb, temperature=t_eff, method=m,
                                     median_us=round(us, 1), cuda_graph=captured)
                            )  # fmt: skip
                            print(f"{device:5s} V={V:<7d} B={B:<4d} b={nb:<2d} T={t_eff:<4} {m:11s} {us:10.1f} us"
                                  + (" (graph)" if captured else ""), flush=True)  # fmt: skip
        meta = dict(
            torch=torch.__version__,
            sglang_tev=sglang_tev.__version__,
            **machine_info("python", machine="arch", processor="cpu", cpu_threads="torch_threads"),
            gpu=torch.cuda.get_device_name() if device.startswith("cuda") else None,
            triton=_triton_version(),
            timing="CUDA events over CUDA-graph replays" if cuda else "wall clock per call, methods round-robin",
            dtype=str(dtype),
            repeats=repeats,
        )
        out = out_path(device)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)
        # short table last
        print(f"\nverifier decision, median us ({device}, {dtype}, {meta['cpu_threads']} threads, torch {torch.__version__})")
        print(f"{'V':>7} {'B':>4} {'b':>2} {'T':>4} " + " ".join(f"{m:>11}" for m in methods))
        for V in vocabs:
            for B in budgets:
                for nb in batches:
                    for T in temps:
                        cells = []
                        for m in methods:
                            want_t = 0.0 if m == "greedy" else T
                            r = [r for r in rows if (r["vocab"], r["budget"], r["batch"], r["method"]) == (V, B, nb, m)
                                 and r["temperature"] == want_t]  # fmt: skip
                            cells.append(f"{r[0]['median_us']:>11.0f}" if r else f"{'-':>11}")
                        print(f"{V:>7} {B:>4} {nb:>2} {T:>4} " + " ".join(cells))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
