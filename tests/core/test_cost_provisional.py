"""Provisional costs (:meth:`sglang_tev.costs.CostTable.provisional`): a pair's first round in a
process, the table's first rounds and costs restored from another process's plan cache are not
what a round costs now; they stay out of the cost fit once two tree budgets are settled, and the
controller's cost probes re-time them. Torch-free: host code only."""

from __future__ import annotations

import math

import pytest

from sglang_tev.autobudget import BudgetController, CostTable


def _restored(seconds: dict[int, float], counts: int = 15, batch: int = 1) -> CostTable:
    """A table as a plan cache restores it: another process's medians, re-timed here."""
    return CostTable.from_json({"seconds": {str(batch): {str(b): s for b, s in seconds.items()}},
                                "counts": {str(batch): {str(b): counts for b in seconds}}}, frozen=False)


def test_a_pair_settles_on_its_second_round_here_after_the_warmup_and_drops_what_came_before():
    t = CostTable(warmup=4, load_correction=False)
    t.record(1, 8, 0.050)  # the pair's first round (allocates)
    assert t.provisional(1, 8) and t.cost(1, 8) == 0.050
    t.record(1, 8, 0.030)  # in the warm-up: still provisional (the first round went: a shape's rule)
    t.record(1, 8, 0.028)
    t.record(1, 0, 0.010)
    assert t.stamp == 4 and t.provisional(1, 8) and t.cost(1, 8) == pytest.approx(0.029)
    t.record(1, 8, 0.020)  # the first settled round: the warm-up's go
    assert not t.provisional(1, 8) and t.cost(1, 8) == 0.020
    t.record(1, 8, 0.022)
    assert t.cost(1, 8) == pytest.approx(0.021)  # then the median as before
    assert t.provisional(1, 0)  # plain decoding's one round is still cold
    assert not t.provisional(1, 16)  # no cost at all is not a provisional one


def test_restored_costs_are_provisional_until_re_timed_here_tuned_ones_never():
    t = _restored({0: 0.009, 16: 0.036, 32: 0.0205})
    assert all(t.provisional(1, b) for b in (0, 16, 32)) and t.warmup == 32
    t.stamp = 40  # past the warm-up
    t.record(1, 32, 0.030)  # its first round here replaces the restored median ...
    assert t.provisional(1, 32) and t.seconds[1][32] == 0.030
    t.record(1, 32, 0.019)  # ... and its second settles it
    assert not t.provisional(1, 32) and t.seconds[1][32] == 0.019
    frozen = CostTable.from_json({"seconds": {"1": {"0": 0.009, "16": 0.036}}})
    assert frozen.frozen and not frozen.provisional(1, 16) and not frozen.provisional(1, 0)
    tuned = CostTable()
    tuned.set(1, 16, 0.02)
    assert not tuned.provisional(1, 16)


def test_the_fit_reads_settled_costs_only_once_two_tree_budgets_are_settled():
    # a restored table whose small budgets were timed cold: the monotone fit pools them with the
    # larger ones into one flat cost (the CPU server's plan cache of 2026-12-07)
    t = _restored({0: 0.0094, 8: 0.0447, 16: 0.0362, 24: 0.0214, 32: 0.0205, 48: 0.0203, 64: 0.0209})
    flat = [t.cost(1, b) for b in (8, 16, 32, 64)]
    assert max(flat) - min(flat) < 1e-12  # one pooled cost
    t.stamp = 40
    for b, s in ((64, 0.0232), (64, 0.0232), (48, 0.0216), (48, 0.0216)):
        t.record(1, b, s)
    assert not t.provisional(1, 64) and not t.provisional(1, 48) and t.provisional(1, 32)
    # now 32, 24, 16, 8 are read through the settled costs: 1 us a node below 48, not below plain
    assert t.cost(1, 32) == pytest.approx(0.0200) and t.cost(1, 16) == pytest.approx(0.0184)
    assert t.cost(1, 0) == 0.0094 and t.cost(1, 8) == pytest.approx(0.0176)
    # one settled tree budget is not a fit: the restored ones stay in it until a second settles
    u = _restored({0: 0.0094, 16: 0.0362, 32: 0.0205})
    u.stamp = 40
    u.record(1, 32, 0.019)
    u.record(1, 32, 0.019)
    assert u.cost(1, 16) > 0.019  # pooled with the cold 16


def _true_cost(b: int) -> float:
    """A CPU: a plain round 10 ms, a tree round 17 ms plus 0.1 ms a node."""
    return 0.010 if b == 0 else 0.017 + 0.0001 * b


def _coverage(b: int) -> float:
    return 2.5 * (1 - math.exp(-b / 12.0))


def _serve(ctl: BudgetController, rounds: int) -> list[int]:
    picks = []
    for _ in range(rounds):
        b = ctl.choose(1)
        picks.append(b)
        cum = [[_coverage(g) for g in ctl.grid_upto(b)]] if b else None
        ctl.observe(1, b, cum, _true_cost(b))
    return picks


def test_a_process_restoring_a_cold_table_re_times_it_and_finds_the_best_tree():
    """The case measured on the CPU server: a plan cache whose small trees were timed cold (and on
    a slower minute) reads flat, so the largest tree wins where the true best is 32 nodes (rates
    per ms: 16: 0.153, 24: 0.163, 32: 0.165, 48: 0.158, 64: 0.149). The cost probes re-time the
    provisional costs and the choice moves to 32."""
    grid = (0, 2, 4, 8, 16, 24, 32, 48, 64)
    rates = {b: (1 + (_coverage(b) if b else 0)) / _true_cost(b) for b in grid}
    assert max(rates, key=rates.get) == 32
    table = _restored({0: 0.0094, 2: 0.031, 4: 0.029, 8: 0.0447, 16: 0.0362, 24: 0.0214, 32: 0.0205, 48: 0.0203,
                       64: 0.0209})
    ctl = BudgetController(grid, table)
    ctl.gain.update({b: _coverage(b) for b in grid if b})  # the restored gains (exact here)
    ctl._inc.update({b: _coverage(b) - _coverage(p) for p, b in zip(grid, grid[1:]) if b})
    picks = _serve(ctl, 1500)
    assert picks[:5] == [64] * 5  # the restored table's choice
    assert picks[-300:].count(32) >= 270
    # what was re-timed here: every tree the cost probes could afford, 32's neighbours first
    assert not any(table.provisional(1, b) for b in (16, 24, 32, 48, 64))


def test_the_cost_probe_re_times_the_cheapest_provisional_tree_first():
    table = _restored({0: 0.0094, 8: 0.0447, 16: 0.0362, 32: 0.0205, 64: 0.0209})
    ctl = BudgetController((0, 8, 16, 32, 64), table)
    ctl.gain.update({8: 1.2, 16: 1.8, 32: 2.3, 64: 2.5})
    table.stamp = 40
    for b, s in ((64, 0.0232), (64, 0.0232), (32, 0.0200), (32, 0.0200)):
        table.record(1, b, s)
    # choice 32 (rate 0.165 against 64's 0.151): up 64 (settled), across plain, down the
    # provisional 16 (read at 17.6 ms through the fit) before its neighbour below would be
    assert ctl.best(1) == 32 and ctl.probe_kinds(1, 32) == (64, 0, 16)
    table.record(1, 16, 0.0184)
    table.record(1, 16, 0.0184)
    assert ctl.probe_kinds(1, 32) == (64, 0, 8)  # then 8 (its probe loses more)
    table.record(1, 8, 0.0176)
    table.record(1, 8, 0.0176)
    assert ctl.probe_kinds(1, 32) == (64, 0, 16)  # none left: the next smaller tree again
    # a provisional tree whose probe would lose more than stale_loss x 2 x regime_margin of the
    # choice's round is not re-timed by the cost probe
    strict = BudgetController((0, 8, 16, 32, 64), table, stale_loss=1.0)
    table._settled.discard((1, 8))
    assert strict.probe_kinds(1, 32)[2] == 16


def test_a_restored_pairs_first_round_here_is_dropped_when_its_second_arrives():
    """(Review 2026-12-07) the shape rule read the counts, which carry the restored ones."""
    t = CostTable.from_json({"seconds": {"1": {"8": 0.012, "16": 0.014}}, "counts": {"1": {"8": 120, "16": 40}}},
                            frozen=False)
    t.record(1, 8, 0.5)  # its first round here: allocates
    t.record(1, 8, 0.012)
    assert t.seconds[1][8] == 0.012 and t.counts[1][8] == 122


def test_a_stalled_plain_round_cannot_keep_plain_decoding_out():
    """The one plain round calibration times is the cost of plain decoding until an across probe
    re-times it, and the probe is priced from that cost. A stalled round (here 0.5 s against
    10 ms) read as is priced the probe out of the allowance for good (measured: batch 1's plain
    round read 63 ms from cold rounds, every batch size borrowed it, and batch 8 at T = 1 ran
    3,000 tree rounds at 0.57x plain decoding). A plain round is read no higher than the cheapest
    tree's (a tree round runs a plain round's forward and a draft), so the probe runs, re-times
    it, and plain decoding wins."""
    grid = (0, 2, 4, 8, 16, 32, 64)
    table = CostTable(load_correction=False)
    ctl = BudgetController(grid, table)

    def seconds(b: int) -> float:
        return 0.010 if b == 0 else 0.020 + 0.0002 * b

    plain_rounds, picks = 0, []
    for _ in range(3000):
        b = ctl.choose(8)
        picks.append(b)
        s = seconds(b)
        if b == 0:
            plain_rounds += 1
            if plain_rounds == 2:  # calibration's timed plain round (the first one is a switch round)
                s = 0.5
        cum = [[0.5 * (1 - math.exp(-g / 4.0)) for g in ctl.grid_upto(b)] for _ in range(8)] if b else None
        ctl.observe(8, b, cum, s)
    assert table.seconds[8][0] < 0.02  # re-timed: the stall is gone from the median
    assert picks[-1000:].count(0) >= 950


def test_a_plain_round_is_read_no_higher_than_the_cheapest_tree():
    t = CostTable(load_correction=False)
    t.record(4, 0, 0.300)  # stalled
    assert t.cost(4, 0) == 0.300  # no tree timed: as measured
    t.record(4, 16, 0.030)
    t.record(4, 64, 0.050)
    assert t.cost(4, 0) == pytest.approx(0.030)
    assert t.cost(4, 4) == pytest.approx(0.030)  # below the smallest tree: not below plain (capped too)
    u = CostTable(load_correction=False)
    u.record(4, 0, 0.010)
    u.record(4, 16, 0.030)
    assert u.cost(4, 0) == 0.010  # a plain round below the trees is read as measured
    # a plain round lent from another batch size (the case measured: batch 1's plain read 63 ms from
    # three cold rounds, trees 10-15 ms, and every other batch size borrowed it)
    v = CostTable(load_correction=False)
    v.record(1, 0, 0.063)
    v.record(1, 8, 0.010)
    v.record(1, 16, 0.0116)
    v.record(8, 8, 0.0277)
    assert v.cost(1, 0) == pytest.approx(0.010)  # the lender's own, capped
    assert v.cost(8, 0) == pytest.approx(0.010)  # lent, and no higher than batch 8's trees
    w = CostTable(load_correction=False)
    w.record(1, 0, 0.063)
    w.record(8, 8, 0.0277)
    assert w.cost(8, 0) == pytest.approx(0.0277)  # the lender has no tree: capped by the borrower's
    # a batch size with neither (a shrinking batch): plain lent from batch 1, trees from batch 8
    # (unscaled: batch 8 has no plain round): plain is read no higher than those trees (a review's case)
    x = CostTable.from_json({"seconds": {"1": {"0": 0.063, "16": 0.05}, "8": {"16": 0.02, "32": 0.025}}})
    for b in (6, 7, 8):
        assert x.cost(b, 0) <= x.cost(b, 16) == pytest.approx(0.02), b
    assert x.cost(1, 0) == pytest.approx(0.05)  # its own tree
    # with plain rounds on both sides the lent trees are scaled by them: no floor, plain as lent
    y = CostTable.from_json({"seconds": {"1": {"0": 0.006, "16": 0.010}, "8": {"0": 0.011}}})
    assert y.cost(8, 0) == pytest.approx(0.011) and y.cost(8, 16) == pytest.approx(0.011 * 0.010 / 0.006)


def test_a_restored_tree_cost_from_one_cold_round_is_timed_again():
    """A fresh-user review's case: one run on a busy machine left the plan cache with every tree
    timed once, 10-50x plain decoding (plain itself re-timed over 749 rounds), and every later
    process ran plain decoding only: no across probe could pay to re-time a tree that costly. Tree
    costs timed in fewer than RESTORED_MIN_ROUNDS rounds are left out of a restored table, so the
    next process times them again and runs the trees that win."""
    from sglang_tev.costs import RESTORED_MIN_ROUNDS

    data = {"seconds": {"1": {"0": 0.0100, "16": 0.26, "24": 0.088, "64": 0.135}},
            "counts": {"1": {"0": 749, "16": 1, "24": 1, "64": 1}}}
    grid = (0, 2, 4, 8, 16, 24, 32, 48, 64)
    restored = CostTable.from_json(data, frozen=False)
    assert restored.seconds == {1: {0: 0.0100}} and RESTORED_MIN_ROUNDS == 3
    picks = _serve(BudgetController(grid, restored), 600)
    assert picks[-200:].count(0) <= 20  # the trees win here (32 nodes: ~1.7x plain's rate)
    kept = CostTable.from_json(data, frozen=True)  # a tuned table is read as it is
    assert kept.seconds[1][16] == 0.26
    data["counts"]["1"]["24"] = 3  # timed in enough rounds: restored
    assert 24 in CostTable.from_json(data, frozen=False).seconds[1]
