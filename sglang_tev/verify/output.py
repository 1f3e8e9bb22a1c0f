"""The verifiers' result types: :class:`VerifyOutput` (device tensors, or host lists kept by a
host walk) and :class:`HostDecision` (a round's decision as Python lists, in one transfer)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..tree import DraftTree

__all__ = ["VerifyOutput", "HostDecision", "first_nonfinite"]


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
        reach_cum: per tree, ``sum_{i = 1..B'} P(v_i)`` (the coverage of the tree's first B'
            non-root nodes) for each ``B'`` of ``reach_at``, when asked for, else None.
        reach_nodes: per tree, ``P(v)`` of its valid nodes root first (greedy: 1 on the accepted
            path, 0 elsewhere), when asked for, else None.
    """

    paths: list
    path_tokens: list
    accept_len: list
    bonus: list
    coverage: list
    tree_nodes: list
    first_nonfinite: list | None = None
    reach_cum: list | None = None
    reach_nodes: list | None = None


class VerifyOutput:
    """Result of verifying a batch of trees (read-only).

    Attributes:
        path: int64 [b, N], accepted node indices root-first, -1 padded (static width).
        accept_len: int64 [b], accepted draft tokens (bonus excluded) = depth of the exit node.
        bonus: int64 [b], the bonus token drawn after the accepted path.
        exit_node: int64 [b], the last accepted node.
        coverage: float [b], the target coverage C_p of each tree under the processed target
            law (E[accept_len], paper Eq. 6); an extra the runtimes report.
        reach: float [b, N] or None, the target reach probability P(v) of every node (paper
            Eq. 2) when the verifier computed the exit law (None: greedy, where P is 1 on the
            accepted path and 0 elsewhere, which :meth:`host` uses instead).

    A verifier that decided on the host (greedy on CPU) keeps its Python lists and builds these
    tensors only when one is read; :meth:`host` then costs nothing.
    """

    __slots__ = ("_tensors", "_host", "_shape", "reach")
    _FIELDS = ("path", "accept_len", "bonus", "exit_node", "coverage")

    def __init__(self, path: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor, exit_node: torch.Tensor,
                 coverage: torch.Tensor, reach: torch.Tensor | None = None) -> None:
        self._tensors = (path, accept_len, bonus, exit_node, coverage)
        self._host = None
        self._shape = None
        self.reach = reach

    @classmethod
    def from_host(cls, decision: tuple, width: int, coverage_dtype: torch.dtype) -> "VerifyOutput":
        """A decision made on the host (greedy on CPU): ``decision`` = (paths, path_tokens,
        accept_len, bonus, coverage, tree_nodes, first_nonfinite), Python lists per row; the
        tensors (``path`` int64 [b, width], coverage of ``coverage_dtype``) are built only when
        one is read."""
        out = cls.__new__(cls)
        out._tensors, out._host, out._shape = None, decision, (width, coverage_dtype)
        out.reach = None
        return out

    @property
    def decided_on_host(self) -> bool:
        """The decision was made on the host (:meth:`from_host`): :meth:`host` costs nothing."""
        return self._host is not None

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

    def host(self, tree: DraftTree, check_finite: torch.Tensor | None = None,
             reach_at: list[int] | None = None, reach_nodes: bool = False) -> HostDecision:
        """The decision on the host, in ONE device-to-host transfer (none when the verifier
        decided on the host: its lists are kept).

        Args:
            tree: the tree this output verifies (its tokens give ``path_tokens``).
            check_finite: optional float [b, N, V], the logits that were verified: each tree's
                first valid node with a non-finite row max comes back in the same transfer (the
                host verifiers find it in the pass that takes the argmax).
            reach_at: optional increasing budgets ``B'`` in [1, N - 1]: ``reach_cum`` comes back in
                the same transfer (``budget="auto"``, :mod:`sglang_tev.autobudget`).
            reach_nodes: also return every valid node's ``P(v)`` in the same transfer (the
                planner's calibration labels, :class:`sglang_tev.plan.TreePlanner`).
        Returns:
            :class:`HostDecision`.
        """
        if self._host is not None:
            kept = self._host
            cum = None if not reach_at else [_path_reach(p, reach_at) for p in kept[0]]
            nodes = None if not reach_nodes else [_path_nodes(p, m) for p, m in zip(kept[0], kept[5])]
            return HostDecision(*kept[:6], first_nonfinite=None if check_finite is None else kept[6], reach_cum=cum,
                                reach_nodes=nodes)
        path, accept_len, bonus, _, coverage = self._tensors
        b, n = path.shape
        path_tokens = torch.gather(tree.tokens, 1, path.clamp(min=0))
        ints = torch.cat([path, path_tokens, accept_len.view(b, 1), bonus.view(b, 1),
                          tree.valid.sum(1, keepdim=True)], 1)
        parts = [ints.to(torch.float64), coverage.view(b, 1).to(torch.float64)]  # ids < 2^53: exact
        if check_finite is not None:
            parts.append(check_finite.amax(-1).to(torch.float64))
        want_nodes = reach_nodes and self.reach is not None
        if want_nodes:  # before the sub-budget coverages, which come last
            parts.append(self.reach.to(torch.float64))
        n_reach = len(reach_at) if reach_at else 0
        if n_reach and self.reach is not None:
            cum = self.reach.to(torch.float64)[:, 1:].cumsum(1)  # node 0 is the root
            parts.append(cum[:, [x - 1 for x in reach_at]])
        rows = torch.cat(parts, 1).tolist()  # the one transfer
        acc = [int(h[2 * n]) for h in rows]
        nodes = [int(h[2 * n + 2]) for h in rows]
        paths = [[int(x) for x in h[: a + 1]] for h, a in zip(rows, acc)]
        node_reach = None
        if reach_nodes:
            end = len(rows[0]) - (n_reach if n_reach and self.reach is not None else 0)
            node_reach = ([h[end - n: end][:m] for h, m in zip(rows, nodes)] if want_nodes
                          else [_path_nodes(p, m) for p, m in zip(paths, nodes)])
        reach_cum = None
        if n_reach:
            reach_cum = ([h[-n_reach:] for h in rows] if self.reach is not None
                         else [_path_reach(p, reach_at) for p in paths])
        return HostDecision(
            reach_cum=reach_cum,
            reach_nodes=node_reach,
            paths=paths,
            path_tokens=[[int(x) for x in h[n: n + a + 1]] for h, a in zip(rows, acc)],
            accept_len=acc,
            bonus=[int(h[2 * n + 1]) for h in rows],
            coverage=[h[2 * n + 3] for h in rows],
            tree_nodes=nodes,
            first_nonfinite=None if check_finite is None else [first_nonfinite(h[2 * n + 4:], m)
                                                              for h, m in zip(rows, nodes)],
        )


def _path_reach(path: list, reach_at: list[int]) -> list[float]:
    """Greedy law: P(v) is 1 on the accepted path and 0 elsewhere, so the coverage of the first B'
    nodes is the number of path nodes (root excluded) with index <= B'."""
    nodes = path[1:]
    return [float(sum(1 for v in nodes if v <= x)) for x in reach_at]


def _path_nodes(path: list, n_valid: int) -> list[float]:
    """Greedy law: ``P(v)`` of each of the first ``n_valid`` nodes, 1 on the accepted path, else 0."""
    on = set(path)
    return [1.0 if v in on else 0.0 for v in range(n_valid)]


def first_nonfinite(row_max: list, n_valid: int) -> int:
    """The first of the first ``n_valid`` row maxima that is not finite, or -1."""
    return next((v for v in range(n_valid) if not math.isfinite(row_max[v])), -1)
