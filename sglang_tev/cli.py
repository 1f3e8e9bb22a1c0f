"""The ``sglang-tev`` command line: ``generate`` and ``bench`` (DESIGN §5; user doc: docs/cli.md).

``sglang-tev generate PROMPT`` streams exactly the decoded new text to stdout (the prompt is not
echoed; the final flush makes stdout equal ``tokenizer.decode(new_ids, skip_special_tokens=True)``) and prints one summary
line to stderr. ``sglang-tev bench`` runs every method over a prompt set and writes results.json,
outputs.jsonl, meta.json and two plots (see :mod:`sglang_tev.hf.bench`).

Bad arguments exit with status 2 and a message naming the argument; no traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

from . import __version__

PROG = "sglang-tev"
ASSETS_DIR = Path(__file__).resolve().parent / "assets" / "tiny-code"  # the shipped model pair
VERIFIERS = ("tev", "predraw", "sequential", "greedy")
METHODS = ("autoregressive", "chain", *VERIFIERS)  # = hf.runtime.GENERATION_METHODS (no torch import for --help)
DTYPES = ("float32", "bfloat16", "float16")
# First word of a runtime ValueError message -> the command-line argument it is about.
_ARG_OF = {
    "target": "--target", "draft": "--draft", "prompt": "PROMPT", "budget": "--budget",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "top_k": "--top-k", "min_p": "--min-p", "block_size": "--block-size", "method": "--method",
    "methods": "--methods", "verifier": "--verifier", "stop_strings": "--stop", "seed": "--seed",
    "budgets": "--budgets", "temperatures": "--temperatures", "prompts": "--dataset", "limit": "--limit",
    "dataset": "--dataset",
}


class UsageError(Exception):
    """A bad command-line value: reported as ``error: argument ARG: MESSAGE``, exit status 2."""

    def __init__(self, arg: str, message: str) -> None:
        super().__init__(f"argument {arg}: {message}")
        self.arg = arg


def default_model_paths() -> tuple[Path, Path]:
    """(target, draft) of the shipped pair, ``sglang_tev/assets/tiny-code/{target,draft}``.

    Raises:
        FileNotFoundError: the pair is not installed there.
    """
    root = Path(ASSETS_DIR)
    target, draft = root / "target", root / "draft"
    if not (target.is_dir() and draft.is_dir()):
        raise FileNotFoundError(f"no --target given and the shipped model pair is not installed at {root} "
                                "(expected target/ and draft/ there); pass --target and --draft")
    return target, draft


def _usage_from(exc: Exception, default_arg: str) -> UsageError:
    msg = str(exc)
    if "need a drafter" in msg or "needs a drafter" in msg:
        method = msg.split("'")[1] if msg.count("'") >= 2 else "this method"
        return UsageError("--draft", f"--method {method} needs a drafter: pass --draft DIR or use "
                                     "--method autoregressive")
    head = msg.split(":", 1)[0].split(" ", 1)[0]
    return UsageError(_ARG_OF.get(head, default_arg), msg)


# ---------------------------------------------------------------------------------------------- parser

def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _float_list(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _str_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", help="target model directory (HF, with tokenizer); default: the shipped tiny-code pair")
    g.add_argument("--draft", help="DFlash drafter directory (z-lab layout); default without --target: the shipped drafter")
    g.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--no-chat-template", action="store_true",
                   help="do not apply the tokenizer's chat template (default: applied when the tokenizer has one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Lossless tree speculative decoding (DFlash + DDTree + TEV).")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for one prompt (stdout: the new text only)",
                       description="Generate with tree speculative decoding. stdout carries exactly the new "
                       "text; a summary line goes to stderr.")
    g.add_argument("prompt", metavar="PROMPT", nargs="?", help="the prompt text")
    g.add_argument("more_prompts", metavar="PROMPT ...", nargs="*",
                   help="more prompts: decoded as one batch; stdout then carries one JSON line per prompt, in input order")
    _add_model_args(g)
    g.add_argument("--budget", type=int, default=64, help="DDTree budget B, non-root nodes (default 64)")
    g.add_argument("--verifier", choices=VERIFIERS, default="tev",
                   help="verifier of the DDTree (and of --method chain) (default tev)")
    g.add_argument("--method", choices=METHODS,
                   help="override: autoregressive, chain, or DDTree + a verifier (default: the --verifier)")
    g.add_argument("--temperature", type=float, default=0.0, help="target temperature; 0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="top-p in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k; <= 0 off (default 0)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p in [0, 1] (default 0: off)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="new tokens at most, >= 1 (default 256)")
    g.add_argument("--seed", type=int, default=0, help="seed of the verifier's randomness (default 0)")
    g.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable); output ends with it")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    g.add_argument("--block-size", type=int, help="draft block size K (default: the drafter's)")
    g.add_argument("--prompts-file", metavar="FILE",
                   help="prompts from a .jsonl file (one 'prompt' or 'messages' per line) or 'humaneval'; "
                   "stdout: one JSON line per prompt, in input order")
    g.add_argument("--batch-size", type=int, help="rows decoded together (default: all prompts)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="as transformers' (default 1: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="as OpenAI / SGLang (default 0: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="as OpenAI / SGLang (default 0: off)")

    b = sub.add_parser("bench", help="compare autoregressive, chain and DDTree verifiers on a prompt set",
                       description="Benchmark every method on one prompt set in one run; writes results.json, "
                       "outputs.jsonl, meta.json, tau_hist.png and stage_ms.png to --output (default: bench-results/<date-time>).")
    _add_model_args(b)
    b.add_argument("--dataset", required=True, help="'humaneval' or a .jsonl file (one 'prompt' or 'messages' per line)")
    b.add_argument("--limit", type=int, help="use the first N prompts")
    b.add_argument("--budgets", type=_int_list, default=[32, 64, 128], help="DDTree budgets, comma-separated (default 32,64,128)")
    b.add_argument("--temperatures", type=_float_list, default=[0.0, 1.0], help="comma-separated (default 0,1)")
    b.add_argument("--max-new-tokens", type=int, default=256, help="per prompt (default 256)")
    b.add_argument("--methods", type=_str_list, default=["autoregressive", "chain", "tev", "predraw", "sequential"],
                   help="comma-separated subset of autoregressive,chain,tev,predraw,sequential,greedy "
                   "(default: all but greedy)")
    b.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i (default 0)")
    b.add_argument("--ignore-eos", action="store_true", help="do not stop at the EOS token")
    b.add_argument("--output", metavar="DIR",
                   help="output directory, created (default: bench-results/<UTC date-time> under the current directory)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--batch-sizes", type=_int_list, default=None,
                   help="also decode all prompts batched at these sizes, e.g. 1,4,16: tokens/s over the batch and "
                   "per-row tau go into results.json ('batch') and batch_tokens_per_s.png")
    return parser


# ---------------------------------------------------------------------------------------------- loading

def _torch_device(name: str | None):
    import torch

    if name is None:
        return None
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise UsageError("--device", f"invalid device {name!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", f"{name!r} asked for but CUDA is not available")
    return dev


def _model_paths(args) -> tuple:
    """(target, draft) from --target/--draft: without --target the shipped target, and its
    drafter unless --draft names another."""
    if args.target is not None:
        return args.target, args.draft
    try:
        target, draft = default_model_paths()
    except FileNotFoundError as e:
        raise UsageError("--target", str(e)) from None
    return target, draft if args.draft is None else args.draft


def _load(args):
    """-> SpeculativeGenerator from :func:`_model_paths`, --device, --dtype."""
    import torch

    target, draft = _model_paths(args)
    device = _torch_device(args.device)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keep stderr to our own lines
        hf_logging.set_verbosity_error()  # e.g. "sequence length is longer than..." for prompts we skip
    except ImportError:  # pragma: no cover
        pass
    from .hf.runtime import SpeculativeGenerator

    try:
        gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device=device)
    except (FileNotFoundError, ValueError, OSError) as e:
        msg = str(e)
        arg = "--target" if msg.startswith(("target:", "target ")) else "--draft"
        raise UsageError(arg, msg) from None
    if gen.tokenizer is None:
        raise UsageError("--target", f"{target} has no tokenizer; text prompts need one")
    return gen


# ---------------------------------------------------------------------------------------------- generate

class TextStreamer:
    """Writes the decoded new text incrementally so that the concatenation equals ``decode(ids)``.

    Each call decodes all new ids so far and writes only the new suffix of the text. A trailing
    U+FFFD (an incomplete multi-byte character) is held back until more tokens arrive; so is a
    trailing space run when the tokenizer cleans up tokenization spaces (the cleanup can remove a
    space once the next token is known). :meth:`finish` writes whatever remains of the final text.

    Args:
        decode: ids -> text (``tokenizer.decode``).
        write: text -> None (e.g. ``sys.stdout.write`` followed by a flush).
        hold_spaces: also hold back text from a trailing space (tokenizers with
            ``clean_up_tokenization_spaces``).
    """

    def __init__(self, decode: Callable[[list[int]], str], write: Callable[[str], None], hold_spaces: bool = False) -> None:
        self.decode = decode
        self.write = write
        self.hold_spaces = hold_spaces
        self.ids: list[int] = []
        self.written = ""

    def _stable(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        if self.hold_spaces:
            cut = text.rfind(" ", max(0, len(text) - 4))
            if cut >= 0:
                text = text[:cut]
        return text

    def _emit(self, text: str) -> None:
        if text.startswith(self.written) and len(text) > len(self.written):
            self.write(text[len(self.written):])
            self.written = text

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(int(t) for t in new_ids)
        self._emit(self._stable(self.decode(self.ids)))

    def finish(self, final_ids: list[int] | None = None) -> str:
        """Write the rest of ``decode(final_ids)`` (default: the ids seen); returns the full text.

        If an earlier write is not a prefix of the final text (a decoder whose output for a prefix
        is not a prefix of the whole), stdout cannot be corrected; that never happens for byte-level
        BPE or SentencePiece decoders with the hold-backs above.
        """
        ids = self.ids if final_ids is None else list(final_ids)
        text = self.decode(ids)
        if text.startswith(self.written):
            if len(text) > len(self.written):
                self.write(text[len(self.written):])
        else:
            self.write(text[_common_prefix(text, self.written):])
        self.written = text
        return text


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _check_generate_args(args) -> None:
    if args.budget < 0:
        raise UsageError("--budget", f"must be >= 0, got {args.budget}")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    if not (args.temperature >= 0) or math.isinf(args.temperature):
        raise UsageError("--temperature", f"must be a finite number >= 0, got {args.temperature}")
    if not (0 < args.top_p <= 1):
        raise UsageError("--top-p", f"must be in (0, 1], got {args.top_p}")
    if not (0 <= args.min_p <= 1):
        raise UsageError("--min-p", f"must be in [0, 1], got {args.min_p}")
    if args.block_size is not None and args.block_size < 2:
        raise UsageError("--block-size", f"must be >= 2, got {args.block_size}")
    if args.stop is not None and any(s == "" for s in args.stop):
        raise UsageError("--stop", "stop strings must be non-empty")
    method = args.method or args.verifier
    if args.temperature >= 1e-5:
        greedy_arg = None
        if method == "greedy":
            greedy_arg = "--verifier" if args.method is None else "--method"
        elif method == "chain" and args.verifier == "greedy":
            greedy_arg = "--verifier"
        if greedy_arg is not None:
            raise UsageError(greedy_arg, "'greedy' is exact only at temperature 0; use tev, predraw or sequential")


def _controls(args) -> dict:
    return dict(repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty)


def _cmd_generate_batch(args) -> int:
    """Several prompts (positional and/or --prompts-file) decoded as one batch; stdout: one JSON
    line per prompt in input order ({"index", "text", "token_ids", "finish_reason"})."""
    import json

    from .hf.datasets import encode_prompt, load_prompts
    from .sampling import SamplingParams

    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError("--batch-size", f"must be >= 1, got {args.batch_size}")
    texts = ([args.prompt] if args.prompt is not None else []) + list(args.more_prompts)
    loaded = []
    if args.prompts_file:
        try:
            loaded = load_prompts(args.prompts_file)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError("--prompts-file", str(e)) from None
        if not loaded:
            raise UsageError("--prompts-file", f"{args.prompts_file} holds no prompts")
    if any(t == "" for t in texts):
        raise UsageError("PROMPT", "prompts must be non-empty")
    gen = _load(args)
    chat = not args.no_chat_template
    prompts = [gen.encode(t, chat) for t in texts] + [encode_prompt(p, gen.tokenizer, chat) for p in loaded]
    method = args.method or args.verifier
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    t0 = time.perf_counter()
    try:
        results = gen.generate(
            prompts, method=method, budget=args.budget, sampling=sampling, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop_strings=args.stop, ignore_eos=args.ignore_eos,
            block_size=args.block_size, verifier=args.verifier, batch_size=args.batch_size, **_controls(args),
        )
    except ValueError as e:
        raise _usage_from(e, "PROMPT") from None
    wall = time.perf_counter() - t0
    for i, r in enumerate(results):
        print(json.dumps({"index": i, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason}),
              flush=True)
    toks = sum(len(r.token_ids) for r in results)
    rounds = sum(len(r.rounds) for r in results)
    print(f"[{PROG}] {len(results)} prompts, {toks} tokens, {rounds} row-rounds, tau {toks / max(rounds, 1):.2f}, "
          f"{toks / wall:.1f} tok/s over the batch, method={method}, batch_size={args.batch_size or len(results)}",
          file=sys.stderr, flush=True)
    return 0


def cmd_generate(args) -> int:
    from .sampling import SamplingParams

    _check_generate_args(args)
    if args.prompts_file or args.more_prompts or args.batch_size is not None:
        return _cmd_generate_batch(args)
    if args.prompt is None:
        raise UsageError("PROMPT", "give a prompt (or several, or --prompts-file FILE)")
    gen = _load(args)
    tok = gen.tokenizer
    method = args.method or args.verifier

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    streamer = TextStreamer(lambda ids: tok.decode(ids, skip_special_tokens=True), write,
                            hold_spaces=bool(getattr(tok, "clean_up_tokenization_spaces", False)))
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    try:
        result = gen.generate(
            args.prompt, method=method, budget=args.budget, sampling=sampling, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop_strings=args.stop, ignore_eos=args.ignore_eos,
            block_size=args.block_size, verifier=args.verifier, chat_template=not args.no_chat_template,
            stream=streamer, **_controls(args),
        )
    except ValueError as e:
        raise _usage_from(e, "PROMPT") from None
    streamer.finish(result.token_ids)
    rounds = len(result.rounds)
    tps = result.tokens_per_s
    extra = f"budget={args.budget}" if method in VERIFIERS else (f"verifier={args.verifier}" if method == "chain" else "")
    print(f"[{PROG}] {len(result.token_ids)} tokens, {rounds} rounds, tau {result.tau:.2f}, "
          f"{tps:.1f} tok/s, finish={result.finish_reason}, method={method}" + (f", {extra}" if extra else ""),
          file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- bench

def cmd_bench(args, argv: list[str]) -> int:
    from .hf.bench import format_table, run_bench
    from .hf.datasets import load_prompts

    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit", f"must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    if not args.budgets and any(m in VERIFIERS for m in args.methods):
        raise UsageError("--budgets", "give at least one budget")
    if any(b < 0 for b in args.budgets):
        raise UsageError("--budgets", f"budgets must be >= 0, got {args.budgets}")
    if not args.temperatures or any(not (t >= 0) or math.isinf(t) for t in args.temperatures):
        raise UsageError("--temperatures", f"temperatures must be finite numbers >= 0, got {args.temperatures}")
    if not args.methods:
        raise UsageError("--methods", f"give at least one of {','.join(METHODS)}")
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        raise UsageError("--methods", f"unknown {bad}; choose from {','.join(METHODS)}")
    out = Path(args.output) if args.output else \
        Path("bench-results") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    if out.exists() and not out.is_dir():
        raise UsageError("--output", f"{out} exists and is not a directory")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError("--output", f"cannot create {out}: {blocker} is not a directory")
    try:
        prompts = load_prompts(args.dataset, args.limit)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError("--dataset", str(e)) from None
    if not prompts:
        raise UsageError("--dataset", f"{args.dataset} holds no prompts")
    gen = _load(args)
    target, draft = _model_paths(args)
    meta = {"dataset": args.dataset, "limit": args.limit, "target_path": os.fspath(target),
            "draft_path": None if draft is None else os.fspath(draft), "argv": argv}
    try:
        records = run_bench(
            gen, prompts, budgets=args.budgets, temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
            methods=args.methods, seed=args.seed, output_dir=out, chat_template=not args.no_chat_template,
            ignore_eos=args.ignore_eos, progress=not args.no_progress,
            command=shlex.join([PROG, *argv]), meta=meta, batch_sizes=args.batch_sizes,
        )
    except ValueError as e:
        raise _usage_from(e, "--dataset") from None
    print(format_table(records))
    print(f"[{PROG}] wrote {out / 'results.json'}, outputs.jsonl, meta.json, tau_hist.png, stage_ms.png",
          file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sglang-tev`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2, message printed)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    sub = parser._subparsers._group_actions[0].choices[args.command]  # for the usage line
    try:
        if args.command == "generate":
            return cmd_generate(args)
        return cmd_bench(args, argv)
    except UsageError as e:
        sys.stdout.flush()
        print(f"{sub.prog}: error: {e}\n(see {sub.prog} --help)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"[{PROG}] interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
