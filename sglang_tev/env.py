"""Every ``SGLANG_TEV_*`` environment variable, declared once (``docs/env.md`` lists them).

Torch-free (standard library and :mod:`sglang_tev.spec` only), so the command line, the SGLang
plugin's start-up checks and the test harness read variables the same way without importing
torch. No other module of the package reads an ``SGLANG_TEV_*`` variable from ``os.environ``
itself: it calls :func:`get` with one of the names below::

    from sglang_tev import env
    verifier = env.get(env.VERIFIER)              # "tev" unless SGLANG_TEV_VERIFIER says otherwise
    topk = env.get(env.TOPK, {"SGLANG_TEV_TOPK": "8"})   # 8 (an explicit mapping, e.g. in tests)

Each :class:`Variable` has a parser that keeps the exact semantics its readers had before this
registry (a lenient switch stays lenient, a strict one raises); a value a parser refuses raises
:class:`EnvError` (a :class:`~sglang_tev.spec.SpecError`, so a ``ValueError``) whose ``arg`` is
the variable's name and whose message lists the accepted values.

:func:`check_environment` refuses any ``SGLANG_TEV_*`` name the registry does not know (a typo
would otherwise be ignored silently), naming the closest known one. It runs where sglang-tev
starts: the SGLang plugin's ``validate_server_args`` hook and the TEV worker, the transformers
runtime (:class:`~sglang_tev.hf.runtime.SpeculativeGenerator`) and ``python -m sglang_tev.train``.
Importing :mod:`sglang_tev` never raises for the environment.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from .spec import AUTO, DRAFT_MODES, SERVED_VERIFIERS, SpecError

__all__ = [
    "PREFIX",
    "USER",
    "TESTING",
    "Variable",
    "EnvError",
    "REGISTRY",
    "names",
    "get",
    "check_environment",
    "DFLASH2_MODES",
    "VERIFIER",
    "TOPK",
    "DFLASH2_MODE",
    "CACHE",
    "NATIVE",
    "PLAN_CACHE",
    "REFERENCE_ATTENTION",
    "CPU_ATTN_IGNORE_MASK",
    "CPU_HARNESS",
    "TP_TRACE",
    "SYNC_PROBE",
    "PLAIN_STEPS",
    "RAGGED_CUTS",
    "GRAPH_TREE_SIZES",
    "STEP_TRACE",
    "KEEP_LOGS",
    "REQUIRE_SGLANG",
]

PREFIX = "SGLANG_TEV_"
"""Every variable of the registry starts with this; :func:`check_environment` checks the names
that do (compared in upper case, so ``sglang_tev_verifier`` is caught too)."""

USER = "user"
"""Audience of a variable that operators set (serving, the runtime, the native helpers)."""

TESTING = "testing"
"""Audience of a variable that the test harness, CI or debugging sets."""

DFLASH2_MODES = tuple(m for m in DRAFT_MODES if m != AUTO)
"""Draft modes of a DFlash2 drafter under SGLang (``SGLANG_TEV_DFLASH2_MODE``): ``lattice``,
``marginal``."""

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


class EnvError(SpecError):
    """A bad value of a known ``SGLANG_TEV_*`` variable, or an ``SGLANG_TEV_*`` name the registry
    does not know. ``arg`` is the variable's name as it appears in the environment; ``str`` is
    ``"{name} {message}"`` (``SGLANG_TEV_TOPK must be an integer >= 1, got '0'``).

    Attributes:
        suggestion: for an unknown name, the closest known name (None when nothing is close; None
            for a bad value).
    """

    def __init__(self, arg: str, message: str, suggestion: Optional[str] = None) -> None:
        super().__init__(arg, message)
        self.suggestion = suggestion


@dataclass(frozen=True)
class Variable:
    """One ``SGLANG_TEV_*`` variable.

    Attributes:
        name: the full name (``SGLANG_TEV_VERIFIER``).
        parse: ``fn(raw: str) -> value`` for a variable that is set (raw as in the environment,
            unstripped); raises ``ValueError`` with the message after the name (``"must be ..."``).
        default: the value when the variable is unset.
        values: the accepted values, as ``docs/env.md`` writes them.
        doc: one line: what it does.
        audience: :data:`USER` or :data:`TESTING`.
        choices: the accepted values when they are a closed set (after stripping and lower-casing),
            else None.
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    values: str
    doc: str
    audience: str
    choices: Optional[tuple] = None

    def read(self, environ: Optional[Mapping[str, str]] = None) -> Any:
        """The typed value from ``environ`` (default ``os.environ``).

        Raises:
            EnvError naming the variable and the accepted values.
        """
        env = os.environ if environ is None else environ
        raw = env.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise EnvError(self.name, str(e)) from None


# ------------------------------------------------------------------------------ parsers
# Each keeps the semantics of the reader it replaced (noted per parser).

def _verifier(raw: str) -> str:
    # srt/config.read_env: stripped, lower-cased; empty = the default
    value = raw.strip().lower() or "tev"
    if value not in SERVED_VERIFIERS:
        raise ValueError(f"must be one of {SERVED_VERIFIERS}, got {raw!r}")
    return value


def _topk(raw: str) -> Optional[int]:
    # srt/config.read_env: stripped; empty = unset (None: the budget B); int() >= 1
    text = raw.strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be an integer >= 1, got {text!r}")
    return value


def _dflash2_mode(raw: str) -> Optional[str]:
    # srt/config.read_dflash2_mode: stripped, lower-cased; empty = unset (the drafter decides)
    value = raw.strip().lower()
    if not value:
        return None
    if value not in DFLASH2_MODES:
        raise ValueError(f"must be one of {DFLASH2_MODES}, got {raw!r}")
    return value


SERVED_BUDGETS = ("fixed", "auto", "auto-ragged")
"""How the SGLang plugin sizes each round's trees (``SGLANG_TEV_BUDGET``)."""


def _served_budget(raw: str) -> str:
    # srt/config: stripped, lower-cased; empty = auto (the default since the graph tiers)
    value = raw.strip().lower() or "auto"
    if value not in SERVED_BUDGETS:
        raise ValueError(f"must be one of {SERVED_BUDGETS}, got {raw!r}")
    return value


def _tree_sizes(raw: str) -> Optional[tuple]:
    # srt/graph_tiers: empty / "auto" = the default tiers (None); "off" = none (auto runs eagerly;
    # only the word: "0" is a tree size, refused); else comma-separated tree sizes >= 1 (checked
    # against N when the server's args are resolved)
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    if value == "off":
        return ()
    try:
        sizes = tuple(int(x) for x in value.split(","))
    except ValueError:
        sizes = (0,)  # not integers: refused below with the same message
    if min(sizes) < 1:
        raise ValueError(f"must be auto, off or comma-separated tree sizes (integers >= 1), got {raw!r}")
    return sizes


def _path(raw: str) -> Optional[str]:
    # native._cache_dir, the harness's trace / probe: an empty value counts as unset
    return raw or None


def _native(raw: str) -> bool:
    # native._disabled: off only for 0 / false / no / off (any case, stripped); anything else on
    return raw.strip().lower() not in _OFF


def _exactly_one(raw: str) -> bool:
    # the plugin's reference-attention switch and the harness's flags: on only for the string "1"
    return raw == "1"


def _strict_flag(raw: str) -> bool:
    # cpu_attention._env_flag: 0/1 words (stripped, any case); empty = off; anything else refused
    value = raw.strip().lower()
    if value in ("", *_OFF):
        return False
    if value in _ON:
        return True
    raise ValueError(f"must be 0 or 1, got {raw!r}")


# ------------------------------------------------------------------------------ the registry

VERIFIER = "SGLANG_TEV_VERIFIER"
TOPK = "SGLANG_TEV_TOPK"
DFLASH2_MODE = "SGLANG_TEV_DFLASH2_MODE"
BUDGET = "SGLANG_TEV_BUDGET"
GRAPH_TREE_SIZES = "SGLANG_TEV_GRAPH_TREE_SIZES"
CACHE = "SGLANG_TEV_CACHE"
NATIVE = "SGLANG_TEV_NATIVE"
PLAN_CACHE = "SGLANG_TEV_PLAN_CACHE"
REFERENCE_ATTENTION = "SGLANG_TEV_REFERENCE_ATTENTION"
CPU_ATTN_IGNORE_MASK = "SGLANG_TEV_CPU_ATTN_IGNORE_MASK"
CPU_HARNESS = "SGLANG_TEV_CPU_HARNESS"
TP_TRACE = "SGLANG_TEV_TP_TRACE"
SYNC_PROBE = "SGLANG_TEV_SYNC_PROBE"
PLAIN_STEPS = "SGLANG_TEV_PLAIN_STEPS"
RAGGED_CUTS = "SGLANG_TEV_RAGGED_CUTS"
STEP_TRACE = "SGLANG_TEV_STEP_TRACE"
KEEP_LOGS = "SGLANG_TEV_KEEP_LOGS"
REQUIRE_SGLANG = "SGLANG_TEV_REQUIRE_SGLANG"

_VARIABLES = (
    Variable(VERIFIER, _verifier, "tev", " | ".join(SERVED_VERIFIERS) + " (any case; empty = tev)",
             "the verifier the SGLang plugin runs (greedy rows take argmax-follow in each)", USER,
             SERVED_VERIFIERS),
    Variable(TOPK, _topk, None, "an integer >= 1 (empty = unset)",
             "per-depth candidate list width of the SGLang plugin's DDTree builder (unset: the budget B = N - 1)",
             USER),
    Variable(DFLASH2_MODE, _dflash2_mode, None, " | ".join(DFLASH2_MODES) + " (any case; empty = unset)",
             "how the SGLang plugin drafts with a DFlash2 checkpoint (unset: lattice when it has a candidate "
             "selector, else marginal)", USER, DFLASH2_MODES),
    Variable(BUDGET, _served_budget, "auto", " | ".join(SERVED_BUDGETS) + " (any case; empty = auto)",
             "how the SGLang plugin sizes each round's trees: auto (the default) = one width "
             "per round for the batch, from the calibrated exit law and the measured round cost, at most N - 1 "
             "(0 = a plain decoding step; under TP rank 0's plan; CPU-verified; on CUDA target verify graphs per "
             "tree-size tier, SGLANG_TEV_GRAPH_TREE_SIZES, not run on a GPU yet); fixed = N - 1 nodes every round "
             "(what sglang-tev tune times); "
             "auto-ragged = auto with each request's tree cut to its own size within that width, verified in one "
             "ragged forward (tev_cpu, tested; FlashInfer, not run on a GPU; one width elsewhere)", USER, SERVED_BUDGETS),
    Variable(GRAPH_TREE_SIZES, _tree_sizes, None, "auto | off | comma-separated tree sizes in [1, N] (empty = auto)",
             "SGLANG_TEV_BUDGET=auto with CUDA graphs: the tree sizes (nodes per request, root included) whose "
             "target verify graphs are captured, each round's width one of them; auto = 1, 5, 9, 17, 33 below N; "
             "1 and N always added; off = the decode runs eagerly", USER),
    Variable(CACHE, _path, None, "a directory (empty = unset)",
             "where the native host helpers are built and the plan cache lives (plan/; unset: "
             "$XDG_CACHE_HOME/sglang_tev, else ~/.cache/sglang_tev)",
             USER),
    Variable(NATIVE, _native, True, "0 | false | no | off (any case) turn it off; anything else leaves it on",
             "build and use the native C host helpers (DDTree builder, greedy walk, KV move); off: the "
             "identical Python paths", USER),
    Variable(PLAN_CACHE, _native, True, "0 | false | no | off (any case) turn it off; anything else leaves it on",
             "budget=\"auto\" and SGLANG_TEV_BUDGET=auto keep what they learned (cost table, gains, reach "
             "calibration) per machine, model pair and dtype (a server: also TP size, backend, layout, N, K) "
             "under $SGLANG_TEV_CACHE/plan, so a fresh process or a restarted server starts from it", USER),
    Variable(REFERENCE_ATTENTION, _exactly_one, False, "1 = on; anything else off",
             "register the SGLang plugin's pure-torch tev_cpu attention backend on a GPU machine too "
             "(a reference for mask layouts)", USER),
    Variable(CPU_ATTN_IGNORE_MASK, _strict_flag, False, "0 | 1 (also false/no/off, true/yes/on; empty = 0)",
             "make tev_cpu ignore the tree mask on target verify: a negative control, never for serving", TESTING),
    Variable(CPU_HARNESS, _exactly_one, False, "1 = on; anything else off",
             "load the SGLang CPU test harness at interpreter start (sitecustomize on PYTHONPATH)", TESTING),
    Variable(TP_TRACE, _path, None, "a directory (empty = unset)",
             "the CPU harness records each scheduler process's TEV round decisions there", TESTING),
    Variable(SYNC_PROBE, _path, None, "a file (empty = unset)",
             "the CPU harness counts the host syncs of each decode step into this file", TESTING),
    Variable(PLAIN_STEPS, _exactly_one, False, "1 = on; anything else off",
             "the CPU harness (SGLANG_TEV_CPU_HARNESS=1; no effect elsewhere) plans every SGLANG_TEV_BUDGET=auto "
             "round as a plain step (tests; benchmarks/sglang_step_trace.py)", TESTING),
    Variable(RAGGED_CUTS, _exactly_one, False, "1 = on; anything else off",
             "the CPU harness (SGLANG_TEV_CPU_HARNESS=1; no effect elsewhere) cuts every "
             "SGLANG_TEV_BUDGET=auto-ragged tree round of two or more requests to per-request sizes of at "
             "least two values, whatever the clock says (tests of the ragged verify on the real Engine)", TESTING),
    Variable(STEP_TRACE, _path, None, "a file (empty = unset)",
             "the CPU harness (SGLANG_TEV_CPU_HARNESS=1; no effect elsewhere) appends one line per worker step "
             "(its times, mode, batch size, tokens) to this file (benchmarks/sglang_step_trace.py)", TESTING),
    Variable(KEEP_LOGS, _exactly_one, False, "1 = keep; anything else delete",
             "keep the log files of the SGLang hosts the tests start (deleted when a host closes otherwise)", TESTING),
    Variable(REQUIRE_SGLANG, _exactly_one, False, "1 = required; anything else not",
             "make the SGLang tests fail instead of skipping when sglang is not installed (CI sets it)", TESTING),
)

REGISTRY: dict[str, Variable] = {v.name: v for v in _VARIABLES}
"""Name -> :class:`Variable`, in ``docs/env.md``'s order."""


def names(audience: Optional[str] = None) -> tuple[str, ...]:
    """The registered names (of one audience, :data:`USER` or :data:`TESTING`, when given)."""
    return tuple(n for n, v in REGISTRY.items() if audience is None or v.audience == audience)


def _closest(name: str) -> Optional[str]:
    match = difflib.get_close_matches(name.upper(), list(REGISTRY), n=1, cutoff=0.6)
    return match[0] if match else None


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The typed value of a registered variable from ``environ`` (default ``os.environ``, read now).

    Raises:
        EnvError naming the variable and the accepted values, for a value its parser refuses.
        KeyError for a name that is not registered (a programming error; the message names the
        closest registered name).
    """
    var = REGISTRY.get(name)
    if var is None:
        close = _closest(name)
        raise KeyError(f"{name} is not a registered sglang-tev variable"
                       + (f"; did you mean {close}?" if close else ""))
    return var.read(environ)


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse an ``SGLANG_TEV_*`` name that the registry does not know.

    Names are compared in upper case (``sglang_tev_verifier`` is refused too, with the right
    spelling suggested). Values are not parsed here: each reader checks its own when it reads it.

    Args:
        environ: the mapping to check (default ``os.environ``).
    Raises:
        EnvError whose ``arg`` is the first unknown name (sorted), its message naming the closest
        known name and listing the known ones, e.g. ``SGLANG_TEV_VERIFER is not a known sglang-tev
        variable; did you mean SGLANG_TEV_VERIFIER? (known: ...)``; further unknown names are
        listed after it.
    """
    env = os.environ if environ is None else environ
    unknown = sorted(n for n in env if n.upper().startswith(PREFIX) and n not in REGISTRY)
    if not unknown:
        return
    name = unknown[0]
    close = _closest(name)
    message = "is not a known sglang-tev variable"
    if close:
        message += f"; did you mean {close}?"
    message += f" (known: {', '.join(REGISTRY)}; docs/env.md)"
    if len(unknown) > 1:
        message += f"; also unknown: {', '.join(unknown[1:])}"
    raise EnvError(name, message, suggestion=close)
