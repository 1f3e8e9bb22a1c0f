"""CUDA graphs per tree-size tier for ``SGLANG_TEV_BUDGET=auto`` (imports sglang only inside functions).

SGLang captures the target's TARGET_VERIFY graphs at one width, ``--speculative-num-draft-tokens``
= N tokens per request, once per batch-size bucket (``DecodeCudaGraphRunner``), and a replay of a
graph captured at one width refuses every other width (``can_run_graph`` checks
``spec_info.num_tokens_per_req``, ``decode_cuda_graph_runner.py:860-869``). Under ``auto`` a
round's tree has a width the planner picks, so before tiers ``auto`` ran the decode eagerly.

A tier is one more ``DecodeCudaGraphRunner`` on the target's model runner, captured at a smaller
tree size w (w tokens per request, the tree mask through ``graphs``' capture hook as at N), with
its own attention backend so its capture metadata never overwrites the main runner's (a backend
keeps per-batch-size graph state). This is SGLang's own pattern for a second verify width on one
model runner: UNO's private tree-draft runner builds its backend with
``_get_attention_backend`` under a ``speculative_num_draft_tokens`` override
(``uno_worker_v2.py:126-147``), captures after the target (``:149-190``) and binds the
runner only around the forward that needs it (``:791-801``). The planner's budgets become the
tiers' (budget b runs at w = b + 1 nodes), so every round's width has a graph; a batch above a
tier's largest captured batch size runs eagerly, as any speculative decode does. Graph memory:
the tiers share SGLang's graph memory pool and static input buffers
(``DecodeInputBuffers.share_buffers``); each adds its backend's buffers and its graphs.

Tiers (``SGLANG_TEV_GRAPH_TREE_SIZES``): by default 1, 5, 9, 17 and 33 below N (budgets 0, 4, 8,
16, 32), plus N itself (the runner SGLang captured); or a list of tree sizes, to which 1 (the plain
step) and N are always added; ``off`` keeps ``auto`` eager. ``auto-ragged`` stays eager: its
per-request sizes need a ragged verify graph, which SGLang 0.5.23 captures only on backends with
``supports_ragged_verify_graph`` (TRT-LLM MHA, DeepSeek V4), and neither of TEV's tree-mask backends
on CUDA (FlashInfer, Triton) is among them.

Not run on a GPU yet (no device here): the capture and replay are ``scripts/sglang_smoke.py``'s
``TEV-auto`` mode; on CPU the tier selection, the binding and a replay emulation are tested
(``tests/srt/test_srt_graph_tiers.py``, ``tests/srt/test_srt_graphs.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Optional, Sequence

__all__ = ["DEFAULT_TIER_BUDGETS", "tier_sizes", "wanted_tier_sizes", "GraphTiers", "build_tier_backends", "capture_tiers"]

logger = logging.getLogger(__name__)

DEFAULT_TIER_BUDGETS = (0, 4, 8, 16, 32)
"""Budgets (nodes below the root) of the default tiers; each tier has ``b + 1`` nodes."""


def tier_sizes(tree_size: int, requested: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The tree sizes (nodes per request, root included) to capture graphs at.

    Args:
        tree_size: N (``--speculative-num-draft-tokens``), >= 2.
        requested: ``SGLANG_TEV_GRAPH_TREE_SIZES``'s list, or None for the default
            (:data:`DEFAULT_TIER_BUDGETS` + 1 below N).
    Returns:
        Sorted distinct sizes, always holding 1 (a plain step) and N (SGLang's own runner).
    Raises:
        ValueError naming ``SGLANG_TEV_GRAPH_TREE_SIZES`` for a size outside [1, N].
    """
    n = int(tree_size)
    if requested is None:
        sizes = {b + 1 for b in DEFAULT_TIER_BUDGETS if b + 1 < n}
    else:
        bad = [s for s in requested if not 1 <= int(s) <= n]
        if bad:
            raise ValueError(
                f"SGLANG_TEV_GRAPH_TREE_SIZES: tree sizes must be in [1, N = {n}] (--speculative-num-draft-tokens), got {bad}"
            )
        sizes = {int(s) for s in requested}
    return tuple(sorted(sizes | {1, n}))


class GraphTiers:
    """The target's verify graph runners by tree size, and the binding that makes SGLang's forward
    replay the right one.

    Args:
        model_runner: the target's ``ModelRunner`` (its ``decode_cuda_graph_runner`` is rebound
            around each round's target forward).
        runners: ``{tree size: runner}`` (SGLang's ``DecodeCudaGraphRunner`` or a stand-in with
            ``captured_req_width``), N's being the runner SGLang captured.
    Raises:
        ValueError naming ``runners`` when one's ``captured_req_width`` is not its key.
    """

    def __init__(self, model_runner, runners: dict) -> None:
        for w, r in runners.items():
            if int(getattr(r, "captured_req_width", w)) != int(w):
                raise ValueError(f"runners: the runner under tree size {w} was captured at {r.captured_req_width}")
        self.model_runner = model_runner
        self.runners = {int(w): r for w, r in runners.items()}

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.runners))

    @property
    def budgets(self) -> tuple[int, ...]:
        """The planner's grid: one budget per tier (size - 1; 0 = a plain step)."""
        return tuple(w - 1 for w in self.sizes)

    def runner_for(self, width: int):
        """The runner captured at ``width`` tokens per request, or None (the forward runs eagerly)."""
        return self.runners.get(int(width))

    @contextlib.contextmanager
    def bound(self, width: int) -> Iterator[object]:
        """``model_runner.decode_cuda_graph_runner`` = the tier of ``width`` (None: eager) while
        the round's target forward runs (SGLang's ``prepare_for_verify`` and ``ModelRunner.forward``
        read that attribute), restored after, also on an error. Yields the bound runner."""
        mr = self.model_runner
        saved = mr.decode_cuda_graph_runner
        runner = self.runner_for(width)
        mr.decode_cuda_graph_runner = runner
        try:
            yield runner
        finally:
            mr.decode_cuda_graph_runner = saved


@contextlib.contextmanager
def _spec_width(width: int):
    """SGLang's ``speculative_num_draft_tokens`` = ``width`` for a backend's or runner's construction
    (both size their buffers from it), as UNO overrides it for its private backend."""
    from sglang.srt.runtime_context import get_spec

    with get_spec().override(speculative_num_draft_tokens=int(width)):
        yield


def wanted_tier_sizes(settings, device, environ=None) -> tuple[int, ...]:
    """The tiers this server captures: :func:`tier_sizes` under ``SGLANG_TEV_BUDGET=auto`` on a
    CUDA device with SGLang's decode graphs on (``cuda_graph_config.decode.backend``, which
    ``config.resolve_server_args`` turned off where tiers do not apply) and
    ``SGLANG_TEV_GRAPH_TREE_SIZES`` not ``off``; else ``()``.

    Args:
        settings: the worker's ``TevSettings`` (``budget_mode``, ``tree_size``).
        device: the worker's device (``"cuda"``, ``"cuda:0"``, a ``torch.device``).
    """
    import torch

    from .. import env as _env

    requested = _env.get(_env.GRAPH_TREE_SIZES, environ)
    if settings.budget_mode != "auto" or requested == () or torch.device(device).type != "cuda":
        return ()
    from sglang.srt.runtime_context import get_exec

    if str(get_exec().graph.cuda_graph_config.decode.backend) == "disabled":  # Backend.DISABLED, a plain str
        return ()
    return tier_sizes(settings.tree_size, requested)


def build_tier_backends(model_runner, sizes: Sequence[int], tree_size: int) -> dict:
    """One private attention backend per tier below N, built like the target's own at the tier's
    width (``ModelRunner._get_attention_backend()`` under the width override). They share the
    target's FlashInfer workspace, as the wrappers inside one backend do: one target forward runs
    per round, and each replay plans its metadata before it runs (UNO asks for a new workspace
    because its draft and target verify are both planned within one step). Call after the
    target's pools exist (the spec worker's ``init_attention_backends``).

    Returns:
        ``{tree size: backend}`` (N excluded: SGLang's own backend serves it; empty for no sizes).
    """
    backends = {}
    if not sizes:
        return backends
    saved = getattr(model_runner, "init_new_workspace", None)
    try:
        for w in sizes:
            if int(w) == int(tree_size):
                continue
            with _spec_width(w):
                backends[int(w)] = model_runner._get_attention_backend()
    finally:
        if saved is not None:
            model_runner.init_new_workspace = saved
    return backends


def capture_tiers(model_runner, backends: dict, tree_size: int, served=None, log_rank0: bool = True) -> Optional[GraphTiers]:
    """Capture one verify graph runner per tier on the target's model runner, after SGLang captured
    its own at N (the spec worker's ``init_cuda_graphs``).

    Each runner is SGLang's runner class for this model runner (``_decode_cuda_graph_runner_cls``)
    built with the tier's backend and width, while ``model_runner.attn_backend`` and
    ``decode_cuda_graph_runner`` are bound to the tier's (capture reads them) and restored after.

    Args:
        backends: :func:`build_tier_backends`' (empty: nothing to capture).
        served: the worker's ``ServedBudget``, whose budgets become the tiers' (``use_grid``).
    Returns:
        :class:`GraphTiers` over the tiers and SGLang's runner at N, or None when there are no
        tiers or SGLang captured no target graph (graphs off: every round runs eagerly).
    """
    main = getattr(model_runner, "decode_cuda_graph_runner", None)
    if main is None or not backends:
        return None
    cls = model_runner._decode_cuda_graph_runner_cls()
    runners = {int(tree_size): main}
    saved_backend = model_runner.attn_backend
    tic = time.perf_counter()
    try:
        for w, backend in sorted(backends.items(), reverse=True):
            model_runner.attn_backend = backend
            model_runner.decode_cuda_graph_runner = None
            with _spec_width(w):
                runners[w] = cls(model_runner, attn_backend=backend, speculative_num_draft_tokens=w)
    finally:
        model_runner.attn_backend = saved_backend
        model_runner.decode_cuda_graph_runner = main
    tiers = GraphTiers(model_runner, runners)
    if served is not None:
        served.use_grid(tiers.budgets)
    if log_rank0:
        logger.info("TEV: target verify graphs at tree sizes %s (auto: one tier per round width), captured in %.1f s",
                    ", ".join(map(str, tiers.sizes)), time.perf_counter() - tic)
    return tiers
