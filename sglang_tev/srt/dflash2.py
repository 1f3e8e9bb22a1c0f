"""TEV's draft head for DFlash2 checkpoints in SGLang 0.5.23 (imports sglang only
inside functions).

SGLang runs a DFlash2 checkpoint (``architectures`` ``DFlash2DraftModel`` or its aliases
``DFlash2BeamDraftModel`` / ``MiniMaxDFlash2DraftModel``, ``srt/models/dflash.py:1264-1324``) with
its own modules, which TEV reuses for every weight:

* the grouped dynamic causal conv around each layer's attention and MLP (``DFlashGroupedConv``,
  ``:520-591``, built whenever ``conv_kernel_size`` is set, ``:718-735``) runs inside the draft
  forward, so TEV's block forward already carries it (``set_block_size`` restarts it per block);
* the candidate selector (``CandidateSelector``, ``:1142-1261``): per block slot the top-k
  candidates of the target LM head with SGLang's unary transform (``compute_candidates``,
  ``:1293-1302``: ``output_multiplier`` then softcap on the top-k values only) and the K x K
  lattice scores (``build_lattice`` / ``_score_edges``), taken through SGLang's own
  ``_selector_lattice`` (``srt/speculative/dflash_worker_v2.py:237-249``).

What TEV does instead of SGLang's selector walk (``sample_path``): it normalises each lattice row
(``log_softmax`` over the candidates: the transition law at temperature 1) and builds a DDTree over
the lattice (``sglang_tev.draft.lattice.build_lattice_tree``), verified exactly like any tree.

Modes (:data:`MODES`, chosen with ``SGLANG_TEV_DFLASH2_MODE``; see :func:`resolve_draft_serving`):

* ``lattice`` (default when the checkpoint has a selector): the selector lattice -> lattice tree;
* ``marginal``: the selector ignored; the full-vocabulary logits of the target head, transformed
  as z-lab's reference does (``dflash/model.py:599-605``: ``x * output_multiplier``, then
  ``c * tanh(x / c)``), then per-depth top-k and log-sum-exp into the ordinary DDTree
  (:func:`transformed_candidate_topk`). The only mode of a DFlash2-style drafter without a
  selector, and the negative control of the lattice mode.

Refused at start-up, one ``ValueError`` naming the feature: a LiLiCorr head
(``srt/models/lilicorr.py`` ``LiLiCorrDraftModel``), a Domino projector (``projector_type:
domino``), ``SGLANG_TEV_DFLASH2_MODE=lattice`` without a selector.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from ..draft.dflash2 import transform_logits  # the one DFlash2 logit transform (float32 out)
from ..spec import AUTO, resolve_draft_mode
from .config import DFLASH2_MODES, ENV_DFLASH2_MODE, read_dflash2_mode

__all__ = [
    "MODES",
    "DraftServing",
    "resolve_draft_serving",
    "check_draft_config",
    "transform_logits",
    "transformed_candidate_topk",
    "selector_lattice_from_hidden",
]

logger = logging.getLogger(__name__)

MODES = DFLASH2_MODES
"""DFlash2 draft modes TEV serves (``SGLANG_TEV_DFLASH2_MODE``; ``config.DFLASH2_MODES``)."""


@dataclass(frozen=True)
class DraftServing:
    """How TEV drafts with the loaded DFlash-family checkpoint.

    Attributes:
        mode: ``"lattice"`` (selector lattice -> :func:`~sglang_tev.draft.lattice.build_lattice_tree`)
            or ``"marginal"`` (per-depth top-k + log-sum-exp -> DDTree).
        conv: the checkpoint's grouped conv taps (0: none); run by SGLang's draft model.
        selector_top_k: candidates per slot of the checkpoint's selector (0: no selector).
        output_multiplier, final_logit_softcapping: the checkpoint's logit transform (1.0 / None:
            neutral).
    """

    mode: str
    conv: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None

    @property
    def transformed(self) -> bool:
        """Whether the marginal head must transform the logits (a non-neutral transform)."""
        return self.output_multiplier != 1.0 or self.final_logit_softcapping is not None

    @property
    def plain(self) -> bool:
        """A DFlash v1 drafter: no conv, no selector, no transform (TEV's original path)."""
        return not self.conv and not self.selector_top_k and not self.transformed

    def marginal_topk_fn(self, default: Callable) -> Callable:
        """The ``candidate_topk``-like function of the marginal head: ``default`` (SGLang's
        ``candidate_topk``) when the transform is neutral, else :func:`transformed_candidate_topk`
        bound to this checkpoint's transform."""
        if not self.transformed:
            return default
        return partial(
            transformed_candidate_topk,
            output_multiplier=self.output_multiplier,
            final_logit_softcapping=self.final_logit_softcapping,
        )

    def describe(self) -> str:
        parts = [f"mode={self.mode}"]
        if self.conv:
            parts.append(f"conv taps={self.conv} (SGLang DFlashGroupedConv)")
        if self.selector_top_k:
            use = "lattice tree" if self.mode == "lattice" else "IGNORED (marginal mode)"
            parts.append(f"selector top_k={self.selector_top_k}: {use}")
        if self.transformed:
            where = "top-k unary values (SGLang compute_candidates)" if self.mode == "lattice" else "full-vocabulary logits"
            parts.append(
                f"transform x*{self.output_multiplier:g}"
                + (f", softcap {self.final_logit_softcapping:g}" if self.final_logit_softcapping is not None else "")
                + f" on the {where}"
            )
        return ", ".join(parts)


def resolve_draft_serving(draft_model, draft_config, environ=None) -> DraftServing:
    """Decide, once at start-up, how every DFlash2 feature of the loaded drafter is served.

    Args:
        draft_model: SGLang's loaded draft model (``DFlashDraftModel`` or a subclass): read are
            ``candidate_selector`` (``srt/models/dflash.py:704``, set by ``DFlash2DraftModel``)
            and ``lilicorr`` (``:705``, set by ``LiLiCorrDraftModel``).
        draft_config: SGLang's ``DFlashDraftConfig`` of the checkpoint
            (``srt/speculative/dflash_utils.py`` ``parse_dflash_draft_config``).
        environ: mapping for ``SGLANG_TEV_DFLASH2_MODE`` (default ``os.environ``).
    Returns:
        :class:`DraftServing`: ``lattice`` when the drafter has a selector and the variable is
        unset or ``lattice``; ``marginal`` otherwise.
    Raises:
        ValueError with one line naming the feature: a LiLiCorr head; a Domino projector;
        ``SGLANG_TEV_DFLASH2_MODE=lattice`` for a drafter without a candidate selector; a bad
        variable value (:func:`~sglang_tev.srt.config.read_dflash2_mode`).
    """
    requested = read_dflash2_mode(environ)
    if getattr(draft_model, "lilicorr", None) is not None:
        raise ValueError(
            "TEV: the drafter's LiLiCorr head (LiLiCorrDraftModel) is not served: TEV drafts trees from the "
            "target head's per-depth laws or a DFlash2 selector lattice; use --speculative-algorithm DFLASH"
        )
    if getattr(draft_config, "is_domino", False) or getattr(draft_config, "projector_type", None) == "domino":
        raise ValueError(
            "TEV: the drafter's Domino projector (dflash_config.projector_type='domino') is not served: TEV drafts "
            "from the target LM head; use --speculative-algorithm DFLASH"
        )
    selector = getattr(draft_model, "candidate_selector", None)
    top_k = int(getattr(selector, "top_k", 0) or 0) if selector is not None else 0
    if requested == "lattice" and selector is None:
        raise ValueError(
            "TEV: SGLANG_TEV_DFLASH2_MODE=lattice needs a DFlash2 candidate selector "
            "(dflash_config.selector_rank / selector_top_k); this drafter has none"
        )
    mode = resolve_draft_mode(requested or AUTO, selector is not None, arg=ENV_DFLASH2_MODE)  # lattice checked above
    softcap = getattr(draft_config, "final_logit_softcapping", None)
    return DraftServing(
        mode=mode,
        conv=int(getattr(draft_config, "conv_kernel_size", 0) or 0),
        selector_top_k=top_k,
        output_multiplier=float(getattr(draft_config, "output_multiplier", 1.0)),
        final_logit_softcapping=float(softcap) if softcap else None,
    )


def check_draft_config(hf_config, environ=None) -> None:
    """The same refusals as :func:`resolve_draft_serving`, read from the drafter's config alone, so
    a server refuses before any model loads (``TevAlgo.handle_server_args``).

    Args:
        hf_config: the drafter's HF config (SGLang's ``get_config`` result, or a dict).
        environ: mapping for ``SGLANG_TEV_DFLASH2_MODE`` (default ``os.environ``).
    Raises:
        ValueError with one line naming the feature: ``architectures`` ``LiLiCorrDraftModel``; a
        Domino projector; ``SGLANG_TEV_DFLASH2_MODE=lattice`` without ``selector_rank`` (or with an
        architecture SGLang builds no selector for); anything SGLang's ``parse_dflash_draft_config``
        refuses.
    """
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    cfg = parse_dflash_draft_config(draft_hf_config=hf_config)
    archs = hf_config.get("architectures") if isinstance(hf_config, dict) else getattr(hf_config, "architectures", None)
    archs = list(archs or [])
    has_selector = bool(cfg.selector_rank) and any(a in DFLASH2_ARCHITECTURES for a in archs)
    draft = SimpleNamespace(
        lilicorr=object() if "LiLiCorrDraftModel" in archs else None,
        candidate_selector=SimpleNamespace(top_k=cfg.selector_top_k) if has_selector else None,
    )
    resolve_draft_serving(draft, cfg, environ)


DFLASH2_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel")
"""Architectures SGLang 0.5.23 builds a ``CandidateSelector`` for (``srt/models/dflash.py:1264-1324``)."""


def transformed_candidate_topk(
    hidden: torch.Tensor,
    lm_head,
    k: int,
    *,
    with_partition: bool = False,
    output_multiplier: float = 1.0,
    final_logit_softcapping: Optional[float] = None,
):
    """SGLang's ``candidate_topk`` (``srt/models/dflash.py:107-154``) on TRANSFORMED logits.

    The steps of ``candidate_topk`` in its order: the dense/quantised head check, the target head
    restricted to the original vocabulary (``_project_candidate_logits``), then -- the one step
    added -- :func:`transform_logits` on the full (local shard of the) vocabulary, the quantised
    head's padded tail masked to ``-inf`` again (the softcap would lift it to ``-c``), then
    ``lilicorr_topk_lse`` (top-k and the full-vocabulary log-sum-exp), and under TP the same
    gather of k values / ids per rank and global top-k, and the log-sum-exp of the ranks' lse.
    The transform is elementwise, so transforming each shard equals transforming the whole.

    Args:
        hidden: [n, H] draft hidden states.
        lm_head: the target's LM head (dense weight or a supported quant method).
        k: candidates per row.
        with_partition: also return the full-vocabulary log-sum-exp of the transformed logits.
        output_multiplier, final_logit_softcapping: the checkpoint's transform.
    Returns:
        (ids int64 [n, k], vals float32 [n, k], lse float32 [n] or None), as ``candidate_topk``.
    Raises:
        RuntimeError as ``candidate_topk``: a head that is neither dense nor a supported quant method.
    No host sync (capturable, as ``candidate_topk``).
    """
    from sglang.kernels.ops.speculative.lilicorr import lilicorr_topk_lse
    from sglang.srt.distributed.communication_op import tensor_model_parallel_all_gather
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
    from sglang.srt.models.dflash import _project_candidate_logits, _radix_topk
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.dflash_utils import is_dense_head_weight

    weight = getattr(lm_head, "weight", None)
    use_quant_head = should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
    if not use_quant_head and not is_dense_head_weight(weight):
        raise RuntimeError(
            "DFlash candidate top-k requires a dense FP16/BF16/FP32 target lm_head or a supported lm_head.quant_method."
        )
    single = get_parallel().tp_size == 1
    num_org = int(lm_head.org_vocab_size) if single else int(lm_head.shard_indices.num_org_elements)
    logits = _project_candidate_logits(hidden, lm_head, num_org=num_org, use_quant_head=use_quant_head)
    logits = transform_logits(logits, output_multiplier, final_logit_softcapping)
    if logits.shape[-1] > num_org:  # the quantised head's padded tail (candidate_topk masks it before)
        logits[:, num_org:] = float("-inf")
    lse = None
    if with_partition:
        vals, ids, lse = lilicorr_topk_lse(logits, k)
    else:
        vals, ids = _radix_topk(logits, k)
    if single:
        return ids.long(), vals, lse
    global_ids = ids.long() + int(lm_head.shard_indices.org_vocab_start_index)
    gathered_vals = tensor_model_parallel_all_gather(vals.float(), dim=-1)
    gathered_ids = tensor_model_parallel_all_gather(global_ids, dim=-1)
    top_vals, sel = torch.topk(gathered_vals, k, dim=-1)
    if lse is not None:
        lse = torch.logsumexp(tensor_model_parallel_all_gather(lse.unsqueeze(-1), dim=-1), dim=-1)
    return torch.gather(gathered_ids, -1, sel).long(), top_vals, lse


def selector_lattice_from_hidden(
    hidden_states: torch.Tensor, block_size: int, draft_model, anchor_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """TEV's lattice head: SGLang's selector lattice of one draft block, rows normalised.

    Follows SGLang's selector draft (``_SelectorDraftSampler.__call__`` /
    ``_propose_selector_block``, ``srt/speculative/dflash_worker_v2.py:297-303, 1487-1497``): the
    block's rows 1..K-1 (row 0 is the anchor), ``_selector_lattice(draft_model, pred_hidden,
    anchor)`` (``:237-249``: ``compute_candidates`` = top-k of the target head with the unary
    transform, then ``CandidateSelector.build_lattice``); instead of ``sample_path`` it returns
    ``log_softmax`` of the scores over the candidates, the layout of
    ``sglang_tev.draft.lattice`` (slot 0's row 0 is the law given the anchor; its rows >= 1 repeat
    it, as SGLang expands the anchor over all predecessor rows).

    Args:
        hidden_states: [bs * K, H] the draft block's hidden states.
        block_size: K.
        draft_model: SGLang's ``DFlash2DraftModel`` with ``lm_head`` attached (the target's).
        anchor_tokens: int [bs], the block's root (bonus) tokens.
    Returns:
        (candidate_ids int64 [bs, K-1, k], trans_logq float32 [bs, K-1, k, k]). No host sync.
    """
    from sglang.srt.speculative.dflash_worker_v2 import _selector_lattice

    H = hidden_states.shape[-1]
    bs = hidden_states.shape[0] // block_size
    pred = hidden_states.view(bs, block_size, H)[:, 1:, :]
    candidate_ids, scores = _selector_lattice(draft_model, pred, anchor_tokens.view(-1).to(torch.int64))
    return candidate_ids.to(torch.int64), torch.log_softmax(scores.float(), dim=-1)
