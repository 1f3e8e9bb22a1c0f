"""Argument parsing shared by every ``sglang-tev`` command: the value types of the flags
(``_int``, ``_budget`` and the comma-separated list parsers), the one-line argparse error,
:class:`UsageError`, the runtime-argument -> flag map used to report runtime errors, and the
model options every command takes.

Imports no torch (``sglang-tev --help`` stays fast).
"""

from __future__ import annotations

import argparse
import re
import sys

from ..spec import GENERATION_METHODS, SpecError

PROG = "sglang-tev"
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


_int.__name__ = "integer"  # argparse names the type in "invalid integer value: 'abc'"


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


def _float_list(s: str) -> list[float]:
    parts = _entries(s)
    try:
        return [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _str_list(s: str) -> list[str]:
    return _entries(s)

def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", help="target model directory (HF, with tokenizer); default: the shipped tiny-code pair")
    g.add_argument("--draft", help="DFlash or DFlash2 drafter directory (z-lab layout); default without --target: the shipped drafter")
    g.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    g.add_argument("--dtype", choices=DTYPES,
                   help="weights dtype (default: bfloat16 on CUDA; on CPU bfloat16 for a half-precision checkpoint "
                        "where the CPU has native bf16 (avx512_bf16 / amx_bf16), else float32)")
    g.add_argument("--no-chat-template", action="store_true",
                   help="do not apply the tokenizer's chat template (default: applied when the tokenizer has one)")
