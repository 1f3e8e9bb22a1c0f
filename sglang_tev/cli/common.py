"""Helpers the ``sglang-tev`` commands share: the shipped model pair, model loading (``--target``,
``--draft``, ``--device``, ``--dtype``), the ``--output`` / prompt-file checks that run before
any model loads, and :class:`TextStreamer` (stdout of ``generate``).

torch is imported inside the functions that need it, never at import time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

from ..hf import assets as _assets  # no torch import
from ..paths import creatable_dir_problem
from .args import UsageError, _strip_name

ASSETS_DIR = _assets.ASSETS_DIR  # the shipped model pair; read by default_model_paths (tests patch it here)


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
    from ..hf.runtime import SpeculativeGenerator

    try:
        gen = SpeculativeGenerator.from_pretrained(target, draft, dtype=dtype, device=device)
    except (FileNotFoundError, ValueError, OSError) as e:
        msg = str(e)
        arg = "--target" if msg.startswith(("target:", "target ")) else "--draft"
        raise UsageError(arg, _strip_name(msg)) from None
    if gen.tokenizer is None:
        raise UsageError("--target", f"{target} has no tokenizer; text prompts need one")
    return gen


def _output_path(value: str | None, root: str) -> Path:
    """``--output`` as given, else ``root/<UTC time stamp>``."""
    return Path(value) if value else Path(root) / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _prompts_arg(arg: str, source: str, limit: int | None) -> list:
    """``load_prompts(source, limit)``; a missing, malformed or empty source is ``UsageError(arg)``."""
    from ..hf.datasets import load_prompts

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
