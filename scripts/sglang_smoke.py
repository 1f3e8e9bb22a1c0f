#!/usr/bin/env python
"""GPU smoke test of the SGLang plugin: ``sglang.Engine`` with and without TEV, with and without
decode CUDA graphs, on Triton and FlashInfer.

Needs a CUDA GPU and ``pip install "sglang-tev[sglang]"``. For each attention backend in
``--attention-backends`` (default triton, flashinfer) and each mode in ``--modes`` (default: no
speculation, DFLASH, TEV with decode CUDA graphs, TEV eager), it starts an ``sglang.Engine`` on the
given models (default: the small pair shipped in ``sglang_tev/assets/tiny-code``) with decode graphs
captured for batch sizes 1/2/4/8 (``-eager`` modes: ``--cuda-graph-backend-decode disabled``), runs

1. a greedy batch of ``--batch`` prompts: every speculative mode's output token ids must equal the
   no-speculation ids (graphs = eager = plain greedy);
2. a greedy batch of 3 prompts, which replays the bucket-4 graphs (padded rows: seq_len 1, mask
   padded with True): the same check;
3. a batch of ``--batch`` requests with mixed sampling parameters (temperature 0 / 0.6 / 1.0,
   top-k, top-p, min-p, seeds, a regex grammar, a logit bias): every request must finish;
4. from the engine log (``SGLANG_LOG_DECODE_GRAPH_KEY=1``): with graphs, replays of the target's
   verify graph and (speculative modes) the draft graph, and TEV's draft head folded into the draft
   graph; in ``-eager`` modes no replay at all; ``TEV-auto`` (``SGLANG_TEV_BUDGET=auto`` with a
   target verify graph per tree-size tier) also the tiers' capture line, rounds at two or more widths
   and graph replays at two or more tree sizes (the worker logs each size's first replay); in
   every TEV mode, the drafter's context KV written by SGLang's fused Triton writer (``draft_kv.py``);

and prints tau (SGLang's ``spec_accept_length``: mean tokens per verify round) and tokens/s per
backend and mode (TEV with graphs beside TEV eager and DFLASH), plus TEV's per-request metrics.
Exit code 0 when every check passes, 1 when one fails, 2 when no CUDA GPU or sglang is available.

    python scripts/sglang_smoke.py
    python scripts/sglang_smoke.py --target Qwen/Qwen3-4B --draft z-lab/Qwen3-4B-DFlash-b16 --budget 64

This script is the only check of the worker's GPU path (``sglang_tev/srt/worker.py``) and of the
CUDA-graph path (``sglang_tev/srt/graphs.py``); CI has no GPU (see docs/sglang.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "sglang_tev" / "assets" / "tiny-code"

GRAPH_BUCKETS = (1, 2, 4, 8)
"""Decode graph batch sizes captured (``--cuda-graph-bs-decode``); ``max_running_requests`` = 8."""

PADDED_BATCH = 3
"""A batch that is not a bucket: its replay pads to 4 (seq_len fill rows, mask padded with True)."""


def _bucket(bs: int) -> int:
    return next(b for b in GRAPH_BUCKETS if b >= bs)

PROMPTS = [
    "def fibonacci(n):",
    "def quicksort(xs):",
    "class Stack:\n    def __init__(self):",
    "def read_lines(path):\n    with open(path) as f:",
    "import os\n\ndef walk_files(root):",
    "def binary_search(a, x):",
    "def merge(a, b):\n    out = []",
    "def is_prime(n):",
]


def mixed_sampling(n: int, seed: int) -> list[dict]:
    base = [
        dict(temperature=0.0),
        dict(temperature=0.6, top_p=0.9),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.8, min_p=0.05),
        dict(temperature=1.0, top_k=50, top_p=0.8, sampling_seed=seed),
        dict(temperature=0.7, regex="[a-z_ ]+\\("),  # a grammar: per-node vocabulary masks
        dict(temperature=0.9, logit_bias={"0": -100.0}),
        dict(temperature=1.2, top_p=0.95, sampling_seed=seed + 1),
    ]
    return [base[i % len(base)] for i in range(n)]


GRAPH_REPLAY = "Decode graph replay: worker="
"""SGLang's per-replay log line (``decode_cuda_graph_runner.py:1988-2001``, with
``SGLANG_LOG_DECODE_GRAPH_KEY=1`` and log level info): ``worker=target`` / ``worker=draft``."""


@contextlib.contextmanager
def captured_stderr(path: Path):
    """Send file descriptor 2 (this process and the scheduler subprocesses it starts) to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


AUTO_MODES = {"auto": ("auto", True), "auto-eager": ("auto", False), "auto-ragged": ("auto-ragged", False)}
"""TEV's load-adaptive modes: suffix -> (``SGLANG_TEV_BUDGET``, decode graphs)."""


def parse_mode(spec: str) -> tuple[str, bool]:
    """``TEV`` -> ("TEV", graphs on); ``TEV-eager`` -> ("TEV", graphs off); ``TEV-auto`` -> ("TEV",
    graphs on) with ``SGLANG_TEV_BUDGET=auto`` (a target verify graph per tree-size tier,
    ``sglang_tev/srt/graph_tiers.py``); ``TEV-auto-eager`` the same, graphs off;
    ``TEV-auto-ragged`` -> ("TEV", graphs off) with ``auto-ragged`` (each request's tree at its own
    size through one ragged verify forward on FlashInfer, one width per round on Triton)."""
    name, _, suffix = spec.partition("-")
    auto = suffix in AUTO_MODES
    if name not in ("none", "DFLASH", "TEV") or suffix not in ("", "eager", *AUTO_MODES) or (auto and name != "TEV"):
        raise ValueError(f"unknown mode {spec!r}: none, DFLASH or TEV, optionally with -eager; "
                         "TEV-auto, TEV-auto-eager, TEV-auto-ragged")
    return name, AUTO_MODES[suffix][1] if auto else suffix == ""


def run_mode(spec: str, backend: str, args, prompts: list[str], log_dir: Path) -> dict:
    import sglang

    name, graphs = parse_mode(spec)
    kwargs = dict(
        model_path=args.target,
        mem_fraction_static=args.mem_fraction,
        attention_backend=backend,
        random_seed=args.seed,
        log_level="info",  # the graph-replay lines are info; all of it goes to the log file
        tp_size=args.tp,
        max_running_requests=max(GRAPH_BUCKETS),
        cuda_graph_bs_decode=list(GRAPH_BUCKETS),
        cuda_graph_backend_decode="full" if graphs else "disabled",
    )
    if name == "DFLASH":
        kwargs.update(speculative_algorithm="DFLASH", speculative_draft_model_path=args.draft)
    elif name == "TEV":
        kwargs.update(
            speculative_algorithm="TEV",
            speculative_draft_model_path=args.draft,
            speculative_num_draft_tokens=args.budget + 1,
        )
        if args.block_size:
            kwargs["speculative_dflash_block_size"] = args.block_size
        if args.max_depth:
            kwargs["speculative_num_steps"] = args.max_depth
    log = log_dir / f"{backend}-{spec}.log"
    os.environ["SGLANG_LOG_DECODE_GRAPH_KEY"] = "1"
    os.environ["SGLANG_TEV_BUDGET"] = AUTO_MODES.get(spec.partition("-")[2], ("fixed",))[0]
    with captured_stderr(log):
        engine = sglang.Engine(**kwargs)
        try:
            greedy = dict(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
            engine.generate(prompts[:1], greedy)  # warm-up
            t0 = time.perf_counter()
            outs = engine.generate(prompts, greedy)
            dt = time.perf_counter() - t0
            # bucket padding: 3 requests replay the bucket-4 graphs (buckets 1/2/4/8)
            padded = engine.generate([PROMPTS[i % len(PROMPTS)] for i in range(PADDED_BATCH)], greedy)
            mixed = [dict(s, max_new_tokens=args.max_new_tokens) for s in mixed_sampling(len(prompts), args.seed)]
            t1 = time.perf_counter()
            mouts = engine.generate(prompts, mixed)
            mdt = time.perf_counter() - t1
        finally:
            engine.shutdown()
    text = log.read_text(errors="replace")
    ids = lambda os_: [o.get("output_ids") if o.get("output_ids") is not None else o["text"] for o in os_]  # noqa: E731
    toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
    mtoks = sum(o["meta_info"]["completion_tokens"] for o in mouts)
    return dict(
        mode=spec,
        backend=backend,
        graphs=graphs,
        # token ids when SGLang returns them, else the text (never compare two missing values)
        greedy_ids=ids(outs),
        padded_ids=ids(padded),
        greedy_texts=[o["text"] for o in outs],
        greedy_tok_s=toks / dt,
        greedy_tau=_mean([o["meta_info"].get("spec_accept_length") for o in outs]),
        mixed_finished=all(o["meta_info"].get("finish_reason") is not None for o in mouts),
        mixed_tok_s=mtoks / mdt,
        mixed_tau=_mean([o["meta_info"].get("spec_accept_length") for o in mouts]),
        tev_meta_example={k: v for k, v in mouts[0]["meta_info"].items() if "tev_" in k or k == "customized_info"},
        replays={w: text.count(GRAPH_REPLAY + w) for w in ("target", "draft")},
        tev_head_folded="TEV draft head (per-depth" in text,
        # the worker's start-up line: which writer fills the drafter's context KV (srt/draft_kv.py)
        kv_writer=next((ln.split("drafter context KV: ", 1)[1].strip() for ln in text.splitlines() if "drafter context KV: " in ln), None),
        # auto with graphs: the tiers captured, and the widths the rounds ran at
        # the worker's capture line (the config's start-up line says only what it will capture)
        tiers_line=next((ln.strip() for ln in text.splitlines() if "one tier per round width), captured in" in ln), None),
        tiers_replayed=sorted({int(m.group(1)) for m in re.finditer(r"first replay of the target verify graph at tree size (\d+)", text)}),
        budgets_seen=sorted({b for o in outs + mouts for b in (o["meta_info"].get("tev_budget") or []) if b is not None}),
        log=str(log),
    )


def graph_checks(r: dict) -> list[tuple[bool, str]]:
    """What the log must show: replays on both runners with graphs (TEV: its head folded into the
    draft graph), none without."""
    name, _ = parse_mode(r["mode"])
    target, draft = r["replays"]["target"], r["replays"]["draft"]
    out = []
    if name == "TEV":  # on CUDA the drafter's context KV goes through SGLang's fused Triton writer
        writer = r.get("kv_writer")
        out.append((bool(writer) and writer.startswith("stacked (SGLang's fused"), f"drafter context KV: {writer}"))
    if not r["graphs"]:
        return out + [(target == 0 and draft == 0, f"eager (replays: target {target}, draft {draft})")]
    out.append((target > 0, f"target graph replays {target}"))
    if name != "none":
        out.append((draft > 0, f"draft graph replays {draft}"))
    if name == "TEV":
        out.append((r["tev_head_folded"], "TEV head folded into the draft graph" if r["tev_head_folded"] else "TEV head NOT folded"))
    if r["mode"] == "TEV-auto":  # graph tiers: captured, and the rounds' widths changed (budgets are tiers' - 1)
        out.append((r["tiers_line"] is not None, r["tiers_line"] or "no graph tiers captured"))
        out.append((len(r["budgets_seen"]) >= 2, f"round budgets seen {r['budgets_seen']}"))
        out.append((len(r["tiers_replayed"]) >= 2, f"target graphs replayed at tree sizes {r['tiers_replayed']}"))
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(ASSETS / "target"))
    p.add_argument("--draft", default=str(ASSETS / "draft"))
    p.add_argument("--budget", type=int, default=64, help="B drafted nodes per tree (N = B + 1)")
    p.add_argument("--block-size", type=int, default=None, help="drafter block (default: the drafter's config)")
    p.add_argument("--max-depth", type=int, default=None, help="max tree depth (default: block size - 1)")
    p.add_argument("--batch", type=int, default=8, help=f"greedy and mixed batch size (graphs up to {max(GRAPH_BUCKETS)})")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--attention-backends", default="triton,flashinfer", help="comma-separated subset of triton,flashinfer")
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--modes", default="none,DFLASH,TEV,TEV-eager,TEV-auto,TEV-auto-eager,TEV-auto-ragged",
        help="comma-separated subset of none, DFLASH, TEV, each optionally with -eager (decode CUDA graphs off), "
             "TEV-auto (SGLANG_TEV_BUDGET=auto: one width per round, a target graph per tree-size tier), "
             "TEV-auto-eager (the same, graphs off) and TEV-auto-ragged (auto-ragged, eager: per-request sizes "
             "through a ragged verify on flashinfer, per-round widths on triton)",
    )  # fmt: skip
    p.add_argument("--log-dir", default=None, help="engine logs (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    backends = [b.strip() for b in args.attention_backends.split(",") if b.strip()]
    for m in modes:
        try:
            parse_mode(m)  # a bad mode fails before any engine starts
        except ValueError as e:
            p.error(f"--modes: {e}")
    if not set(backends) <= {"triton", "flashinfer"}:
        p.error(f"--attention-backends: triton and/or flashinfer, got {args.attention_backends!r}")

    try:
        import sglang  # noqa: F401
        import torch
    except ImportError as e:
        print(f"sglang is not installed ({e}); pip install 'sglang-tev[sglang]'", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU: this smoke test needs one (the plugin's CPU logic is checked by pytest)", file=sys.stderr)
        return 2
    from sglang_tev.srt.plugin import register

    register()  # SGLang's load_plugins() does this too when the package is installed

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tev-smoke-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results = {f"{b}/{m}": run_mode(m, b, args, prompts, log_dir) for b in backends for m in modes}

    ok = True
    print(f"target {args.target}\ndraft  {args.draft}\nbudget {args.budget}, batch {args.batch}, max_new_tokens {args.max_new_tokens}, "
          f"graph buckets {list(GRAPH_BUCKETS)}, GPU {torch.cuda.get_device_name(0)}, sglang {sglang.__version__}, "
          f"torch {torch.__version__}, logs {log_dir}")  # fmt: skip
    print(f"{'backend/mode':22s} {'greedy tau':>10s} {'greedy tok/s':>13s} {'mixed tau':>10s} {'mixed tok/s':>12s}  checks")
    for key, r in results.items():
        backend = r["backend"]
        checks = []
        reference = results.get(f"{backend}/none")
        if r["mode"] != "none" and reference is not None:
            # graphs = eager = plain greedy: every mode against the plain model, full batch and bs 3
            for field, label in (("greedy_ids", "greedy"), ("padded_ids", f"bs {PADDED_BATCH} (bucket {_bucket(PADDED_BATCH)})")):
                diverged = [(i, first_divergence(a, b)) for i, (a, b) in enumerate(zip(r[field], reference[field])) if a != b]
                checks.append(f"{label} identical" if not diverged else f"{label} DIFFERS (prompt, token): {diverged}")
                ok &= not diverged
        for passed, msg in graph_checks(r):
            checks.append(msg)
            ok &= passed
        checks.append("mixed batch finished" if r["mixed_finished"] else "mixed batch DID NOT FINISH")
        ok &= r["mixed_finished"]
        fmt = lambda x: f"{x:10.2f}" if x is not None else f"{'-':>10s}"  # noqa: E731
        print(f"{key:22s} {fmt(r['greedy_tau'])} {r['greedy_tok_s']:13.1f} {fmt(r['mixed_tau'])} {r['mixed_tok_s']:12.1f}  {'; '.join(checks)}")
    for b in backends:
        graphs, eager, dflash = (results.get(f"{b}/{m}") for m in ("TEV", "TEV-eager", "DFLASH"))
        if graphs and eager:
            print(f"{b}: TEV greedy tok/s with graphs / eager = {graphs['greedy_tok_s'] / eager['greedy_tok_s']:.2f}x"
                  + (f"; TEV / DFLASH (both graphs) = {graphs['greedy_tok_s'] / dflash['greedy_tok_s']:.2f}x" if dflash else ""))  # fmt: skip
    tev = next((r for r in results.values() if r["mode"] == "TEV" and r["tev_meta_example"]), None)
    if tev is not None:
        print("TEV meta_info of request 0 (per round):", json.dumps(tev["tev_meta_example"], default=str)[:2000])
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
