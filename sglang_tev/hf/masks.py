"""Attention masks of the target's forwards: which mask each layer needs (its attention window),
the ragged prefill's causal masks, the tree masks of a round's forward, their format for the
attention implementation, and the full-attention tree mask kept in one buffer across rounds.

Attention windows (DESIGN §5): the target's ``layer_types`` (``full_attention``,
``sliding_attention``) and ``sliding_window`` (a query at position q sees keys at positions p with
``q - p < sliding_window``, as transformers' ``sliding_window_overlay``) are applied in the mask
per layer type; the cache keeps every position for every layer (the mask hides what a window
excludes), so commit never indexes a trimmed cache.
"""

from __future__ import annotations

import torch

from ..native import native
from ..tree import DraftTree, additive_mask

__all__ = ["AttentionLayout", "attention_layout", "prefill_masks", "tree_masks", "attention_mask_format",
           "KEPT_MASK_MAX_ROWS", "KeptTreeMask"]


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


def attention_mask_format(masks, additive_dtype: torch.dtype | None):
    """Bool masks (a tensor or a dict per layer type) as the attention implementation wants them:
    unchanged for SDPA (``additive_dtype`` None), HF's additive float mask of that dtype for eager."""
    if additive_dtype is None:
        return masks
    if isinstance(masks, dict):
        return {k: attention_mask_format(v, additive_dtype) for k, v in masks.items()}
    return additive_mask(masks, additive_dtype)


KEPT_MASK_MAX_ROWS = 4
"""Batches of at most this many rows update one kept tree-mask buffer in place (per row one C
call, or two slice writes); larger ones build the mask in one vectorised pass (:func:`tree_masks`)."""


class KeptTreeMask:
    """The full-attention tree mask (as :func:`tree_masks`) as HF's additive float mask (0 =
    attend, ``finfo.min`` = masked), kept in one buffer [cap, 1, N, max_len] and updated in place
    as the reference keeps its mask: per row, the columns that became context since its last round
    are zeroed and its tree window gets the ancestor mask (one C call on CPU float32, else a fill
    and a ``where``). Columns past a row's window were never opened for it (rows only grow), so
    they stay masked; a slot that changes hands is reset first. Float, so SDPA does not convert a
    bool mask in every layer.

    Args:
        cap: batch slots; max_len: slots per row; dtype: the target's float dtype; device.
    """

    def __init__(self, cap: int, max_len: int, dtype: torch.dtype, device) -> None:
        self.cap, self.max_len, self.dtype, self.device = cap, max_len, dtype, device
        self.buf: torch.Tensor | None = None  # allocated at the first round (N known)
        self.slots: list = []  # per slot: (row object it was written for, context columns set)
        self._by_n: dict = {}  # the buffers of other tree widths N (budget="auto"), with their slots

    def update(self, tree: DraftTree, rows: list, kv_len: int) -> torch.Tensor:
        """The mask [b, 1, N, kv_len] of ``tree`` (b = len(rows), row i in slot i; each row has
        ``past_len``), written into the buffer. No host sync."""
        b, n = tree.parents.shape
        if self.buf is None or self.buf.shape[2] != n:
            if self.buf is not None:  # budget="auto" changes N between rounds: one buffer per N
                self._by_n[self.buf.shape[2]] = (self.buf, self.slots)
            if n in self._by_n:
                self.buf, self.slots = self._by_n.pop(n)
            else:
                dt = self.dtype
                low = torch.finfo(dt).min
                self.buf = torch.full((self.cap, 1, n, self.max_len), low, dtype=dt, device=self.device)
                self.slots = [(None, 0)] * self.cap
                self._vals = (torch.zeros((), dtype=dt, device=self.device), torch.full((), low, dtype=dt, device=self.device), low)
        buf = self.buf
        zero, low, low_f = self._vals  # 0-d tensors for torch.where; the Python float for C
        anc = tree.ancestor_mask
        update = None
        if buf.device.type == "cpu" and buf.dtype == torch.float32 and anc.is_contiguous():
            update = native("mask_update")  # one C call per row: no tensor op
        for i, r in enumerate(rows):
            owner, done = self.slots[i]
            L = r.past_len
            if owner is not r or done > L:
                buf[i].fill_(low_f)
                done = 0
            if update is not None:
                update(buf.data_ptr() + buf.element_size() * i * buf.stride(0), n, self.max_len, done, L,
                       anc.data_ptr() + i * n * n, low_f)
            else:
                if L > done:
                    buf[i, 0, :, done:L] = 0
                torch.where(anc[i], zero, low, out=buf[i, 0, :, L: L + n])
            self.slots[i] = (r, L)
        return buf[:b, :, :, :kv_len]
