"""Load-adaptive trees: each round's tree size from this round's draft, a calibration learned from
past rounds' exit laws, and the measured cost of rounds (DESIGN §2; paper Eq. 2 and 6).

What a node is worth. In a best-first tree (DDTree, the lattice DDTree) nodes join in pop order,
by non-increasing draft path score ``s(v) = sum log q`` along the path, and the first ``b`` nodes
ARE the budget-``b`` tree. A round with tree ``T`` emits ``1 + sum_{v in T} P(v)`` tokens in
expectation (the bonus token plus the coverage C_p, Eq. 6), where the target reach probability
``P(v)`` (Eq. 2) of a node does not depend on the rest of the tree. After every verify forward the
exit law gives ``P(v)`` of every node exactly, so each verified round labels each node's draft
score with the reach it had: :class:`ReachCalibration` learns ``E[P(v) | s(v)]`` from those labels,
per temperature regime (greedy rows learn hit rates: ``P`` is 1 on the accepted path and 0
elsewhere), and from the tree's edges the chance the target goes on along an edge once it reached
its parent (per depth, by the edge's draft log-probability), whose product along a path values a
node as Eq. 2 builds its reach. What the node values still miss (the pop position: which rank of
child a node is) is learned per segment of pop order as the ratio of realised to predicted reach,
and the values are scaled by it (:meth:`ReachCalibration.corrected`). A row's values are made
non-increasing in pop order by pooling adjacent violators (prefix totals kept at block ends).

What a round costs. The runtime measures seconds per round as a function of the batch and the
verify tokens (``cost(width)`` or ``cost(total)``): a *ragged* runtime pays for the sum of the
rows' tree sizes, a *padded* one for the batch times the largest.

The choice (:func:`allocate`). Given every row's node values, one budget per row that maximises
expected tokens per second. With a long-run rate ``rate`` (tokens per second the runtime already
reaches), the round maximises ``tokens - rate * seconds`` (Dinkelbach's step: a confident round
takes every node worth more than the time it costs at that rate, an unconfident one few); without
one, the round's own ratio ``tokens / seconds``. Ragged: the nodes of all rows ranked together by
value (a prefix of a row's non-increasing values is its best-first sub-tree), the total chosen on
the cost curve. Padded: one width for every row. Both equal brute force over all budget vectors
(``tests/core/test_planner.py``).

Exactness: the plan depends only on this round's draft (fixed before the target is read) and on
past rounds, never on this round's target probabilities or draws; an exact verifier samples the
target law given whatever tree it gets, so the output law is untouched.

Torch is needed only by :func:`node_path_scores` and :func:`node_edge_scores`; the rest is host arithmetic.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .spec import SpecError, is_greedy

__all__ = ["SCORE_EDGES", "MAX_DEPTH_KEY", "edge_key", "ReachCalibration", "Allocation", "allocate", "regime_of",
           "node_path_scores", "node_edge_scores"]

SCORE_EDGES = (0.0, -0.01, -0.03, -0.06, -0.1, -0.17, -0.25, -0.35, -0.5, -0.7, -1.0, -1.4, -2.0, -2.8, -4.0,
               -5.5, -8.0, -12.0)
"""Bin edges over the draft path score (natural-log units): bin ``i`` holds scores in
``(SCORE_EDGES[i + 1], SCORE_EDGES[i]]``, the last bin everything at or below ``-12``."""

LAYOUTS = ("ragged", "padded")


def regime_of(temperature: float) -> str:
    """The calibration's regime key of a row's temperature: ``"greedy"``, or the temperature
    rounded to a tenth (``"T0.7"``): the reach of a node at a given draft score depends on the
    target law it is verified under."""
    if is_greedy(temperature):
        return "greedy"
    return f"T{round(float(temperature), 1):g}"


def _bin(score: float) -> int:
    # SCORE_EDGES is decreasing: count the edges strictly above the score, minus one
    neg = -score
    return min(len(SCORE_EDGES) - 1, max(0, bisect.bisect_left(_NEG_EDGES, neg) - 1))


_NEG_EDGES = tuple(-e for e in SCORE_EDGES)  # increasing, for bisect


def _prior(i: int) -> float:
    """Prior reach of bin ``i``: the draft probability ``exp(s)`` at the bin's middle (a calibrated
    drafter's reach)."""
    hi = SCORE_EDGES[i]
    lo = SCORE_EDGES[i + 1] if i + 1 < len(SCORE_EDGES) else SCORE_EDGES[-1] - 4.0
    return math.exp(0.5 * (hi + lo))


_PRIORS = [_prior(i) for i in range(len(SCORE_EDGES))]


def _check_edges(edges, n: int) -> tuple[list[float], list[int], list[int]]:
    """``edges`` as :meth:`ReachCalibration.update` takes them, checked for ``n`` nodes: three
    sequences of at least ``n`` entries, depths >= 1, each parent -1 or an earlier node.

    Raises:
        SpecError naming ``edges``.
    """
    try:
        logq, depths, parents = (list(x) for x in edges)
    except (TypeError, ValueError):
        raise SpecError("edges", "must be (edge_logq, depths, parents), three sequences") from None
    if min(len(logq), len(depths), len(parents)) < n:
        raise SpecError("edges", f"need {n} nodes in each of edge_logq, depths, parents, got "
                                 f"{len(logq)}, {len(depths)}, {len(parents)}")
    logq, depths, parents = logq[:n], depths[:n], parents[:n]
    # the planner's own rows (ints and finite floats) pass in one sweep each, every round
    if (all(type(d) is int and d >= 1 for d in depths)
            and all(type(p) is int and -1 <= p < j for j, p in enumerate(parents))):
        try:
            out = [float(x) for x in logq]
        except (TypeError, ValueError):
            out = None
        if out is not None and all(map(math.isfinite, out)):
            return out, depths, parents
    for j in range(n):
        if isinstance(depths[j], bool) or int(depths[j]) != depths[j] or depths[j] < 1:
            raise SpecError("edges", f"node {j}: depth must be an integer >= 1, got {depths[j]!r}")
        if isinstance(parents[j], bool) or int(parents[j]) != parents[j] or not -1 <= parents[j] < j:
            raise SpecError("edges", f"node {j}: parent must be -1 (the root) or an earlier node, got {parents[j]!r}")
        if not math.isfinite(float(logq[j])):
            raise SpecError("edges", f"node {j}: edge_logq must be finite, got {logq[j]!r}")
    return [float(x) for x in logq], [int(d) for d in depths], [int(p) for p in parents]


def _antitone(means: list[float], weights: list[float]) -> list[float]:
    """Weighted isotonic fit, non-increasing along the list (pool adjacent violators). Called
    several times a round (each calibration table read after a label, each row's node values),
    so it keeps block means on parallel stacks and returns a copy at once when nothing violates."""
    if all(a >= b for a, b in zip(means, means[1:])):
        return list(means)
    vals: list[float] = []  # per block: its weighted mean, total weight, length
    tot: list[float] = []
    lens: list[int] = []
    for x, w in zip(means, weights):
        n = 1
        while vals and vals[-1] < x:
            pw = tot.pop()
            x = (vals.pop() * pw + x * w) / (pw + w)
            w += pw
            n += lens.pop()
        vals.append(x)
        tot.append(w)
        lens.append(n)
    out: list[float] = []
    for x, n in zip(vals, lens):
        out.extend([x] * n)
    return out


MAX_DEPTH_KEY = 6
"""Depths the edge calibration keeps apart (:func:`edge_key`): 1, 2, ..., 5 and 6 or deeper."""


SEGMENT_LABELS = "unrefined"
"""Which rounds label :meth:`ReachCalibration.learn_segments` (written with the segments; a
saved calibration of another rule keeps its tables and drops its segments)."""


def edge_key(regime: str, depth: int) -> str:
    """The calibration key of the edges into depth ``depth`` (>= 1) under ``regime``:
    ``"greedy@e3"``, the depth capped at :data:`MAX_DEPTH_KEY`."""
    return f"{regime}@e{min(int(depth), MAX_DEPTH_KEY)}"


class ReachCalibration:
    """Draft scores -> expected target reach, learned online per regime.

    Two tables per regime, each a running mean per score bin (:data:`SCORE_EDGES`) of labels,
    starting at the prior ``exp(score)`` with weight ``prior_weight`` and moving as an EMA of
    weight ``alpha`` once ``1 / alpha`` labels are in (the drafter's context, the prompt mix and
    the load change), read through a fit non-increasing in the score:

    * the regime's key: a node's draft path score ``s(v) = sum log q`` -> ``E[P(v) | s(v)]``;
    * with the tree's edges (:meth:`update` / :meth:`values` ``edges``), per depth
      (:func:`edge_key`): an edge's draft log-probability ``log q(v | parent)`` -> the chance the
      target goes on to ``v`` once it reached the parent, ``E[P(v) / P(parent)]``. A node's
      value is then the product along its path, as the reach itself is (Eq. 2). The path score
      alone cannot tell a likely child of the chain the target follows from a sibling branch of
      the same score: on the CPU server (shipped pair, greedy, 64-node trees, 1,789 rounds) it
      valued the nodes past the 16th at 0.40 tokens a round where they held 0.82, and cut the
      rounds whose nodes 17-32 held the most (0.66 tokens against 0.34 in the rounds it kept).
    Args:
        alpha: the EMA weight per label once a bin has ``1 / alpha`` labels (0 < alpha <= 1).
        prior_weight: pseudo-labels of the prior per bin (>= 0).
    Raises:
        SpecError naming ``alpha`` / ``prior_weight``: out of range.
    """

    def __init__(self, alpha: float = 0.002, prior_weight: float = 2.0) -> None:
        if not 0 < alpha <= 1:
            raise SpecError("alpha", f"must be in (0, 1], got {alpha!r}")
        if not prior_weight >= 0:
            raise SpecError("prior_weight", f"must be >= 0, got {prior_weight!r}")
        self.alpha, self.prior_weight = float(alpha), float(prior_weight)
        self.means: dict[str, list[float]] = {}
        self.counts: dict[str, list[float]] = {}
        self.segments: dict[str, dict[int, list[float]]] = {}  # regime -> {size: [real, predicted, rounds]}
        self._fit: dict[str, list[float]] = {}

    def _regime(self, regime: str) -> tuple[list[float], list[float]]:
        m = self.means.get(regime)
        if m is None:
            m = self.means[regime] = [_prior(i) for i in range(len(SCORE_EDGES))]
            self.counts[regime] = [self.prior_weight] * len(SCORE_EDGES)
        return m, self.counts[regime]

    def update(self, regime: str, scores: Iterable[float], reach: Iterable[float], edges=None) -> None:
        """Fold labels in: the draft path score of each verified node and its reach ``P(v)``
        (0..1; for greedy rows 1 if the node was on the accepted path, else 0).

        Args:
            edges: None, or the same nodes' ``(edge_logq, depths, parents)`` (lists: the draft
                log-probability of the edge into each node, its depth >= 1, and its parent's
                index in this list, -1 for the root): each edge whose parent was reached is also
                a label of its depth's edge table, ``P(v) / P(parent)`` with weight ``P(parent)``
                (greedy: the hit rate of the children of reached nodes).
        """
        scores, reach = list(scores), [float(p) for p in reach]
        n = min(len(scores), len(reach))
        checked = None if edges is None else _check_edges(edges, n)  # before any table moves
        ok = [math.isfinite(p) for p in reach[:n]]  # a label that is not a number is left out
        # each label moves its bin's running mean by its weight over the bin's count (capped at
        # 1 / alpha: past that an EMA of weight alpha); inlined, as every node of every round is one
        clamped = [min(1.0, max(0.0, p)) if good else 0.0 for p, good in zip(reach, ok)]
        cap = 1.0 / self.alpha
        means, counts = self._regime(regime)
        for s, p, good in zip(scores, clamped, ok):
            if good:
                i = _bin(float(s))
                c = counts[i] = min(counts[i] + 1.0, cap)
                means[i] += (p - means[i]) / max(1.0, c)
        self._fit.pop(regime, None)
        if checked is None:
            return
        tables: dict[int, tuple[list[float], list[float]]] = {}  # per capped depth: (means, counts), found once
        for j, (e, d, par) in enumerate(zip(*checked)):
            above = 1.0 if par < 0 else clamped[par]
            if ok[j] and (par < 0 or ok[par]) and above > 1e-6:
                if d > MAX_DEPTH_KEY:
                    d = MAX_DEPTH_KEY
                t = tables.get(d)
                if t is None:
                    key = edge_key(regime, d)
                    t = tables[d] = self._regime(key)
                    self._fit.pop(key, None)
                tm, tc = t
                i = _bin(e)
                c = tc[i] = min(tc[i] + above, cap)
                tm[i] += above * (min(1.0, clamped[j] / above) - tm[i]) / max(1.0, c)

    def table(self, regime: str) -> list[float]:
        """The fitted reach per bin of ``regime`` (non-increasing; the prior before any label)."""
        fit = self._fit.get(regime)
        if fit is None:
            means, counts = self._regime(regime)
            fit = self._fit[regime] = _antitone(means, [max(c, 1e-9) for c in counts])
        return fit

    def value(self, regime: str, score: float) -> float:
        """The expected reach of one node of draft path score ``score`` under ``regime``."""
        return self.table(regime)[_bin(float(score))]

    def values(self, regime: str, scores: Sequence[float], edges=None) -> list[float]:
        """The expected reach of each node of a row's frontier in pop order, non-increasing (what
        :func:`allocate` takes). Without ``edges``, :meth:`value` of each path score
        (non-increasing as the scores are). With them (as :meth:`update`), the product along each
        node's path of its edges' calibrated continuation chances (an edge table never labelled
        reads its prior, ``exp`` of the middle of the edge's score bin), then made non-increasing along the row by pooling
        adjacent violators: a prefix's total is kept wherever a pooled block ends, so the
        best-first sub-trees the allocation compares are valued by what their nodes hold."""
        if edges is None:
            t = self.table(regime)
            return [t[_bin(float(s))] for s in scores]
        out: list[float] = []
        tables: dict[int, list[float]] = {}  # per capped depth: its edge table, read once a call
        for e, d, par in zip(*_check_edges(edges, len(scores))):
            d = min(d, MAX_DEPTH_KEY)
            t = tables.get(d)
            if t is None:
                key = edge_key(regime, d)
                t = tables[d] = self.table(key) if key in self.means else _PRIORS
            out.append((1.0 if par < 0 else out[par]) * t[_bin(e)])
        return _antitone(out, [1.0] * len(out))

    # ------------------------------------------------------------ what the node values miss
    SEGMENT_ALPHA = 0.02
    """The EMA weight of a segment's sums per labelled row (a running mean for the first 50)."""

    def learn_segments(self, regime: str, values: Sequence[float], reach: Sequence[float], sizes: Sequence[int]) -> None:
        """Compare one verified row's predicted and realised reach per segment of pop order.

        Node values (by score or edges) miss what the pop position says about a node (on the CPU
        server's shipped pair the third node in pop order was reached in 63 % of the rounds, the
        second, of a higher path score, in 6 %): there the values summed over the first 24
        nodes 1.9 tokens where the rounds held 2.5, and the cut stopped short of what paid. So
        per segment ``(sizes[k-1], sizes[k]]`` of pop order the sums of the row's values
        (:meth:`values`, before :meth:`corrected`) and of its verified reach are kept as EMAs,
        and :meth:`corrected` scales the segment's values by their ratio. The rows must not have been
        cut by these values: a row verified through a segment because its values there were high
        reads a low ratio (the winner's curse); :class:`~sglang_tev.plan.TreePlanner` labels only
        rounds whose width the values did not choose (probes, trials, calibration rounds).

        Args:
            values: the row's node values in pop order (at least its verified nodes).
            reach: the verified nodes' reach ``P(v)``, in pop order (the root left out); only the
                segments it covers in full are labelled.
            sizes: the segment ends (the grid's positive budgets, increasing).
        """
        reach = [float(x) for x in reach]
        values = [float(x) for x in values]
        if not all(math.isfinite(x) for x in reach + values):
            return  # a row with a label or value that is not a number teaches nothing
        reach = [min(1.0, max(0.0, x)) for x in reach]
        seg = self.segments.setdefault(regime, {})
        prev = 0
        for size in sizes:
            if size > len(reach) or size > len(values):
                break
            e = seg.setdefault(int(size), [0.0, 0.0, 0])
            e[2] += 1
            w = max(self.SEGMENT_ALPHA, 1.0 / e[2])
            e[0] += w * (sum(float(x) for x in reach[prev:size]) - e[0])
            e[1] += w * (sum(values[prev:size]) - e[1])
            prev = size

    SEGMENT_MIN_ROUNDS = 8
    """Labelled rows a segment needs before its factor is read (one round's ratio is noise)."""

    def segment_factor(self, regime: str, size: int) -> float:
        """Realised over predicted reach of the segment ending at ``size`` (1 while it has fewer
        than :attr:`SEGMENT_MIN_ROUNDS` labelled rows or is predicted empty), clipped to [0.2, 5]."""
        e = self.segments.get(regime, {}).get(int(size))
        if e is None or e[2] < self.SEGMENT_MIN_ROUNDS or e[1] <= 1e-9:
            return 1.0
        return min(5.0, max(0.2, e[0] / e[1]))

    def corrected(self, regime: str, values: Sequence[float], sizes: Sequence[int]) -> list[float]:
        """``values`` (a row's, in pop order) with each segment's scaled by
        :meth:`segment_factor` (nodes past the last size keep theirs), capped at 1 and made
        non-increasing again by pooling adjacent violators (:func:`allocate` takes them)."""
        out = [float(v) for v in values]
        prev = 0
        for size in sizes:
            if prev >= len(out):
                break
            f = self.segment_factor(regime, size)
            out[prev:size] = [min(1.0, v * f) for v in out[prev:size]]
            prev = size
        return _antitone(out, [1.0] * len(out))

    def to_json(self) -> dict:
        return {"edges": list(SCORE_EDGES), "alpha": self.alpha, "prior_weight": self.prior_weight,
                "means": self.means, "counts": self.counts,
                "segments": {g: {str(k): v for k, v in seg.items()} for g, seg in self.segments.items()},
                "segment_labels": SEGMENT_LABELS}

    @classmethod
    def from_json(cls, data: dict) -> "ReachCalibration":
        """The calibration :meth:`to_json` wrote.

        Raises:
            ValueError: other bin edges, or per-regime lists of the wrong length / out of range.
        """
        if list(data.get("edges", ())) != list(SCORE_EDGES):
            raise ValueError("calibration: written with other score bins")
        cal = cls(float(data["alpha"]), float(data["prior_weight"]))
        for regime, means in data["means"].items():
            counts = data["counts"][regime]
            if len(means) != len(SCORE_EDGES) or len(counts) != len(SCORE_EDGES):
                raise ValueError(f"calibration: regime {regime!r} has {len(means)} bins, want {len(SCORE_EDGES)}")
            if not all(0.0 <= float(x) <= 1.0 for x in means) or not all(
                    math.isfinite(float(c)) and float(c) >= 0 for c in counts):
                raise ValueError(f"calibration: regime {regime!r} holds values out of range")
            cal.means[str(regime)] = [float(x) for x in means]
            cal.counts[str(regime)] = [float(c) for c in counts]
        # segments a cache learnt under another labelling rule are dropped, not trusted (before
        # 2026-12-07 refined rounds labelled them too, with the winner's curse's low ratios)
        segments = (data.get("segments") or {}) if data.get("segment_labels") == SEGMENT_LABELS else {}
        if not isinstance(segments, dict):
            raise ValueError("calibration: segments must be {regime: {size: [realised, predicted, rounds]}}")
        for regime, seg in segments.items():
            cal.segments[str(regime)] = _segments_from_json(regime, seg)
        return cal


def _segments_from_json(regime, seg) -> dict[int, list]:
    """One regime's segments as :meth:`ReachCalibration.to_json` wrote them, checked.

    Raises:
        ValueError naming the calibration's regime: not ``{size >= 1: [realised >= 0, predicted >= 0,
        rounds >= 0 (an integer)]}`` of finite numbers.
    """
    bad = ValueError(f"calibration: regime {regime!r} has malformed segments "
                     "(want {size >= 1: [realised >= 0, predicted >= 0, rounds >= 0]}, finite numbers)")
    if not isinstance(seg, dict):
        raise bad
    out = {}
    for k, v in seg.items():
        try:
            size = int(k)
        except (TypeError, ValueError):
            raise bad from None
        if str(size) != str(k).strip() or size < 1 or not isinstance(v, (list, tuple)) or len(v) != 3:
            raise bad
        if any(isinstance(x, (bool, str)) or not isinstance(x, (int, float)) for x in v):
            raise bad
        real, pred, rounds = float(v[0]), float(v[1]), v[2]
        if not (math.isfinite(real) and math.isfinite(pred) and real >= 0 and pred >= 0):
            raise bad
        if not (float(rounds).is_integer() and rounds >= 0):
            raise bad
        out[size] = [real, pred, int(rounds)]
    return out


@dataclass(frozen=True)
class Allocation:
    """One round's choice.

    Attributes:
        budgets: per row, the nodes (root excluded) of its tree, in the rows' order.
        tokens: expected committed tokens of the round (one per row plus the chosen values).
        seconds: the cost the choice was made with.
        size: what the cost was read at (the total of the budgets when ragged, the width padded).
    """

    budgets: tuple[int, ...]
    tokens: float
    seconds: float
    size: int

    @property
    def rate(self) -> float:
        """Expected tokens per second."""
        return self.tokens / self.seconds


def _check_values(values) -> list[list[float]]:
    rows = [[float(v) for v in row] for row in values]
    if not rows:
        raise SpecError("values", "one list of node values per row, got no rows")
    for r, row in enumerate(rows):
        if any(not 0.0 <= v <= 1.0 for v in row):
            raise SpecError("values", f"row {r}: node values are reach probabilities in [0, 1], got {row}")
        if any(a < b for a, b in zip(row, row[1:])):
            raise SpecError("values", f"row {r}: node values must be non-increasing in pop order, got {row}")
    return rows


def allocate(values: Sequence[Sequence[float]], cost: Callable[[int], float | None], *, layout: str = "ragged",
             sizes: Iterable[int] | None = None, rate: float | None = None) -> Allocation | None:
    """The budgets of one round that maximise expected tokens per second.

    Args:
        values: per row, the calibrated values (expected reach, in [0, 1]) of its frontier nodes
            in pop order, non-increasing; a row's list length is the most nodes it may take.
        cost: seconds of the round as a function of its size (``None``: unknown, not chosen):
            the total of the budgets (``layout="ragged"``) or the width every row is padded to
            (``"padded"``); size 0 is a root-only round.
        layout: ``"ragged"`` or ``"padded"``.
        sizes: the sizes that may be chosen (None: every size from 0 to the most nodes).
        rate: the long-run tokens per second the runtime reaches (>0): maximise
            ``tokens - rate * seconds``; None: maximise ``tokens / seconds``.
    Returns:
        The best :class:`Allocation` (ties to the smaller size), or None when no allowed size has
        a known cost.
    Raises:
        SpecError naming ``values`` (empty, out of [0, 1], increasing within a row), ``layout`` or
        ``rate``; ValueError when ``cost`` returns a non-positive number.
    """
    rows = _check_values(values)
    if layout not in LAYOUTS:
        raise SpecError("layout", f"must be one of {LAYOUTS}, got {layout!r}")
    if rate is not None and not rate > 0:
        raise SpecError("rate", f"must be > 0 tokens per second or None, got {rate!r}")
    b = len(rows)
    if layout == "ragged":
        # all rows' nodes by value desc (ties: row, then pop order): each prefix is prefix-closed per row
        order = list(heapq.merge(*[[(-v, r, i) for i, v in enumerate(row)] for r, row in enumerate(rows)]))
        top = len(order)
    else:
        top = max(len(row) for row in rows)
    allowed = sorted({int(s) for s in sizes if 0 <= int(s) <= top}) if sizes is not None else list(range(top + 1))
    best, best_key = None, None
    prefix, taken = 0.0, 0
    cum = [[0.0] for _ in rows]
    if layout == "padded":
        for r, row in enumerate(rows):
            for v in row:
                cum[r].append(cum[r][-1] + v)
    for size in allowed:
        sec = cost(size)
        if sec is None:
            continue
        if not sec > 0:
            raise ValueError(f"cost({size}) must be > 0 seconds, got {sec!r}")
        if layout == "ragged":
            while taken < size:
                prefix += -order[taken][0]
                taken += 1
            tokens = b + prefix
        else:
            tokens = b + sum(c[min(size, len(c) - 1)] for c in cum)
        key = tokens / sec if rate is None else tokens - rate * sec
        if best_key is None or key > best_key + 1e-12:
            best_key, best = key, (size, tokens, sec)
    if best is None:
        return None
    size, tokens, sec = best
    if layout == "ragged":
        budgets = [0] * b
        for _, r, _ in order[:size]:
            budgets[r] += 1
    else:
        budgets = [min(size, len(row)) for row in rows]
    return Allocation(tuple(budgets), tokens, sec, size)


def node_path_scores(tree, drafted=None, *, edges=None):
    """float64 [b, N]: each node's draft path score ``sum log q`` along its path (root 0; padded
    nodes ``-inf``), the score DDTree ranks it by (temperature 1, as the builders): the sum of
    :func:`node_edge_scores` over the node's ancestors and itself.

    Args: ``tree`` and ``drafted`` as :func:`node_edge_scores`; or ``edges``, its result for this
    tree when already at hand (``drafted`` is then not read).
    """
    import torch

    edge = node_edge_scores(tree, drafted) if edges is None else edges
    score = (tree.ancestor_mask.to(torch.float64) * edge.unsqueeze(1)).sum(-1)
    return torch.where(tree.valid, score, torch.full_like(score, float("-inf")))


def node_edge_scores(tree, drafted):
    """float64 [b, N]: the draft log-probability ``log q(v | parent)`` of the edge into each node
    (root and padded nodes 0), temperature 1, as the builders read it.

    Args:
        tree: the round's :class:`~sglang_tev.tree.DraftTree` (nodes in pop order).
        drafted: what the tree was built from: draft logits float [b, H, V] (row j = depth j + 1,
            marginal mode); the per-depth top-k lists ``(logq float [b, H, k], ids int64 [b, H, k])``
            with ``logq`` normalised over the vocabulary (the SGLang worker's marginal mode); or a
            :class:`~sglang_tev.draft.dflash2.SelectorLattice`
            (``candidate_ids`` [b, D, k], ``transition_logq`` [b, D, k, k]: a node's edge is read
            from the transition row of its parent's candidate, slot 0 from row 0).
    """
    import torch

    b, n = tree.parents.shape
    dev = tree.parents.device
    depth = tree.depth
    real = tree.valid.clone()
    real[:, 0] = False
    d0 = (depth - 1).clamp(min=0)
    if hasattr(drafted, "transition_logq"):
        ids, trans = drafted.candidate_ids, drafted.transition_logq.to(torch.float64)
        D, k = ids.shape[1], ids.shape[2]
        d0 = d0.clamp(max=D - 1)
        cand_rows = ids.gather(1, d0.unsqueeze(-1).expand(b, n, k))  # [b, N, k]: the node's slot's candidates
        cidx = (cand_rows == tree.tokens.unsqueeze(-1)).to(torch.int64).argmax(-1)  # [b, N]
        pc = cidx.gather(1, tree.parents.clamp(min=0))
        pc = torch.where(depth <= 1, torch.zeros_like(pc), pc)  # slot 0's law is row 0
        flat = ((d0 * k + pc) * k + cidx)
        edge = trans.reshape(b, -1).gather(1, flat)
    elif isinstance(drafted, tuple):
        logq, ids = drafted
        H, k = ids.shape[1], ids.shape[2]
        d0 = d0.clamp(max=H - 1)
        cand = ids.gather(1, d0.unsqueeze(-1).expand(b, n, k))  # [b, N, k]: the node's depth's list
        hit = cand == tree.tokens.unsqueeze(-1)
        lq = logq.to(torch.float64).gather(1, d0.unsqueeze(-1).expand(b, n, k))
        edge = torch.where(hit, lq, torch.zeros_like(lq)).sum(-1)  # a listed token appears once per depth
    else:
        logits = drafted.to(torch.float32)
        H = logits.shape[1]
        d0 = d0.clamp(max=H - 1)
        lse = torch.logsumexp(logits, -1).to(torch.float64)  # [b, H]
        at = logits.gather(2, tree.tokens.unsqueeze(1).expand(b, H, n)).to(torch.float64)  # [b, H, N]
        edge = at.gather(1, d0.unsqueeze(1)).squeeze(1) - lse.gather(1, d0)
    return torch.where(real, edge, torch.zeros_like(edge)).to(dev)
