"""The learning-rate schedule: linear warmup, then cosine decay to a floor (the trainer's and
``scripts/build_tiny_code.py``'s target stage)."""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["lr_at", "lr_lambda"]


def lr_at(step: int, warmup: int, total: int, floor: float, base: float = 1.0) -> float:
    """The learning rate of update ``step`` (0-based): ``base * (step + 1) / warmup`` for the first
    ``warmup`` updates, then ``base * (floor + (1 - floor) · ½(1 + cos(π t)))`` with
    ``t = (step - warmup) / max(1, total - warmup)`` capped at 1 (``base · floor`` from ``total``
    on). ``base = 1`` gives the multiplier of ``torch.optim.lr_scheduler.LambdaLR``; the
    expression is evaluated in this order for any ``base`` (results are bit-stable)."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


def lr_lambda(warmup: int, total: int, floor: float) -> Callable[[int], float]:
    """``step -> lr_at(step, warmup, total, floor)``, a plain function: ``LambdaLR`` then keeps it
    out of its ``state_dict`` (checkpoints hold no schedule object)."""
    def f(step: int) -> float:
        return lr_at(step, warmup, total, floor)
    return f
