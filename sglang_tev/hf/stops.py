"""Stop handling (DESIGN §5): which tokens stop a request, the stop tokens the tree builder keeps
as leaves, and the cut of a round's emitted block after its first stop token or stop string
(inclusive) and at ``max_new_tokens``."""

from __future__ import annotations

from typing import Sequence

import torch

from .transfer import to_device

__all__ = ["stop_token_set", "leaf_tokens", "cut_block"]


def stop_token_set(stop_token_ids: Sequence[int] | None, ignore_eos: bool, target, tokenizer) -> set[int]:
    """The request's stop tokens: ``stop_token_ids`` plus, unless ``ignore_eos``, the EOS id(s)
    of the target's generation config, else the tokenizer's, else the model config's."""
    stops = set(int(t) for t in (stop_token_ids or []))
    if not ignore_eos:
        eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        if eos is None:
            eos = getattr(target.config, "eos_token_id", None)
        if isinstance(eos, int):
            stops.add(eos)
        elif eos is not None:
            stops.update(int(e) for e in eos)
    return stops


def leaf_tokens(stops: Sequence[set[int]], device) -> torch.Tensor | None:
    """int64 [b, S] of each row's stop tokens (sorted, padded with -1), the tokens the builder
    does not expand below; None when no row has one."""
    s = max(len(st) for st in stops)
    if s == 0:
        return None
    rows = [sorted(st) + [-1] * (s - len(st)) for st in stops]
    return to_device(rows, torch.int64, device)


def cut_block(block: list[int], so_far: list[int], stops: set[int], stop_strings: Sequence[str] | None,
              remaining: int, tokenizer) -> tuple[list[int], str | None]:
    """Cut a round's block at the first stop token / stop string (inclusive) and at the budget.

    Args:
        block: the round's tokens (accepted path, then the bonus token).
        so_far: the row's tokens emitted before this round.
        stops: stop token ids; stop_strings: stop strings (need ``tokenizer``).
        remaining: tokens the row may still emit (>= 1).
    Returns:
        (the kept tokens, finish reason: ``"stop"``, ``"length"`` or None to go on).
    """
    reason = None
    if len(block) >= remaining:
        block = block[:remaining]
        reason = "length"
    for i, tok in enumerate(block):
        if tok in stops:
            return block[: i + 1], "stop"
    if stop_strings:
        base = len(so_far)
        full = so_far + block
        # Decode only a window of recent tokens: an occurrence completed by token i ends in
        # it, and a character spans at most 4 byte-level tokens, so 4 * len + 8 tokens cover
        # it with room at the left edge (where a partial character or a tokenizer's stripped
        # leading space may differ from the full decode). Earlier occurrences would have
        # stopped earlier rounds. Cost per token: O(longest stop string), not O(output).
        window = 4 * max(len(s) for s in stop_strings) + 8
        for i in range(len(block)):
            end = base + i + 1
            text = tokenizer.decode(full[max(0, end - window): end], skip_special_tokens=False)
            if any(s in text for s in stop_strings):
                return block[: i + 1], "stop"
    return block, reason
