"""Drafters for tests: :class:`OracleDrafter` proposes the target's own greedy continuation with a
set accuracy, so tiny random models get long accepted paths (positions, compaction, context
gathering are exercised)."""

from __future__ import annotations

import torch

__all__ = ["OracleDrafter"]


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
    max_rows = None

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

    # ------------------------------------------------------------ BatchDrafter
    def start(self, rows: int, max_len: int, device) -> None:
        self.reset()

    def add_context(self, rows, features, positions) -> None:  # pragma: no cover - needs no features
        pass

    def move_row(self, src: int, dst: int, length: int) -> None:
        pass

    @torch.inference_mode()
    def draft_rows(self, rows, roots, root_pos, tokens, depth, max_root_pos) -> torch.Tensor:
        pos = root_pos.tolist()
        return torch.cat([self.draft(tokens[r: r + 1, : p + 1], None, depth) for r, p in enumerate(pos)], 0)
