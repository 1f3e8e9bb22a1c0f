"""CUDA graphs for TEV's target verify and draft forwards on SGLang's own graph runner
(imports sglang only inside functions).

SGLang 0.5.23 captures every decode-phase forward of a speculative algorithm with one class,
``DecodeCudaGraphRunner`` (``srt/model_executor/runner/decode_cuda_graph_runner.py``), in
TARGET_VERIFY mode, once per batch-size bucket, ``width`` tokens per request: N (the tree) on
the target runner and K (the draft block) on the draft runner (``TevAlgo``'s
``get_num_tokens_per_req_for_target_verify``). TEV needs two things the DFLASH family does not:

1. **The target verify graph must be captured with the tree mask.** For the DFLASH family,
   ``get_spec_info`` (``:2106-2130``) captures the target verify WITHOUT a custom mask on
   FlashInfer and Triton (``resolve_dflash_verify_mask_policy``: a linear block is the backend's
   causal path), and a graph captured without a mask ignores the mask given at replay: Triton's
   metadata (``triton_backend.py:1321-1331``) and FlashInfer's wrapper
   (``flashinfer_backend.py:1326-1332``) decide mask or no mask at capture. The AROUND hook
   :func:`_around_get_spec_info` hands a TEV target runner's capture a ``DFlashVerifyInput``
   carrying the runner's static all-ones ``buffers.custom_mask``, as EAGLE's branch does
   (``:2071-2104``); the draft runner keeps DFLASH's mask-less input (its block attention is
   the drafter's own non-causal path). :func:`_around_dummy_verify_input` does the same for
   the eager warm-up dummy (``spec_info.py:482-532``, ``base_runner.py:653``), whose DFLASH
   branch also states the width N for the draft runner, where TEV's is K.
   At replay the live mask reaches the captured kernels out of graph, with no host sync on
   Triton (``_update_target_verify_buffers`` copies it into the static ``verify_mask`` buffer,
   ``triton_backend.py:592-653``) and through ``plan()`` on FlashInfer (it packs the bits into
   the wrapper's ``custom_mask_buf``; about three blocking device-to-host reads per replay,
   the comment at ``flashinfer_backend.py:874-879``).

2. **TEV's draft head folded into the draft graph.** DFLASH appends a "draft sampler" to the
   draft runner's ``capture_tail_hooks`` (``dflash_worker_v2.py:743-746``;
   ``draft_worker_common.py:148-159``), so the head runs inside the captured graph and writes
   static buffers the worker reads after a replay (``_DflashDraftSampler.out``, ``:135-210``,
   read at ``:2732``). :class:`TevDraftHead` is TEV's head in that slot: per-depth top-k and the
   full-vocabulary log-sum-exp of the drafter's logits (``candidate_topk(..., with_partition=
   True)``, ``srt/models/dflash.py:107-154``), written into static ``[max_bs, K-1, k]`` buffers.

Bucket padding: a replay pads the batch to the next captured size with ``seq_lens`` = the
backend's fill value (1 on Triton and FlashInfer) for the padded rows; :func:`pad_tree_mask`
appends those rows' mask segments (all True, as DFLASH's ``generate_attn_arg_prefill`` pads,
``dflash_info.py:198-219``), so the static mask buffer holds a defined mask for every row.

Randomness: nothing here draws random numbers; the verifier's uniforms are drawn eagerly by the
worker after the replays (a captured draw would repeat the same numbers on every replay).

``scripts/sglang_smoke.py`` is the GPU check (its status: docs/sglang.md).
"""

from __future__ import annotations

import logging
import numbers
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "ALGORITHM",
    "TevDraftHead",
    "draft_topk_from_hidden",
    "graph_padded_batch_size",
    "pad_tree_mask",
    "install_graph_hooks",
    "build_tev_draft_head",
]

logger = logging.getLogger(__name__)

ALGORITHM = "TEV"

_GET_SPEC_INFO = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info"
_DUMMY_VERIFY_INPUT = "sglang.srt.speculative.spec_info.create_dummy_verify_input"
_installed = False


def _is_tev(spec_algorithm) -> bool:
    return getattr(spec_algorithm, "name", None) == ALGORITHM


# ---------------------------------------------------------------------- target verify capture
def _around_get_spec_info(original: Callable, runner, num_tokens: int):
    """AROUND hook of ``DecodeCudaGraphRunner.get_spec_info(self, num_tokens)``.

    For a TEV server's target runner: SGLang's DFLASH-family ``DFlashVerifyInput`` (width
    ``runner.captured_req_width`` = N, hidden capture FULL, ragged layout as SGLang builds it)
    with ``custom_mask = runner.buffers.custom_mask`` (bool, all ones, sized
    ``(max_bs * fill + max_bs * N) * N`` >= the capture's ``bs * N * (fill + N)``), so the
    attention backend captures its masked TARGET_VERIFY path. Everything else (other
    algorithms, TEV's draft runner) gets SGLang's own result unchanged.

    Raises:
        RuntimeError when SGLang's result for a TEV target runner is not a ``DFlashVerifyInput``
        (a SGLang version this hook was not written for).
    """
    spec_info = original(runner, num_tokens)
    model_runner = runner.model_runner
    if not _is_tev(model_runner.spec_algorithm) or model_runner.is_draft_worker:
        return spec_info
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    if not isinstance(spec_info, DFlashVerifyInput):
        raise RuntimeError(
            f"TEV: DecodeCudaGraphRunner.get_spec_info returned {type(spec_info).__name__} for the target runner; "
            "the tree-mask capture hook expects SGLang 0.5.23's DFlashVerifyInput"
        )
    spec_info.custom_mask = runner.buffers.custom_mask
    return spec_info


def _around_dummy_verify_input(original: Callable, spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker):
    """AROUND hook of ``create_dummy_verify_input(spec_algorithm, custom_mask, num_tokens_per_req,
    is_draft_worker)`` (``spec_info.py:482-532``): the warm-up dummy of a TEV runner is a
    ``DFlashVerifyInput`` of the runner's own width (N target, K draft; SGLang's DFLASH branch
    states N for both) carrying ``custom_mask`` on the target runner, as the captured graphs do.
    Other algorithms get SGLang's result unchanged."""
    spec_info = original(spec_algorithm, custom_mask, num_tokens_per_req, is_draft_worker)
    if not _is_tev(spec_algorithm):
        return spec_info
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    return DFlashVerifyInput(
        draft_token=None,
        positions=None,
        draft_token_num=int(num_tokens_per_req),
        custom_mask=None if is_draft_worker else custom_mask,
        capture_hidden_mode=spec_info.capture_hidden_mode,
    )


def install_graph_hooks() -> None:
    """Register :func:`_around_get_spec_info` and :func:`_around_dummy_verify_input` as
    ``HookRegistry`` AROUND hooks (``load_plugins()`` applies them in every SGLang process,
    before any runner captures). Idempotent; servers running another algorithm are untouched."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_GET_SPEC_INFO, _around_get_spec_info, HookType.AROUND)
    HookRegistry.register(_DUMMY_VERIFY_INPUT, _around_dummy_verify_input, HookType.AROUND)
    _installed = True


# ---------------------------------------------------------------------- bucket padding
def graph_padded_batch_size(bs: int, runner) -> Optional[int]:
    """The batch size a replay of ``runner`` pads ``bs`` to, or None when no graph can take it.

    Args:
        bs: live requests.
        runner: SGLang's ``DecodeCudaGraphRunner`` (its ``capture_bs``, sorted ascending, and
            ``disable_padding``) or None (graphs off).
    Returns:
        The smallest captured size >= bs (``base_cuda_graph_runner.py:166``, ``_pad_to_bucket``),
        ``bs`` itself when padding is disabled and bs is captured, None otherwise.
    """
    if runner is None:
        return None
    buckets: Sequence[int] = sorted(int(b) for b in runner.capture_bs)
    if getattr(runner, "disable_padding", False):
        return bs if bs in buckets else None
    for b in buckets:
        if b >= bs:
            return b
    return None


def pad_tree_mask(mask: torch.Tensor, bs: int, padded_bs: int, tree_size: int, fill_seq_len: int) -> torch.Tensor:
    """Append the mask segments of the rows a graph replay pads on.

    A TEV verify mask is FULL layout: request b's segment is ``N x (seq_len_b + N)`` (its
    committed prefix, then the tree), concatenated over requests (``round.tree_verify_layout``).
    A replay runs ``padded_bs - bs`` more rows of ``seq_len = fill_seq_len``; each gets an
    all-True ``N x (fill_seq_len + N)`` segment (what DFLASH pads with,
    ``dflash_info.py:198-219``). Padded rows' outputs are discarded.

    Args:
        mask: bool [sum_b N * (seq_len_b + N)].
        bs, padded_bs: live and padded batch sizes (``padded_bs >= bs``).
        tree_size: N.
        fill_seq_len: the attention backend's ``get_cuda_graph_seq_len_fill_value()``.
    Returns:
        bool [mask.numel() + (padded_bs - bs) * N * (fill_seq_len + N)]; ``mask`` itself when
        nothing is padded.
    Raises:
        ValueError when ``padded_bs < bs`` or the mask is not 1-D bool.
    """
    if padded_bs < bs:
        raise ValueError(f"padded_bs {padded_bs} < bs {bs}")
    if mask.dim() != 1 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a 1-D bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    extra = (padded_bs - bs) * tree_size * (fill_seq_len + tree_size)
    if extra == 0:
        return mask
    return torch.cat([mask, torch.ones(extra, dtype=torch.bool, device=mask.device)])


# ---------------------------------------------------------------------- draft head
def draft_topk_from_hidden(
    hidden_states: torch.Tensor, block_size: int, lm_head, k: int, topk_fn: Callable, depth: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """TEV's draft head: per-depth top-k of the drafter's log-probabilities.

    Args:
        hidden_states: [bs * K, H] the draft block's hidden states (row 0 of each block is the
            root; rows 1..K-1 are depths 1..K-1).
        block_size: K.
        lm_head: the target's LM head (the drafter has none).
        k: list width per depth.
        topk_fn: ``candidate_topk``-like ``fn(hidden [n, H], lm_head, k, with_partition=True)
            -> (ids [n, k], vals [n, k], lse [n])`` (SGLang's ``srt/models/dflash.py:107-154``:
            top-k logits and the full-vocabulary log-sum-exp, all-gathered under TP).
        depth: D, the depths read (1 <= D <= K - 1; None: K - 1): rows past D go through no LM
            head (a tree of B nodes reaches depth B at most).
    Returns:
        (logq float32 [bs, D, k] = vals - lse, ids int64 [bs, D, k]). No host sync beyond
        what ``topk_fn`` does (SGLang's: none), so it can run inside a captured graph.
    Raises:
        ValueError naming ``depth`` outside [1, K - 1].
    """
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, numbers.Integral)):
        raise ValueError(f"depth must be an int in [1, {block_size - 1}] (the block's mask slots), got {depth!r}")
    D = block_size - 1 if depth is None else int(depth)
    if not 1 <= D <= block_size - 1:
        raise ValueError(f"depth must be in [1, {block_size - 1}] (the block's mask slots), got {depth!r}")
    H = hidden_states.shape[-1]
    bs = hidden_states.shape[0] // block_size
    hs = hidden_states.view(bs, block_size, H)[:, 1 : D + 1, :].reshape(-1, H)
    ids, vals, lse = topk_fn(hs, lm_head, k, with_partition=True)
    logq = (vals.float() - lse.float().unsqueeze(-1)).view(bs, D, k)
    return logq, ids.view(bs, D, k).to(torch.int64)


class TevDraftHead:
    """TEV's draft head as the draft graph's capture tail hook (the slot DFLASH's
    ``_DflashDraftSampler`` fills, ``dflash_worker_v2.py:135-210``).

    Called as ``head(hidden_states [bs * K, H], input_ids)`` inside the draft runner's captured
    forward (``make_draft_sampler_capture_hook``), it computes :func:`draft_topk_from_hidden` and
    copies the result into static buffers whose addresses the graph bakes in:

    * ``logq``: float32 [max_bs, K-1, k]; ``ids``: int64 [max_bs, K-1, k].

    After a replay of bs rows (padded rows included) :meth:`read` returns the live ``[:bs]``
    views; the next replay overwrites them, so the worker consumes them in the same round. No
    host sync and no random draw inside (the verifier's uniforms are drawn outside any graph).
    """

    def __init__(self, *, lm_head, block_size: int, topk: int, max_bs: int, device, topk_fn: Optional[Callable] = None):
        if topk_fn is None:
            from sglang.srt.models.dflash import candidate_topk as topk_fn
        self.lm_head = lm_head
        self.block_size = int(block_size)
        self.topk = int(topk)
        self.max_bs = int(max_bs)
        self.topk_fn = topk_fn
        shape = (self.max_bs, self.block_size - 1, self.topk)
        self.logq = torch.empty(shape, dtype=torch.float32, device=device)
        self.ids = torch.empty(shape, dtype=torch.int64, device=device)

    def compute(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`draft_topk_from_hidden` with this head's LM head, K, k and top-k function."""
        return draft_topk_from_hidden(hidden_states, self.block_size, self.lm_head, self.topk, self.topk_fn)

    def __call__(self, hidden_states: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> None:
        logq, ids = self.compute(hidden_states)
        bs = logq.shape[0]
        self.logq[:bs].copy_(logq)
        self.ids[:bs].copy_(ids)

    def read(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logq [bs, K-1, k], ids [bs, K-1, k]): views of the static buffers after a replay."""
        return self.logq[:bs], self.ids[:bs]


def build_tev_draft_head(worker) -> Optional[TevDraftHead]:
    """TEV's ``_maybe_build_draft_sampler`` (``dflash_worker_v2.py:884-998``): the head DFLASH's
    ``init_cuda_graphs`` appends to the draft runner's capture tail hooks before capture.

    Returns None (the head stays eager, as DFLASH's) when ``SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1``,
    the target has no LM head, or the head is neither dense nor a quantised head SGLang's own
    logits path runs under graphs (the same gate as DFLASH's, ``:904-911``); and for a DFlash2
    drafter in lattice mode (``worker._tev_draft.mode == "lattice"``): its lattice head and tree
    run eagerly after the draft graph's replay (``TEVWorker._draft_lattice``), SGLang's selector
    walk (``_SelectorDraftSampler``) is never folded. A DFlash2 drafter in marginal mode folds
    this head with the checkpoint's logit transform (``dflash2.transformed_candidate_topk``).
    """
    from sglang.srt.environ import envs
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.runtime_context import get_exec, get_parallel
    from sglang.srt.speculative.dflash_utils import is_dense_head_weight

    def eager(reason: str):
        if get_parallel().tp_rank == 0:
            logger.info("TEV draft head kept eager (reason=%s).", reason)
        return None

    if envs.SGLANG_DFLASH_EAGER_DRAFT_SAMPLER.get():
        return eager("SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1")
    serving = getattr(worker, "_tev_draft", None)
    if serving is not None and serving.mode == "lattice":
        return eager("DFlash2 lattice mode: the selector lattice and its tree run after the draft graph's replay")
    lm_head = unwrap_lora_layer(getattr(worker.target_worker.model_runner.model, "lm_head", None))
    if lm_head is None:
        return eager("no target lm_head")
    if not (
        is_dense_head_weight(getattr(lm_head, "weight", None))
        or should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
    ):
        return eager("unsupported quantized lm_head")
    max_bs = max(get_exec().graph.cuda_graph_config.decode.bs)
    if get_parallel().tp_rank == 0:
        logger.info(
            "TEV draft head (per-depth top-%d + log-sum-exp%s) folded into the draft cuda graph (max_bs=%d).",
            worker.tev.topk,
            ", DFlash2 logit transform" if serving is not None and serving.transformed else "",
            max_bs,
        )
    topk_fn = None
    if serving is not None and serving.transformed:
        from sglang.srt.models.dflash import candidate_topk

        topk_fn = serving.marginal_topk_fn(candidate_topk)
    return TevDraftHead(
        lm_head=lm_head, block_size=worker.block_size, topk=worker.tev.topk, max_bs=max_bs, device=worker.device,
        topk_fn=topk_fn,
    )
