"""The budget controller's choices, pinned: fixed synthetic observation sequences (seeded noise in
the round times and coverages, several batch sizes, busy minutes, a drifting acceptance, regime
flips, a frozen table) fed through ``choose`` / ``observe``, and every choice compared with the
one the controller made when this harness was written (before its per-batch state was cut into
:class:`~sglang_tev.autobudget.BatchSizeState`). Any change in a choice, a trial or a learned
gain fails here; change the expectations only with a change meant to alter the choices.
Re-recorded once since (2026-12-06): a tree's cost lent from another batch size became the lender's
ratio to its plain round times this batch size's plain round; in these scenarios' own cost models
that moved the tokens per second of the chosen plans by -0.2 % to +1.4 % (seeds 0-4); a batch size
with no plain round of its own measures the lent tree against its lent plain round. Re-recorded
again (2026-12-06, later): while plain decoding wins, the across and up probes skip trees whose
probe would lose more than ``stale_loss`` (4) times the best tree's; tokens per second of the
chosen plans moved -1.1 % to +0.6 % (trial_fails -0.6 to -1.1 %: free probes of the budget the
fast bursts made look cheap re-time it, and 3 trials fail instead of 5; frozen -0.1 %; the others
0, seeds 0-4). And with it a gain step observed after a gap of g rounds takes weight
``1 - (1 - alpha) ** g`` (at most ``stale_weight``, 0.5) instead of ``alpha``; both together, against
the choices before: cpu_default -1.4 % to +1.3 %, regime_flips -3.4 % to +2.4 %, trial_fails -1.7 %
to +0.2 %, interleaved -0.3 % to +0.5 %, frozen -0.1 %, no_plain 0 (seeds 0-4; in these cost models
acceptance does not drift within a stretch, so fresher probe gains buy nothing here; the runtime
case they are for is ``tests/runtime/test_autobudget.py``). Then across probes were charged the
measured price of the switches they cause (the first round after a switch, beyond its budget's
round); in these models a switch costs nothing but the noise's 3x bursts, and against the
session's start the three changes together moved cpu_default -2.9 % to +1.9 % (mean -0.7 %),
regime_flips -4.4 % to +2.7 % (mean -0.3 %), trial_fails -0.1 % to +1.3 %, interleaved -0.9 % to
+0.7 %, frozen -0.1 %, no_plain 0. A switch's price was then capped at 2 rounds (a noise burst on a
switch round had made regime_flips seed 4 miss a flip): regime_flips -3.5 % to +4.6 % (mean
+1.8 %) against the session's start, the others as before. Re-recorded (2026-12-07): costs
timed cold (a pair's first round here, the table's first 32 rounds) or restored are provisional,
leave the fit once two tree budgets are settled, and the cost probe re-times them first; tokens per
second of the chosen plans, seeds 0-4: cpu_default -1.4 % to +1.0 % (mean -0.3 %), regime_flips
-3.5 % to +5.7 % (+0.6 %), trial_fails -0.1 % to +0.7 % (+0.3 %), interleaved and frozen 0,
no_plain -3.9 % to -0.4 % (-1.3 %: its 300 rounds pay the re-timing of its 32 warm-up rounds'
costs; these models have no cold rounds, so the re-timing buys nothing here; the case it is for
is ``tests/core/test_cost_provisional.py``). Re-recorded (2026-12-07, later): a plain round is read
no higher than the cheapest tree's fitted cost at its batch size, its own or lent (a stalled plain round had
kept plain decoding out for good); seeds 0-4: cpu_default -1.7 % to 0 (mean -0.3 %), regime_flips
-0.9 % to +3.9 % (+1.1 %), trial_fails -0.7 % to +0.2 % (-0.2 %), interleaved 0 to +0.2 % (0),
frozen and no_plain 0. Re-recorded (2026-12-08): the cost fit is convex as well as non-decreasing
in the budget (least squares over hinge functions; the isotonic fit before it); seeds 0-4 against the
choices before: cpu_default -2.0 % to +1.8 % (mean -0.2 %; its cost model is linear in the budget, so
both fits read it alike and the choices move only where the 3x bursts fall), regime_flips, no_plain
-0.1 % to 0, trial_fails, interleaved and frozen 0 (their choices unchanged).

Torch-free: the controller is host code."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from sglang_tev.autobudget import DEFAULT_GRID, BudgetController, CostTable


def _coverage(rng: random.Random, upto: list[int], level: float, rows: int) -> list[list[float]]:
    """Per row, a noisy non-decreasing cumulative coverage over the sub-budgets ``upto``."""
    out = []
    for _ in range(rows):
        acc, row = 0.0, []
        for b in upto:
            acc = max(acc, level * (1 - math.exp(-b / 12.0)) * rng.uniform(0.6, 1.4))
            row.append(round(acc, 6))
        out.append(row)
    return out


def simulate(ctl: BudgetController, seed: int, rounds: int, schedule, seconds, level, nan_every: int = 0,
             inject=None):
    """``rounds`` choose / observe pairs; returns the controller (its history, trials, gains).
    ``inject(t)``: ``(batch, budget, seconds)`` rounds observed before round t's choice (rounds
    the controller did not choose: a burst the table sees)."""
    rng = random.Random(seed)
    for t in range(rounds):
        batch = schedule(t)
        for ib, ibudget, isec in inject(t) if inject else ():
            ctl.observe(ib, ibudget, _coverage(rng, ctl.grid_upto(ibudget), level(t), ib) if ibudget else None, isec)
        b = ctl.choose(batch)
        s = seconds(t, batch, b) * rng.uniform(0.92, 1.08)
        if rng.random() < 0.03:
            s *= 3.0  # a neighbour's burst
        if nan_every and t % nan_every == nan_every - 1:
            s = float("nan")  # not a time: the table ignores it
        rows = _coverage(rng, ctl.grid_upto(b), level(t), batch) if b else None
        ctl.observe(batch, b, rows, s)
    return ctl


def _stretches(*parts):
    """A schedule of batch sizes in stretches ``(batch, rounds), ...``, repeated."""
    seq = [b for b, n in parts for _ in range(n)]
    return lambda t: seq[t % len(seq)]


def _cpu(t, batch, b):
    """Every node costs (a CPU); a busy minute at rounds 200-280 runs everything 2x slower."""
    s = 0.010 * batch ** 0.5 * (1 + 0.012 * b) + (0.002 if b else 0.0)
    return s * (2.0 if 200 <= t < 280 else 1.0)


def _flip(t, batch, b):
    """Trees lose, then (rounds 250-500 and 650-) win by far, then lose again."""
    if b == 0:
        return 0.010 * batch
    return 0.010 * batch * ((1.05 + 0.0004 * b) if 250 <= t < 500 or t >= 650 else (1.8 + 0.004 * b))


def _slow_trees(t, batch, b):
    """Trees cost 2.5x plain decoding and more."""
    return 0.010 * batch * ((2.5 + 0.01 * b) if b else 1.0)


def _fast_bursts(t):
    """Every 150 rounds from round 40, twelve budget-8 rounds at batch 1 timed 2.5x faster than
    they run: the switch they suggest fails its trial (and the next ones, waiting longer each)."""
    return [(1, 8, 0.0105)] * 12 if t % 150 == 40 and t < 400 else []


def _gpu(t, batch, b):
    """Flat up to 16 nodes a row, then rising (a GPU); plain decoding nearly a tree's cost."""
    return 0.008 * (1 + 0.05 * batch) * (1.0 + max(0, b * batch - 16) * 0.004) + (0.001 if b else 0.0)


SCENARIOS = {
    # name: (controller factory, rounds, schedule, seconds, acceptance level, nan_every[, inject])
    "cpu_default": (lambda: BudgetController(DEFAULT_GRID, CostTable()), 700,
                    _stretches((1, 150), (4, 100), (2, 80), (8, 70), (1, 100)), _cpu,
                    lambda t: 2.5 if t < 350 else 1.0, 0),
    "regime_flips": (lambda: BudgetController((0, 4, 16, 64), CostTable(), explore_share=0.05, min_gap=4,
                                              trial_rounds=3), 800, _stretches((1, 400), (2, 400)), _flip,
                     lambda t: 1.0, 97),
    "trial_fails": (lambda: BudgetController((0, 8, 32), CostTable(), explore_share=0.02, min_gap=3), 900,
                    _stretches((1, 600), (3, 300)), _slow_trees, lambda t: 1.6, 0, _fast_bursts),
    "interleaved": (lambda: BudgetController((0, 2, 8, 32), CostTable(window=7), explore_share=0.02, margin=0.0,
                                             regime_margin=0.2, alpha=0.2), 600,
                    lambda t: (1, 2, 1, 3)[t % 4], _gpu, lambda t: 1.5 + math.sin(t / 60.0), 0),
    "frozen": (lambda: BudgetController(DEFAULT_GRID, CostTable.from_json(
        {"seconds": {"1": {"0": 0.010, "4": 0.013, "16": 0.016, "64": 0.040}, "4": {"0": 0.020, "16": 0.050}}})), 300,
               _stretches((1, 50), (3, 50), (4, 50)), _gpu, lambda t: 2.0 if t < 150 else 0.4, 0),
    "no_plain": (lambda: BudgetController((2, 6, 12), CostTable(load_correction=False), explore_share=0.1,
                                          min_gap=2), 300, _stretches((2, 60), (1, 30)), _cpu, lambda t: 1.2, 0,
                 lambda t: [(2, 2, 0.02)] if t == 0 else []),  # a first round of 2 only: no gain above it yet
}


def _rle(history) -> str:
    """``batch:budget*count`` runs, space separated."""
    out, prev, n = [], None, 0
    for h in history:
        if h == prev:
            n += 1
            continue
        if prev is not None:
            out.append(f"{prev[0]}:{prev[1]}" + (f"*{n}" if n > 1 else ""))
        prev, n = h, 1
    if prev is not None:
        out.append(f"{prev[0]}:{prev[1]}" + (f"*{n}" if n > 1 else ""))
    return " ".join(out)


def run(name: str, seed: int = 0) -> dict:
    """One scenario's record: the choices (run-length coded), the trials, the gains (rounded),
    a digest of all three."""
    make, rounds, schedule, seconds, level, nan_every, *inject = SCENARIOS[name]
    ctl = simulate(make(), seed, rounds, schedule, seconds, level, nan_every, *inject)
    rec = {"choices": _rle(ctl.history), "trials": list(ctl.trials),
           "gain": {b: round(g, 9) for b, g in sorted(ctl.gain.items())}}
    rec["digest"] = hashlib.sha256(repr(rec).encode()).hexdigest()[:16]
    return rec


EXPECTED: dict[str, dict] = {  # seed 0; re-recorded when a tree's cost lent across batch sizes became a ratio to plain
    "cpu_default": {
        "choices": (
            "1:64 1:0*2 1:24*20 1:32 1:24*126 4:24*6 4:0*2 4:32*5 4:24*6 4:16 4:24*5 4:32 4:24*29 4:32*24 4:16*6 "
            "4:8*6 4:24*9 2:0*2 2:32*11 2:24 2:32*5 2:48 2:32*11 2:0*2 2:32*17 2:24 2:32*5 2:0*2 2:64*22 8:0*2 "
            "8:24*68 1:24*5 1:64 1:32*5 1:48 1:32*5 1:0*2 1:32*5 1:24 1:32*5 1:48 1:32*5 1:0*2 1:32*5 1:24 1:32*5 "
            "1:48 1:32*113 1:0*2 1:32*5 1:24 1:32*5 1:48 1:32*73 4:24*3 4:0*47"
        ),
        "trials": [(4, 24, 0, True)],
        "gain": {2: 0.14659628, 4: 0.290837824, 8: 0.47054017, 16: 0.698882713, 24: 0.887132971, 32: 0.998856668,
                 48: 1.128609413, 64: 1.176173045},
        "digest": "1bd6fa9895cb9585",
    },
    "regime_flips": {
        "choices": (
            "1:64 1:0*2 1:16*2 1:0*4 1:64*2 1:0*3 1:16*2 1:0*3 1:64*2 1:0*7 1:16*2 1:0*3 1:64*2 1:0*7 1:64*2 "
            "1:0*7 1:16*2 1:0*3 1:64*2 1:0*11 1:64*2 1:0*7 1:64*2 1:0*3 1:16*2 1:0*3 1:64*2 1:0*7 1:16*2 1:0*27 "
            "1:64*2 1:0*27 1:16*2 1:0*11 1:64*2 1:0*11 1:64*3 1:0*2 1:64*3 1:16 1:64*3 1:0*2 1:64*3 1:0*2 1:64*3 "
            "1:16 1:64*3 1:0*2 1:64*3 1:0*2 1:64*3 1:16 1:64*3 1:0*2 1:64*3 1:0*2 1:64*3 1:16 1:64*3 1:0*2 1:64*3 "
            "1:0*2 1:64*3 1:16 1:64*3 1:0*2 1:64*3 1:0*2 1:64*3 1:16 1:64*3 1:0*2 1:64*3 1:0*2 1:64*3 1:16 1:64*3 "
            "1:0*2 1:64*3 1:0*2 1:64*3 1:16 1:64*3 1:0*2 1:64*3 1:0*2 1:64*3 1:16 1:64*3 1:0*2 1:64*3 1:0*2 "
            "1:64*3 1:16 1:64*19 1:0*2 1:64*27 1:0*2 1:64*3 1:16 1:64*23 1:0*2 1:64*5 2:64*4 2:16*4 2:0*2 2:64*3 "
            "2:16 2:64*19 2:0*2 2:64*19 2:0*2 2:64*3 2:16 2:64*15 2:0*2 2:64*15 2:0*2 2:64*3 2:16 2:64*15 2:0*2 "
            "2:64*19 2:0*2 2:64*3 2:16 2:64*8 2:16*7 2:0*2 2:64*3 2:16 2:64*4 2:16*3 2:0*2 2:16*3 2:4 2:16*3 2:64 "
            "2:16*3 2:0*2 2:64*3 2:4 2:64*3 2:0*2 2:64*3 2:0*2 2:64*3 2:16 2:64*3 2:0*2 2:64*3 2:0*2 2:64*3 2:16 "
            "2:64*3 2:0*2 2:64*3 2:0*2 2:64*3 2:16 2:64*3 2:0*2 2:64*3 2:0*2 2:64*3 2:16 2:64*3 2:0*2 2:64*3 "
            "2:0*2 2:64*3 2:16 2:64*3 2:0*2 2:64*3 2:0*2 2:64*3 2:16 2:64*3 2:0*2 2:64*3 2:0*2 2:64*3 2:16 2:64*3 "
            "2:0*2 2:64*3 2:0*2 2:64*3 2:16 2:64*3 2:0*2 2:64*3 2:0*2 2:64*3 2:16 2:64*3 2:0*2 2:64*3 2:0*2 "
            "2:64*3 2:16 2:64*3 2:0*2 2:64*11 2:0*2 2:64*3 2:16 2:64*23 2:0*2 2:64*19 2:0*2 2:64*3 2:16 2:64"
        ),
        "trials": [(1, 0, 64, True)],
        "gain": {4: 0.291037156, 16: 0.750634398, 64: 0.996237914},
        "digest": "9b93af742dd60475",
    },
    "trial_fails": {
        "choices": (
            "1:32 1:0*2 1:8*2 1:0*36 1:8*5 1:0*3 1:8*2 1:0*2 1:8*2 1:0*20 1:8*2 1:0*2 1:8*5 1:0*108 1:8*5 1:0*12 "
            "1:8*2 1:0*53 1:32*2 1:0*59 1:8*5 1:0*45 1:32*2 1:0*152 1:32*2 1:0*56 1:8*5 1:0*8 3:0*2 3:8*2 "
            "3:0*138 3:8*2 3:0*122 3:8*2 3:0*32"
        ),
        "trials": [(1, 0, 8, False), (1, 0, 8, False), (1, 0, 8, False), (1, 0, 8, False), (1, 0, 8, False)],
        "gain": {8: 0.744228243, 32: 1.764289043},
        "digest": "2bf7a77e9244f0e4",
    },
    "interleaved": {
        "choices": (
            "1:32 2:0 1:8 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:0 2:32 1:0 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:8 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:0 3:32 1:0 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:0 2:32 1:0 3:32 1:32 2:32 1:32 3:32 1:32 2:8 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:0 3:32 1:0 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 "
            "1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:8 1:32 2:32 1:32 3:8 "
            "1:32 2:32 1:32 3:8 1:8 2:32 1:32 3:8 1:32 2:32 1:32 3:8 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:8 1:32 "
            "2:32 1:32 3:8 1:32 2:32 1:32 3:8 1:0 2:32 1:0 3:8 1:32 2:8 1:32 3:8 1:32 2:8 1:32 3:2 1:32 2:8 1:32 "
            "3:8 1:32 2:8 1:32 3:8 1:32 2:8 1:32 3:8 1:32 2:8 1:0 3:8 1:0 2:8 1:32 3:8 1:32 2:8 1:32 3:0 1:32 "
            "2:8 1:32 3:0 1:32 2:8 1:32 3:8 1:32 2:8 1:32 3:8 1:32 2:8 1:32 3:8 1:8 2:32 1:32 3:8 1:32 2:32 1:32 "
            "3:8 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:0 1:32 2:32 1:32 "
            "3:32 1:8 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:0 2:32 1:0 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:0 "
            "3:32 1:0 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:8 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:0 1:32 2:32 1:32 3:0 1:32 2:32 1:32 "
            "3:32 1:32 2:32 1:32 3:32 1:32 2:32 1:32 3:32 1:8 2:32 1:32 3:32"
        ),
        "trials": [],
        "gain": {2: 0.156100407, 8: 0.489874398, 32: 0.976619823},
        "digest": "d17661e70aa935f8",
    },
    "frozen": {
        "choices": (
            "1:64 1:16*49 3:4*50 4:4*50 1:16*35 1:4*2 1:0*5 1:4*2 1:0*5 1:4 3:4*4 3:0*6 3:4*2 3:0*5 3:4*2 3:0*31 "
            "4:4*4 4:0*6 4:4*2 4:0*38"
        ),
        "trials": [],
        "gain": {2: 0.064157184, 4: 0.128738873, 8: 0.241936989, 16: 0.389838803, 24: 1.150997803, 32: 1.150997803,
                  48: 1.150997803, 64: 1.152154803},
        "digest": "4b49610b175daea0",
    },
    "no_plain": {
        "choices": (
            "2:12*5 2:2 2:12 2:2 2:12 2:2 2:12*3 2:2 2:12 2:2 2:12 2:2 2:12 2:2 2:12*3 2:2 2:12 2:2 2:12*3 2:2 "
            "2:12 2:2 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 "
            "2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 1:12*2 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 "
            "1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 2:12 2:6 2:12 2:6 2:12 2:6 2:12 "
            "2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 "
            "2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 "
            "2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 1:12*2 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 "
            "1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 2:12 2:6 2:12 2:6 2:12 2:6 "
            "2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 "
            "2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:2 2:6 2:2 2:6*2 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 "
            "2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 1:12*2 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 "
            "1:2 1:6 1:2 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 1:6 1:12 2:12 2:6 2:12 2:6 2:12 2:6 "
            "2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 2:12 2:6 "
            "2:12 2:6"
        ),
        "trials": [],
        "gain": {2: 0.190269696, 6: 0.489319478, 12: 0.722787694},
        "digest": "3109a2551036531b",
    },
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_makes_the_recorded_choices(name):
    want = EXPECTED[name]
    got = run(name)
    assert got["choices"] == want["choices"]
    assert got["trials"] == want["trials"]
    assert got["gain"] == pytest.approx(want["gain"], abs=1e-9)
    assert got["digest"] == want["digest"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_digests_over_more_seeds(name):
    """Seeds 1-4 of each scenario: only the digest of choices, trials and gains is pinned."""
    assert [run(name, s)["digest"] for s in range(1, 5)] == DIGESTS[name]


DIGESTS: dict[str, list[str]] = {  # seeds 1-4, recorded with EXPECTED
    "cpu_default": ["f4e1bc2dc915335e", "7873e911cc3c5d88", "829d1023d6e8248c", "51deef3a573f3f35"],
    "regime_flips": ["f6c3c4b8c29b34e9", "194651c0137ca183", "50d5631b23dc415a", "53bad504d8a2aeb6"],
    "trial_fails": ["ebf2040969da7867", "6056f5f9dcaf92cd", "be784614a8c9bd64", "747346cc43d1fd54"],
    "interleaved": ["1a205125fefa771e", "2aceeb040f4330ec", "0e2d0a03d3e2f786", "5b46a3d387541e98"],
    "frozen": ["3adb7c606e32ed01", "f6c6053e4dc04a09", "f9bf84820286cb0b", "2b1aec5d71119766"],
    "no_plain": ["48e16dc67ad091e4", "15fffe7a84ef935d", "ac3d7282f6a8cd3e", "d652b187ce8265b9"],
}
