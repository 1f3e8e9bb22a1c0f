"""Training data for the DFlash objective: token sequences, loss masks, batches, anchors.

Sources (``data:`` / ``eval_data:`` of the run config):

* ``.npy`` — a 1-D array of token ids, documents joined by a separator (the target's EOS, e.g.
  ``scripts/build_tiny_code.py``'s ``train.npy``). Cut into consecutive non-overlapping windows
  of ``seq_len`` tokens (the last one shorter when the length is not a multiple; dropped if it
  is a single token); every token is supervised.
* ``.jsonl`` — one object per line with ``text`` (a document; tokenized, EOS appended, every
  token supervised, cut into windows of ``seq_len`` tokens like ``.npy``) or ``messages`` (a chat
  rendered with the tokenizer's chat template; only the assistant turns are supervised;
  truncated to ``seq_len`` tokens) or ``prompt_ids`` + ``response_ids`` (a target rollout,
  :mod:`.rollout`: only the response is supervised; truncated to ``seq_len`` tokens).

Determinism: the sample indices of step ``s`` are a pure function of ``(seed, s)`` (a seeded
permutation per epoch, :func:`batch_indices`), and so are the anchors (:func:`sample_anchors`
with :func:`anchor_keys`): this is what makes resume bit-identical on CPU.

**Anchor rule** (DESIGN §6; SpecForge ``OnlineDFlashModel._sample_anchor_positions``, tightened
to full blocks). In a sequence ``x[0:S]`` with loss mask ``m`` and separator ids ``sep``, position
``a`` is a valid anchor iff

1. ``1 <= a`` and ``a + K - 1 <= S - 1``: the context ``x[0:a]`` is non-empty and the whole
   block ``a .. a+K-1`` is inside the sequence;
2. ``m[a+1] .. m[a+K-1]`` are all True: every label of the block is supervised (the anchor
   itself need not be: in chat data the first round's root is the prompt's last token);
3. ``x[a] .. x[a+K-2]`` contain no separator: the block never runs past the end of a document (a
   separator may be the block's last label: the drafter learns to propose EOS).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

__all__ = ["TokenDataset", "load_dataset", "batch_indices", "collate", "valid_anchor_positions",
           "sample_anchors", "anchor_keys"]


@dataclass
class TokenDataset:
    """Token sequences with per-token loss masks.

    Attributes:
        sequences: int64 ``[L_i]`` each, ``2 <= L_i <= seq_len`` (npy: views of one array).
        loss_masks: bool ``[L_i]`` each (True = the token is a supervised label), or None when
            every token is supervised.
        seq_len: the window / truncation length in tokens.
        source: the file it came from.
    """

    sequences: list[torch.Tensor]
    loss_masks: list[torch.Tensor] | None
    seq_len: int
    source: str

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def _load_npy(path: Path, seq_len: int, key: str) -> TokenDataset:
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ValueError(f"{key}: {path} is not a readable .npy file ({e})") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{key}: {path} must hold a 1-D integer array of token ids, got "
                         f"{arr.dtype} {arr.shape}")
    if len(arr) < 2:
        raise ValueError(f"{key}: {path} holds {len(arr)} tokens; need at least 2")
    ids = torch.from_numpy(np.asarray(arr).astype(np.int64))
    windows = list(ids.split(seq_len))
    if len(windows[-1]) < 2:  # a lone trailing token has no label
        windows.pop()
    return TokenDataset(windows, None, seq_len, os.fspath(path))


def _assistant_spans(tokenizer, messages: list, key: str, lineno: int) -> tuple[str, list]:
    """Full chat text and the character spans of the assistant turns (prefix rendering)."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        before = render(messages[:i], True)
        upto = render(messages[:i + 1], False)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(f"{key}: line {lineno}: the tokenizer's chat template does not render "
                             "conversations prefix by prefix; cannot locate the assistant turns")
        spans.append((len(before), len(upto)))
    return full, spans


def jsonl_rows(path: Path, key: str):
    """``(line number, parsed object)`` of each non-blank line; ``ValueError`` naming ``key`` and
    the line for one that is not JSON."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{key}: line {lineno} of {path} is not JSON ({e})") from None


def _load_jsonl(path: Path, seq_len: int, tokenizer, key: str) -> TokenDataset:
    if tokenizer is None:
        raise ValueError(f"{key}: a .jsonl dataset needs the target's tokenizer, none was found")
    eos = tokenizer.eos_token_id
    seqs, masks = [], []
    for lineno, row in jsonl_rows(path, key):
        kinds = [k for k in ("text", "messages", "response_ids") if isinstance(row, dict) and k in row]
        if len(kinds) != 1:
            raise ValueError(f"{key}: line {lineno} of {path} must be an object with exactly "
                             "one of 'text', 'messages' or 'prompt_ids' + 'response_ids' (a rollout)")
        if "response_ids" in row:
            p_ids, r_ids = row.get("prompt_ids"), row["response_ids"]
            if not all(isinstance(x, list) and all(isinstance(t, int) and 0 <= t for t in x)
                       for x in (p_ids, r_ids)):
                raise ValueError(f"{key}: line {lineno}: 'prompt_ids' and 'response_ids' must be "
                                 "lists of token ids")
            ids = p_ids + r_ids
            mask = [False] * len(p_ids) + [True] * len(r_ids)
        elif "text" in row:
            if not isinstance(row["text"], str):
                raise ValueError(f"{key}: line {lineno}: 'text' must be a string")
            ids = list(tokenizer(row["text"], add_special_tokens=False, verbose=False)["input_ids"])  # packed later: no length warning
            if eos is not None:
                ids.append(eos)
            mask = [True] * len(ids)
        else:
            msgs = row["messages"]
            if not isinstance(msgs, list) or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
                    for m in msgs):
                raise ValueError(f"{key}: line {lineno}: 'messages' must be a list of "
                                 "{role, content} objects")
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"{key}: line {lineno}: chat 'messages' need a tokenizer "
                                 "with a chat template")
            text, spans = _assistant_spans(tokenizer, msgs, key, lineno)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            ids = list(enc["input_ids"])
            mask = [any(s <= a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
        # a document is cut into windows of seq_len; a conversation / rollout is truncated to one
        step = seq_len if "text" in row else max(len(ids), 1)
        for lo in range(0, len(ids), step):
            w_ids, w_mask = ids[lo:lo + seq_len], mask[lo:lo + seq_len]
            if len(w_ids) >= 2 and any(w_mask[1:]):
                seqs.append(torch.tensor(w_ids, dtype=torch.long))
                masks.append(torch.tensor(w_mask, dtype=torch.bool))
    if not seqs:
        raise ValueError(f"{key}: {path} holds no usable row (>= 2 tokens with a supervised label)")
    return TokenDataset(seqs, masks, seq_len, os.fspath(path))


def load_dataset(path: str | os.PathLike, seq_len: int, tokenizer=None,
                 key: str = "data") -> TokenDataset:
    """Load a ``.npy`` or ``.jsonl`` source (see the module docstring).

    Raises ``FileNotFoundError`` / ``ValueError`` whose message starts with ``key`` (the config
    key that named the file) for a missing file, an unknown suffix or malformed content.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{key}: no file at {os.fspath(p)!r}")
    if p.suffix == ".npy":
        return _load_npy(p, seq_len, key)
    if p.suffix == ".jsonl":
        return _load_jsonl(p, seq_len, tokenizer, key)
    raise ValueError(f"{key}: {os.fspath(p)!r} must end in .npy or .jsonl")


# -- batches -----------------------------------------------------------------------------------

_PERMS: dict[tuple[int, int, int], torch.Tensor] = {}


def _perm(seed: int, epoch: int, n: int) -> torch.Tensor:
    key = (seed, epoch, n)
    if key not in _PERMS:
        if len(_PERMS) > 4:
            _PERMS.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _PERMS[key] = torch.randperm(n, generator=g)
    return _PERMS[key]


def batch_indices(step: int, batch_size: int, n_samples: int, seed: int, rank: int = 0,
                  world_size: int = 1) -> list[int]:
    """Sample indices of ``rank``'s part of the global batch of ``step`` (0-based).

    The global batch of step ``s`` is positions ``s*B*W .. (s+1)*B*W - 1`` of the endless stream
    ``perm_0 ‖ perm_1 ‖ ...`` (``perm_e`` a permutation of the samples seeded by ``(seed, e)``);
    rank ``r`` takes positions ``r*B .. r*B+B-1`` of it. ``B = batch_size``, ``W = world_size``.
    """
    base = step * batch_size * world_size + rank * batch_size
    out = []
    for pos in range(base, base + batch_size):
        epoch, i = divmod(pos, n_samples)
        out.append(int(_perm(seed, epoch, n_samples)[i]))
    return out


def collate(ds: TokenDataset, indices: Sequence[int],
            pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad the chosen samples to the longest one.

    Returns ``(ids int64 [b, S'], loss_mask bool [b, S'])``, padding has mask False. Right padding
    needs no attention mask for a causal target: real positions never see it.
    """
    seqs = [ds.sequences[i] for i in indices]
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.bool)
    for r, (i, s) in enumerate(zip(indices, seqs)):
        ids[r, :len(s)] = s
        mask[r, :len(s)] = True if ds.loss_masks is None else ds.loss_masks[i]
    return ids, mask


# -- anchors -----------------------------------------------------------------------------------

def valid_anchor_positions(ids: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                           sep_ids: Sequence[int] = ()) -> torch.Tensor:
    """bool ``[b, S]``: positions that may anchor a training block (rule in the module docstring).

    ids : int64 ``[b, S]``; loss_mask : bool ``[b, S]``; block_size : K >= 2; sep_ids : the
    document separator ids (normally the target's EOS; empty: no separator rule).
    """
    b, S = ids.shape
    K = block_size
    out = torch.zeros(b, S, dtype=torch.bool, device=ids.device)
    if S - K < 1:
        return out
    a = torch.arange(1, S - K + 1, device=ids.device)           # candidate anchors
    sup = torch.nn.functional.pad(loss_mask.long().cumsum(1), (1, 0))  # sup[:, i] = Σ m[:i]
    ok = (sup[:, a + K] - sup[:, a + 1]) == K - 1                # m[a+1 .. a+K-1] all set
    if len(sep_ids):
        is_sep = torch.isin(ids, torch.tensor(list(sep_ids), dtype=ids.dtype, device=ids.device))
        sep = torch.nn.functional.pad(is_sep.long().cumsum(1), (1, 0))
        ok &= (sep[:, a + K - 1] - sep[:, a]) == 0               # no sep in x[a .. a+K-2]
    out[:, a] = ok
    return out


def anchor_keys(seed: int, step: int, batch_size: int, seq_len: int, rank: int = 0) -> torch.Tensor:
    """float32 ``[batch_size, seq_len]`` uniform keys of ``rank``'s rows at ``step``.

    Drawn from a CPU generator seeded by ``(seed, step)`` only: rows ``rank*B .. rank*B+B-1`` of
    the global ``[(rank+1)*B, seq_len]`` draw, so a sample's anchors do not depend on the world size.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 7919 + 17)
    return torch.rand((rank + 1) * batch_size, seq_len, generator=g)[rank * batch_size:]


def sample_anchors(valid: torch.Tensor, num_anchors: int,
                   keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num_anchors`` anchors per row, uniformly without replacement among valid positions.

    valid : bool ``[b, S]`` (:func:`valid_anchor_positions`); keys : float ``[b, >= S]`` i.i.d.
    uniform keys (:func:`anchor_keys`; the only randomness). Returns ``(anchors int64 [b, n],
    keep bool [b, n])`` with ``n = min(num_anchors, S)``, anchors sorted ascending within a row;
    ``keep`` is False for the slots a row could not fill (their anchor is some invalid position:
    exclude them). Source: SpecForge ``_sample_anchor_positions`` (random keys, take the
    smallest, sort).
    """
    b, S = valid.shape
    if keys.shape[0] != b or keys.shape[1] < S:
        raise ValueError(f"keys: expected ({b}, >= {S}), got {tuple(keys.shape)}")
    n = min(num_anchors, S)
    keys = keys[:, :S].to(valid.device)
    # invalid positions after every valid one, in a fixed order (keys in [2, 3))
    keys = torch.where(valid, keys, 2.0 + torch.arange(S, device=valid.device) / S)
    idx = keys.topk(n, dim=1, largest=False).indices
    anchors, _ = idx.sort(dim=1)
    return anchors, valid.gather(1, anchors)
