"""Does SGLang 0.5.23's own DFLASH die on a greedy request that ends at (or near) the context length?

Starts ``sglang.Engine(speculative_algorithm="DFLASH")`` with the shipped tiny-code drafter (block
16) on the CPU test harness (``sglang_tev.testing.sglang_cpu``, ``tev_cpu`` attention) with a small
``context_length``, and for each end position E sends ONE greedy ``ignore_eos`` request whose
prompt + ``max_new_tokens`` == E (within the limit: E <= context_length), then a normal short
request to see whether the Engine still serves. A dead Engine is restarted for the next E.

The arithmetic it probes (page size 1): a ``req_to_token`` row holds ``context_len + 4 + N``
slots (``srt/mem_cache/allocation_sizing.py:96-116``, ``get_req_to_token_extra_context_len``,
N = ``speculative_num_draft_tokens``); every DFLASH decode step reserves KV slots up to
``committed + 2N`` (``srt/speculative/dflash_info_v2.py:142-154``, ``reserve = 2 * block_size``)
and writes them into the row (``srt/mem_cache/allocation.py:837``,
``assign_req_to_token_pool_func``). So a step whose committed length exceeds
``context_len + 4 - N`` needs a window past the row.

Usage::

    OMP_NUM_THREADS=1 python scripts/dflash_context_edge_repro.py [--context-length 256]
        [--ends 240,246,247,250,256] [--prompt-len 64] [--output runs/dflash-context-edge.json]

Prints one line per end position and a summary table; exits 0 whatever it observed (it is a
reproduction, not a test). Nothing here is specific to DFLASH: ``--algorithm TEV --tree-size 65``
runs the same probe on TEV (not run when this was written; TEV's fix was in progress).
Observations: ``docs/dflash-context-edge.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_kwargs(args) -> dict:
    from sglang_tev.testing.sglang_cpu.hosts import dflash_kwargs, tev_kwargs

    extra = dict(context_length=args.context_length, max_running_requests=4)
    if args.algorithm == "DFLASH":
        return dflash_kwargs(**extra)
    return tev_kwargs(args.tree_size, attention_backend="tev_cpu", **extra)


def error_lines(log: str, n: int = 12) -> list[str]:
    """The exception lines of an Engine log (the last traceback's tail and any 'Error' line)."""
    lines = log.splitlines()
    keep = [l for l in lines if re.search(r"(Error|Exception|Traceback|raise|File \".*(dflash|allocation|harness))", l)]
    return keep[-n:]


def generate(host, ids, sp, timeout: float):
    """``host.generate`` with a deadline: the host's reply reader blocks, so a hung Engine is
    killed (the host process this script started, by its pid) after ``timeout`` seconds."""
    import threading

    timer = threading.Timer(timeout, lambda: host.proc.poll() is None and host.proc.kill())
    timer.start()
    try:
        return host.generate(ids, sp)
    finally:
        timer.cancel()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-length", type=int, default=256)
    ap.add_argument("--ends", default="240,246,247,250,256",
                    help="end positions E = prompt + max_new_tokens, comma-separated (each <= context length)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--algorithm", default="DFLASH", choices=["DFLASH", "TEV"])
    ap.add_argument("--tree-size", type=int, default=65, help="TEV only: N")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--output", default=None, help="write the observations as JSON here")
    args = ap.parse_args(argv)
    ends = [int(e) for e in args.ends.split(",") if e.strip()]
    if any(e > args.context_length or e <= args.prompt_len for e in ends):
        ap.error("--ends: every end must be > --prompt-len and <= --context-length")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

    from transformers import AutoTokenizer

    from sglang_tev.testing.sglang_cpu.hosts import TARGET, EngineHost
    from sglang_tev.hf.datasets import load_humaneval

    tok = AutoTokenizer.from_pretrained(TARGET)
    text = "".join(p.text for p in load_humaneval(3))
    prompt = tok(text).input_ids[: args.prompt_len]
    assert len(prompt) == args.prompt_len
    probe = tok("def add(a, b):").input_ids
    kwargs = engine_kwargs(args)
    host, started = None, 0
    obs = []
    for end in ends:
        if host is None:
            t = time.monotonic()
            host = EngineHost(kwargs)
            started += 1
            info = host.call("server_info")
            n = info.get("speculative_num_draft_tokens")
            row = args.context_length + 4 + int(n)
            print(f"Engine started ({time.monotonic() - t:.0f} s): {args.algorithm}, N = {n}, "
                  f"context_length = {info.get('context_length', args.context_length)}, "
                  f"row = {args.context_length} + 4 + {n} = {row}; a step dies when committed + {2 * int(n)} > {row}, "
                  f"i.e. committed > {row - 2 * int(n)}", flush=True)
        rec = {"end": end, "prompt_len": len(prompt), "max_new_tokens": end - len(prompt)}
        sp = {"temperature": 0, "max_new_tokens": end - len(prompt), "ignore_eos": True}
        try:
            out = generate(host, [prompt], [sp], args.request_timeout)[0]
            rec["request"] = "ok"
            rec["completion_tokens"] = out["meta_info"]["completion_tokens"]
            rec["finish_reason"] = out["meta_info"]["finish_reason"]
            rec["spec_verify_ct"] = out["meta_info"].get("spec_verify_ct")
        except Exception as e:
            rec["request"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        try:
            generate(host, [probe], [{"temperature": 0, "max_new_tokens": 8}], 120)
            rec["engine_after"] = "serving"
        except Exception as e:
            rec["engine_after"] = f"dead ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        rec["survived"] = rec["request"] == "ok" and rec["engine_after"] == "serving"
        if not rec["survived"]:
            rec["log_errors"] = error_lines(host.tail(400))
            host.close()
            host = None
        print(f"end {end} (prompt {len(prompt)} + max_new_tokens {end - len(prompt)}): request {rec['request']}; "
              f"engine {rec['engine_after']}", flush=True)
        for line in rec.get("log_errors", []):
            print("    | " + line, flush=True)
        obs.append(rec)
    if host is not None:
        host.close()
    print("\n| end = prompt + max_new_tokens | context_length | request | Engine afterwards |")
    print("|---|---|---|---|")
    for r in obs:
        print(f"| {r['end']} | {args.context_length} | {'ok' if r['request'] == 'ok' else 'failed'} | "
              f"{'serving' if r['engine_after'] == 'serving' else 'dead'} |")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "argv": sys.argv[1:], "engine_kwargs": kwargs, "engines_started": started,
                       "observations": obs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
