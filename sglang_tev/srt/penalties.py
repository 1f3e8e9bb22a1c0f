"""Penalties and ``min_new_tokens`` at every tree node of a TEV round, on SGLang's own penalizer
state (imports sglang only inside functions).

SGLang keeps each running batch's committed penalty state in a ``BatchedPenalizerOrchestrator``
(``sampling/penaltylib``: ``f * count`` per token, presence and repetition marks, the output
length for ``min_new_tokens`` and its stop-token mask), filtered, merged and rebuilt with the batch
by SGLang itself (a retracted request restarts from an empty state, in plain decoding too). Plain
decoding feeds it one token per step: ``ScheduleBatch.prepare_for_decode`` cumulates the last
output token (``managers/schedule_batch.py:3769``). SGLang 0.5.23's spec-v2 decode preparation
for the DFlash family (``DFlashDraftInputV2.prepare_for_decode``, which TEV uses) feeds nothing,
and its verify never reads the state (``apply_dflash_verify_logits_adjustments`` looks for
``acc_linear_penalties``, a field ``SamplingBatchInfo`` does not have; the forward's copy of the
batch info has no orchestrator), so DFLASH drops penalties after the first token. TEV instead:

1. reaches the scheduler's orchestrator from the forward (:func:`install_penalizer_hook`: the
   forward runs on ``SamplingBatchInfo.copy_for_forward()``, ``managers/scheduler.py:4598``,
   which has ``penalizer_orchestrator=None``; an AFTER hook hands the copy a reference);
2. at the start of a round feeds the root (the last committed token, the previous round's bonus
   or the prefill's token), exactly what plain decoding's ``prepare_for_decode`` feeds;
3. applies the penalised law at every node from that state plus the node's path
   (:func:`sglang_tev.penalties.apply_sglang_penalties`), before logit bias and grammar masks, as
   SGLang's sampler orders them;
4. after verification feeds the accepted drafted tokens of each request (the bonus is the next
   round's root), so the state again holds every committed output token.

Order: SGLang's overlap-mode order (the default; also the one its forward copy uses for the
prefill's first token): the additive penalties, then repetition. (Non-overlap plain decoding
applies the four penalizers in the iteration order of a ``set`` of classes,
``sampling_batch_info.py:276-284``, which varies between processes; it matters only when
repetition is combined with frequency or presence penalties.)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..penalties import apply_sglang_penalties
from ..tree import DraftTree

__all__ = ["install_penalizer_hook", "batch_penalizer", "apply_tree_penalties", "count_accepted", "STATE_ATTR"]

STATE_ATTR = "_tev_penalizer_orchestrator"
"""Attribute of the forward copy of ``SamplingBatchInfo`` holding the scheduler's orchestrator."""

_TARGET = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.copy_for_forward"
_installed = False


def _keep_orchestrator(result, info, *args, **kwargs):
    """AFTER hook of ``SamplingBatchInfo.copy_for_forward``: the copy of a TEV batch with active
    penalties keeps a reference to the scheduler's orchestrator (other batches are untouched)."""
    orch = getattr(info, "penalizer_orchestrator", None)
    if result is None or orch is None or not orch.is_required:
        return result
    batch = orch.batch
    if getattr(getattr(batch, "spec_algorithm", None), "name", None) == "TEV":
        setattr(result, STATE_ATTR, orch)
    return result


def install_penalizer_hook() -> None:
    """Register :func:`_keep_orchestrator` on ``SamplingBatchInfo.copy_for_forward`` through
    SGLang's ``HookRegistry`` (``load_plugins()`` applies it in every process). Idempotent."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _keep_orchestrator, HookType.AFTER)
    _installed = True


def batch_penalizer(sampling_info):
    """The scheduler's penalizer orchestrator of this forward, or None when no request of the
    batch has a penalty or ``min_new_tokens``.

    Raises:
        RuntimeError when penalties are active but the state is unreachable (the hook was not
        applied): serving them without it would silently drop them.
    """
    orch = getattr(sampling_info, STATE_ATTR, None)
    if orch is not None:
        return orch if orch.is_required else None
    live = getattr(sampling_info, "penalizer_orchestrator", None)
    if (live is not None and live.is_required) or getattr(sampling_info, "acc_additive_penalties", None) is not None or (
        getattr(sampling_info, "acc_scaling_penalties", None) is not None
    ):
        raise RuntimeError(
            "TEV: a request has penalties or min_new_tokens but the scheduler's penalizer state is not on the "
            f"forward copy of SamplingBatchInfo ({STATE_ATTR}); the plugin's copy_for_forward hook was not applied"
        )
    return None


def _state(orch) -> dict:
    """Keyword arguments of :func:`apply_sglang_penalties` from the prepared penalizers."""
    from sglang.srt.sampling import penaltylib as P

    out = {}
    for cls, pen in orch.penalizers.items():
        if not pen.is_prepared():
            continue
        if cls is P.BatchedFrequencyPenalizer:
            out["frequency"] = (pen.cumulated_frequency_penalties, pen.frequency_penalties)
        elif cls is P.BatchedPresencePenalizer:
            out["presence"] = (pen.cumulated_presence_penalties, pen.presence_penalties)
        elif cls is P.BatchedRepetitionPenalizer:
            out["repetition"] = (pen.cumulated_repetition_penalties, pen.repetition_penalties)
        elif cls is P.BatchedMinNewTokensPenalizer:
            out["min_new_tokens"] = (pen.stop_token_penalties, pen.len_output_tokens, pen.min_new_tokens)
        else:
            raise RuntimeError(f"TEV: unknown SGLang penalizer {cls.__name__}: its law along tree paths is not implemented")
    return out


def apply_tree_penalties(logits: torch.Tensor, tree: DraftTree, sampling_info):
    """Feed each request's root to SGLang's penalizer state, then penalise every node's logits.

    Args:
        logits: float [bs * N, V] verify logits (row b * N + i = node i of request b), raw:
            before logit bias and grammar masks; modified in place.
        tree: the round's bs trees (node 0 = the root, the last committed token).
        sampling_info: the forward's ``SamplingBatchInfo``.
    Returns:
        the orchestrator (pass it to :func:`count_accepted` after verification), or None when no
        request has penalties (nothing done). No host sync.
    """
    orch = batch_penalizer(sampling_info)
    if orch is None:
        return None
    b, n = tree.parents.shape
    orch.cumulate_output_tokens(tree.tokens[:, 0].to(torch.int64))
    apply_sglang_penalties(logits.view(b, n, -1), tree, **_state(orch))
    return orch


def count_accepted(orch, tokens: torch.Tensor, counts: torch.Tensor) -> None:
    """Feed each request's first ``counts[b]`` tokens to SGLang's penalizer state (ragged: plain
    ``cumulate_output_tokens`` takes one token for every request).

    Equal to calling ``orch.cumulate_output_tokens`` once per token for each request alone:
    frequency adds one copy of f per occurrence, presence and repetition mark the tokens, the
    min-new-tokens length grows by ``counts[b]``.

    Args:
        orch: the batch's ``BatchedPenalizerOrchestrator``.
        tokens: int64 [bs, W]; entries at or past ``counts[b]`` are ignored.
        counts: int [bs], 0 <= counts[b] <= W.
    Raises:
        RuntimeError for a penalizer this function does not know. No host sync.
    """
    from sglang.srt.sampling import penaltylib as P

    bs, w = tokens.shape
    v = orch.vocab_size
    keep = torch.arange(w, device=tokens.device).view(1, w) < counts.view(bs, 1).to(tokens.device)
    tok = tokens.clamp(0, v - 1)
    hit = None
    for cls, pen in orch.penalizers.items():
        if not pen.is_prepared():
            continue
        if cls is P.BatchedFrequencyPenalizer:
            src = torch.where(keep, pen.frequency_penalties, 0.0)
            pen.cumulated_frequency_penalties.scatter_add_(1, tok, src)
            continue
        if cls is P.BatchedMinNewTokensPenalizer:
            pen.len_output_tokens.add_(keep.sum(1, keepdim=True).to(pen.len_output_tokens.dtype))
            continue
        if hit is None:  # [bs, V]: tokens fed to each request (a spare column takes the rest)
            hit = torch.zeros(bs, v + 1, dtype=torch.bool, device=tokens.device)
            hit.scatter_(1, torch.where(keep, tok, v), True)
            hit = hit[:, :v]
        if cls is P.BatchedPresencePenalizer:
            cum, val = pen.cumulated_presence_penalties, pen.presence_penalties
        elif cls is P.BatchedRepetitionPenalizer:
            cum, val = pen.cumulated_repetition_penalties, pen.repetition_penalties
        else:
            raise RuntimeError(f"TEV: unknown SGLang penalizer {cls.__name__}: cannot count accepted tokens for it")
        cum.copy_(torch.where(hit, val, cum))
