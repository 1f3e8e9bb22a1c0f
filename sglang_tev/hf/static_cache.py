"""A static, preallocated KV cache with per-row lengths, and how a cache is handed to a
transformers model (:func:`cache_kwargs`, from :mod:`sglang_tev.compat`).

Layout: per target layer, keys and values ``[rows, kv_heads, max_len, head_dim]`` allocated once
(at the first write, when the head shapes are known). Row r holds the KV of positions
``[0, lengths[r])`` in slots ``[0, lengths[r])`` (slot = position). A forward writes its tokens at
slots given per row (:meth:`StaticKVCache.begin`) and attends over slots ``[0, kv_len)``; the
4-D mask (``hf/masks.py``) decides what each query sees, so rows of different lengths share one
forward. Nothing beyond a row's length is ever visible, so stale entries there need no clearing.

The round's commit moves each row's accepted tree nodes to the front of its tree window with one
gather per layer (:meth:`StaticKVCache.compact`); no ``torch.cat`` growth, no crop. The cache keeps
every position for every layer, sliding-window layers included (their masks hide what the window
excludes).
"""

from __future__ import annotations

import ctypes

import torch

from ..compat import cache_kwarg_name, cache_kwargs  # noqa: F401 - re-exported: their home was here
from ..native import native

__all__ = ["StaticKVCache", "row_grid", "write_slots", "cache_kwarg_name", "cache_kwargs"]


def row_grid(slots: torch.Tensor) -> torch.Tensor:
    """int64 [b, T]: row r's index at every one of its T slots (``arange(b)`` broadcast)."""
    b, t = slots.shape
    return torch.arange(b, device=slots.device).view(b, 1).expand(b, t)


def write_slots(dst: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """``dst[r, :, slots[r, j]] = values[r, :, j]`` for every row r and token j, in place.

    Args:
        dst: [b, heads, slots, head_dim] (a view of a cache buffer; any strides).
        slots: int64 [b, T], the slot of each row's token j (distinct within a row, or the
            duplicates' slot never read).
        values: [b, heads, T, head_dim].
        rows: :func:`row_grid` of ``slots`` when the caller writes several buffers at the same
            slots (made here otherwise).

    ``index_put_`` over the (row, slot) pairs: ``Tensor.scatter_`` with the same index expanded
    to ``values``' shape takes time in the buffer's length on CPU (torch 2.14: ~40 us against
    ~5 us per call at 8 rows, 277-352 slots, one token; ~1 ms against ~0.1 ms for a commit's
    gather + scatter over every layer).
    """
    dst.transpose(1, 2).index_put_((row_grid(slots) if rows is None else rows, slots), values.transpose(1, 2))


class StaticKVCache:
    """Preallocated per-layer KV buffers with per-row lengths; passed to a transformers model as its
    cache (it implements ``update``, the one call the attention layers make).

    Args:
        rows: batch capacity.
        max_len: slots per row (positions the row may ever hold, tree window included).
        num_layers: target layers.
        device, dtype: of the buffers.

    Before each forward call :meth:`begin` with the rows and the slots to write; the forward then
    sees ``[rows, kv_heads, kv_len, head_dim]`` views (no copy).
    """

    def __init__(self, rows: int, max_len: int, num_layers: int, device, dtype) -> None:
        self.rows, self.max_len, self.num_layers = rows, max_len, num_layers
        self.device, self.dtype = torch.device(device), dtype
        # one joint buffer [layers, 2 (k, v), rows, kv_heads, max_len, head_dim] for every layer of
        # layer 0's shape (one indexed read + one write commit them all); other shapes get their own
        self.kv: torch.Tensor | None = None
        self.extra: dict[int, torch.Tensor] = {}
        self._rows = slice(0, rows)
        self._slots: torch.Tensor | int = 0  # int: contiguous start for every row; tensor [b, T]
        self._kv_len = 0
        self._grids: dict[torch.Size, torch.Tensor] = {}  # row_grid by slots shape [b, T]

    def _layer_buf(self, layer_idx: int, key_states: torch.Tensor) -> torch.Tensor:
        """[2, rows, kv_heads, max_len, head_dim] of one layer, allocated at its first write."""
        shape = (self.rows, key_states.shape[1], self.max_len, key_states.shape[3])
        if self.kv is None:
            self.kv = torch.zeros((self.num_layers, 2, *shape), dtype=key_states.dtype, device=key_states.device)
        if tuple(self.kv.shape[2:]) == shape and layer_idx not in self.extra:
            return self.kv[layer_idx]
        if layer_idx not in self.extra:
            self.extra[layer_idx] = torch.zeros((2, *shape), dtype=key_states.dtype, device=key_states.device)
        return self.extra[layer_idx]

    # --------------------------------------------------------------- what the model calls
    def begin(self, rows: slice, slots: torch.Tensor | int, kv_len: int) -> None:
        """Set the rows of the next forward, where its T tokens go (an int start shared by all rows,
        or int64 slots [b, T]) and how many slots the attention reads (``kv_len``)."""
        self._rows, self._slots, self._kv_len = rows, slots, kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write the new K/V ``[b, kv_heads, T, head_dim]`` and return the views the attention reads."""
        buf = self._layer_buf(layer_idx, key_states)
        k, v = buf[0, self._rows], buf[1, self._rows]
        if isinstance(self._slots, int):
            t = key_states.shape[2]
            k[:, :, self._slots: self._slots + t] = key_states
            v[:, :, self._slots: self._slots + t] = value_states
        else:
            rows = self._grids.get(self._slots.shape)
            if rows is None:  # kept per shape: a captured graph reads the same tensor every replay
                rows = self._grids[self._slots.shape] = row_grid(self._slots)
            write_slots(k, self._slots, key_states, rows)
            write_slots(v, self._slots, value_states, rows)
        return k[:, :, : self._kv_len], v[:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def __len__(self) -> int:
        return self.num_layers

    def _buffers(self):
        """(tensor, number of leading dims before rows) of every buffer."""
        out = [] if self.kv is None else [(self.kv, 2)]
        return out + [(b, 1) for b in self.extra.values()]

    # --------------------------------------------------------------- the runtime's side
    def compact(self, rows: slice, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move slots ``src`` [b, W] to ``dst`` [b, W] of ``rows`` in every layer, keys and values
        at once: one indexed read and one indexed write over the joint buffer (the read copies
        first, so overlapping ranges are safe; indexing, not gather / scatter: see
        :func:`write_slots`)."""
        r = row_grid(src)
        for buf, lead in self._buffers():
            # [..., b, slots, kv_heads, head_dim]: the (row, slot) pairs index two adjacent dims
            x = buf[(slice(None),) * lead + (rows,)].transpose(lead + 1, lead + 2)
            pre = (slice(None),) * lead
            x[pre + (r, dst)] = x[pre + (r, src)]

    def compact_row(self, row: int, src: list[int], dst_start: int) -> None:
        """One row's commit: slots ``src`` (increasing, ``src[j] >= dst_start + j``: a path) move to
        ``[dst_start, dst_start + len(src))`` in every layer. On CPU one C call over every
        (layer, K/V, head) block (no tensor op); else an index_select and a slice copy."""
        w = len(src)
        move = native("kv_move") if self.device.type == "cpu" else None
        idx = None
        for buf, lead in self._buffers():
            x = buf[(slice(None),) * lead + (row,)]  # [..., kv_heads, max_len, head_dim]
            if move is not None and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
                es = x.element_size()
                pad = 3 - (x.dim() - 2)
                sizes = (1,) * pad + tuple(x.shape[:-2])
                strides = (0,) * pad + tuple(st * es for st in x.stride()[:-2])
                slots = (ctypes.c_int64 * w)(*src)
                move(x.data_ptr(), *sizes, *strides, x.shape[-1] * es, ctypes.addressof(slots), w, dst_start)
            else:
                if idx is None:
                    idx = torch.tensor(src, dtype=torch.int64, device=x.device)
                x[..., dst_start: dst_start + w, :] = x.index_select(lead + 1, idx)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` slots into row ``dst`` (a finished row's slot is reused)."""
        for buf, lead in self._buffers():
            pre = (slice(None),) * lead
            buf[pre + (dst, slice(None), slice(0, length))] = buf[pre + (src, slice(None), slice(0, length))]

    def row_kv(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(k, v)`` of one row, each ``[1, kv_heads, length, head_dim]`` (views)."""
        out = []
        for i in range(self.num_layers):
            buf = self.extra[i] if i in self.extra else self.kv[i]
            out.append((buf[0, row: row + 1, :, :length], buf[1, row: row + 1, :, :length]))
        return out
