#!/usr/bin/env python
"""DFlash vs DFlash2 on the shipped tiny-code pair (issue 28 item 5): expected block length
``1 + C_p`` with ``sglang-tev eval-drafter`` (paired over held-out prompts) and realized tau and
tokens/s with ``sglang-tev bench``, for

    DFlash chain            draft[chain]         (the linear block, per-depth argmax)
    DFlash + DDTree         draft[marginal]      (the shipped default) and draft-base[marginal]
    DFlash2 chain           draft2[chain]        (the selector's walk: DFlash2 as SGLang serves it)
    DFlash2 marginal tree   draft2[marginal]     (DDTree over the transformed marginals)
    DFlash2 lattice tree    draft2[lattice]      (DDTree over the selector lattice)

``draft/`` is the shipped default (DFlash, ExitTrain-tuned), ``draft-base/`` the same drafter
before ExitTrain (the draft stage of scripts/build_tiny_code.py), ``draft2/`` the draft2 stage: a
DFlash2 drafter with draft-base's recipe, data and steps. The decision rule is stated in
docs/tiny-code.md ("Stage draft2") before this script first ran.

Prompts: the first ``--prompts`` of the ExitTrain experiment's held-out test prompts (cut from the
18 held-out stdlib files, never seen by the tokenizer, target or drafters;
``sglang_tev/train/recipes/exittrain-tiny-code.yaml`` design, seed ``prompt_seed + 1``).

    python benchmarks/dflash2_compare.py --draft2 sglang_tev/assets/tiny-code/draft2 --out runs/dflash2-compare
    python benchmarks/dflash2_compare.py --report runs/dflash2-compare     # the markdown tables again

Writes OUT/eval/ (eval-drafter), OUT/bench-<drafter>-<i>/ (bench), OUT/summary.json (every
command, wall time, machine, versions, the numbers) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "sglang_tev" / "assets" / "tiny-code"


def machine() -> dict:
    from sglang_tev.machine import machine_info

    return {**machine_info(host="node", cpu="cpu", cores="cpu_count", python="python", torch="torch",
                           transformers="transformers"),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def prompts_file(out: Path, n: int) -> Path:
    """The first n held-out test prompts of the ExitTrain experiment (same cut, same seed)."""
    from sglang_tev.train.config import load_recipe
    from sglang_tev.train.rollout import cut_prompts

    design = load_recipe("exittrain-tiny-code")["design"]
    split = json.loads((REPO / "runs" / "tiny-code" / "tokenizer" / "split.json").read_text())
    rows = cut_prompts(split["stdlib"], split["heldout"], design["test_prompts"], design["prompt_seed"] + 1,
                       design["prompt_chars"])[:n]
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(cmd: list[str], log: list, env: dict) -> float:
    t0 = time.time()
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    wall = round(time.time() - t0, 1)
    log.append({"command": " ".join(cmd), "wall_s": wall})
    return wall


def measure(args) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads))
    cmds: list = []
    prompts = prompts_file(out, args.prompts)
    cli = [sys.executable, "-m", "sglang_tev.cli"]
    tgt = str(ASSET / "target")
    d1, d0, d2 = str(ASSET / "draft"), str(ASSET / "draft-base"), str(args.draft2)
    run(cli + ["eval-drafter", "--target", tgt, "--no-chat-template",
               "--draft", f"{d1}@marginal,chain", "--draft", f"{d0}@marginal,chain",
               "--draft", f"{d2}@lattice,marginal,chain", "--prompts", str(prompts),
               "--temperatures", "0,1", "--budgets", args.eval_budgets, "--max-new-tokens", "128", "--seed", "0",
               "--cache-dir", str(out / "continuations"), "--output", str(out / "eval"), "--overwrite",
               "--no-progress"], cmds, env)
    common = ["--target", tgt, "--no-chat-template", "--dataset", str(prompts), "--budgets", "32,64",
              "--temperatures", "0,1", "--max-new-tokens", "128", "--repeats", "1", "--overwrite", "--no-progress"]
    for i in range(args.bench_rounds):  # interleaved: the two drafters alternate, same minutes
        run(cli + ["bench", "--draft", d1, "--methods", "autoregressive,chain,tev",
                   "--output", str(out / f"bench-draft-{i}")] + common, cmds, env)
        run(cli + ["bench", "--draft", d2, "--methods", "autoregressive,chain,tev", "--draft-modes", "lattice,marginal",
                   "--output", str(out / f"bench-draft2-{i}")] + common, cmds, env)
    (out / "summary.json").write_text(json.dumps({"machine": machine(), "threads": args.threads,
                                                  "prompts": args.prompts, "eval_budgets": args.eval_budgets,
                                                  "bench_rounds": args.bench_rounds, "commands": cmds,
                                                  "tables": tables(out)}, indent=2) + "\n")


def _bench_rows(path: Path) -> list[dict]:
    data = json.loads((path / "results.json").read_text())
    return data["results"] if isinstance(data, dict) else data


PAIRS = (("draft2[lattice]", "draft[marginal]"), ("draft2[lattice]", "draft-base[marginal]"),
         ("draft2[marginal]", "draft-base[marginal]"), ("draft2[lattice]", "draft2[marginal]"),
         ("draft2[chain]", "draft[chain]"))


def tables(out: Path) -> dict:
    """The eval rows (1 + C_p ± SE per row, T, B), the paired differences of PAIRS (% of the
    second row's mean, cluster-robust SE over prompts) and the bench rows (median over runs)."""
    import statistics

    from sglang_tev.train.drafter_eval import cluster_se, paired_difference

    ev = json.loads((out / "eval" / "results.json").read_text())
    by = {(r["drafter"], r["temperature"], r["budget"]): r for r in ev["results"]}
    eval_rows = [{"row": r["drafter"], "temperature": r["temperature"], "budget": r["budget"],
                  "block_len": r["block_len"], "block_len_se": r["block_len_se"], "w_root": r["w_root"]}
                 for r in ev["results"]]
    pairs = []
    for a, b in PAIRS:
        for (name, t, bud), ra in by.items():
            if name != a or (b, t, bud) not in by:
                continue
            rb = by[(b, t, bud)]
            n = ra["per_prompt"]["positions"]
            d, se = paired_difference(ra["per_prompt"]["block_len_sum"], rb["per_prompt"]["block_len_sum"], n)
            ref = cluster_se(rb["per_prompt"]["block_len_sum"], n)[0]
            pairs.append({"a": a, "b": b, "temperature": t, "budget": bud, "diff": d, "diff_se": se,
                          "pct": 100 * d / ref, "pct_se": 100 * se / ref})
    bench: dict = {}
    for path in sorted(out.glob("bench-*-*")):
        name = path.name.rsplit("-", 1)[0][len("bench-"):]
        for r in _bench_rows(path):
            key = (name, r["method"], r.get("draft_mode") or "", r["temperature"], r.get("budget") or 0)
            bench.setdefault(key, []).append(r)
    bench_rows = []
    for (name, method, mode, t, b), rs in sorted(bench.items()):
        taus = [r["tau"] for r in rs if r.get("tau") is not None]
        bench_rows.append({"drafter": name, "method": method, "draft_mode": mode or None, "temperature": t,
                           "budget": b or None, "tau": statistics.median(taus) if taus else None,
                           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs), "runs": len(rs)})
    return {"eval": eval_rows, "pairs": pairs, "bench": bench_rows}


def markdown(out: Path) -> str:
    t = json.loads((out / "summary.json").read_text())["tables"]
    lines = ["| row | T | B | 1 + C_p (± SE) | w(root) |", "| --- | --- | --- | --- | --- |"]
    for r in t["eval"]:
        lines.append(f"| {r['row']} | {r['temperature']:g} | {r['budget']} | {r['block_len']:.4f} ± "
                     f"{r['block_len_se']:.4f} | {r['w_root']:.3f} |")
    lines += ["", "| paired difference | T | B | Δ 1 + C_p | % (± SE) |", "| --- | --- | --- | --- | --- |"]
    for r in t["pairs"]:
        lines.append(f"| {r['a']} − {r['b']} | {r['temperature']:g} | {r['budget']} | {r['diff']:+.4f} | "
                     f"{r['pct']:+.2f} ± {r['pct_se']:.2f} |")
    lines += ["", "| drafter | method | draft mode | T | B | tau | tokens/s (median of runs) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in t["bench"]:
        tau = "—" if r["tau"] is None else f"{r['tau']:.3f}"
        lines.append(f"| {r['drafter']} | {r['method']} | {r['draft_mode'] or '—'} | {r['temperature']:g} | "
                     f"{r['budget'] if r['budget'] is not None else '—'} | {tau} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft2", type=Path, default=ASSET / "draft2", help="the DFlash2 drafter (default: the shipped draft2/)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "dflash2-compare")
    p.add_argument("--prompts", type=int, default=32, help="held-out test prompts used (default 32 of 96)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bench-rounds", type=int, default=2, help="interleaved bench runs per drafter (default 2)")
    p.add_argument("--eval-budgets", default="32,64", help="eval-drafter budgets (default 32,64)")
    p.add_argument("--report", type=Path, metavar="OUT", help="print the tables of a finished run and exit")
    args = p.parse_args(argv)
    if args.report is not None:
        print(markdown(args.report))
        return 0
    measure(args)
    print(markdown(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
