"""A CPU stand-in for CUDA-graph capture and replay, for
:class:`~sglang_tev.hf.cuda_graphs.GraphedTreeForward` (``SpeculativeGenerator(...,
cuda_graphs=True, graph_backend=EmulatedCudaGraphs())``).

A CUDA graph records the kernels ``fn()`` launches on the tensors it read and wrote during capture;
a replay relaunches them on the same memory: new inputs reach it only through those tensors
(copied in place), its outputs are the tensors the capture returned (overwritten in place), and
Python-side values (sizes, slices, branches) are those of the capture. The stand-in keeps that
contract on CPU:

* ``trace=True`` (default): the capture traces ``fn`` with dynamo into ONE FX graph
  (``fullgraph=True``; a graph break or an op whose output size or Python value is read from the
  data raises, as a CUDA capture would fail on a host sync), keeps the real tensors it read (the
  static inputs, the KV cache, the weights), and a replay runs that graph on them: Python state is
  frozen at capture, as in a real graph. The outputs of a replay are copied into the tensors the
  capture returned.
* ``trace=False``: a replay calls ``fn()`` again (it reads the same static buffers) and copies its
  outputs into the captured ones; Python state is re-read. Cheaper (no trace), weaker.

Not emulated: memory pools, streams, asynchronous execution.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["EmulatedCudaGraphs", "EmulatedGraph"]

_names = itertools.count()


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


class EmulatedGraph:
    """One captured ``fn`` (see the module doc). Attributes: ``replays`` (int), ``out`` (what the
    capture returned), ``graph_module`` (the traced FX graph, or None with ``trace=False``)."""

    def __init__(self, fn, out, run) -> None:
        self.fn, self.out, self._run = fn, out, run
        self.replays = 0
        self.graph_module = None

    def replay(self) -> None:
        outs = _tensors(self.out)
        new = self._run()
        if len(new) != len(outs):
            raise RuntimeError(f"replay returned {len(new)} tensors, the capture {len(outs)}")
        with torch.no_grad():
            for o, n in zip(outs, new):
                o.copy_(n)
        self.replays += 1


class EmulatedCudaGraphs:
    """CPU stand-in for :class:`~sglang_tev.hf.cuda_graphs.CudaGraphBackend` (same four methods).

    Args:
        trace: replay a dynamo trace of the capture (Python state frozen) or call ``fn`` again.
    Attributes:
        graphs: every :class:`EmulatedGraph` captured, in order; warmups: ``fn`` calls made by
            :meth:`warmup`.
    Raises (from :meth:`capture`, with ``trace=True``): ``torch._dynamo.exc.Unsupported`` at a
    graph break; ``torch._dynamo.exc.BackendCompilerFailed`` naming the nodes when the graph holds
    data-dependent ops (``.item()``, ``nonzero``, mask indexing, ...), which torch 2.14's dynamo
    traces without a break; RuntimeError when an output of ``fn`` is not a graph output.
    """

    def __init__(self, trace: bool = True) -> None:
        self.trace = trace
        self.graphs: list[EmulatedGraph] = []
        self.warmups = 0

    def warmup(self, fn, times: int) -> None:
        for _ in range(times):
            fn()
            self.warmups += 1

    def capture(self, fn):
        if not self.trace:
            out = fn()
            graph = EmulatedGraph(fn, out, lambda: _tensors(fn()))
        else:
            graph = self._traced(fn)
        self.graphs.append(graph)
        return graph, graph.out

    def replay(self, graph: EmulatedGraph) -> None:
        graph.replay()

    def synchronize(self) -> None:
        pass

    # ------------------------------------------------------------------ the dynamo capture
    def _traced(self, fn) -> EmulatedGraph:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        seen = {}

        def backend(gm: torch.fx.GraphModule, example_inputs):
            bad = [n.format_node() for n in gm.graph.nodes
                   if n.meta.get("example_value") is not None and free_unbacked_symbols(n.meta["example_value"])]
            if bad:
                raise RuntimeError("data-dependent ops in the captured graph (a host sync on CUDA): " + "; ".join(bad))
            seen["gm"], seen["inputs"] = gm, list(example_inputs)

            def run(*args):
                res = gm(*args)
                seen["last"] = res
                return res

            return run

        def captured():
            return fn()

        # a fresh code object per capture: dynamo's cache (and recompile limit) is per code object
        captured.__code__ = captured.__code__.replace(co_name=f"emulated_capture_{next(_names)}")
        out = torch.compile(captured, backend=backend, fullgraph=True, dynamic=False)()
        gm, inputs, flat = seen["gm"], seen["inputs"], list(seen["last"])
        # each output tensor of fn must be one of the graph's outputs (not rebuilt by dynamo)
        index = []
        for t in _tensors(out):
            j = next((j for j, r in enumerate(flat) if r is t), None)
            if j is None:
                raise RuntimeError("an output of the captured function is not an output of its graph")
            index.append(j)

        def run():
            res = gm(*inputs)
            return [res[j] for j in index]

        graph = EmulatedGraph(fn, out, run)
        graph.graph_module = gm
        return graph
