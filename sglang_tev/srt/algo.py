"""``TevAlgo``: the TEV entry in SGLang's speculative-algorithm registry (imports sglang).

SGLang dispatches on duck-typed predicates (``is_*`` / ``supports_*``) of the algorithm object
rather than on its type. The stock ``CustomSpecAlgo`` of 0.5.23 lacks several methods the
scheduler calls unconditionally (``create_future_map``, ``carries_draft_hidden_states``,
``need_topk``, ``get_platform_worker_cls``; notes §1.4), so :class:`TevAlgo` defines every one.

TEV is a member of the DFlash family (``is_dflash_family``): that turns on the target's auxiliary
hidden-state capture of the drafter's ``target_layer_ids``, draft-KV pool sizing, the
``DFlashDraftInputV2`` decode preparation and the draft runner's TARGET_VERIFY path. It is not
``is_dflash`` (that gates NPU and DFlash-only heads).
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from .config import resolve_server_args

__all__ = ["TevAlgo", "read_draft_block_size", "check_draft_features"]

logger = logging.getLogger(__name__)


def _draft_hf_config(sa):
    """The drafter's HF config via SGLang's own loader, or None (logged) when it cannot be read."""
    import json

    from sglang.srt.utils.hf_transformers_utils import get_config

    try:
        return get_config(
            sa.speculative_draft_model_path,
            trust_remote_code=sa.trust_remote_code,
            revision=sa.speculative_draft_model_revision,
            model_override_args=json.loads(sa.json_model_override_args or "{}"),
        )
    except Exception as e:  # no network, missing path: ask for the flag instead
        logger.warning("TEV: could not read the drafter config at %s: %s", sa.speculative_draft_model_path, e)
        return None


def read_draft_block_size(sa) -> Optional[int]:
    """The drafter config's block size (``block_size`` or ``dflash_config.block_size``), or None.

    Reads ``--speculative-draft-model-path`` with SGLang's own config loader and DFlash parser.
    """
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    hf_config = _draft_hf_config(sa)
    if hf_config is None:
        return None
    return parse_dflash_draft_config(draft_hf_config=hf_config).resolve_block_size(default=None)


def check_draft_features(sa) -> None:
    """Refuse, before any model loads, a drafter with a DFlash-family feature TEV does not serve
    (``dflash2.check_draft_config``: a LiLiCorr head, a Domino projector,
    ``SGLANG_TEV_DFLASH2_MODE=lattice`` without a selector). An unreadable config is left to the
    worker, which checks the loaded model the same way (``dflash2.resolve_draft_serving``).

    Raises:
        ValueError naming the feature.
    """
    from .dflash2 import check_draft_config

    hf_config = _draft_hf_config(sa)
    if hf_config is not None:
        check_draft_config(hf_config)


class TevAlgo(CustomSpecAlgo):
    """TEV = DFlash drafting + DDTree tree + Tree Exit Verification, as an SGLang algorithm.

    Every predicate SGLang's scheduler, model runner, memory sizing and CUDA-graph paths call is
    defined here explicitly (no ``__getattr__`` fallback).
    """

    # ---- family membership
    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        # the draft runner runs its block as TARGET_VERIFY (the CustomSpecAlgo default False makes
        # the draft runner's graph capture raise)
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        # prefill is DFlash's: draft KV is written at slots planned before the target forward
        return True

    # ---- features not supported yet (SGLang falls back to the safe paths)
    def supports_mixed_chunk(self) -> bool:
        return False

    def supports_ragged_verify(self) -> bool:
        return False

    def supports_grammar_overlap(self) -> bool:
        return False

    def has_draft_kv(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> Optional[type]:
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True, needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    # ---- server args
    def handle_server_args(self, server_args) -> None:
        """Refuse a drafter feature TEV does not serve (:func:`check_draft_features`), then resolve
        TEV's settings with plain writes on SGLang's stand-in (see ``config``)."""
        check_draft_features(server_args)
        settings = resolve_server_args(server_args, read_draft_block_size=read_draft_block_size)
        logger.info(
            "TEV: tree size N=%d (budget %d), block size %d, max depth %d, top-k %d, verifier %s",
            settings.tree_size,
            settings.budget,
            settings.block_size,
            settings.max_depth,
            settings.topk,
            settings.verifier,
        )

    def resolve_max_speculative_num_draft_tokens(self, server_args) -> Optional[int]:
        """max(N, K): the draft block (K tokens) and the tree (N) share the verify window."""
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        n = cfg.speculative_num_draft_tokens
        k = cfg.speculative_dflash_block_size
        if n is None:
            return None
        return max(int(n), int(k)) if k is not None else int(n)

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        """The draft runner verifies a block of K tokens; the target verifies the N-node tree."""
        if is_draft_worker:
            from sglang.srt.runtime_context import get_spec

            k = get_spec().speculative_dflash_block_size
            if k is not None:
                return int(k)
        return num_draft_tokens
