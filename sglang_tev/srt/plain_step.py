"""A plain decoding step for the whole batch without the round's tree machinery (imports sglang).

Mixed into ``TEVWorker`` (``worker.py``), whose round calls :meth:`PlainStepMixin._plain_step`
when the planner gives every request budget 0 and :meth:`~PlainStepMixin._lean_plain_step_fits`
holds. It uses the worker's own parts: ``_decode_forward`` (SGLang's DECODE forward),
``_target_logits``, ``_write_draft_kv`` (the held drafter-KV write), ``_observe``, ``_report``,
SGLang's ``_draft_write_ids`` / ``_make_next_draft_input_decode``, and its settings (``tev``),
generator, TP sync, graph tiers and ``_plain_info`` (per batch size, a plain step's meta-info values).
"""

from __future__ import annotations

import torch
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite

from ..spec import is_scalar_greedy
from ..verify import num_uniforms
from ..verify._common import argmax_last
from ..verify.tev import tev_root_bonus
from .meta_info import plain_round_host, round_columns
from .penalties import batch_penalizer
from .round import sampling_params_from_info, seeded_uniforms

__all__ = ["PlainStepMixin"]


class PlainStepMixin:
    """``TEVWorker``'s plain step for the whole batch (see the module doc)."""

    def _lean_plain_step_fits(self, batch) -> bool:
        """Whether a plain step for the whole batch can skip the round's tree machinery
        (:meth:`_plain_step`): no grammar, logprobs or penalties (each walks the tree's nodes),
        the TEV verifier (its root-only draw is :func:`tev_root_bonus`), and a DECODE forward
        (no target CUDA graph: those are captured for TARGET_VERIFY). Host flags only."""
        if batch.has_grammar or batch.return_logprob or self.tev.verifier != "tev":
            return False
        tiers = self._graph_tiers
        runner = tiers.runner_for(1) if tiers is not None else getattr(self.target_worker.model_runner, "decode_cuda_graph_runner", None)
        return runner is None and batch_penalizer(batch.sampling_info) is None

    def _plain_step(self, batch, draft_input, served, round_plan, seq_lens_cpu, seq_lens_sum, on_publish):
        """A plain decoding step for the whole batch (every budget 0), as the round on root-only
        trees computes it without building them: SGLang's DECODE forward of each request's root,
        its logit adjustments, the bonus drawn by :func:`tev_root_bonus` from the same uniform
        column (the same token, field for field the same result: ``tests/srt/test_srt_plain_step.py``),
        the drafter-KV write held, and a result whose rows hold one token each
        (``speculative_output_stride`` 1; a tree round's rows hold its width). Only where
        :meth:`_lean_plain_step_fits`. On the CPU server the general round's own work in a plain
        step was about twice SGLang's (0.74 against 0.36 ms), this step's 0.56 (docs/benchmarks.md,
        "A plain step without the tree machinery")."""
        bs = len(batch.seq_lens)
        prefix = batch.seq_lens
        roots = draft_input.bonus_tokens.view(-1).to(torch.int64)
        target_out, kv_plan = self._decode_forward(batch, roots, seq_lens_cpu, seq_lens_sum)
        logits_output, logits = self._target_logits(target_out)
        sampling_info = batch.sampling_info
        apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=sampling_info, draft_token_num=1)
        all_greedy = bool(getattr(sampling_info, "is_all_greedy", False))  # a host flag: no read
        sampling = sampling_params_from_info(sampling_info, batch.reqs)
        if is_scalar_greedy(sampling.temperature):
            bonus = argmax_last(logits)
        else:  # the uniforms the round would draw for a one-node tree, column 1 the bonus's
            seeds = getattr(sampling_info, "sampling_seed", None)
            count = num_uniforms(self.tev.verifier, 1)
            if seeds is not None and not all_greedy:
                uniforms = seeded_uniforms(seeds, prefix, count)
            else:
                uniforms = torch.rand(bs, count, dtype=torch.float64, device=logits.device, generator=self._tev_generator)
            bonus = tev_root_bonus(logits, sampling, uniforms[:, 1])
        site = SpecTpSyncSite.DFLASH_ACCEPT_GREEDY if all_greedy else SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
        if self._tp_sync.enabled(site):  # TP > 1: rank 0's token (the exit is the root on every rank)
            bonus = self._tp_sync.sync(site, bonus.contiguous())
        ones = torch.ones(bs, dtype=torch.int32, device=self.device)
        new_seq_lens = prefix + 1
        if on_publish is not None:
            on_publish(new_seq_lens)
        # a held write copies its rows; one written at once is read before the next step
        self._write_draft_kv(logits_output.hidden_states, self._draft_write_ids(kv_plan), prefix.to(torch.int64), ones, 1)
        logits_output.hidden_states = None
        self._observe(served, round_plan, None, None)
        host = self._plain_info.get(bs)
        if host is None:
            host = self._plain_info[bs] = plain_round_host(bs)
        self._report(logits_output, round_columns(host))  # columns of its own: RoundLog tracks their reads
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=bonus.to(torch.int64, copy=True),  # a copy: the bonus is also the next root
            accept_lens=ones,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=self._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=self.tev.tree_size,
            speculative_output_stride=1,
            new_seq_lens=new_seq_lens,
        )
