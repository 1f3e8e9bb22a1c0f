"""The engine of ``sglang-tev bench``: every method on one prompt set, in one run.

For each temperature T (DESIGN §5): ``autoregressive`` once, ``chain`` once (the linear DFlash
block, verified by TEV), and DDTree verified by ``tev`` / ``predraw`` / ``sequential`` for every
budget B; ``chain`` and the DDTree methods once per draft mode in ``draft_modes`` (a
DFlash2 drafter's ``lattice`` / ``marginal`` modes side by side; ``auto`` by default, see
:data:`~sglang_tev.hf.runtime.DRAFT_MODES`). Every configuration decodes every prompt with the
same seed (``seed + prompt index``) through :meth:`SpeculativeGenerator.generate`.

Files written to ``output_dir``:

* ``results.json`` — one record per (method, budget, T, draft mode), keys :data:`RECORD_KEYS`;
  ``draft_mode`` is the mode the runs used (``lattice`` / ``marginal``, ``auto`` resolved; null
  for autoregressive);
  ``tau`` = total emitted tokens / total rounds over all prompts (DESIGN §3: mean(accept_len + 1),
  a round cut by a stop or by max_new_tokens counts what it emitted); ``accept_len_mean`` and
  ``coverage_mean`` (C_p, paper Eq. 6) are means over the same rounds. Speed is robust to a busy
  machine: every (configuration, prompt) is decoded ``repeats`` times (same seed, same tokens)
  and its rate is new tokens / the median decode seconds (prefill excluded); ``tokens_per_s`` is
  the median of those per-prompt rates and ``tokens_per_s_iqr`` their [25th, 75th] percentiles;
  ``speedup`` is the median over prompts of the per-prompt rate over the autoregressive rate at
  the same T (paired; null without an autoregressive record), ``speedup_iqr`` its quartiles;
  ``repeat_spread`` = median over prompts of (max - min) / median of the repeats' decode seconds
  (0 with one repeat): the timing noise of the machine. ``stage_ms`` = mean wall ms per round of
  each stage in :data:`~sglang_tev.hf.runtime.STAGES` (first repeat); ``budget`` is null for
  autoregressive and chain; ``skipped_prompts`` = prompts too long for the model (prompt tokens
  + 1 > positions).
* ``outputs.jsonl`` — one line per (configuration, prompt): the new token ids, text, finish reason,
  tokens emitted per round, the median and every repeat's decode seconds.
* ``meta.json`` — command line, machine, versions, device, dtype, date, settings, ``target_path``
  (once; the CLI adds ``draft_path``).
* ``tau_hist.png`` — tokens emitted per round, one panel per (method, budget), temperatures
  overlaid; ``stage_ms.png`` — stacked mean stage ms per round, one panel per temperature.

Timings include a CUDA synchronise per stage (the runtime's), so stage_ms adds up to the round.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import statistics
from collections import Counter
import sys
from pathlib import Path
from typing import Callable, Sequence

from ..atomic import atomic_write
from ..machine import machine_info
from ..sampling import SamplingParams
from .datasets import Prompt, encode_prompt
from ..spec import DRAFT_MODES, GENERATION_METHODS, MAX_BUDGET, VERIFIERS, is_greedy
from .runtime import STAGES, SpeculativeGenerator

__all__ = ["run_bench", "bench_configs", "format_table", "DEFAULT_METHODS", "RECORD_KEYS", "TREE_METHODS"]

DEFAULT_METHODS = ("autoregressive", "chain", "tev", "predraw", "sequential")
TREE_METHODS = VERIFIERS  # DDTree + this verifier, one run per budget
RECORD_KEYS = ("method", "budget", "temperature", "draft_mode", "prompts", "new_tokens", "rounds", "tau",
               "accept_len_mean", "coverage_mean", "tokens_per_s", "tokens_per_s_iqr", "speedup", "speedup_iqr",
               "repeats", "repeat_spread", "stage_ms", "skipped_prompts", "budgets_chosen")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_configs(methods: Sequence[str], budgets: Sequence[int], temperatures: Sequence[float],
                  draft_modes: Sequence[str] | None = None) -> list[tuple]:
    """(method, budget, temperature) in run order: per T, each method in ``methods`` order; tree
    methods once per budget, autoregressive and chain once with budget None. With
    ``draft_modes``: (method, budget, temperature, draft mode), chain and the tree methods once per
    mode (each method's modes together), autoregressive once with draft mode None."""
    out = []
    for T in temperatures:
        for m in methods:
            bs = budgets if m in TREE_METHODS else [None]
            if draft_modes is None:
                out.extend((m, b, T) for b in bs)
            elif m == "autoregressive":
                out.append((m, None, T, None))
            else:
                out.extend((m, b, T, dm) for b in bs for dm in draft_modes)
    return out


def _draft_modes(generator, draft_modes) -> list[str]:
    """The requested draft modes resolved for this generator (``auto`` -> lattice / marginal),
    deduplicated, in order. ValueError naming ``draft_modes``."""
    if isinstance(draft_modes, str) or not draft_modes:
        raise ValueError(f"draft_modes must be a non-empty list of {DRAFT_MODES}, got {draft_modes!r}")
    out = []
    for dm in draft_modes:
        if dm not in DRAFT_MODES:
            raise ValueError(f"draft_modes: unknown {dm!r}; choose from {list(DRAFT_MODES)}")
        if generator.drafter is None:
            continue
        try:
            out.append(generator.resolve_draft_mode(dm, "tev"))
        except ValueError as e:
            raise ValueError(f"draft_modes: {e}") from None
    return list(dict.fromkeys(out)) or ["marginal"]


def _check_args(generator, budgets, temperatures, max_new_tokens, methods, seed, repeats=1):
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("methods must name at least one method")
    bad = [m for m in methods if m not in GENERATION_METHODS]
    if bad:
        raise ValueError(f"methods: unknown {bad}; choose from {list(GENERATION_METHODS)}")
    budgets = list(dict.fromkeys(budgets))
    if any(b != "auto" and (isinstance(b, bool) or not isinstance(b, int) or b < 0) for b in budgets):
        raise ValueError(f"budgets must be 'auto' or ints >= 0, got {budgets!r}")
    if any(b != "auto" and b > MAX_BUDGET for b in budgets):
        raise ValueError(f"budgets must be <= {MAX_BUDGET}, got {budgets!r}")
    if not budgets and any(m in TREE_METHODS for m in methods):
        raise ValueError("budgets must hold at least one budget for the DDTree methods")
    temperatures = list(dict.fromkeys(float(t) for t in temperatures))
    if not temperatures or any(not (t >= 0) or math.isinf(t) for t in temperatures):
        raise ValueError(f"temperatures must be finite numbers >= 0, got {temperatures!r}")
    if "greedy" in methods and any(not is_greedy(t) for t in temperatures):
        raise ValueError("methods: 'greedy' is exact only at temperature 0; drop it or use temperatures 0")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if generator.drafter is None and any(m != "autoregressive" for m in methods):
        raise ValueError("methods: speculative methods need a drafter; load one or use methods=['autoregressive']")
    return methods, budgets, temperatures


def _encode_all(generator, prompts, chat_template, log):
    """-> [(index, id, token ids)] of the prompts that fit, number skipped."""
    kept, skipped = [], 0
    limit = generator.max_positions
    for i, p in enumerate(prompts):
        if isinstance(p, (Prompt, str)):
            if generator.tokenizer is None:
                raise ValueError("prompts: text prompts need a tokenizer; pass token ids instead")
            ids = encode_prompt(p, generator.tokenizer, chat_template)
            pid = p.id if isinstance(p, Prompt) else str(i)
        else:
            ids = [int(t) for t in p]
            pid = str(i)
        if not ids:
            log(f"[sglang-tev] warning: skipping prompt {pid!r}: it has no tokens")
            skipped += 1
        elif len(ids) + 1 > limit:
            log(f"[sglang-tev] warning: skipping prompt {pid!r}: {len(ids)} tokens + 1 > the model's "
                f"{limit} positions")
            skipped += 1
        else:
            kept.append((i, pid, ids))
    return kept, skipped


def _quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(25th, 50th, 75th) percentiles, linear interpolation (numpy's default)."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _prompt_rates(runs, times) -> list[float]:
    """Per prompt: new tokens / median decode seconds over the repeats."""
    return [len(res.token_ids) / statistics.median(ts) if statistics.median(ts) > 0 else 0.0
            for res, ts in zip(runs, times)]


def _record(method, budget, T, draft_mode, runs, times, skipped) -> dict:
    """``runs``: the first repeat's result per prompt; ``times``: every repeat's decode seconds per prompt."""
    rounds = [r for res in runs for r in res.rounds]
    n_rounds = max(1, len(rounds))
    new_tokens = sum(len(res.token_ids) for res in runs)
    q1, med, q3 = _quartiles(_prompt_rates(runs, times))
    spread = statistics.median((max(ts) - min(ts)) / statistics.median(ts) if statistics.median(ts) > 0 else 0.0
                               for ts in times)
    return {
        "method": method,
        "budget": budget,
        "temperature": float(T),
        "draft_mode": draft_mode,
        "prompts": len(runs),
        "new_tokens": new_tokens,
        "rounds": len(rounds),
        "tau": sum(r.emitted for r in rounds) / n_rounds,
        "accept_len_mean": sum(r.accept_len for r in rounds) / n_rounds,
        "coverage_mean": sum(r.coverage for r in rounds) / n_rounds,
        "tokens_per_s": med,
        "tokens_per_s_iqr": [q1, q3],
        "speedup": None,
        "speedup_iqr": None,
        "repeats": len(times[0]),
        "repeat_spread": float(spread),
        "stage_ms": {s: sum(r.stage_ms.get(s, 0.0) for r in rounds) / n_rounds for s in STAGES},
        "skipped_prompts": skipped,
        # budget "auto": the budgets its rounds ran with ({budget: rounds}, 0 = plain decoding rounds)
        "budgets_chosen": dict(sorted(Counter(r.budget for r in rounds).items())) if budget == "auto" else None,
    }


def _add_speedups(records: list[dict], rates: dict) -> None:
    """Paired speed-up: per prompt, rate / the autoregressive rate at the same T; median and quartiles."""
    base = {r["temperature"]: rates[(r["method"], r["budget"], r["temperature"], r["draft_mode"])]
            for r in records if r["method"] == "autoregressive"}
    for r in records:
        b = base.get(r["temperature"])
        if b is None:
            continue
        mine = rates[(r["method"], r["budget"], r["temperature"], r["draft_mode"])]
        ratios = [x / y for x, y in zip(mine, b) if y > 0]
        if ratios:
            q1, med, q3 = _quartiles(ratios)
            r["speedup"], r["speedup_iqr"] = med, [q1, q3]


def _label(method: str, budget: int | None, draft_mode: str | None = None) -> str:
    s = method if budget is None else f"{method} B={budget}"
    return s if draft_mode is None else f"{s} {draft_mode}"


def _modes_shown(records) -> bool:
    """Labels name the draft mode when the records hold more than one."""
    return len({r.get("draft_mode") for r in records if r.get("draft_mode") is not None}) > 1


def format_table(records: Sequence[dict]) -> str:
    """A plain-text table: method, draft mode, budget, T, tau, accept_len, coverage, tok/s and
    speedup (medians over prompts) each with its interquartile range, the repeats' timing spread,
    and the mean draft and build ms per round."""
    head = ("method", "draft", "budget", "T", "tau", "accept_len", "coverage", "tok/s", "tok/s IQR", "speedup",
            "speedup IQR", "repeat spread", "draft ms", "build ms")
    rows = [head]
    for r in records:
        t1, t3 = r["tokens_per_s_iqr"]
        rows.append((
            r["method"], r.get("draft_mode") or "-", "-" if r["budget"] is None else str(r["budget"]),
            f"{r['temperature']:g}",
            f"{r['tau']:.3f}", f"{r['accept_len_mean']:.3f}", f"{r['coverage_mean']:.3f}",
            f"{r['tokens_per_s']:.1f}", f"{t1:.1f}-{t3:.1f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            "-" if r["speedup_iqr"] is None else f"{r['speedup_iqr'][0]:.2f}-{r['speedup_iqr'][1]:.2f}x",
            f"{100 * r['repeat_spread']:.0f}%" if r["repeats"] > 1 else "-",
            f"{r['stage_ms']['draft']:.2f}", f"{r['stage_ms']['build']:.2f}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plots

def plot_tau_hist(records: Sequence[dict], emitted: dict, path: str | os.PathLike) -> None:
    """Histogram of tokens emitted per round: one panel per (method, budget), one colour per T.

    ``emitted[(method, budget, T, draft_mode)]`` is the list of per-round emitted counts.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    shown = _modes_shown(records)
    panels = list(dict.fromkeys((r["method"], r["budget"], r.get("draft_mode")) for r in records))
    temps = list(dict.fromkeys(r["temperature"] for r in records))
    tau = {(r["method"], r["budget"], r["temperature"], r.get("draft_mode")): r["tau"] for r in records}
    top = max([max(v) for v in emitted.values() if v] + [1])
    bins = [x - 0.5 for x in range(1, top + 2)]
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(3.6 * ncols, 2.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (m, b, dm) in zip(axes.flat, panels):
        for T in temps:
            xs = emitted.get((m, b, T, dm), [])
            if xs:
                ax.hist(xs, bins=bins, density=True, histtype="step", linewidth=1.5,
                        label=f"T={T:g}, tau {tau[(m, b, T, dm)]:.2f}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(_label(m, b, dm if shown else None), fontsize=10)
        ax.set_xlabel("tokens emitted per round")
        ax.set_ylabel("fraction of rounds")
        ax.legend(fontsize=7)
    fig.suptitle("Tokens emitted per round (accept_len + 1)")
    fig.savefig(path, dpi=100)


def plot_stage_ms(records: Sequence[dict], path: str | os.PathLike) -> None:
    """Stacked bars of mean ms per round by stage, one bar per (method, budget), one panel per T."""
    from matplotlib.figure import Figure

    temps = list(dict.fromkeys(r["temperature"] for r in records))
    fig = Figure(figsize=(max(6.0, 0.7 * len(records) / max(1, len(temps)) + 3), 3.6 * len(temps)),
                 layout="constrained")
    axes = fig.subplots(len(temps), 1, squeeze=False)[:, 0]
    for ax, T in zip(axes, temps):
        rs = [r for r in records if r["temperature"] == T]
        x = list(range(len(rs)))
        bottom = [0.0] * len(rs)
        for s in STAGES:
            h = [r["stage_ms"][s] for r in rs]
            ax.bar(x, h, bottom=bottom, label=s)
            bottom = [a + b for a, b in zip(bottom, h)]
        shown = _modes_shown(records)
        ax.set_xticks(x, [_label(r["method"], r["budget"], r.get("draft_mode") if shown else None) for r in rs],
                      rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms per round")
        ax.set_title(f"Mean stage time per round, T={T:g}")
        ax.legend(fontsize=7, ncols=len(STAGES))
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------- meta

def _machine() -> dict:
    info = machine_info("node", "platform", "processor", "cpu_count", "torch_threads", "python", "gpu")
    if info["gpu"] is None:  # recorded only where there is one
        del info["gpu"]
    return info


def _meta(generator, command, extra, settings) -> dict:
    import torch
    import transformers

    from .. import __version__

    return {
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "versions": {"sglang_tev": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "device": str(generator.device),
        "dtype": generator.dtype_name,
        "target_path": getattr(generator.config, "_name_or_path", None),  # the CLI's own value overrides
        "max_positions": generator.max_positions,
        "block_size": getattr(generator.drafter, "block_size", None),
        **settings,
        **(extra or {}),
    }


def _write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------- main loop

def run_bench(
    generator: SpeculativeGenerator,
    prompts: Sequence[Prompt | str | Sequence[int]],
    budgets: Sequence[int | str] = ("auto", 32, 64, 128),
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 256,
    methods: Sequence[str] = DEFAULT_METHODS,
    seed: int = 0,
    output_dir: str | os.PathLike | None = None,
    *,
    chat_template: bool = True,
    ignore_eos: bool = False,
    warmup: bool = True,
    repeats: int = 3,
    overwrite: bool = False,
    progress: bool = True,
    plots: bool = True,
    command: str | None = None,
    meta: dict | None = None,
    log: Callable[[str], None] = _stderr,
    batch_sizes: Sequence[int] | None = None,
    draft_modes: Sequence[str] = ("auto",),
) -> list[dict]:
    """Run every (method, budget, temperature) configuration over ``prompts``.

    Args:
        generator: a loaded :class:`SpeculativeGenerator` (with a drafter unless only
            ``autoregressive`` is asked for).
        prompts: :class:`~sglang_tev.hf.datasets.Prompt` / text (encoded with the tokenizer,
            chat template per ``chat_template``) or token ids. Prompts with tokens + 1 > the model's
            positions are skipped with a warning and counted in ``skipped_prompts``.
        budgets: DDTree budgets B >= 0, or ``"auto"`` (the per-round choice of ``budget="auto"``;
            its record's ``budgets_chosen`` counts the rounds per budget) (tree methods run once per
            budget).
        temperatures: target temperatures >= 0 (below 1e-5: greedy).
        max_new_tokens: per prompt, >= 1.
        methods: a subset of :data:`~sglang_tev.hf.runtime.GENERATION_METHODS`.
        seed: prompt i is decoded with seed ``seed + i`` by every configuration.
        output_dir: where results.json, outputs.jsonl, meta.json and the plots go (created);
            None writes nothing. An existing non-empty directory is refused unless ``overwrite``.
        warmup: first run every method once on the first prompt (4 tokens, untimed) so one-time
            costs do not land on the first configuration.
        repeats: decode every (configuration, prompt) this many times, >= 1; the per-prompt rate
            uses the median decode time, tokens and round statistics come from the first repeat.
        overwrite: write into a non-empty ``output_dir`` (its files of these names are replaced).
        progress: a tqdm bar over (configuration x prompt) on stderr.
        command: the command line recorded in meta.json.
        meta: extra keys for meta.json.
        batch_sizes: also decode all prompts batched (``generate`` with a list, ``batch_size`` = each
            size) for every configuration; each record gains ``batch``: a list of {batch_size,
            tokens_per_s (all new tokens / wall seconds of the batched call, prefill included),
            overhead_ms_per_row_round (build + verify + commit per round / rows in it), tau_per_row,
            wall_s}; plot ``batch_tokens_per_s.png``.
        draft_modes: entries of :data:`~sglang_tev.hf.runtime.DRAFT_MODES`; chain and the tree
            methods run once per mode (resolved: ``auto`` -> ``lattice`` for a DFlash2 drafter
            with a selector, else ``marginal``; duplicates run once). ``stage_ms["draft"]`` /
            ``["build"]`` compare the modes' drafting costs at the same budget.

    Returns:
        The records of results.json (keys :data:`RECORD_KEYS`), in run order (:func:`bench_configs`).
        Per-prompt outputs are in ``output_dir/outputs.jsonl``.

    Raises:
        ValueError naming the argument: unknown method or draft mode, ``lattice`` without a
        DFlash2 selector, budget < 0 or > MAX_BUDGET, temperature < 0,
        max_new_tokens < 1, repeats < 1, 'greedy' at a temperature > 0, a speculative method without
        a drafter, a non-empty ``output_dir`` without ``overwrite``, or no prompt left after
        skipping. All are raised before anything is written.
    """
    from tqdm import tqdm

    methods, budgets, temperatures = _check_args(generator, budgets, temperatures, max_new_tokens, methods, seed,
                                                 repeats)
    out_dir = None if output_dir is None else Path(output_dir)
    if out_dir is not None and not overwrite and out_dir.is_dir() and any(out_dir.iterdir()):
        raise ValueError(f"output_dir: {out_dir} exists and is not empty (results of an earlier run?); "
                         "choose another or pass overwrite=True")
    if batch_sizes is not None:
        batch_sizes = list(dict.fromkeys(batch_sizes))
        if not batch_sizes or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in batch_sizes):
            raise ValueError(f"batch_sizes must be ints >= 1, got {batch_sizes!r}")
    modes = _draft_modes(generator, draft_modes)
    kept, skipped = _encode_all(generator, prompts, chat_template, log)
    if not kept:
        raise ValueError(f"prompts: none of the {len(prompts)} prompts is usable: each is empty or longer than the "
                         f"model's {generator.max_positions} positions (the warnings above say which)")
    configs = bench_configs(methods, budgets, temperatures, modes)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        settings = {"budgets": budgets, "temperatures": temperatures, "max_new_tokens": max_new_tokens,
                    "methods": methods, "seed": seed, "chat_template": bool(chat_template and getattr(generator.tokenizer, "chat_template", None)), "ignore_eos": ignore_eos,
                    "repeats": repeats, "prompts": len(kept), "skipped_prompts": skipped, "draft_modes": modes}
        _write_json(out_dir / "meta.json", _meta(generator, command, meta, settings))

    def gen(method, budget, T, dm, ids, s, n):
        return generator.generate(
            ids, method=method, budget=64 if budget is None else budget, sampling=SamplingParams(temperature=T),
            seed=s, max_new_tokens=n, ignore_eos=ignore_eos, verifier="tev", draft_mode=dm or "auto",
        )

    if warmup:
        for m in methods:
            b = budgets[0] if m in TREE_METHODS else None
            for dm in ([None] if m == "autoregressive" else modes):
                gen(m, b, temperatures[0], dm, kept[0][2], seed, min(4, max_new_tokens))

    records: list[dict] = []
    emitted: dict = {}
    rates: dict = {}
    generator.time_stages = True  # a CUDA synchronise per stage, so stage_ms adds up to the round
    outputs_f = open(out_dir / "outputs.jsonl", "w", encoding="utf-8") if out_dir is not None else None
    bar = tqdm(total=len(configs) * len(kept) * repeats, desc="bench", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    try:
        for method, budget, T, dm in configs:
            bar.set_postfix_str(f"{_label(method, budget, dm)} T={T:g}")
            runs, times = [], []
            for i, pid, ids in kept:
                res = gen(method, budget, T, dm, ids, seed + i, max_new_tokens)
                ts = [res.decode_s]
                bar.update(1)
                for _ in range(repeats - 1):  # same seed: same tokens; only the clock differs
                    ts.append(gen(method, budget, T, dm, ids, seed + i, max_new_tokens).decode_s)
                    bar.update(1)
                runs.append(res)
                times.append(ts)
                if outputs_f is not None:
                    outputs_f.write(json.dumps({
                        "method": method, "budget": budget, "temperature": T, "draft_mode": dm, "prompt_index": i,
                        "prompt_id": pid, "prompt_tokens": len(ids), "new_token_ids": res.token_ids,
                        "text": res.text, "finish_reason": res.finish_reason, "rounds": len(res.rounds),
                        "emitted_per_round": [r.emitted for r in res.rounds],
                        "accept_len_per_round": [r.accept_len for r in res.rounds],
                        "decode_s": statistics.median(ts), "decode_s_repeats": ts, "prefill_s": res.prefill_s,
                    }) + "\n")
            records.append(_record(method, budget, T, dm, runs, times, skipped))
            rates[(method, budget, T, dm)] = _prompt_rates(runs, times)
            emitted[(method, budget, T, dm)] = [r.emitted for res in runs for r in res.rounds]
            if batch_sizes:
                records[-1]["batch"] = [_batched(generator, method, budget, T, dm, kept, seed, max_new_tokens, ignore_eos, bs)
                                        for bs in batch_sizes]
    finally:
        bar.close()
        if outputs_f is not None:
            outputs_f.close()
    _add_speedups(records, rates)

    if out_dir is not None:
        _write_json(out_dir / "results.json", records)
        if plots:
            plot_tau_hist(records, emitted, out_dir / "tau_hist.png")
            plot_stage_ms(records, out_dir / "stage_ms.png")
            if batch_sizes:
                plot_batch(records, out_dir / "batch_tokens_per_s.png")
    return records


def _batched(generator, method, budget, T, dm, kept, seed, max_new_tokens, ignore_eos, batch_size) -> dict:
    """All prompts in one batched call at ``batch_size`` rows: throughput over the batch, the
    non-forward overhead per row per round, and each row's tau."""
    import time as _time

    t0 = _time.perf_counter()
    res = generator.generate(
        [ids for _, _, ids in kept], method=method, budget=64 if budget is None else budget,
        sampling=SamplingParams(temperature=T), seed=[seed + i for i, _, _ in kept], max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos, verifier="tev", batch_size=batch_size, draft_mode=dm or "auto")
    wall = _time.perf_counter() - t0
    toks = sum(len(r.token_ids) for r in res)
    row_rounds = sum(len(r.rounds) for r in res)
    overhead = sum((x.stage_ms.get("build", 0.0) + x.stage_ms.get("verify", 0.0) + x.stage_ms.get("commit", 0.0)) / x.batch_rows
                   for r in res for x in r.rounds)
    return {"batch_size": batch_size, "tokens_per_s": toks / wall, "wall_s": wall, "new_tokens": toks,
            "overhead_ms_per_row_round": overhead / max(row_rounds, 1), "tau_per_row": [r.tau for r in res]}


def plot_batch(records: Sequence[dict], path: str | os.PathLike) -> None:
    """Tokens/s over the batch against the batch size, one line per (method, budget, T)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in records:
        if not r.get("batch"):
            continue
        xs = [b["batch_size"] for b in r["batch"]]
        ax.plot(xs, [b["tokens_per_s"] for b in r["batch"]], marker="o",
                label=f"{_label(r['method'], r['budget'], r.get('draft_mode') if _modes_shown(records) else None)} "
                      f"T={r['temperature']:g}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s over the batch")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
