"""Drafters the transformers runtime can call.

A drafter maps the committed context to per-depth draft logits ``[1, H, V]`` for the next round
(DESIGN §5). The runtime calls :meth:`Drafter.draft` once per round with the round's root token and
the target features of the tokens committed since the last call; it never looks inside.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..draft.dflash import DFlashDraftModel

__all__ = ["Drafter", "DFlashDrafter", "OracleDrafter"]


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
    """The DFlash drafter with its context cache (z-lab ``dflash_generate`` draft step).

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


class OracleDrafter:
    """A test drafter that proposes the target's own greedy continuation with a set accuracy.

    At each depth the target's greedy next token (given the committed context and the oracle's
    own proposals so far) gets the top draft logit with probability ``accuracy``; otherwise a
    random other token does and the true one comes second. Used to exercise long accepted paths
    (positions, compaction, context gathering) with tiny random models.

    Args:
        target: HF causal LM (run without cache; meant for tiny models).
        vocab_size: V of the draft logits.
        accuracy: probability in [0, 1] that the true token ranks first at a depth.
        block_size: K.
        seed: RNG seed of the oracle's mistakes.
    """

    target_layer_ids = None

    def __init__(self, target, vocab_size: int, accuracy: float = 0.9, block_size: int = 8, seed: int = 0) -> None:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy must be in [0, 1], got {accuracy}")
        self.target = target
        self.vocab_size = vocab_size
        self.accuracy = accuracy
        self.block_size = block_size
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)

    @torch.inference_mode()
    def draft(self, committed: torch.Tensor, new_features: torch.Tensor | None, depth: int) -> torch.Tensor:
        seq = committed
        dev = committed.device
        out = torch.zeros(1, depth, self.vocab_size)
        for d in range(depth):
            nxt = int(self.target(seq).logits[0, -1].argmax())
            noise = torch.rand(self.vocab_size, generator=self.gen)
            if float(torch.rand((), generator=self.gen)) < self.accuracy:
                noise[nxt] = 3.0  # true token first
                guess = nxt
            else:
                guess = int(torch.randint(self.vocab_size - 1, (), generator=self.gen))
                guess += guess >= nxt  # any token but the true one
                noise[guess] = 3.0
                noise[nxt] = 2.0
            out[0, d] = noise * 4.0
            seq = torch.cat([seq, torch.tensor([[guess]], device=dev)], 1)
        return out.to(dev)
