"""``sglang-tev eval-drafter``: drafters compared by the exact expected block length of their
trees on the target's own continuations (:func:`sglang_tev.train.drafter_eval.evaluate_drafters`).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from pathlib import Path

from ..spec import MAX_BUDGET, TREE_MODES
from .args import PROG, UsageError, _at_least, _float_list, _int_list, _str_list, _strip_name
from .common import _check_output_dir, _output_path, _prompts_arg, _torch_device, default_model_paths

EVAL_EXAMPLES = """\
examples:
  sglang-tev eval-drafter --prompts humaneval --limit 24               # the shipped pair, T = 0 and 1, B = 64
  sglang-tev eval-drafter --target DIR --draft OLD --draft NEW --prompts prompts.jsonl \\
      --temperatures 0,1 --budgets 32,64 --max-new-tokens 128 --output runs/eval --cache-dir runs/cont
  sglang-tev eval-drafter --target DIR --draft V1 --draft DFLASH2 --prompts prompts.jsonl \
      --tree-modes marginal,lattice,chain                              # rows V1[marginal], DFLASH2[lattice], ...
"""


TREE_MODE_CHOICES = ("auto", *TREE_MODES)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``eval-drafter`` subcommand's parser (its part of :func:`sglang_tev.cli.build_parser`)."""
    e = subparsers.add_parser("eval-drafter", help="compare drafters by the exact expected block length 1 + C_p on the "
                       "target's own continuations",
                       description="Generate (once, cached) the target's own continuations of the prompts at each "
                       "temperature, then compute exactly, at every position, each drafter's DDTree and its exit law: "
                       "the mean expected block length 1 + C_p, where the target mass exits (root, depth, budget-cut "
                       "leaves, horizon) and, for two or more drafters, the paired differences against the first with "
                       "standard errors over prompts. Writes results.json, table.txt and exit_mass_by_depth.png to "
                       "--output (default: eval-results/<date-time>).",
                       epilog=EVAL_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    eg = e.add_argument_group("model")
    eg.add_argument("--target", help="target model directory (HF, with tokenizer); default: the shipped tiny-code pair")
    eg.add_argument("--draft", action="append", metavar="DIR",
                    help="DFlash / DFlash2 drafter directory (repeatable; the first row is the baseline of the "
                    "differences); DIR@MODES measures this drafter in MODES (e.g. DIR@lattice,chain) instead of "
                    "--tree-modes; default without --target: the shipped drafter")
    eg.add_argument("--tree-modes", type=_str_list, default=["auto"], metavar="MODES",
                    help="comma-separated subset of auto,marginal,lattice,chain: how each drafter's block becomes "
                    "a tree, one report row per (drafter, mode) named DRAFTER[MODE] (auto: lattice for a DFlash2 "
                    "drafter with a selector, else marginal; lattice is skipped for a drafter without a selector "
                    "when other modes are listed; chain = the greedy chain, K-1 nodes whatever B; default auto)")
    eg.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    eg.add_argument("--no-chat-template", action="store_true",
                    help="do not apply the tokenizer's chat template (default: applied when the tokenizer has one)")
    e.add_argument("--prompts", required=True, metavar="FILE",
                   help="'humaneval' or a .jsonl file (one 'prompt' or 'messages' per line)")
    e.add_argument("--limit", type=int, help="use the first N prompts")
    e.add_argument("--temperatures", type=_float_list, default=[0.0, 1.0],
                   help="target temperatures of the continuations and of the law, comma-separated (default 0,1)")
    e.add_argument("--budgets", type=_int_list, default=[64], help="DDTree budgets, comma-separated (default 64)")
    e.add_argument("--max-new-tokens", type=int, default=128, help="continuation length at most (default 128)")
    e.add_argument("--seed", type=int, default=0, help="sampling seed of the continuations (default 0)")
    e.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch (default 16)")
    e.add_argument("--output", metavar="DIR",
                   help="output directory (default: eval-results/<UTC date-time>); an existing non-empty one is "
                   "refused unless --overwrite")
    e.add_argument("--cache-dir", metavar="DIR",
                   help="where the continuations are cached and reused (default: DIR/continuations of --output)")
    e.add_argument("--overwrite", action="store_true", help="write into a non-empty --output")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(run=run)
    return e


def _draft_with_modes(value: str) -> tuple[str, list[str] | None]:
    """``--draft DIR@MODES`` -> (DIR, [modes]); ``DIR`` (or an existing directory whose name holds
    an ``@``) -> (DIR, None). ``UsageError('--draft')`` for an unknown mode after the ``@``."""
    path, sep, spec = value.rpartition("@")
    if not sep or not path or os.path.isdir(value):
        return value, None
    try:
        modes = _str_list(spec)
    except argparse.ArgumentTypeError:  # an empty entry
        modes = []
    if not modes or any(m not in TREE_MODE_CHOICES for m in modes):
        raise UsageError("--draft", f"{value!r}: the tree modes after '@' must be a comma-separated subset of "
                                    f"{','.join(TREE_MODE_CHOICES)}")
    return path, modes


def run(args, argv: list[str]) -> int:
    """``sglang-tev eval-drafter``: :func:`sglang_tev.train.drafter_eval.evaluate_drafters`."""
    if args.limit is not None:
        _at_least("--limit", args.limit, 1)
    _at_least("--max-new-tokens", args.max_new_tokens, 1)
    _at_least("--batch-size", args.batch_size, 1)
    _at_least("--seed", args.seed, 0)
    if not args.budgets or any(not 0 <= b <= MAX_BUDGET for b in args.budgets):
        raise UsageError("--budgets", f"give budgets in [0, {MAX_BUDGET}], got {args.budgets}")
    if not args.temperatures or any(not (t >= 0) or math.isinf(t) for t in args.temperatures):
        raise UsageError("--temperatures", f"temperatures must be finite numbers >= 0, got {args.temperatures}")
    if len(set(args.temperatures)) != len(args.temperatures) or len(set(args.budgets)) != len(args.budgets):
        raise UsageError("--temperatures" if len(set(args.temperatures)) != len(args.temperatures) else "--budgets",
                         "values must be distinct")
    if not args.tree_modes or any(m not in TREE_MODE_CHOICES for m in args.tree_modes):
        raise UsageError("--tree-modes", f"give a comma-separated subset of {','.join(TREE_MODE_CHOICES)}, got "
                                         f"{','.join(args.tree_modes) or 'nothing'}")
    if args.target is not None:
        target, drafts = args.target, list(args.draft or [])
        if not drafts:
            raise UsageError("--draft", "give at least one --draft with --target")
    else:
        try:
            target, shipped = default_model_paths()
        except FileNotFoundError as e:
            raise UsageError("--target", str(e)) from None
        drafts = list(args.draft or [shipped])
    drafts, draft_modes = zip(*(_draft_with_modes(str(d)) for d in drafts))
    drafts = list(drafts)
    for arg, path in [("--target", target)] + [("--draft", d) for d in drafts]:
        if not os.path.isdir(path):
            raise UsageError(arg, f"no model directory at {os.fspath(path)!r}")
    out = _output_path(args.output, "eval-results")
    _check_output_dir(out, args.overwrite, reusable=("continuations",))
    if args.cache_dir is not None:
        _check_output_dir(Path(args.cache_dir), False, arg="--cache-dir", must_be_empty=False)
    prompts = _prompts_arg("--prompts", args.prompts, args.limit)
    device = _torch_device(args.device)
    if device is None:
        import torch
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
    from ..train.drafter_eval import evaluate_drafters, format_table

    try:
        rep = evaluate_drafters(target, drafts, prompts, temperatures=args.temperatures, budgets=args.budgets,
                                max_new_tokens=args.max_new_tokens, seed=args.seed, output_dir=out,
                                cache_dir=args.cache_dir, chat_template=not args.no_chat_template,
                                batch_size=args.batch_size, device=device, progress=not args.no_progress,
                                command=shlex.join([PROG, *argv]), tree_modes=args.tree_modes,
                                draft_tree_modes=list(draft_modes))
    except (FileNotFoundError, ValueError) as e:
        msg = str(e)
        head = msg.split(":", 1)[0].split(" ", 1)[0]
        arg = {"prompts": "--prompts", "target": "--target", "draft": "--draft", "budgets": "--budgets",
               "temperatures": "--temperatures", "max_new_tokens": "--max-new-tokens",
               "tree_modes": "--tree-modes"}.get(head, "--prompts")
        raise UsageError(arg, _strip_name(msg)) from None
    print(format_table(rep))
    print(f"[{PROG}] wrote {out / 'results.json'}, table.txt, exit_mass_by_depth.png "
          f"(continuations: {rep['generate_s']:.1f} s, scoring: {rep['score_s']:.1f} s)", file=sys.stderr)
    return 0
