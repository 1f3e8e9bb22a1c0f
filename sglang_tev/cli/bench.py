"""``sglang-tev bench``: every method over one prompt set in one run (:func:`sglang_tev.hf.bench.run_bench`);
writes results.json, outputs.jsonl, meta.json and the plots to ``--output``.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys

from ..spec import DRAFT_MODES, MAX_BUDGET, VERIFIERS, is_greedy
from .args import (METHODS, PROG, UsageError, _add_model_args, _at_least, _budget_list, _float_list, _int_list,
                   _str_list, _usage_from)
from .common import _check_output_dir, _load, _model_paths, _output_path, _prompts_arg

BENCH_EXAMPLES = """\
examples:
  sglang-tev bench --dataset humaneval --limit 20 --max-new-tokens 128
  sglang-tev bench --target DIR --draft DIR --dataset prompts.jsonl --budgets 32,64 \\
      --temperatures 0,1 --repeats 5 --output runs/bench
"""

def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``bench`` subcommand's parser (its part of :func:`sglang_tev.cli.build_parser`)."""
    b = subparsers.add_parser("bench", help="compare autoregressive, chain and DDTree verifiers on a prompt set",
                       description="Benchmark every method on one prompt set in one run; writes results.json, "
                       "outputs.jsonl, meta.json, tau_hist.png and stage_ms.png to --output (default: bench-results/<date-time>).",
                       epilog=BENCH_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(b)
    b.add_argument("--dataset", required=True, help="'humaneval' or a .jsonl file (one 'prompt' or 'messages' per line)")
    b.add_argument("--limit", type=int, help="use the first N prompts")
    b.add_argument("--budgets", type=_budget_list, default=["auto", 32, 64, 128],
                   help="DDTree budgets, comma-separated; 'auto' = the per-round choice of --budget auto "
                        "(default auto,32,64,128)")
    b.add_argument("--temperatures", type=_float_list, default=[0.0, 1.0], help="comma-separated (default 0,1)")
    b.add_argument("--max-new-tokens", type=int, default=256, help="per prompt (default 256)")
    b.add_argument("--methods", type=_str_list, default=["autoregressive", "chain", "tev", "predraw", "sequential"],
                   help="comma-separated subset of autoregressive,chain,tev,predraw,sequential,greedy "
                   "(default: all but greedy)")
    b.add_argument("--draft-modes", type=_str_list, default=["auto"],
                   help="comma-separated subset of auto,lattice,marginal: chain and the DDTree methods run once per "
                   "draft mode, side by side (lattice needs a DFlash2 drafter with a selector; default auto)")
    b.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i (default 0)")
    b.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    b.add_argument("--repeats", type=int, default=3,
                   help="decode every (configuration, prompt) N times; tok/s per prompt is the median "
                   "time's (default 3)")
    b.add_argument("--output", metavar="DIR",
                   help="output directory, created (default: bench-results/<UTC date-time> under the current "
                   "directory); an existing non-empty one is refused unless --overwrite")
    b.add_argument("--overwrite", action="store_true", help="write into a non-empty --output, replacing its files")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--batch-sizes", type=_int_list, default=None,
                   help="also decode all prompts batched at these sizes, e.g. 1,4,16: tokens/s over the batch and "
                   "per-row tau go into results.json ('batch') and batch_tokens_per_s.png")
    b.set_defaults(run=run)
    return b


def run(args, argv: list[str]) -> int:
    """``sglang-tev bench``: :func:`sglang_tev.hf.bench.run_bench`, its table printed."""
    from ..hf.bench import format_table, run_bench

    if args.limit is not None:
        _at_least("--limit", args.limit, 1)
    _at_least("--max-new-tokens", args.max_new_tokens, 1)
    _at_least("--repeats", args.repeats, 1)
    fixed = [b for b in args.budgets if b != "auto"]
    if any(b > MAX_BUDGET for b in fixed):
        raise UsageError("--budgets", f"budgets must be <= {MAX_BUDGET}, got {args.budgets}")
    if not args.budgets and any(m in VERIFIERS for m in args.methods):
        raise UsageError("--budgets", "give at least one budget")
    if any(b < 0 for b in fixed):
        raise UsageError("--budgets", f"budgets must be >= 0, got {args.budgets}")
    if not args.temperatures or any(not (t >= 0) or math.isinf(t) for t in args.temperatures):
        raise UsageError("--temperatures", f"temperatures must be finite numbers >= 0, got {args.temperatures}")
    if not args.methods:
        raise UsageError("--methods", f"give at least one of {','.join(METHODS)}")
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        raise UsageError("--methods", f"unknown {bad}; choose from {','.join(METHODS)}")
    if "greedy" in args.methods and any(not is_greedy(t) for t in args.temperatures):
        raise UsageError("--methods", "'greedy' is exact only at temperature 0; drop it or use --temperatures 0")
    if not args.draft_modes or any(m not in DRAFT_MODES for m in args.draft_modes):
        raise UsageError("--draft-modes", f"give a comma-separated subset of {','.join(DRAFT_MODES)}, got "
                                          f"{','.join(args.draft_modes) or 'nothing'}")
    if args.batch_sizes is not None and (not args.batch_sizes or any(b < 1 for b in args.batch_sizes)):
        raise UsageError("--batch-sizes", f"must be integers >= 1, got {args.batch_sizes}")
    out = _output_path(args.output, "bench-results")
    _check_output_dir(out, args.overwrite)
    target, draft = _model_paths(args)
    prompts = _prompts_arg("--dataset", args.dataset, args.limit)
    gen = _load(args)
    meta = {"dataset": args.dataset, "limit": args.limit, "target_path": os.fspath(target),
            "draft_path": None if draft is None else os.fspath(draft), "argv": argv}
    try:
        records = run_bench(
            gen, prompts, budgets=args.budgets, temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
            methods=args.methods, seed=args.seed, output_dir=out, chat_template=not args.no_chat_template,
            ignore_eos=args.ignore_eos, progress=not args.no_progress, repeats=args.repeats,
            overwrite=args.overwrite, batch_sizes=args.batch_sizes, draft_modes=args.draft_modes,
            command=shlex.join([PROG, *argv]), meta=meta,
        )
    except ValueError as e:
        raise _usage_from(e, "--dataset") from None
    except KeyboardInterrupt:
        if out.is_dir() and not (out / "results.json").exists() and any(out.iterdir()):
            print(f"[{PROG}] {out} holds a partial run (no results.json; bench does not resume): rerun with "
                  "--overwrite or another --output", file=sys.stderr)
        raise
    print(format_table(records))
    print(f"[{PROG}] wrote {out / 'results.json'}, outputs.jsonl, meta.json, tau_hist.png, stage_ms.png",
          file=sys.stderr)
    return 0
