"""``budget="auto"``: each round's tree size from the exit law of past rounds and measured costs.

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
as the median of recent rounds, divided by the load of the minute they ran in (a shared machine
runs the same round up to 2x slower in a busy minute), and read through a fit that is
non-decreasing and convex in the budget (:class:`CostTable`).

The choice. Per round and per batch (one tree size for all rows, so the forward keeps one shape):
``argmax_B (1 + E[accept | B]) / cost(b, B)`` over the budgets whose gain has been observed, with
a short calibration at the start (the largest budget once — it observes every smaller budget's
gain — then plain decoding and the middle of the grid once each) and probes paid from an
exploration allowance (``explore_share`` of the decoding time): gain probes (a larger budget
than the best tree) and cost probes (the other regime: plain decoding while trees win, the trees
while plain decoding wins) in turn; a probe nearly as good as the choice is nearly free and runs
often, one far worse runs rarely (while plain decoding wins, a tree whose probe would lose more
than ``stale_loss`` times the best tree's is not probed at all: it would hold up the others); an
across probe also pays the measured price of the two switches it causes. A gain step seen again
after many rounds moves by more than one observation's weight (acceptance drifts within a
request). A switch between plain decoding and the trees is a trial: the
other regime's costs come from single probe rounds, each timed in its own minute, so the switch
runs a few rounds first and is kept only if their tokens per second beat the regime before it
by the regime margin, both timed in the same minute; a failed trial waits 32 rounds, doubling
with each failure in a row, before the next (:class:`BudgetController`).

Exactness: the choice reads only rounds that are already verified (their probabilities and their
clocks), never the current round's draws, so every round's tree is fixed before its verifier
draws; each exact verifier then samples the target law given the tree, and the output keeps
plain sampling's law (tested by the same chi-square as the fixed budgets). Greedy output is plain
greedy decoding's whatever the budgets. Seeded sampled runs repeat exactly when the choices repeat,
i.e. with a fixed cost table (:class:`CostTable` ``frozen``, e.g. from ``sglang-tev tune``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .costs import CostTable  # the cost table lives in its own module; it is part of this one's API
from .spec import AUTO, MAX_BUDGET  # the largest budget anywhere, cost tables included

__all__ = ["AUTO", "DEFAULT_GRID", "MAX_BUDGET", "CostTable", "BudgetController", "BatchSizeState", "Trial"]

DEFAULT_GRID = (0, 2, 4, 8, 16, 24, 32, 48, 64)
"""Budgets ``budget="auto"`` chooses from (0 = a plain decoding round). The largest is the
default ``max_budget``."""


SWITCH_CAP = 2.0
"""A switch's price (:attr:`BudgetController.switch`) counts at most this many times the round it
precedes. Within that bound it is what was measured; the bound keeps one stall on a switch round
(or a price carried in from another process's plan cache) from making every across probe
unaffordable, after which the price would never be measured again."""


@dataclass
class Trial:
    """A switch between plain decoding and the trees on trial (:meth:`BudgetController.end_trial`).

    Attributes:
        source: the budget in use before the switch; ``target``: the budget on trial.
        rounds: rounds of ``target`` observed since the trial began.
        seconds, tokens: raw seconds and expected tokens (1 + the mean row's coverage) of those
            rounds, the first left out (it pays for the switch).
    """

    source: int
    target: int
    rounds: int = 0
    seconds: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)

    def record(self, seconds: float, rows: list[list[float]] | None) -> None:
        """Count one verified round of ``target``; from the second on, keep its time and tokens."""
        self.rounds += 1
        if self.rounds > 1:
            self.seconds.append(seconds)
            self.tokens.append(1.0 + (statistics.fmean(r[-1] for r in rows) if rows else 0.0))


@dataclass
class BatchSizeState:
    """What :class:`BudgetController` keeps per batch size (the gains are shared by all sizes,
    the costs live in the :class:`CostTable`).

    Attributes:
        calibrated: past calibration (costs and gains, once known, stay known).
        current: the budget in use; ``cost_now``: its cost when last read (the allowance grows
            by it). None before the first read.
        age: rounds since the choice was read (None before the first read; 0 right after a read,
            a trial's start or end: only such a round may start a probe).
        trial: the regime switch on trial; ``repeat``: an across probe's second round, due next.
        last: the budget of the last observed round.
        cooldown: no trial before this round (of :attr:`BudgetController.rounds`); ``failures``:
            trials failed in a row.
    """

    calibrated: bool = False
    current: int | None = None
    cost_now: float | None = None
    age: int | None = None
    trial: Trial | None = None
    repeat: int | None = None
    last: int | None = None
    cooldown: int = 0
    failures: int = 0


class BudgetController:
    """The budget choice (see the module docstring). A generator keeps one per target law (greedy,
    or sampled at a temperature), so a later call starts from what earlier calls learned.

    Args:
        grid: candidate budgets, increasing, ``0`` (plain decoding) allowed; the largest is the
            calibration / exploration tree.
        costs: the :class:`CostTable` (shared by a generator's controllers; frozen tables are
            read only).
        explore_share: the share of decoding time probes may lose: each round adds this share of
            its expected seconds to an allowance, and a probe runs when the allowance covers what
            it is expected to lose against the choice (its seconds times one minus its rate over
            the choice's). Probes of budgets nearly as good as the choice are nearly free and run
            often (every ``min_gap`` rounds at most); probes of far worse ones rarely.
        min_gap: rounds between two probes at least; the choice is re-read (every budget's rate)
            every ``min_gap`` rounds, and a probe can start only in a round that re-read it.
        alpha: the gains are running means of past rounds until ``1 / alpha`` of them, then EMAs
            with this weight (they follow a drifting acceptance).
        margin: a new budget replaces the current one only when its rate is higher by this
            fraction (no flapping between budgets of nearly equal rate).
        regime_margin: the same between plain decoding and a tree: switching costs a round or two
            (the first tree round after plain ones writes their drafter context; the first plain
            one after a tree moves the kept mask back), on this CPU 1-5 ms.
        trial_rounds: rounds a switch between plain decoding and the trees runs on trial (see the
            module docstring; the first is left out of the comparison). Not with a frozen table:
            its choices stay a function of the table (seeded runs repeat).
        stale_loss: while plain decoding wins, the across probes re-time only trees whose probe
            loses at most this many times the best tree's (:meth:`probe_kinds`).
        stale_weight: the most one round's coverage moves a gain step last observed many rounds
            ago (:meth:`learn_gains`); None: ``max(0.5, alpha)``.

    Attributes:
        gain: ``{budget: mean accepted draft tokens}`` (shared by every batch size).
        batches: ``{batch size: BatchSizeState}`` (:meth:`state`).
        allowance: seconds (table scale) probes may still lose.
        rounds: choices made after calibration (trial cool-downs count in them).
        history: ``(batch, budget)`` of every round, for reports and tests.
        trials: ``(batch, from, to, kept)`` of the last 1,000 regime trials.
        switch: ``{(batch, into trees): seconds}``, what the first round after a switch between
            plain decoding and the trees costs beyond its budget's round (an EMA of weight
            ``switch_alpha``, 0.25), in the table's scale; the across probes pay it.
    """

    def __init__(self, grid: Sequence[int], costs: CostTable, explore_share: float = 0.005, min_gap: int = 6,
                 alpha: float = 0.05, margin: float = 0.03, regime_margin: float = 0.10, trial_rounds: int = 5,
                 stale_loss: float = 4.0, stale_weight: float | None = None) -> None:
        g = sorted(set(int(x) for x in grid))
        if not g or g[0] < 0 or g[-1] < 1:
            raise ValueError(f"grid: budgets >= 0 with at least one > 0, got {list(grid)!r}")
        if not 0 <= explore_share < 1:
            raise ValueError(f"explore_share must be in [0, 1), got {explore_share!r}")
        if min_gap < 1:
            raise ValueError(f"min_gap must be >= 1, got {min_gap!r}")
        if trial_rounds < 2:
            raise ValueError(f"trial_rounds must be >= 2, got {trial_rounds!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if not stale_loss >= 1:
            raise ValueError(f"stale_loss must be >= 1, got {stale_loss!r}")
        if stale_weight is None:
            stale_weight = max(0.5, alpha)
        if not alpha <= stale_weight <= 1:
            raise ValueError(f"stale_weight must be in [alpha={alpha}, 1], got {stale_weight!r}")
        self.grid, self.costs = g, costs
        self.alpha, self.margin, self.regime_margin = alpha, margin, regime_margin
        self.explore_share, self.min_gap, self.trial_rounds = explore_share, int(min_gap), int(trial_rounds)
        self.stale_loss, self.stale_weight = float(stale_loss), float(stale_weight)
        self.switch_alpha = 0.25
        self.gain: dict[int, float] = {}
        self._n: dict[int, int] = {}              # budget -> rounds that observed it
        self._inc: dict[int, float] = {}          # budget -> its gain over the next smaller grid budget
        self._seen: dict[int, int] = {}           # budget -> the gain clock when last observed
        self.switch: dict[tuple[int, bool], float] = {}
        self._clock = 0                           # rounds observed (all batch sizes)
        self.allowance = 0.0
        self._since = 0                           # re-reading rounds since the last probe (all sizes)
        self._explorations = 0                    # probes so far: their kind turns with it
        self.rounds = 0
        self.batches: dict[int, BatchSizeState] = {}
        self.trials: list[tuple[int, int, int, bool]] = []
        self.history: list[tuple[int, int]] = []

    @property
    def max_budget(self) -> int:
        return self.grid[-1]

    def state(self, batch: int) -> BatchSizeState:
        """This batch size's state (a fresh one on first use)."""
        st = self.batches.get(batch)
        if st is None:
            st = self.batches[batch] = BatchSizeState()
        return st

    # ------------------------------------------------------------------ value estimates
    def expected_tokens(self, budget: int) -> float | None:
        """1 + E[accepted | budget] from past rounds (1 for plain decoding), None if unobserved."""
        if budget == 0:
            return 1.0
        g = self.gain.get(budget)
        return None if g is None else 1.0 + g

    def rate(self, batch: int, budget: int) -> float | None:
        """Expected tokens per second per row at (batch, budget), None while unknown (and, with
        a frozen table, for a budget the table does not hold at any batch size: its cost would
        only be the fit's guess, never timed)."""
        if self.costs.frozen and not any(budget in row for row in self.costs.seconds.values()):
            return None
        e, c = self.expected_tokens(budget), self.costs.cost(batch, budget)
        return None if e is None or c is None else e / c

    def _rates(self, batch: int, budgets) -> dict[int, float]:
        """``{budget: rate}`` of the budgets whose rate is known (ties go to the smaller budget
        in both argmaxes over it)."""
        return {b: r for b in budgets if (r := self.rate(batch, b)) is not None}

    def best(self, batch: int, regime: int | None = None) -> int | None:
        """The budget of highest known rate, keeping the current one unless beaten by ``margin``
        (``regime_margin`` between plain decoding and a tree); with ``regime`` only the budgets
        of that one's regime (plain decoding, or the trees)."""
        budgets = self.grid if regime is None else [b for b in self.grid if (b == 0) == (regime == 0)]
        known = self._rates(batch, budgets)
        if not known:
            return None
        top = max(known, key=lambda b: (known[b], -b))
        cur = self.state(batch).current
        if cur in known:
            margin = self.regime_margin if (cur == 0) != (top == 0) else self.margin
            if known[top] <= known[cur] * (1 + margin):
                return cur
        return top

    def best_tree(self, batch: int) -> int:
        """The tree budget (> 0) of highest known rate (the largest budget while none is known)."""
        known = self._rates(batch, [b for b in self.grid if b > 0])
        return max(known, key=lambda b: (known[b], -b)) if known else self.max_budget

    # ------------------------------------------------------------------ the choice
    def choose(self, batch: int) -> int:
        """The budget of the next round at this batch size (0: a plain decoding round).

        In order: calibration (:meth:`calibration_budget`); a round already committed to
        (:meth:`scheduled_budget`); every ``min_gap`` rounds a re-read choice (:meth:`reread`,
        which may start a trial); then the choice, or, in a round that re-read it, a probe
        paid from the allowance (:meth:`take_probe`; the allowance grows by ``explore_share``
        of the choice's cost a round: costs drift with the load, so they must be re-timed)."""
        st = self.state(batch)
        if not st.calibrated:
            b = self.calibration_budget(batch)
            if b is not None:
                return self._log(batch, b)
            st.calibrated = True
        self.rounds += 1
        b = self.scheduled_budget(batch, st)
        if b is not None:
            return self._log(batch, b)
        self._since += 1
        if st.age is None or st.age >= self.min_gap:
            # re-read every min_gap rounds: gains and costs move slowly, and reading every
            # budget's rate costs ~1 % of a small model's plain round
            b = self.reread(batch, st)
            if b is not None:
                return self._log(batch, b)
        age, st.age = st.age, st.age + 1
        self.allowance += self.explore_share * st.cost_now
        if self._since < self.min_gap or age:
            return self._log(batch, st.current)
        probe = self.take_probe(batch, st)
        return self._log(batch, st.current if probe is None else probe)

    def calibration_budget(self, batch: int) -> int | None:
        """The next calibration round's budget, None once calibrated: the largest tree until its
        gain and cost are known (it observes every smaller budget's gain), plain decoding until
        timed, then the middle of the grid (a second point of the cost fit; the smallest tree
        once the middle is timed) while some tree has no cost. A frozen table never times a
        round: it calibrates over the budgets it holds (the largest with a cost) only."""
        costed = [b for b in self.grid if b > 0 and self.costs.cost(batch, b) is not None]
        top = max(costed) if self.costs.frozen and costed else self.max_budget
        if top not in self.gain or self.costs.cost(batch, top) is None:
            return top
        if 0 in self.grid and self.costs.cost(batch, 0) is None and not self.costs.frozen:
            return 0
        positive = [b for b in self.grid if b > 0]
        if any(self.costs.cost(batch, b) is None for b in positive) and not self.costs.frozen:
            mid = positive[len(positive) // 2]
            return mid if not self.costs.measured(batch, mid) else positive[0]
        return None

    def scheduled_budget(self, batch: int, st: BatchSizeState) -> int | None:
        """A round already committed to: an across probe's second round (the one its cost is read
        from), else a running trial's next round; a trial whose ``trial_rounds`` are done is
        ended here (:meth:`end_trial`). None when nothing is due."""
        if st.repeat is not None:
            b, st.repeat = st.repeat, None
            return b
        if st.trial is not None:
            if st.trial.rounds < self.trial_rounds:
                return st.trial.target
            self.end_trial(batch, st)
        return None

    def reread(self, batch: int, st: BatchSizeState) -> int | None:
        """Re-read the choice (:meth:`best`) into ``st.current`` / ``st.cost_now`` (age 0). A
        switch between plain decoding and the trees is not taken at once: during a cool-down
        (:meth:`back_off_rounds`) the best of the current regime stays; otherwise, once the regime
        in use has recent raw times (:meth:`regime_before`), the switch starts on trial and its
        budget is returned (the other regime's costs come from rare probes, each in its own
        minute: try it for a few rounds, then compare both in the same minute). None otherwise."""
        cur, top = st.current, self.best(batch)
        if cur is not None and top is not None and (cur == 0) != (top == 0):
            if self.rounds < st.cooldown:  # a trial failed lately: stay
                top = self.best(batch, regime=cur)
            elif self.regime_before(batch, cur) is not None:
                st.trial = Trial(cur, top)
                st.age = 0
                return top
        st.current = top
        st.cost_now = self.costs.cost(batch, top)
        st.age = 0
        return None

    # ------------------------------------------------------------------ probes
    def probe_kinds(self, batch: int, best: int) -> tuple[int | None, int | None, int | None]:
        """The candidate probes ``(up, across, down)`` around the choice ``best`` (None: none of
        that kind).

        * up (gains): the next larger budget than the best tree; it observes the gains of every
          budget up to it (larger ones follow through their increments);
        * across (the other regime): plain decoding while a tree wins; while plain decoding wins,
          the tree budgets timed so far in turn, the one timed longest ago first (a cost timed in
          a busy minute is re-read), among those whose probe would lose at most
          ``stale_loss`` times the best tree's (:meth:`best_tree`; at least a two-round probe
          ``regime_margin`` slower than plain decoding): a far worse tree, e.g. the capacity
          timed once at calibration, would wait for the allowance for hundreds of rounds and
          block every other probe meanwhile, while the gains the trees' rounds re-observe went
          stale (measured on the shipped pair: 512 rounds plain, 12 % below the trees); an up
          probe over that loss is left out too;
        * down (costs): a tree whose cost is provisional (:meth:`CostTable.provisional`: restored
          from a plan cache, or timed only cold) while one's probe would lose at most
          ``stale_loss`` times ``2 * regime_margin`` of the choice's round, the cheapest such
          probe first (a cold or foreign cost never re-timed holds the fit, and with it every
          budget's cost, where it was; the up probe re-times its own); else the next smaller tree than the choice (its gain is
          known from every round of the choice; its cost is only estimated until timed)."""
        tree = best if best > 0 else self.best_tree(batch)
        bigger = [b for b in self.grid if b > tree]
        smaller = [b for b in self.grid if 0 < b < best]
        up = bigger[0] if bigger else None
        if best > 0:
            across = 0 if 0 in self.grid else None
        else:
            timed = [b for b in self.grid if b > 0 and self.costs.measured(batch, b)] or [tree]
            if self.rate(batch, 0) is not None and self.rate(batch, tree) is not None:
                cap = self.stale_loss * max(self.probe_loss(batch, tree, 0),
                                            2 * self.regime_margin * self.costs.cost(batch, 0))
                cheap = lambda b: b == tree or (self.rate(batch, b) is not None  # noqa: E731
                                                and self.probe_loss(batch, b, 0) <= cap)
                timed = [b for b in timed if cheap(b)] or [tree]
                up = up if up is None or cheap(up) else None
            across = min(timed, key=lambda b: self.costs.last.get((batch, b), -1))
        down = smaller[-1] if smaller else None
        if best > 0 and self.rate(batch, best) is not None:
            cap = self.stale_loss * 2 * self.regime_margin * self.costs.cost(batch, best)
            cold = [(loss, b) for b in self.grid if b > 0 and b not in (best, up) and self.costs.provisional(batch, b)
                    and self.rate(batch, b) is not None and (loss := self.probe_loss(batch, b, best)) <= cap]
            if cold:
                down = min(cold)[1]
        return up, across, down

    def next_probe(self, batch: int, best: int) -> int | None:
        """The probe the next exploration would run: of :meth:`probe_kinds`, the kind whose turn
        it is (up, across, down by the count of probes so far), the next kind when one has none
        (or only ``best``); None when none has."""
        kinds = self.probe_kinds(batch, best)
        k = self._explorations % 3
        return next((p for p in kinds[k:] + kinds[:k] if p is not None and p != best), None)

    def probe_loss(self, batch: int, probe: int, best: int) -> float:
        """The seconds (table scale) a probe is expected to lose against ``best``: its cost times
        one minus its rate over best's (0 for a faster probe); for an across probe twice that (it
        runs two rounds) plus both switches' price as measured (:attr:`switch`: into the probe's
        regime and back, each at most :data:`SWITCH_CAP` times the round it precedes: a stall on a
        switch round, or a price from another process's plan cache, must not stop the probes that
        would measure it again). Both rates must be known."""
        loss = self.costs.cost(batch, probe) * max(0.0, 1.0 - self.rate(batch, probe) / self.rate(batch, best))
        if (probe == 0) != (best == 0):
            loss = 2 * loss + self.switch_price(batch, probe) + self.switch_price(batch, best)
        return loss

    def switch_price(self, batch: int, into: int) -> float:
        """What the first round of budget ``into`` after a switch of regime costs beyond that
        round (:attr:`switch`), at most :data:`SWITCH_CAP` times its cost; 0 while unmeasured."""
        price = self.switch.get((batch, into > 0), 0.0)
        c = self.costs.cost(batch, into)
        return min(price, SWITCH_CAP * c) if c is not None else 0.0

    def take_probe(self, batch: int, st: BatchSizeState) -> int | None:
        """The probe this round runs, paid from the allowance (:meth:`next_probe`,
        :meth:`probe_loss`); an across probe's second round is scheduled (``st.repeat``: its
        first round pays for the switch, see :meth:`observe`). None (nothing charged) when there
        is nothing to probe, its rate is unknown (a frozen table without its cost) or the
        allowance does not cover its loss."""
        best = st.current
        probe = self.next_probe(batch, best)
        if probe is None or self.rate(batch, probe) is None:
            return None
        loss = self.probe_loss(batch, probe, best)
        if loss > self.allowance:
            return None
        self.allowance -= loss
        self._since = 0
        self._explorations += 1
        if (probe == 0) != (best == 0):
            st.repeat = probe
        return probe

    # ------------------------------------------------------------------ trials
    def regime_before(self, batch: int, budget: int) -> float | None:
        """The median raw seconds of the last rounds of (batch, budget) (the regime in use, just
        before a trial), None while fewer than 4 (or the table is frozen: no trial then)."""
        raw = self.costs.raw(batch, budget)
        return statistics.median(raw[-8:]) if len(raw) >= 4 and not self.costs.frozen else None

    def trial_won(self, batch: int, trial: Trial) -> bool:
        """Whether the trial's tokens per second (mean tokens over the median of its raw seconds)
        beat the regime before it (:meth:`regime_before`) by ``regime_margin``, both raw times of
        the same minute (by the regime margin, as the table had to: a few rounds of a noisy minute
        decide it). Won when either side has nothing to compare."""
        before = self.regime_before(batch, trial.source)
        if not trial.seconds or before is None or self.expected_tokens(trial.source) is None:
            return True
        rate_to = statistics.fmean(trial.tokens) / statistics.median(trial.seconds)
        return rate_to > self.expected_tokens(trial.source) / before * (1 + self.regime_margin)

    @staticmethod
    def back_off_rounds(failures: int) -> int:
        """Rounds to wait after the ``failures``-th failed trial in a row: 32, doubling with each
        failure, five doublings at most (1,024)."""
        return 32 << min(5, failures - 1)

    def end_trial(self, batch: int, st: BatchSizeState) -> None:
        """Keep the trial's budget when it won (:meth:`trial_won`), else go back and wait before
        the next trial (:meth:`back_off_rounds`); the choice counts as just read (age 0)."""
        t, st.trial = st.trial, None
        won = self.trial_won(batch, t)
        self.trials.append((batch, t.source, t.target, won))
        del self.trials[:-1000]
        st.failures = 0 if won else st.failures + 1
        if not won:
            st.cooldown = self.rounds + self.back_off_rounds(st.failures)
        keep = t.target if won else t.source
        st.current = keep
        st.cost_now = self.costs.cost(batch, keep)
        st.age = 0

    def _log(self, batch: int, budget: int) -> int:
        self.history.append((batch, budget))
        return budget

    # ------------------------------------------------------------------ feedback
    def observe(self, batch: int, budget: int, reach_cum: Iterable[Sequence[float]] | None, seconds: float) -> None:
        """Feed back a verified round.

        Args:
            batch: rows of the round; budget: its budget.
            reach_cum: per row, ``sum P`` over the first ``B'`` non-root nodes for each grid budget
                ``0 < B' <= budget`` in increasing order (:meth:`grid_upto`); None for a plain round.
            seconds: the round's wall time.
        """
        st = self.state(batch)
        self._clock += 1
        last, st.last = st.last, budget
        # the first round after a switch between plain decoding and the trees also pays for the
        # switch (the kept drafter context written, the mask buffers moved): up to a fifth of a
        # batch-8 plain round here, which would bias every single-round probe against the other
        # regime; it is not timed into the table (across probes run two rounds for this)
        if last is None or (last == 0) == (budget == 0):
            self.costs.record(batch, budget, seconds)
        elif not self.costs.frozen and math.isfinite(seconds) and (c := self.costs.cost(batch, budget)) is not None:
            # ... what it pays beyond the round is the switch's price, charged to the probes that
            # switch (:meth:`probe_loss`): after a long plain stretch the drafter catches up on
            # every token since its last round
            excess = min(max(0.0, seconds / self.costs.current_load() - c), SWITCH_CAP * c)
            key = (batch, budget > 0)
            prev = self.switch.get(key)
            self.switch[key] = excess if prev is None else prev + self.switch_alpha * (excess - prev)
        rows = [list(r) for r in reach_cum] if reach_cum else None
        if st.trial is not None and budget == st.trial.target:
            st.trial.record(seconds, rows)
        if rows:
            self.learn_gains(budget, rows)

    def learn_gains(self, budget: int, rows: list[list[float]]) -> None:
        """Fold one round's per-row coverages (``rows[r][j]``: at ``grid_upto(budget)[j]``) into
        the gains. Per grid step, what the budget adds over the next smaller one (clipped at 0)
        is a running mean, an EMA of weight ``alpha`` after ``1 / alpha`` rounds; a budget's gain
        is the sum of the steps up to it, so a larger budget, observed less often (probes), moves
        with the smaller budgets' fresh gains instead of keeping a stale level, and never falls
        below them. Gains stop at the first step never observed.

        The EMA runs over rounds, not observations: a step last observed ``g`` rounds ago (any
        batch size) takes weight ``1 - (1 - alpha) ** g``, at most ``stale_weight``. A step every
        round observes moves by ``alpha`` as before; one only probes observe (plain decoding won)
        is not held at the level of rounds hundreds of rounds old: acceptance drifts within a
        request (the shipped pair's README prompt: 1.3-1.7 tokens a round over its first 45
        rounds, 2.2 after), and at ``alpha`` per probe round the gains learned in the hard
        opening kept plain decoding for 500 rounds."""
        prev = 0.0
        for j, b in enumerate(self.grid_upto(budget)):
            mean = sum(r[j] for r in rows) / len(rows)
            n = self._n.get(b, 0) + 1
            self._n[b] = n
            gap = max(1, self._clock - self._seen.get(b, self._clock - 1))
            self._seen[b] = self._clock
            w = max(min(self.stale_weight, 1.0 - (1.0 - self.alpha) ** gap), self.alpha, 1.0 / n)
            self._inc[b] = (1 - w) * self._inc.get(b, 0.0) + w * max(0.0, mean - prev)
            prev = mean
        total = 0.0
        for b in self.grid_upto(self.max_budget):
            if b not in self._inc:
                break
            total += self._inc[b]
            self.gain[b] = total

    def grid_upto(self, budget: int) -> list[int]:
        """The grid budgets in (0, budget]: the sub-budgets a round of ``budget`` observes."""
        return [b for b in self.grid if 0 < b <= budget]
