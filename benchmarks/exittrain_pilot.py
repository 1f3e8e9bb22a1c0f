"""Schedule pilot for the ExitTrain experiment (docs/exittrain.md, "Schedule pilot").

Chunk 1's gate said NO-GO: the token-only control (token CE, γ 7, lr 1e-3) made the shipped
drafter worse on the test set. This pilot chooses the control's schedule again WITHOUT touching
the test set: each variant trains the control (arm A, seed 0) from the shipped drafter on the
experiment's shared rollouts, and is scored by ``eval-drafter`` on a validation set of prompts cut
from the stdlib TRAINING split (cut points the 1 024 training prompts do not use), paired against
the shipped drafter on the same positions.

Selection rule (stated before the numbers): among the token-only variants, the one whose smaller
paired z (over T = 0 and T = 1) against the shipped drafter is largest, if that z is > 0; else the
distillation variant if its smaller z is > 0; else none (the experiment would then be reported
as: no schedule found that improves the shipped drafter).

    python benchmarks/exittrain_pilot.py --exp runs/exittrain --out runs/exittrain-pilot --jobs 2
    python benchmarks/exittrain_pilot.py --report      # the table, from the results JSON

Needs the experiment's data stage (``exittrain_experiment.py --data-only``). Each unit appends its
command, seed, machine and wall time to ``OUT/<unit>/record.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import exittrain_experiment as X  # the script's own folder is on sys.path

RESULTS = X.REPO / "benchmarks" / "results" / "exittrain-pilot.json"
VAL_PROMPTS = 24
STEPS = 600
# name: (token_weight, distill_weight, loss_decay_gamma, lr). Chunk 1's control was (1, 0, 7, 1e-3).
VARIANTS = {
    "tok-g2-lr1e-3": (1.0, 0.0, 2.0, 1e-3),
    "tok-g2-lr3e-4": (1.0, 0.0, 2.0, 3e-4),
    "tok-g7-lr3e-4": (1.0, 0.0, 7.0, 3e-4),
    "distill-g2-lr3e-4": (0.0, 1.0, 2.0, 3e-4),
}


def val_prompts(exp: Path) -> Path:
    """Prompts 1 024..1 047 of the training split's seeded cut order: the same files, cut points
    the training prompts do not use (``cut_prompts`` extends its list without changing its head)."""
    p = exp / "data" / "val_prompts.jsonl"
    if p.exists():
        return p
    split = json.loads((X.REPO / "runs" / "tiny-code" / "tokenizer" / "split.json").read_text())
    n = X.DESIGN["train_prompts"]
    rows = X.cut_prompts(Path(split["stdlib"]), split["train"], n + VAL_PROMPTS, X.DESIGN["prompt_seed"],
                         X.DESIGN["prompt_chars"])
    train = [json.loads(ln) for ln in (exp / "data" / "train_prompts.jsonl").read_text().splitlines()]
    if [r["id"] for r in rows[:n]] != [r["id"] for r in train]:
        raise SystemExit("the training prompts were not cut by this code; cannot place the validation set")
    assert not {r["id"] for r in rows[n:]} & {r["id"] for r in train}
    p.write_text("".join(json.dumps(r) + "\n" for r in rows[n:]))
    return p


def eval_cmd(exp: Path, prompts: Path, draft: Path, dest: Path) -> list[str]:
    return X.eval_cmd(exp, draft, dest, prompts=prompts, cache=exp / "data" / "val_continuations")


def train_cmd(exp: Path, out: Path, variant: str) -> list[str]:
    tw, dw, gamma, lr = VARIANTS[variant]
    ov = dict(o.split("=", 1) for o in X.train_overrides(exp, "A", 0, 0.0, STEPS))
    ov.update({"output_dir": str(out / variant), "loss.token_weight": str(tw), "loss.distill_weight": str(dw),
               "loss_decay_gamma": str(gamma), "lr": str(lr), "max_steps": str(STEPS), "stop_at_step": str(STEPS)})
    return [sys.executable, "-m", "sglang_tev.train", *(f"{k}={v}" for k, v in ov.items())]


def unit(exp: Path, out: Path, prompts: Path, variant: str, mach: dict) -> None:
    rd = out / variant
    if not (rd / "final" / "model.safetensors").exists():
        X.run_cmd(train_cmd(exp, out, variant), rd, "train", 0, mach, steps=[0, STEPS])
    if not (rd / "eval" / "results.json").exists():
        X.run_cmd(eval_cmd(exp, prompts, rd / "final", rd / "eval"), rd, "eval", 0, mach)


def collect(out: Path) -> dict:
    base = X.load_eval(out / "shipped" / "eval" / "results.json")
    rep = {"validation_prompts": VAL_PROMPTS, "steps": STEPS, "shipped": {k: v["block_len"] for k, v in base.items()},
           "variants": {}}
    for v, (tw, dw, g, lr) in VARIANTS.items():
        p = out / v / "eval" / "results.json"
        if not p.exists():
            continue
        ev = X.load_eval(p)
        row = {"token_weight": tw, "distill_weight": dw, "gamma": g, "lr": lr, "block_len": {}, "vs_shipped": {}}
        for k in ev:
            d, se = X.paired(ev[k], base[k])
            row["block_len"][k] = ev[k]["block_len"]
            row["vs_shipped"][k] = {"diff": d, "se": se, "z": d / se if se else 0.0}
        recs = json.loads((out / v / "record.json").read_text())
        row["record"] = recs
        rep["variants"][v] = row
    worst = {v: min(x["z"] for x in r["vs_shipped"].values()) for v, r in rep["variants"].items()}
    tok = {v: z for v, z in worst.items() if rep["variants"][v]["distill_weight"] == 0}
    dis = {v: z for v, z in worst.items() if rep["variants"][v]["distill_weight"] > 0}
    best_tok = max(tok, key=tok.get) if tok else None
    if best_tok and tok[best_tok] > 0:
        rep["chosen"] = best_tok
    elif dis and max(dis.values()) > 0:
        rep["chosen"] = max(dis, key=dis.get)
    else:
        rep["chosen"] = None
    rep["complete"] = len(rep["variants"]) == len(VARIANTS)
    RESULTS.write_text(json.dumps(rep, indent=1) + "\n")
    return rep


def report(rep: dict) -> str:
    keys = list(rep["shipped"])
    L = ["| variant | dense loss | γ | lr | " + " | ".join(f"1+C_p {k}" for k in keys) + " | "
         + " | ".join(f"Δ vs shipped {k} (% ± SE, z)" for k in keys) + " | train wall (s) |",
         "| --- " * (5 + 2 * len(keys)) + "|",
         "| shipped | | | | " + " | ".join(f"{rep['shipped'][k]:.4f}" for k in keys) + " |" + " |" * len(keys) + " |"]
    for v, r in rep["variants"].items():
        dense = "token CE" if r["distill_weight"] == 0 else "distillation"
        wall = sum(e["wall_s"] for e in r["record"] if e["kind"] == "train")
        L.append(f"| {v} | {dense} | {r['gamma']:g} | {r['lr']:g} | "
                 + " | ".join(f"{r['block_len'][k]:.4f}" for k in keys) + " | "
                 + " | ".join(f"{r['vs_shipped'][k]['diff']:+.2f} ± {r['vs_shipped'][k]['se']:.2f} "
                              f"({r['vs_shipped'][k]['z']:+.1f})" for k in keys) + f" | {wall:.0f} |")
    L.append(f"\nchosen: {rep['chosen']}" + ("" if rep.get("complete") else " (pilot incomplete)"))
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exp", type=Path, default=X.REPO / "runs" / "exittrain", help="the experiment's --out (data stage done)")
    p.add_argument("--out", type=Path, default=X.REPO / "runs" / "exittrain-pilot")
    p.add_argument("--jobs", type=int, default=2, help="units in parallel, one thread each (default 2)")
    p.add_argument("--wait-minutes", type=float, default=30.0,
                   help="how long to wait for a data stage still running elsewhere (default 30)")
    p.add_argument("--report", action="store_true")
    args = p.parse_args(argv)
    if args.report:
        print(report(json.loads(RESULTS.read_text())), end="")
        return 0
    if args.jobs < 1:
        p.error(f"argument --jobs: must be >= 1, got {args.jobs}")
    exp, out = args.exp.resolve(), args.out.resolve()
    if not (exp / "data" / "train_prompts.jsonl").exists():
        p.error(f"--exp: {exp} has no data stage; start exittrain_experiment.py --data-only first")
    mach = X.machine()
    prompts = val_prompts(exp)
    if not (out / "shipped" / "eval" / "results.json").exists():  # alone: it writes the continuations cache
        X.run_cmd(eval_cmd(exp, prompts, X.BASE_DRAFT, out / "shipped" / "eval"), out / "shipped", "eval", None, mach)
    deadline = time.time() + 60 * args.wait_minutes
    while not (exp / "data" / "rollouts.done").exists():  # the data stage may still be running
        if time.time() > deadline:
            p.error(f"--exp: {exp / 'data'} has no finished rollouts after {args.wait_minutes:g} min; "
                    "run exittrain_experiment.py --data-only")
        time.sleep(20)
    with ThreadPoolExecutor(args.jobs) as ex:
        for f in [ex.submit(unit, exp, out, prompts, v, mach) for v in VARIANTS]:
            f.result()
    print(report(collect(out)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
