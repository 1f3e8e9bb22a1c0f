"""What one decoding step costs inside SGLang's CPU server: plain decoding against TEV's steps.

Starts one CPU server per mode (as the project's HTTP tests do), drives it with ``--concurrency``
streams of the same request (``--temperature``, ``--output-len`` tokens, ``ignore_eos``) for
``--seconds``, and times every call of the worker's ``forward_batch_generation`` inside the
scheduler process: its own time ("work") and the gap from its end to the next call's start
(SGLang's scheduler work between steps: result processing, the next batch). Steps next to a
prefill are left out. Reported per mode: median work and gap per decode step (ms), the work split
into SGLang's model forwards ("fwd") and the rest ("own": the worker's own lines, the sampler's or
TEV's draw among them), tokens per step and request, the rounds' budgets, and the client's tokens
per second.

Modes:
    plain          SGLang without speculative decoding (its ``TpModelWorker``)
    tev17, tev33   TEV, fixed tree of N = 17 / 33 (``TEVWorker``)
    auto65, auto17 TEV, ``SGLANG_TEV_BUDGET=auto`` with capacity 65 / 17
    auto65-plain   the same server with every round planned as a plain step: what a TEV plain
                   step costs against SGLang's own (benchmark instrumentation, not a server option)

The timing and the plain-step plans are the CPU harness's hooks in the server's processes
(``SGLANG_TEV_STEP_TRACE``, ``SGLANG_TEV_PLAIN_STEPS``: ``sglang_tev/testing/sglang_cpu/step_hooks.py``).

    OMP_NUM_THREADS=1 python benchmarks/sglang_step_trace.py --modes plain,auto65-plain \\
        --temperature 1 --seconds 30 [--output result.json]

``--paired R`` starts every mode's server at once and runs R rounds of one request per mode, the
order rotated every round, instead of ``--seconds`` of load per mode in turn: on a VM whose speed
drifts between minutes the modes then share the same minutes (each row adds ``speed``, the median
over rounds of the first mode's request time over this mode's, with quartiles).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "def fibonacci(n):\n    "


def _modes():
    from sglang_tev import env as tev_env
    from sglang_tev.testing.sglang_cpu import hosts

    tev = lambda n: hosts.tev_kwargs(n, attention_backend="tev_cpu")  # noqa: E731
    return {
        "plain": (hosts.plain_kwargs(), {}),
        "tev17": (tev(17), {}),
        "tev33": (tev(33), {}),
        "auto65": (tev(65), {"SGLANG_TEV_BUDGET": "auto"}),
        "auto17": (tev(17), {"SGLANG_TEV_BUDGET": "auto"}),
        "auto65-plain": (tev(65), {"SGLANG_TEV_BUDGET": "auto", tev_env.PLAIN_STEPS: "1"}),
    }


def _generate(host, temperature: float, n: int) -> dict:
    """One ``/generate`` of ``n`` tokens on ``host`` (a ``ServerHost``); its JSON reply."""
    body = {"text": PROMPT, "sampling_params": {"temperature": temperature, "max_new_tokens": n, "ignore_eos": True}}
    status, out = host.post("/generate", body, timeout=600)
    if status != 200:
        raise RuntimeError(f"/generate answered {status}: {str(out)[:300]}")
    return out


def summarize(lines: list[str]) -> dict:
    """Median work / gap (ms) per decode step from the trace lines, with the steps' tokens, overall
    and per round width.

    Args:
        lines: ``kind t0 t1 mode bs tokens [width [forward]]`` per worker call, in call order
            (``step_hooks.install_step_trace``).
    Returns:
        dict with ``steps``, ``work_ms``, ``gap_ms``, ``step_ms`` (their sum), ``tokens_per_step``
        (per request), where the lines carry it ``forward_ms`` (SGLang's model forwards within the
        work) and ``own_ms`` (the work less them: the worker's own), and ``by_width``: per round
        width (0 = a plain step) the same medians and
        ``start_ms``, the median interval from the step's start to the next one's (what a client
        sees per step), and under auto ``charged_ms`` (the median seconds the planner was charged
        for those rounds) and ``table_ms`` (its cost table's fitted cost, load-free, after the last
        of them, at that round's batch size: with rounds of several batch sizes under one width it
        is the last one's); ``{"steps": 0}`` when no two decode steps followed each other.
    """
    rows = []
    for x in lines:
        f = x.split()
        if len(f) < 6:  # a line cut short (a server killed while writing it)
            continue
        rows.append((float(f[1]), float(f[2]), f[3], int(f[4]), int(f[5]), int(f[6]) if len(f) > 6 else -1,
                     float(f[7]) if len(f) > 7 else None,
                     (float(f[8]), float(f[10])) if len(f) > 10 else None))
    # (width, work ms, gap ms, tokens per request, forward ms or None, (charged s, table's s) or None)
    # of every decode step followed by a decode step
    steps = [(cur[5], 1e3 * (cur[1] - cur[0]), 1e3 * (nxt[0] - cur[1]), cur[4] / max(1, cur[3]),
              None if cur[6] is None else 1e3 * cur[6], cur[7])
             for cur, nxt in zip(rows, rows[1:]) if cur[2] == "d" and nxt[2] == "d"]
    if not steps:
        return {"steps": 0}

    def medians(part):
        out = {"steps": len(part), "work_ms": statistics.median(x[1] for x in part),
               "gap_ms": statistics.median(x[2] for x in part), "tokens_per_step": statistics.fmean(x[3] for x in part)}
        if all(x[4] is not None for x in part):  # the model forwards' share of the work, and the rest
            out["forward_ms"] = statistics.median(x[4] for x in part)
            out["own_ms"] = statistics.median(x[1] - x[4] for x in part)
        return out

    row = medians(steps)
    row["step_ms"] = row["work_ms"] + row["gap_ms"]
    row["by_width"] = {}
    for k in sorted({x[0] for x in steps}):
        part = [x for x in steps if x[0] == k]
        row["by_width"][str(k)] = dict(medians(part), start_ms=statistics.median(x[1] + x[2] for x in part))
        planned = [x[5] for x in part if x[5] is not None]
        if planned:  # what the planner was charged for these rounds, and what its table held last
            row["by_width"][str(k)].update(charged_ms=1e3 * statistics.median(c for c, _ in planned),
                                           table_ms=1e3 * planned[-1][1] if planned[-1][1] > 0 else None)
    return row


def run_mode(name: str, kwargs: dict, env: dict, args, folder: Path) -> dict:
    from sglang_tev import env as tev_env
    from sglang_tev.testing.sglang_cpu import hosts

    trace = folder / f"{name}.trace"
    env = dict(env, **{tev_env.STEP_TRACE: str(trace)})
    host = hosts.ServerHost(kwargs, env=env)
    try:
        for _ in range(2):  # warm-up (and, under auto, the calibration's first rounds)
            _generate(host, args.temperature, args.output_len)
        trace.unlink(missing_ok=True)
        stop = time.perf_counter() + args.seconds
        done, budgets, lock = [0], {}, threading.Lock()

        def stream():
            while time.perf_counter() < stop:
                out = _generate(host, args.temperature, args.output_len)
                with lock:
                    done[0] += args.output_len
                    for b in out["meta_info"].get("tev_budget") or []:
                        budgets[b] = budgets.get(b, 0) + 1

        t0 = time.perf_counter()
        threads = [threading.Thread(target=stream) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        host.close()
    if not trace.exists():
        raise RuntimeError(f"{name}: the server wrote no step trace (the CPU harness's {tev_env.STEP_TRACE} hook did not run)")
    row = summarize(trace.read_text().splitlines())
    row.update(mode=name, tok_s=done[0] / wall, budgets=dict(sorted(budgets.items())))
    return row


def run_paired(modes: list[str], known: dict, args, folder: Path) -> list[dict]:
    """Every mode's server up at once; ``args.paired`` rounds of one request per mode, in an order
    rotated every round (A B C, B C A, ...), so the VM's drift falls on all modes alike. Each row
    adds ``speed`` (median over rounds of the first mode's request seconds over this mode's) with
    its quartiles; ``tok_s`` is output tokens over this mode's own request seconds."""
    from sglang_tev import env as tev_env
    from sglang_tev.testing.sglang_cpu import hosts

    started, seconds, budgets = {}, {m: [] for m in modes}, {m: {} for m in modes}
    try:
        for m in modes:
            kwargs, env = known[m]
            started[m] = hosts.ServerHost(kwargs, env=dict(env, **{tev_env.STEP_TRACE: str(folder / f"{m}.trace")}))
        for m in modes:
            for _ in range(2):  # warm-up (and, under auto, the calibration's first rounds)
                _generate(started[m], args.temperature, args.output_len)
            (folder / f"{m}.trace").unlink(missing_ok=True)
        for i in range(args.paired):
            k = i % len(modes)
            for m in modes[k:] + modes[:k]:  # each mode first in turn (two modes: A B, B A, ...)
                t0 = time.perf_counter()
                out = _generate(started[m], args.temperature, args.output_len)
                seconds[m].append(time.perf_counter() - t0)
                for b in out["meta_info"].get("tev_budget") or []:
                    budgets[m][b] = budgets[m].get(b, 0) + 1
    finally:
        for h in started.values():
            h.close()
    rows = []
    for m in modes:
        trace = folder / f"{m}.trace"
        if not trace.exists():
            raise RuntimeError(f"{m}: the server wrote no step trace (the CPU harness's {tev_env.STEP_TRACE} hook did not run)")
        row = summarize(trace.read_text().splitlines())
        speed = sorted(a / b for a, b in zip(seconds[modes[0]], seconds[m]))
        row.update(mode=m, tok_s=args.output_len * len(seconds[m]) / sum(seconds[m]), budgets=dict(sorted(budgets[m].items())),
                   speed=statistics.median(speed), speed_q1=speed[len(speed) // 4], speed_q3=speed[(3 * len(speed)) // 4])
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="plain,auto65-plain", help="comma-separated: plain, tev17, tev33, auto65, auto17, auto65-plain")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seconds", type=float, default=30.0, help="traced load per mode, after two warm-up requests")
    p.add_argument("--paired", type=int, default=0,
                   help="instead of --seconds per mode: every server up at once and this many rounds of one "
                        "request per mode, the order rotated every round (speeds relative to the first mode)")
    p.add_argument("--output", help="write the rows as JSON here")
    args = p.parse_args(argv)
    known = _modes()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        p.error(f"--modes: {'unknown ' + ', '.join(bad) if bad else 'none given'} (known: {', '.join(known)})")
    if args.concurrency < 1:
        p.error(f"--concurrency must be at least 1, got {args.concurrency}")
    if not args.paired and not (math.isfinite(args.seconds) and args.seconds > 0):
        p.error(f"--seconds must be a finite number above 0, got {args.seconds}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.output and not Path(args.output).resolve().parent.is_dir():
        p.error(f"--output: no such directory {str(Path(args.output).resolve().parent)!r}")
    if args.paired < 0:
        p.error(f"--paired must be a number of rounds >= 1 (0: off), got {args.paired}")
    if args.paired and (args.concurrency != 1 or len(set(modes)) != len(modes)):
        p.error("--paired runs one request at a time (--concurrency 1), each mode once in --modes")
    if args.output_len < 2:
        p.error(f"--output-len must be at least 2 (a decode step after the first token), got {args.output_len}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.paired:
            rows = run_paired(modes, known, args, folder)
            for r in rows:
                print(json.dumps(r), flush=True)
        for m in modes if not args.paired else []:
            kwargs, env = known[m]
            rows.append(run_mode(m, kwargs, env, args, folder))
            print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["mode"] == "plain" and r.get("steps")), None)
    print(f"{'mode':>14} {'work ms':>8} {'gap ms':>7} {'step ms':>8} {'x plain':>8} {'tok/step':>8} {'tok/s':>7} {'fwd ms':>7} {'own ms':>7}")
    for r in rows:
        if not r.get("steps"):
            print(f"{r['mode']:>14}  no consecutive decode steps traced")
            continue
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "-"
        print(f"{r['mode']:>14} {r['work_ms']:8.2f} {r['gap_ms']:7.2f} {r['step_ms']:8.2f} {ratio:>8} "
              f"{r['tokens_per_step']:8.2f} {r['tok_s']:7.1f}"
              + (f" {r['forward_ms']:7.2f} {r['own_ms']:7.2f}" if "forward_ms" in r else "")
              + (f"   speed {r['speed']:.3f} ({r['speed_q1']:.3f}-{r['speed_q3']:.3f})" if "speed" in r else ""))
        if len(r.get("by_width", {})) > 1:
            for k, d in r["by_width"].items():
                print(f"{'width ' + k:>14} {d['work_ms']:8.2f} {d['gap_ms']:7.2f} {d['start_ms']:8.2f} {'':>8} "
                      f"{d['tokens_per_step']:8.2f} {d['steps']:>5} steps"
                      + (f"   charged {d['charged_ms']:.2f} ms" if d.get("charged_ms") is not None else "")
                      + (f", table {d['table_ms']:.2f} ms" if d.get("table_ms") is not None else ""))
    if args.output:
        from sglang_tev.machine import machine_info

        Path(args.output).write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                 "machine": machine_info("cpu_model", "cpu_count", "cpu_bf16", "platform", "python", "torch", "transformers", "torch_threads"), "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
