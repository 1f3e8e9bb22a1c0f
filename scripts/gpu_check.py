#!/usr/bin/env python
"""One GPU check of sglang-tev: correctness first, then the numbers, in one command (issue 18).

On the lent GPU machine (the device tool runs the command from the repository root and brings back
what is written under ``$OUT``; the machine has torch, Triton, transformers and scipy, no network
and no SGLang, so nothing is installed: the package is imported from this checkout)::

    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT"          # device tool timeout_s=540

Anywhere, without a GPU (what ``tests/runtime/test_gpu_check.py`` runs)::

    python scripts/gpu_check.py --dry-run --out /tmp/gpu-check

Steps, in order of importance; each runs in its own Python process (a CUDA fault in one cannot
take the next with it; on CPU the Triton interpreter must be switched on before Triton is
imported), and every check in a step is guarded: a failure is recorded (status in the JSON lines,
traceback in the log) and the script goes on.

1. ``triton``: the fused Triton TEV kernel against the torch reference on the same uniforms,
   through ``verify_tree(backend="triton" / "torch")``: exit node, bonus, path and accept length
   equal, coverage within rtol 2e-5 (float32 sums over V in another order), at V = 151936,
   bf16 and fp32 logits, B in {64, 32, 128}, T in {0.6, 1.0}, plain / top-k / top-p / min-p /
   top-k with top-p / per-row parameters (one greedy row), on ragged batches of four trees (one
   root-only; padded rows hold NaN, every row one -inf; each node's first child about 0.7 of its
   law) built by ``sglang_tev.testing.triton_cases.make_case``; a row where the kernel and the
   float32 reference part is settled by the float64 reference (rounding at an inverse-CDF
   boundary); ``verify_tree``'s default backend on CUDA is the kernel; then chi-square of the
   kernel's (exit node, bonus) against the enumerated law (``kernel_draws_against_law`` there)
   with 20k draws per case.
2. ``runtime``: the transformers runtime (``SpeculativeGenerator``) with a small random Qwen3
   target + random DFlash drafter (``sglang_tev.testing.models``' builders, float32) and with
   the shipped trained tiny-code pair (real acceptance): greedy output equal to plain HF greedy
   decoding (``sglang_tev.testing.models.plain_greedy``), eager and ``cuda_graphs=True`` each, batch 1 and
   4 (ragged prompts), graphs output equal to eager (and no capture fell back to eager); a
   sampled batch (T = 1, top-p 0.9) runs to length in both modes; ``budget="auto"`` (eager)
   greedy equal to plain, with the budgets it chose and its tokens/s against
   ``method="autoregressive"`` recorded (no bar: the planner's first GPU figures).
3. ``timing``: verifier decision latency (tev-triton, tev torch, predraw, sequential, greedy) at
   V = 151936, batch 1, B in {64, 32, 128}, T in {0.6, 1.0}, bf16 logits, each call captured in a
   CUDA graph and timed with CUDA events over replays (``benchmarks/verifier.py``); the round on
   Qwen3-4B-shaped random bf16 weights, prompt 1024, 64 new tokens (draft, build, tree forward,
   verify, commit, overhead = build + verify + commit) eager and with CUDA graphs at T = 0 and 1,
   and the autoregressive step (``benchmarks/gpu_round.py``); B = 32 and 128 last.

``--dry-run`` runs the same steps and checks (same functions, same records) on CPU at tiny shapes
(V = 48 / 64, tiny models, one draw, 60 chi-square draws; 30-70 s on a loaded 2-core machine),
the kernel under ``TRITON_INTERPRET=1``; ``cuda_graphs`` needs CUDA, so the graphs mode there is
``static_shapes=True`` (the fixed shapes capture uses, run eagerly). Dry-run figures are not
comparable to anything.

Outputs in ``--out`` (written as it goes, so a run cut short still leaves its results):
``results.jsonl`` one JSON line per check (status pass / fail / skipped, seconds, details) and per
figure (value, unit, the H200 anchor from ``benchmarks/anchors-h200.json`` and the goal beside
it), flushed line by line; ``log.txt`` every step's output and the tracebacks; ``summary.md``
the final tables (every check; every figure beside its anchor and goal). The short table is
printed last on stdout. Goals reported, never asserted: TEV decision <= 50 us at B = 64,
V = 151936, batch 1; non-forward round overhead <= 0.5 ms at B = 64 (issue 18); with CUDA graphs
tree forward <= 7.5 ms and autoregressive step <= 6.9 ms (issue 10).

``--time-budget`` (seconds, default 450, so the whole run stays under 8 minutes on one H200; the
GPU run is estimated at about 5 minutes, never measured) counts from the start; a step may use at
most a share of it (triton 30 %, runtime 25 %, timing the rest), so a hung step still leaves the
next ones their time. A check whose estimated time no longer fits is recorded as skipped, and so
is every check of a step that cannot start; a step still running 30 s after its share is killed,
the check it was running recorded as failed and the rest as skipped. After a GPU run: copy ``results.jsonl`` and ``summary.md`` to
``benchmarks/results/gpu-check-<gpu>/`` and the summary's figures into docs/benchmarks.md.

Exit status: 0 when no check failed (skipped ones allowed), 1 when one failed or a step crashed,
2 on usage errors (no CUDA GPU without ``--dry-run``; results already in ``--out`` without
``--overwrite``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "benchmarks", ROOT):  # ROOT ends up first: this checkout's sglang_tev
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

STEPS = ("triton", "runtime", "timing")
RESULTS, LOG, SUMMARY = "results.jsonl", "log.txt", "summary.md"
ANCHORS_FILE = ROOT / "benchmarks" / "anchors-h200.json"
STEP_SHARE = {"triton": 0.3, "runtime": 0.25, "timing": 1.0}
"""The most of the time budget each step may take from its start (within the global budget), so
a hung kernel in one step still leaves the later steps their time."""
STEP_GRACE_S = 30.0
"""A step process still running this long after its share of the budget is killed."""

GPU = dict(
    mode="gpu",
    # 1. triton
    vocab=151936, budgets=[64, 32, 128], dtypes=["bfloat16", "float32"], temps=[0.6, 1.0],
    samplings=["plain", "top_k", "top_p", "min_p", "top_k_top_p", "per_row"], top_k=50, draws=8,
    chi2_cases=["T1", "top_k3_top_p0.8", "min_p0.2"], chi2_draws=20_000,
    # 2. runtime
    runtime_pairs=["random", "tiny-code"], runtime_batches=[1, 4], runtime_new_tokens=200, runtime_budget=32,
    # 3. timing
    verifier_vocab=151936, verifier_budgets=[64, 32, 128], verifier_temps=[0.6, 1.0],
    verifier_methods=["tev-triton", "tev", "predraw", "sequential", "greedy"], verifier_repeats=10,
    verifier_replays=20, round_shape="qwen3-4b", round_budgets=[64, 32, 128], round_temps=[0.0, 1.0],
    round_prompt_len=1024, round_new_tokens=64,
)
"""The GPU run (about 5 minutes on an H200 by estimate; never run yet)."""

DRY = dict(
    GPU, mode="dry-run",
    vocab=48, budgets=[6], dtypes=["bfloat16"], temps=[0.6], top_k=5, draws=1, chi2_cases=["T1"], chi2_draws=60,
    runtime_new_tokens=12, runtime_budget=8,
    verifier_vocab=64, verifier_budgets=[4], verifier_temps=[1.0], verifier_repeats=2, verifier_replays=1,
    round_shape="tiny", round_budgets=[8], round_prompt_len=16, round_new_tokens=8,
)
"""The same checks at tiny shapes, on CPU."""

ROUND_FIGURES = ("draft", "build", "tree_forward", "verify", "commit", "verify_commit", "overhead")
MODES = ("eager", "graphs")


# ---------------------------------------------------------------------------------------- plan
@dataclass
class Check:
    """One guarded check: ``fn(ctx, recorder) -> dict`` of details (``ok: False`` marks a wrong
    result, ``why`` says what); ``est_s`` its estimated seconds on the GPU (it is skipped when the
    time budget left is smaller); ``figures`` the figure names it records."""

    name: str
    fn: Callable
    est_s: float = 5.0
    figures: list = field(default_factory=list)


class SkipCheck(Exception):
    """Raised by a check that cannot run here for a stated reason (recorded as skipped)."""


def need_triton(cfg: dict) -> None:
    """Triton is needed: without it a dry run skips the check (the CPU torch wheel has no Triton);
    on a GPU it is a failure."""
    from sglang_tev.verify import triton_available

    if not triton_available():
        if cfg["mode"] == "gpu":
            raise RuntimeError("triton is not installed")
        raise SkipCheck("triton is not installed")


def plan(cfg: dict) -> dict[str, list[Check]]:
    """The checks of each step, in order (no torch import: the parent process lists them)."""
    return {"triton": triton_checks(cfg), "runtime": runtime_checks(cfg), "timing": timing_checks(cfg)}


def _t(x: float) -> str:
    return f"T{x:g}"


# ------------------------------------------------------------------------------ 1. triton
def triton_checks(cfg: dict) -> list[Check]:
    out = []
    for B in cfg["budgets"]:
        for T in cfg["temps"]:
            for dtype in cfg["dtypes"]:
                for kind in cfg["samplings"]:
                    first = not out
                    out.append(Check(f"triton/equal/V{cfg['vocab']}/B{B}/{dtype}/{_t(T)}/{kind}",
                                     partial(_triton_equal, cfg=cfg, B=B, dtype=dtype, T=T, kind=kind),
                                     est_s=40 if first else 3))  # the first call compiles the kernels
    out.append(Check("triton/dispatch/auto-is-kernel", partial(_triton_dispatch, cfg=cfg), est_s=3))
    for case in cfg["chi2_cases"]:
        out.append(Check(f"triton/chi2/{case}", partial(_triton_chi2, cfg=cfg, case=case), est_s=15))
    return out


def ragged_sizes(budget: int) -> list[int]:
    """Node counts of the four trees of a batch: full, about half, root only, full minus three."""
    n = 1 + budget
    return [n, max(1, n // 2), 1, max(1, n - 3)]


def sampling_for(kind: str, temperature: float, cfg: dict, rows: int, device):
    """The SamplingParams of a sampling ``kind`` at ``temperature`` (top-k = cfg["top_k"])."""
    import torch

    from sglang_tev import SamplingParams

    k = cfg["top_k"]
    if kind == "plain":
        return SamplingParams(temperature=temperature)
    if kind == "top_k":
        return SamplingParams(temperature=temperature, top_k=k)
    if kind == "top_p":
        return SamplingParams(temperature=temperature, top_p=0.9)
    if kind == "min_p":
        return SamplingParams(temperature=temperature, min_p=0.05)
    if kind == "top_k_top_p":
        return SamplingParams(temperature=temperature, top_k=k, top_p=0.8)
    if kind == "per_row":  # one greedy row, one with top-k and top-p, one with min-p
        cyc = lambda xs, dt: torch.tensor([xs[i % 4] for i in range(rows)], dtype=dt, device=device)  # noqa: E731
        return SamplingParams(temperature=cyc([temperature, 0.0, temperature, 1.3], torch.float64),
                              top_k=cyc([0, 0, k, 0], torch.int64), top_p=cyc([1.0, 1.0, 0.9, 0.95], torch.float64),
                              min_p=cyc([0.0, 0.0, 0.0, 0.05], torch.float64))
    raise ValueError(f"sampling kind: unknown {kind!r}")


def _triton_case(ctx: dict, cfg: dict, B: int, T: float):
    """(tree, float32 logits) on the kernel's device for budget B at temperature T, built once.

    ``make_case`` boosts the first drafted child of every node by ``deep`` over N(0, 1.5^2)
    logits; ``deep`` is set so that child holds about 0.7 of its parent's law at T (the rest
    spread over V), so exits fall at every depth at either temperature."""
    key = ("triton-case", B, T)
    if key not in ctx:
        from sglang_tev.testing.triton_cases import DEVICE, make_case

        ctx.pop(next((k for k in ctx if isinstance(k, tuple) and k[0] == "triton-case"), None), None)  # free the last
        V = cfg["vocab"]
        # child logit d: d / T = log-normaliser of the noise at T (log V + (1.5 / T)^2 / 2) + logit(0.7)
        deep = T * (math.log(V) + (1.5 / T) ** 2 / 2 + math.log(0.7 / 0.3))
        _, tree, logits = make_case(1000 + B, V, ragged_sizes(B), width=1 + B, deep=deep)
        ctx[key] = (tree.to(DEVICE), logits.to(DEVICE))
    return ctx[key]


FIELDS = ("exit_node", "bonus", "path", "accept_len")


def _triton_equal(ctx, rec, cfg, B, dtype, T, kind):
    import torch

    from sglang_tev import verify_tree

    need_triton(cfg)
    tree, logits32 = _triton_case(ctx, cfg, B, T)
    logits = logits32.to(getattr(torch, dtype))
    b, dev = tree.batch_size, tree.device
    sp = sampling_for(kind, T, cfg, b, dev)
    g = torch.Generator().manual_seed(zlib.crc32(f"{B}/{dtype}/{T}/{kind}".encode()))  # str hash() is salted
    wrong = dict.fromkeys(FIELDS, 0)
    cov_diff, accept, hard, rounding, cov_bad = 0.0, set(), 0, 0, 0
    for _ in range(cfg["draws"]):
        u = torch.rand(b, 2, dtype=torch.float64, generator=g).to(dev)
        k = verify_tree(tree, logits, "tev", sampling=sp, uniforms=u, backend="triton")
        r = verify_tree(tree, logits, "tev", sampling=sp, uniforms=u, backend="torch")
        differ = torch.zeros(b, dtype=torch.bool, device=dev)
        for f in FIELDS:
            d = (getattr(k, f) != getattr(r, f)).reshape(b, -1).any(1)
            wrong[f] += int(d.sum())
            differ |= d
        if bool(differ.any()):
            # Both sum float32 masses over V in their own order: a uniform that falls within rounding
            # of an inverse-CDF boundary may land on either side. Arbitrate with the float64 law.
            x = verify_tree(tree, logits.double(), "tev", sampling=sp, uniforms=u, backend="torch")
            off = (k.exit_node != x.exit_node) | (k.bonus != x.bonus)
            hard += int((differ & off).sum())
            rounding += int((differ & ~off).sum())
        kc, rc = k.coverage.double(), r.coverage.double()
        cov_bad += int((~torch.isclose(kc, rc, rtol=2e-5, atol=1e-6)).sum())
        cov_diff = max(cov_diff, float((kc - rc).abs().max()))
        accept.update(r.accept_len.tolist())
    fails = []
    if hard:
        fails.append(f"{hard} rows where the kernel differs from the float32 and the float64 reference "
                     f"(rows differing per field: {wrong})")
    if cov_bad:
        fails.append(f"{cov_bad} rows with coverage off by more than rtol 2e-5 (max {cov_diff:.3g})")
    return dict(ok=not fails, why="; ".join(fails) or None, draws=cfg["draws"], rows=b,
                tree_nodes=tree.valid.sum(1).tolist(), rows_differing=wrong, rows_float64_agrees_with_kernel=rounding,
                coverage_max_abs_diff=cov_diff, accept_lens_seen=sorted(accept),
                sampling=repr(sp) if kind != "per_row" else "per-row tensors")


def _triton_dispatch(ctx, rec, cfg):
    """verify_tree(backend=None) uses the kernel for CUDA logits and equals the reference."""
    import torch

    from sglang_tev import SamplingParams, verify_tree
    from sglang_tev.verify import _use_kernel

    need_triton(cfg)
    B, T = cfg["budgets"][0], cfg["temps"][-1]
    tree, logits32 = _triton_case(ctx, cfg, B, T)
    logits = logits32.to(torch.bfloat16)
    u = torch.rand(tree.batch_size, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).to(tree.device)
    sp = SamplingParams(temperature=T, top_p=0.95)
    auto = verify_tree(tree, logits, "tev", sampling=sp, uniforms=u)
    ref = verify_tree(tree, logits, "tev", sampling=sp, uniforms=u, backend="torch")
    same = all(torch.equal(getattr(auto, f), getattr(ref, f)) for f in FIELDS)
    is_kernel = _use_kernel(None, "tev", logits)
    want_kernel = logits.is_cuda
    ok = same and is_kernel == want_kernel
    return dict(ok=ok, why=None if ok else f"equal {same}, auto picks the kernel {is_kernel} (expected {want_kernel})",
                auto_is_kernel=is_kernel, device=str(logits.device))


def _triton_chi2(ctx, rec, cfg, case):
    need_triton(cfg)
    from sglang_tev.testing.triton_cases import ALPHA, kernel_draws_against_law

    got = kernel_draws_against_law(case, cfg["chi2_draws"])
    fails = []
    if not got["pvalue"] > ALPHA:
        fails.append(f"chi-square p = {got['pvalue']:.3g} <= {ALPHA}")
    if not abs(got["accept_mean"] - got["coverage"]) < got["accept_bound"]:
        fails.append(f"mean accept_len {got['accept_mean']:.4f} vs coverage {got['coverage']:.4f}")
    if not abs(got["kernel_coverage"] - got["coverage"]) <= 1e-6:
        fails.append(f"kernel coverage {got['kernel_coverage']} vs {got['coverage']}")
    return dict(got, ok=not fails, why="; ".join(fails) or None, alpha=ALPHA)


# ----------------------------------------------------------------------------- 2. runtime
def runtime_checks(cfg: dict) -> list[Check]:
    out = []
    for pair in cfg["runtime_pairs"]:
        out.append(Check(f"runtime/{pair}/load", partial(_runtime_load, cfg=cfg, pair=pair), est_s=10))
        for b in cfg["runtime_batches"]:
            for mode in MODES:
                out.append(Check(f"runtime/{pair}/b{b}/{mode}=plain", partial(_runtime_greedy, cfg=cfg, pair=pair,
                                                                              batch=b, mode=mode), est_s=15))
            out.append(Check(f"runtime/{pair}/b{b}/graphs=eager", partial(_runtime_same, pair=pair, batch=b), est_s=1))
            out.append(Check(f"runtime/{pair}/b{b}/auto=plain", partial(_runtime_auto, cfg=cfg, pair=pair, batch=b),
                             est_s=20))
        out.append(Check(f"runtime/{pair}/b{max(cfg['runtime_batches'])}/sampled",
                         partial(_runtime_sampled, cfg=cfg, pair=pair), est_s=15))
    return out


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def mode_options(mode: str, device) -> dict:
    """SpeculativeGenerator options of a mode: graphs = ``cuda_graphs=True`` on CUDA; on CPU
    ``static_shapes=True`` (the fixed shapes capture uses, run eagerly: cuda_graphs needs CUDA)."""
    if mode == "eager":
        return {}
    return {"cuda_graphs": True} if device.type == "cuda" else {"static_shapes": True}


TINY_CODE_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
                     "import os\n\ndef walk_files(root):\n    for", "def is_prime(n):\n    if n < 2:\n        return"]


def _runtime_load(ctx, rec, cfg, pair):
    import torch

    dev = _device()
    if pair == "random":  # the runtime tests' random pair (float32)
        from sglang_tev.testing.models import RAGGED, dflash_for, qwen3

        target = qwen3(0).to(dev)
        draft = dflash_for(target).to(dev)
        prompts = [list(p) for p in RAGGED]
    elif pair == "tiny-code":  # the shipped trained pair: long accepted paths
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from sglang_tev.draft.dflash import DFlashDraftModel
        from sglang_tev.hf.assets import quiet_loading, shipped_pair

        tdir, ddir = shipped_pair()
        with quiet_loading():
            target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32, attn_implementation="sdpa")
        target = target.to(dev).eval()
        draft = DFlashDraftModel.from_pretrained(ddir, dtype=torch.float32, device=dev).eval()
        tok = AutoTokenizer.from_pretrained(tdir)
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in TINY_CODE_PROMPTS]
    else:
        raise ValueError(f"pair: unknown {pair!r}")
    ctx[pair] = dict(target=target, draft=draft, prompts=prompts, plain={}, out={})
    return dict(device=str(dev), dtype=str(next(target.parameters()).dtype),
                target_params=sum(p.numel() for p in target.parameters()),
                draft_params=sum(p.numel() for p in draft.parameters()), prompt_lens=[len(p) for p in prompts])


def _generator(ctx, pair, mode):
    from sglang_tev.hf.drafters import DFlashDrafter
    from sglang_tev.hf.runtime import SpeculativeGenerator

    key = (pair, "gen", mode)
    if key not in ctx:
        m = ctx[pair]
        ctx[key] = SpeculativeGenerator(m["target"], DFlashDrafter(m["draft"], m["target"]),
                                        **mode_options(mode, _device()))
    return ctx[key]


def _plain_refs(ctx, cfg, pair, batch):
    """(the pair's context, new tokens, the first ``batch`` prompts), with plain HF greedy
    decoding of each prompt computed once into ``ctx[pair]["plain"]``."""
    from sglang_tev.testing.models import plain_greedy

    m = ctx[pair]
    n = cfg["runtime_new_tokens"]
    prompts = m["prompts"][:batch]
    for i, p in enumerate(prompts):
        if i not in m["plain"]:
            m["plain"][i] = plain_greedy(m["target"], p, n)
    return m, n, prompts


def _runtime_greedy(ctx, rec, cfg, pair, batch, mode):
    m, n, prompts = _plain_refs(ctx, cfg, pair, batch)
    gen = _generator(ctx, pair, mode)
    res = gen.generate(prompts if batch > 1 else prompts[0], method="tev", budget=cfg["runtime_budget"],
                       max_new_tokens=n, ignore_eos=True)
    res = res if isinstance(res, list) else [res]
    got = [r.token_ids for r in res]
    m["out"][(batch, mode)] = got
    first_diff = [next((j for j, (a, b) in enumerate(zip(x, m["plain"][i])) if a != b), None if x == m["plain"][i] else -1)
                  for i, x in enumerate(got)]
    fails = [f"row {i} differs from plain greedy at token {d}" + _gap_note(m["target"], prompts[i], m["plain"][i], d)
             for i, d in enumerate(first_diff) if d is not None]
    stats = dict(gen.graph_stats) if gen.graph_stats else None
    if gen.cuda_graphs and (not stats or stats["captures"] < 1 or stats["fallbacks"]):
        fails.append(f"CUDA-graph capture did not hold: {stats}")
    return dict(ok=not fails, why="; ".join(fails) or None, tokens=n, tau=[round(r.tau, 3) for r in res],
                rounds=[len(r.rounds) for r in res], graph_stats=stats, options=mode_options(mode, _device()))


def _runtime_auto(ctx, rec, cfg, pair, batch):
    """``budget="auto"`` in the eager mode: greedy output equals plain greedy; recorded beside it,
    the budgets auto chose and its tokens/s against ``method="autoregressive"`` on the same rows
    (one warm-up call each, then one timed call each; informational, no bar: the first GPU figures
    of issue 37's planner)."""
    import time
    from collections import Counter

    import torch

    m, n, prompts = _plain_refs(ctx, cfg, pair, batch)
    gen = _generator(ctx, pair, "eager")
    arg = prompts if batch > 1 else prompts[0]
    seconds = {}
    for method, kw in (("autoregressive", {}), ("tev", {"budget": "auto"})):
        gen.generate(arg, method=method, max_new_tokens=n, ignore_eos=True, **kw)  # warm-up (shapes, controller)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = gen.generate(arg, method=method, max_new_tokens=n, ignore_eos=True, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds[method] = time.perf_counter() - t0
    res = res if isinstance(res, list) else [res]
    fails = [f"row {i} differs from plain greedy" for i, r in enumerate(res) if r.token_ids != m["plain"][i]]
    budgets = Counter(rd.budget for r in res for rd in r.rounds)
    tokens = sum(len(r.token_ids) for r in res)
    return dict(ok=not fails, why="; ".join(fails) or None, tau=[round(r.tau, 3) for r in res],
                budgets={str(b): c for b, c in sorted(budgets.items(), key=lambda x: (x[0] is None, x[0] or 0))},
                auto_tok_s=round(tokens / seconds["tev"], 1), autoregressive_tok_s=round(tokens / seconds["autoregressive"], 1),
                auto_x_plain=round(seconds["autoregressive"] / seconds["tev"], 3))


def _gap_note(model, prompt, ref, j) -> str:
    """The plain model's top-2 logit gap where the outputs part (a near tie flips under any
    change of kernels or summation order), as text."""
    import torch

    if j is None or j < 0:
        return ""
    with torch.no_grad():
        ids = torch.tensor([list(prompt) + ref[:j]], device=next(model.parameters()).device)
        top = torch.topk(model(ids).logits[0, -1].float(), 2).values
    return f" (plain decoding's top-2 logit gap there: {float(top[0] - top[1]):.3g})"


def _runtime_same(ctx, rec, pair, batch):
    out = ctx[pair]["out"]
    missing = [m for m in MODES if (batch, m) not in out]
    if missing:
        return dict(ok=False, why=f"no output of {missing} (that check failed)")
    same = out[(batch, "eager")] == out[(batch, "graphs")]
    return dict(ok=same, why=None if same else "eager and graphs outputs differ")


def _runtime_sampled(ctx, rec, cfg, pair):
    from sglang_tev import SamplingParams

    m = ctx[pair]
    batch = max(cfg["runtime_batches"])
    n = cfg["runtime_new_tokens"]
    vocab = m["target"].get_output_embeddings().weight.shape[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    fails, tau, outs = [], {}, {}
    for mode in MODES:
        res = _generator(ctx, pair, mode).generate(m["prompts"][:batch], method="tev", budget=cfg["runtime_budget"],
                                                   sampling=sp, seed=list(range(11, 11 + batch)), max_new_tokens=n,
                                                   ignore_eos=True)
        outs[mode] = [r.token_ids for r in res]
        tau[mode] = [round(r.tau, 3) for r in res]
        for i, r in enumerate(res):
            if len(r.token_ids) != n or r.finish_reason != "length" or not all(0 <= t < vocab for t in r.token_ids):
                fails.append(f"{mode} row {i}: {len(r.token_ids)} tokens, finish {r.finish_reason}")
    # not required: eager and graphs forwards may round differently, and one flipped draw changes the rest
    return dict(ok=not fails, why="; ".join(fails) or None, sampling=repr(sp), tau=tau,
                eager_equals_graphs=outs["eager"] == outs["graphs"])


# ------------------------------------------------------------------------------ 3. timing
def verifier_figure(method: str, vocab: int, budget: int, temperature: float) -> str:
    return f"verifier/{method}/V{vocab}/B{budget}/{_t(0.0 if method == 'greedy' else temperature)}/b1"


def timing_checks(cfg: dict) -> list[Check]:
    out = []
    V = cfg["verifier_vocab"]
    for B in cfg["verifier_budgets"]:
        for T in cfg["verifier_temps"]:
            methods = [m for m in cfg["verifier_methods"] if not (m == "greedy" and T != cfg["verifier_temps"][0])]
            out.append(Check(f"timing/verifier/V{V}/B{B}/{_t(T)}",
                             partial(_time_verifier, cfg=cfg, B=B, T=T, methods=methods), est_s=25,
                             figures=[verifier_figure(m, V, B, T) for m in methods]))
    out.append(Check("timing/verifier/tev-triton-captured", _verifier_captured, est_s=0))
    out.append(Check(f"timing/round/build-{cfg['round_shape']}", partial(_round_build, cfg=cfg), est_s=60))
    for i, B in enumerate(cfg["round_budgets"]):
        for mode in MODES:
            for T in cfg["round_temps"] if i == 0 else cfg["round_temps"][:1]:
                out.append(Check(f"timing/round/{mode}/{_t(T)}/B{B}", partial(_time_round, cfg=cfg, mode=mode, T=T, B=B),
                                 est_s=30, figures=[f"round/{mode}/{_t(T)}/B{B}/{s}" for s in ROUND_FIGURES]))
        if i == 0:
            for mode in MODES:
                out.append(Check(f"timing/ar/{mode}", partial(_time_ar, cfg=cfg, mode=mode), est_s=20,
                                 figures=[f"ar/{mode}/step", f"ar/{mode}/tree_forward"]))
    return out


def _time_verifier(ctx, rec, cfg, B, T, methods):
    import torch
    import verifier as vb

    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # as benchmarks/verifier.py
    g = ctx.setdefault("verifier-generator", torch.Generator().manual_seed(0))
    key = ("verifier-case", B)
    if key not in ctx:
        ctx.pop(next((k for k in ctx if isinstance(k, tuple) and k[0] == "verifier-case"), None), None)
        ctx[key] = vb.decision_case(cfg["verifier_vocab"], B, 1, dev, dtype, g)
    tree, logits = ctx[key]
    note = None
    if "tev-triton" in methods:
        try:
            need_triton(cfg)
        except SkipCheck as e:
            methods, note = [m for m in methods if m != "tev-triton"], f"tev-triton not timed: {e}"
    timed = vb.time_decisions(tree, logits, methods, T, g, cfg["verifier_repeats"], cfg["verifier_replays"],
                              warmup=3 if dev.type == "cuda" else 1)
    captured = ctx.setdefault("verifier-captured", {})
    for m, (us, graph) in timed.items():
        name = verifier_figure(m, cfg["verifier_vocab"], B, T)
        rec.figure(name, us, "us", cuda_graph=graph)
        captured[name] = graph
    return dict(dtype=str(dtype), timing="CUDA events over CUDA-graph replays" if dev.type == "cuda"
                else "wall clock, methods round-robin", repeats=cfg["verifier_repeats"], replays=cfg["verifier_replays"],
                note=note)


def _verifier_captured(ctx, rec):
    """The fused TEV decision was captured in a CUDA graph (no host sync inside) wherever timed."""
    got = {k: v for k, v in ctx.get("verifier-captured", {}).items() if k.startswith("verifier/tev-triton/")}
    if _device().type != "cuda":
        return dict(note="CPU: CUDA graphs need CUDA; nothing to capture (dry run)", timed=len(got))
    if not got:
        return dict(ok=False, why="tev-triton was not timed (its timing checks failed or were skipped)")
    eager = [k for k, v in got.items() if not v]
    return dict(ok=not eager, why=f"timed eagerly (capture failed): {eager}" if eager else None, captured=len(got))


def _round_models(ctx, cfg):
    if "round-models" not in ctx:
        raise RuntimeError("the round's models were not built (timing/round/build failed or was skipped)")
    return ctx["round-models"]


def _round_build(ctx, rec, cfg):
    import torch
    import gpu_round

    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.time()
    target, draft = gpu_round.build_models(dev, dtype, cfg["round_shape"])
    prompts = gpu_round.random_prompts(1, cfg["round_prompt_len"], target.config.vocab_size)
    ctx["round-models"] = (target, draft, prompts)
    return dict(shape=cfg["round_shape"], dtype=str(dtype), seconds=round(time.time() - t0, 1),
                target_params=sum(p.numel() for p in target.parameters()),
                draft_params=sum(p.numel() for p in draft.parameters()), prompt_len=cfg["round_prompt_len"],
                new_tokens=cfg["round_new_tokens"])


def _round_generator(ctx, mode):
    from sglang_tev.hf.drafters import DFlashDrafter
    from sglang_tev.hf.runtime import SpeculativeGenerator

    target, draft, _ = ctx["round-models"]
    key = ("round-gen", mode)
    if key not in ctx:
        gen = SpeculativeGenerator(target, DFlashDrafter(draft, target), **mode_options(mode, _device()))
        gen.time_stages = True  # a CUDA synchronise after each stage, so the stages add up
        ctx[key] = gen
    return ctx[key]


def _time_round(ctx, rec, cfg, mode, T, B):
    import gpu_round

    from sglang_tev import SamplingParams

    _, _, prompts = _round_models(ctx, cfg)
    sp = None if T == 0 else SamplingParams(temperature=T)
    got = gpu_round.measure(_round_generator(ctx, mode), prompts, "tev", B, cfg["round_new_tokens"], sp)
    ms = dict(got["ms_per_round"])
    ms["verify_commit"] = round(ms["verify"] + ms["commit"], 3)
    for s in ROUND_FIGURES:
        rec.figure(f"round/{mode}/{_t(T)}/B{B}/{s}", ms[s], "ms", graph_stats=got["graph_stats"])
    return _graphs_held(dict(got, options=mode_options(mode, _device())))


def _graphs_held(detail: dict) -> dict:
    """With cuda_graphs, a capture that fell back to eager makes the "graphs" figures eager ones: fail."""
    stats = detail.get("graph_stats")
    if detail["options"].get("cuda_graphs") and (not stats or stats["captures"] < 1 or stats["fallbacks"]):
        detail.update(ok=False, why=f"CUDA-graph capture did not hold ({stats}): these graphs figures ran eagerly")
    return detail


def _time_ar(ctx, rec, cfg, mode):
    import gpu_round

    _, _, prompts = _round_models(ctx, cfg)
    got = gpu_round.measure(_round_generator(ctx, mode), prompts, "autoregressive", cfg["round_budgets"][0],
                            cfg["round_new_tokens"])
    rec.figure(f"ar/{mode}/step", got["ms_per_round"]["total"], "ms", graph_stats=got["graph_stats"])
    rec.figure(f"ar/{mode}/tree_forward", got["ms_per_round"]["tree_forward"], "ms", graph_stats=got["graph_stats"])
    return _graphs_held(dict(got, options=mode_options(mode, _device())))


# ------------------------------------------------------------------- anchors and goals
_ANCHORS = None


def anchors() -> dict:
    global _ANCHORS
    if _ANCHORS is None:
        _ANCHORS = json.loads(ANCHORS_FILE.read_text())
    return _ANCHORS


def anchor_for(name: str) -> str:
    """The H200 anchor figure(s) (benchmarks/anchors-h200.json) comparable to figure ``name``,
    as text; "" when none."""
    a = anchors()
    parts = name.split("/")
    if parts[0] == "verifier" and len(parts) == 6:
        method, v, b, t = parts[1], parts[2], parts[3], parts[4]
        if v != "V151936":
            return ""
        cols = a["verifier_us"]["columns"]
        for row in a["verifier_us"]["rows"]:
            r = dict(zip(cols, row))
            if f"B{r['B']}" == b and _t(r["T"]) == t:
                if method in ("tev", "tev-triton"):
                    s = f"TEV reference style {r['tev_reference']} us; unfused logsumexp pass {r['logsumexp_pass']} us"
                    return s + (f"; read floor ~{a['verifier_us']['floor_us_B64']} us" if b == "B64" else "")
                if method == "predraw":
                    return f"predraw (DDTree style) {r['predraw']} us"
        return ""
    if parts[0] == "round" and len(parts) == 5:
        mode, t, b, stage = parts[1:]
        cols = a["ddtree_round_ms"]["columns"]
        for row in a["ddtree_round_ms"]["rows"]:
            r = dict(zip(cols, row))
            if f"B{r['B']}" == b and _t(r["T"]) == t:
                ref = "DDTree reference (HF eager)"
                if stage == "draft":
                    return f"{ref} draft {r['draft']} ms"
                if stage == "build":
                    return f"{ref} tree build + compile {r['tree_build'] + r['tree_compile']:.2f} ms"
                if stage == "tree_forward":
                    s = f"{ref} target tree forward {r['tree_forward']} ms"
                    if b == "B64":
                        compiled = a["tree_forward_65_ms"]["static_cache_compiled"]
                        s += f"; 65-token chunk, StaticCache + torch.compile {compiled} ms"
                    return s
                if stage == "verify_commit":
                    return f"{ref} commit (sample + follow + compact) {r['commit']} ms"
                if stage == "overhead":
                    return f"{ref} non-forward overhead {r['overhead']} ms"
        return ""
    if parts[0] == "ar" and len(parts) == 3:
        s = a["ar_step_ms"]
        if parts[1] == "eager" and parts[2] == "step":
            return (f"DDTree code's autoregressive step {s['ddtree_code_T0_first_pass']} ms (T = 0), "
                    f"{s['ddtree_code_T1_warm']} ms (T = 1)")
        if parts[1] == "eager" and parts[2] == "tree_forward":
            return (f"HF eager 1-token decode forward: DynamicCache {s['hf_eager_dynamic_cache']} ms, "
                    f"StaticCache {s['hf_eager_static_cache']} ms")
        if parts[1] == "graphs":
            return (f"StaticCache + torch.compile 1-token decode forward {s['static_cache_compiled']} ms; weight-read "
                    f"floor {a['weight_read_floor_ms']} ms")
    return ""


def goal_for(name: str) -> dict | None:
    """The goal a figure is reported against (never asserted): {"max", "source"} or None."""
    parts = name.split("/")
    if parts[0] == "verifier" and parts[1] == "tev-triton" and parts[2] == "V151936" and parts[3] == "B64":
        return {"max": 50.0, "source": "issue 18: TEV decision <= 50 us at B = 64, V = 151936, batch 1"}
    if parts[0] == "round" and parts[3] == "B64" and parts[4] == "overhead":
        return {"max": 0.5, "source": "issue 18: non-forward round overhead <= 0.5 ms at B = 64"}
    if parts[0] == "round" and parts[1] == "graphs" and parts[3] == "B64" and parts[4] == "tree_forward":
        return {"max": 7.5, "source": "issue 10: tree forward <= 7.5 ms with graph replay"}
    if name == "ar/graphs/step":
        return {"max": 6.9, "source": "issue 10: autoregressive step <= 6.9 ms with graph replay"}
    return None


# --------------------------------------------------------------------------- recording
def _jsonable(x):
    """JSON for what json cannot write: 0-d tensors / NumPy scalars as floats, else their text."""
    try:
        return float(x)
    except Exception:  # noqa: BLE001 - e.g. a tensor of several elements: its text
        return str(x)


class Recorder:
    """Appends one JSON line per check / figure to ``out/results.jsonl`` (flushed at once) and
    tracebacks to ``out/log.txt``; runs each check guarded against the time budget."""

    def __init__(self, out: Path, step: str, deadline: float, gpu: bool) -> None:
        self.out, self.step, self.deadline, self.gpu = Path(out), step, deadline, gpu

    def write(self, **record) -> None:
        with open(self.out / RESULTS, "a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
            f.flush()

    def log(self, text: str) -> None:
        with open(self.out / LOG, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def figure(self, name: str, value: float, unit: str, **extra) -> None:
        """One figure; on the GPU with its H200 anchor and goal (a dry run's tiny shapes compare to nothing)."""
        goal = goal_for(name) if self.gpu else None
        self.write(type="figure", step=self.step, name=name, value=round(float(value), 4), unit=unit,
                   anchor=anchor_for(name) if self.gpu else "", goal=goal,
                   meets_goal=None if goal is None else float(value) <= goal["max"], **extra)

    def run(self, check: Check, ctx: dict) -> str:
        left = self.deadline - time.time()
        need = check.est_s if self.gpu else 0.0  # dry run: estimates are for the GPU
        if left <= 0 or left < need:
            self.write(type="check", step=self.step, name=check.name, status="skipped",
                       reason=f"time budget: {max(0.0, left):.0f} s left, the check needs ~{check.est_s:.0f} s")
            print(f"[{self.step}] skipped {check.name} (time budget)", flush=True)
            return "skipped"
        t0 = time.time()
        error = None
        try:
            detail = dict(check.fn(ctx, self) or {})
            ok = detail.pop("ok", True)
            why = detail.pop("why", None)
            status = "pass" if ok else "fail"
            if not ok:
                error = why or "wrong result"
        except (KeyboardInterrupt, SystemExit):
            raise
        except SkipCheck as e:
            self.write(type="check", step=self.step, name=check.name, status="skipped", reason=str(e))
            print(f"[{self.step}] skipped {check.name} ({e})", flush=True)
            return "skipped"
        except BaseException as e:  # noqa: BLE001 - any failure is recorded and the step goes on
            detail, status, error = {}, "fail", f"{type(e).__name__}: {e}"
            self.log(f"[{self.step}] {check.name} raised:\n{traceback.format_exc()}")
        secs = time.time() - t0
        self.write(type="check", step=self.step, name=check.name, status=status, seconds=round(secs, 2),
                   error=error, detail=detail)
        print(f"[{self.step}] {status:7s} {check.name} ({secs:.1f} s)" + (f": {error}" if error else ""), flush=True)
        return status


def environment() -> dict:
    import torch

    from sglang_tev.machine import machine_info

    env = dict(**machine_info("python", "platform", "torch", cuda="cuda_version", cpu_count="cpu_count"),
               triton_interpret=os.environ.get("TRITON_INTERPRET", ""))
    for dist in ("triton", "transformers", "scipy"):  # versions without importing them (seconds each)
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   multiprocessors=p.multi_processor_count)
    return env


def run_step(step: str, out: Path, deadline: float, dry: bool) -> int:
    """Run the checks of ``step`` in this process (the ``--step`` child)."""
    rec = Recorder(out, step, deadline, gpu=not dry)
    rec.write(type="meta", step=step, **environment())
    ctx: dict = {}
    for check in plan(DRY if dry else GPU)[step]:
        rec.run(check, ctx)
    return 0


# ------------------------------------------------------------------------------ parent
def read_records(out: Path) -> list[dict]:
    path = out / RESULTS
    if not path.exists():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a killed process
            continue
    return recs


def _spawn(step: str, out: Path, deadline: float, dry: bool, log) -> tuple[int | None, list[str]]:
    """Run one step in a child process; stream its output to the log (progress lines also to
    stdout). Returns (exit code or None when killed at the deadline, its last lines)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step", step, "--out", str(out), "--deadline", repr(deadline)]
    if dry:
        cmd.append("--dry-run")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if dry:  # Triton's interpreter must be on before Triton is imported
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    tail: list[str] = []

    def pump():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            tail.append(line)
            del tail[:-40]
            if line.startswith(f"[{step}]"):
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(1.0, deadline + STEP_GRACE_S - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()  # our own child, by its handle
        proc.wait()
        rc = None
    reader.join(timeout=10)
    return rc, tail


def finish_records(out: Path, cfg: dict, step_status: dict) -> list[dict]:
    """Record every planned check that left no record: skipped (the step could not start, or
    ended cleanly before it), or failed (the check that was running when its step process died
    or was killed)."""
    recs = read_records(out)
    seen = {r["name"] for r in recs if r.get("type") == "check"}
    extra = []
    for step, checks in plan(cfg).items():
        st = step_status.get(step, {"status": "skipped"})
        blamed = False
        for c in checks:
            if c.name in seen:
                continue
            if st["status"] in ("crashed", "killed") and not blamed:
                blamed = True
                extra.append(dict(type="check", step=step, name=c.name, status="fail",
                                  error=f"the step process {st['status']} during this check ({st.get('why', '')}); "
                                        f"see {LOG}"))
            else:
                why = ("time budget: the step could not start" if st["status"] == "skipped" else
                       f"the step process {st['status']} before this check")
                extra.append(dict(type="check", step=step, name=c.name, status="skipped", reason=why))
    with open(out / RESULTS, "a") as f:
        for r in extra:
            f.write(json.dumps(r) + "\n")
    return recs + extra


def _fmt(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def figure_rows(cfg: dict, recs: list[dict]) -> list[dict]:
    """Every planned figure with its value (None when not measured), anchor and goal (on the GPU)."""
    gpu = cfg["mode"] == "gpu"
    figs = {r["name"]: r for r in recs if r.get("type") == "figure"}
    status = {r["name"]: r["status"] for r in recs if r.get("type") == "check"}
    rows = []
    for checks in plan(cfg).values():
        for c in checks:
            for name in c.figures:
                f = figs.get(name)
                goal = goal_for(name) if gpu else None
                rows.append(dict(name=name, value=None if f is None else f["value"], unit=None if f is None else f["unit"],
                                 check_status=status.get(c.name, "skipped"), anchor=anchor_for(name) if gpu else "",
                                 goal=goal,
                                 meets_goal=None if f is None or goal is None else f["value"] <= goal["max"],
                                 cuda_graph=None if f is None else f.get("cuda_graph")))
    return rows


def _value(r: dict, gpu: bool) -> str:
    if r["value"] is None:
        return f"not measured ({r['check_status']})"
    eager = gpu and r["name"].startswith("verifier/") and r["cuda_graph"] is False
    return f"{_fmt(r['value'])} {r['unit']}" + (" (timed eagerly: capture failed)" if eager else "")


def _goal_text(r: dict) -> str:
    if r["goal"] is None:
        return ""
    verdict = "" if r["meets_goal"] is None else (" **met**" if r["meets_goal"] else " **missed**")
    return f"<= {r['goal']['max']:g} ({r['goal']['source'].split(':')[0]}){verdict}"


def summary(cfg: dict, recs: list[dict], run: dict) -> tuple[str, str]:
    """(markdown of every check and figure, the short text table for stdout)."""
    gpu = run["mode"] == "gpu"
    checks = [r for r in recs if r.get("type") == "check"]
    order = {c.name: i for i, c in enumerate(x for cs in plan(cfg).values() for x in cs)}
    checks.sort(key=lambda r: order.get(r["name"], 1 << 30))
    counts = {s: {k: 0 for k in ("pass", "fail", "skipped")} for s in STEPS}
    for r in checks:
        counts[r["step"]][r["status"]] += 1
    metas = [r for r in recs if r.get("type") == "meta"]
    env = metas[0] if metas else {}
    head = (f"sglang-tev GPU check ({run['mode']}): {sum(c['pass'] for c in counts.values())} pass, "
            f"{sum(c['fail'] for c in counts.values())} fail, {sum(c['skipped'] for c in counts.values())} skipped "
            f"in {run['seconds']:.0f} s (time budget {run['time_budget']:.0f} s)")
    machine = (f"{env.get('gpu') or 'CPU only'}, torch {env.get('torch')}, triton {env.get('triton')}, "
               f"transformers {env.get('transformers')}, Python {env.get('python')}")
    figs = figure_rows(cfg, recs)
    md = [f"# {head}", "", f"Machine: {machine}. Command: `{run['command']}`. Started {run['started']} UTC.", ""]
    if run["mode"] != "gpu":
        md += ["Dry run: CPU, tiny shapes; the figures measure nothing comparable to the anchors.", ""]
    md += ["## Checks", "", "| step | check | status | s | note |", "|---|---|---|---|---|"]
    for r in checks:
        note = r.get("error") or r.get("reason") or ""
        md.append(f"| {r['step']} | `{r['name']}` | {r['status']} | {r.get('seconds', '')} | {note.replace('|', '/')} |")
    md += ["", "## Figures", "", f"Anchors: {anchors()['source'].split(':')[0]} (H200, 2026-11-30), copied into "
           "`benchmarks/anchors-h200.json`.", "", "| figure | value | H200 anchor | goal |", "|---|---|---|---|"]
    for r in figs:
        md.append(f"| `{r['name']}` | {_value(r, gpu)} | {r['anchor']} | {_goal_text(r)} |")
    # the short table: counts, failures, the goal figures and the first budget's figures
    short = [head, machine, "", f"{'step':8s} {'pass':>5s} {'fail':>5s} {'skip':>5s}"]
    for s in STEPS:
        short.append(f"{s:8s} {counts[s]['pass']:5d} {counts[s]['fail']:5d} {counts[s]['skipped']:5d}")
    fails = [r for r in checks if r["status"] == "fail"]
    for r in fails[:12]:
        short.append(f"FAIL {r['name']}: {(r.get('error') or '')[:160]}")
    if len(fails) > 12:
        short.append(f"... {len(fails) - 12} more failures in {SUMMARY}")
    b0 = f"/B{cfg['round_budgets'][0]}/"
    vb0 = f"/B{cfg['verifier_budgets'][0]}/"
    keep = [r for r in figs if r["goal"] or (r["name"].startswith("verifier/") and vb0 in r["name"])
            or (r["name"].startswith("round/") and b0 in r["name"] and r["name"].rsplit("/", 1)[1] in
                ("draft", "tree_forward", "overhead")) or r["name"].endswith("/step")]
    if keep:
        short += ["", f"{'figure':40s} {'value':>14s}  goal / anchor"]
        for r in keep:
            val = _value(r, gpu) if r["value"] is not None else "not measured"
            extra = "; ".join(x for x in (_goal_text(r).replace("**", ""), r["anchor"]) if x)
            short.append(f"{r['name']:40s} {val:>14s}  {extra[:120]}")
    short.append(f"(all checks and figures: {SUMMARY}; JSON lines: {RESULTS}; tracebacks: {LOG})")
    return "\n".join(md) + "\n", "\n".join(short)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="One GPU check of sglang-tev: Triton TEV, the runtime on CUDA, timings.")
    ap.add_argument("--out", required=True, help="directory for results.jsonl, log.txt and summary.md")
    ap.add_argument("--dry-run", action="store_true", help="the same checks on CPU at tiny shapes (seconds)")
    ap.add_argument("--time-budget", type=float, default=450.0,
                    help="seconds for the whole run; checks that no longer fit are recorded as skipped (default 450)")
    ap.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    ap.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)  # internal: run one step in this process
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.step:
        return run_step(args.step, out, args.deadline, args.dry_run)

    if args.time_budget < 0:
        ap.error(f"argument --time-budget: must be >= 0, got {args.time_budget:g}")
    if (out / RESULTS).exists() and not args.overwrite:
        ap.exit(2, f"{ap.prog}: error: argument --out: {out / RESULTS} exists; pass --overwrite to replace it\n")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            ap.exit(2, f"{ap.prog}: error: no CUDA GPU is available; use --dry-run to run the checks on CPU\n")
    cfg = DRY if args.dry_run else GPU
    out.mkdir(parents=True, exist_ok=True)
    for name in (RESULTS, LOG, SUMMARY):
        (out / name).unlink(missing_ok=True)
    t0 = time.time()
    deadline = t0 + args.time_budget
    run = dict(type="run", mode=cfg["mode"], command=" ".join(["python", "scripts/gpu_check.py", *(argv or sys.argv[1:])]),
               started=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)), time_budget=args.time_budget)
    Recorder(out, "-", deadline, False).write(**run)
    step_status: dict[str, dict] = {}
    with open(out / LOG, "a") as log:
        for step in STEPS:
            left = deadline - time.time()
            if left < 5:
                step_status[step] = dict(status="skipped")
                print(f"[{step}] skipped: {max(0.0, left):.0f} s of the time budget left", flush=True)
                continue
            s0 = time.time()
            step_deadline = min(deadline, s0 + STEP_SHARE[step] * args.time_budget)
            log.write(f"==== step {step} ({left:.0f} s of the budget left, {step_deadline - s0:.0f} s for this step)\n")
            log.flush()
            rc, tail = _spawn(step, out, step_deadline, args.dry_run, log)
            if rc == 0:
                st = dict(status="done")
            elif rc is None:
                st = dict(status="killed", why=f"still running {STEP_GRACE_S:.0f} s after its share of the time budget")
            else:
                st = dict(status="crashed", why=f"exit status {rc}")
                sys.stdout.write("".join(tail[-20:]))
            step_status[step] = st
            Recorder(out, step, deadline, False).write(type="step", step=step, seconds=round(time.time() - s0, 1), **st)
    run["seconds"] = time.time() - t0
    recs = finish_records(out, cfg, step_status)
    md, short = summary(cfg, recs, run)
    (out / SUMMARY).write_text(md)
    print("\n" + short, flush=True)
    failed = any(r.get("type") == "check" and r["status"] == "fail" for r in recs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
