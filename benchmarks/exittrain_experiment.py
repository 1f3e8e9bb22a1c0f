"""ExitTrain experiment on the shipped tiny-code pair (issue: ExitTrain, docs/exittrain.md).

Every arm starts from the shipped drafter and trains the same number of optimizer steps on the
same data (the stdlib token stream of ``scripts/build_tiny_code.py``'s tokenizer stage) with the
shipped recipe (distillation, gamma 2, 512-token windows, batch 4; 16 anchors per window by default,
the shipped build used 32), continued at the shipped run's final learning rate:

    A  dense loss only (the shipped recipe continued)
    B  dense + lambda * L_exit with prefix weights  (reachability control, paper §6.2)
    C  dense + lambda * L_exit with exit weights    (ExitTrain, paper Eq. 14)

Each run is then measured with ``sglang-tev bench`` (tev, all 164 HumanEval prompts, T = 0 and 1)
at B = 64, and seed 0 of each arm also at B = 32 / 128. Everything is resumable: training resumes
from its checkpoints, a finished bench (``results.json``) is skipped, so rerunning the same command
continues where a killed session stopped.

    python scripts/build_tiny_code.py --out runs/tiny-code --stages tokenizer   # the data (8 s)
    python benchmarks/exittrain_experiment.py --out runs/exittrain --jobs 2      # train + bench
    python benchmarks/exittrain_experiment.py --out runs/exittrain --report      # table + JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "sglang_tev" / "assets" / "tiny-code"

ARMS = {  # name: (loss.exit.mode, lambda)
    "A": ("none", 0.0),
    "B": ("prefix", 10.0),
    "C": ("exit", 10.0),
    "C-lam30": ("exit", 30.0),
    "C-lam100": ("exit", 100.0),
}
# (arm, seed); seed 0 of A/B/C is also benched at B = 32 / 128
RUNS = [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 1), ("C", 1), ("C-lam30", 0), ("C-lam100", 0)]
WIDE = {("A", 0), ("B", 0), ("C", 0)}


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


def train_cmd(args, arm: str, seed: int) -> list[str]:
    mode, lam = ARMS[arm]
    return [sys.executable, "-m", "sglang_tev.train",
            f"target={ASSET / 'target'}", f"draft_init={ASSET / 'draft'}", f"data={args.data}",
            f"output_dir={args.out / run_name(arm, seed)}", f"max_steps={args.steps}", f"seed={seed}",
            "seq_len=512", "batch_size=4", f"num_anchors={args.anchors}", "loss_decay_gamma=2", f"lr={args.lr}",
            "warmup_steps=0", "threads=1", "save_every=25", "progress=false", "tensorboard=false",
            "export_dtype=bfloat16", "loss.token_weight=0.0", "loss.distill_weight=1.0",
            f"loss.exit.mode={mode}", f"loss.exit.lambda={lam}", "loss.exit.budget=64"]


def bench_cmd(args, draft: Path, out: Path, budgets: str) -> list[str]:
    return [sys.executable, "-m", "sglang_tev.cli", "bench", "--target", str(ASSET / "target"),
            "--draft", str(draft), "--dataset", "humaneval", "--limit", str(args.limit),
            "--budgets", budgets, "--temperatures", "0,1", "--max-new-tokens", str(args.max_new_tokens),
            "--methods", "tev", "--repeats", "1", "--output", str(out), "--no-progress"]  # tau needs no timing repeats


def run(cmd: list[str], log: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")
    return time.time() - t0


def bench_once(args, draft: Path, out: Path, budgets: str, log: Path) -> None:
    if (out / "results.json").exists():
        return
    if out.exists():  # a killed bench: start it again
        import shutil
        shutil.rmtree(out)
    wall = run(bench_cmd(args, draft, out, budgets), log)
    (out / "wall.json").write_text(json.dumps({"wall_s": round(wall, 1), "command": bench_cmd(args, draft, out, budgets)}))


def job(args, arm: str | None, seed: int, wide: bool = False) -> None:
    """Train (when needed) and bench one run at B = 64, or (``wide``) bench it at B = 32 / 128."""
    name = "shipped" if arm is None else run_name(arm, seed)
    d = args.out / name
    d.mkdir(parents=True, exist_ok=True)
    log = d / "experiment.log"
    draft = ASSET / "draft" if arm is None else d / "final"
    if wide:
        if not (draft / "model.safetensors").exists():
            raise SystemExit(f"{name}: not trained yet; rerun to bench it at B = 32 / 128")
        bench_once(args, draft, d / "bench-b32-128", "32,128", log)
    else:
        if arm is not None and not (draft / "model.safetensors").exists():
            wall = run(train_cmd(args, arm, seed), log)
            (d / "train_wall.json").write_text(json.dumps({"wall_s": round(wall, 1), "seed": seed,
                                                           "command": train_cmd(args, arm, seed)}))
        bench_once(args, draft, d / "bench-b64", "64", log)
    print(f"[exittrain] {name} {'B=32/128' if wide else 'B=64'} done", file=sys.stderr, flush=True)


def report(args) -> dict:
    rows = {}
    names = ["shipped"] + [run_name(a, s) for a, s in RUNS]
    for name in names:
        d = args.out / name
        res = {}
        for sub in ("bench-b64", "bench-b32-128"):
            p = d / sub / "results.json"
            if p.exists():
                for r in json.loads(p.read_text()):
                    if r["method"] == "tev":
                        res[f"B{r['budget']}-T{r['temperature']:g}"] = {
                            "tau": r["tau"], "tokens_per_s": r["tokens_per_s"], "coverage_mean": r["coverage_mean"]}
        rec = {"bench": res}
        log = d / "train_log.jsonl"
        if log.exists():
            recs = [json.loads(ln) for ln in log.read_text().splitlines()]
            rec["steps"] = len(recs)
            for k in ("ms_draft", "ms_build", "ms_tree_forward", "ms_backward"):
                vals = [r[k] for r in recs if k in r]
                if vals:
                    rec[f"median_{k}"] = round(statistics.median(vals), 1)
            rec["median_step_ms"] = round(statistics.median(
                sum(r.get(k, 0.0) for k in ("ms_draft", "ms_build", "ms_tree_forward", "ms_backward")) for r in recs), 1)
            tail = recs[-20:]
            for k in ("loss_distill", "loss_exit", "est_tau", "coverage"):
                if k in tail[0]:
                    rec[f"last20_{k}"] = round(statistics.mean(r[k] for r in tail), 4)
        for f in ("train_wall.json",):
            if (d / f).exists():
                rec["train_wall_s"] = json.loads((d / f).read_text())["wall_s"]
        rows[name] = rec

    def taus(arm, key):
        return [rows[run_name(arm, s)]["bench"][key]["tau"] for a, s in RUNS
                if a == arm and key in rows.get(run_name(arm, s), {}).get("bench", {})]

    summary = {}
    for key in ("B64-T0", "B64-T1", "B32-T0", "B32-T1", "B128-T0", "B128-T1"):
        summary[key] = {}
        for arm in ARMS:
            t = taus(arm, key)
            if t:
                summary[key][arm] = {"mean": statistics.mean(t), "min": min(t), "max": max(t), "n": len(t)}
        for other in ("A", "B"):
            if "C" in summary[key] and other in summary[key]:
                summary[key][f"C_over_{other}_pct"] = 100 * (summary[key]["C"]["mean"] / summary[key][other]["mean"] - 1)
    import torch
    import transformers
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores ({platform.platform()})",
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "steps": args.steps, "lr": args.lr, "anchors": args.anchors, "limit": args.limit,
           "max_new_tokens": args.max_new_tokens,
           "arms": {k: {"mode": m, "lambda": lam} for k, (m, lam) in ARMS.items()},
           "runs": rows, "summary": summary}
    return out


def markdown(rep: dict) -> str:
    """The tables of docs/exittrain.md from :func:`report`."""
    runs, summ = rep["runs"], rep["summary"]
    out = ["| run | λ | τ B=64 T=0 | τ B=64 T=1 | train C_p (last 20 steps, T=1) | distill loss (last 20) |",
           "| --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        b = r["bench"]
        arm = name.rsplit("-s", 1)[0]
        lam = "-" if name == "shipped" else rep["arms"][arm]["lambda"]
        cov = r.get("last20_coverage")
        out.append(f"| {name} | {lam} | {b.get('B64-T0', {}).get('tau', float('nan')):.3f} | "
                   f"{b.get('B64-T1', {}).get('tau', float('nan')):.3f} | "
                   f"{'-' if cov is None else f'{cov:.3f}'} | {r.get('last20_loss_distill', float('nan')):.4f} |")
    out += ["", "| arm | τ B=64 T=0 mean (min–max) | τ B=64 T=1 mean (min–max) | seeds |", "| --- | --- | --- | --- |"]
    for arm in ("A", "B", "C"):
        cells = []
        for key in ("B64-T0", "B64-T1"):
            x = summ.get(key, {}).get(arm)
            cells.append("-" if x is None else f"{x['mean']:.3f} ({x['min']:.3f}–{x['max']:.3f})")
        n = summ.get("B64-T0", {}).get(arm, {}).get("n", 0)
        out.append(f"| {arm} | {cells[0]} | {cells[1]} | {n} |")
    for other in ("A", "B"):
        cells = [f"{summ.get(k, {}).get(f'C_over_{other}_pct', float('nan')):+.1f} %" for k in ("B64-T0", "B64-T1")]
        out.append(f"| C vs {other} | {cells[0]} | {cells[1]} | |")
    out += ["", "| run | τ B=32 T=0 | τ B=32 T=1 | τ B=128 T=0 | τ B=128 T=1 |", "| --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        b = r["bench"]
        if "B32-T0" in b:
            out.append(f"| {name} | " + " | ".join(f"{b.get(k, {}).get('tau', float('nan')):.3f}"
                                                  for k in ("B32-T0", "B32-T1", "B128-T0", "B128-T1")) + " |")
    out += ["", "| run | median step (ms) | draft | build | tree forward | backward | train wall (s) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        if "median_step_ms" in r:
            out.append(f"| {name} | {r['median_step_ms']:.0f} | " + " | ".join(
                f"{r.get('median_' + k, 0):.0f}" for k in ("ms_draft", "ms_build", "ms_tree_forward", "ms_backward"))
                + f" | {r.get('train_wall_s', float('nan')):.0f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "exittrain")
    p.add_argument("--data", type=Path, default=REPO / "runs" / "tiny-code" / "tokenizer" / "train.npy")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--anchors", type=int, default=16, help="anchors per 512-token window")
    p.add_argument("--limit", type=int, default=164)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each")
    p.add_argument("--runs", default=None, help="comma-separated subset, e.g. A-s0,C-s0,shipped")
    p.add_argument("--report", action="store_true", help="only collect results (JSON on stdout)")
    p.add_argument("--markdown", action="store_true", help="with --report: the docs tables instead of JSON")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    settings = args.out / "settings.json"
    if args.report and settings.exists():  # the settings the runs were made with
        for k, v in json.loads(settings.read_text()).items():
            setattr(args, k, v)
    if args.report:
        rep = report(args)
        print(markdown(rep) if args.markdown else json.dumps(rep, indent=1))
        return 0
    if not args.data.exists():
        p.error(f"--data: {args.data} is missing; run scripts/build_tiny_code.py --out runs/tiny-code --stages tokenizer")
    args.out.mkdir(parents=True, exist_ok=True)
    mine = {"steps": args.steps, "lr": args.lr, "anchors": args.anchors, "limit": args.limit,
            "max_new_tokens": args.max_new_tokens}
    if settings.exists() and json.loads(settings.read_text()) != mine:
        p.error(f"--out: {args.out} holds runs made with {settings.read_text().strip()}; use another --out")
    settings.write_text(json.dumps(mine) + "\n")
    # the must-haves first (every A/B/C run at B = 64, seed 0 at 32 / 128), then the
    # starting drafter's own numbers, then the optional λ sweep
    todo = [(a, s, False) for a, s in RUNS[:6]] + [(a, s, True) for a, s in RUNS if (a, s) in WIDE] \
        + [(None, 0, False), (None, 0, True)] + [(a, s, False) for a, s in RUNS[6:]]
    if args.runs:
        want = set(args.runs.split(","))
        todo = [t for t in todo if ("shipped" if t[0] is None else run_name(t[0], t[1])) in want]
    with ThreadPoolExecutor(args.jobs) as ex:
        for f in [ex.submit(job, args, *t) for t in todo]:
            f.result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
