"""``sglang-tev tune``: every budget measured on this machine (:func:`sglang_tev.hf.tune.run_tune`),
the tokens/s-optimal one per batch size printed as SGLang flags, optionally saved as a cost table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..spec import MAX_BUDGET
from .args import PROG, UsageError, _add_model_args, _at_least, _float_list, _int_list, _str_list, _usage_from
from .common import _check_output_dir, _load, _prompts_arg

TUNE_EXAMPLES = """\
examples:
  sglang-tev tune                                          # the shipped pair, batch 1 and 8, T = 0 and 1
  sglang-tev tune --target DIR --draft DIR --batch-sizes 1,4,16 --output tune.json
  sglang-tev generate --cost-table tune.json "def f(x):"   # --budget auto reads the tuned costs
"""

def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``tune`` subcommand's parser (its part of :func:`sglang_tev.cli.build_parser`)."""
    t = subparsers.add_parser("tune", help="measure every budget on this machine and print the tokens/s-optimal "
                       "--speculative-num-draft-tokens (and verifier) per batch size",
                       description="Decode the same prompts at every budget of --budgets (0 = plain decoding), "
                       "interleaved sweeps after a warm-up sweep, per batch size and temperature; print every "
                       "configuration's median tokens/s, tau and ratio to plain decoding, the best per batch size as "
                       "SGLang flags, and with --output a JSON (rows, best, the cost table for --cost-table, the "
                       "command, machine and versions). Measured with this package's transformers runtime: on a "
                       "GPU server SGLang's round costs differ, tau does not.",
                       epilog=TUNE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_args(t)
    t.add_argument("--dataset", default="humaneval",
                   help="'humaneval' (default) or a .jsonl file; batch size b decodes its first b prompts")
    t.add_argument("--batch-sizes", type=_int_list, default=[1, 8], help="comma-separated (default 1,8)")
    t.add_argument("--temperatures", type=_float_list, default=[0.0, 1.0], help="comma-separated (default 0,1)")
    t.add_argument("--budgets", type=_int_list, default=[0, 4, 8, 16, 32, 64],
                   help="budgets to measure, 0 = plain decoding (default 0,4,8,16,32,64)")
    t.add_argument("--verifiers", type=_str_list, default=["tev"],
                   help="verifiers tried at T > 0, comma-separated subset of tev,predraw,sequential (default tev)")
    t.add_argument("--max-new-tokens", type=int, default=128, help="per prompt, EOS ignored (default 128)")
    t.add_argument("--repeats", type=int, default=3, help="timed sweeps after the warm-up sweep (default 3)")
    t.add_argument("--seed", type=int, default=0, help="sampled sweeps use seed + sweep (default 0)")
    t.add_argument("--output", metavar="FILE", help="write the JSON here (refused if it exists, unless --overwrite)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    t.set_defaults(run=run)
    return t


def run(args, argv: list[str]) -> int:
    """``sglang-tev tune``: :func:`sglang_tev.hf.tune.run_tune`, printed and optionally saved."""
    from ..hf.tune import format_tune, run_tune, tune_meta, write_tune

    _at_least("--max-new-tokens", args.max_new_tokens, 1)
    _at_least("--repeats", args.repeats, 1)
    if not args.batch_sizes or any(b < 1 for b in args.batch_sizes):
        raise UsageError("--batch-sizes", f"must be integers >= 1, got {args.batch_sizes}")
    if not args.temperatures or any(not (t >= 0) or math.isinf(t) for t in args.temperatures):
        raise UsageError("--temperatures", f"must be finite numbers >= 0, got {args.temperatures}")
    if not args.budgets or any(not 0 <= b <= MAX_BUDGET for b in args.budgets) or max(args.budgets) < 1:
        raise UsageError("--budgets", f"must be integers in [0, {MAX_BUDGET}] with at least one > 0, got {args.budgets}")
    bad = [v for v in args.verifiers if v not in ("tev", "predraw", "sequential")]
    if not args.verifiers or bad:
        raise UsageError("--verifiers", f"give a comma-separated subset of tev,predraw,sequential, got "
                                        f"{','.join(args.verifiers) or 'nothing'}")
    out = Path(args.output) if args.output else None
    if out is not None:
        if out.is_dir():
            raise UsageError("--output", f"{out} is a directory; give a file name")
        if out.exists() and not args.overwrite:
            raise UsageError("--output", f"{out} exists; choose another name or pass --overwrite")
        _check_output_dir(out.parent if str(out.parent) else Path("."), True, arg="--output", must_be_empty=False)
    prompts = _prompts_arg("--dataset", args.dataset, None)
    if len(prompts) < max(args.batch_sizes):
        raise UsageError("--batch-sizes", f"the largest batch size ({max(args.batch_sizes)}) needs that many prompts; "
                                          f"{args.dataset} has {len(prompts)}")
    if args.repeats < 3:
        print(f"{PROG} tune: warning: --repeats {args.repeats}: each budget's median is over {args.repeats} timed "
              "sweep(s), so one slow minute can decide the table; 3 or more is safer on a shared machine",
              file=sys.stderr)
    gen = _load(args)
    texts = [p.text if hasattr(p, "text") else p for p in prompts[: max(args.batch_sizes)]]
    try:
        result = run_tune(gen, texts, batch_sizes=args.batch_sizes, temperatures=args.temperatures,
                          budgets=args.budgets, verifiers=args.verifiers, max_new_tokens=args.max_new_tokens,
                          repeats=args.repeats, seed=args.seed, chat_template=not args.no_chat_template,
                          progress=lambda line: print(f"[{PROG}] {line}", file=sys.stderr, flush=True))
    except ValueError as e:
        raise _usage_from(e, "--budgets") from None
    print(format_tune(result))
    if out is not None:
        write_tune(out, result, tune_meta(argv, dtype=gen.dtype_name))
        print(f"[{PROG}] wrote {out} (its cost table: sglang-tev generate --cost-table {out})", file=sys.stderr)
    return 0
