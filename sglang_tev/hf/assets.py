"""The model pair shipped in the package, by name, and quiet weight loading.

``SpeculativeGenerator.from_pretrained()`` (no arguments) or ``from_pretrained("tiny-code")``
loads the pair in ``sglang_tev/assets/tiny-code/{target,draft}`` (model card there: a 5.8 M
parameter Qwen3-architecture code model and a 2-layer DFlash drafter trained on the Python
standard library). No torch import here: the CLI's ``--help`` path uses it too.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Iterator

__all__ = ["ASSETS_DIR", "SHIPPED_PAIR", "shipped_pair", "resolve_pretrained", "quiet_loading", "shipped_pair_default"]

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-code"
SHIPPED_PAIR = "tiny-code"
"""The name that means the shipped pair (a local directory of that name wins, as in HF)."""


DEFAULT_DRAFT = "draft2"
"""The default drafter of the shipped pair: the DFlash2 drafter (it beat the DFlash drafter
``draft/`` by the rule stated in docs/tiny-code.md, "Stage draft2"). ``draft/`` (DFlash, ExitTrain-tuned)
and ``draft-base/`` ship beside it."""


def shipped_pair(root: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """(target, default drafter) directories of the shipped pair (``root`` default
    :data:`ASSETS_DIR`; the drafter is :data:`DEFAULT_DRAFT`).

    Raises:
        FileNotFoundError: the pair is not installed there.
    """
    root = Path(ASSETS_DIR if root is None else root)
    target, draft = root / "target", root / DEFAULT_DRAFT
    if not (target.is_dir() and draft.is_dir()):
        raise FileNotFoundError(f"the shipped model pair is not installed at {root} (expected target/ and "
                                f"{DEFAULT_DRAFT}/ there); pass target= and draft= directories")
    return target, draft


def resolve_pretrained(target, draft):
    """``(target, draft)`` for ``from_pretrained``: ``target`` None or ``"tiny-code"`` (when no
    local directory has that name) is the shipped target, and then ``draft`` None is the shipped
    drafter; ``draft=False`` means no drafter. Other values pass through unchanged."""
    if target is None or (isinstance(target, str) and target == SHIPPED_PAIR and not os.path.isdir(target)):
        shipped_target, shipped_draft = shipped_pair()
        return shipped_target, shipped_draft if draft is None else (None if draft is False else draft)
    return target, None if draft is False else draft


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Turn transformers' progress bars (e.g. "Loading weights") off for the block, then restore
    the caller's setting. Warnings and errors still go through transformers' logging."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def shipped_pair_default(fn):
    """Decorator of ``from_pretrained(cls, target=None, draft=None, **kw)``: resolves the shipped
    pair (:func:`resolve_pretrained`) and loads inside :func:`quiet_loading`."""

    @functools.wraps(fn)
    def wrapper(cls, target=None, draft=None, **kwargs):
        target, draft = resolve_pretrained(target, draft)
        with quiet_loading():
            return fn(cls, target, draft, **kwargs)

    return wrapper
