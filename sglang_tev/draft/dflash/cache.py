"""The drafter's context-only K/V cache (:class:`DFlashDraftCache`)."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["DFlashDraftCache"]


class DFlashDraftCache:
    """Context-only K/V of the drafter, per layer ``(b, kv_heads, T, head_dim)`` after k_norm + RoPE.

    Holds exactly the context positions fed so far (the block's own K/V are never stored, as
    z-lab ``dflash_generate`` crops them right after the draft forward). Buffers grow by
    doubling, so appending a round's accepted tokens costs no full copy. All rows share one length.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._length = 0

    @property
    def length(self) -> int:
        """Number of cached context positions (tokens)."""
        return self._length

    def __len__(self) -> int:
        return self._length

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions; ``ValueError`` (argument ``n``) unless ``0 <= n <= length``."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._length:
            raise ValueError(f"n: must be an int in [0, {self._length}], got {n!r}")
        self._length = n

    def reset(self) -> None:
        """Drop everything (buffers included)."""
        self.__init__(self.num_layers)

    def layer(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views ``(k, v)`` of layer ``i``, each ``(b, kv_heads, length, head_dim)``; None if empty."""
        if self._length == 0:
            return None, None
        return self._keys[i][:, :, :self._length], self._values[i][:, :, :self._length]

    def extend(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append one ``(k, v)`` per layer, each ``(b, kv_heads, T_new, head_dim)``."""
        if len(kv) != self.num_layers:
            raise ValueError(f"kv: expected {self.num_layers} layers, got {len(kv)}")
        t_new = kv[0][0].shape[2]
        need = self._length + t_new
        for i, (k, v) in enumerate(kv):
            buf_k, buf_v = self._keys[i], self._values[i]
            if buf_k is not None and (buf_k.shape[0] != k.shape[0] or buf_k.shape[1] != k.shape[1]
                                      or buf_k.shape[3] != k.shape[3]):
                raise ValueError(f"cache: holds rows of shape {tuple(buf_k.shape[:2])}+"
                                 f"head_dim {buf_k.shape[3]}, got K of shape {tuple(k.shape)}")
            if buf_k is None or buf_k.shape[2] < need:
                cap = max(need, 2 * (buf_k.shape[2] if buf_k is not None else 0), 64)
                new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
                new_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
                if self._length:
                    new_k[:, :, :self._length] = buf_k[:, :, :self._length]
                    new_v[:, :, :self._length] = buf_v[:, :, :self._length]
                self._keys[i], self._values[i] = buf_k, buf_v = new_k, new_v
            buf_k[:, :, self._length:need] = k
            buf_v[:, :, self._length:need] = v
        self._length = need
