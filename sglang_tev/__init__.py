"""sglang-tev: lossless tree speculative decoding with Tree Exit Verification (TEV).

Core API (DESIGN §3)::

    from sglang_tev import (DraftTree, SamplingParams, exit_law, exit_law_from_edges,
                            build_ddtree, build_ddtree_topk, verify_tree)
"""

__version__ = "0.1.0"

from .draft.ddtree import build_ddtree, build_ddtree_topk
from .sampling import SamplingParams, processed_probs
from .tree import DraftTree, ExitLaw, exit_law, exit_law_from_edges, residual_probs
from .verify import VerifyOutput, num_uniforms, verify_tree

__all__ = [
    "__version__",
    "DraftTree",
    "ExitLaw",
    "SamplingParams",
    "VerifyOutput",
    "build_ddtree",
    "build_ddtree_topk",
    "exit_law",
    "exit_law_from_edges",
    "num_uniforms",
    "processed_probs",
    "residual_probs",
    "verify_tree",
]
