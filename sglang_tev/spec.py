"""The decode spec: every name, letter and limit of sglang-tev written once (DESIGN §2-§3).

Torch-free (standard library only), so the command line, the SGLang plugin's start-up checks and
config parsers read the same values without importing torch. Every other module imports these;
none writes its own copy.

Letters, as the code and docs use them:

=====  =================================================================================
``b``  rows of a batch (requests decoded together)
``N``  nodes of a draft tree, root included: ``N = 1 + B``
``V``  vocabulary size of the target (the drafter shares the target's head)
``K``  block size of the DFlash drafter: one root + ``K - 1`` mask slots per draft forward
``B``  budget: non-root nodes of a DDTree (0 = a plain decoding step)
``H``  drafted depths (draft rows ``[b, H, .]``, row j = depth j + 1), ``H <= K - 1``
``D``  a tree's depth: its deepest node (``DraftTree.max_depth``), ``D <= min(B, H)``
``k``  per-depth top-k candidates the builder reads
=====  =================================================================================

The hidden size has no letter: it is spelled ``hidden`` (``[b, S, hidden]``).
"""

from __future__ import annotations

import numbers
from typing import Sequence

__all__ = [
    "GREEDY_EPS",
    "MAX_BUDGET",
    "MAX_TREE_SIZE",
    "SGLANG_MAX_TREE_SIZE",
    "AUTO",
    "VERIFIERS",
    "SERVED_VERIFIERS",
    "GENERATION_METHODS",
    "DRAFT_MODES",
    "TREE_MODES",
    "SpecError",
    "is_greedy",
    "is_scalar_greedy",
    "greedy_temperature",
    "resolve_draft_mode",
    "num_uniforms",
    "check_budget",
]

GREEDY_EPS = 1e-5
"""Temperatures below this are greedy: the target law is one-hot at the argmax (ties -> lowest id),
and every verifier reduces to argmax-follow (DESIGN §1)."""

MAX_BUDGET = 1024
"""Largest DDTree budget B (non-root nodes) anywhere in the project: the builder holds
B x min(B, V) candidates, and SGLang's tree kernels take one CUDA block per request. Cost tables
and the trainer's budgets obey it too."""

MAX_TREE_SIZE = MAX_BUDGET + 1
"""Largest tree N = 1 + B (root included) of the transformers runtime."""

SGLANG_MAX_TREE_SIZE = MAX_BUDGET
"""Largest ``--speculative-num-draft-tokens`` (N, root included) under SGLang: its tree kernels
(``tree.cuh``) run one thread per node in one CUDA block of at most 1,024 threads, so B <= 1023
there. Deliberately one below :data:`MAX_TREE_SIZE`: a hardware limit of SGLang's, not ours."""

AUTO = "auto"
"""The budget (and draft mode) that the runtime chooses itself."""

VERIFIERS = ("tev", "predraw", "sequential", "greedy")
"""Verifiers of :func:`sglang_tev.verify_tree`. ``greedy`` is exact only when every row is greedy."""

SERVED_VERIFIERS = ("tev", "predraw", "sequential")
"""Verifiers the SGLang plugin serves (``SGLANG_TEV_VERIFIER``); greedy rows take argmax-follow
inside each of them."""

GENERATION_METHODS = ("autoregressive", "chain", *VERIFIERS)
"""Methods of the transformers runtime: plain decoding, the linear DFlash block (``chain``), and a
DDTree verified by one of :data:`VERIFIERS`."""

DRAFT_MODES = (AUTO, "lattice", "marginal")
"""How a round drafts its tree: ``marginal`` (per-depth laws, DDTree), ``lattice`` (the DFlash2
selector's candidate lattice), ``auto`` (lattice iff the drafter has a candidate selector)."""

TREE_MODES = ("marginal", "lattice", "chain")
"""Trees the trainer and ``eval-drafter`` measure and train on (``chain`` here is a tree shape,
the per-depth argmax path; in the runtime ``chain`` is a method)."""

_UNIFORMS_PER_TREE = {"tev": 2, "greedy": 0}  # tev: exit draw + bonus draw; greedy: none
_UNIFORMS_PER_NODE = ("predraw", "sequential")  # one uniform per node (U = N)


class SpecError(ValueError):
    """A bad value of one named argument.

    ``arg`` is the argument's name as the Python API spells it (``budget``, ``draft_mode``, ...);
    the command line maps it to its flag (``--budget``) from this attribute, never from the
    message's words. A ``ValueError``, so callers that catch ``ValueError`` keep working; ``str``
    of the error is ``"{arg} {message}"`` (``budget must be <= 1024, got 2000``).
    """

    def __init__(self, arg: str, message: str) -> None:
        self.arg = arg
        self.message = message
        super().__init__(f"{arg} {message}")


def is_greedy(temperature) -> bool:
    """Whether a scalar temperature means greedy decoding (``temperature < GREEDY_EPS``).

    Args:
        temperature: a Python number (or anything ``float()`` takes: a 0-d tensor, a NumPy scalar).
            Per-row tensors are decided by :meth:`sglang_tev.SamplingParams.greedy_mask`, which
            applies this same threshold.
    """
    return float(temperature) < GREEDY_EPS


def is_scalar_greedy(temperature) -> bool:
    """Host-side, no device sync: ``temperature`` is a Python number below :data:`GREEDY_EPS`.
    A tensor (per-row temperatures) gives False: its rows are decided on the device by
    :meth:`sglang_tev.SamplingParams.greedy_mask`."""
    return isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and temperature < GREEDY_EPS


def greedy_temperature(temperature: float) -> float:
    """``0.0`` for a greedy temperature, the temperature itself otherwise (one key per target law)."""
    return 0.0 if is_greedy(temperature) else float(temperature)


def resolve_draft_mode(draft_mode: str, has_selector: bool, *, arg: str = "draft_mode",
                       modes: Sequence[str] = DRAFT_MODES, lattice_error: str | None = None) -> str:
    """The draft mode a call runs: ``auto`` -> ``lattice`` iff the drafter has a DFlash2 candidate
    selector, else ``marginal``; any other mode as given.

    Args:
        draft_mode: one of ``modes`` (default :data:`DRAFT_MODES`).
        has_selector: the drafter has a candidate selector (``selector_rank`` in its config).
        arg: the argument's name for errors (``draft_mode``, ``mode``, ``SGLANG_TEV_DFLASH2_MODE``).
        modes: the accepted names (the trainer also takes ``chain``).
        lattice_error: the message for ``lattice`` without a selector (each caller names its own
            way out); a generic one when None.
    Raises:
        SpecError naming ``arg``: an unknown mode, or ``lattice`` without a selector.
    """
    if draft_mode not in modes:
        raise SpecError(arg, f"must be one of {tuple(modes)}, got {draft_mode!r}")
    if draft_mode == AUTO:
        return "lattice" if has_selector else "marginal"
    if draft_mode == "lattice" and not has_selector:
        raise SpecError(arg, lattice_error or "'lattice' needs a DFlash2 drafter with a candidate selector (config "
                                              "selector_rank / selector_top_k); this drafter has none: use 'marginal' "
                                              "or 'auto'")
    return draft_mode


def num_uniforms(method: str, num_nodes: int) -> int:
    """How many float64 uniforms one tree of ``num_nodes`` nodes consumes under ``method``:
    ``tev`` 2 (exit draw, bonus draw), ``predraw`` and ``sequential`` N (one per node), ``greedy`` 0.

    Raises:
        SpecError naming ``method``: not one of :data:`VERIFIERS`.
    """
    if method in _UNIFORMS_PER_TREE:
        return _UNIFORMS_PER_TREE[method]
    if method in _UNIFORMS_PER_NODE:
        return int(num_nodes)
    raise SpecError("method", f"must be one of {VERIFIERS}, got {method!r}")


def check_budget(budget, *, arg: str = "budget", allow_auto: bool = True, low: int = 0) -> None:
    """Check one budget value: ``"auto"`` (when allowed) or an int in ``[low, MAX_BUDGET]``.

    Raises:
        SpecError naming ``arg``.
    """
    if allow_auto and isinstance(budget, str) and budget == AUTO:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < low:
        what = f"'auto' or an int >= {low}" if allow_auto else f"an int >= {low}"
        raise SpecError(arg, f"must be {what}, got {budget!r}")
    if budget > MAX_BUDGET:
        raise SpecError(arg, f"must be <= {MAX_BUDGET} (the builder holds budget x min(budget, V) candidates), "
                             f"got {budget}")
