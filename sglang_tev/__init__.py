"""sglang-tev: lossless tree speculative decoding with Tree Exit Verification (TEV).

Core API (DESIGN §3)::

    from sglang_tev import (DraftTree, SamplingParams, exit_law, exit_law_from_edges,
                            build_ddtree, build_ddtree_topk, verify_tree)

The names load on first use (PEP 562), so ``import sglang_tev.cli`` and ``sglang-tev --help``
import no torch; the torch-free names and limits live in :mod:`sglang_tev.spec`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first attribute access)
_LAZY = {
    "build_ddtree": ".draft.ddtree",
    "build_ddtree_topk": ".draft.ddtree",
    "SamplingParams": ".sampling",
    "processed_probs": ".sampling",
    "DraftTree": ".tree",
    "ExitLaw": ".tree",
    "exit_law": ".tree",
    "exit_law_from_edges": ".tree",
    "residual_probs": ".tree",
    "VerifyOutput": ".verify",
    "num_uniforms": ".verify",
    "verify_tree": ".verify",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sglang_tev' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
