"""``TEVWorker``: SGLang's DFlash V2 worker with the decode round replaced by TEV (imports sglang).

Runs on CUDA (FlashInfer / Triton apply the tree mask; ``scripts/sglang_smoke.py`` is the GPU
check; what has been verified where is in docs/sglang.md) and on CPU with ``--attention-backend tev_cpu``, where
CI runs it inside SGLang's real Engine and HTTP server (``tests/engine/test_sglang_engine.py``,
``test_sglang_server.py``, ``test_sglang_kv_edges.py``, ``test_sglang_penalties.py``). The tensor
logic it calls lives in ``round.py`` (tested alone); this file wires it between SGLang's forwards.

Reused from ``DFlashWorkerV2`` unchanged: construction (draft runner, mask token, embeddings),
memory pools, attention backends, the draft runner's CUDA graphs, the prefill branch (target
prefill with auxiliary hidden capture + draft-KV materialisation), the idle branch,
``DFlashDraftInputV2`` (KV over-allocation in ``prepare_for_decode``, filter/merge), the
prefix-valid draft-KV writer (fed every draft layer's K/V at once: ``draft_kv.py``, SGLang's fused
Triton writer on CUDA) and SGLang's verify logit adjustments (logit bias; penalties are
applied per node by ``penalties.py`` on SGLang's penalizer state). Replaced: the decode round, as

    draft block [root, MASK x (K-1)] -> draft hidden -> per-depth top-k + logsumexp
    -> batched DDTree (round.build_trees) -> verify layout (tokens, positions, FULL custom mask,
    retrieve arrays) -> target TARGET_VERIFY forward (FlashInfer / Triton apply the mask)
    -> penalties per node -> SGLang logit adjustments -> processed target law from batch.sampling_info
    -> verify_tree batched (tev / predraw / sequential; greedy at T = 0) -> accepted drafts counted
    -> accepted path's KV slots and hidden rows moved to the front of each window
    -> draft-KV append with the commit lengths -> GenerationBatchResult

A round planned as a plain step for the whole batch (``SGLANG_TEV_BUDGET=auto``, budget 0) drafts
nothing and, without target CUDA graphs, runs the target as SGLang's own DECODE forward
(``_decode_forward``); its token is drawn as the verifier draws a root-only tree's (without
building one where the batch needs no tree: ``_plain_step``, ``plain_step.py``) and its drafter KV is held, then written with the other held steps' at once before the drafter next reads
its pool (``draft_kv.PendingDraftKV``). With CUDA graphs, ``auto`` captures a target verify graph per
tree-size tier (``graph_tiers``: 1 node for a plain step, ..., N) and each round replays its width's.

DFlash2 checkpoints (SGLang's ``DFlash2DraftModel``: conv, transform, candidate selector) are
served or refused at construction (``dflash2.resolve_draft_serving``); in lattice mode the
per-depth top-k step is replaced by SGLang's selector lattice with normalised rows
(``dflash2.selector_lattice_from_hidden``) and the DDTree by the lattice tree
(``round.build_lattice_trees``); in marginal mode the top-k is taken of the transformed
full-vocabulary logits (``dflash2.transformed_candidate_topk``). Everything after the tree is the
same round.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import torch
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments, parse_dflash_draft_config
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout
from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets, make_draft_block_spec_info
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

from ..env import check_environment
from ..hf.plan_cache import enabled as plan_cache_enabled
from ..tree import root_only_tree
from ..verify import num_uniforms
from .config import RAGGED_VERIFY_BACKENDS, settings_from_server_args, verify_layout_for
from .dflash2 import DraftServing, resolve_draft_serving
from .draft_kv import PendingDraftKV, held_writes_refusal, install_context_kv_writer
from .graphs import build_tev_draft_head, graph_padded_batch_size, pad_tree_mask
from .graph_tiers import build_tier_backends, capture_tiers, wanted_tier_sizes
from .budget import ServedBudget
from .draft_block import DraftBlockMixin
from .plain_step import PlainStepMixin
from .plan_store import SAVE_EVERY, ServedPlanStore, served_key
from .kv_headroom import check_row_headroom
from .meta_info import META_INFO_KEYS, RoundLog, round_info_to_host
from .penalties import apply_tree_penalties, count_accepted
from .round import (
    adopt_rank0_decision,
    build_lattice_trees,
    build_trees,
    commit_outputs,
    compact_rows,
    ragged_pack,
    request_depth_caps,
    sampling_params_from_info,
    as_float32,
    seeded_uniforms,
    tree_verify_layout,
    verify_batch,
)

__all__ = ["TEVWorker", "META_INFO_KEYS"]

logger = logging.getLogger(__name__)


class _DropBlockSizeNotice(logging.Filter):
    """Drops DFlash's "block size mismatch" warning (``dflash_worker_v2.py:517-522``) while the
    parent constructor runs: it sizes the block from ``speculative_num_draft_tokens``, which TEV
    uses for the tree size N, and TEV sets the drafter's own block size right after."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("DFLASH block size mismatch")


def _host_seq_lens(batch) -> tuple[torch.Tensor, int]:
    """(committed lengths int [bs] in host memory, their sum) as the scheduler already keeps them
    (``prepare_for_decode``; with overlap, ``FutureMap.resolve_seq_lens_cpu``). A future map built
    without host lengths (``needs_cpu_seq_lens=False``) leaves them unset; the tree mask's size
    needs them, so that case pays one device-to-host copy here."""
    seq_lens_cpu = batch.seq_lens_cpu
    if seq_lens_cpu is None:
        seq_lens_cpu = batch.seq_lens.cpu()
        return seq_lens_cpu, int(seq_lens_cpu.sum())
    seq_lens_sum = batch.seq_lens_sum
    return seq_lens_cpu, int(seq_lens_sum) if seq_lens_sum is not None else int(seq_lens_cpu.sum())


def _row_temperatures(sampling, reqs) -> list[float]:
    """Per request, its temperature for the planner's calibration regime (0 = greedy: SGLang
    stores a greedy request as top_k = 1, temperature = 1), read on the host: from the round's
    scalar :func:`sampling_params_from_info`, else from the requests' own sampling params (the
    per-row tensors were built from them; reading the tensors would be a device read a round)."""
    t = sampling.temperature
    if not torch.is_tensor(t):
        return [float(t)] * len(reqs)
    return [0.0 if r.sampling_params.top_k <= 1 else as_float32(r.sampling_params.temperature) for r in reqs]


class TEVWorker(PlainStepMixin, DraftBlockMixin, DFlashWorkerV2):
    """DFlash V2 worker whose decode round drafts a DDTree and verifies it with TEV."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        check_environment()  # an unknown SGLANG_TEV_* name (a typo) is refused before any model loads
        dflash_logger = logging.getLogger(DFlashWorkerV2.__module__)
        notice = _DropBlockSizeNotice()
        dflash_logger.addFilter(notice)
        try:
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
        finally:
            dflash_logger.removeFilter(notice)
        if torch.device(self.device).type == "cpu":
            # the drafter's fused Triton q/k-norm + RoPE (models/dflash.py:383) has no CPU path;
            # the flag selects the unfused torch path of the same computation
            for module in self.draft_model.modules():
                if hasattr(module, "use_table_qk_norm_rope"):
                    module.use_table_qk_norm_rope = False
        self.tev = settings_from_server_args(get_spec())
        self._row_headroom_checked = False  # the pools exist only after the workers are built
        # DFlash sizes its block from speculative_num_draft_tokens, which TEV uses for N.
        self.block_size = self.tev.block_size
        self.draft_model.set_block_size(self.block_size)
        self._block_pos_offsets = build_block_pos_offsets(length=self.block_size, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(draft_token_num=self.block_size, device=self.device)
        # the draft block's spec info per block length (auto cuts it: draft_block.py), the whole block's SGLang's own
        self._block_spec_infos, self._block_cut = {self.block_size: self._draft_block_spec_info}, None
        self.speculative_num_draft_tokens = self.tev.tree_size
        # the drafter's context KV of every layer at once (draft_kv.py; SGLang's per-layer path otherwise)
        kv_writer = install_context_kv_writer(self)
        # identical seeds on every TP rank, so ranks draw identical uniforms
        self._tev_generator = torch.Generator(device=self.device)
        self._tev_generator.manual_seed(int(getattr(server_args, "random_seed", 0) or 0))
        # every DFlash2 feature of the checkpoint is served or refused here, before any graph capture
        self._tev_draft: DraftServing = resolve_draft_serving(
            self.draft_model, parse_dflash_draft_config(draft_hf_config=self.draft_model_runner.model_config.hf_config)
        )
        if self._tev_draft.mode == "lattice":
            # compute_candidates reads the target head from the draft model (SGLang attaches it the
            # same way, dflash_worker_v2.py:911 and :1484-1485)
            self.draft_model.lm_head = unwrap_lora_layer(self.target_worker.model_runner.model.lm_head)
        # SGLANG_TEV_BUDGET=auto: one tree width per round (budget.py); auto-ragged: also each request's
        # own size, verified in one ragged forward where the backend takes it; fixed: N - 1.
        # Under TP rank 0 decides and every rank adopts its plans (broadcast on the TP CPU group)
        self._served_budget = None
        self._plan_store = None  # rank 0's plan cache under auto (srt/plan_store.py), opened at the first decode
        self._tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        if self.tev.budget_mode != "fixed":
            broadcast = None
            if self._tp_size > 1:
                from sglang.srt.distributed import get_tp_group

                group = get_tp_group()
                broadcast = lambda obj: group.broadcast_object(obj, src=0)  # noqa: E731
            # the layout (ragged or one width per round) is read from the target's attention backend
            # at the first decode: SGLang builds that backend after the draft worker
            self._served_budget = ServedBudget(self.tev.budget, self.block_size, broadcast=broadcast,
                                               leader=get_parallel().tp_rank == 0)
            self._layout_resolved = False
        # plain steps' drafter-KV writes, held until the drafter next reads its pool (draft_kv.py),
        # unless SGLang also copies that pool outside the worker (checked again at the first decode)
        held_refusal = held_writes_refusal(self)
        self._draft_kv_pending = PendingDraftKV() if held_refusal is None else None
        # auto on CUDA: a target verify graph runner per tree-size tier (graph_tiers), built at start-up
        self._tier_backends, self._graph_tiers = {}, None
        self._plain_info = {}  # batch size -> a plain step's customized_info values (the same every step)
        # the TEV line of the periodic log (rank 0 only), at SGLang's decode-log cadence
        self._round_log = (
            RoundLog(max(1, int(getattr(server_args, "decode_log_interval", 40) or 40)), logger)
            if get_parallel().tp_rank == 0
            else None
        )
        if get_parallel().tp_rank == 0:
            logger.info("TEV worker: %s; drafter context KV: %s; plain steps' drafter KV: %s", self.tev, kv_writer,
                        "held until the next draft or prefill" if held_refusal is None else f"written each step ({held_refusal})")
            if self._tev_draft.selector_top_k and self._tev_draft.mode == "marginal":
                # asked for (SGLANG_TEV_DFLASH2_MODE=marginal), but never silent: the selector is unused
                logger.warning("TEV DFlash2 drafter: %s", self._tev_draft.describe())
            elif not self._tev_draft.plain:
                logger.info("TEV DFlash2 drafter: %s", self._tev_draft.describe())

    def _maybe_build_draft_sampler(self):
        """TEV's head in DFLASH's draft-graph slot (``dflash_worker_v2.py:884-998``, called by
        ``init_cuda_graphs`` before the draft runner captures): per-depth top-k + log-sum-exp into
        static buffers (``graphs.TevDraftHead``, with the DFlash2 transform in marginal mode); None
        keeps it eager. A DFlash2 drafter in lattice mode keeps its head eager (the draft forward,
        conv included, still replays in the draft graph): SGLang's selector walk is never folded."""
        return build_tev_draft_head(self)

    def init_attention_backends(self):
        """DFlash's, then one private target backend per graph tier under auto (``graph_tiers``)."""
        super().init_attention_backends()
        self._tier_backends = build_tier_backends(self.target_worker.model_runner, wanted_tier_sizes(self.tev, self.device),
                                                  self.tev.tree_size)

    def init_cuda_graphs(self):
        """DFlash's (the draft graphs), then the target's verify graphs at each tier below N, after
        SGLang captured N's; the planner's budgets become the tiers'."""
        super().init_cuda_graphs()
        self._graph_tiers = capture_tiers(self.target_worker.model_runner, self._tier_backends, self.tev.tree_size,
                                          served=self._served_budget, log_rank0=get_parallel().tp_rank == 0)

    def _validate_phase1_sampling_support(self, batch) -> None:
        """No-op. DFlash's check (``dflash_worker_v2.py:2287-2317``) warns that sampled requests
        fall back to greedy argmax verification on builds without its sampling-verify kernel;
        TEV verifies every request under its own processed target law, so nothing falls back."""
        return None

    # ------------------------------------------------------------------ entry
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            self._flush_draft_kv()  # before the prefill writes (and may reuse freed slots of) the drafter's pool
            return super().forward_batch_generation(batch, on_publish, grammar_barrier, pp_proxy_tensors)
        return self._tev_decode(batch, on_publish, grammar_barrier)

    def _flush_draft_kv(self) -> None:
        """Write the drafter KV that plain steps held (``draft_kv.PendingDraftKV``), oldest first,
        in one prefix-valid write."""
        pending = self._draft_kv_pending
        held = pending.take() if pending is not None else None
        if held is not None:
            self._append_target_hidden_to_draft_kv_by_loc(**held)

    # ------------------------------------------------------------------ the round
    def _first_auto_decode(self, served: ServedBudget) -> None:
        """The verify layout: under ``auto-ragged`` per-request tree sizes (ragged verify) where the
        target's attention backend takes them, else one width per round for the batch; said once,
        on rank 0, which also restores what an earlier server learned (``SGLANG_TEV_PLAN_CACHE``,
        :mod:`sglang_tev.srt.plan_store`)."""
        runner = self.target_worker.model_runner
        served.layout = "padded"
        if self.tev.budget_mode == "auto-ragged":  # per-request sizes where the backend takes them
            served.layout = verify_layout_for(runner.attn_backend)
        self._layout_resolved = True
        if get_parallel().tp_rank != 0:
            return
        if plan_cache_enabled():
            key = served_key(runner.model, self.draft_model, runner.model_config.dtype, self.device,
                             tp_size=self._tp_size, attn_backend=runner.attn_backend, layout=served.layout,
                             capacity=served.capacity, block_size=self.block_size, grid=served.grid,
                             graphs=self._graph_tiers is not None)
            self._plan_store = ServedPlanStore(key)
            laws = self._plan_store.load_into(served)
            logger.info("TEV plan cache: %s", f"restored {', '.join(laws)}" if laws else "nothing to restore yet")
        if served.layout == "ragged":
            logger.info("TEV: SGLANG_TEV_BUDGET=auto-ragged sizes each request's tree (ragged verify)")
        elif self.tev.budget_mode == "auto-ragged":
            logger.warning("TEV: SGLANG_TEV_BUDGET=auto-ragged gives one tree width per round for the batch: the "
                           "attention backend takes no ragged verify (per-request sizes need one of %s)",
                           ", ".join(RAGGED_VERIFY_BACKENDS))

    def _window_locs(self, batch, width: int) -> torch.Tensor:
        """The KV slots (virtual, int64 [bs * width], row-major) of positions ``seq_lens[b] ..
        seq_lens[b] + width - 1`` of every request: the window a forward of ``width`` tokens a
        request writes (SGLang reserved them in ``prepare_for_decode``)."""
        prefix = batch.seq_lens
        return assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix,
            end_offset=prefix + width,
            batch_size=len(prefix),
            draft_token_num=width,
            device=self.device,
        )

    def _verify_forward(self, batch, layout, N, seq_lens_cpu, seq_lens_sum, graph_runner, pack=None):
        """The target's TARGET_VERIFY forward over this round's trees (``layout``: N nodes a request
        and their custom mask) through DFlash's verify input; with CUDA graphs a root-only round
        takes it too (the graph is captured for TARGET_VERIFY). With ``pack`` (a
        :class:`~sglang_tev.srt.round.RaggedPack`, eager only) request b verifies only its first
        ``pack.lens[b]`` nodes, packed, through SGLang's ``RaggedVerifyLayout``; they are written to
        the first slots of its window. Returns (the target worker's ``GenerationBatchResult``, the
        whole window's ``KVLocPlan``)."""
        bs = len(batch.seq_lens)
        prefix = batch.seq_lens
        out_cache_loc = self._window_locs(batch, N)
        kv_plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            seq_lens_cpu=seq_lens_cpu + N,
            write_virtual=out_cache_loc,
            read_extent=N,
        )
        # a graph replay pads the batch to its bucket with seq_len = the backend's fill value;
        # give those rows an all-True mask segment, so the static mask buffer is defined everywhere
        padded_bs = graph_padded_batch_size(bs, graph_runner)
        custom_mask = layout.custom_mask
        if padded_bs is not None:
            custom_mask = pad_tree_mask(custom_mask, bs, padded_bs, N, int(graph_runner.seq_len_fill_value))
        ragged = {}
        if pack is not None:
            t = sum(pack.lens)
            ragged = dict(kv_loc_cols=pack.cols, ragged_verify_layout=RaggedVerifyLayout(
                verify_lens=pack.indptr.diff(), graph_num_tokens=t, extend_start_loc=pack.indptr[:-1],
                qo_indptr_device=pack.indptr, verify_lens_cpu=pack.lens, total_verify_tokens=t, max_q_len=max(pack.lens)))
            out_cache_loc, custom_mask = out_cache_loc[pack.cols], pack.custom_mask
        verify_input = DFlashVerifyInput(
            draft_token=layout.draft_token if pack is None else pack.draft_token,
            positions=layout.positions if pack is None else pack.positions,
            draft_token_num=N,
            custom_mask=custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=kv_plan,
            **ragged,
        )
        batch.out_cache_loc = out_cache_loc
        # backend planning reads a host bound of committed prefix + window, as in DFlash's verify;
        # the mask's per-request offsets come from the device seq_lens (the committed prefix).
        # prepare_for_verify asks the target graph runner's can_run_graph and, when it can, runs its
        # load_batch (static slots, bucket padding, the backend's replay metadata with this mask)
        saved = (batch.seq_lens_cpu, batch.seq_lens_sum)
        batch.seq_lens_cpu = seq_lens_cpu + N
        batch.seq_lens_sum = seq_lens_sum + bs * N
        try:
            fb, _ = verify_input.prepare_for_verify(batch, self.target_worker)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = saved
        target_out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=fb, is_verify=True, skip_attn_backend_init=True
        )
        return target_out, kv_plan

    def _decode_forward(self, batch, roots, seq_lens_cpu, seq_lens_sum):
        """A plain step for the whole batch as SGLang's own DECODE forward: each request's root
        (last round's bonus token, int64 [bs]) at position ``seq_lens[b]``, attention over the
        committed prefix and itself, no verify input, no custom mask, the target's DFlash layers
        captured (``CaptureHiddenMode.FULL``) for the drafter's KV. Its logits and KV slot are
        those of the TARGET_VERIFY forward of a root-only tree; only the forward's set-up is
        SGLang's plain decoding's. Used only without target CUDA graphs (they are captured for
        TARGET_VERIFY). Returns (the target worker's ``GenerationBatchResult``, the ``KVLocPlan``
        of the written slot)."""
        bs = len(batch.seq_lens)
        prefix = batch.seq_lens
        runner = self.target_worker.model_runner
        out_cache_loc = self._window_locs(batch, 1)
        seq_lens = prefix + 1  # DECODE counts the new token in seq_lens (positions = seq_lens - 1)
        kv_plan = runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu + 1,
            write_virtual=out_cache_loc,
            read_extent=0,
        )
        batch.out_cache_loc = out_cache_loc
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=roots,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=seq_lens_sum + bs,
            seq_lens_cpu=seq_lens_cpu + 1,
            positions=prefix.to(torch.int64),
            sampling_info=batch.sampling_info,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            num_token_non_padded=(
                torch.full((), bs, dtype=torch.int32, device=self.device) if enable_num_token_non_padded() else None
            ),
            global_num_token_non_padded_cpu=bs,
        )
        kv_plan.bind(fb, runner.kv_index_translator)
        target_out = self.target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)
        return target_out, kv_plan

    def _write_draft_kv(self, hidden, cache_loc, positions, commit_lens, width: int) -> None:
        """The drafter KV of a round's committed tokens (SGLang's prefix-valid writer: request b's
        first ``commit_lens[b]`` of its ``width`` window rows). A plain step's (width 1) is held and
        written when the drafter next reads its pool (:class:`draft_kv.PendingDraftKV`)."""
        pending = self._draft_kv_pending
        if width == 1 and pending is not None:
            pending.add(hidden, cache_loc, positions, commit_lens)
            if pending.full:
                self._flush_draft_kv()
            return
        self._append_target_hidden_to_draft_kv_by_loc(target_hidden=hidden, cache_loc=cache_loc, cache_loc_2d=cache_loc.view(-1, width),
                                                      positions=positions, commit_lens=commit_lens)

    def _observe(self, served, round_plan, reach_cum, reach_nodes) -> None:
        """The planner's record of this round (under ``auto``); rank 0 keeps what it learned every
        ``SAVE_EVERY`` rounds."""
        if served is None:
            return
        served.observe(round_plan, reach_cum, reach_nodes)
        if self._plan_store is not None and served.rounds % SAVE_EVERY == 0:
            self._plan_store.save_from(served)

    def _report(self, logits_output, info: dict) -> None:
        """The round's ``customized_info`` (meta_info.py) and the periodic log line's record."""
        logits_output.customized_info = info
        if self._round_log is not None:
            self._round_log.record(info)

    def _target_logits(self, target_out) -> tuple[LogitsProcessorOutput, torch.Tensor]:
        """The target forward's output and its logits [rows, V], gathered across TP ranks where
        SGLang deferred the gather (``is_deferred_shard``)."""
        logits_output: LogitsProcessorOutput = target_out.logits_output
        logits = logits_output.next_token_logits
        target_lp = self._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(logits):
            logits = target_lp.finish_deferred_gather(logits)
            logits_output.next_token_logits = logits
        return logits_output, logits

    def _tev_decode(self, batch, on_publish, grammar_barrier=None):
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError("TEV expected DFlashDraftInputV2 state on the running batch")
        bs = len(batch.seq_lens)
        capacity = self.tev.tree_size  # N: what SGLang reserves per request
        dev = self.device
        prefix = batch.seq_lens
        served = self._served_budget
        if served is not None and not self._layout_resolved:
            self._first_auto_decode(served)
        # the batch's target law picks the planner's controller (a host flag: no device read)
        round_plan = served.plan(bs, bool(batch.sampling_info.is_all_greedy)) if served is not None else None
        budget = self.tev.budget if round_plan is None else round_plan.budget
        if prefix.is_cuda:
            # carried over from the previous overlap step, possibly made on another stream (as DFlash)
            prefix.record_stream(torch.cuda.current_stream(prefix.device))
        seq_lens_cpu, seq_lens_sum = _host_seq_lens(batch)
        if not self._row_headroom_checked:
            # the scheduler builds SGLang's HiCache draft plan after the worker: holding stops if it copies the pool
            refusal = held_writes_refusal(self) if self._draft_kv_pending is not None else None
            if refusal is not None:
                self._flush_draft_kv()
                self._draft_kv_pending = None
                if get_parallel().tp_rank == 0:
                    logger.info("TEV: plain steps write the drafter KV each step (%s)", refusal)
            # every slot a step reserves near the context length must lie inside the request's row
            check_row_headroom(
                row_len=self.model_runner.req_to_token_pool.req_to_token.shape[1],
                context_len=self.target_worker.model_runner.model_config.context_len,
                tree_size=capacity,
                block_size=self.block_size,
                page_size=self.model_runner.token_to_kv_pool_allocator.page_size,
            )
            self._row_headroom_checked = True

        if budget == 0 and self._lean_plain_step_fits(batch):
            return self._plain_step(batch, draft_input, served, round_plan, seq_lens_cpu, seq_lens_sum, on_publish)

        # 1) draft -> tree
        # no node may sit at a position past the model's context (a request near its end gets a
        # shallower tree, root-only at the last position)
        roots = draft_input.bonus_tokens.view(-1).to(torch.int64)
        drafted = None
        caps = None
        if budget > 0:
            self._flush_draft_kv()  # the draft forward reads the drafter KV of every committed token
            caps = request_depth_caps(prefix, self.tev.max_depth, self.target_worker.model_runner.model_config.context_len)
        if budget == 0:
            # a plain decoding step (SGLANG_TEV_BUDGET=auto): nothing drafted. The draft KV of the
            # committed token is held at commit, written before the next draft reads it.
            tree = root_only_tree(roots)
        elif self._tev_draft.mode == "lattice":
            # DFlash2: DDTree over the selector lattice (parent-dependent child lists)
            cand, trans_logq = self._draft_lattice(batch, draft_input, seq_lens_cpu, seq_lens_sum)
            tree = build_lattice_trees(cand, trans_logq, budget, roots, self.tev.max_depth, depth_cap=caps)
            drafted = SimpleNamespace(candidate_ids=cand, transition_logq=trans_logq)
        else:
            # the depths a tree of this budget reaches (and under auto a block cut to them)
            block, depth = self._draft_extent(budget, cut=round_plan is not None)
            logq, ids = self._draft_topk(batch, draft_input, seq_lens_cpu, seq_lens_sum, block, depth, budget)
            tree = build_trees(logq, ids, budget, roots, depth, depth_cap=caps)
            drafted = (logq, ids)
        sampling_info = batch.sampling_info
        sampling = sampling_params_from_info(sampling_info, batch.reqs)  # this round's target law (scalars when shared)
        if served is not None and drafted is not None:
            round_plan, tree = served.refine(round_plan, tree, drafted, _row_temperatures(sampling, batch.reqs))
        N = tree.num_nodes  # this round's width: the capacity with a fixed budget
        tiers = self._graph_tiers  # auto on CUDA: the round's width replays its tier (None: eagerly)
        graph_runner = tiers.runner_for(N) if tiers is not None else getattr(self.target_worker.model_runner, "decode_cuda_graph_runner", None)
        # a root-only round (a plain step) without target graphs runs as SGLang's DECODE forward;
        # a graph captured for TARGET_VERIFY (with its mask) is replayed with one
        decode = N == 1 and graph_runner is None
        # the verify layout; a DECODE step needs it only for the grammar's walk (and no mask)
        layout = None if decode and not batch.has_grammar else tree_verify_layout(tree, prefix, seq_lens_sum, with_mask=not decode)
        # grammar: SGLang walks each request's tree (retrieve links; padded nodes are left out)
        # with its grammar state and fills one vocabulary mask per node (spec_utils.traverse_tree)
        grammar_tree = (
            GrammarTree.from_device(layout.retrieve_next_token, layout.retrieve_next_sibling, layout.draft_token.view(bs, N))
            if batch.has_grammar
            else None
        )

        # 2) target verify over the tree (request b's first lens[b] nodes only, where the plan is ragged)
        pack = None
        if not decode and graph_runner is None and round_plan is not None and round_plan.ragged:
            lens = [min(b + 1, N) for b in round_plan.budgets]
            pack = ragged_pack(tree, layout, prefix, lens, seq_lens_cpu.tolist())
        with tiers.bound(N) if tiers is not None else contextlib.nullcontext():
            if decode:  # a plain step for the whole batch: no verify input, no custom mask
                target_out, kv_plan = self._decode_forward(batch, roots, seq_lens_cpu, seq_lens_sum)
            else:
                target_out, kv_plan = self._verify_forward(batch, layout, N, seq_lens_cpu, seq_lens_sum, graph_runner, pack)
        if tiers is not None and target_out.can_run_cuda_graph:
            tiers.replayed(N)
        logits_output, logits = self._target_logits(target_out)
        if pack is not None:  # back to the [bs * N] node rows the round reads (cut nodes: a root's, never reached)
            for name in ("next_token_logits", "hidden_states"):
                setattr(logits_output, name, getattr(logits_output, name).index_select(0, pack.expand))
            logits = logits_output.next_token_logits
        grammar_mask = None
        if grammar_tree is not None:
            grammar_mask = build_grammar_vocab_mask(
                reqs=batch.reqs, tree=grammar_tree, sampling_info=sampling_info, device=logits.device, barrier=grammar_barrier
            )
        # penalties / min_new_tokens: node v's law after the committed output + path(v), from
        # SGLang's penalizer state (the root is fed to it first); then logit bias, as its sampler
        penalizer = apply_tree_penalties(logits, tree, sampling_info)
        apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=sampling_info, draft_token_num=N)
        if grammar_mask is not None:
            # node v's row allows what the grammar allows after the path to v: the target law the
            # verifier sees is the constrained law plain decoding samples from
            grammar_mask.apply(logits)

        # 3) exact verification on the processed target law
        uniforms = None
        seeds = getattr(sampling_info, "sampling_seed", None)
        all_greedy = bool(getattr(sampling_info, "is_all_greedy", False))  # a host flag: no read
        if seeds is not None and not all_greedy:
            uniforms = seeded_uniforms(seeds, prefix, num_uniforms(self.tev.verifier, N))
        out = verify_batch(tree, logits, sampling, self.tev.verifier, generator=self._tev_generator, uniforms=uniforms)
        site = SpecTpSyncSite.DFLASH_ACCEPT_GREEDY if all_greedy else SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
        if self._tp_sync.enabled(site):  # TP > 1 (SGLANG_SPEC_TP_SYNC, default all): rank 0 decides
            out = adopt_rank0_decision(tree, out, lambda t: self._tp_sync.sync(site, t))
        plan = commit_outputs(tree, out, prefix)
        if penalizer is not None:  # the accepted drafts join the penalty state (the bonus: next root)
            count_accepted(penalizer, plan.out_tokens, plan.commit_lens - 1)
        if batch.return_logprob:
            # the emitted token of path node d is out_tokens[b, d] (the next drafted token, then
            # the bonus); its logprob is read from that node's processed verify logits
            # (a scatter with a spare slot for off-path entries: boolean indexing would sync)
            width = plan.accept_index.shape[1]
            predict = torch.zeros(bs * N + 1, dtype=torch.int64, device=dev)
            slot = torch.where(plan.accept_index >= 0, plan.accept_index, bs * N)
            predict.scatter_(0, slot.reshape(-1), plan.out_tokens[:, :width].reshape(-1))
            compute_spec_logprobs(batch, logits_output, predict[: bs * N], accept_index=plan.accept_index)

        # 4) commit: accepted path to the front of each window (KV and hidden rows)
        target_ids = kv_plan.write_ids(self.model_runner.kv_index_translator)  # physical slots of the window
        if N > 1:
            src = target_ids[plan.src_rows.reshape(-1)]
            dst = target_ids[plan.dst_rows.reshape(-1)]
            self.model_runner.token_to_kv_pool_allocator.get_kvcache().move_kv_cache(dst, src)
            hidden = compact_rows(logits_output.hidden_states, plan)
        else:  # a root-only round (a plain step): the path is the root, already at the front
            hidden = logits_output.hidden_states
        if on_publish is not None:
            on_publish(plan.new_seq_lens)
        commit_positions = (prefix.view(bs, 1).to(torch.int64) + torch.arange(N, device=dev).view(1, N)).reshape(-1)
        self._write_draft_kv(hidden, self._draft_write_ids(kv_plan), commit_positions, plan.commit_lens, N)
        logits_output.hidden_states = None
        if served is not None and drafted is not None:  # the round's one host read: the planner's cost and reach labels
            dec = out.host(tree, reach_at=list(round_plan.reach_at), reach_nodes=True)
            self._observe(served, round_plan, dec.reach_cum, dec.reach_nodes)
        else:  # a plain step: its cost only, nothing to read
            self._observe(served, round_plan, None, None)
        tree_budgets = tree.valid.sum(dim=1) - 1  # drafted nodes of each request's tree (fewer at the context's end)
        self._report(logits_output, round_info_to_host(plan.commit_lens, out.accept_len, out.coverage, tree_budgets))
        next_draft_input = self._make_next_draft_input_decode(bonus_tokens=out.bonus, new_seq_lens=plan.new_seq_lens)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=plan.out_tokens.reshape(-1),
            accept_lens=plan.commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=capacity,
            speculative_output_stride=N,  # this round's width: SGLang reads row b at b * N
            new_seq_lens=plan.new_seq_lens,
        )
