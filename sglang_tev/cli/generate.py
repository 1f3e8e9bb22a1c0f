"""``sglang-tev generate``: one prompt streamed to stdout (exactly the decoded new text), or a
batch of prompts (``MORE`` prompts, ``--prompts-file``) as one JSON line each; one summary line
on stderr. Every check that needs no model runs before one loads (:func:`_check_generate_args`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ..spec import DRAFT_MODES, VERIFIERS, SpecError, check_budget, is_greedy
from .args import DTYPES, METHODS, PROG, UsageError, _add_model_args, _at_least, _budget, _strip_name, _usage_from
from .common import TextStreamer, _load, _model_paths

GENERATE_EXAMPLES = """\
examples:
  sglang-tev generate "def fibonacci(n):"                  # the shipped tiny-code pair, greedy
  sglang-tev generate --max-new-tokens 64 "def f(x):" | head -n 3
  cat prompt.txt | sglang-tev generate -                   # the prompt from stdin
  sglang-tev generate --prompts-file prompts.jsonl > out.jsonl   # one JSON line per prompt
  sglang-tev generate --target DIR --draft DIR --budget 64 --temperature 0.8 --top-p 0.95 "Explain KV caches."
"""

def add_parser(subparsers) -> argparse.ArgumentParser:
    """The ``generate`` subcommand's parser (its part of :func:`sglang_tev.cli.build_parser`)."""
    g = subparsers.add_parser("generate", help="generate text for one prompt (stdout: the new text only) or a batch",
                       description="Generate with tree speculative decoding. stdout carries exactly the new "
                       "text; a summary line goes to stderr.", epilog=GENERATE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompt", metavar="PROMPT", nargs="?",
                   help="the prompt text; '-' reads it from stdin (verbatim, until EOF)")
    g.add_argument("--prompts-file", metavar="FILE",
                   help="also generate for every prompt of FILE: a .jsonl file (one 'prompt' or 'messages' per "
                   "line, optional 'id'), 'humaneval', or a text file (one prompt per non-empty line); all prompts are decoded "
                   "as one batch (--batch-size rows at a time) and stdout gets one JSON line per prompt, in order")
    g.add_argument("more_prompts", metavar="MORE", nargs="*",
                   help="more prompts: decoded as one batch; stdout then carries one JSON line per prompt, in input order")
    _add_model_args(g)
    g.add_argument("--budget", type=_budget, default=None,
                   help="DDTree budget B (non-root nodes), or 'auto' (default): each round's budget chosen to "
                        "maximise expected tokens/s from the exit law of past rounds and measured round costs; "
                        "0 rounds are plain decoding steps (tree methods only)")
    g.add_argument("--cost-table", metavar="FILE",
                   help="with --budget auto: seconds per round by batch size and budget from 'sglang-tev tune "
                        "--output FILE', read instead of timing rounds (the choices, and seeded runs, then repeat)")
    g.add_argument("--no-plan-cache", action="store_true",
                   help="with --budget auto: neither read nor write what earlier runs learned (cost table, gains, "
                        "reach calibration; kept per machine, model pair and dtype under ~/.cache/sglang_tev/plan; "
                        "also SGLANG_TEV_PLAN_CACHE=0)")
    g.add_argument("--verifier", choices=VERIFIERS, default="tev",
                   help="verifier of the DDTree (and of --method chain) (default tev)")
    g.add_argument("--method", choices=METHODS,
                   help="override: autoregressive, chain, or DDTree + a verifier (default: the --verifier)")
    g.add_argument("--draft-mode", choices=DRAFT_MODES, default="auto",
                   help="DFlash2 drafters: 'lattice' = DDTree over the selector's candidate lattice "
                   "(with --method chain: the selector's own greedy / sampled chain), 'marginal' = DDTree over the "
                   "transformed per-depth marginals (--method chain: per-depth argmax); 'auto' (default) = lattice "
                   "when the drafter has a candidate selector, else marginal (DFlash v1 accepts marginal only)")
    g.add_argument("--temperature", type=float, default=0.0, help="target temperature; 0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="top-p in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k; <= 0 off (default 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p in [0, 1] (default 0: off)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="new tokens at most, >= 1 (default 256)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the verifier's randomness (default 0); a sampled run repeats exactly with a fixed "
                        "--budget or a --cost-table (--budget auto's choices follow measured round times)")
    g.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable); output ends with it")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    g.add_argument("--block-size", type=int, help="draft block size K (default: the drafter's)")
    g.add_argument("--batch-size", type=int, help="rows decoded together (default: all prompts)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="as transformers' (default 1: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="as OpenAI / SGLang (default 0: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="as OpenAI / SGLang (default 0: off)")
    g.set_defaults(run=run)
    return g


def _chosen_budgets(rounds) -> str:
    """``budget=auto``: the budgets the rounds ran with, most used first (``16x40 24x10 0x2``)."""
    from collections import Counter

    counts = Counter(r.budget for r in rounds if r.budget is not None)
    return " ".join(f"{b}x{n}" for b, n in counts.most_common())


def _draft_block_size(draft) -> int | None:
    """The drafter's block size K from its config.json (z-lab: ``dflash_config.block_size`` or top
    level, default 16), without loading it; None when the config cannot be read (the load says why)."""
    try:
        cfg = json.loads((Path(draft) / "config.json").read_text())
        dcfg = cfg.get("dflash_config") or {}
        k = dcfg.get("block_size", cfg.get("block_size", 16))
    except (OSError, ValueError, AttributeError):
        return None
    return k if isinstance(k, int) and not isinstance(k, bool) else None


def _check_generate_args(args) -> None:
    """Every check that needs no model (run before loading one)."""
    if args.prompts_file is None and args.prompt is None:
        raise UsageError("PROMPT", "give a prompt, '-' to read it from stdin, or --prompts-file FILE")
    if args.prompt == "" or "" in args.more_prompts:
        raise UsageError("PROMPT", "the prompt is empty")
    if "-" in args.more_prompts or (args.prompt == "-" and args.more_prompts):
        raise UsageError("PROMPT", "'-' (stdin) must be the only PROMPT")
    method = args.method or args.verifier
    if method not in VERIFIERS:  # autoregressive / chain: no tree, so no budget to set or choose
        for flag, given in (("--budget", args.budget is not None), ("--cost-table", args.cost_table is not None)):
            if given:
                raise UsageError(flag, f"applies to the tree methods ({', '.join(VERIFIERS)}), not --method {method}")
    if args.budget is None:
        args.budget = "auto"
    if args.budget != "auto":
        _at_least("--budget", args.budget, 0)
    if args.cost_table is not None:  # read before any model loads
        if args.budget != "auto":
            raise UsageError("--cost-table", f"applies to --budget auto only, got --budget {args.budget}")
        from ..costs import CostTable

        path = args.cost_table
        try:
            args.cost_table = CostTable.load(path, frozen=True)
        except ValueError as e:
            raise UsageError("--cost-table", _strip_name(str(e))) from None
        args.cost_table_file = (path, _table_dtype(path))
    if not (math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0):
        raise UsageError("--repetition-penalty", f"must be a finite number > 0, got {args.repetition_penalty}")
    for flag, v in (("--frequency-penalty", args.frequency_penalty), ("--presence-penalty", args.presence_penalty)):
        if not -2.0 <= v <= 2.0:  # OpenAI / SGLang range (rejects NaN too)
            raise UsageError(flag, f"must be in [-2, 2], got {v}")
    try:
        check_budget(args.budget)  # the runtime's own check, before any model loads
    except SpecError as e:
        raise UsageError("--budget", e.message) from None
    _at_least("--max-new-tokens", args.max_new_tokens, 1)
    if not (args.temperature >= 0) or math.isinf(args.temperature):
        raise UsageError("--temperature", f"must be a finite number >= 0, got {args.temperature}")
    if not (0 < args.top_p <= 1):
        raise UsageError("--top-p", f"must be in (0, 1], got {args.top_p}")
    if not (0 <= args.min_p <= 1):
        raise UsageError("--min-p", f"must be in [0, 1], got {args.min_p}")
    if args.block_size is not None and method == "autoregressive":
        raise UsageError("--block-size", "applies to the drafting methods, not --method autoregressive")
    if args.block_size is not None and args.block_size < 2:
        raise UsageError("--block-size", f"must be >= 2, got {args.block_size}")
    if args.stop is not None and any(s == "" for s in args.stop):
        raise UsageError("--stop", "stop strings must be non-empty")
    if not is_greedy(args.temperature):
        greedy_arg = None
        if method == "greedy":
            greedy_arg = "--verifier" if args.method is None else "--method"
        elif method == "chain" and args.verifier == "greedy":
            greedy_arg = "--verifier"
        if greedy_arg is not None:
            raise UsageError(greedy_arg, "'greedy' is exact only at temperature 0; use tev, predraw or sequential")


def _read_prompts_file(path: str) -> list:
    """[Prompt] of a .jsonl file (hf.datasets.load_jsonl), ``humaneval``, or a text file (one per
    non-empty line)."""
    from ..hf.datasets import Prompt, load_jsonl

    p = Path(path)
    try:
        if path == "humaneval":
            from ..hf.datasets import load_prompts
            prompts = load_prompts("humaneval")
        elif p.suffix == ".jsonl":
            prompts = load_jsonl(p)
        else:
            if not p.is_file():
                raise FileNotFoundError(f"{p}: no such file")
            lines = p.read_text(encoding="utf-8").splitlines()
            prompts = [Prompt(id=f"{p.name}:{i}", text=line) for i, line in enumerate(lines, 1) if line.strip()]
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UsageError("--prompts-file", str(e)) from None
    if not prompts:
        raise UsageError("--prompts-file", f"{p} holds no prompts")
    return prompts


def _summary_gap() -> None:
    """On a terminal, start the stderr summary on its own line when stdout's text did not end
    one (stdout itself stays exactly the text)."""
    tty = getattr(sys.stdout, "isatty", None), getattr(sys.stderr, "isatty", None)
    if all(f is not None and f() for f in tty):
        sys.stderr.write("\n")


def _controls(args) -> dict:
    return dict(repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty)


def _cmd_generate_batch(args, file_prompts: list) -> int:
    """Several prompts (PROMPT ... and/or --prompts-file rows) decoded as one batch of
    ``--batch-size`` rows; stdout: one JSON line per prompt in input order ({"index", "id", "text",
    "token_ids", "new_tokens", "rounds", "tau", "finish_reason"}); one summary line on stderr."""
    from ..hf.datasets import Prompt, encode_prompt
    from ..sampling import SamplingParams

    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError("--batch-size", f"must be >= 1, got {args.batch_size}")
    texts = ([args.prompt] if args.prompt is not None else []) + list(args.more_prompts)
    items = [Prompt(id=f"PROMPT:{i}", text=t) for i, t in enumerate(texts, 1)] + list(file_prompts)
    gen = _load(args)
    _use_cost_table(gen, args)
    chat = not args.no_chat_template
    prompts = []
    for p in items:  # every prompt is checked before the first is generated
        ids = encode_prompt(p, gen.tokenizer, chat)
        arg = "--prompts-file" if p in file_prompts else "PROMPT"
        if not ids:
            raise UsageError(arg, f"{p.id}: the prompt has no tokens")
        if len(ids) > gen.max_positions:
            raise UsageError(arg, f"{p.id}: the prompt has {len(ids)} tokens, more than the model's "
                                  f"{gen.max_positions} positions")
        prompts.append(ids)
    method = args.method or args.verifier
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    t0 = time.perf_counter()
    try:
        results = gen.generate(
            prompts, method=method, budget=args.budget, sampling=sampling, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop_strings=args.stop, ignore_eos=args.ignore_eos,
            block_size=args.block_size, verifier=args.verifier, batch_size=args.batch_size,
            draft_mode=args.draft_mode, **_controls(args),
        )
    except ValueError as e:
        raise _usage_from(e, "PROMPT") from None
    wall = time.perf_counter() - t0
    for i, (p, r) in enumerate(zip(items, results)):
        row = {"index": i, "id": p.id, "text": r.text, "token_ids": r.token_ids, "new_tokens": len(r.token_ids),
               "rounds": len(r.rounds), "tau": r.tau, "finish_reason": r.finish_reason}
        sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    toks = sum(len(r.token_ids) for r in results)
    rounds = sum(len(r.rounds) for r in results)
    print(f"[{PROG}] {len(results)} prompts, {toks} tokens, {rounds} row-rounds, tau {toks / max(rounds, 1):.2f}, "
          f"{toks / wall:.1f} tok/s over the batch, method={method}, batch_size={args.batch_size or len(results)}"
          + (f", budget={args.budget}" + (f" [{_chosen_budgets([x for r in results for x in r.rounds])}]"
                                          if args.budget == "auto" else "") if method in VERIFIERS else ""),
          file=sys.stderr, flush=True)
    return 0


def _use_cost_table(gen, args) -> None:
    """``--cost-table FILE``: the generator's ``budget="auto"`` reads this frozen table (and then
    neither reads nor writes the plan cache); ``--no-plan-cache``: the cache is off."""
    if getattr(args, "no_plan_cache", False):
        gen.plan_cache = False
    if getattr(args, "cost_table", None) is None:
        return
    gen.cost_table = args.cost_table  # loaded and checked by _check_generate_args (the generator
    # replaces each controller built on another table)
    path, timed = getattr(args, "cost_table_file", (None, None))
    dtype = gen.dtype_name
    if timed is not None and timed != dtype:
        fix = f"pass --dtype {timed}, or re-run sglang-tev tune" if timed in DTYPES else "re-run sglang-tev tune"
        print(f"{PROG} generate: warning: --cost-table {path} was timed with {timed} weights and this run loads "
              f"{dtype}: its round times are another dtype's ({fix})", file=sys.stderr, flush=True)


def _table_dtype(path) -> str | None:
    """The weights' dtype ``sglang-tev tune`` recorded in a cost-table file's ``meta`` (None: not
    recorded, e.g. a bare table or one written before tune recorded it)."""
    import json
    from pathlib import Path

    try:
        meta = json.loads(Path(path).read_text()).get("meta")
    except (OSError, ValueError, AttributeError):
        return None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    return dtype if isinstance(dtype, str) else None


def run(args, argv: list[str]) -> int:
    """``sglang-tev generate``: checks, then one streamed prompt or :func:`_cmd_generate_batch`."""
    from ..sampling import SamplingParams

    _check_generate_args(args)
    _, draft = _model_paths(args)  # the paths exist: checked before any load
    if args.block_size is not None and draft is not None:
        k = _draft_block_size(draft)
        if k is not None and args.block_size > k:
            raise UsageError("--block-size", f"must be in [2, {k}] (the drafter's block size), got {args.block_size}")
    prompts = None
    if args.prompts_file is not None:
        prompts = _read_prompts_file(args.prompts_file)
    elif args.prompt == "-":
        args.prompt = sys.stdin.read()
        if args.prompt == "":
            raise UsageError("PROMPT", "stdin is empty ('-' reads the prompt from stdin)")
    if prompts is not None or args.more_prompts or args.batch_size is not None:
        return _cmd_generate_batch(args, prompts or [])
    gen = _load(args)
    _use_cost_table(gen, args)
    tok = gen.tokenizer
    method = args.method or args.verifier
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    kwargs = dict(method=method, budget=args.budget, sampling=sampling, seed=args.seed,
                  max_new_tokens=args.max_new_tokens, stop_strings=args.stop, ignore_eos=args.ignore_eos,
                  block_size=args.block_size, verifier=args.verifier, chat_template=not args.no_chat_template,
                  draft_mode=args.draft_mode)
    extra = f"budget={args.budget}" if method in VERIFIERS else (f"verifier={args.verifier}" if method == "chain" else "")
    try:
        mode = gen.resolve_draft_mode(args.draft_mode, method)
    except ValueError as e:
        raise _usage_from(e, "--draft-mode") from None
    if mode is not None and gen.has_selector:  # name the mode where there is a choice (DFlash2)
        extra = f"{extra}, draft_mode={mode}" if extra else f"draft_mode={mode}"
    extra = f", method={method}" + (f", {extra}" if extra else "")

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    streamer = TextStreamer(lambda ids: tok.decode(ids, skip_special_tokens=True), write,
                            hold_spaces=bool(getattr(tok, "clean_up_tokenization_spaces", False)))
    try:
        result = gen.generate(args.prompt, stream=streamer, **kwargs, **_controls(args))
    except ValueError as e:
        raise _usage_from(e, "PROMPT") from None
    text = streamer.finish(result.token_ids)
    if text and not text.endswith("\n"):
        _summary_gap()
    if args.budget == "auto" and method in VERIFIERS:
        extra = extra.replace("budget=auto", f"budget=auto [{_chosen_budgets(result.rounds)}]")
    print(f"[{PROG}] {len(result.token_ids)} tokens, {len(result.rounds)} rounds, tau {result.tau:.2f}, "
          f"{result.tokens_per_s:.1f} tok/s, finish={result.finish_reason}{extra}", file=sys.stderr, flush=True)
    return 0
