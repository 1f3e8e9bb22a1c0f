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
    "C-lam3": ("exit", 3.0),
    "C-lam30": ("exit", 30.0),
}
# (arm, seed); seed 0 of A/B/C is also benched at B = 32 / 128
RUNS = [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 1), ("C", 1), ("C-lam3", 0), ("C-lam30", 0)]
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
            "--methods", "tev", "--output", str(out), "--no-progress"]


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


def job(args, arm: str | None, seed: int) -> None:
    name = "shipped" if arm is None else run_name(arm, seed)
    d = args.out / name
    d.mkdir(parents=True, exist_ok=True)
    log = d / "experiment.log"
    if arm is None:
        draft = ASSET / "draft"
    else:
        draft = d / "final"
        if not (draft / "model.safetensors").exists():
            wall = run(train_cmd(args, arm, seed), log)
            (d / "train_wall.json").write_text(json.dumps({"wall_s": round(wall, 1), "seed": seed,
                                                           "command": train_cmd(args, arm, seed)}))
    bench_once(args, draft, d / "bench-b64", "64", log)
    if arm is None or (arm, seed) in WIDE:
        bench_once(args, draft, d / "bench-b32-128", "32,128", log)
    print(f"[exittrain] {name} done", file=sys.stderr, flush=True)


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
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    settings = args.out / "settings.json"
    if args.report and settings.exists():  # the settings the runs were made with
        for k, v in json.loads(settings.read_text()).items():
            setattr(args, k, v)
    if args.report:
        print(json.dumps(report(args), indent=1))
        return 0
    if not args.data.exists():
        p.error(f"--data: {args.data} is missing; run scripts/build_tiny_code.py --out runs/tiny-code --stages tokenizer")
    args.out.mkdir(parents=True, exist_ok=True)
    mine = {"steps": args.steps, "lr": args.lr, "anchors": args.anchors, "limit": args.limit,
            "max_new_tokens": args.max_new_tokens}
    if settings.exists() and json.loads(settings.read_text()) != mine:
        p.error(f"--out: {args.out} holds runs made with {settings.read_text().strip()}; use another --out")
    settings.write_text(json.dumps(mine) + "\n")
    todo = RUNS[:6] + [(None, 0)] + RUNS[6:]  # the λ sweep last: it is optional
    if args.runs:
        want = set(args.runs.split(","))
        todo = [(a, s) for a, s in todo if ("shipped" if a is None else run_name(a, s)) in want]
    with ThreadPoolExecutor(args.jobs) as ex:
        for f in [ex.submit(job, args, a, s) for a, s in todo]:
            f.result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
