"""``budget="auto"``: each round's tree size from the exit law of past rounds and measured costs
(issue 29).

What a round gains. For a best-first tree (DDTree, the lattice DDTree) the first ``B'`` nodes in
pop order ARE the budget-``B'`` tree, and the target reach probability ``P(v)`` of a node (paper
Eq. 2) does not depend on the rest of the tree. So one verified round of budget ``B`` gives, from
the target probabilities it already computed, the exact expected number of accepted draft tokens
of every smaller best-first budget of that round,

    E[accept | B'] = sum_{i = 1..B'} P(v_i)          (coverage C_p of the sub-tree, Eq. 6),

and a round emits ``1 + accept`` tokens (the bonus token on top). ``B' = 0`` is plain decoding:
one token per round and no draft at all.

What a round costs. The wall seconds of whole rounds (draft + build + tree forward + verify +
commit; on CUDA the round's one host sync makes the clock honest), kept per (batch size, budget)
as an exponential moving average, with a least-squares line in ``1 + B`` filling budgets not yet
timed at that batch size.

The choice. Per round and per batch (one tree size for all rows, so the forward keeps one shape):
``argmax_B (1 + E[accept | B]) / cost(b, B)`` over the budgets whose gain has been observed, with
a short calibration at the start (the largest budget once — it observes every smaller budget's
gain — then plain decoding and the middle of the grid once each) and exploration rounds every
``period`` rounds (the next larger budget than the current choice, every fourth time the largest),
the period doubling up to ``max_period`` while exploring does not change the choice.

Exactness: the choice reads only rounds that are already verified (their probabilities and their
clocks), never the current round's draws, so every round's tree is fixed before its verifier
draws; each exact verifier then samples the target law given the tree, and the output keeps
plain sampling's law (tested by the same chi-square as the fixed budgets). Greedy output is plain
greedy decoding's whatever the budgets. Seeded sampled runs repeat exactly when the choices repeat,
i.e. with a fixed cost table (:class:`CostTable` ``frozen``, e.g. from ``sglang-tev tune``).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["AUTO", "DEFAULT_GRID", "CostTable", "BudgetController", "parse_budget"]

AUTO = "auto"
DEFAULT_GRID = (0, 2, 4, 8, 16, 24, 32, 48, 64)
"""Budgets ``budget="auto"`` chooses from (0 = a plain decoding round). The largest is the
default ``max_budget``."""


def parse_budget(value, max_budget: int) -> int | str:
    """``"auto"`` or an int budget in [0, max_budget] (an int-like string is accepted: CLI input).
    Raises ``ValueError`` naming ``budget``."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"budget must be 'auto' or an int >= 0, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"budget must be 'auto' or an int >= 0, got {value!r}")
    if value > max_budget:
        raise ValueError(f"budget must be <= {max_budget}, got {value}")
    return value


@dataclass
class CostTable:
    """Seconds per round by (batch size, budget): the median of the last ``window`` measured
    rounds of each pair.

    Attributes:
        seconds: ``{batch: {budget: seconds}}``.
        counts: ``{batch: {budget: rounds measured}}``.
        frozen: when True :meth:`record` ignores new rounds (a table from ``sglang-tev tune``;
            repeated calls then choose the same budgets, so seeded runs repeat).
        window: measurements per pair the median is taken over.
    """

    seconds: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    frozen: bool = False
    window: int = 9
    _recent: dict = field(default_factory=dict, repr=False)

    def record(self, batch: int, budget: int, seconds: float) -> None:
        if self.frozen or not math.isfinite(seconds) or seconds <= 0:
            return
        recent = self._recent.setdefault((batch, budget), [])
        recent.append(seconds)
        del recent[:-self.window]
        cnt = self.counts.setdefault(batch, {})
        cnt[budget] = cnt.get(budget, 0) + 1
        # the median of the last few rounds: a round slowed by a neighbour, or a first round that
        # allocated its buffers, does not set the cost
        self.seconds.setdefault(batch, {})[budget] = statistics.median(recent)

    def measured(self, batch: int, budget: int) -> bool:
        return budget in self.seconds.get(batch, {})

    def cost(self, batch: int, budget: int) -> float | None:
        """Seconds of a round at (batch, budget): measured, else the least-squares line in
        ``1 + B`` through the measured budgets > 0 at this batch size (plain decoding, budget 0,
        is never extrapolated: it has no draft), else the same at the nearest batch size that has
        one (a batch that shrinks as rows finish needs no new calibration), else None."""
        for b in sorted(self.seconds, key=lambda x: (x != batch, abs(x - batch), x)):
            c = self._at(b, budget)
            if c is not None:
                return c
        return None

    def _at(self, batch: int, budget: int) -> float | None:
        row = self.seconds.get(batch, {})
        if budget in row:
            return row[budget]
        if budget == 0:
            return None
        pts = [(1 + b, s) for b, s in row.items() if b > 0]
        if len({x for x, _ in pts}) < 2:
            return None
        n = len(pts)
        mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sxx)
        est = my + slope * (1 + budget - mx)
        return est if est > 0 else None

    def to_json(self) -> dict:
        return {"seconds": {str(b): {str(k): v for k, v in r.items()} for b, r in self.seconds.items()},
                "counts": {str(b): {str(k): v for k, v in r.items()} for b, r in self.counts.items()}}

    @classmethod
    def from_json(cls, data: dict, frozen: bool = True) -> "CostTable":
        """A table written by :meth:`to_json` (``sglang-tev tune --output``). Raises ``ValueError``
        naming ``cost_table`` for a malformed one."""
        try:
            sec = {int(b): {int(k): float(v) for k, v in r.items()} for b, r in data["seconds"].items()}
            cnt = {int(b): {int(k): int(v) for k, v in r.items()} for b, r in data.get("counts", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"cost_table: not a cost table ({e!r})") from None
        if any(not (v > 0 and math.isfinite(v)) for r in sec.values() for v in r.values()):
            raise ValueError("cost_table: every entry must be a finite number of seconds > 0")
        return cls(sec, cnt, frozen=frozen)

    @classmethod
    def load(cls, path, frozen: bool = True) -> "CostTable":
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"cost_table: no file at {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cost_table: {p} is not JSON ({e})") from None
        return cls.from_json(data.get("cost_table", data), frozen=frozen)


class BudgetController:
    """The budget choice (see the module docstring). A generator keeps one per target law (greedy,
    or sampled at a temperature), so a later call starts from what earlier calls learned.

    Args:
        grid: candidate budgets, increasing, ``0`` (plain decoding) allowed; the largest is the
            calibration / exploration tree.
        costs: the :class:`CostTable` (shared by a generator's controllers; frozen tables are
            read only).
        period, max_period: rounds between explorations, doubled while exploring confirms the
            choice (reset when it changes it).
        alpha: the gains are running means of past rounds until ``1 / alpha`` of them, then EMAs
            with this weight (they follow a drifting acceptance).
        margin: a new budget replaces the current one only when its rate is higher by this
            fraction (no flapping between budgets of nearly equal rate).

    Attributes:
        history: ``(batch, budget)`` of every round, for reports and tests.
    """

    def __init__(self, grid: Sequence[int], costs: CostTable, period: int = 8, max_period: int = 128,
                 alpha: float = 0.05, margin: float = 0.03) -> None:
        g = sorted(set(int(x) for x in grid))
        if not g or g[0] < 0 or g[-1] < 1:
            raise ValueError(f"grid: budgets >= 0 with at least one > 0, got {list(grid)!r}")
        self.grid, self.costs = g, costs
        self.alpha, self.margin = alpha, margin
        self.gain: dict[int, float] = {}          # budget -> mean accepted draft tokens
        self._n: dict[int, int] = {}
        self.period, self.min_period, self.max_period = period, period, max_period
        self._since, self._explorations, self._pending_explore = 0, 0, None
        self._current: dict[int, int] = {}        # batch -> budget in use
        self.history: list[tuple[int, int]] = []

    @property
    def max_budget(self) -> int:
        return self.grid[-1]

    def expected_tokens(self, budget: int) -> float | None:
        """1 + E[accepted | budget] from past rounds (1 for plain decoding), None if unobserved."""
        if budget == 0:
            return 1.0
        g = self.gain.get(budget)
        return None if g is None else 1.0 + g

    def rate(self, batch: int, budget: int) -> float | None:
        """Expected tokens per second per row at (batch, budget), None while unknown."""
        e, c = self.expected_tokens(budget), self.costs.cost(batch, budget)
        return None if e is None or c is None else e / c

    def best(self, batch: int) -> int | None:
        """The budget of highest known rate, keeping the current one unless beaten by ``margin``."""
        known = {b: r for b in self.grid if (r := self.rate(batch, b)) is not None}
        if not known:
            return None
        top = max(known, key=lambda b: (known[b], -b))
        cur = self._current.get(batch)
        if cur in known and known[top] <= known[cur] * (1 + self.margin):
            return cur
        return top

    def choose(self, batch: int) -> int:
        """The budget of the next round at this batch size."""
        top = self.max_budget
        # calibration: the largest tree (observes every gain), plain decoding, the middle of the
        # grid (a second point of the cost line), each until timed
        if top not in self.gain or self.costs.cost(batch, top) is None:
            return self._log(batch, top)
        if 0 in self.grid and self.costs.cost(batch, 0) is None:
            return self._log(batch, 0)
        positive = [b for b in self.grid if b > 0]
        if any(self.costs.cost(batch, b) is None for b in positive):
            mid = positive[len(positive) // 2]
            return self._log(batch, mid if not self.costs.measured(batch, mid) else positive[0])
        best = self.best(batch)
        self._current[batch] = best
        self._since += 1
        if self._since >= self.period:  # exploration: refresh the gains above the choice
            self._since = 0
            self._explorations += 1
            bigger = [b for b in self.grid if b > best]
            if bigger:
                self._pending_explore = (batch, best)
                return self._log(batch, top if self._explorations % 4 == 0 else bigger[0])
        return self._log(batch, best)

    def _log(self, batch: int, budget: int) -> int:
        self.history.append((batch, budget))
        return budget

    def observe(self, batch: int, budget: int, reach_cum: Iterable[Sequence[float]] | None, seconds: float) -> None:
        """Feed back a verified round.

        Args:
            batch: rows of the round; budget: its budget.
            reach_cum: per row, ``sum P`` over the first ``B'`` non-root nodes for each grid budget
                ``0 < B' <= budget`` in increasing order (:meth:`grid_upto`); None for a plain round.
            seconds: the round's wall time.
        """
        self.costs.record(batch, budget, seconds)
        if reach_cum:
            rows = [list(r) for r in reach_cum]
            for j, b in enumerate(self.grid_upto(budget)):
                mean = sum(r[j] for r in rows) / len(rows)
                n = self._n.get(b, 0) + 1
                self._n[b] = n
                w = max(self.alpha, 1.0 / n)
                old = self.gain.get(b, 0.0)
                self.gain[b] = (1 - w) * old + w * mean
        if self._pending_explore is not None:
            (b0, before), self._pending_explore = self._pending_explore, None
            changed = self.best(b0) != before
            self.period = self.min_period if changed else min(2 * self.period, self.max_period)

    def grid_upto(self, budget: int) -> list[int]:
        """The grid budgets in (0, budget]: the sub-budgets a round of ``budget`` observes."""
        return [b for b in self.grid if 0 < b <= budget]
