"""The budget policy a runtime asks before every round, and the plan it answers with (DESIGN §2).

A round reads one :class:`RoundPlan`: a budget per row (0 = a plain decoding step for that row),
the depth the drafter's block must reach, and the sub-budgets whose coverage the verifier should
report back. Whether the plan was fixed or chosen does not change the round's code: the round
never asks which policy made it.

Two policies:

* :class:`FixedBudget` -- every row, every round, the same budget B and the whole block
  (``--budget B``; what ``sglang-tev tune`` times).
* :class:`AutoBudget` -- ``budget="auto"``: the measured-cost controller of
  :mod:`sglang_tev.hf.autobudget` (its choice from past rounds only, so the output law is
  untouched); a budget-B round drafts a block of ``min(K, B + 1)`` tokens, since a tree of B
  nodes reaches depth B at most. Today every row of a batch gets the same budget; the plan's
  shape already holds one per row.

Torch-free: plans are host data, made before any device work of the round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from .spec import MAX_BUDGET, SpecError, check_budget

__all__ = ["RoundPlan", "BudgetPolicy", "FixedBudget", "AutoBudget"]


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
        controller: a :class:`sglang_tev.hf.autobudget.BudgetController` (its grid's largest
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
