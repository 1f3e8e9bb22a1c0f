"""Count the calls that would block the host on a CUDA device (host syncs), with where they are.

:class:`HostSyncCounter` is a :class:`torch.overrides.TorchFunctionMode`: every torch call made
while it is active passes through it, and it records the ones that read a device tensor's values
on the host or copy host data onto the device without ``non_blocking``::

    from sglang_tev.testing.host_sync import HostSyncCounter

    with HostSyncCounter(include=("sglang_tev/",)) as c:
        worker.forward_batch_generation(batch)          # anything that calls torch
    for op, file, line, device in c.events:            # one HostSync per blocking call
        print(f"{file}:{line} {op} ({device})")
    c.count()                                           # len(c.events)
    c.by_site()                                         # {(file, line, op): times}

It runs on CPU as an emulator: by default (``count_cpu=True``) an op on a CPU tensor counts as if
the tensor lived on the device, so a CPU test run finds every place that would sync on a GPU. On
a GPU pass ``count_cpu=False`` to count only reads of non-CPU tensors (host-side bookkeeping on
CPU tensors, such as SGLang's ``seq_lens_cpu``, then does not count).

What counts (``HostSync.op`` names the kind):

==================  ========================================================================
op                  calls
==================  ========================================================================
``read``            ``Tensor.item / tolist / numpy / cpu / __bool__ / __int__ / __float__ /
                    __index__ / __array__ / __format__ / __repr__ / __contains__``,
                    ``torch.equal / allclose`` (a Python value from device data: ``if t:``,
                    ``int(t)``, ``range(t)``, ``list[t]``, ``np.asarray(t)``, printing)
``to_host``         ``Tensor.to(<cpu>)`` of a device tensor without ``non_blocking=True``; on
                    a CPU tensor only when the call names the host (``"cpu"`` or a CPU tensor:
                    ``x.to(y.device)`` stays on the device on a GPU run, so it is not counted);
                    ``Tensor.copy_`` from a device tensor into a CPU one without ``non_blocking``
``to_device``       ``torch.tensor / as_tensor`` with an explicit device (a non-CPU one; with
                    ``count_cpu`` any) and data that is not already a tensor on it: PyTorch builds
                    the data on the host and copies it with ``non_blocking=False``, which waits
                    for the stream; ``Tensor.to / cuda`` of a CPU tensor onto a device and
                    ``Tensor.copy_`` from CPU into a device tensor, without ``non_blocking``
``dynamic_shape``   ``nonzero`` (``Tensor.`` and ``torch.``), ``torch.argwhere``, one-argument
                    ``torch.where``, ``masked_select``, ``unique`` (``torch.`` and ``Tensor.``),
                    ``bincount``, ``repeat_interleave`` with tensor repeats and no
                    ``output_size``, ``Tensor.__getitem__`` / ``__setitem__`` with a bool or uint8
                    tensor index (alone or in a tuple): the output size is read from the device
==================  ========================================================================

Every call above was checked to reach ``__torch_function__`` (torch 2.14, ``tests/core/test_host_sync.py``
counts each one). Not seen by a TorchFunctionMode, so never counted: ``torch.cuda.synchronize``,
``Event.synchronize`` / ``Stream.synchronize``, reads inside C++ or Triton code, and calls made
while another TorchFunctionMode handles a call (a mode is popped while it runs, so an op's own
internal calls are not counted twice). ``HostSync.file`` / ``line`` is the innermost Python frame
outside torch (and outside this module); ``include`` keeps events whose file path contains one of
its fragments (``"/"``-separated, e.g. ``"sglang_tev/"`` or ``"sglang_tev/srt/round.py"``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from typing import NamedTuple, Sequence

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSync", "HostSyncCounter", "gpu_code_paths"]

_T = torch.Tensor
_READS = {
    _T.item, _T.tolist, _T.numpy, _T.cpu, _T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.__array__,
    _T.__format__, _T.__repr__, _T.__contains__, torch.equal, torch.allclose, _T.equal, _T.allclose,
}
_DYNAMIC = {_T.nonzero, torch.nonzero, torch.argwhere, _T.argwhere, _T.masked_select, torch.masked_select,
            torch.unique, _T.unique, torch.bincount, _T.bincount}
_REPEAT = {torch.repeat_interleave, _T.repeat_interleave}
_INDEX = {_T.__getitem__, _T.__setitem__}
_NEW = {torch.tensor, torch.as_tensor}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)


class HostSync(NamedTuple):
    """One blocking call.

    Attributes:
        op: the kind and the call, e.g. ``"read:Tensor.item"``, ``"dynamic_shape:Tensor.__getitem__"``.
        file: absolute path (``/``-separated) of the innermost Python frame outside torch and this module.
        line: its line number.
        device: the device type of the tensor involved (``"cpu"`` in a CPU emulation run).
    """

    op: str
    file: str
    line: int
    device: str


def _name(func) -> str:
    q = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if func in (torch.unique,):
        return "torch.unique"
    q = q.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")
    return q if "." in q else f"torch.{q}"


def _is_cpu(dev) -> bool:
    return dev is not None and torch.device(dev).type == "cpu"


def _target_device(args, kwargs):
    """The device a ``Tensor.to(...)`` call moves to (None when it only changes the dtype)."""
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, int) and not isinstance(a, bool):  # a CUDA ordinal
            return torch.device("cuda", a)
    other = kwargs.get("other")
    return other.device if isinstance(other, torch.Tensor) else None


def _names_cpu(args, kwargs) -> bool:
    """The ``Tensor.to`` call spells the host out: the string ``"cpu"`` or a CPU tensor. A
    ``torch.device`` object is usually another tensor's ``.device`` (the tensor's own device on a
    GPU run), so on a CPU run it does not count."""
    dev = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(dev, str):
        return dev.split(":")[0] == "cpu"
    return isinstance(dev, torch.Tensor) and dev.device.type == "cpu"


def _to_non_blocking(args, kwargs) -> bool:
    """``non_blocking`` of ``Tensor.to(device, dtype, non_blocking, copy)`` /
    ``to(dtype, non_blocking, copy)`` / ``to(tensor, non_blocking, copy)``."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    rest = list(args[1:])
    if rest and isinstance(rest[0], (str, torch.device, int)) and not isinstance(rest[0], bool):
        rest = rest[1:]  # the device
        if rest and isinstance(rest[0], torch.dtype):
            rest = rest[1:]
    elif rest and isinstance(rest[0], (torch.dtype, torch.Tensor)):
        rest = rest[1:]
    return bool(rest) and rest[0] is True


def _has_mask_index(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


class HostSyncCounter(TorchFunctionMode):
    """Record every torch call that would block the host on a CUDA device (see the module doc).

    Args:
        include: path fragments; an event is kept when its file contains one of them (None: all).
        count_cpu: count ops on CPU tensors as if they were on the device (default True: the CPU
            emulation); False counts only ops that involve a non-CPU tensor or device.
    Attributes:
        events: list of :class:`HostSync` ``(op, file, line, device)``, in call order.
    Use as a context manager (``with HostSyncCounter() as c:``); re-entering clears nothing.
    """

    def __init__(self, include: Sequence[str] | None = None, count_cpu: bool = True) -> None:
        super().__init__()
        if isinstance(include, str):
            raise TypeError("include must be a sequence of path fragments, not one string")
        self.include = None if include is None else tuple(s.replace(os.sep, "/") for s in include)
        self.count_cpu = bool(count_cpu)
        self.events: list[HostSync] = []

    # ------------------------------------------------------------------ results
    def count(self, op: str | None = None) -> int:
        """Events recorded (those whose ``op`` contains ``op`` when given)."""
        return sum(1 for e in self.events if op is None or op in e.op)

    def by_site(self) -> dict[tuple[str, int, str], int]:
        """``{(file, line, op): times}``, most frequent first."""
        return dict(Counter((e.file, e.line, e.op) for e in self.events).most_common())

    def format(self) -> str:
        """One line per site: ``file:line op xN``."""
        return "\n".join(f"{f}:{ln} {op} x{n}" for (f, ln, op), n in self.by_site().items())

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = self._classify(func, args, kwargs)
        if hit is not None:
            self._record(*hit)
        return func(*args, **kwargs)

    def _classify(self, func, args, kwargs):
        """(op, device type) when ``func(*args, **kwargs)`` blocks, else None."""
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        dev = first.device.type if first is not None else "cpu"
        if func in _READS:
            return f"read:{_name(func)}", dev
        if func in _DYNAMIC:
            return f"dynamic_shape:{_name(func)}", dev
        if func is torch.where and len(args) + len(kwargs) == 1:
            return "dynamic_shape:torch.where", dev
        if func in _REPEAT:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            single = func is torch.repeat_interleave and repeats is None  # repeat_interleave(repeats)
            if (single or isinstance(repeats, torch.Tensor)) and kwargs.get("output_size") is None and not (
                    len(args) > 3 and args[3] is not None):
                return f"dynamic_shape:{_name(func)}", dev
            return None
        if func in _INDEX:
            if len(args) > 1 and _has_mask_index(args[1]):
                return f"dynamic_shape:{_name(func)}", dev
            return None
        if func is _T.to and first is not None:
            target = _target_device(args, kwargs)
            if target is None or _to_non_blocking(args, kwargs):
                return None
            if target.type == "cpu":
                if first.device.type != "cpu" or _names_cpu(args, kwargs):
                    return "to_host:Tensor.to", dev
                return None  # x.to(y.device) on a CPU run: a no-op there, and on the device too
            if first.device.type == "cpu":
                return "to_device:Tensor.to", target.type
            return None
        if func is _T.cuda and first is not None and first.device.type == "cpu":
            if kwargs.get("non_blocking", False):
                return None
            return "to_device:Tensor.cuda", "cuda"
        if func is _T.copy_ and first is not None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            src = args[1]
            if kwargs.get("non_blocking", False) or (len(args) > 2 and args[2] is True):
                return None
            if first.device.type == "cpu" and src.device.type != "cpu":
                return "to_host:Tensor.copy_", src.device.type
            if first.device.type != "cpu" and src.device.type == "cpu":
                return "to_device:Tensor.copy_", first.device.type
            return None
        if func in _NEW:
            target = kwargs.get("device")
            if target is None:
                return None
            target = torch.device(target)
            data = args[0] if args else kwargs.get("data")
            if isinstance(data, torch.Tensor) and data.device == target:
                return None  # already there: no copy
            return f"to_device:{_name(func)}", target.type
        return None

    def _record(self, op: str, device: str) -> None:
        if not self.count_cpu and device == "cpu":
            return
        frame = sys._getframe(2)  # skip _record and __torch_function__
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(_TORCH_DIR) and path != _THIS_FILE:
                break
            frame = frame.f_back
        file = path.replace(os.sep, "/") if frame is not None else "?"
        line = frame.f_lineno if frame is not None else 0
        if self.include is not None and not any(s in file for s in self.include):
            return
        self.events.append(HostSync(op, file, line, device))


@contextlib.contextmanager
def gpu_code_paths():
    """Run the round's CUDA code paths on CPU tensors, so a CPU test counts or compiles what a GPU
    runs: the level-wise DDTree builder (not the CPU heap) with its static depth bound (not the
    exact max-depth read), the verifier's device walk (not the CPU host walk), ``torch.argmax``
    (not the NumPy view): :data:`sglang_tev.execution.DEVICE_PATHS`, restored on exit. Results are
    unchanged (the paths are tested equal); only speed on CPU and the host reads differ."""
    from .. import execution

    with execution.use(execution.DEVICE_PATHS):
        yield
