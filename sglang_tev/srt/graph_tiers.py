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
the tiers share SGLang's graph memory pool, but each has its own backend graph state (the KV index
and mask buffers a backend sizes by batch x width x context: the default tiers' widths sum to
about N, so together about what SGLang's runner at N takes again) and its own static input buffers
(SGLang's pool shares a buffer only between runners asking the same size). The capture's memory and
time are logged; SGLang sized the KV pool before, so a GPU short of memory fails at start-up, with
a message naming ``SGLANG_TEV_GRAPH_TREE_SIZES``. With two-batch overlap or PD multiplexing no tiers
are captured (both re-wrap the backends per runner).

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
import numbers
import time
from typing import Iterator, Optional, Sequence

__all__ = ["DEFAULT_TIER_BUDGETS", "tier_sizes", "wanted_tier_sizes", "GraphTiers", "build_tier_backends", "capture_tiers"]

logger = logging.getLogger(__name__)

DEFAULT_TIER_BUDGETS = (0, 4, 8, 16, 32)
"""Budgets (nodes below the root) of the default tiers; each tier has ``b + 1`` nodes."""

_FEWER_TIERS = ("capture fewer tiers (SGLANG_TEV_GRAPH_TREE_SIZES=1,17 say), none (SGLANG_TEV_GRAPH_TREE_SIZES=off: "
                "auto runs the decode eagerly), or serve fixed trees (SGLANG_TEV_BUDGET=fixed)")


def tier_sizes(tree_size: int, requested: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The tree sizes (nodes per request, root included) to capture graphs at.

    Args:
        tree_size: N (``--speculative-num-draft-tokens``), an integer >= 2.
        requested: ``SGLANG_TEV_GRAPH_TREE_SIZES``'s integers, or None for the default
            (:data:`DEFAULT_TIER_BUDGETS` + 1 below N).
    Returns:
        Sorted distinct sizes (nodes per request), always holding 1 (a plain step) and N (SGLang's
        own runner).
    Raises:
        ValueError naming ``tree_size`` (not an integer >= 2), ``requested`` (not integers) or
        ``SGLANG_TEV_GRAPH_TREE_SIZES`` (a size outside [1, N]).
    """
    if isinstance(tree_size, bool) or not isinstance(tree_size, numbers.Integral) or tree_size < 2:
        raise ValueError(f"tree_size must be an integer >= 2 (N, root included), got {tree_size!r}")
    n = int(tree_size)
    if requested is None:
        sizes = {b + 1 for b in DEFAULT_TIER_BUDGETS if b + 1 < n}
    else:
        if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in requested):
            raise ValueError(f"requested must be integer tree sizes, got {list(requested)!r}")
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
        model_runner: the target's ``ModelRunner``; around each round's target forward its
            ``decode_cuda_graph_runner`` and ``attn_backend`` are rebound to the round's tier, as
            SGLang binds both for UNO's second width (``_bind_uno_draft_runtime``) and EAGLE's
            draft runtime: the replay plans on the runner's backend, and what runs outside the
            graph (a breakable graph's eager attention, an eager fallback) reads the model
            runner's, so the two must be the same.
        runners: ``{tree size: runner}`` (SGLang's ``DecodeCudaGraphRunner`` or a stand-in with
            ``captured_req_width`` and ``attn_backend``), the largest being the runner SGLang
            captured at N (``model_runner.decode_cuda_graph_runner`` at construction).
    Raises:
        ValueError naming ``runners`` when it is empty, one lacks ``captured_req_width`` or has
        another than its key, or the largest is not the model runner's own.
    """

    def __init__(self, model_runner, runners: dict) -> None:
        if not runners:
            raise ValueError("runners must hold at least SGLang's runner at N, got none")
        for w, r in runners.items():
            width = getattr(r, "captured_req_width", None)
            if width is None or int(width) != int(w):
                raise ValueError(f"runners: the runner under tree size {w} was captured at {width}")
        self.model_runner = model_runner
        self.runners = {int(w): r for w, r in runners.items()}
        self.tree_size = max(self.runners)
        self.main = self.runners[self.tree_size]
        if self.main is not model_runner.decode_cuda_graph_runner:
            raise ValueError(f"runners: the runner under tree size {self.tree_size} (N) must be the model runner's own")
        self.stale = False
        self._replayed: set[int] = set()

    @property
    def sizes(self) -> tuple[int, ...]:
        """The tree sizes with a runner (nodes per request), ascending; N last."""
        return tuple(sorted(self.runners))

    @property
    def budgets(self) -> tuple[int, ...]:
        """The planner's grid: one budget per tier (size - 1; 0 = a plain step)."""
        return tuple(w - 1 for w in self.sizes)

    def runner_for(self, width: int):
        """The runner to replay a round of ``width`` tokens per request (an int, the round's tree
        size), or None (the forward runs eagerly). At N, the model runner's current one. When
        SGLang has replaced that since the tiers were captured (a weight update with
        ``recapture_cuda_graph``), the tiers' graphs may read freed weights: the tiers below N are
        released and their rounds run eagerly from then on (said once)."""
        current = self.model_runner.decode_cuda_graph_runner
        if current is not self.main and not self.stale:
            self.stale = True
            self.runners = {self.tree_size: self.main}  # the tiers' graphs and buffers go
            logger.warning("TEV: SGLang recaptured the target's verify graphs; rounds below N = %d now run eagerly "
                           "(the graph tiers were captured with the old ones)", self.tree_size)
        if int(width) == self.tree_size:
            return current
        return None if self.stale else self.runners.get(int(width))

    def replayed(self, width: int) -> None:
        """Note that a round of ``width`` replayed its graph (the target forward's
        ``can_run_cuda_graph``); the first replay at each size is logged (what the GPU smoke test
        counts)."""
        if width not in self._replayed:
            self._replayed.add(int(width))
            logger.info("TEV: first replay of the target verify graph at tree size %d", width)

    @contextlib.contextmanager
    def bound(self, width: int) -> Iterator[object]:
        """The model runner's ``decode_cuda_graph_runner`` = the runner of ``width`` (the round's
        tree size; None: eager) and its ``attn_backend`` = that runner's backend (unchanged when
        eager) while the round's target forward runs (SGLang's ``prepare_for_verify`` and
        ``ModelRunner.forward`` read both). Yields the bound runner; both attributes are restored
        after, also when the forward raises (the error propagates)."""
        mr = self.model_runner
        saved = mr.decode_cuda_graph_runner, mr.attn_backend
        runner = self.runner_for(width)
        mr.decode_cuda_graph_runner = runner
        if runner is not None:
            mr.attn_backend = getattr(runner, "attn_backend", saved[1])
        try:
            yield runner
        finally:
            mr.decode_cuda_graph_runner, mr.attn_backend = saved


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
        environ: environment mapping (default ``os.environ``).
    Returns:
        The tree sizes to capture (:func:`tier_sizes`), or ``()``.
    Raises:
        :class:`~sglang_tev.env.EnvError` for a bad ``SGLANG_TEV_GRAPH_TREE_SIZES``; ValueError
        for a size above N (``config.validate_server_args`` refuses both at launch already).
    """
    import torch

    from .. import env as _env

    requested = _env.get(_env.GRAPH_TREE_SIZES, environ)
    if settings.budget_mode != "auto" or requested == () or torch.device(device).type != "cuda":
        return ()
    from sglang.srt.runtime_context import get_disagg, get_exec

    if str(get_exec().graph.cuda_graph_config.decode.backend) == "disabled":  # Backend.DISABLED, a plain str
        return ()
    if bool(get_exec().overlap.enable_two_batch_overlap) or bool(get_disagg().enable_pdmux):
        # both re-wrap or re-initialise the model runner's backends per runner: not written for tiers
        # (said at launch by config.resolve_server_args)
        return ()
    return tier_sizes(settings.tree_size, requested)


def build_tier_backends(model_runner, sizes: Sequence[int], tree_size: int) -> dict:
    """One private attention backend per tier below N, built like the target's own at the tier's
    width (``ModelRunner._get_attention_backend()`` under the width override). They share the
    target's FlashInfer workspace, as the wrappers inside one backend do: one target forward runs
    per round, and each replay plans its metadata before it runs (UNO asks for a new workspace
    because its draft and target verify are both planned within one step). Call after the
    target's pools exist (the spec worker's ``init_attention_backends``).

    SGLang's own start-up also binds its backends to the KV index translator and stamps the
    backend names on the model runner (``init_attention_backends``); FlashInfer and Triton take the
    translator in their constructors and the names are the target's already, so neither is
    repeated here.

    Args:
        model_runner: the target's ``ModelRunner``.
        sizes: :func:`wanted_tier_sizes`' (empty: no backends).
        tree_size: N, whose backend is SGLang's.
    Returns:
        ``{tree size: backend}`` (N excluded; empty for no sizes).
    Raises:
        RuntimeError naming the tier and ``SGLANG_TEV_GRAPH_TREE_SIZES`` when a backend cannot be
        built (SGLang's error chained).
    """
    backends = {}
    for w in sizes:
        if int(w) == int(tree_size):
            continue
        with _spec_width(w):
            try:
                backends[int(w)] = model_runner._get_attention_backend()
            except Exception as e:
                raise RuntimeError(f"TEV: building the attention backend of graph tier {w} failed "
                                   f"({type(e).__name__}: {e}); {_FEWER_TIERS}") from e
    return backends


def capture_tiers(model_runner, backends: dict, tree_size: int, served=None, log_rank0: bool = True) -> Optional[GraphTiers]:
    """Capture one verify graph runner per tier on the target's model runner, after SGLang captured
    its own at N (the spec worker's ``init_cuda_graphs``).

    Each runner is SGLang's runner class for this model runner (``_decode_cuda_graph_runner_cls``)
    built with the tier's backend and width, while ``model_runner.attn_backend`` and
    ``decode_cuda_graph_runner`` are bound to the tier's (capture reads them) and restored after.

    Args:
        model_runner: the target's ``ModelRunner``, SGLang's runner at N captured.
        backends: :func:`build_tier_backends`' (empty: nothing to capture).
        tree_size: N.
        served: the worker's ``ServedBudget``, whose budgets become the tiers' (``use_grid``).
        log_rank0: log the tiers, their capture time and memory (rank 0 under TP).
    Returns:
        :class:`GraphTiers` over the tiers and SGLang's runner at N, or None when there are no
        tiers or SGLang captured no target graph (graphs off: every round runs eagerly).
    Raises:
        RuntimeError naming the tier and ``SGLANG_TEV_GRAPH_TREE_SIZES`` when a capture fails
        (SGLang's error chained; the model runner restored): the server does not start, as with
        SGLang's own capture.
    """
    main = getattr(model_runner, "decode_cuda_graph_runner", None)
    if main is None or not backends:
        return None
    cls = model_runner._decode_cuda_graph_runner_cls()
    runners = {int(tree_size): main}
    saved_backend = model_runner.attn_backend
    tic, free_before = time.perf_counter(), _free_gpu_memory_gb(model_runner)
    try:
        for w, backend in sorted(backends.items(), reverse=True):
            model_runner.attn_backend = backend
            model_runner.decode_cuda_graph_runner = None
            with _spec_width(w):
                try:
                    runners[w] = cls(model_runner, attn_backend=backend, speculative_num_draft_tokens=w)
                except Exception as e:
                    raise RuntimeError(f"TEV: capturing the target verify graphs at tree size {w} failed "
                                       f"({type(e).__name__}: {e}); {_FEWER_TIERS}") from e
    finally:
        model_runner.attn_backend = saved_backend
        model_runner.decode_cuda_graph_runner = main
    tiers = GraphTiers(model_runner, runners)
    if served is not None:
        served.use_grid(tiers.budgets)
    if log_rank0:
        free_after = _free_gpu_memory_gb(model_runner)
        used = "" if free_before is None or free_after is None else f", {free_before - free_after:.2f} GB (avail {free_after:.2f} GB)"
        logger.info("TEV: target verify graphs at tree sizes %s (auto: one tier per round width), captured in %.1f s%s",
                    ", ".join(map(str, tiers.sizes)), time.perf_counter() - tic, used)
    return tiers


def _free_gpu_memory_gb(model_runner) -> Optional[float]:
    """Free device memory in GB as SGLang measures it around its captures, or None off CUDA."""
    if str(getattr(model_runner, "device", "cpu")).split(":")[0] != "cuda":
        return None
    from sglang.srt.utils import get_available_gpu_memory

    return float(get_available_gpu_memory(model_runner.device, model_runner.gpu_id, empty_cache=False))
