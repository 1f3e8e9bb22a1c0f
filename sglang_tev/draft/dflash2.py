"""DFlash2 pieces: grouped dynamic causal convolution, logit transform, candidate selector.

Written from the math of two references (read, not copied):

* z-lab's PyPI ``dflash`` 0.1.0, ``dflash/model.py``: ``_grouped_dynamic_convolve``,
  ``GroupedDynamicCausalConv``, ``Qwen3DFlashDecoderLayer.forward`` (the conv wrapped around
  attention and around the MLP), ``DFlashDraftModel.compute_logits`` (the logit transform, on the
  full vocabulary), ``CandidateSelector.select`` and ``DFlash2DraftModel`` (its ``from_pretrained``
  maps the stored codebook names to ``.weight``);
* SGLang 0.5.23, ``srt/models/dflash.py``: ``_grouped_conv`` / ``DFlashGroupedConv``
  (lines 519-591; the kernel restarts at each block: ``position % block_size >= tap``),
  ``_score_edges`` / ``CandidateSelector.build_lattice`` / ``sample_path`` (lines 1107-1261),
  ``DFlash2DraftModel._transform_unary_logits`` (1284-1291, applied to the top-K values only);
  config keys in ``srt/speculative/dflash_utils.py`` (``parse_dflash_draft_config``).

What this module defines, letters: b batch, T tokens, H hidden size, G = H / group_size conv
groups, taps = conv_kernel_size, V vocabulary, D = K - 1 drafted slots of a block, k =
selector_top_k, r = selector_rank.

* :func:`grouped_causal_conv` — ``out[t, c] = Σ_{j < taps, j <= pos(t)} (base[j, c] +
  delta[t, j, g(c)]) · x[t - j, c]`` with ``pos(t) = t mod block_len`` (the position inside its
  block) and ``g(c) = c // group_size``. Taps that reach before the block's first token contribute
  zero, so a block shorter than the taps is well defined (the reference's ``F.pad`` shape breaks
  when a tap offset exceeds the block length; its output on the positions it can compute is equal
  to ours: the conv is causal). The dynamic coefficient is indexed by the OUTPUT position t.
* :func:`transform_logits` — ``logits · output_multiplier``, then ``c · tanh(logits / c)`` with
  ``c = final_logit_softcapping`` when set: on the full-vocabulary logits, as the reference's
  ``compute_logits``. SGLang applies the same transform to the top-K values only; the transform is
  monotone (multiplier > 0), so the candidate set and the selector scores are the same either way;
  what differs is the marginal: here ``log_softmax`` of the transformed full-vocabulary logits
  (a law over V), while SGLang never forms one (its TEV/DDTree head would normalise raw logits).
* :class:`CandidateSelector` / :class:`SelectorLattice` — per slot d the top-k candidates of the
  transformed logits and the scores ``s[d, p, c] = unary[d, c] + <A[pred_p] ⊙ W_h h_d, B[cand_c]>``
  (``pred`` = the candidates of slot d - 1; for d = 0 the anchor token, every row alike).
  ``transition_logq = log_softmax(s, -1)``: row p of slot d is log q(slot d = cand_c | slot d-1 =
  cand_p) at temperature 1. ``unary_logq`` = the full-vocabulary marginal log q at the candidates.
* :func:`selector_walk` — the reference's proposal: greedy (T = 0) or sampled walk through the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import is_greedy

__all__ = [
    "DFLASH2_ARCHITECTURES",
    "GroupedCausalConv",
    "CandidateSelector",
    "SelectorLattice",
    "grouped_causal_conv",
    "transform_logits",
    "selector_walk",
    "path_q_rows",
]

# Architectures SGLang 0.5.23 runs as DFlash2 (srt/models/dflash.py EntryClass; the last two are
# aliases of the first there and here).
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel")


# ----------------------------------------------------------------------------------------------
# Grouped dynamic causal convolution
# ----------------------------------------------------------------------------------------------

def grouped_causal_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group_size: int,
                        block_len: int | None = None) -> torch.Tensor:
    """Grouped dynamic depthwise causal convolution inside blocks (see the module docstring).

    Args:
        x: float ``[b, T, H]``; tokens ``i·block_len .. (i+1)·block_len - 1`` form block i.
        base: float ``[taps, H]``, the static per-channel kernel (tap j multiplies ``x[t - j]``).
        delta: float ``[b, T, taps, G]``, the dynamic per-group coefficients of output token t.
        group_size: channels per group; ``G = H // group_size``.
        block_len: tokens per block (the kernel restarts at each block); None = one block of T.

    Returns ``[b, T, H]`` in ``x``'s dtype (``base`` is cast to it, as the reference). A tap that
    would read before its block's first token reads zero, so any T >= 1 works, T < taps included.
    Pure tensor ops, no host sync. Raises ``ValueError`` on mismatched shapes.
    """
    b, t, h = x.shape
    taps = base.shape[0]
    if h % group_size or base.shape != (taps, h) or delta.shape != (b, t, taps, h // group_size):
        raise ValueError(f"delta: expected ({b}, {t}, {taps}, {h // group_size}) with base "
                         f"({taps}, {h}), got {tuple(delta.shape)} and {tuple(base.shape)}")
    g = h // group_size
    span = t if block_len is None else block_len
    if span >= t:
        # one block (a draft's): tap by tap, fewer ops than the windows below
        coef = base.to(x.dtype).view(taps, g, group_size) + delta.to(x.dtype).unsqueeze(-1)  # [b, T, taps, G, gs]
        xg = x.reshape(b, t, g, group_size)
        out = coef[:, :, 0] * xg
        for j in range(1, min(taps, t)):  # taps reaching before the block read zero
            out[:, j:] += coef[:, j:, j] * xg[:, :-j]
        return out.view(b, t, h)
    nb = -(-t // span)
    # x[t - j] for every tap j at once, zero before each block: pad every block's front with
    # taps - 1 zeros and take sliding windows (window k ends at block position k; its element
    # i is x[k - (taps - 1 - i)], so the taps are read in reverse)
    xb = x if nb * span == t else F.pad(x, (0, 0, 0, nb * span - t))
    xb = F.pad(xb.reshape(b, nb, span, h), (0, 0, taps - 1, 0))
    win = xb.unfold(2, taps, 1).reshape(b, nb * span, g, group_size, taps)[:, :t]  # [b, T, G, gs, taps]
    coef = (base.to(x.dtype).flip(0).t().reshape(1, 1, g, group_size, taps)
            + delta.to(x.dtype).flip(2).transpose(2, 3).unsqueeze(3))  # [b, T, G, gs, taps], reversed taps
    out = (coef * win).sum(-1)
    return out.reshape(b, t, h)


class GroupedCausalConv(nn.Module):
    """The conv pair around one sublayer (attention or MLP) of a DFlash2 layer.

    Parameters (z-lab / SGLang names): ``base_kernel [2, taps, H]`` (index 0: input side, 1:
    output side) and ``kernel_projection.weight [2·taps·G, H]`` (no bias). :meth:`prepare`
    projects the sublayer INPUT once into both sides' dynamic coefficients ``[b, T, 2, taps, G]``,
    convolves the input with side 0 and returns side 1's coefficients, which :meth:`finish` uses
    to convolve the sublayer output (reference ``GroupedDynamicCausalConv.prepare/finish``; SGLang
    ``DFlashGroupedConv``). Fresh modules start as the identity (``base_kernel[:, 0] = 1``, as
    SGLang) with a random projection.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"config key 'conv_group_size'={group_size} must divide "
                             f"hidden_size={hidden_size}")
        self.taps, self.group_size = taps, group_size
        self.groups = hidden_size // group_size
        base = torch.zeros(2, taps, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, block_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [b, T, H]`` -> (conv of x with side 0 ``[b, T, H]``, side-1 coefficients ``[b, T, taps, G]``)."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        out = grouped_causal_conv(x, self.base_kernel[0], delta[:, :, 0], self.group_size, block_len)
        return out, delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block_len: int | None = None) -> torch.Tensor:
        """Sublayer output ``y [b, T, H]`` convolved with side 1 and :meth:`prepare`'s ``delta``."""
        return grouped_causal_conv(y, self.base_kernel[1], delta, self.group_size, block_len)


# ----------------------------------------------------------------------------------------------
# Logit transform
# ----------------------------------------------------------------------------------------------

def transform_logits(logits: torch.Tensor, output_multiplier: float = 1.0,
                     final_logit_softcapping: float | None = None) -> torch.Tensor:
    """DFlash2's logit transform: ``logits · output_multiplier``, then ``c · tanh(logits / c)`` for
    ``c = final_logit_softcapping`` (None: no cap). The one implementation, for the transformers
    runtime, the trainer and the SGLang plugin.

    Dtypes: computed and returned in float32 for float32 / bfloat16 / float16 input (a half
    head's logits are upcast first), float64 for float64. Any shape. Returns ``logits`` itself
    when both are neutral and it is already in that dtype, else a new tensor; ``-inf`` stays
    ``-inf`` without a softcap and becomes ``-c`` with one. References: z-lab ``dflash`` 0.1.0
    ``DFlashDraftModel.compute_logits`` (``dflash/model.py:599-605``); SGLang
    ``DFlash2DraftModel._transform_unary_logits`` (``srt/models/dflash.py:1284-1291``)."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    if output_multiplier != 1.0:
        logits = logits * float(output_multiplier)
    if final_logit_softcapping is not None:
        c = float(final_logit_softcapping)
        logits = torch.tanh(logits / c) * c
    return logits


# ----------------------------------------------------------------------------------------------
# Candidate selector
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SelectorLattice:
    """One block's candidate lattice (per row of the batch).

    Attributes:
        candidate_ids: int64 ``[b, D, k]``, slot d's top-k tokens by transformed logit,
            descending (ties in ``torch.topk`` order).
        unary_logq: float32 ``[b, D, k]``, the marginal mode: ``log_softmax`` over the FULL
            vocabulary of the transformed logits, at the candidates (``build_ddtree_topk`` input).
        scores: float32 ``[b, D, k, k]``, the selector scores ``s[d, p, c]`` (transformed logit
            of cand c + bilinear term); for d = 0 every row p holds the anchor-conditioned scores.
        transition_logq: float32 ``[b, D, k, k]``, ``log_softmax(scores, -1)``: row p of slot d is
            the law (temperature 1) of slot d's token given slot d-1's token is candidate p;
            slot 0's rows are all the one law given the anchor.
    """

    candidate_ids: torch.Tensor
    unary_logq: torch.Tensor
    scores: torch.Tensor
    transition_logq: torch.Tensor


class CandidateSelector(nn.Module):
    """The DFlash2 candidate selector (reference ``CandidateSelector``, SGLang ``CandidateSelector``).

    Parameters, exactly the stored names under ``candidate_selector.``: ``predecessor_codebook``
    ``[V, r]`` (A), ``successor_codebook`` ``[V, r]`` (B) — plain parameters, no ``.weight``, as
    SGLang and the stored checkpoints (the reference adds ``.weight`` through a key mapping) — and
    ``hidden_projection.weight`` ``[r, H]`` (W_h, no bias).
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def lattice(self, hidden: torch.Tensor, logits: torch.Tensor,
                anchor_ids: torch.Tensor) -> SelectorLattice:
        """Score the block's k × k transitions.

        Args:
            hidden: ``[b, D, H]``, the drafter's final-normed hidden states of slots 1 .. K-1.
            logits: float ``[b, D, V]``, the TRANSFORMED draft logits of the same slots.
            anchor_ids: int64 ``[b]``, the block's root (the verified anchor / bonus token).

        Returns a :class:`SelectorLattice` (scores in float32). Raises ``ValueError`` naming the
        argument on shape mismatches or ``k > V``. No host sync. Reference:
        ``CandidateSelector.select`` (per-slot loop) / SGLang ``_score_edges`` (all k × k pairs).
        """
        b, d, _ = hidden.shape
        if logits.dim() != 3 or logits.shape[:2] != (b, d) or logits.shape[2] < self.top_k:
            raise ValueError(f"logits: expected ({b}, {d}, V >= {self.top_k}), got {tuple(logits.shape)}")
        if anchor_ids.shape != (b,) or anchor_ids.dtype != torch.long:
            raise ValueError(f"anchor_ids: expected int64 ({b},), got {anchor_ids.dtype} {tuple(anchor_ids.shape)}")
        logits = logits.float()
        unary, cand = torch.topk(logits, self.top_k, dim=-1)  # [b, D, k], descending
        logz = torch.logsumexp(logits, dim=-1, keepdim=True)
        hp = self.hidden_projection(hidden).float()  # [b, D, r]
        pred = torch.cat([anchor_ids.view(b, 1, 1).expand(b, 1, self.top_k), cand[:, :-1]], dim=1)
        a = self.predecessor_codebook.float()[pred]  # [b, D, k_pred, r]
        bb = self.successor_codebook.float()[cand]  # [b, D, k_cand, r]
        scores = unary[:, :, None, :] + torch.einsum("bdpr,bdcr->bdpc", a * hp[:, :, None, :], bb)
        return SelectorLattice(candidate_ids=cand, unary_logq=unary - logz, scores=scores,
                               transition_logq=torch.log_softmax(scores, dim=-1))

    def teacher_forced_scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidate_ids: torch.Tensor,
                              predecessor_ids: torch.Tensor) -> torch.Tensor:
        """Selector scores of given candidates after a GIVEN predecessor token (training).

        Args:
            hidden: ``[..., H]``, a slot's final-normed hidden state.
            unary: float ``[..., k]``, the slot's transformed logits at the candidates (with grad).
            candidate_ids: int64 ``[..., k]``, the candidates (the slot's top-k, or any token set).
            predecessor_ids: int64 ``[...]``, the token before the slot (the anchor for slot 1).

        Returns float32 ``[..., k]``: ``unary[c] + <A[pred] ⊙ W_h h, B[cand_c]>``, the row of
        :meth:`lattice`'s ``scores`` whose predecessor is ``predecessor_ids`` (equal to it when the
        predecessor is slot d-1's candidate p). Differentiable in every input and parameter.
        Reference: the objective of SpecForge PR #772 (``dflash2_selector_loss_alpha``), which scores
        the top-k after the teacher-forced gold predecessor.
        """
        hp = self.hidden_projection(hidden).float()                            # [..., r]
        a = self.predecessor_codebook.float()[predecessor_ids]                 # [..., r]
        bb = self.successor_codebook.float()[candidate_ids]                    # [..., k, r]
        return unary.float() + torch.einsum("...r,...kr->...k", a * hp, bb)


def path_q_rows(lattice: SelectorLattice, indices: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The proposal law of each slot along a walk.

    Args:
        lattice: a :class:`SelectorLattice`.
        indices: int64 ``[b, D]``, the walk's candidate index per slot.
        temperature: > 0 (q = softmax(scores / T)).

    Returns float32 ``[b, D, k]``: row d = softmax over slot d's candidates of the scores given
    slot d-1's chosen candidate (the anchor for d = 0) — the reference's ``q_rows`` (there in its
    own candidate order). ``ValueError`` for ``temperature <= 0``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0 here, got {temperature!r}")
    s = lattice.scores
    b, d, k, _ = s.shape
    prev = torch.cat([torch.zeros_like(indices[:, :1]), indices[:, :-1]], dim=1)  # slot 0: any row
    rows = s.gather(2, prev[:, :, None, None].expand(b, d, 1, k))[:, :, 0]
    return torch.softmax(rows / temperature, dim=-1)


def selector_walk(lattice: SelectorLattice, temperature: float = 0.0, uniforms: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk the lattice slot by slot, as the reference's ``CandidateSelector.select``.

    Args:
        lattice: a :class:`SelectorLattice`.
        temperature: 0 (or < 1e-5) = greedy (argmax of each row); else sample from
            ``softmax(row / T)`` by inverse CDF.
        uniforms: optional float ``[b, D]`` in [0, 1), the only randomness when given; else drawn
            from ``generator``.

    Returns ``(tokens int64 [b, D], indices int64 [b, D], q_rows float32 [b, D, k])``; ``q_rows``
    is :func:`path_q_rows` at T > 0 and one-hot at the walk at T = 0 (as SGLang's ``sample_path``;
    the reference returns None there). Sequential over D (one small op chain per slot); no host
    sync. ``ValueError`` for ``temperature < 0`` or ``uniforms`` of the wrong shape.
    """
    s = lattice.scores
    b, d, k, _ = s.shape
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature!r}")
    greedy = is_greedy(temperature)
    if not greedy:
        if uniforms is None:
            uniforms = torch.rand((b, d), generator=generator, dtype=torch.float64, device=s.device)
        elif uniforms.shape != (b, d):
            raise ValueError(f"uniforms: expected ({b}, {d}), got {tuple(uniforms.shape)}")
    index = torch.zeros(b, dtype=torch.long, device=s.device)
    out = []
    for slot in range(d):
        row = s[:, slot].gather(1, index.view(b, 1, 1).expand(b, 1, k))[:, 0]  # [b, k]
        if greedy:
            index = row.argmax(-1)
        else:
            cdf = torch.softmax(row.double() / temperature, dim=-1).cumsum(-1)
            index = (uniforms[:, slot, None].double() >= cdf).sum(-1).clamp_max(k - 1)
        out.append(index)
    indices = torch.stack(out, dim=1)
    tokens = lattice.candidate_ids.gather(2, indices[..., None])[..., 0]
    q = F.one_hot(indices, k).float() if greedy else path_q_rows(lattice, indices, temperature)
    return tokens, indices, q
