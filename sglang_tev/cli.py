"""The ``sglang-tev`` command line: ``generate``, ``bench`` and ``eval-drafter`` (DESIGN §5; user doc:
docs/cli.md).

``sglang-tev generate PROMPT`` streams exactly the decoded new text to stdout (the prompt is not
echoed; the final flush makes stdout equal ``tokenizer.decode(new_ids, skip_special_tokens=True)``) and prints one summary
line to stderr. ``sglang-tev bench`` runs every method over a prompt set and writes results.json,
outputs.jsonl, meta.json and two plots (see :mod:`sglang_tev.hf.bench`). ``sglang-tev eval-drafter``
compares drafters by the exact expected block length of their trees on the target's own
continuations (see :mod:`sglang_tev.train.drafter_eval`).

Bad arguments exit with status 2 and one line naming the argument (no usage block, no traceback);
the checks that need no model run before any model is loaded. A closed stdout (``| head``) ends
the command quietly with status 141 (128 + SIGPIPE), as Unix tools do.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

from . import __version__
from .hf import assets as _assets  # no torch import
from .paths import creatable_dir_problem
from .spec import (DRAFT_MODES, GENERATION_METHODS, MAX_BUDGET, TREE_MODES, VERIFIERS, SpecError, check_budget,
                   is_greedy)

PROG = "sglang-tev"
ASSETS_DIR = _assets.ASSETS_DIR  # the shipped model pair
EXIT_SIGPIPE = 128 + 13  # what a shell reports for a tool killed by SIGPIPE (`yes | head`)
METHODS = GENERATION_METHODS
DTYPES = ("float32", "bfloat16", "float16")
# A runtime argument's name (SpecError.arg; for plain ValueErrors, the message's leading name) -> its flag.
_ARG_OF = {
    "target": "--target", "draft": "--draft", "prompt": "PROMPT", "budget": "--budget",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "top_k": "--top-k", "min_p": "--min-p", "block_size": "--block-size", "method": "--method",
    "methods": "--methods", "verifier": "--verifier", "stop_strings": "--stop", "seed": "--seed",
    "budgets": "--budgets", "temperatures": "--temperatures", "prompts": "--dataset", "limit": "--limit",
    "dataset": "--dataset", "repeats": "--repeats", "output_dir": "--output", "draft_mode": "--draft-mode",
    "draft_modes": "--draft-modes", "tree_modes": "--tree-modes", "cost_table": "--cost-table",
    "batch_sizes": "--batch-sizes", "verifiers": "--verifiers",
}


class UsageError(Exception):
    """A bad command-line value: reported as ``error: argument ARG: MESSAGE``, exit status 2."""

    def __init__(self, arg: str, message: str) -> None:
        super().__init__(f"argument {arg}: {message}")
        self.arg = arg


def _at_least(flag: str, value: int, low: int) -> None:
    """Raise :class:`UsageError` naming ``flag`` unless ``value >= low``."""
    if value < low:
        raise UsageError(flag, f"must be >= {low}, got {value}")


def default_model_paths() -> tuple[Path, Path]:
    """(target, draft) of the shipped pair, ``sglang_tev/assets/tiny-code/{target,draft2}`` (the
    default drafter is the DFlash2 one, :data:`sglang_tev.hf.assets.DEFAULT_DRAFT`).

    Raises:
        FileNotFoundError: the pair is not installed there.
    """
    try:
        return _assets.shipped_pair(ASSETS_DIR)
    except FileNotFoundError:
        root = Path(ASSETS_DIR)
        raise FileNotFoundError(f"no --target given and the shipped model pair is not installed at {root} "
                                f"(expected target/ and {_assets.DEFAULT_DRAFT}/ there); pass --target and --draft") from None


def _usage_from(exc: Exception, default_arg: str) -> UsageError:
    msg = str(exc)
    if "need a drafter" in msg or "needs a drafter" in msg:
        method = msg.split("'")[1] if msg.count("'") >= 2 else "this method"
        return UsageError("--draft", f"--method {method} needs a drafter: pass --draft DIR or use "
                                     "--method autoregressive")
    if isinstance(exc, SpecError):  # the runtime named its argument: no guessing from the words
        return UsageError(_ARG_OF.get(exc.arg, default_arg), msg)
    head = msg.split(":", 1)[0].split(" ", 1)[0]
    return UsageError(_ARG_OF.get(head, default_arg), _strip_name(msg))


def _strip_name(msg: str) -> str:
    """'target: no model directory at ...' -> 'no model directory at ...': the argument is named
    once, by ``argument --target:``."""
    head, sep, rest = msg.partition(": ")
    return rest if sep and head in _ARG_OF else msg


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad value is one line (``PROG CMD: error: argument --x: ...``) with
    status 2, like every other bad value: no usage block."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        sys.stdout.flush()
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


# ---------------------------------------------------------------------------------------------- parser

def _entries(s: str) -> list[str]:
    """The entries of a comma-separated list (surrounding spaces dropped); an empty entry
    (``4,,8``, a trailing comma) is refused rather than skipped."""
    if not s.strip():
        raise argparse.ArgumentTypeError("got nothing: give at least one entry")
    parts = [x.strip() for x in s.split(",")]
    if any(not x for x in parts):
        raise argparse.ArgumentTypeError(f"an empty entry in {s!r}")
    return parts


def _int(x: str) -> int:
    """A plain decimal integer (``-3`` allowed, so its range check can name it; ``+5``, ``1e3``
    and ``0x10`` are not)."""
    if not re.fullmatch(r"-?[0-9]+", x):
        raise ValueError(x)
    return int(x)


def _int_list(s: str) -> list[int]:
    try:
        return [_int(x) for x in _entries(s)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _budget(s: str):
    """``auto`` (as the Python API spells it) or an integer (the DDTree budget)."""
    if s.strip() == "auto":
        return "auto"
    try:
        return _int(s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {s!r}") from None


def _budget_list(s: str) -> list:
    return [_budget(x) for x in _entries(s)]


def _chosen_budgets(rounds) -> str:
    """``budget=auto``: the budgets the rounds ran with, most used first (``16x40 24x10 0x2``)."""
    from collections import Counter

    counts = Counter(r.budget for r in rounds if r.budget is not None)
    return " ".join(f"{b}x{n}" for b, n in counts.most_common())


def _float_list(s: str) -> list[float]:
    parts = _entries(s)
    try:
        return [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _str_list(s: str) -> list[str]:
    return _entries(s)


GENERATE_EXAMPLES = """\
examples:
  sglang-tev generate "def fibonacci(n):"                  # the shipped tiny-code pair, greedy
  sglang-tev generate --max-new-tokens 64 "def f(x):" | head -n 3
  cat prompt.txt | sglang-tev generate -                   # the prompt from stdin
  sglang-tev generate --prompts-file prompts.jsonl > out.jsonl   # one JSON line per prompt
  sglang-tev generate --target DIR --draft DIR --budget 64 --temperature 0.8 --top-p 0.95 "Explain KV caches."
"""

BENCH_EXAMPLES = """\
examples:
  sglang-tev bench --dataset humaneval --limit 20 --max-new-tokens 128
  sglang-tev bench --target DIR --draft DIR --dataset prompts.jsonl --budgets 32,64 \\
      --temperatures 0,1 --repeats 5 --output runs/bench
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", help="target model directory (HF, with tokenizer); default: the shipped tiny-code pair")
    g.add_argument("--draft", help="DFlash or DFlash2 drafter directory (z-lab layout); default without --target: the shipped drafter")
    g.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--no-chat-template", action="store_true",
                   help="do not apply the tokenizer's chat template (default: applied when the tokenizer has one)")


TUNE_EXAMPLES = """\
examples:
  sglang-tev tune                                          # the shipped pair, batch 1 and 8, T = 0 and 1
  sglang-tev tune --target DIR --draft DIR --batch-sizes 1,4,16 --output tune.json
  sglang-tev generate --cost-table tune.json "def f(x):"   # --budget auto reads the tuned costs
"""

EVAL_EXAMPLES = """\
examples:
  sglang-tev eval-drafter --prompts humaneval --limit 24               # the shipped pair, T = 0 and 1, B = 64
  sglang-tev eval-drafter --target DIR --draft OLD --draft NEW --prompts prompts.jsonl \\
      --temperatures 0,1 --budgets 32,64 --max-new-tokens 128 --output runs/eval --cache-dir runs/cont
  sglang-tev eval-drafter --target DIR --draft V1 --draft DFLASH2 --prompts prompts.jsonl \
      --tree-modes marginal,lattice,chain                              # rows V1[marginal], DFLASH2[lattice], ...
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Lossless tree speculative decoding (DFlash + DDTree + TEV).",
                     epilog=(GENERATE_EXAMPLES + BENCH_EXAMPLES.split("\n", 1)[1] + TUNE_EXAMPLES.split("\n", 1)[1]
                             + EVAL_EXAMPLES.split("\n", 1)[1]
                             + "\nsee COMMAND --help for each option\n"),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(command_parsers=sub.choices)  # each command's parser, for its error line

    g = sub.add_parser("generate", help="generate text for one prompt (stdout: the new text only) or a batch",
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

    b = sub.add_parser("bench", help="compare autoregressive, chain and DDTree verifiers on a prompt set",
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

    t = sub.add_parser("tune", help="measure every budget on this machine and print the tokens/s-optimal "
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

    e = sub.add_parser("eval-drafter", help="compare drafters by the exact expected block length 1 + C_p on the "
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
    drafter unless --draft names another. Each must be a directory (checked here, before loading)."""
    if args.target is not None:
        target, draft = args.target, args.draft
    else:
        try:
            target, draft = default_model_paths()
        except FileNotFoundError as e:
            raise UsageError("--target", str(e)) from None
        draft = draft if args.draft is None else args.draft
    for arg, path in (("--target", target), ("--draft", draft)):
        if path is not None and not os.path.isdir(path):
            raise UsageError(arg, f"no model directory at {os.fspath(path)!r}")
    return target, draft


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
        raise UsageError(arg, _strip_name(msg)) from None
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
        from .hf.autobudget import CostTable

        try:
            args.cost_table = CostTable.load(args.cost_table, frozen=True)
        except ValueError as e:
            raise UsageError("--cost-table", _strip_name(str(e))) from None
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
    from .hf.datasets import Prompt, load_jsonl

    p = Path(path)
    try:
        if path == "humaneval":
            from .hf.datasets import load_prompts
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
    from .hf.datasets import Prompt, encode_prompt
    from .sampling import SamplingParams

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
    """``--cost-table FILE``: the generator's ``budget="auto"`` reads this frozen table."""
    if getattr(args, "cost_table", None) is None:
        return
    gen.cost_table = args.cost_table  # loaded and checked by _check_generate_args (the generator
    # replaces each controller built on another table)


def cmd_generate(args) -> int:
    from .sampling import SamplingParams

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


# ---------------------------------------------------------------------------------------------- bench

def cmd_bench(args, argv: list[str]) -> int:
    from .hf.bench import format_table, run_bench

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


# ---------------------------------------------------------------------------------------------- tune

def cmd_tune(args, argv: list[str]) -> int:
    """``sglang-tev tune``: :func:`sglang_tev.hf.tune.run_tune`, printed and optionally saved."""
    from .hf.tune import format_tune, run_tune, tune_meta, write_tune

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
        write_tune(out, result, tune_meta(argv))
        print(f"[{PROG}] wrote {out} (its cost table: sglang-tev generate --cost-table {out})", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- eval-drafter

def _output_path(value: str | None, root: str) -> Path:
    """``--output`` as given, else ``root/<UTC time stamp>``."""
    return Path(value) if value else Path(root) / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _prompts_arg(arg: str, source: str, limit: int | None) -> list:
    """``load_prompts(source, limit)``; a missing, malformed or empty source is ``UsageError(arg)``."""
    from .hf.datasets import load_prompts

    try:
        prompts = load_prompts(source, limit)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(arg, str(e)) from None
    if not prompts:
        raise UsageError(arg, f"{source} holds no prompts")
    return prompts


def _check_output_dir(out: Path, overwrite: bool, reusable: tuple[str, ...] = (), arg: str = "--output",
                      must_be_empty: bool = True) -> None:
    """Refuse a folder argument (``arg``) that cannot be written before any model loads: a file,
    a dangling link, a file on its path, a name the filesystem rejects, a place that cannot be
    written (``/proc``, a read-only mount), or, with ``must_be_empty``, a non-empty folder without
    ``--overwrite`` (entries named in ``reusable`` do not count). Raises ``UsageError(arg)``;
    creates nothing (the write probe is removed at once)."""
    try:
        if out.is_symlink() and not out.exists():
            raise UsageError(arg, f"{out} is a link to a missing {os.readlink(out)!r}")
        if must_be_empty and out.is_dir() and any(p.name not in reusable for p in out.iterdir()) and not overwrite:
            raise UsageError(arg, f"{out} exists and is not empty (results of an earlier run?); "
                                  f"choose another {arg} or pass --overwrite")
    except OSError as e:  # e.g. a name longer than the filesystem allows
        raise UsageError(arg, f"cannot use {str(out)[:80]!r}: {e.strerror or e}") from None
    # a file in the way, a read-only or virtual filesystem (/proc), a name too long: before
    # minutes of model loading, not at the first write
    problem = creatable_dir_problem(out)
    if problem is not None:
        raise UsageError(arg, problem)


TREE_MODE_CHOICES = ("auto", *TREE_MODES)


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


def cmd_eval_drafter(args, argv: list[str]) -> int:
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
    from .train.drafter_eval import evaluate_drafters, format_table

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


# ---------------------------------------------------------------------------------------------- main

def _stdout_gone() -> int:
    """The reader of stdout went away (EPIPE): end quietly, as a tool killed by SIGPIPE would.
    stdout's fd is pointed at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return EXIT_SIGPIPE
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass
    return EXIT_SIGPIPE


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``sglang-tev`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        sub = args.command_parsers.get(args.command, parser)  # for the error line
        if unknown:  # named by the subcommand, as its other errors are
            sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2, one line printed)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "eval-drafter":
            return cmd_eval_drafter(args, argv)
        if args.command == "tune":
            return cmd_tune(args, argv)
        return cmd_bench(args, argv)
    except UsageError as e:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            return _stdout_gone()
        print(f"{sub.prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return _stdout_gone()
    except OSError as e:
        if e.errno == errno.EPIPE:
            return _stdout_gone()
        raise
    except KeyboardInterrupt:
        print(f"[{PROG}] interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
