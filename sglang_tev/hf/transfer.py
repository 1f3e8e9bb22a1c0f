"""Host-to-device copies of the round's small index lists without a host sync."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device`` without a host sync: built in pinned host
    memory and copied with ``non_blocking=True`` on CUDA (``torch.tensor(..., device=cuda)``
    copies from pageable memory and waits for the stream); a plain tensor on CPU.

    Args:
        data: a (nested, rectangular) list of Python numbers.
        dtype: the tensor's dtype.
        device: where it goes.
    Returns:
        The tensor on ``device`` (its copy may still be in flight on the current CUDA stream;
        work queued after it on that stream sees the data).
    """
    pin = torch.device(device).type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)
