"""Generation controls applied at every tree node with that node's own prefix, and the round's
finiteness check.

Node v of a row's tree predicts the token after ``committed + path(v)``, where ``path(v)`` are the
drafted tokens on the way from the root to v (v included, root excluded: the root is already
committed). Every control below sees exactly that prefix, so the processed target law at v is the
one plain decoding with the same controls would use after that prefix, and every exact verifier
keeps the output law of plain decoding (DESIGN §1: exactness is w.r.t. the processed law).

Order (as transformers' processors, before the sampling law's warpers): repetition penalty, then
frequency and presence penalties, then logit bias, then the user's logits processor.

* ``repetition_penalty`` p (transformers ``RepetitionPenaltyLogitsProcessor``): for every token in
  the prompt or the output so far, ``logit / p`` if the logit is > 0, else ``logit * p``.
* ``frequency_penalty`` f, ``presence_penalty`` a (OpenAI / SGLang / vLLM): ``logit - f * c - a *
  (c > 0)``, c = count of the token among the tokens generated so far (prompt excluded).
* ``logit_bias`` {token id: bias}: added.
* ``logits_processor``: a transformers-style ``fn(input_ids int64 [n, L], scores float [n, V]) ->
  scores``, called once per (row, depth) with the prefixes of that depth's nodes (the slow path:
  O(rows x depth) calls per round).

The path counts (:func:`~sglang_tev.penalties.path_counts`) are shared with the SGLang plugin,
which applies SGLang's own penalty semantics on the same paths (``sglang_tev/penalties.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..penalties import path_counts
from ..tree import DraftTree
from .transfer import to_device

__all__ = ["Controls", "path_counts", "apply_controls"]

LogitsProcessorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Controls:
    """Per-request generation controls (defaults: none).

    Attributes:
        repetition_penalty: > 0; 1 = off.
        frequency_penalty, presence_penalty: floats; 0 = off.
        logit_bias: {token id: additive bias} or None.
        logits_processor: transformers-style ``fn(input_ids [n, L], scores [n, V]) -> scores`` or None.
    """

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None
    logits_processor: LogitsProcessorFn | None = None

    def validate(self, vocab_size: int) -> None:
        """ValueError naming the field for a value out of range."""
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or abs(x) == float("inf"):
                raise ValueError(f"{name} must be a finite number, got {x!r}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a dict {token id: bias}")
            for t, v in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                    raise ValueError(f"logit_bias: token id {t!r} is not in [0, {vocab_size})")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v == float("inf"):
                    raise ValueError(f"logit_bias: bias of token {t} must be a number < +inf, got {v!r}")
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise ValueError("logits_processor must be callable (input_ids, scores) -> scores")

    @property
    def penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def active(self) -> bool:
        return self.penalties or bool(self.logit_bias) or self.logits_processor is not None


def apply_controls(logits: torch.Tensor, tree: DraftTree, controls: list[Controls], gen_counts: torch.Tensor | None,
                   seen: torch.Tensor | None, bias: torch.Tensor | None, prefixes) -> torch.Tensor:
    """The controlled logits of every node.

    Args:
        logits: float32 [b, N, V] target logits of the tree nodes.
        controls: one :class:`Controls` per row.
        gen_counts: float32 [b, V] counts of the tokens each row generated so far (committed), or
            None when no row has frequency/presence penalties.
        seen: bool [b, V] tokens in each row's prompt or output so far, or None when no row has a
            repetition penalty.
        bias: float32 [b, V] logit bias per row, or None.
        prefixes: ``fn(row) -> int64 [L]`` committed tokens of a row (user processors only).
    Returns:
        float32 [b, N, V] (a new tensor when anything applies). No host sync except in user
        processors.
    """
    b, n, v = logits.shape
    dev = logits.device
    out = logits
    if gen_counts is not None or seen is not None:
        pc = path_counts(tree, v)
        out = out.clone()
        if seen is not None:
            p = to_device([c.repetition_penalty for c in controls], out.dtype, dev).view(b, 1, 1)
            present = seen.unsqueeze(1) | (pc > 0)
            scaled = torch.where(out > 0, out / p, out * p)
            out = torch.where(present, scaled, out)
        if gen_counts is not None:
            f = to_device([c.frequency_penalty for c in controls], out.dtype, dev).view(b, 1, 1)
            a = to_device([c.presence_penalty for c in controls], out.dtype, dev).view(b, 1, 1)
            cnt = gen_counts.unsqueeze(1) + pc
            out = out - f * cnt - a * (cnt > 0).to(out.dtype)
    if bias is not None:
        out = out + bias.unsqueeze(1)
    if any(c.logits_processor is not None for c in controls):
        out = out.clone() if out is logits else out
        depth = tree.depth.tolist()
        valid = tree.valid.tolist()
        for r, c in enumerate(controls):
            if c.logits_processor is None:
                continue
            base = prefixes(r)
            path = _paths(tree, r)
            by_depth: dict[int, list[int]] = {}
            for i in range(n):
                if valid[r][i]:
                    by_depth.setdefault(depth[r][i], []).append(i)
            for d, nodes in by_depth.items():
                ids = torch.stack([torch.cat([base, path[i]]) for i in nodes])
                idx = torch.tensor(nodes, device=dev)
                out[r, idx] = c.logits_processor(ids, out[r, idx]).to(out.dtype)
    return out


def _paths(tree: DraftTree, r: int) -> list[torch.Tensor]:
    """Drafted tokens from the root (excluded) to each node (included) of tree ``r``."""
    par = tree.parents[r].tolist()
    tok = tree.tokens[r]
    out: list[torch.Tensor] = [tok[:0]]
    for i in range(1, len(par)):
        out.append(torch.cat([out[par[i]] if par[i] > 0 else tok[:0], tok[i: i + 1]]))
    return out
