"""Capture checks the round and lattice tests share: compile a function with dynamo into one
graph with no data-dependent op (:func:`compiled`, :class:`DataDependentOp`), what counts as a
refusal (:data:`REFUSED`), and equality of nested results tensor by tensor (:func:`assert_same`)."""

from __future__ import annotations

import dataclasses

import torch
import torch._dynamo

from sglang_tev.srt import round as R



def eager_without_data_dependent_ops(gm: torch.fx.GraphModule, example_inputs):
    """Dynamo backend: ``backend="eager"`` (run the traced FX graph as is), after failing with
    :class:`DataDependentOp` when a node's example value holds an unbacked symbol (``.item()``,
    ``int(t)``, ``.tolist()``, ``nonzero``, mask indexing, ... all create one)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    bad = [n.format_node() for n in gm.graph.nodes
           if n.meta.get("example_value") is not None and free_unbacked_symbols(n.meta["example_value"])]
    if bad:
        raise DataDependentOp("data-dependent ops in the graph: " + "; ".join(bad))
    return gm.forward


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=eager_without_data_dependent_ops, dynamic=False)


REFUSED = (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed)


def flat(x):
    """Every tensor (and static int) of a nested result, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (int, float)):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in flat(y)]
    if isinstance(x, R.VerifyOutput):
        return flat(tuple(x))
    if dataclasses.is_dataclass(x):  # DraftTree, TreeVerifyLayout, CommitPlan, ExitLaw: their fields, not host caches
        return flat([getattr(x, f.name) for f in dataclasses.fields(x)])
    return flat(list(vars(x).values()))


def assert_same(a, b):
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            assert x == y


class DataDependentOp(RuntimeError):
    """A traced graph holds an op whose output (a Python scalar or a shape) is read from the data."""
