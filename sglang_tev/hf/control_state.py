"""The committed-token state the generation controls (``hf/controls.py``) read, one row per batch
slot: tokens seen so far (prompt included; repetition penalty), counts of the generated tokens
(frequency and presence penalties) and the logit-bias rows. A buffer exists only when some
request of the call uses it. The scheduler starts and moves rows; the round's commit records the
emitted tokens and its verify stage applies the controls."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from .controls import Controls, apply_controls
from .transfer import to_device

__all__ = ["ControlState"]


class ControlState:
    """Per-slot control buffers of one call.

    Args:
        controls: every request's :class:`Controls` (decides which buffers exist).
        cap: batch slots; vocab_size: V; device.

    Attributes:
        active: some request has a control (the round then applies them at every node).
        seen: bool [cap, V] or None; counts: float32 [cap, V] or None; bias: float32 [cap, V] or None.
    """

    def __init__(self, controls: list[Controls], cap: int, vocab_size: int, device) -> None:
        self.device = device
        self.active = any(c.active for c in controls)
        use_seen = any(c.repetition_penalty != 1.0 for c in controls)
        use_counts = any(c.frequency_penalty != 0.0 or c.presence_penalty != 0.0 for c in controls)
        use_bias = any(c.logit_bias for c in controls)
        self.seen = torch.zeros(cap, vocab_size, dtype=torch.bool, device=device) if use_seen else None
        self.counts = torch.zeros(cap, vocab_size, dtype=torch.float32, device=device) if use_counts else None
        self.bias = torch.zeros(cap, vocab_size, dtype=torch.float32, device=device) if use_bias else None

    def start_row(self, slot: int, prompt_ids: list[int], controls: Controls) -> None:
        """A new request in ``slot``: its prompt is seen, nothing generated, its logit bias set."""
        dev = self.device
        if self.seen is not None:
            self.seen[slot] = False
            self.seen[slot, to_device(prompt_ids, torch.int64, dev)] = True
        if self.counts is not None:
            self.counts[slot] = 0
        if self.bias is not None:
            self.bias[slot] = 0
            if controls.logit_bias:
                self.bias[slot, to_device(list(controls.logit_bias), torch.int64, dev)] = to_device(
                    list(controls.logit_bias.values()), torch.float32, dev)

    def move_row(self, src: int, dst: int) -> None:
        """The row in slot ``src`` moves to slot ``dst``."""
        for buf in (self.seen, self.counts, self.bias):
            if buf is not None:
                buf[dst] = buf[src]

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, b: int) -> None:
        """The round emitted ``tokens`` int64 [m] in rows ``slots`` int64 [m] (of the first b slots)."""
        if self.counts is not None:
            self.counts[:b].index_put_((slots, tokens), torch.ones(len(tokens), device=self.device), accumulate=True)
        if self.seen is not None:
            self.seen[slots, tokens] = True

    def apply(self, logits: torch.Tensor, tree: DraftTree, controls: list[Controls], prefixes) -> torch.Tensor:
        """The controlled logits float32 [b, N, V] of every node (:func:`~sglang_tev.hf.controls.apply_controls`
        with the first b slots' buffers; ``prefixes(i)`` gives row i's committed tokens)."""
        b = logits.shape[0]
        return apply_controls(logits, tree, controls, self.counts[:b] if self.counts is not None else None,
                              self.seen[:b] if self.seen is not None else None,
                              self.bias[:b] if self.bias is not None else None, prefixes)
