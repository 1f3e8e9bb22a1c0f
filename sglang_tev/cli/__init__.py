"""The ``sglang-tev`` command line: ``generate``, ``bench``, ``tune``, ``eval-drafter`` and ``draw-tree``
(DESIGN §5; user doc: docs/cli.md).

``sglang-tev generate PROMPT`` streams exactly the decoded new text to stdout (the prompt is not
echoed; the final flush makes stdout equal ``tokenizer.decode(new_ids, skip_special_tokens=True)``) and prints one summary
line to stderr. ``sglang-tev bench`` runs every method over a prompt set and writes results.json,
outputs.jsonl, meta.json and two plots (see :mod:`sglang_tev.hf.bench`). ``sglang-tev eval-drafter``
compares drafters by the exact expected block length of their trees on the target's own
continuations (see :mod:`sglang_tev.train.drafter_eval`). ``sglang-tev draw-tree`` draws one round's
draft tree with its exit law, and exit mass by depth over a prompt set (see
:mod:`sglang_tev.train.tree_exits`).

Bad arguments exit with status 2 and one line naming the argument (no usage block, no traceback);
the checks that need no model run before any model is loaded. A closed stdout (``| head``) ends
the command quietly with status 141 (128 + SIGPIPE), as Unix tools do.

Layout: this module builds the parser (:func:`build_parser`, each command adding its own
subparser) and dispatches (:func:`main`); :mod:`.args` holds the flag types, :class:`UsageError`
and the runtime-argument -> flag map, :mod:`.common` the model loading, output checks and
:class:`TextStreamer`; one module per command (:mod:`.generate`, :mod:`.bench`, :mod:`.tune`,
:mod:`.eval_drafter`, :mod:`.draw_tree`), each with ``add_parser(subparsers)`` and ``run(args, argv)``. Importing
the package imports no torch.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from .. import __version__
from ..spec import DRAFT_MODES, MAX_BUDGET, VERIFIERS
from . import bench, draw_tree, eval_drafter, generate, tune
from .args import DTYPES, EXIT_SIGPIPE, METHODS, PROG, UsageError, _Parser
from .args import _usage_from  # noqa: F401 (re-exported: tests call cli._usage_from)
from .common import ASSETS_DIR, TextStreamer, default_model_paths
from .eval_drafter import TREE_MODE_CHOICES

__all__ = ["main", "build_parser", "TextStreamer", "default_model_paths", "UsageError", "PROG", "ASSETS_DIR",
           "METHODS", "DTYPES", "TREE_MODE_CHOICES", "VERIFIERS", "DRAFT_MODES", "MAX_BUDGET", "EXIT_SIGPIPE"]

COMMANDS = (generate, bench, tune, eval_drafter, draw_tree)  # in the order of --help


def build_parser() -> argparse.ArgumentParser:
    """The ``sglang-tev`` parser: each command's subparser from its module's ``add_parser``."""
    parser = _Parser(prog=PROG, description="Lossless tree speculative decoding (DFlash + DDTree + TEV).",
                     epilog=(generate.GENERATE_EXAMPLES + bench.BENCH_EXAMPLES.split("\n", 1)[1]
                             + tune.TUNE_EXAMPLES.split("\n", 1)[1] + eval_drafter.EVAL_EXAMPLES.split("\n", 1)[1]
                             + draw_tree.DRAW_EXAMPLES.split("\n", 1)[1]
                             + "\nsee COMMAND --help for each option\n"),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(command_parsers=sub.choices)  # each command's parser, for its error line
    for command in COMMANDS:
        command.add_parser(sub)  # sets its own default run=command.run
    return parser


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
    from ..env import EnvError, check_environment

    try:  # a misspelled SGLANG_TEV_* name is refused before any model loads, by every command
        check_environment()
    except EnvError as e:
        print(f"{sub.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        return args.run(args, argv)
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
