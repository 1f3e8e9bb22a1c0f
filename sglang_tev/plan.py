"""The budget policy a runtime asks before every round, and the plan it answers with (DESIGN §2).

A round reads one :class:`RoundPlan`: a budget per row (0 = a plain decoding step for that row),
the depth the drafter's block must reach, and the sub-budgets whose coverage the verifier should
report back. Whether the plan was fixed or chosen does not change the round's code: the round
never asks which policy made it.

Two policies:

* :class:`FixedBudget` -- every row, every round, the same budget B and the whole block
  (``--budget B``; what ``sglang-tev tune`` times).
* :class:`AutoBudget` -- ``budget="auto"``: the measured-cost controller of
  :mod:`sglang_tev.autobudget` (its choice from past rounds only, so the output law is
  untouched); a budget-B round drafts a block of ``min(K, B + 1)`` tokens, since a tree of B
  nodes reaches depth B at most. :class:`TreePlanner` with ``layout="ragged"`` (the SGLang worker on
  a backend that takes ragged verifies) gives each row its own budget; the transformers runtime
  pads rows to one width.

Torch-free: plans are host data, made before any device work of the round.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from .planner import ReachCalibration, allocate
from .spec import MAX_BUDGET, SpecError, check_budget

__all__ = ["RoundPlan", "BudgetPolicy", "FixedBudget", "AutoBudget", "TreePlanner", "cut_tree", "cut_rows"]


@dataclass(frozen=True)
class RoundPlan:
    """What one round runs.

    Attributes:
        budgets: one budget B per row, ints in ``[0, capacity]`` (0: that row takes a plain
            decoding step); rows in the batch's order.
        capacity: the largest budget any round of this call may plan (the buffers, the KV
            reservation and static shapes are sized by it: ``N = 1 + capacity``).
        draft_depth: how many mask slots the drafter's block fills, ``None`` for the whole
            block (``K - 1``); a tree of B nodes reaches depth B at most.
        reach_at: the sub-budgets ``0 < B' <= B`` whose coverage the verifier reports for the
            policy to learn from (empty: none wanted).
    """

    budgets: tuple[int, ...]
    capacity: int
    draft_depth: int | None = None
    reach_at: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.budgets:
            raise SpecError("budgets", "a plan needs one budget per row, got none")
        if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= self.capacity for b in self.budgets):
            raise SpecError("budgets", f"must be ints in [0, capacity={self.capacity}], got {self.budgets}")

    @property
    def budget(self) -> int:
        """The round's tree budget: the largest row's (the tree width every row is padded to)."""
        return max(self.budgets)

    @property
    def plain(self) -> bool:
        """Every row takes a plain decoding step (no draft, a root-only tree)."""
        return self.budget == 0

    @property
    def ragged(self) -> bool:
        """Rows take different budgets (a ragged runtime verifies ``sum(budgets) + rows`` tokens)."""
        return min(self.budgets) != max(self.budgets)

    @property
    def timed_budget(self) -> int:
        """The budget the cost table times this round as: :attr:`budget`, or for a ragged round
        the uniform width of the same token count (its mean budget per row, rounded, at least 1:
        how :meth:`TreePlanner._refine_ragged` reads the table)."""
        if not self.ragged:
            return self.budget
        return max(1, round(sum(self.budgets) / len(self.budgets)))


class BudgetPolicy(Protocol):
    """What a runtime asks each round. ``plan`` sees only past rounds (and, in later policies, this
    round's draft), so the output law of an exact verifier is untouched whatever it returns."""

    capacity: int

    def plan(self, batch: int) -> RoundPlan:
        """The plan of the next round of ``batch`` rows."""

    def observe(self, plan: RoundPlan, reach_cum: Iterable[Sequence[float]] | None, seconds: float) -> None:
        """Feed back a verified round: per row the coverage at each of ``plan.reach_at`` (None
        for a plain round) and the round's wall time in seconds."""


class FixedBudget:
    """Every row, every round: budget ``budget``, the whole block. ``observe`` learns nothing.

    Raises:
        SpecError naming ``budget``: not an int in ``[0, MAX_BUDGET]``.
    """

    def __init__(self, budget: int) -> None:
        check_budget(budget, allow_auto=False)
        self.capacity = budget
        self._plans: dict[int, RoundPlan] = {}

    def plan(self, batch: int) -> RoundPlan:
        p = self._plans.get(batch)
        if p is None:
            p = self._plans[batch] = RoundPlan((self.capacity,) * batch, self.capacity)
        return p

    def observe(self, plan: RoundPlan, reach_cum, seconds: float) -> None:
        return None


class AutoBudget:
    """``budget="auto"``: one budget for the batch from the cost controller, the block cut to it.

    Args:
        controller: a :class:`sglang_tev.autobudget.BudgetController` (its grid's largest
            budget is the capacity); any object with ``grid``, ``choose(batch) -> int``,
            ``grid_upto(budget)`` and ``observe(batch, budget, reach_cum, seconds)`` works.
        block_size: K of the drafter (None: no drafter; the depth is then not cut).
    Raises:
        SpecError naming ``controller``: its grid is empty or above :data:`MAX_BUDGET`.
    """

    def __init__(self, controller, block_size: int | None = None) -> None:
        grid = [int(b) for b in controller.grid]
        if not grid or max(grid) > MAX_BUDGET:
            raise SpecError("controller", f"grid must be non-empty budgets <= {MAX_BUDGET}, got {grid}")
        self.controller = controller
        self.capacity = max(grid)
        self.block_size = block_size
        self._plans: dict[tuple[int, int], RoundPlan] = {}  # (rows, budget) -> plan: no work per round

    def plan(self, batch: int) -> RoundPlan:
        b = self.controller.choose(batch)
        p = self._plans.get((batch, b))
        if p is None:
            depth = None if self.block_size is None else min(self.block_size - 1, b)
            p = self._plans[batch, b] = RoundPlan((b,) * batch, self.capacity, draft_depth=depth,
                                                  reach_at=tuple(self.controller.grid_upto(b)))
        return p

    def observe(self, plan: RoundPlan, reach_cum, seconds: float) -> None:
        self.controller.observe(len(plan.budgets), plan.budget, reach_cum, seconds)


class TreePlanner(AutoBudget):
    """``budget="auto"`` with this round's draft: the width of each round's trees from the
    calibrated values of the nodes the builder produced (:mod:`sglang_tev.planner`).

    Two stages. Before the draft, the cost controller's choice from past rounds
    (:class:`AutoBudget`: plain decoding or trees, calibration, probes, trials). In its steady
    rounds (calibrated, no trial, the choice itself, a tree) the tree is built one grid step
    larger (the headroom), and after the build :meth:`refine` cuts it to the grid width ``w``
    that maximises ``tokens - rate * seconds`` over the rows' calibrated node values (by edges
    when :meth:`refine_tree` reads them, scaled per segment of pop order by what past rounds held
    there: :meth:`~sglang_tev.planner.ReachCalibration.corrected`, learnt only from rounds whose
    width the values did not choose)
    (:func:`~sglang_tev.planner.allocate`, padded layout: the transformers runtime pads rows to one
    width), ``rate`` the tokens per second of recent rounds of this batch size (an EMA), the
    seconds the controller's cost table at (batch, w). The verified round's exit law labels every
    node's score with its reach (:meth:`observe` with ``reach_nodes``) for the calibration; the
    controller sees the round at the width it ran.

    Args:
        controller, block_size: as :class:`AutoBudget`.
        calibration: a :class:`~sglang_tev.planner.ReachCalibration` (kept across calls by the
            runtime, persisted with the cost table); None: a fresh one.
        rate_alpha: the EMA weight of the rate per round (0 < rate_alpha <= 1).
        headroom: ``"step"`` (default) or ``"capacity"``, see :meth:`headroom`.
        layout: ``"padded"`` (default: one width for every row, the transformers runtime's and a
            uniform verify's) or ``"ragged"`` (a runtime that verifies each row's tree at its own
            size in one forward, paying for the total): see :meth:`refine`.
    Raises:
        SpecError naming ``controller`` (as :class:`AutoBudget`), ``rate_alpha``, ``headroom`` or
        ``layout``.
    """

    def __init__(self, controller, block_size: int | None = None, calibration: ReachCalibration | None = None,
                 rate_alpha: float = 0.1, headroom: str = "step", layout: str = "padded") -> None:
        super().__init__(controller, block_size)
        if not 0 < rate_alpha <= 1:
            raise SpecError("rate_alpha", f"must be in (0, 1], got {rate_alpha!r}")
        self.calibration = calibration if calibration is not None else ReachCalibration()
        self.rate_alpha = float(rate_alpha)
        if headroom not in ("step", "capacity"):
            raise SpecError("headroom", f"must be 'step' or 'capacity', got {headroom!r}")
        self.headroom_mode = headroom
        if layout not in ("padded", "ragged"):
            raise SpecError("layout", f"must be 'padded' or 'ragged', got {layout!r}")
        self.layout = layout
        self._rate: dict[int, list[float]] = {}   # batch -> [EMA tokens, EMA seconds]
        self._pending: tuple | None = None        # (plan, regimes, scores, edges, values, refined) of the round
        self.widths: list[tuple[int, int, int]] = []  # (batch, ceiling, width) of refined rounds, last 10,000

    def plan(self, batch: int) -> RoundPlan:
        b = self.controller.choose(batch)
        st = self.controller.state(batch)
        steady = b > 0 and st.calibrated and st.trial is None and b == st.current
        if steady:
            b = self.headroom(b)
        p = self._plans.get((batch, b, steady))
        if p is None:
            depth = None if self.block_size is None else min(self.block_size - 1, b)
            reach_at = tuple(self.controller.grid_upto(b)) if not steady else ()
            p = self._plans[batch, b, steady] = _RefinablePlan((b,) * batch, self.capacity, draft_depth=depth,
                                                               reach_at=reach_at, refinable=steady)
        return p

    def headroom(self, budget: int) -> int:
        """The budget a steady round's tree is built at before :meth:`refine` cuts it: the grid's
        largest (``headroom="capacity"``) or the next grid budget above the controller's choice
        (``"step"``)."""
        if self.headroom_mode == "capacity":
            return self.capacity
        up = [g for g in self.controller.grid if g > budget]
        return up[0] if up else budget

    def rate(self, batch: int) -> float | None:
        """Recent tokens per second at this batch size (expected tokens from the rounds' reach),
        None before any round."""
        r = self._rate.get(batch)
        return None if r is None or r[1] <= 0 else r[0] / r[1]

    def refine(self, plan: RoundPlan, scores: Sequence[Sequence[float]], regimes: Sequence[str],
               edges: Sequence | None = None) -> RoundPlan:
        """The plan cut to this round's draft (``plan`` itself when it is not refinable).

        Args:
            plan: what :meth:`plan` returned this round.
            scores: per row, the draft path scores of its tree's non-root nodes in pop order
                (:func:`~sglang_tev.planner.node_path_scores`, padded nodes left out).
            regimes: per row, its calibration regime (:func:`~sglang_tev.planner.regime_of`).
            edges: per row, the same nodes' ``(edge_logq, depths, parents)``
                (:meth:`~sglang_tev.planner.ReachCalibration.update`): the calibration then values
                each node as the product of its edges' continuation chances and learns them;
                None: by path score alone.
        """
        if edges is not None and len(edges) != len(scores):
            raise SpecError("edges", f"one (edge_logq, depths, parents) per row: {len(edges)} for {len(scores)} rows")
        dep = None if edges is None else [tuple(list(x) for x in e) for e in edges]
        # the rows' node values as the calibration reads them now (its segments learn from them)
        raw = [self.calibration.values(g, s, None if dep is None else d)
               for g, s, d in zip(regimes, scores, dep or [None] * len(scores))] if plan.budget > 0 else None
        if not getattr(plan, "refinable", False):
            # not cut (calibration, probes, trials), but its nodes still label the calibration
            self._pending = (plan, list(regimes), [list(s) for s in scores], dep, raw, False) if plan.budget > 0 else None
            return plan
        batch, ceiling = len(plan.budgets), plan.budget
        sizes = self.controller.grid_upto(ceiling)
        segs = self.controller.grid_upto(self.capacity)
        values = [self.calibration.corrected(g, v, segs) for g, v in zip(regimes, raw)]
        costs = self.controller.costs
        alloc = allocate(values, lambda w: costs.cost(batch, w), layout="padded", sizes=sizes, rate=self.rate(batch))
        w = ceiling if alloc is None else max(1, alloc.size)
        w = min(ceiling, next((g for g in sizes if g >= w), ceiling))
        out = self._uniform(batch, w) if self.layout == "padded" else self._refine_ragged(batch, w, values, costs)
        self.widths.append((batch, ceiling, out.budget))
        del self.widths[:-10000]
        self._pending = (out, list(regimes), [list(s) for s in scores], dep, raw, True)
        return out

    def _uniform(self, batch: int, w: int) -> RoundPlan:
        out = self._plans.get((batch, w, "refined"))
        if out is None:
            depth = None if self.block_size is None else min(self.block_size - 1, w)
            out = self._plans[batch, w, "refined"] = RoundPlan((w,) * batch, self.capacity, draft_depth=depth,
                                                               reach_at=tuple(self.controller.grid_upto(w)))
        return out

    def _refine_ragged(self, batch: int, width: int, values: list[list[float]], costs) -> RoundPlan:
        """Per-row budgets within the uniform ``width`` the padded allocation chose: every row's
        first ``width`` nodes ranked together by calibrated value, the total chosen on the cost
        curve. A ragged round of ``t`` drafted nodes over ``batch`` rows is charged as a uniform
        round of width ``t / batch`` (interpolated between the table's integer widths, at least
        1: the draft was paid for every row): its forward's tokens. What scales with the widest
        row (the verify over the padded tree, a padded attention) is why no row exceeds
        ``width``: measured on the CPU server, uncapped rows ran up to the build's width and lost
        11-14 % against one width per round at concurrency 4 and 16, T = 0. Each row's tree is
        its own best-first prefix; at least one node in all."""
        values = [v[:width] for v in values]
        top = sum(len(v) for v in values)
        if top == 0:
            return self._uniform(batch, width)

        def cost(total: int) -> float | None:
            w = max(1.0, total / batch)
            lo = int(w)
            c0 = costs.cost(batch, lo)
            if c0 is None or w == lo:
                return c0
            c1 = costs.cost(batch, lo + 1)
            return None if c1 is None else c0 + (c1 - c0) * (w - lo)

        alloc = allocate(values, cost, layout="ragged", sizes=range(1, top + 1), rate=self.rate(batch))
        if alloc is None:
            return self._uniform(batch, width)
        budgets = tuple(alloc.budgets)
        if min(budgets) == max(budgets):
            return self._uniform(batch, budgets[0])
        depth = None if self.block_size is None else min(self.block_size - 1, max(budgets))
        # the controller's gains learn from sub-budgets every row verified in full
        return RoundPlan(budgets, self.capacity, draft_depth=depth, reach_at=tuple(self.controller.grid_upto(min(budgets))))

    def refine_tree(self, plan: RoundPlan, tree, drafted, regimes: Sequence[str]):
        """:meth:`refine` from the tree itself: its nodes' draft path and edge scores as the
        builder ranked them (:meth:`~sglang_tev.tree.DraftTree.node_scores`; from ``drafted`` by
        :func:`~sglang_tev.planner.node_edge_scores` when the builder attached none, in one host
        read), padded nodes left out, and the tree cut to the refined plan (a best-first tree's
        first w + 1 nodes are its budget-w tree). Returns (plan, tree)."""
        rows = tree.node_scores()
        if rows is None:
            from .planner import node_edge_scores, node_path_scores
            from .tree import host_node_scores

            edge = node_edge_scores(tree, drafted)
            rows = host_node_scores(node_path_scores(tree, edges=edge), edge, tree.depth, tree.parents, tree.valid)
        out = self.refine(plan, [r[0] for r in rows], regimes, [r[1:] for r in rows])
        return out, cut_rows(tree, out.budgets)

    def observe(self, plan: RoundPlan, reach_cum, seconds: float, reach_nodes=None) -> None:
        """As :meth:`AutoBudget.observe`, plus: ``reach_nodes`` (per row, the reach ``P(v)`` of
        the tree's nodes root first, as verified) label the refined round's scores for the
        calibration; the rate EMA moves by this round's expected tokens over its seconds."""
        batch = len(plan.budgets)
        if plan.ragged:
            # timed as the uniform width of the same token count (how :meth:`_refine_ragged` reads
            # the table); its gains from the sub-budgets every row verified in full
            self.controller.observe(batch, plan.timed_budget, None, seconds)
            if reach_cum and plan.reach_at:
                self.controller.learn_gains(min(plan.budgets), [list(r) for r in reach_cum])
        else:
            super().observe(plan, reach_cum, seconds)
        tokens = float(batch)
        if plan.ragged and reach_nodes is not None:  # expected tokens: one per row + every node's reach
            tokens += sum(sum(p[1:]) for p in reach_nodes)
        elif reach_cum:
            tokens += sum(r[-1] for r in reach_cum)
        ema = self._rate.get(batch)
        if ema is None:
            self._rate[batch] = [tokens, seconds]
        else:
            a = self.rate_alpha
            ema[0] += a * (tokens - ema[0])
            ema[1] += a * (seconds - ema[1])
        pending, self._pending = self._pending, None
        if pending is not None and reach_nodes is not None and pending[0] is plan:
            _, regimes, scores, edges, raw, refined = pending
            segs = self.controller.grid_upto(self.capacity)
            for r, (g, s, p, b) in enumerate(zip(regimes, scores, reach_nodes, plan.budgets)):
                m = min(len(s), max(0, len(p) - 1), b)  # a row's nodes past its own cut were not verified
                if not refined:
                    # what this row's values said per segment of pop order against what it held; only
                    # from rounds whose width the values did not choose (probes, trials, calibration):
                    # a refined round verifies a segment because its values there were high, and the
                    # ratio over such rows reads low (the winner's curse), which cut more rounds, whose
                    # survivors read lower still (greedy, CPU server, 2026-12-07: 0.3 at pop 3-4)
                    self.calibration.learn_segments(g, raw[r], p[1: m + 1], segs)
                self.calibration.update(g, s[:m], p[1: m + 1], None if edges is None else tuple(x[:m] for x in edges[r]))


def cut_tree(tree, n: int):
    """The first ``n`` nodes of a best-first ``DraftTree`` (its budget ``n - 1`` tree: a node's
    parent always comes before it); the tree itself when it has ``n`` nodes or fewer. Its
    ``parents`` / ``tokens`` / ``valid`` / ``depth`` are views of the input tree's (trees are not
    written in place; copy before doing so).

    Raises:
        ValueError naming ``n`` when it is below 1 (the root).
    """
    import torch

    from .tree import DraftTree

    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n must be an integer of at least 1 (the root), got {n!r}")
    n = int(n)
    if n >= tree.num_nodes:
        return tree
    # a prefix of a best-first tree keeps its nodes' depths and ancestors: slice them (no
    # pointer jumping again); max_depth is the prefix's own, from the node scores already on the
    # host when the planner read them (a device read otherwise: a host sync on CUDA)
    depth = tree.depth[:, :n]
    valid = tree.valid[:, :n]
    scores, host = tree.prefix_caches(n)
    if n == 1:
        max_depth = 0
    elif scores is not None:
        max_depth = max((max(r[2], default=0) for r in scores), default=0)
    else:
        max_depth = int(torch.where(valid, depth, torch.zeros_like(depth)).max().item())
    out = DraftTree(tree.parents[:, :n], tree.tokens[:, :n], valid, depth,
                    tree.ancestor_mask[:, :n, :n].contiguous(), max_depth)
    if scores is not None:
        out.with_node_scores(scores)
    if host is not None:
        out.with_host_lists(host)
    return out


def cut_rows(tree, budgets: Sequence[int]):
    """Each row's best-first tree cut to its own budget: row b keeps its first ``budgets[b] + 1``
    nodes, the rest become padded nodes (invalid, as a tree smaller than its budget pads); the
    tree is :func:`cut_tree` to the largest. ``budgets`` are host ints (a plan's).

    Raises:
        ValueError naming ``budgets`` (not one non-negative int per row).
    """
    from .tree import DraftTree

    b = tree.parents.shape[0]
    if len(budgets) != b or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0 for x in budgets):
        raise ValueError(f"budgets must be {b} non-negative ints (one per row), got {list(budgets)}")
    out = cut_tree(tree, max(budgets) + 1)
    if min(budgets) == max(budgets):
        return out
    import torch

    n = out.num_nodes
    keep = torch.arange(n, device=out.parents.device).view(1, n) <= torch.tensor(
        [int(x) for x in budgets], device=out.parents.device).view(b, 1)
    return DraftTree.from_parents(out.parents, out.tokens, out.valid & keep, validate=False)


@dataclass(frozen=True)
class _RefinablePlan(RoundPlan):
    """A :class:`RoundPlan` the policy may still cut after the draft (:meth:`TreePlanner.refine`)."""

    refinable: bool = False
