"""History-dependent penalties at every tree node: the tokens on each node's path, and SGLang's
penalty law applied per node (pure torch; shared by both runtimes).

Node v of a tree predicts the token after ``committed + path(v)``, where ``path(v)`` are the
drafted tokens from the root's child down to v (v included; the root is the last committed token
and is already part of the history). A penalty that depends on the tokens generated so far is
therefore a different function at every node; the processed target law at v must be the one plain
decoding would use after that history (DESIGN §1: exactness is w.r.t. the processed law). Both
runtimes keep the committed counts themselves and add the path's tokens here:

* :func:`path_tokens` / :func:`path_counts`: the path's tokens of every node (the transformers
  runtime's ``hf/controls.py`` turns them into dense counts, in transformers' semantics);
* :func:`apply_sglang_penalties`: SGLang 0.5.23's penalty math (``sglang/srt/sampling/penaltylib``)
  on the committed state SGLang's own penalizers keep, plus each node's path (the SGLang plugin,
  ``srt/penalties.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .tree import DraftTree

__all__ = ["path_tokens", "path_counts", "path_multiplicity", "apply_sglang_penalties"]


def path_tokens(tree: DraftTree) -> torch.Tensor:
    """The drafted tokens on the path of every node.

    Args:
        tree: b trees of N nodes.
    Returns:
        int64 [b, N, W], W = ``max(tree.max_depth, 1)`` (0 for a root-only tree): entry k of node v
        is the token of v's k-th ancestor-or-self (k = 0: v itself) for k < depth(v), else -1. The
        root has no entries; a padded node (depth 1) has its own token only. W gathers, no host
        sync.
    """
    b, n = tree.parents.shape
    width = max(tree.max_depth, 1 if n > 1 else 0)
    out = torch.full((b, n, width), -1, dtype=torch.int64, device=tree.device)
    if width == 0:
        return out
    par = tree.parents.clamp(min=0)  # the root points at itself
    cur = torch.arange(n, device=tree.device).expand(b, n)
    for k in range(width):
        out[:, :, k] = torch.where(tree.depth > k, torch.gather(tree.tokens, 1, cur), -1)
        cur = torch.gather(par, 1, cur)
    return out


def path_counts(tree: DraftTree, vocab_size: int) -> torch.Tensor:
    """float32 [b, N, V]: how often each token occurs on the path from the root (excluded) to each
    node (included). Padded nodes count their own token only (their rows are never used).
    Token ids are clamped to [0, V)."""
    b, n = tree.parents.shape
    tok = path_tokens(tree)
    counts = torch.zeros(b, n, vocab_size, dtype=torch.float32, device=tree.device)
    counts.scatter_add_(2, tok.clamp(0, vocab_size - 1), (tok >= 0).to(torch.float32))
    return counts


def path_multiplicity(tok: torch.Tensor) -> torch.Tensor:
    """int64 [b, N, W]: for each entry of :func:`path_tokens`, how often its token occurs on that
    node's path (0 for the -1 entries)."""
    on = tok >= 0
    same = (tok.unsqueeze(-1) == tok.unsqueeze(-2)) & on.unsqueeze(-1) & on.unsqueeze(-2)
    return same.sum(-1)


def apply_sglang_penalties(
    logits: torch.Tensor,
    tree: DraftTree,
    *,
    frequency: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    presence: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    repetition: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    min_new_tokens: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """SGLang's penalised logits at every tree node, in place.

    At node v the result is what SGLang 0.5.23's sampler applies for plain decoding after the
    committed history plus ``path(v)``, in its order (``SamplingBatchInfo.update_penalties`` then
    ``_apply_pre_grammar_logits_transforms``, ``sampling/sampling_batch_info.py:409-437``): the
    additive penalties (frequency, presence, min-new-tokens) summed into one vector and added, then
    the scaling one (repetition). SGLang counts OUTPUT tokens only, repetition included (the
    prompt never enters its penalizers). Per token t with count c (committed) + m (on the path):

    * frequency f: ``- f * (c + m)``, where SGLang's ``f * c`` is a sum of c copies of f
      (``scatter_add_``, kept as is) and the path adds m more copies, one at a time;
    * presence a: ``- a`` if c + m > 0;
    * min-new-tokens: ``-inf`` at the request's stop tokens while ``generated + depth(v) <
      min_new_tokens`` (generated = output tokens committed, the root included);
    * repetition p (after the additive ones): ``x * p`` if x < 0 else ``x / p``, if c + m > 0.

    Entries off every path take the committed-state values (one broadcast per request); the
    entries of path tokens are recomputed from the raw logits and written back (bitwise what
    SGLang's own tensors would give after feeding the path, for float32 logits).

    Args:
        logits: float [b, N, V] raw target logits of the tree nodes; modified in place. Rows of
            padded nodes get some finite-or-not values (ignored by every verifier).
        tree: the b trees.
        frequency: (SGLang's ``cumulated_frequency_penalties`` float32 [b, V],
            ``frequency_penalties`` float32 [b, 1]) or None.
        presence: (``cumulated_presence_penalties`` [b, V]: a where seen else 0,
            ``presence_penalties`` [b, 1]) or None.
        repetition: (``cumulated_repetition_penalties`` [b, V]: p where seen else 1,
            ``repetition_penalties`` [b, 1]) or None.
        min_new_tokens: (``stop_token_penalties`` float32 [b, V]: -inf at stop tokens else 0,
            generated int [b] or [b, 1], ``min_new_tokens`` int [b] or [b, 1]) or None.
    Returns:
        ``logits``. No host sync.
    """
    b, n, v = logits.shape
    if frequency is None and presence is None and repetition is None and min_new_tokens is None:
        return logits
    dt = logits.dtype
    tok = path_tokens(tree)  # [b, n, w]
    w = tok.shape[-1]
    on = tok >= 0
    idx = tok.clamp(0, v - 1)
    flat = idx.view(b, n * w)

    def at_path(x: torch.Tensor) -> torch.Tensor:  # [b, V] -> [b, n, w]
        return torch.gather(x, 1, flat).view(b, n, w)

    raw = torch.gather(logits, 2, idx)  # [b, n, w], before anything is applied
    masked = None
    if min_new_tokens is not None:
        stop, generated, minimum = min_new_tokens
        masked = (generated.view(b, 1) + tree.depth) < minimum.view(b, 1)  # [b, n]

    # 1) the committed state, every node: additive vector, min-new-tokens, scaling
    if frequency is not None or presence is not None:
        additive = torch.zeros(b, v, dtype=torch.float32, device=logits.device)
        if frequency is not None:
            additive.sub_(frequency[0])
        if presence is not None:
            additive.sub_(presence[0])
        logits.add_(additive.unsqueeze(1))
    if masked is not None:
        logits.add_(torch.where(masked.unsqueeze(-1), stop.unsqueeze(1), 0.0))
    if repetition is not None:
        s = repetition[0].unsqueeze(1)
        logits.copy_(torch.where(logits < 0, logits * s, logits / s))

    # 2) the path's tokens: recomputed from the raw logits with the node's own counts
    if w == 0:
        return logits
    y = raw
    if frequency is not None or presence is not None or masked is not None:
        add = torch.zeros(b, n, w, dtype=torch.float32, device=logits.device)
        if frequency is not None:
            f = frequency[1].view(b, 1, 1).to(torch.float32)
            mult = path_multiplicity(tok)
            cf = at_path(frequency[0])
            for k in range(1, w + 1):  # one copy of f per occurrence, as SGLang's scatter_add_
                cf = torch.where(mult >= k, cf + f, cf)
            add.sub_(cf)
        if presence is not None:
            add.sub_(presence[1].view(b, 1, 1).to(torch.float32).expand(b, n, w))
        y = (y + add).to(dt)
        if masked is not None:
            y = (y + torch.where(masked.unsqueeze(-1), at_path(stop), 0.0)).to(dt)
    if repetition is not None:
        p = repetition[1].view(b, 1, 1).to(torch.float32)
        y = torch.where(y < 0, y * p, y / p).to(dt)
    # write back: the -1 entries repeat entry 0 (v's own token, same value) so that every write to
    # one (node, token) carries one value; the root (no entries) writes back what it has
    own = on[:, :, :1]
    idx = torch.where(on, idx, idx[:, :, :1])
    y = torch.where(on, y, torch.where(own, y[:, :, :1], torch.gather(logits, 2, idx[:, :, :1])))
    logits.scatter_(2, idx, y)
    return logits
