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
(tested for identical outputs).
"""

from __future__ import annotations

import logging
import time

import torch

__all__ = ["GraphedTreeForward"]

log = logging.getLogger("sglang_tev")


class GraphedTreeForward:
    """Captured target forwards keyed by (rows, nodes).

    Args:
        forward: ``fn(tokens, positions, masks) -> (logits float32 [b, N, V], features or None)``,
            the eager tree forward (its cache already set to the static slots).
        warmup: eager calls before a capture (allocator and lazy init settle).
    """

    def __init__(self, forward, warmup: int = 2) -> None:
        self.forward = forward
        self.warmup = warmup
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.failed: set[tuple[int, int]] = set()
        self.stats = {"captures": 0, "capture_s": 0.0, "fallbacks": 0}
        self.pool = None

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
                torch.cuda.synchronize()
                return self.forward(tokens, positions, masks)
        graph, s_tok, s_pos, s_masks, out = self.graphs[key]
        s_tok.copy_(tokens)
        s_pos.copy_(positions)
        _copy_masks(s_masks, masks)
        graph.replay()
        return out

    def _capture(self, key, tokens, positions, masks) -> None:
        t0 = time.perf_counter()
        s_tok, s_pos = tokens.clone(), positions.clone()
        s_masks = {k: v.clone() for k, v in masks.items()} if isinstance(masks, dict) else masks.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.forward(s_tok, s_pos, s_masks)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(s_tok, s_pos, s_masks)
        self.pool = graph.pool()
        self.graphs[key] = (graph, s_tok, s_pos, s_masks, out)
        torch.cuda.synchronize()
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        log.info("sglang-tev: captured the tree forward %s in %.2f s", key, time.perf_counter() - t0)


def _copy_masks(dst, src) -> None:
    if isinstance(dst, dict):
        for k in dst:
            dst[k].copy_(src[k])
    else:
        dst.copy_(src)
