"""Differences between the transformers releases the package supports, in one place (stdlib
only): the hf runtime, the trainer and the test models all pass a KV cache the same way."""

from __future__ import annotations

import inspect

__all__ = ["cache_kwarg_name", "cache_kwargs"]


def cache_kwarg_name(model) -> str:
    """The KV-cache keyword of ``model.forward``: ``cache`` where transformers has renamed it
    (the signature says so; 5.2x), else ``past_key_values`` (which newer releases accept only
    until their removal)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{cache_kwarg_name(model): cache}``, to pass a KV cache to ``model(...)``."""
    return {cache_kwarg_name(model): cache}
