"""The cost side of ``budget="auto"`` (:mod:`sglang_tev.autobudget`): seconds per round by batch size
and budget, measured on this machine and read through a fit that is non-decreasing and convex in the
budget (:class:`CostTable`). Kept apart from the controller, which reads it; both runtimes and
``sglang-tev tune`` build, save and load it.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from .spec import MAX_BUDGET

__all__ = ["CostTable", "RESTORED_MIN_ROUNDS"]

RESTORED_MIN_ROUNDS = 3
"""Rounds a tree cost restored from a plan cache (``CostTable.from_json(frozen=False)``) must have
been timed in; fewer, and it is left out and timed again."""


def _monotone(points: list[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """Weighted isotonic (non-decreasing) fit of ``(budget, seconds, weight)`` sorted by budget,
    by pooling adjacent violators: a larger tree never costs less, so two noisy medians in the
    wrong order are replaced by their weighted mean."""
    blocks: list[list] = []  # [sum w*s, sum w, budgets]
    for b, s, w in points:
        blocks.append([s * w, w, [b]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            sw, ww, bs = blocks.pop()
            blocks[-1][0] += sw
            blocks[-1][1] += ww
            blocks[-1][2] += bs
    return [(b, sw / ww) for sw, ww, bs in blocks for b in bs]


def _solve(g: list[list[float]], r: list[float]) -> list[float] | None:
    """``z`` with ``g z = r`` for a small square system (Gaussian elimination, partial pivoting);
    None when ``g`` is singular."""
    k = len(r)
    m = [row[:] + [r[i]] for i, row in enumerate(g)]
    for c in range(k):
        p = max(range(c, k), key=lambda i: abs(m[i][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        mc = m[c]
        for i in range(c + 1, k):
            mi = m[i]
            f = mi[c] / mc[c]
            if f:
                for j in range(c, k + 1):
                    mi[j] -= f * mc[j]
    z = [0.0] * k
    for i in range(k - 1, -1, -1):
        mi = m[i]
        z[i] = (mi[k] - sum(mi[j] * z[j] for j in range(i + 1, k))) / mi[i]
    return z


def _convex(points: list[tuple[int, float, int]]) -> list[tuple[int, float]]:
    """Weighted least-squares fit of ``(budget, seconds, weight)`` sorted by budget, non-decreasing
    AND convex in the budget: ``f(x) = a + sum_k c_k max(0, x - x_k)`` with ``c_k >= 0``, a knot at
    every budget but the largest (so data already convex and non-decreasing is fitted exactly),
    solved by Lawson and Hanson's active-set NNLS with the intercept ``a`` free. A round's cost
    grows by at least as much per node as the tree grows (a CPU's forward by a fixed share per
    node, a GPU's flat until the tiles fill, then rising), so one stale or inflated median tilts
    the fit's slope a little everywhere instead of pooling its neighbours into a step that makes
    the budgets on either side look best (measured on the CPU server: medians 19 / 23 / 28 / 22 /
    26 / 30 / 28 / 33 ms for 2-64 nodes, isotonic steps of 1-2 ms per node below 16 and flat above,
    widths 2 and 48 chosen in turn). Returns ``(budget, fitted seconds)`` per point. Data already
    convex and non-decreasing is returned as is; otherwise ~45-80 us for 8 noisy points in pure
    Python (the Gram matrix from suffix sums, never the columns; each hinge that enters re-solves
    its system, so the time grows with the hinges the fit keeps)."""
    n = len(points)
    if n <= 2:
        return _monotone(points)  # with two points every monotone fit is convex
    xs = [float(b) for b, _, _ in points]
    slopes = [(points[i + 1][1] - points[i][1]) / (xs[i + 1] - xs[i]) for i in range(n - 1)]
    if slopes[0] >= 0 and all(a <= b for a, b in zip(slopes, slopes[1:])):
        return [(b, float(s)) for b, s, _ in points]  # already convex and non-decreasing: itself
    # suffix sums (i >= j) of w, w x, w x^2, w y, w x y: hinge k is non-zero from point k on
    s0, s1, s2, t0, t1 = ([0.0] * (n + 1) for _ in range(5))
    for i in range(n - 1, -1, -1):
        _, y, w = points[i]
        x = xs[i]
        s0[i], s1[i], s2[i] = s0[i + 1] + w, s1[i + 1] + w * x, s2[i + 1] + w * x * x
        t0[i], t1[i] = t0[i + 1] + w * y, t1[i + 1] + w * x * y
    knot = [0.0] + xs[:-1]  # column 0 the intercept, column k >= 1 the hinge at xs[k - 1]

    def gram(a: int, b: int) -> float:
        if not (a and b):
            k = a or b
            return s0[0] if not k else s1[k] - knot[k] * s0[k]
        i = max(a, b)
        return s2[i] - (knot[a] + knot[b]) * s1[i] + knot[a] * knot[b] * s0[i]

    rhs = [t0[0]] + [t1[k] - knot[k] * t0[k] for k in range(1, n)]
    coef = [0.0] * n
    coef[0] = rhs[0] / s0[0]
    active = [0]  # Lawson-Hanson's passive set; the free intercept always in it
    # no tolerance on the gradient or the weights: one scaled to the largest entry stopped early
    # when one median was 1e5x the others (a reviewer's case: 3 % off); 3n steps bound the loop
    for _ in range(3 * n):
        j, best = None, 0.0  # the hinge whose weight would lower the squared error most
        for k in range(1, n):
            if k not in active:
                gk = rhs[k] - sum(gram(k, a) * coef[a] for a in active)
                if gk > best:
                    j, best = k, gk
        if j is None:
            break
        active.append(j)
        while True:
            z = _solve([[gram(a, b) for b in active] for a in active], [rhs[a] for a in active])
            if z is None:  # the new column adds nothing independent: done
                active.pop()
                break
            neg = [coef[a] / (coef[a] - zi) for zi, a in zip(z, active) if a and zi <= 0]
            if not neg:
                for zi, a in zip(z, active):
                    coef[a] = zi
                break
            step = min(neg)  # move toward z until the first weight reaches 0; drop it
            for zi, a in zip(z, active):
                coef[a] += step * (zi - coef[a])
            for a in active:
                if a and coef[a] <= 0.0:
                    coef[a] = 0.0
            active = [a for a in active if a == 0 or coef[a] > 0.0]
        if z is None:
            break
    return [(b, coef[0] + sum(coef[k] * (xs[i] - knot[k]) for k in active if 0 < k <= i))
            for i, (b, _, _) in enumerate(points)]


@dataclass
class CostTable:
    """Seconds per round by (batch size, budget), measured on this machine.

    Each (batch, budget) keeps its last ``window`` round times (the first one of a pair is dropped
    once a second arrives: the first round of a new shape allocates). The cost of a tree budget
    is read from a fit across budgets: the weighted least-squares fit of the medians that is
    non-decreasing and convex in the budget (:func:`_convex`; a larger tree never costs less, and
    never less per node added), interpolated linearly between measured budgets, extended above
    the largest by the last segment's slope and below the smallest by the fit's mean slope (not
    below the plain round's cost; held flat while that is untimed). So every tree
    round informs every tree budget (a CPU's round times grow by a fraction of a percent per
    node, less than the noise of one budget's rounds), while a GPU's flat-then-rising cost keeps
    its shape.

    Provisional costs. A pair's first round in a process allocates its shapes (and builds CPU
    kernels for them), the first rounds of a process run cold, and a cost restored from a plan
    cache was timed in another process, at that minute's speed of the machine. None of these is
    what the pair costs now, and any non-decreasing fit pools a too-high small budget with every
    larger one (measured on the CPU server with the isotonic fit of before 2026-12-08: a restored
    table 36 / 21 / 20.5 / 20.3 / 21 ms for 16 / 24 / 32 / 48 / 64 nodes read as one flat cost, so
    the largest tree won where 32 nodes ran 12 % faster). So a pair is *provisional* until it has a *settled* round: one of this process, not
    its first here, recorded after the table's first ``warmup`` rounds; its provisional rounds are
    dropped then. Once a batch size has two settled tree budgets, the fit reads settled ones only
    (the provisional ones are read through it) and the controller's cost probes re-time the
    provisional ones (:meth:`~sglang_tev.autobudget.BudgetController.probe_kinds`).

    The machine's load. A shared machine runs the same round 1.5-2x slower in a busy minute, and a
    budget timed only by occasional probes would carry the minute it was timed in. So each round
    time is divided by the load of its minute before it is stored: the median of the last 8 raw
    times of the pair timed most in the last 16 rounds (the budget in use), over the median of
    its last 64 (clipped to [1/2, 4]; 1 until that pair has 16 times). A probe's round is then read
    against the rounds it is compared with, and every cost is at the budget in use's usual load.

    Attributes:
        seconds: ``{batch: {budget: seconds}}``, the median of each pair's recent rounds (in the
            table's load-free scale).
        counts: ``{batch: {budget: rounds measured}}``.
        frozen: when True :meth:`record` ignores new rounds (a table from ``sglang-tev tune``;
            repeated calls then choose the same budgets, so seeded runs repeat).
        window: measurements per pair the median is taken over.
        load_correction: divide round times by the load of their minute (above); off, the
            medians of raw times.
        stamp: rounds recorded so far; ``last``: ``{(batch, budget): stamp of its last round}``.
        warmup: the table's first rounds, whose times are provisional (above).
    """

    seconds: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    frozen: bool = False
    window: int = 15
    load_correction: bool = True
    stamp: int = 0
    warmup: int = 32
    last: dict = field(default_factory=dict, repr=False)
    _here: dict = field(default_factory=dict, repr=False)       # pair -> rounds recorded in this process
    _settled: set = field(default_factory=set, repr=False)      # pairs with a settled round (above)
    _recent: dict = field(default_factory=dict, repr=False)
    _raw: dict = field(default_factory=dict, repr=False)
    _pairs: list = field(default_factory=list, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)  # cost() answers since the last change
    _fits: dict = field(default_factory=dict, repr=False)  # batch -> (points, fit) of its last fit
    _load: float | None = field(default=None, repr=False)

    def current_load(self) -> float:
        """The load of the current minute relative to the budget in use's usual one (see above)."""
        if not self.load_correction or not self._pairs:
            return 1.0
        cur = max(set(self._pairs), key=self._pairs.count)
        raw = self._raw.get(cur, [])
        if len(raw) < 16:
            return 1.0
        return min(4.0, max(0.5, statistics.median(raw[-8:]) / statistics.median(raw)))

    def record(self, batch: int, budget: int, seconds: float) -> None:
        """Add one measured round (ignored when frozen or not a finite time > 0)."""
        if self.frozen or not math.isfinite(seconds) or seconds <= 0:
            return
        cnt = self.counts.setdefault(batch, {})
        cnt[budget] = cnt.get(budget, 0) + 1
        pair = (batch, budget)
        recent = self._recent.setdefault(pair, [])
        here = self._here[pair] = self._here.get(pair, 0) + 1
        if here == 2 and len(recent) == 1:
            recent.clear()  # the pair's first round here allocated its shapes (restored counts aside)
        if pair not in self._settled and here >= 2 and self.stamp >= self.warmup:
            recent.clear()  # its first settled round: the provisional ones go
            self._settled.add(pair)
        if self.stamp % 4 == 0 or self._load is None:  # the load moves by the minute: read it every 4th round
            self._load = self.current_load()
        norm = seconds / self._load  # this minute's load, from the rounds before this one
        raw = self._raw.setdefault((batch, budget), [])
        raw.append(seconds)
        del raw[:-64]
        self._pairs.append((batch, budget))
        del self._pairs[:-16]
        self.stamp += 1
        self.last[(batch, budget)] = self.stamp
        self._memo.clear()
        recent.append(norm)
        del recent[:-self.window]
        # the median of the last few rounds: a round slowed by a neighbour does not set the cost
        self.seconds.setdefault(batch, {})[budget] = statistics.median(recent)

    def set(self, batch: int, budget: int, seconds: float, count: int = 1) -> None:
        """Set a pair's cost outright (``sglang-tev tune``: a median over whole timed runs).
        Raises ``ValueError`` naming ``seconds`` unless it is a finite number > 0."""
        if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
        self._memo.clear()
        self._recent[(batch, budget)] = [float(seconds)]
        self._settled.add((batch, budget))
        self.counts.setdefault(batch, {})[budget] = int(count)
        self.seconds.setdefault(batch, {})[budget] = float(seconds)

    def raw(self, batch: int, budget: int) -> list[float]:
        """The pair's last (up to 64) measured round times, in seconds as measured (no load
        correction), oldest first."""
        return self._raw.get((batch, budget), [])

    def measured(self, batch: int, budget: int) -> bool:
        return budget in self.seconds.get(batch, {})

    def provisional(self, batch: int, budget: int) -> bool:
        """Whether the pair has a cost but no settled round yet (see the class docstring; a frozen
        table's costs are never provisional: they are not re-timed)."""
        return not self.frozen and self.measured(batch, budget) and (batch, budget) not in self._settled

    def cost(self, batch: int, budget: int) -> float | None:
        """Seconds of a round at (batch, budget), in the table's scale (seconds at load 1: only
        ratios between budgets matter): plain decoding (budget 0) measured, never
        extrapolated (it has no draft), and read no higher than the cheapest tree's fitted cost
        at the batch size (:meth:`_plain`); a tree budget from the convex monotone fit over this batch
        size's measured tree budgets (one measured budget: that one only). A batch size with
        nothing for ``budget`` borrows from the nearest batch size n that has it (a batch that
        shrinks as rows finish needs no new calibration): where the lender has a plain round, its
        ratio to it times this batch size's plain round, its own or lent (seconds from another
        batch size would be on another scale: a tree of 8 rows read as cheaper than a plain
        round of 32); else the lender's seconds. None when nothing applies."""
        key = (batch, budget)
        if key not in self._memo:  # asked ~10 times a round; the table changes once a round
            c = self._at(batch, budget) if batch in self.seconds else None
            if c is None:  # the nearest batch size that has it
                n, c = next(((b, c) for b in sorted(self.seconds, key=lambda x: (abs(x - batch), x))
                             if b != batch and (c := self._at(b, budget)) is not None), (None, None))
                if c is not None and budget > 0:
                    # this batch size's plain round, its own or lent (budget 0: no recursion here)
                    plain, lender_plain = self.cost(batch, 0), self._at(n, 0)
                    if plain and lender_plain:
                        c = plain * c / lender_plain
                elif c is not None and (floor := self._tree_floor(batch, c)) is not None:
                    c = min(c, floor)  # a lent plain round, too, no higher than a tree round here
            self._memo[key] = c
        return self._memo[key]

    def _fit(self, batch: int) -> list[tuple[int, float]]:
        """The monotone convex fit (:func:`_convex`) over this batch size's measured tree budgets
        (settled ones only once two are), weighted by their rounds (up to ``window``), memoized
        until the table changes and recomputed only when its points do (a plain round changes
        none of them)."""
        fit = self._memo.get(("fit", batch))
        if fit is None:
            row, cnt = self.seconds.get(batch, {}), self.counts.get(batch, {})
            trees = [b for b in row if b > 0]
            settled = [b for b in trees if not self.provisional(batch, b)]
            pts = sorted((b, row[b], min(self.window, max(1, cnt.get(b, 1))))
                         for b in (settled if len(settled) >= 2 else trees))
            last = self._fits.get(batch)
            fit = last[1] if last is not None and last[0] == pts else _convex(pts)
            self._fits[batch] = (pts, fit)
            self._memo[("fit", batch)] = fit
        return fit

    def _plain(self, batch: int) -> float | None:
        """This batch size's plain round, read no higher than its cheapest tree round: a tree
        round runs a plain round's forward and a draft, so a plain time above it is a stalled
        measurement, and read as is it would price the across probes that re-time it out of the
        allowance for good. Measured: a benchmark's plan cache held batch 1's plain round at 63 ms
        (three cold rounds; its trees 10-15 ms), every other batch size borrowed it (:meth:`cost`),
        and at batch 8, T = 1 auto ran 3,000 tree rounds at 0.57x plain decoding, never a plain one."""
        c = self.seconds.get(batch, {}).get(0)
        floor = self._tree_floor(batch, c)
        return c if c is None or floor is None else min(c, floor)

    def _tree_floor(self, batch: int, plain: float | None) -> float | None:
        """The cheapest tree round this batch size reads: its own fit's, else (no tree timed here)
        that of the nearest batch size with one, as :meth:`cost` lends it: unscaled when the
        lender or this batch size has no plain round (with both, the lent trees are read as the
        lender's ratio to its plain round times ``plain``, never below it: no floor needed). None
        when no batch size has a tree."""
        fit = self._fit(batch) if batch in self.seconds else []
        if fit:
            return fit[0][1]
        n = next((b for b in sorted(self.seconds, key=lambda x: (abs(x - batch), x)) if b != batch and self._fit(b)), None)
        if n is None:
            return None
        if plain is not None and self._plain(n) is not None:
            return None
        return self._fit(n)[0][1]

    def _at(self, batch: int, budget: int) -> float | None:
        if budget == 0:
            return self._plain(batch)
        fit = self._fit(batch)
        if not fit:
            return None
        if len(fit) == 1:
            return fit[0][1] if fit[0][0] == budget else None
        xs = [b for b, _ in fit]
        j = max(1, min(len(fit) - 1, next((i for i, x in enumerate(xs) if x >= budget), len(fit) - 1)))
        (x0, y0), (x1, y1) = fit[j - 1], fit[j]
        if budget < x0:
            # below the smallest timed budget: the fit's mean slope carried down, not below a plain
            # round (a tree round adds a draft to it); held flat while plain decoding is untimed.
            # A guess that errs low is timed as soon as it is chosen; one that erred high (held
            # flat on a CPU, where every node costs) would keep the smaller trees from ever
            # being chosen, hence timed
            plain = self._plain(batch)
            if plain is None:
                return y0
            slope = (fit[-1][1] - fit[0][1]) / (fit[-1][0] - fit[0][0])
            return max(plain, y0 - slope * (x0 - budget))
        return y0 + (y1 - y0) * (budget - x0) / (x1 - x0)

    def to_json(self) -> dict:
        return {"seconds": {str(b): {str(k): v for k, v in r.items()} for b, r in self.seconds.items()},
                "counts": {str(b): {str(k): v for k, v in r.items()} for b, r in self.counts.items()}}

    @classmethod
    def from_json(cls, data: dict, frozen: bool = True) -> "CostTable":
        """A table written by :meth:`to_json` (``sglang-tev tune --output``, or a plan cache with
        ``frozen=False``: then tree costs timed in fewer than :data:`RESTORED_MIN_ROUNDS` rounds are
        left out). Raises ``ValueError`` naming ``cost_table`` for a malformed one."""
        shape = "a JSON object {\"seconds\": {batch size: {budget: seconds per round}}}"
        if not isinstance(data, dict) or not isinstance(data.get("seconds"), dict):
            raise ValueError(f"cost_table: not a cost table (expected {shape})")
        try:
            raw = {int(b): dict(r) for b, r in data["seconds"].items()}
            cnt = {int(b): {int(k): int(v) for k, v in r.items()} for b, r in (data.get("counts") or {}).items()}
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for r in raw.values() for v in r.values()):
                raise ValueError("an entry is not a number")
            sec = {b: {int(k): float(v) for k, v in r.items()} for b, r in raw.items()}
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"cost_table: not a cost table ({e}; expected {shape})") from None
        if any(not (v > 0 and math.isfinite(v)) for r in sec.values() for v in r.values()):
            raise ValueError("cost_table: every entry must be a finite number of seconds > 0")
        if any(b < 1 for b in sec) or any(not 0 <= k <= MAX_BUDGET for r in sec.values() for k in r):
            raise ValueError(f"cost_table: batch sizes must be >= 1 and budgets in 0..{MAX_BUDGET}")
        if not any(any(b > 0 for b in r) for r in sec.values()):
            raise ValueError("cost_table: holds no tree budget (> 0) at any batch size; nothing to choose from")
        if not frozen:
            # a restored tree cost timed in fewer than RESTORED_MIN_ROUNDS rounds (a calibration
            # round, a probe) is left out: the controller times it again here. Kept, one cold round
            # of a busy minute held every tree at 10-50x plain decoding and no probe could pay to
            # re-time it, run after run
            sec = {b: {k: v for k, v in r.items() if k == 0 or cnt.get(b, {}).get(k, 0) >= RESTORED_MIN_ROUNDS}
                   for b, r in sec.items()}
            cnt = {b: {k: v for k, v in r.items() if k in sec.get(b, {})} for b, r in cnt.items()}
            sec = {b: r for b, r in sec.items() if r}
        table = cls(sec, cnt, frozen=frozen)
        if frozen:  # a tuned table is the truth it is run with; a restored one is re-timed here
            table._settled = {(b, k) for b, r in sec.items() for k in r}
        return table

    @classmethod
    def load(cls, path, frozen: bool = True) -> "CostTable":
        """Read a JSON table (a file of :meth:`to_json`, or one holding it under ``cost_table``).
        Raises ``ValueError`` naming ``cost_table`` for a missing or malformed file."""
        if not str(path).strip():
            raise ValueError("cost_table: the path is empty")
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"cost_table: {p} is a directory; give the JSON file 'sglang-tev tune --output' wrote")
        if not p.is_file():
            raise ValueError(f"cost_table: no file at {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cost_table: {p} is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"cost_table: {p} is not a cost table")
        return cls.from_json(data.get("cost_table", data), frozen=frozen)
