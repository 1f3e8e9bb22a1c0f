"""Drafters the transformers runtime can call.

A drafter maps the committed context to per-depth draft logits for the next round (DESIGN §5).
Two interfaces:

* :class:`BatchDrafter` — what the batched runtime drives: slots (rows) with their own lengths,
  context features written at their positions, one draft call per round for all active rows.
  :class:`~sglang_tev.hf.dflash_runner.StaticDFlashDrafter` (the DFlash drafter over a static
  context cache) implements it (so does the tests' ``sglang_tev.testing.drafters.OracleDrafter``).
* :class:`Drafter` — one sequence at a time (``draft(committed, new_features, depth)``), kept for
  simple custom drafters; the runtime wraps it (:class:`SequenceDrafterAdapter`) and then runs
  batch size 1 only.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..draft.dflash import DFlashDraftModel

__all__ = ["Drafter", "BatchDrafter", "DFlashDrafter", "SequenceDrafterAdapter"]


class BatchDrafter(Protocol):
    """The batched runtime's drafter interface (rows = slots of the static batch).

    Attributes:
        block_size: K; a round drafts at most K - 1 depths.
        target_layer_ids: target layers whose outputs (HF ``hidden_states[id + 1]``) the drafter
            reads as context features, or None when it needs none.
        max_rows: largest batch it serves (None = any).
        reads_tokens: optional, default True; False when ``draft_rows`` never reads ``tokens``
            (the runtime then does not keep that buffer up to date).
        has_selector: optional, default False; True when the drafter also implements
            ``draft_lattice_rows(rows, roots, root_pos, tokens, depth, max_root_pos) ->
            SelectorLattice`` (a DFlash2 candidate lattice: ``candidate_ids`` int64 [b, depth, k],
            ``transition_logq`` float [b, depth, k, k]); the runtime's ``draft_mode="lattice"``
            calls it instead of ``draft_rows``
            (:class:`~sglang_tev.hf.dflash_runner.StaticDFlashDrafter` for DFlash2 checkpoints).
        partial_slots: optional, default False; True when ``draft_rows`` / ``draft_lattice_rows``
            also take ``slots=S`` (1 <= S <= depth) and then return the first S depths only (the
            block stays depth + 1 tokens); the runtime passes ``min(B, deepest depth cap)``.
    """

    block_size: int
    target_layer_ids: Sequence[int] | None
    max_rows: int | None

    def start(self, rows: int, max_len: int, device) -> None:
        """A new generation call: ``rows`` slots of up to ``max_len`` positions each."""

    def add_context(self, rows: slice, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Target features float [b, T, F] of committed tokens at int64 ``positions`` [b, T] (slots
        past a row's context may be padding; they are overwritten before they are ever read)."""

    def draft_rows(self, rows: slice, roots: torch.Tensor, root_pos: torch.Tensor, tokens: torch.Tensor,
                   depth: int, max_root_pos: int) -> torch.Tensor:
        """Draft logits float [b, H = depth, V]; row r's context is positions ``[0, root_pos[r])``.

        Args:
            roots: int64 [b], the root tokens; root_pos: int64 [b], their positions.
            tokens: int64 [b, max_len], committed tokens (row r valid on ``[0, root_pos[r]]``).
            max_root_pos: ``max(root_pos)`` on the host.
        """

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row ``src``'s first ``length`` context positions become row ``dst``'s."""


class Drafter(Protocol):
    """What the runtime needs from a drafter.

    Attributes:
        block_size: K; a round drafts at most K - 1 depths.
        target_layer_ids: target layers whose outputs (HF ``hidden_states[id + 1]``) the drafter
            reads as context features, or None when it needs none.
    """

    block_size: int
    target_layer_ids: Sequence[int] | None

    def reset(self) -> None:
        """Forget all context (a new sequence starts)."""

    def draft(self, committed: torch.Tensor, new_features: torch.Tensor | None, depth: int) -> torch.Tensor:
        """Draft logits of one round.

        Args:
            committed: int64 [1, L], every committed token; the last one is the round's root (at
                position L - 1, not yet seen by the target).
            new_features: float [1, T_new, F], target context features of the committed tokens
                that are new since the previous call (root excluded), or None.
            depth: H >= 1, depths to draft.
        Returns:
            float [1, H, V] untempered draft logits; row j is depth j + 1.
        """


class DFlashDrafter:
    """The DFlash drafter with its context cache (z-lab ``dflash_generate`` draft step), one
    sequence at a time: what a user hands to the runtime, and the one-sequence reference.

    :class:`~sglang_tev.hf.runtime.SpeculativeGenerator` does not call :meth:`draft`: it runs the
    same model as :class:`~sglang_tev.hf.dflash_runner.StaticDFlashDrafter`, the batched form
    over a static context cache (equal to one reference ``DFlashDraftCache`` per row:
    ``tests/runtime/test_dflash_runner_fused.py``).

    Args:
        model: a :class:`DFlashDraftModel`.
        target: the HF causal LM whose ``get_input_embeddings()`` and ``lm_head`` the drafter uses.
    """

    def __init__(self, model: DFlashDraftModel, target) -> None:
        self.model = model
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.block_size = model.block_size
        self.target_layer_ids = tuple(model.target_layer_ids)
        self.cache = model.new_cache()

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    @torch.inference_mode()
    def draft(self, committed: torch.Tensor, new_features: torch.Tensor | None, depth: int) -> torch.Tensor:
        root = committed[:, -1]
        root_pos = committed.shape[1] - 1
        return self.model.draft_logits(
            self.embed, self.lm_head, root, root_pos, new_features, self.cache, block_size=depth + 1
        )


class SequenceDrafterAdapter:
    """Runs a one-sequence :class:`Drafter` under the batched runtime (batch size 1 only): the
    target features of each committed stretch are kept until the next draft call."""

    max_rows = 1

    def __init__(self, drafter) -> None:
        self.inner = drafter
        self.block_size = drafter.block_size
        self.target_layer_ids = getattr(drafter, "target_layer_ids", None)
        self._pending: list[torch.Tensor] = []
        self._fed = 0

    def start(self, rows: int, max_len: int, device) -> None:
        self.inner.reset()
        self._pending, self._fed = [], 0

    def add_context(self, rows, features, positions) -> None:
        self._pending.append((features, positions))

    def move_row(self, src: int, dst: int, length: int) -> None:
        raise RuntimeError("a one-sequence drafter holds one row")

    def draft_rows(self, rows, roots, root_pos, tokens, depth, max_root_pos) -> torch.Tensor:
        feats = None
        if self._pending:  # keep the positions [fed, root_pos): padded slots past them are dropped
            got = torch.cat([f for f, _ in self._pending], 1)
            pos = torch.cat([p for _, p in self._pending], 1)[0]
            keep = (pos >= self._fed) & (pos < max_root_pos)
            order = pos[keep].argsort(stable=True)
            feats = got[:, keep][:, order]
            # later writes to a position win, as in a cache
            p = pos[keep][order]
            last = torch.ones_like(p, dtype=torch.bool)
            last[:-1] = p[1:] != p[:-1]
            feats = feats[:, last]
            self._pending = []
        self._fed = max_root_pos
        return self.inner.draft(tokens[:, : max_root_pos + 1], feats, depth)
