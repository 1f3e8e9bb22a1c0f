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

import math
from dataclasses import dataclass

import torch

from ..draft.host_native import native
from ..sampling import GREEDY_EPS, LogitsProcessor, SamplingParams, processed_probs, validate_logits
from ..tree import DraftTree, edge_probs, exit_law_from_edges
from . import predraw as _predraw
from . import sequential as _sequential
from ._common import argmax_and_max
from .greedy import greedy_verify
from .predraw import predraw_verify
from .sequential import sequential_verify
from .tev import tev_verify, tev_verify_logits

__all__ = ["VerifyOutput", "HostDecision", "verify_tree", "num_uniforms", "METHODS", "BACKENDS", "triton_available"]

METHODS = ("tev", "predraw", "sequential", "greedy")
BACKENDS = ("auto", "torch", "triton")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_available() -> bool:
    """Whether the fused TEV kernel can run here: Triton imports and (on CPU) ``TRITON_INTERPRET=1``."""
    from . import triton_tev

    return triton_tev.HAS_TRITON


@dataclass(frozen=True)
class HostDecision:
    """A round's decision as Python lists, what a runtime reads on the host
    (:meth:`VerifyOutput.host`).

    Attributes:
        paths: per tree, the accepted node indices root-first (no padding; length accept_len + 1).
        path_tokens: their tokens (the root token first).
        accept_len, bonus: per tree, as :class:`VerifyOutput`.
        coverage: per tree, C_p as a float.
        tree_nodes: per tree, the valid nodes (root included).
        first_nonfinite: per tree, the first valid node whose logits row holds a NaN or +inf
            or only -inf (its max is not finite), or -1; when asked for with ``check_finite``,
            else None.
    """

    paths: list
    path_tokens: list
    accept_len: list
    bonus: list
    coverage: list
    tree_nodes: list
    first_nonfinite: list | None = None


class VerifyOutput:
    """Result of verifying a batch of trees (read-only).

    Attributes:
        path: int64 [b, N], accepted node indices root-first, -1 padded (static width).
        accept_len: int64 [b], accepted draft tokens (bonus excluded) = depth of the exit node.
        bonus: int64 [b], the bonus token drawn after the accepted path.
        exit_node: int64 [b], the last accepted node.
        coverage: float [b], the target coverage C_p of each tree under the processed target
            law (E[accept_len], paper Eq. 6); an extra the runtimes report.

    A verifier that decided on the host (greedy on CPU) keeps its Python lists and builds these
    tensors only when one is read; :meth:`host` then costs nothing.
    """

    __slots__ = ("_tensors", "_host", "_shape")
    _FIELDS = ("path", "accept_len", "bonus", "exit_node", "coverage")

    def __init__(self, path: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor, exit_node: torch.Tensor,
                 coverage: torch.Tensor) -> None:
        self._tensors = (path, accept_len, bonus, exit_node, coverage)
        self._host = None
        self._shape = None

    @classmethod
    def _from_host(cls, decision: tuple, width: int, coverage_dtype: torch.dtype) -> "VerifyOutput":
        """From host lists (paths, path_tokens, accept_len, bonus, coverage, tree_nodes,
        first_nonfinite)."""
        out = cls.__new__(cls)
        out._tensors, out._host, out._shape = None, decision, (width, coverage_dtype)
        return out

    def _materialise(self) -> tuple:
        if self._tensors is None:
            paths, _, acc, bonus = self._host[:4]
            n, cover_dt = self._shape
            path = torch.tensor([p + [-1] * (n - len(p)) for p in paths], dtype=torch.int64)
            acc_t, bonus_t, exit_t = torch.tensor([acc, bonus, [p[-1] for p in paths]], dtype=torch.int64)
            self._tensors = (path, acc_t, bonus_t, exit_t, acc_t.to(cover_dt))
        return self._tensors

    path = property(lambda self: self._materialise()[0])
    accept_len = property(lambda self: self._materialise()[1])
    bonus = property(lambda self: self._materialise()[2])
    exit_node = property(lambda self: self._materialise()[3])
    coverage = property(lambda self: self._materialise()[4])

    def __iter__(self):
        return iter(self._materialise())

    def __repr__(self) -> str:
        return "VerifyOutput(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self._FIELDS) + ")"

    def host(self, tree: DraftTree, check_finite: torch.Tensor | None = None) -> HostDecision:
        """The decision on the host, in ONE device-to-host transfer (none when the verifier
        decided on the host: its lists are kept).

        Args:
            tree: the tree this output verifies (its tokens give ``path_tokens``).
            check_finite: optional float [b, N, V], the logits that were verified: each tree's
                first valid node with a non-finite row max comes back in the same transfer (the
                host verifiers find it in the pass that takes the argmax).
        Returns:
            :class:`HostDecision`.
        """
        if self._host is not None:
            kept = self._host
            return HostDecision(*kept[:6], first_nonfinite=None if check_finite is None else kept[6])
        path, accept_len, bonus, _, coverage = self._tensors
        b, n = path.shape
        path_tokens = torch.gather(tree.tokens, 1, path.clamp(min=0))
        ints = torch.cat([path, path_tokens, accept_len.view(b, 1), bonus.view(b, 1),
                          tree.valid.sum(1, keepdim=True)], 1)
        parts = [ints.to(torch.float64), coverage.view(b, 1).to(torch.float64)]  # ids < 2^53: exact
        if check_finite is not None:
            parts.append(check_finite.amax(-1).to(torch.float64))
        rows = torch.cat(parts, 1).tolist()  # the one transfer
        acc = [int(h[2 * n]) for h in rows]
        nodes = [int(h[2 * n + 2]) for h in rows]
        return HostDecision(
            paths=[[int(x) for x in h[: a + 1]] for h, a in zip(rows, acc)],
            path_tokens=[[int(x) for x in h[n: n + a + 1]] for h, a in zip(rows, acc)],
            accept_len=acc,
            bonus=[int(h[2 * n + 1]) for h in rows],
            coverage=[h[2 * n + 3] for h in rows],
            tree_nodes=nodes,
            first_nonfinite=None if check_finite is None else [_first_nonfinite(h[2 * n + 4:], m)
                                                              for h, m in zip(rows, nodes)],
        )


def _first_nonfinite(row_max: list, n_valid: int) -> int:
    """The first of the first ``n_valid`` row maxima that is not finite, or -1."""
    return next((v for v in range(n_valid) if not math.isfinite(row_max[v])), -1)


def num_uniforms(method: str, num_nodes: int) -> int:
    """How many float64 uniforms per tree ``method`` consumes (see the module table)."""
    if method == "tev":
        return 2
    if method == "predraw":
        return _predraw.num_uniforms(num_nodes)
    if method == "sequential":
        return _sequential.num_uniforms(num_nodes)
    if method == "greedy":
        return 0
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


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

    if _scalar_greedy(sampling.temperature):
        # Greedy law: every p_v is one-hot at the argmax, so each method is argmax-follow
        # (DESIGN §1) and uses no randomness; coverage is then the argmax path's depth.
        if logits.device.type == "cpu" and b * n <= HOST_WALK_MAX_NODES:
            return _greedy_on_host(tree, logits)
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
        coverage = law.coverage
    else:
        probs = processed_probs(logits, sampling)
        if method == "predraw":
            exit_node, bonus = predraw_verify(tree, probs, uniforms)
        elif method == "sequential":
            exit_node, bonus = sequential_verify(tree, probs, uniforms)
        else:
            exit_node, bonus = greedy_verify(tree, logits)
        coverage = _coverage(tree, probs)
    accept_len = torch.gather(tree.depth, 1, exit_node.unsqueeze(1)).squeeze(1)
    return VerifyOutput(tree.path(exit_node), accept_len, bonus, exit_node, coverage)


HOST_WALK_MAX_NODES = 4096
"""Greedy verification of CPU trees with at most this many nodes in all (b x N) walks the tree on
the host, as the DDTree reference does: one argmax pass, then a dictionary walk over the
tree's lists. Larger batches (and every other device) use the tensor walk
(:func:`~sglang_tev.verify.greedy.greedy_verify`); both give equal outputs."""


def _greedy_on_host(tree: DraftTree, logits: torch.Tensor) -> VerifyOutput:
    """Argmax-follow with the walk in Python: on CPU each small tensor op costs more than this
    whole walk (caches are cold after the target forward). Keeps the lists (and the first valid
    node whose row max, read at its argmax, is not finite) for :meth:`VerifyOutput.host`; tensors
    are built only if read."""
    b, n = tree.batch_size, tree.num_nodes
    cover_dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    fn = native("greedy_follow") if logits.dtype == torch.float32 else None
    if fn is not None:  # the same walk in one C call (sglang_tev/draft/_ddtree_host.c)
        x, par, tok, val = (t if t.is_contiguous() else t.contiguous()
                            for t in (logits, tree.parents, tree.tokens, tree.valid))
        out = torch.empty(b, 2 * n + 4, dtype=torch.int64)
        if fn(x.data_ptr(), b, n, x.shape[-1], par.data_ptr(), tok.data_ptr(), val.data_ptr(), out.data_ptr()) != 0:
            raise MemoryError("the native greedy walk could not allocate its scratch")
        rows = out.tolist()
        acc = [h[2 * n] for h in rows]
        return VerifyOutput._from_host(([h[: a + 1] for h, a in zip(rows, acc)], [h[n: n + a + 1] for h, a in zip(rows, acc)],
                                        acc, [h[2 * n + 1] for h in rows], [float(a) for a in acc],
                                        [h[2 * n + 2] for h in rows], [h[2 * n + 3] for h in rows]), n, cover_dt)
    top, row_max = argmax_and_max(logits)
    parents, tokens = tree.host()
    paths, path_tokens, acc, bonus = [], [], [], []
    for r in range(b):
        par, tok, tp = parents[r], tokens[r], top[r]
        child = {(par[i] << 32) | tok[i]: i for i in range(1, len(par))}
        cur, path = 0, [0]
        nxt = child.get(tp[0])  # the root's key: (0 << 32) | token
        while nxt is not None:
            path.append(nxt)
            cur = nxt
            nxt = child.get((cur << 32) | tp[cur])
        paths.append(path)
        path_tokens.append([tok[i] for i in path])
        acc.append(len(path) - 1)
        bonus.append(tp[cur])
    return VerifyOutput._from_host((paths, path_tokens, acc, bonus, [float(a) for a in acc],
                                    [len(p) for p in parents],
                                    [_first_nonfinite(m, len(p)) for m, p in zip(row_max, parents)]), n, cover_dt)


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


def _scalar_greedy(temperature) -> bool:
    """Host-side check (no sync): a Python-scalar temperature below 1e-5."""
    return not isinstance(temperature, torch.Tensor) and temperature < GREEDY_EPS


def _coverage(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    return exit_law_from_edges(tree, edge_probs(tree, probs), validate=False).coverage

