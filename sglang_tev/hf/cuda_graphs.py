"""CUDA-graph capture of the target's tree forward at fixed shapes (opt-in; CUDA only).

With ``SpeculativeGenerator(..., static_shapes=True)`` every tree forward of a (batch, N) pair has
the same shapes: the attention reads the whole static cache (``kv_len = max_len``), the slots are
a tensor, the masks are ``[b, 1, N, max_len]``. Those forwards can be captured once and replayed:
:class:`GraphedTreeForward` copies the round's inputs into static buffers, replays, and returns the
static outputs (valid until the next replay, which the round never reaches before it is done with
them). A capture that fails is logged and that shape runs eagerly from then on; the warm-up and
capture seconds are kept in ``stats``.

Not measured on a GPU in this repository (the development machine has none):
``scripts/gpu_check.py`` checks and times it (``benchmarks/gpu_round.py``'s round). On CPU ``static_shapes`` runs eagerly
(tested for identical outputs), and the capture / copy-in / replay / reuse logic runs with a CPU
stand-in for CUDA graphs (``graph_backend``, ``sglang_tev.testing.graph_replay``; that stand-in
traces the captured forward with dynamo, ``fullgraph=True``, and refuses data-dependent ops:
``tests/runtime/test_hf_cuda_graphs.py``).
"""

from __future__ import annotations

import logging
import time

import torch

__all__ = ["GraphedTreeForward", "CudaGraphBackend"]

log = logging.getLogger("sglang_tev")


class CudaGraphBackend:
    """How :class:`GraphedTreeForward` captures and replays: ``torch.cuda.CUDAGraph`` on the current
    device, all captures sharing one memory pool. A stand-in with the same four methods can be
    passed instead (``sglang_tev.testing.graph_replay.EmulatedCudaGraphs`` runs the capture /
    replay logic on CPU).
    """

    def __init__(self) -> None:
        self.pool = None

    def warmup(self, fn, times: int) -> None:
        """Call ``fn()`` ``times`` times eagerly on a side stream (allocator and lazy init settle)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(times):
                fn()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, fn):
        """Capture ``fn()`` (no arguments: it reads static buffers). Returns ``(graph, out)``:
        ``out`` is what ``fn`` returned during capture, tensors that every replay overwrites."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class GraphedTreeForward:
    """Captured target forwards keyed by (rows, nodes).

    Args:
        forward: ``fn(tokens, positions, masks) -> (logits float32 [b, N, V], features or None)``,
            the eager tree forward (its cache already set to the static slots).
        warmup: eager calls before a capture (allocator and lazy init settle).
        backend: capture / replay (:class:`CudaGraphBackend` by default, CUDA only).

    A call with tokens int64 [b, N], positions int64 [b, N] and masks (bool or additive
    [b, 1, N, kv_len], or a dict of them per layer type) of a captured (b, N) copies them into the
    static input buffers, replays, and returns the static outputs: valid until the next call
    with the same (b, N). The first call of a (b, N) warms up, captures, and then replays as well.
    """

    def __init__(self, forward, warmup: int = 2, backend=None) -> None:
        self.forward = forward
        self.warmup = warmup
        self.backend = CudaGraphBackend() if backend is None else backend
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.failed: set[tuple[int, int]] = set()
        self.stats = {"captures": 0, "capture_s": 0.0, "fallbacks": 0}

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, masks) -> tuple:
        key = tuple(tokens.shape)
        if key in self.failed:
            return self.forward(tokens, positions, masks)
        if key not in self.graphs:
            try:
                self._capture(key, tokens, positions, masks)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager, logged
                log.warning("sglang-tev: CUDA-graph capture of the tree forward %s failed (%s: %s); running eagerly",
                            key, type(e).__name__, e)
                self.failed.add(key)
                self.stats["fallbacks"] += 1
                self.backend.synchronize()
                return self.forward(tokens, positions, masks)
        graph, s_tok, s_pos, s_masks, out = self.graphs[key]
        s_tok.copy_(tokens)
        s_pos.copy_(positions)
        _copy_masks(s_masks, masks)
        self.backend.replay(graph)
        return out

    def _capture(self, key, tokens, positions, masks) -> None:
        t0 = time.perf_counter()
        s_tok, s_pos = tokens.clone(), positions.clone()
        s_masks = {k: v.clone() for k, v in masks.items()} if isinstance(masks, dict) else masks.clone()
        self.backend.warmup(lambda: self.forward(s_tok, s_pos, s_masks), self.warmup)
        graph, out = self.backend.capture(lambda: self.forward(s_tok, s_pos, s_masks))
        self.graphs[key] = (graph, s_tok, s_pos, s_masks, out)
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        log.info("sglang-tev: captured the tree forward %s in %.2f s", key, time.perf_counter() - t0)


def _copy_masks(dst, src) -> None:
    if isinstance(dst, dict):
        for k in dst:
            dst[k].copy_(src[k])
    else:
        dst.copy_(src)
