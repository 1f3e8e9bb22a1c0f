"""HostSyncCounter (sglang_tev/testing/host_sync.py): each listed blocking call is counted once, at
the caller's file and line, with its kind; pure device ops are not; the path filter and the
``count_cpu`` switch select events."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from sglang_tev.testing.host_sync import HostSync, HostSyncCounter

x = torch.tensor([1.0, 2.0, 0.0, 3.0])
s = torch.tensor(3.0)
i = torch.tensor(2)
mask = x > 0.5
reps = torch.tensor([1, 0, 2, 1])

BLOCKING = {
    "read:Tensor.item": lambda: s.item(),
    "read:Tensor.tolist": lambda: x.tolist(),
    "read:Tensor.numpy": lambda: x.numpy(),
    "read:Tensor.cpu": lambda: x.cpu(),
    "read:Tensor.__bool__": lambda: 1 if s else 0,
    "read:Tensor.__int__": lambda: int(s),
    "read:Tensor.__float__": lambda: float(s),
    "read:Tensor.__index__": lambda: [1, 2, 3][i],
    "read:Tensor.__array__": lambda: np.asarray(x),
    "read:Tensor.__format__": lambda: f"{s:.2f}",
    "read:Tensor.__repr__": lambda: repr(x),
    "read:Tensor.__contains__": lambda: 2.0 in x,
    "read:torch.equal": lambda: torch.equal(x, x),
    "read:torch.allclose": lambda: torch.allclose(x, x),
    "to_host:Tensor.to": lambda: x.to("cpu"),
    "dynamic_shape:Tensor.nonzero": lambda: x.nonzero(),
    "dynamic_shape:torch.nonzero": lambda: torch.nonzero(x),
    "dynamic_shape:torch.argwhere": lambda: torch.argwhere(x),
    "dynamic_shape:torch.where": lambda: torch.where(mask),
    "dynamic_shape:Tensor.masked_select": lambda: x.masked_select(mask),
    "dynamic_shape:torch.unique": lambda: torch.unique(x),
    "dynamic_shape:Tensor.unique": lambda: x.unique(),
    "dynamic_shape:torch.bincount": lambda: torch.bincount(reps),
    "dynamic_shape:torch.repeat_interleave": lambda: torch.repeat_interleave(reps),
    "dynamic_shape:Tensor.repeat_interleave": lambda: x.repeat_interleave(reps),
    "dynamic_shape:Tensor.__getitem__": lambda: x[mask],
    "dynamic_shape:Tensor.__setitem__": lambda: x.clone().__setitem__((mask,), 0.0),
    "to_device:torch.tensor": lambda: torch.tensor([1, 2], device="cpu"),
    "to_device:torch.as_tensor": lambda: torch.as_tensor(0.5, device=torch.device("cpu")),
}

# device-side ops (and host-only tensor construction) that never wait for the device
PURE = {
    "arith": lambda: (x * 2 + 1).exp(),
    "where3": lambda: torch.where(mask, x, torch.zeros_like(x)),
    "masked_fill": lambda: x.masked_fill(mask, 0.0),
    "gather": lambda: x.gather(0, torch.arange(2)),
    "int index": lambda: x[torch.tensor([0, 2])],
    "slice": lambda: x[1:3],
    "setitem int": lambda: x.clone().__setitem__(torch.tensor([1]), 5.0),
    "repeat const": lambda: x.repeat_interleave(2),
    "repeat output_size": lambda: torch.repeat_interleave(x, reps, output_size=4),
    "to dtype": lambda: x.to(torch.float64),
    "to non_blocking": lambda: x.to("cpu", non_blocking=True),
    "to own device": lambda: x.to(x.device),  # a CPU run of x.to(other.device): no move on a GPU either
    "host tensor": lambda: torch.tensor([1, 2]),
    "full": lambda: torch.full((3,), 2.0),
    "argmax sort cumsum": lambda: (x.argmax(), x.sort(), x.cumsum(0), torch.searchsorted(x.sort().values, x)),
    "copy same device": lambda: torch.empty(4).copy_(x),
    "shape": lambda: (x.shape[0], x.numel(), x.dim(), len(x)),
}


@pytest.mark.parametrize("op", sorted(BLOCKING))
def test_each_blocking_call_is_counted_once_at_its_line(op):
    fn = BLOCKING[op]
    with HostSyncCounter() as c:
        fn()
    assert [e.op for e in c.events] == [op]
    e = c.events[0]
    assert isinstance(e, HostSync) and e.device == "cpu"
    # the innermost frame outside torch: the lambda's own line in this file
    assert e.file.endswith("tests/core/test_host_sync.py")
    assert e.line == inspect.getsourcelines(fn)[1]


@pytest.mark.parametrize("name", sorted(PURE))
def test_device_ops_are_not_counted(name):
    with HostSyncCounter() as c:
        PURE[name]()
    assert c.events == []


def _helper_that_syncs(t):
    return t.sum().item()


def test_path_filter_count_and_sites():
    with HostSyncCounter(include=("tests/core/test_host_sync.py",)) as keep, HostSyncCounter(include=("no/such/dir/",)) as drop:
        pass
    assert keep.events == [] and drop.events == []
    with HostSyncCounter(include=("tests/core/test_host_sync.py",)) as c:
        for _ in range(3):
            _helper_that_syncs(x)
        x.tolist()
    assert c.count() == 4 and c.count("read:Tensor.item") == 3
    line = inspect.getsourcelines(_helper_that_syncs)[1] + 1
    sites = c.by_site()
    assert sites[(c.events[0].file, line, "read:Tensor.item")] == 3
    assert f"test_host_sync.py:{line} read:Tensor.item x3" in c.format()
    with HostSyncCounter(include=("sglang_tev/",)) as c:
        _helper_that_syncs(x)
    assert c.events == []  # the caller is a test file, not sglang_tev/
    with pytest.raises(TypeError, match="include"):
        HostSyncCounter(include="sglang_tev/")


def test_caller_inside_a_library_is_the_frame_outside_torch():
    """A sync reached through torch's own Python code (torch.functional.unique) is reported at the
    caller of the torch function, and one in sglang_tev at its sglang_tev line."""
    from sglang_tev.tree import DraftTree

    t = DraftTree.from_parents(torch.tensor([[-1, 0, 0]]), torch.tensor([[5, 1, 2]]), validate=False)
    with HostSyncCounter(include=("sglang_tev/",)) as c:
        t.host()
    assert c.count() == 3 and {e.op for e in c.events} == {"read:Tensor.tolist"}
    assert all(e.file.endswith("sglang_tev/tree.py") for e in c.events)


def test_count_cpu_false_counts_only_device_tensors():
    """On a GPU the counter is run with count_cpu=False: host tensors are bookkeeping, not syncs.
    The meta device stands in for CUDA here (no data, but the same dispatch)."""
    m = torch.zeros(3, device="meta")
    with HostSyncCounter(count_cpu=False) as c:
        x.tolist()
        x.nonzero()
        torch.tensor([1, 2], device="cpu")
        for kw in ({"non_blocking": True}, {}):
            try:
                m.to("cpu", **kw)  # meta -> cpu cannot copy data; the call is still seen first
            except NotImplementedError:
                pass
        torch.tensor([1, 2], device="meta")
        x.to("meta")
    assert [(e.op, e.device) for e in c.events] == [
        ("to_host:Tensor.to", "meta"), ("to_device:torch.tensor", "meta"), ("to_device:Tensor.to", "meta")]


def test_a_broken_classifier_is_caught(monkeypatch):
    """The test above is not vacuous: a counter that ignored __index__ would miss list[t]."""
    from sglang_tev.testing import host_sync

    monkeypatch.setattr(host_sync, "_READS", host_sync._READS - {torch.Tensor.__index__})
    with HostSyncCounter() as c:
        [1, 2, 3][i]
    assert c.events == []
