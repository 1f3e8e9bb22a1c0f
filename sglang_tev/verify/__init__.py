"""Exact tree verifiers behind one entry point, :func:`verify_tree`.

All four methods realise the same canonical law on a fixed tree when they are exact (paper
Theorem 1, Corollaries 1-2): exit at v with probability w(v), bonus ~ p_v^res. They differ in
how they spend randomness and compute:

=============  =====================================================  ======================
method         decision                                               uniforms U per tree
=============  =====================================================  ======================
``tev``        one exit draw V ~ w, one bonus draw ~ p_V^res           2
``predraw``    one target draw per node, follow the matching child     N
``sequential`` test children in order, remove rejected mass (EAGLE)    N
``greedy``     follow the argmax; only exact at temperature < 1e-5     0
=============  =====================================================  ======================

Verifiers share the law, not the samples: equal uniforms do not give equal outputs across methods.

``tev`` has two backends that consume the same uniforms the same way and return equal outputs:
the torch reference (:func:`sglang_tev.verify.tev.tev_verify_logits`, one pass over the
processed law) and the fused Triton kernel (:mod:`sglang_tev.verify.triton_tev`, one read of the
logits plus the exit row). ``verify_tree(backend=None)`` picks the kernel for CUDA bf16 / fp16 /
fp32 logits when Triton imports, the reference otherwise.
"""

from __future__ import annotations

# the package's names; each method's function stays importable from here too
from .dispatch import BACKENDS, KERNEL_DTYPES, METHODS, _use_kernel, num_uniforms, triton_available, verify_tree  # noqa: F401
from .greedy import greedy_verify  # noqa: F401
from .output import HostDecision, VerifyOutput
from .predraw import predraw_verify  # noqa: F401
from .sequential import sequential_verify  # noqa: F401
from .tev import tev_verify, tev_verify_logits  # noqa: F401

__all__ = ["VerifyOutput", "HostDecision", "verify_tree", "num_uniforms", "METHODS", "BACKENDS", "triton_available"]
