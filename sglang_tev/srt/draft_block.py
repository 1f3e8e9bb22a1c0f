"""The draft block of a TEV round on SGLang's draft runner (imports sglang).

Mixed into ``TEVWorker`` (``worker.py``): the DFlash block forward ``[root, MASK x (K' - 1)]`` on
the draft runner and its head, per-depth top-k (marginal mode, :meth:`DraftBlockMixin._draft_topk`)
or the DFlash2 selector lattice (:meth:`DraftBlockMixin._draft_lattice`). It uses the worker's
settings (``tev``, ``block_size``), its ``_window_locs`` and SGLang's draft runner, embeddings and
mask token (``DFlashWorkerV2``).

How much is drafted follows the round (:meth:`DraftBlockMixin._draft_extent`). A tree of B nodes
reaches depth B at most, so the head reads only the depths ``min(D, B)`` (their logits are the
ones the whole block gives: no tree changes). Under ``SGLANG_TEV_BUDGET=auto`` the block itself is
cut to ``min(D, B) + 1`` tokens, as the transformers runtime does with the plan's
``draft_depth`` (``hf/round.py: draft``): attention inside a DFlash block is bidirectional, so the
drafts of the depths kept may move a little; the plan depends only on past rounds, so the output
law is untouched. Not cut: a fixed tree (``tune`` times it; the drafts stay DFLASH's), a drafter
with a block convolution (DFlash2's conv reads each token's position in the block from the block
size the model was built for), lattice mode (the selector reads every slot), and a draft runner
with CUDA graphs (captured for the whole block).
"""

from __future__ import annotations

import torch
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.models.dflash import candidate_topk
from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info
from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import draft_tp_context

from .dflash2 import selector_lattice_from_hidden
from .graphs import TevDraftHead, draft_topk_from_hidden

__all__ = ["DraftBlockMixin", "block_cut_refusal"]


def block_cut_refusal(worker) -> str | None:
    """Why the worker's draft block keeps all K tokens under ``auto`` (None: it may be cut): lattice
    mode, a block convolution in the drafter, or a draft runner with CUDA graphs."""
    if worker._tev_draft.mode != "marginal":
        return "lattice mode reads every slot"
    # SGLang's DFlashGroupedConv, or any module that reads positions from a block size and taps
    if any(type(m).__name__ == "DFlashGroupedConv" or (hasattr(m, "taps") and hasattr(m, "block_size"))
           for m in worker.draft_model.modules()):
        return "the drafter's block convolution is built for the whole block"
    if getattr(worker.draft_model_runner, "decode_cuda_graph_runner", None) is not None:
        return "the draft graphs are captured for the whole block"
    return None


class DraftBlockMixin:
    """``TEVWorker``'s draft block (see the module doc)."""

    def _draft_extent(self, budget: int, cut: bool) -> tuple[int, int]:
        """(tokens of this round's draft block K', depths its head reads D') for trees of
        ``budget`` >= 1 nodes: D' = min(D, budget); K' = D' + 1 when ``cut`` (an ``auto`` plan) and
        :func:`block_cut_refusal` allows it (decided once, at the first draft), else K.

        Raises:
            ValueError naming ``budget`` below 1 (a plain step drafts nothing)."""
        if int(budget) < 1:
            raise ValueError(f"budget must be >= 1 (a plain step drafts nothing), got {budget!r}")
        depth = min(self.tev.max_depth, int(budget))
        if not cut:
            return self.block_size, depth
        if self._block_cut is None:  # the draft graphs exist only after init_cuda_graphs
            self._block_cut = block_cut_refusal(self) is None
        return (min(self.block_size, depth + 1) if self._block_cut else self.block_size), depth

    def _draft_topk(self, batch, draft_input, seq_lens_cpu, seq_lens_sum, block=None, depth=None, budget=None):
        """Draft block forward of ``block`` tokens (K' <= K, default K) -> (topk_logprobs float32
        [bs, D', k], topk_ids int64 [bs, D', k]) of depths 1..D' (``depth``, default K' - 1).

        ``k`` is the configured list width (``SGLANG_TEV_TOPK``, default N - 1), or on the eager
        head at most ``budget`` rounded up to a power of two (SGLang's top-k kernel takes powers
        of two; other widths fall back to a full-vocabulary ``torch.topk``): a best-first tree of
        B nodes holds no token ranked below B at any depth (its better-ranked siblings would all
        come first), so the tree is the same up to which of two tokens of equal log-probability
        it keeps (the builder breaks ties by token id, and a shorter list may have cut the
        lower id; the output law does not depend on the tree), and under ``auto`` a round built
        at 16 nodes of a 65 capacity does not rank 64 tokens per depth (~2 % of a
        concurrency-1 step on the CPU server, py-spy).

        When the draft runner replayed its CUDA graph (``out.can_run_graph``), the top-k were
        computed inside it by the folded head (``graphs.TevDraftHead``, static buffers, the whole
        block); otherwise the same function runs eagerly on the forward's hidden states of the
        depths read. A DFlash2 drafter with a non-neutral transform gets its full-vocabulary logits
        transformed first (``dflash2.transformed_candidate_topk``, marginal mode)."""
        block = self.block_size if block is None else int(block)
        depth = block - 1 if depth is None else int(depth)
        target_model = self.target_worker.model_runner.model
        lm_head = unwrap_lora_layer(target_model.lm_head)
        topk_fn = self._tev_draft.marginal_topk_fn(candidate_topk)
        k = self.tev.topk if budget is None else min(self.tev.topk, 1 << max(0, int(budget) - 1).bit_length())

        def head_fn(draft_out, bs):
            head = getattr(self, "_draft_sampler", None)
            if isinstance(head, TevDraftHead) and getattr(draft_out, "can_run_graph", False):
                logq, ids = head.read(bs)  # computed inside the replayed draft graph
                return logq[:, :depth], ids[:, :depth]
            hidden = draft_out.logits_output.hidden_states
            return draft_topk_from_hidden(hidden, block, lm_head, k, topk_fn=topk_fn, depth=depth)

        return self._draft_block(batch, draft_input, seq_lens_cpu, seq_lens_sum, head_fn, block)

    def _draft_lattice(self, batch, draft_input, seq_lens_cpu, seq_lens_sum):
        """Draft block forward (SGLang's DFlash2 model: conv included) -> the selector lattice
        (candidate_ids int64 [bs, K-1, k], trans_logq float32 [bs, K-1, k, k]), eagerly on the
        forward's hidden states (``dflash2.selector_lattice_from_hidden``), anchored at the
        block's root (the bonus token)."""
        anchor = draft_input.bonus_tokens.view(-1)

        def head_fn(draft_out, bs):
            hidden = draft_out.logits_output.hidden_states
            return selector_lattice_from_hidden(hidden, self.block_size, self.draft_model, anchor)

        return self._draft_block(batch, draft_input, seq_lens_cpu, seq_lens_sum, head_fn)

    def _draft_block(self, batch, draft_input, seq_lens_cpu, seq_lens_sum, head_fn, block=None):
        """The draft block ``[root, MASK x (K'-1)]`` (``block`` = K' tokens, default K) forward on
        the draft runner, then ``head_fn(draft_out, bs)`` inside the same inference / draft-TP
        scope; returns its result. The block's KV goes to the first K' slots of each request's
        window (SGLang reserved the capacity's)."""
        bs = len(batch.seq_lens)
        K = self.block_size if block is None else int(block)
        dev = self.device
        prefix = batch.seq_lens
        target_model = self.target_worker.model_runner.model
        embed = unwrap_lora_layer(_resolve_dflash_embedding_module(self.draft_model, target_model))

        block_ids = torch.full((bs, K), int(self._mask_token_id), dtype=torch.int64, device=dev)
        block_ids[:, 0] = draft_input.bonus_tokens.view(-1)
        positions = (prefix.view(bs, 1).to(torch.int64) + self._block_pos_offsets[:K].view(1, K)).reshape(-1)
        cache_loc = self._window_locs(batch, K)
        if self._full_embed_gpu is not None:
            emb = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            emb = embed(block_ids)
        if self._noise_embed_scale != 1.0:
            emb = emb * self._noise_embed_scale
        seq_lens_cpu = seq_lens_cpu + K  # host bound: committed prefix + the block (as DFlash)
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            seq_lens_cpu=seq_lens_cpu,
            write_virtual=cache_loc,
            read_extent=K,
        )
        spec_info = self._block_spec_infos.get(K)  # the attention backend reads the block's length from it
        if spec_info is None:
            spec_info = self._block_spec_infos[K] = make_draft_block_spec_info(draft_token_num=K, device=dev)
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            out_cache_loc=cache_loc,
            seq_lens_sum=seq_lens_sum + bs * K,
            seq_lens_cpu=seq_lens_cpu,
            positions=positions,
            input_embeds=emb.view(-1, emb.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * K, dtype=torch.int32, device=dev) if enable_num_token_non_padded() else None
            ),
            global_num_token_non_padded_cpu=bs * K,
            can_run_decode_cuda_graph=getattr(batch, "can_run_decode_cuda_graph", False),  # read only under MLP sync
        )
        plan.bind(fb, self.draft_model_runner.kv_index_translator)
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(fb)
            return head_fn(draft_out, bs)
