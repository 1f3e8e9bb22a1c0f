"""Side by side on SGLang 0.5.23's real CPU Engine: plain decoding, SGLang's DFLASH, TEV N=17, N=65.

Each mode is one ``sglang.Engine`` started in its own process with the CPU test harness
(``sglang_tev.testing.sglang_cpu``: stand-ins for sgl_kernel's CPU ops only; ``tev_cpu`` attention), one at a
time, all with the shipped tiny-code pair (``sglang_tev/assets/tiny-code``, bf16), the same
greedy prompts and the same ``max_new_tokens`` (EOS ignored by default, so every mode emits the
same number of tokens). Per mode:

* a warm-up request (not timed);
* **batch**: all prompts in one ``Engine.generate`` call (concurrent), wall time of the call;
* **alone**: each prompt in its own call, one after another, wall time of each call.

Reported per mode: tokens per round (mean tokens a verify round commits, accepted drafts + the
bonus, pooled over every round of the batch: ``1 + spec_num_correct_drafts / spec_verify_ct``
summed over requests, SGLang's counter of each round's ``accept_lens``, the same for DFLASH and
TEV; TEV's per-round ``meta_info["tev_accept_length"]`` holds the same numbers but loses rounds
on long requests, see :func:`tokens_per_round`), SGLang's own
``spec_accept_length`` (``completion_tokens / spec_verify_ct``, which also counts the prefill's
token and the cut at ``max_new_tokens``; ``tokenizer_manager.py:3166``), output tokens/s of the
batch and of requests alone (median over prompts), and whether the greedy ids equal plain
decoding's (batch vs batch, alone vs alone; where they differ, the bf16 HF target's logit gap
between the two tokens at the first divergence, so near-ties can be told from bugs).

Usage (from the repository root; this checkout's ``sglang_tev`` is put first on the Engines'
``PYTHONPATH``)::

    OMP_NUM_THREADS=1 python benchmarks/sglang_cpu_side_by_side.py \\
        [--prompts humaneval|engine] [--limit 8] [--max-new-tokens 128] [--modes plain,dflash,tev17,tev65] \\
        [--output benchmarks/results/sglang-cpu-side-by-side.json]

``--prompts engine`` uses the 9 prompts of ``tests/engine/test_sglang_engine.py``. The JSON (written
after every mode, so a run cut short keeps what it measured) holds the command, machine, versions,
date, per-mode start and wall times, per-request figures and the ids.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {
    # name: label (Engine kwargs: engine_kwargs)
    "plain": "plain decoding",
    "dflash": "DFLASH (chain, block 16)",
    "tev17": "TEV N=17",
    "tev65": "TEV N=65",
}
ENGINE_TEST_PROMPTS = "tests/engine/test_sglang_engine.py"


SYNC = "-sync"
"""Mode suffix: the same Engine with overlap scheduling off (``disable_overlap_schedule``); the
modes without it run with SGLang's default, overlap on."""


def engine_kwargs(mode: str) -> dict:
    from sglang_tev.testing.sglang_cpu.hosts import dflash_kwargs, plain_kwargs, tev_kwargs

    if mode.endswith(SYNC):
        return dict(engine_kwargs(mode[: -len(SYNC)]), disable_overlap_schedule=True)
    if mode == "plain":
        return plain_kwargs()
    if mode == "dflash":
        return dflash_kwargs()
    if mode.startswith("tev"):
        return tev_kwargs(int(mode[3:]), attention_backend="tev_cpu")
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")


def load_prompt_ids(which: str, limit: int | None, tokenizer) -> tuple[list[str], list[list[int]]]:
    if which == "humaneval":
        from sglang_tev.hf.datasets import encode_prompt, load_humaneval

        prompts = load_humaneval(limit)
        return [p.id for p in prompts], [encode_prompt(p, tokenizer) for p in prompts]
    if which == "engine":
        from sglang_tev.testing.sglang_cpu import engine_prompts

        prompts = engine_prompts()
        texts = prompts[:limit] if limit else prompts
        return [f"engine-test/{i}" for i in range(len(texts))], [tokenizer(t).input_ids for t in texts]
    raise ValueError(f"--prompts must be 'humaneval' or 'engine', got {which!r}")


def machine() -> dict:
    from sglang_tev.machine import machine_info, proc_cpu_model

    m = machine_info("cpu_count", "platform")
    flags = ""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "nproc": m["cpu_count"],
        "cpu_model": proc_cpu_model(),
        "avx512f": " avx512f" in flags,
        "amx": " amx_tile" in flags,
        "mem_total": mem,
        "platform": m["platform"],
        "gpu": "none (CPU only)",
    }


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("sglang", "torch", "transformers", "sglang-tev"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    try:
        out["git_commit"] = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--", "sglang_tev"],
            capture_output=True, text=True, check=True,
        ).stdout.split("\n")
        out["git_dirty"] = [d.strip() for d in dirty if d.strip()]
    except (OSError, subprocess.CalledProcessError):
        out["git_commit"] = None
    return out


def tokens_per_round(metas: list[dict]) -> dict:
    """Pooled tokens per verify round (accepted drafts + bonus), SGLang's accept length, and how
    much of TEV's per-round ``tev_accept_length`` list reached ``meta_info``.

    The figure is SGLang's own counter for every speculative mode: each round adds its
    ``accept_lens`` entry - 1 to ``spec_num_correct_drafts`` and 1 to ``spec_verify_ct``
    (``batch_result_processor.py:785-836``); TEV hands SGLang ``accept_lens = commit_lens``, the
    same numbers as its ``tev_accept_length``. The list itself is not used: SGLang slices a
    request's ``customized_info`` by output-token offsets at every incremental send
    (``output_streamer.py:706-707``, ``req_values[send_token_offset:len(output_ids)]``), which
    drops the rounds of a per-round list after the first send of a long request."""
    out = {}
    verify = sum(int(m.get("spec_verify_ct") or 0) for m in metas)
    if verify:
        completion = sum(int(m["completion_tokens"]) for m in metas)
        out["rounds"] = verify
        out["tokens_per_round"] = 1 + sum(int(m.get("spec_num_correct_drafts") or 0) for m in metas) / verify
        out["spec_accept_length"] = completion / verify  # SGLang's definition, pooled
    lists = [m["tev_accept_length"] for m in metas if "tev_accept_length" in m]
    if lists:
        tev = [a for t in lists for a in t]
        out["tev_accept_length_rounds"] = len(tev)
        out["tev_accept_length_mean"] = sum(tev) / len(tev) if tev else None
        out["tev_accept_length_complete_requests"] = sum(
            len(m["tev_accept_length"]) == int(m.get("spec_verify_ct") or -1) for m in metas if "tev_accept_length" in m)
        full = [m for m in metas if "tev_accept_length" in m and len(m["tev_accept_length"]) == int(m.get("spec_verify_ct") or -1)]
        # where the list is complete it must agree with SGLang's counter round for round
        out["tev_accept_length_agrees_where_complete"] = all(
            sum(m["tev_accept_length"]) == m["spec_verify_ct"] + m["spec_num_correct_drafts"] for m in full)
    return out


class Gap:
    """HF bf16 target logit gap between two tokens at a divergence (loaded on first use)."""

    def __init__(self, target):
        self.target = target
        self.model = None

    def __call__(self, prompt, prefix, a, b) -> float:
        import torch

        if self.model is None:
            from transformers import AutoModelForCausalLM

            torch.set_num_threads(1)
            self.model = AutoModelForCausalLM.from_pretrained(self.target, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits = self.model(torch.tensor([list(prompt) + list(prefix)])).logits[0, -1].float()
        return abs(float(logits[a] - logits[b]))


def compare(got, want, prompt_ids, gap: Gap) -> dict:
    from sglang_tev.testing.sglang_cpu.hosts import first_divergence

    diffs = []
    for i, (g, w) in enumerate(zip(got, want)):
        k = first_divergence(g, w)
        if k is None:
            continue
        d = {"prompt": i, "index": k}
        if k < min(len(g), len(w)):
            d.update(plain=w[k], got=g[k], hf_logit_gap=round(gap(prompt_ids[i], w[:k], w[k], g[k]), 4))
        else:
            d["length"] = [len(g), len(w)]
        diffs.append(d)
    return {"identical": len(got) - len(diffs), "of": len(got), "divergences": diffs}


def run_mode(mode: str, prompt_ids, sp: dict, warm_ids) -> dict:
    from sglang_tev.testing.sglang_cpu.hosts import EngineHost

    kwargs = engine_kwargs(mode)
    rec = {"mode": mode, "label": MODES[mode], "engine_kwargs": kwargs}
    t0 = time.monotonic()
    host = EngineHost(kwargs)
    rec["start_s"] = round(time.monotonic() - t0, 2)
    try:
        info = host.call("server_info")
        rec["server"] = {k: info.get(k) for k in (
            "speculative_algorithm", "speculative_num_draft_tokens", "speculative_num_steps",
            "speculative_dflash_block_size", "attention_backend", "speculative_draft_attention_backend",
            "max_running_requests", "context_length",
        ) if k in info}
        host.generate([warm_ids], [dict(sp, max_new_tokens=8)])
        n = len(prompt_ids)
        t = time.perf_counter()
        batch = host.generate(prompt_ids, [dict(sp) for _ in range(n)])
        rec["batch_wall_s"] = time.perf_counter() - t
        alone, walls = [], []
        for ids in prompt_ids:
            t = time.perf_counter()
            alone.append(host.generate([ids], [dict(sp)])[0])
            walls.append(time.perf_counter() - t)
        rec["alone_wall_s"] = walls
    finally:
        host.close()
    tokens = [len(o["output_ids"]) for o in batch]
    rec["batch_tokens"] = sum(tokens)
    rec["batch_tok_s"] = sum(tokens) / rec["batch_wall_s"]
    per = [len(o["output_ids"]) / w for o, w in zip(alone, walls)]
    rec["alone_tok_s"] = per
    rec["alone_tok_s_median"] = statistics.median(per)
    rec["alone_tok_s_pooled"] = sum(len(o["output_ids"]) for o in alone) / sum(walls)
    rec["batch"] = tokens_per_round([o["meta_info"] for o in batch])
    rec["alone"] = tokens_per_round([o["meta_info"] for o in alone])
    keep = ("completion_tokens", "finish_reason", "e2e_latency", "spec_accept_length", "spec_verify_ct",
            "spec_num_correct_drafts", "tev_accept_length")
    rec["batch_requests"] = [
        {"output_ids": o["output_ids"], **{k: o["meta_info"][k] for k in keep if k in o["meta_info"]}} for o in batch
    ]
    rec["alone_output_ids"] = [o["output_ids"] for o in alone]
    return rec


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def table(result: dict) -> str:
    lines = [
        "| mode | verify tokens / round | tokens per round | SGLang `spec_accept_length` | verify rounds | "
        "`tev_accept_length` rounds returned | batch tok/s | alone tok/s (median) | greedy = plain (batch) | "
        "greedy = plain (alone) | Engine start s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in result["modes"]:
        if "error" in rec:
            lines.append(f"| {rec['label']} | failed: {rec['error'][:80]} |" + " |" * 9)
            continue
        n = (rec.get("server") or {}).get("speculative_num_draft_tokens") if rec["mode"] != "plain" else 1
        def eq(key):
            c = rec.get(key)
            if c is None:
                return "(reference)"
            s = f"{c['identical']}/{c['of']}"
            gaps = [d.get("hf_logit_gap") for d in c["divergences"] if d.get("hf_logit_gap") is not None]
            if gaps:
                s += " (gaps " + ", ".join(f"{g:.3f}" for g in gaps) + ")"
            return s
        lines.append(
            f"| {rec['label']} | {n} | {fmt(rec['batch'].get('tokens_per_round', 1.0 if rec['mode'] == 'plain' else None))} | "
            f"{fmt(rec['batch'].get('spec_accept_length'))} | {rec['batch'].get('rounds', '-')} | "
            f"{rec['batch'].get('tev_accept_length_rounds', '-')} | {rec['batch_tok_s']:.1f} | {rec['alone_tok_s_median']:.1f} | "
            f"{eq('equal_plain_batch')} | {eq('equal_plain_alone')} | {rec['start_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="humaneval", help="'humaneval' (default) or 'engine' (tests/engine/test_sglang_engine.py's 9)")
    ap.add_argument("--limit", type=int, default=8, help="number of prompts (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-ignore-eos", action="store_true", help="stop at EOS (default: EOS ignored, equal lengths)")
    ap.add_argument("--modes", default="plain,dflash,tev17,tev65",
                    help=f"comma-separated; a {SYNC} suffix (e.g. tev65{SYNC}) runs that mode with overlap scheduling off")
    ap.add_argument("--output", default=os.path.join("benchmarks", "results", "sglang-cpu-side-by-side.json"))
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        base = m[: -len(SYNC)] if m.endswith(SYNC) else m
        if base not in MODES and not (base.startswith("tev") and base[3:].isdigit()):
            ap.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)} (or tevN), each optionally with {SYNC}")
        MODES.setdefault(base, f"TEV N={base[3:]}")
        if m != base:
            MODES[m] = MODES[base] + ", overlap off"
    if "plain" not in modes:
        ap.error("--modes must include plain (the reference)")
    modes = ["plain"] + [m for m in modes if m != "plain"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the Engines import this checkout's sglang_tev
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

    from transformers import AutoTokenizer

    from sglang_tev.testing.sglang_cpu.hosts import TARGET

    from sglang_tev.atomic import atomic_write

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    names, prompt_ids = load_prompt_ids(args.prompts, args.limit, tokenizer)
    sp = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": not args.no_ignore_eos}
    result = {
        "command": "OMP_NUM_THREADS=" + os.environ["OMP_NUM_THREADS"] + " python " + " ".join(
            shlex.quote(a) for a in [os.path.relpath(os.path.abspath(__file__), ROOT)] + sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "load_avg_start": os.getloadavg(),
        "prompts": {"set": args.prompts, "names": names, "lengths": [len(p) for p in prompt_ids]},
        "sampling_params": sp,
        "modes": [],
    }
    gap = Gap(TARGET)
    out_path = os.path.join(ROOT, args.output) if not os.path.isabs(args.output) else args.output
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    t_all = time.monotonic()
    plain = None
    for mode in modes:
        print(f"[{mode}] starting the Engine ...", flush=True)
        t = time.monotonic()
        try:
            rec = run_mode(mode, prompt_ids, sp, prompt_ids[0])
        except Exception as e:  # record the failure and go on with the next mode
            rec = {"mode": mode, "label": MODES[mode], "error": f"{type(e).__name__}: {e}"[-4000:]}
        rec["mode_wall_s"] = round(time.monotonic() - t, 2)
        if "error" not in rec:
            if mode == "plain":
                plain = rec
                rec["batch_vs_alone"] = compare(
                    [r["output_ids"] for r in rec["batch_requests"]], rec["alone_output_ids"], prompt_ids, gap)
            elif plain is not None:
                rec["equal_plain_batch"] = compare(
                    [r["output_ids"] for r in rec["batch_requests"]], [r["output_ids"] for r in plain["batch_requests"]],
                    prompt_ids, gap)
                rec["equal_plain_alone"] = compare(rec["alone_output_ids"], plain["alone_output_ids"], prompt_ids, gap)
            print(f"[{mode}] tokens/round {fmt(rec['batch'].get('tokens_per_round'))}, batch {rec['batch_tok_s']:.1f} tok/s, "
                  f"alone {rec['alone_tok_s_median']:.1f} tok/s, {rec['mode_wall_s']:.0f} s", flush=True)
        else:
            print(f"[{mode}] FAILED: {rec['error'][:2000]}", flush=True)
        result["modes"].append(rec)
        result["total_wall_s"] = round(time.monotonic() - t_all, 2)
        result["load_avg_end"] = os.getloadavg()
        atomic_write(out_path, json.dumps(result, indent=1))
    m = result["machine"]
    print(f"\nMachine: {m['nproc']} CPUs, {m['cpu_model']}, no GPU; sglang {result['versions']['sglang']}, "
          f"torch {result['versions']['torch']}, transformers {result['versions']['transformers']}; "
          f"{len(prompt_ids)} {args.prompts} prompts, greedy, {args.max_new_tokens} new tokens"
          f"{'' if args.no_ignore_eos else ', EOS ignored'}; {result['total_wall_s']:.0f} s; JSON: {args.output}")
    print(f"Command: {result['command']}\n")
    print(table(result))
    return 0 if all("error" not in r for r in result["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
