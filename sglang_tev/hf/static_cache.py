"""A static, preallocated KV cache with per-row lengths, and the attention masks that go with it.

Layout: per target layer, keys and values ``[rows, kv_heads, max_len, head_dim]`` allocated once
(at the first write, when the head shapes are known). Row r holds the KV of positions
``[0, lengths[r])`` in slots ``[0, lengths[r])`` (slot = position). A forward writes its tokens at
slots given per row (:meth:`StaticKVCache.begin`) and attends over slots ``[0, kv_len)``; the
4-D mask decides what each query sees, so rows of different lengths share one forward. Nothing
beyond a row's length is ever visible, so stale entries there need no clearing.

The round's commit moves each row's accepted tree nodes to the front of its tree window with one
gather per layer (:meth:`StaticKVCache.compact`); no ``torch.cat`` growth, no crop.

Attention windows (DESIGN §5; issue 11 item 1): the target's ``layer_types`` (``full_attention``,
``sliding_attention``) and ``sliding_window`` (a query at position q sees keys at positions p with
``q - p < sliding_window``, as transformers' ``sliding_window_overlay``) are applied in the mask
per layer type; the cache keeps every position for every layer (the mask hides what a window
excludes), so commit never indexes a trimmed cache.
"""

from __future__ import annotations

import ctypes

import torch

from ..draft.host_native import native

__all__ = ["StaticKVCache", "AttentionLayout", "attention_layout"]


class AttentionLayout:
    """Which mask each target layer needs.

    Attributes:
        windows: dict layer type -> window (None = full attention), one entry per distinct type.
        per_type: True when the model takes a dict ``{layer type: mask}`` (mixed layer types).
    """

    def __init__(self, windows: dict[str, int | None], per_type: bool) -> None:
        self.windows = windows
        self.per_type = per_type


_SUPPORTED_TYPES = ("full_attention", "sliding_attention")


def attention_layout(config) -> AttentionLayout:
    """The attention layout of a transformers config.

    ``layer_types`` when the config has it (Qwen2/3, Gemma 2/3, ...), else every layer full, or
    every layer windowed when ``sliding_window`` is set without layer types (Mistral).

    Raises:
        ValueError naming ``target``: a layer type other than full or sliding attention (chunked,
        linear, ...), or a sliding layer without a positive ``sliding_window``.
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        if window is not None and getattr(config, "use_sliding_window", True):
            return AttentionLayout({"sliding_attention": int(window)}, per_type=False)
        return AttentionLayout({"full_attention": None}, per_type=False)
    kinds = sorted(set(types))
    for t in kinds:
        if t not in _SUPPORTED_TYPES:
            raise ValueError(f"target: layer type {t!r} (config.layer_types) is not supported by the tree runtime; "
                             f"supported: {_SUPPORTED_TYPES}")
    if "sliding_attention" in kinds and (window is None or int(window) < 1):
        raise ValueError(f"target: sliding_attention layers need config.sliding_window >= 1, got {window!r}")
    windows = {t: (int(window) if t == "sliding_attention" else None) for t in kinds}
    return AttentionLayout(windows, per_type=len(kinds) > 1)


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
        # layer 0's shape (one gather + one scatter commit them all); other shapes get their own
        self.kv: torch.Tensor | None = None
        self.extra: dict[int, torch.Tensor] = {}
        self._rows = slice(0, rows)
        self._slots: torch.Tensor | int = 0  # int: contiguous start for every row; tensor [b, T]
        self._kv_len = 0

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
            idx = self._slots[:, None, :, None]
            k.scatter_(2, idx.expand_as(key_states), key_states)
            v.scatter_(2, idx.expand_as(value_states), value_states)
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
        at once: one gather and one scatter over the joint buffer (the gather copies first, so
        overlapping ranges are safe)."""
        b, w = src.shape
        for buf, lead in self._buffers():
            x = buf[(slice(None),) * lead + (rows,)]
            shape = (*x.shape[:lead], b, x.shape[lead + 1], w, x.shape[-1])
            view = (1,) * lead + (b, 1, w, 1)
            moved = x.gather(lead + 2, src.view(view).expand(shape))
            x.scatter_(lead + 2, dst.view(view).expand(shape), moved)

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


def tree_masks(layout: AttentionLayout, lengths: torch.Tensor, depth: torch.Tensor, ancestor: torch.Tensor,
               kv_len: int):
    """Bool masks (True = attend) of tree queries over ``[cached context | tree window]``.

    Args:
        lengths: int64 [b], cached positions per row (the tree of row r sits in slots
            ``lengths[r] + [0, N)``, its root at position ``lengths[r]``).
        depth: int64 [b, N]; ancestor: bool [b, N, N] (self included), from the DraftTree.
        kv_len: slots the attention reads (>= max(lengths) + N).
    Returns:
        one bool tensor [b, 1, N, kv_len], or a dict layer type -> mask when the layout is mixed.

    A node at depth d sits at position ``lengths + d`` and sees the context, its ancestors and
    itself; in a window W only keys at positions p with ``position - p < W`` (a tree key at depth
    d' is at ``lengths + d'``). No host sync.
    """
    b, n = depth.shape
    dev = depth.device
    col = torch.arange(kv_len, device=dev).view(1, 1, kv_len)
    base = lengths.view(b, 1, 1)
    j = col - base  # tree slot index of each column (negative: context)
    in_tree = (j >= 0) & (j < n)
    jc = j.clamp(0, n - 1).expand(b, n, kv_len)
    vis = (col < base) | (in_tree & ancestor.gather(2, jc))
    out = {}
    for kind, window in layout.windows.items():
        if window is None:
            out[kind] = vis.unsqueeze(1)
        else:
            kpos = torch.where(in_tree, base + depth.gather(1, jc[:, 0, :]).unsqueeze(1), col)  # [b, 1, kv_len]
            qpos = base + depth.unsqueeze(-1)  # [b, N, 1]
            out[kind] = (vis & (qpos - kpos < window)).unsqueeze(1)
    return out if layout.per_type else next(iter(out.values()))


def prefill_masks(layout: AttentionLayout, lengths: torch.Tensor, t: int):
    """Bool causal masks [b, 1, t, t] of a ragged prefill (row r's tokens at positions
    ``[0, lengths[r])``, padded to ``t``; a padded query sees only keys of its own row's prefix and
    itself, so no row of the mask is empty)."""
    dev = lengths.device
    q = torch.arange(t, device=dev).view(1, t, 1)
    k = torch.arange(t, device=dev).view(1, 1, t)
    base = (k <= q) & ((k < lengths.view(-1, 1, 1)) | (k == q))
    out = {}
    for kind, window in layout.windows.items():
        out[kind] = (base if window is None else base & (q - k < window)).unsqueeze(1)
    return out if layout.per_type else next(iter(out.values()))
