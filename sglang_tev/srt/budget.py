"""Load-adaptive trees for the SGLang worker (``SGLANG_TEV_BUDGET=auto``): each round's tree width
for the whole batch from the core planner, with ``--speculative-num-draft-tokens`` as the capacity.

The same policy the transformers runtime's ``budget="auto"`` runs (:class:`sglang_tev.plan.TreePlanner`
over :class:`sglang_tev.autobudget.BudgetController`): before the draft, plain decoding or a tree
width from past rounds (calibration, probes, trials); in steady rounds the tree is built one grid step
larger and cut, after the draft, to the width whose calibrated node values pay for their measured
cost; every verified round's exit law labels the nodes' draft path scores with their reach ``P(v)``.
The plan depends only on this round's draft and past rounds, so each request's output law is
untouched (greedy = plain decoding; the engine tests check it).

Target laws: one controller per law of the batch — ``"greedy"`` (every request greedy) or
``"sampled"`` — as the transformers runtime keeps one per target law: a tree that pays under the
greedy law rarely pays under T = 1 (TEV N = 17 on the CPU server: accept length 2.9-3.0 against
2.2-2.4), and one controller serving both would carry the greedy gains into sampled traffic until
they wore off (measured: the CPU server ran trees at T = 1 after the T = 0 benchmark rows, 0.65x /
0.78x / 0.81x plain decoding at concurrency 1 / 4 / 16). The law is read from SGLang's host flag
``is_all_greedy`` (no device read). Each law also times its own rounds (its own cost table): a
sampled round computes the exit law over the tree's rows where a greedy one reads argmaxes, and on
the CPU server a tree round of TEV N = 17 cost 1.7-2.2 plain steps under the greedy law against
2.4-3.0 at T = 1 (concurrency 1, accept length x plain tok/s / tok/s per run of the serving
benchmark), so greedy rounds' costs would make sampled trees look cheap. The reach calibration is
shared (it is kept per temperature regime already).

Grid: the budgets a round may take, :func:`budget_grid` (the default grid up to the capacity);
with CUDA graphs, the captured tiers' (:mod:`sglang_tev.srt.graph_tiers`, :meth:`ServedBudget.use_grid`),
so every round's width replays a graph.

Layout: ``"padded"`` (``SGLANG_TEV_BUDGET=auto``), one width for every request of a round (the
forward keeps a [bs, w] shape); ``"ragged"`` (``auto-ragged``, where the attention backend takes
SGLang's ``RaggedVerifyLayout``: per-request verify lengths in one forward), each request's tree
then cut to its own budget within that width, every request's nodes ranked together by calibrated
value and the total chosen on the cost curve (:meth:`sglang_tev.plan.TreePlanner.refine`). KV reservation stays sized by the capacity N (SGLang
reserves 2N slots per request per step), so the context-edge and overlap rules hold for any width
<= N - 1.

Tensor parallelism: every rank must run the same width every round (their caches and collectives
would part otherwise), so rank 0 decides and the others adopt: rank 0's plan before the draft and
its refined plan after it go to every rank through SGLang's TP group (``broadcast_object`` on the
group's CPU side: no device sync), the followers cut their own trees (built from the same draft) to
it, and only rank 0's planner learns (its clock and its exit-law labels).

Cost: the round's wall seconds, from the round's start to its end; a tree round ends after its one
host read (the decision and the reach labels in one transfer, :meth:`VerifyOutput.host`; on CUDA a
device sync per round, not measured on a GPU yet, on CPU free), a plain step reads nothing. Plus SGLang's own work
per step outside the worker (result processing, streaming, the next batch's preparation): the
lower quartile of the recent gaps between a round's end and the next round's start (idle time and
prefills between rounds only lengthen a gap, and with short requests they are up to half of
them). Every step pays it
once whatever its width, so leaving it out favoured the cheaper rounds (plain steps, narrow trees)
over the ones that emit more tokens per step: on the CPU server a plain step's in-worker time was
~10 ms of a ~12 ms step.
"""

from __future__ import annotations

import numbers
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..autobudget import DEFAULT_GRID, BudgetController
from ..costs import CostTable
from ..plan import RoundPlan, TreePlanner, cut_rows
from ..hf.plan_cache import controller_gains, restore_gains
from ..planner import ReachCalibration, regime_of

if TYPE_CHECKING:
    from ..tree import DraftTree

__all__ = ["ServedBudget", "budget_grid", "LAWS"]

LAWS = ("greedy", "sampled")
"""The target laws :class:`ServedBudget` keeps a controller for (a batch with any sampled
request is ``"sampled"``)."""


def budget_grid(capacity: int) -> tuple[int, ...]:
    """The budgets a served round may take: the default grid up to ``capacity`` = N - 1, plus the
    capacity itself; 0 is a plain decoding step.

    Raises:
        ValueError naming ``capacity`` unless it is an integer of at least 1.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or int(capacity) < 1:
        raise ValueError(f"capacity must be an integer of at least 1 (a tree size N >= 2), got {capacity!r}")
    return tuple(sorted({g for g in DEFAULT_GRID if g <= capacity} | {int(capacity)}))


class ServedBudget:
    """One server's tree-width policy; under TP, one per rank with rank 0 deciding. One planner,
    controller and cost table per target law of the batch (:data:`LAWS`, chosen by
    :meth:`plan`'s ``all_greedy``), one reach calibration for all.

    Args:
        capacity: B_max = N - 1 (``--speculative-num-draft-tokens`` minus the root).
        block_size: K of the drafter.
        costs: the greedy law's :class:`~sglang_tev.costs.CostTable` (None: a fresh one
            that corrects for the machine's load, as the transformers runtime's); every other law
            gets an empty table with the same settings (``frozen``, ``window``,
            ``load_correction``).
        clock: seconds source (default ``time.perf_counter``).
        broadcast: TP > 1: ``broadcast(obj) -> rank 0's obj`` over the TP group (every rank calls
            it in the same order; rank 0 gets its own object back); None: TP 1.
        leader: whether this rank decides (TP rank 0); a follower (``broadcast`` required) runs
            no planner of its own.
        layout: ``"padded"`` (one width per round) or ``"ragged"`` (a width per request; the
            worker verifies them in one ragged forward); the attribute may be set until the first
            :meth:`plan` (the worker learns its backend only then).
    Raises:
        ValueError when a follower has no ``broadcast``, naming ``capacity`` (not an integer
        >= 1), ``block_size`` (not an integer >= 2) or ``layout``.
    """

    def __init__(self, capacity: int, block_size: int, costs: CostTable | None = None, clock=time.perf_counter,
                 broadcast: Callable[[Any], Any] | None = None, leader: bool = True, layout: str = "padded") -> None:
        if layout not in ("padded", "ragged"):
            raise ValueError(f"layout must be 'padded' or 'ragged', got {layout!r}")
        if not leader and broadcast is None:
            raise ValueError("broadcast is required on a follower rank (leader=False): it adopts rank 0's plans")
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 2:
            raise ValueError(f"block_size must be the drafter's K, an integer of at least 2, got {block_size!r}")
        self.grid = budget_grid(capacity)
        self.clock = clock
        self.broadcast = broadcast
        self.leader = bool(leader)
        self.block_size = block_size
        base = costs if costs is not None else CostTable()
        self.cost_tables: dict[str, CostTable] = {LAWS[0]: base}  # law -> the seconds of its rounds
        self.calibration = ReachCalibration()
        self.planners: dict[str, TreePlanner] = {}  # law -> its planner over its own controller
        self._saved_gains: dict[str, dict] = {}  # law -> gains restored from a plan cache (srt/plan_store.py)
        self.law = LAWS[0]  # the law of the round in flight (of the last one between rounds)
        self.capacity = int(capacity)
        self.layout = layout
        self._t0: float | None = None
        self._t_end: float | None = None  # when the last round closed
        self._gaps: list[float] = []      # the last 64 gaps from a round's end to the next one's start
        self.overhead = 0.0               # their lower quartile: SGLang's work per step outside the round
        self.rounds = 0

    @property
    def planner(self) -> TreePlanner:
        """The planner of the current (or last) round's law (rank 0 only: a follower runs none).

        Raises:
            RuntimeError on a follower rank.
        """
        if not self.leader:
            raise RuntimeError("a follower rank (leader=False) runs no planner: it adopts rank 0's plans")
        p = self.planners.get(self.law)
        if p is not None and p.layout != self.layout:
            raise RuntimeError(f"layout changed to {self.layout!r} after the first round (planned {p.layout!r})")
        if p is None:
            base = self.cost_tables[LAWS[0]]
            table = self.cost_tables.setdefault(
                self.law, CostTable(frozen=base.frozen, window=base.window, load_correction=base.load_correction))
            ctl = BudgetController(self.grid, table)
            if self.law in self._saved_gains:
                restore_gains(ctl, self._saved_gains[self.law])
            p = self.planners[self.law] = TreePlanner(ctl, self.block_size, calibration=self.calibration, layout=self.layout)
        return p

    def restore(self, law: str, cost_table: CostTable, gains: dict | None, calibration: ReachCalibration) -> None:
        """Start ``law`` from what an earlier server learned (:mod:`sglang_tev.srt.plan_store`):
        its cost table, its controller's gains (``controller_gains``' dict, or None) and the
        shared reach calibration. Only before that law's first round.

        Raises:
            ValueError naming ``law`` (not one of :data:`LAWS`); RuntimeError once its planner runs.
        """
        if law not in LAWS:
            raise ValueError(f"law must be one of {LAWS}, got {law!r}")
        if law in self.planners:
            raise RuntimeError(f"law {law!r} already planned a round: restore before the first one")
        self.cost_tables[law] = cost_table
        if gains is not None:
            self._saved_gains[law] = gains
        self.calibration = calibration
        for p in self.planners.values():  # one calibration for every law
            p.calibration = calibration

    def gains(self, law: str) -> dict | None:
        """``law``'s controller gains as a plan cache keeps them (the restored ones while it has not
        planned yet; None when it has neither)."""
        p = self.planners.get(law)
        return controller_gains(p.controller) if p is not None else self._saved_gains.get(law)

    @property
    def controller(self) -> BudgetController:
        """The controller of the current (or last) round's law."""
        return self.planner.controller

    @property
    def costs(self) -> CostTable:
        """The cost table of the current (or last) round's law."""
        return self.planner.controller.costs

    def use_grid(self, budgets: Sequence[int]) -> None:
        """Restrict the budgets rounds may take to ``budgets`` (the captured graph tiers',
        :mod:`sglang_tev.srt.graph_tiers`), before the first round.

        Raises:
            ValueError naming ``budgets`` unless they are integers in [0, capacity] holding 0 and
            the capacity; RuntimeError after a round was planned (the planners hold the grid).
        """
        grid = tuple(sorted({int(b) for b in budgets}))
        if not grid or grid[0] != 0 or grid[-1] != self.capacity or any(not 0 <= b <= self.capacity for b in grid):
            raise ValueError(f"budgets must lie in [0, {self.capacity}] and hold 0 and {self.capacity}, got {list(budgets)}")
        if self.planners:
            raise RuntimeError("use_grid() must come before the first round (the planners hold the grid)")
        self.grid = grid

    def _adopt(self, plan: RoundPlan | None) -> RoundPlan:
        return plan if self.broadcast is None else self.broadcast(plan)

    def plan(self, bs: int, all_greedy: bool = True) -> RoundPlan:
        """The round's plan before the draft (one budget for the batch; 0 = plain decoding),
        rank 0's under TP, from the controller of the batch's law (``all_greedy``: SGLang's
        ``sampling_info.is_all_greedy``). Starts the round's clock; the round's law holds until
        its :meth:`observe`.

        Raises:
            ValueError naming ``bs`` (below 1) or ``all_greedy`` (not a bool).
        """
        if isinstance(bs, bool) or not isinstance(bs, numbers.Integral) or bs < 1:
            raise ValueError(f"bs must be the round's number of requests (>= 1), got {bs!r}")
        if not isinstance(all_greedy, bool):
            raise ValueError(f"all_greedy must be a bool (SGLang's is_all_greedy), got {all_greedy!r}")
        self._t0 = self.clock()
        if self._t_end is not None:
            self._gaps.append(max(0.0, self._t0 - self._t_end))
            del self._gaps[:-64]
            self._t_end = None
            # the lower quartile: idle time and prefills between rounds only ever lengthen a gap,
            # and with short requests they can be half of them (a median would read idle time)
            self.overhead = sorted(self._gaps)[len(self._gaps) // 4]
        self.law = LAWS[0] if all_greedy else LAWS[1]
        plan = self._adopt(self.planner.plan(bs) if self.leader else None)
        if len(plan.budgets) != bs:
            raise RuntimeError(f"TEV: rank 0 planned {len(plan.budgets)} requests, this rank runs {bs}")
        return plan

    def refine(self, plan: RoundPlan, tree: DraftTree, drafted, temperatures: Sequence[float]) -> tuple[RoundPlan, DraftTree]:
        """Cut a steady round's tree to the widths the planner picks from its node values, one per
        request under the ragged layout (rank 0's under TP; a follower cuts its own tree to them).

        Args:
            plan: this round's :meth:`plan`.
            tree: the tree built at ``plan.budget`` (best-first: its first w + 1 nodes are the
                budget-w tree).
            drafted: what it was built from (top-k ``(logq, ids)`` or a lattice with
                ``candidate_ids`` / ``transition_logq``; :func:`~sglang_tev.planner.node_path_scores`).
            temperatures: per request, its temperature (0 = greedy).
        Returns:
            (the plan the round runs, the tree cut to it).
        Raises:
            RuntimeError when no round is open (no :meth:`plan` since the last :meth:`observe`).
        """
        if self._t0 is None:
            raise RuntimeError("refine() needs an open round: call plan() first")
        if self.leader:
            plan, tree = self.planner.refine_tree(plan, tree, drafted, [regime_of(t) for t in temperatures])
            self._adopt(plan)
            return plan, tree
        plan = self._adopt(None)
        return plan, cut_rows(tree, plan.budgets)

    def observe(self, plan: RoundPlan, reach_cum, reach_nodes) -> float:
        """Close the round: its seconds since :meth:`plan` plus :attr:`overhead` (SGLang's work
        per step around the round) and its exit-law labels go to the planner of the law
        :meth:`plan` read (rank 0's only). Returns the seconds charged.

        Raises:
            RuntimeError when no round is open (no :meth:`plan`, or this round already observed).
        """
        if self._t0 is None:
            raise RuntimeError("observe() needs an open round: call plan() first, once per round")
        now = self.clock()
        seconds = now - self._t0 + self.overhead
        self._t0 = None
        self._t_end = now
        if self.leader:
            self.planner.observe(plan, reach_cum, seconds, reach_nodes=reach_nodes)
        self.rounds += 1
        return seconds
