"""The one entry point :func:`verify_tree`: argument checks, the greedy shortcut, the uniforms,
and the choice of verifier and backend (the methods themselves live in their own files)."""

from __future__ import annotations

import torch

from ..sampling import GREEDY_EPS, LogitsProcessor, SamplingParams, processed_probs, validate_logits
from ..spec import VERIFIERS as METHODS
from ..spec import is_scalar_greedy, num_uniforms
from ..tree import DraftTree, edge_probs, exit_law_from_edges
from .. import execution
from .greedy import greedy_on_host, greedy_verify
from .output import VerifyOutput
from .predraw import predraw_verify
from .sequential import sequential_verify
from .tev import tev_verify_logits

__all__ = ["verify_tree", "num_uniforms", "METHODS", "BACKENDS", "KERNEL_DTYPES", "triton_available"]

BACKENDS = ("auto", "torch", "triton")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_available() -> bool:
    """Whether the fused TEV kernel can run here: Triton imports and (on CPU) ``TRITON_INTERPRET=1``."""
    from . import triton_tev

    return triton_tev.HAS_TRITON


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,
    method: str = "tev",
    sampling: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    validate: bool = True,
    logits_processor: LogitsProcessor | None = None,
    backend: str | None = None,
) -> VerifyOutput:
    """Verify draft trees against the target and return the accepted paths and bonus tokens.

    Args:
        tree: the draft trees (N nodes, b trees).
        target_logits: float [b, N, V], the target's logits at every tree node (node v's row
            predicts the token after pi(v)). Rows of padded nodes are ignored.
        method: ``"tev"``, ``"predraw"``, ``"sequential"`` or ``"greedy"``.
        sampling: the target law's parameters (default: temperature 1, no truncation).
        generator: source of the uniforms when ``uniforms`` is None.
        uniforms: optional float64 [b, U] in [0, 1), the ONLY randomness when given;
            U = :func:`num_uniforms` (method, N).
        validate: check every argument (several host syncs). Runtimes pass False after checking
            once; then ``tev`` performs no host sync.
        logits_processor: optional ``fn(logits [b, N, V], tree) -> logits`` applied before the
            sampling law (penalties, logit bias, grammar).
        backend: where ``tev`` runs. ``None`` / ``"auto"``: the fused Triton kernel
            (:mod:`sglang_tev.verify.triton_tev`) for CUDA bf16 / fp16 / fp32 logits when Triton
            imports, else the torch reference (:func:`sglang_tev.verify.tev.tev_verify_logits`).
            ``"torch"``: always the reference. ``"triton"``: always the kernel (on CPU only under
            ``TRITON_INTERPRET=1``, for tests). Other methods run in torch; they accept
            ``None`` / ``"auto"`` / ``"torch"``. Both backends consume the same uniforms the same way.

    Returns:
        :class:`VerifyOutput`.

    Raises:
        ValueError naming the argument: unknown method; ``greedy`` with any temperature >= 1e-5
        (not exact there); wrong shape/dtype/device of ``target_logits`` or ``uniforms``; NaN or
        +inf logits, or a valid row of only -inf; uniforms outside [0, 1); invalid sampling values;
        an unknown ``backend``, ``"triton"`` for a method other than ``tev``, for float64 logits
        or where Triton cannot run (these backend checks are host-side and always run).
    """
    sampling = SamplingParams() if sampling is None else sampling
    b, n = tree.batch_size, tree.num_nodes
    use_kernel = _use_kernel(backend, method, target_logits)
    if validate:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not isinstance(tree, DraftTree):
            raise ValueError(f"tree must be a DraftTree, got {type(tree).__name__}")
        if not isinstance(target_logits, torch.Tensor) or not target_logits.is_floating_point():
            raise ValueError("target_logits must be a floating tensor [b, N, V]")
        if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (b, n):
            raise ValueError(f"target_logits must have shape [{b}, {n}, V], got {tuple(target_logits.shape)}")
        if target_logits.device != tree.device:
            raise ValueError(f"target_logits must be on the tree's device {tree.device}, got {target_logits.device}")
        sampling.validate(b)
        if method == "greedy" and not sampling.all_greedy():
            raise ValueError(
                f"method 'greedy' is exact only at temperature < {GREEDY_EPS}; got temperature {sampling.temperature}"
            )
        if uniforms is not None:
            want = num_uniforms(method, n)
            if not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float64:
                raise ValueError("uniforms must be a float64 tensor")
            if tuple(uniforms.shape) != (b, want):
                raise ValueError(f"uniforms must have shape [{b}, {want}] for method {method!r}, got {tuple(uniforms.shape)}")
            if uniforms.device != tree.device:
                raise ValueError(f"uniforms must be on the tree's device {tree.device}")
            if bool(((uniforms < 0) | (uniforms >= 1)).any()):
                raise ValueError("uniforms must lie in [0, 1)")

    # Padded rows may hold anything (even NaN): every step below masks them out by `valid`
    # (rho, edges, child matches), so they are never copied or cleaned here.
    logits = target_logits
    if logits_processor is not None:
        logits = logits_processor(logits, tree)
    if validate:
        validate_logits("target_logits", logits, tree.valid)

    if is_scalar_greedy(sampling.temperature):
        # Greedy law: every p_v is one-hot at the argmax, so each method is argmax-follow
        # (DESIGN §1) and uses no randomness; coverage is then the argmax path's depth.
        if logits.device.type == "cpu" and b * n <= execution.current().host_walk_max_nodes:
            return greedy_on_host(tree, logits)
        exit_node, bonus = greedy_verify(tree, logits)
        accept_len = torch.gather(tree.depth, 1, exit_node.unsqueeze(1)).squeeze(1)
        coverage = accept_len.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        return VerifyOutput(tree.path(exit_node), accept_len, bonus, exit_node, coverage)

    if uniforms is None:
        u_count = num_uniforms(method, n)
        uniforms = torch.rand(b, u_count, dtype=torch.float64, device=tree.device, generator=generator)

    if method == "tev":
        if use_kernel:
            from .triton_tev import triton_tev_verify

            exit_node, bonus, law = triton_tev_verify(tree, logits, sampling, uniforms)
        else:
            exit_node, bonus, law = tev_verify_logits(tree, logits, sampling, uniforms)
    else:
        probs = processed_probs(logits, sampling)
        if method == "predraw":
            exit_node, bonus = predraw_verify(tree, probs, uniforms)
        elif method == "sequential":
            exit_node, bonus = sequential_verify(tree, probs, uniforms)
        else:
            exit_node, bonus = greedy_verify(tree, logits)
        law = _law(tree, probs)
    accept_len = torch.gather(tree.depth, 1, exit_node.unsqueeze(1)).squeeze(1)
    return VerifyOutput(tree.path(exit_node), accept_len, bonus, exit_node, law.coverage, reach=law.P)


def _use_kernel(backend: str | None, method: str, logits) -> bool:
    """Resolve ``backend`` on the host (no sync); raise ValueError naming it when it cannot apply."""
    backend = "auto" if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "torch":
        return False
    is_tensor = isinstance(logits, torch.Tensor)
    if backend == "auto":
        return (
            method == "tev" and is_tensor and logits.is_cuda and logits.dtype in KERNEL_DTYPES and triton_available()
        )
    if method != "tev":
        raise ValueError(f"backend 'triton' exists only for method 'tev', got method {method!r}")
    if is_tensor and logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"backend 'triton' takes bf16 / fp16 / fp32 target_logits, got {logits.dtype}")
    if not triton_available():
        raise ValueError("backend 'triton' needs Triton (and TRITON_INTERPRET=1 set before import on CPU)")
    if is_tensor and not logits.is_cuda and not _interpreting():
        raise ValueError("backend 'triton' on CPU needs TRITON_INTERPRET=1 set before Triton is imported")
    return True


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _law(tree: DraftTree, probs: torch.Tensor):
    return exit_law_from_edges(tree, edge_probs(tree, probs), validate=False)

