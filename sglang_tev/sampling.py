"""Sampling parameters and the processed target law.

Exactness in this project is always with respect to the *processed* target law: the same
distribution plain (non-speculative) sampling would draw from. It is computed in this order,
as HF transformers' logits warpers do::

    softmax(logits / T) -> top-k -> renormalise -> top-p -> renormalise -> min-p -> renormalise

* ``temperature < 1e-5`` means greedy: a one-hot law at the argmax (ties -> lowest id).
* top-k: ``k <= 0`` or ``k >= V`` is off; tokens tied with the k-th largest probability are kept.
* top-p: keep the smallest set, by descending probability (ties -> lower id first), whose mass
  reaches ``top_p``; the crossing token is kept. ``top_p = 1`` is off.
* min-p: keep tokens with ``p >= min_p * max p``; ``min_p = 0`` is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

__all__ = ["SamplingParams", "GREEDY_EPS", "processed_probs", "validate_logits", "LogitsProcessor"]

from .spec import GREEDY_EPS  # noqa: E402  (temperatures below it are greedy, DESIGN §1)

Scalar = Union[int, float, torch.Tensor]
LogitsProcessor = Callable[[torch.Tensor, object], torch.Tensor]
"""``logits_processor(logits [b, N, V], tree) -> logits [b, N, V]``: per-node, path-dependent
processing (penalties, logit bias, grammar). Node v has generated ``committed + depth(v)`` tokens."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; each field a Python scalar or a ``[b]`` tensor.

    Attributes:
        temperature: >= 0; below 1e-5 means greedy. Default 1.0.
        top_k: int; <= 0 or >= V means off. Default 0.
        top_p: in (0, 1]; 1 means off. Default 1.0.
        min_p: in [0, 1]; 0 means off. Default 0.0.
    """

    temperature: Scalar = 1.0
    top_k: Scalar = 0
    top_p: Scalar = 1.0
    min_p: Scalar = 0.0

    def validate(self, batch_size: int | None = None) -> None:
        """Raise ValueError naming the field for an out-of-range value or a wrong-length tensor."""
        for name in ("temperature", "top_k", "top_p", "min_p"):
            x = getattr(self, name)
            if isinstance(x, torch.Tensor):
                if x.dim() > 1 or (batch_size is not None and x.dim() == 1 and x.numel() != batch_size):
                    raise ValueError(f"{name} must be a scalar or a [{batch_size}] tensor, got shape {tuple(x.shape)}")
                if x.is_floating_point() and bool(torch.isnan(x).any()):
                    raise ValueError(f"{name} must not be NaN")
            elif isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"{name} must be a number or a tensor, got {type(x).__name__}")
            elif x != x:
                raise ValueError(f"{name} must not be NaN")
        t = torch.as_tensor(self.temperature, dtype=torch.float64)
        if bool((t < 0).any()):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        p = torch.as_tensor(self.top_p, dtype=torch.float64)
        if bool(((p <= 0) | (p > 1)).any()):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        m = torch.as_tensor(self.min_p, dtype=torch.float64)
        if bool(((m < 0) | (m > 1)).any()):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        k = torch.as_tensor(self.top_k)
        if k.is_floating_point() and bool((k != k.round()).any()):
            raise ValueError(f"top_k must be an integer, got {self.top_k}")

    def greedy_mask(self, batch_size: int, device) -> torch.Tensor:
        """bool [b]: rows whose temperature is below 1e-5."""
        t = _as_rows(self.temperature, batch_size, device, torch.float64)
        return t < GREEDY_EPS

    def all_greedy(self) -> bool:
        """True when every row is greedy (host-side check)."""
        return bool((torch.as_tensor(self.temperature, dtype=torch.float64) < GREEDY_EPS).all())


def _as_rows(x: Scalar, b: int, device, dtype) -> torch.Tensor:
    if isinstance(x, (bool, int, float)):
        # a fill on the device: torch.as_tensor of a Python number would copy it from the host
        # with a blocking copy (a host sync on a GPU)
        return torch.full((b,), x, dtype=dtype, device=device)
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.expand(b) if t.dim() == 0 else t


def validate_logits(name: str, logits: torch.Tensor, valid: torch.Tensor | None = None) -> None:
    """Raise ValueError naming ``name`` for NaN / +inf entries or a row of only -inf.

    Rows where ``valid`` (bool, ``logits.shape[:-1]``) is False are not checked.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor")
    bad = torch.isnan(logits) | (logits == float("inf"))
    row_bad = bad.any(-1)
    row_dead = (logits == float("-inf")).all(-1)
    if valid is not None:
        row_bad = row_bad & valid
        row_dead = row_dead & valid
    if bool(row_bad.any()):
        raise ValueError(f"{name} contains NaN or +inf")
    if bool(row_dead.any()):
        raise ValueError(f"{name} has a row whose entries are all -inf")


def processed_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The processed target law.

    Args:
        logits: float [b, ..., V]. -inf entries are allowed (masked tokens); rows must be finite
            elsewhere (see :func:`validate_logits`). bf16/fp16 are upcast to float32.
        sampling: per-row parameters (scalars or [b] tensors).
    Returns:
        probs [b, ..., V], float32 (float64 for float64 logits); each row sums to 1.

    No host sync.
    """
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dt)
    b, v = x.shape[0], x.shape[-1]
    extra = (1,) * (x.dim() - 1)
    dev = x.device

    def rows(val, dtype):
        return _as_rows(val, b, dev, dtype).view(b, *extra)

    temp = rows(sampling.temperature, dt)
    greedy = temp < GREEDY_EPS
    # one fresh [.., V] buffer, softmax in place: large allocations dominate on CPU
    probs = x * (1.0 / torch.where(greedy, torch.ones_like(temp), temp))
    probs -= probs.amax(-1, keepdim=True)
    probs.exp_()
    probs /= probs.sum(-1, keepdim=True)

    # top-k: keep p >= the k-th largest (ties with it kept); k <= 0 or k >= V is off
    k = rows(sampling.top_k, torch.int64)
    k_on = (k > 0) & (k < v)
    if _maybe_any(k_on, sampling.top_k, lambda z: 0 < z < v):
        sorted_p = probs.sort(dim=-1, descending=True).values
        kth = torch.gather(sorted_p, -1, (k.clamp(1, v) - 1).expand(*probs.shape[:-1], 1))
        probs = torch.where(k_on & (probs < kth), torch.zeros_like(probs), probs)
        probs = probs / probs.sum(-1, keepdim=True)

    # top-p: smallest descending-probability set whose mass reaches top_p (crossing token kept)
    top_p = rows(sampling.top_p, dt)
    p_on = top_p < 1.0
    if _maybe_any(p_on, sampling.top_p, lambda z: z < 1.0):
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each sorted token
        keep_sorted = before < top_p
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = torch.where(p_on & ~keep, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(-1, keepdim=True)

    # min-p: keep p >= min_p * max p
    min_p = rows(sampling.min_p, dt)
    m_on = min_p > 0
    if _maybe_any(m_on, sampling.min_p, lambda z: z > 0):
        thresh = min_p * probs.amax(-1, keepdim=True)
        probs = torch.where(m_on & (probs < thresh), torch.zeros_like(probs), probs)
        probs = probs / probs.sum(-1, keepdim=True)

    if _maybe_any(greedy, sampling.temperature, lambda z: z < GREEDY_EPS):
        onehot = torch.zeros_like(probs).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy, onehot, probs)
    return probs


def _maybe_any(mask: torch.Tensor, param: Scalar, pred) -> bool:
    """Whether a stage may be active, decided on the host for Python scalars (no sync);
    tensor parameters always run the stage (masked per row), so no sync either."""
    if isinstance(param, torch.Tensor):
        return True
    return bool(pred(param))
