"""``budget="auto"`` (issue 29): the sub-budget gains a verified round reports, the budget
controller, the cost table, the runtime under changing budgets (greedy = plain decoding, the
sampled law by chi-square), the drafter's deferred context, and the CLI / bench surface."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from sglang_tev.draft.ddtree import build_ddtree
from sglang_tev.draft.lattice import build_lattice_tree
from sglang_tev.autobudget import SWITCH_CAP, DEFAULT_GRID, BatchSizeState, BudgetController, CostTable, Trial
from sglang_tev.hf.runtime import SpeculativeGenerator
from sglang_tev.sampling import SamplingParams, processed_probs
from sglang_tev.tree import DraftTree, exit_law
from sglang_tev.verify import verify_tree

from sglang_tev.testing.drafters import OracleDrafter
from sglang_tev.testing.exact_law import chi_square_pvalue
from sglang_tev.testing.models import V, plain_greedy, qwen3
from runtime_helpers import FixedDrafter


# ------------------------------------------------------------------- the gains of sub-budgets
def _first(tree: DraftTree, k: int) -> DraftTree:
    """The tree's first k non-root nodes (pop order), the rest padding."""
    valid = tree.valid.clone()
    valid[:, k + 1:] = False
    parents = torch.where(valid, tree.parents, 0)
    parents[:, 0] = -1
    return DraftTree.from_parents(parents, tree.tokens, valid, validate=False)


def test_the_first_nodes_of_a_best_first_tree_are_the_smaller_budget_tree():
    """What makes one round's exit law give every smaller budget's gain (DDTree and lattice DDTree)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 20, generator=g) * 2
    roots = torch.tensor([1, 2, 3])
    big = build_ddtree(logits, 40, roots)
    for k in (1, 3, 8, 17):
        small = build_ddtree(logits, k, roots)
        assert torch.equal(small.parents, big.parents[:, : k + 1]) and torch.equal(small.tokens, big.tokens[:, : k + 1])
    cand = torch.stack([torch.randperm(20, generator=g)[:5] for _ in range(3 * 6)]).view(3, 6, 5)
    trans = torch.log_softmax(torch.randn(3, 6, 5, 5, generator=g) * 2, -1)
    big = build_lattice_tree(cand, trans, 30, roots)
    for k in (2, 9):
        small = build_lattice_tree(cand, trans, k, roots)
        assert torch.equal(small.parents, big.parents[:, : k + 1]) and torch.equal(small.tokens, big.tokens[:, : k + 1])


@pytest.mark.parametrize("method,temperature", [("tev", 1.0), ("predraw", 0.7), ("sequential", 1.3), ("tev", 0.0),
                                                ("greedy", 0.0)])
def test_reach_cum_is_the_coverage_of_each_sub_budget_tree(method, temperature):
    g = torch.Generator().manual_seed(1)
    b, D, Vv, B = 3, 5, 12, 24
    draft = torch.randn(b, D, Vv, generator=g) * 2
    tree = build_ddtree(draft, B, torch.tensor([0, 1, 2]))
    # the target at node v roughly agrees with the draft of the depth below v: deep accepted paths
    rows = draft.gather(1, tree.depth.clamp(max=D - 1)[..., None].expand(b, B + 1, Vv))
    logits = rows * 1.5 + torch.randn(b, B + 1, Vv, generator=g) * 0.5
    sp = SamplingParams(temperature=temperature)
    out = verify_tree(tree, logits, method=method, sampling=sp, generator=torch.Generator().manual_seed(2))
    at = [1, 2, 5, 11, B]
    dec = out.host(tree, reach_at=at)
    probs = processed_probs(logits.double(), sp) if temperature > 0 else \
        torch.nn.functional.one_hot(logits.argmax(-1), Vv).double()
    want = [[float(exit_law(_first(tree, k), probs).coverage[r]) for k in at] for r in range(b)]
    assert np.allclose(dec.reach_cum, want, atol=1e-5)
    assert np.allclose([r[-1] for r in dec.reach_cum], dec.coverage, atol=1e-5)  # the whole tree
    assert max(r[-1] for r in dec.reach_cum) > 1.0  # deep enough to tell sub-budgets apart


# --------------------------------------------------------------------------- cost table
def test_cost_table_median_line_neighbours_and_json(tmp_path):
    t = CostTable(window=3, load_correction=False)  # no load correction: the medians themselves
    t.record(4, 8, 0.5)  # the first round of a shape allocates: dropped once a second arrives
    assert t.cost(4, 8) == pytest.approx(0.5)
    for s in (0.010, 0.050, 0.011, 0.012):  # one slow round among them does not set the cost
        t.record(4, 8, s)
    assert t.cost(4, 8) == pytest.approx(0.012)
    t.record(4, 32, 0.020)
    assert t.cost(4, 16) == pytest.approx(0.012 + (0.020 - 0.012) * 8 / 24)  # the line in 1 + B
    assert t.cost(4, 0) is None  # plain decoding is never extrapolated
    assert t.cost(2, 32) == pytest.approx(0.020)  # the nearest batch size that has one
    # with plain rounds timed on both sides a tree's cost is lent as a ratio to plain decoding:
    # batch 16's plain round costs 0.030 s, batch 4's 0.010 s; batch 4's tree of 8 (0.012 s) must
    # not read as cheaper than batch 16's plain round
    for s in (0.010, 0.010):
        t.record(4, 0, s)
    for s in (0.030, 0.030):
        t.record(16, 0, s)
    assert t.cost(16, 8) == pytest.approx(0.030 * 0.012 / 0.010) and t.cost(16, 8) > t.cost(16, 0)
    assert t.cost(16, 32) == pytest.approx(0.030 * 0.020 / 0.010)
    # batch 2 has no plain round of its own: its plain round is lent (batch 4's) and the tree
    # keeps its ratio to it; batch 32 borrows plain from 16 and the tree from 16's ratio too
    assert t.cost(2, 0) == pytest.approx(0.010) and t.cost(2, 32) == pytest.approx(0.020)
    assert t.cost(32, 0) == pytest.approx(0.030) and t.cost(32, 8) == pytest.approx(0.036) and t.cost(32, 8) > t.cost(32, 0)
    assert t.cost(100, 8) > t.cost(100, 0)  # never cheaper than the plain round it is measured against
    for bad in (True, 0, -1.0, float("nan"), float("inf"), "0.1"):  # set() takes seconds > 0 only
        with pytest.raises(ValueError, match="seconds"):
            t.set(4, 8, bad)
    assert t.cost(4, 8) == pytest.approx(0.012)  # untouched by the refusals
    assert CostTable().cost(1, 8) is None
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"cost_table": t.to_json()}))
    back = CostTable.load(path)
    assert back.frozen and back.cost(4, 8) == pytest.approx(0.012)
    back.record(4, 8, 9.0)
    assert back.cost(4, 8) == pytest.approx(0.012)  # frozen: read only
    for bad, match in (({"seconds": {"1": {"8": -1}}}, "finite"), ({"nope": 1}, "not a cost table")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="cost_table"):
            CostTable.load(path)
    with pytest.raises(ValueError, match="cost_table"):
        CostTable.load(tmp_path / "missing.json")


def test_cost_fit_is_monotone_in_the_budget():
    """Noisy medians in the wrong order are pooled (a larger tree never costs less); between and
    beyond measured budgets the fit is linear, so a flat-then-rising (GPU) cost keeps its shape."""
    t = CostTable()
    for b, s in {8: 0.020, 16: 0.018, 32: 0.022, 64: 0.040}.items():
        for _ in range(3):
            t.record(1, b, s)
    c = {b: t.cost(1, b) for b in (4, 8, 12, 16, 24, 32, 48, 64, 96)}
    assert c[8] == pytest.approx(0.019) and c[16] == pytest.approx(0.019) and c[12] == pytest.approx(0.019)
    assert c[4] == pytest.approx(0.019)  # below the smallest timed budget: held flat
    assert c[48] == pytest.approx(0.031) and c[96] == pytest.approx(0.058)
    assert list(c.values()) == sorted(c.values())
    t.set(1, 0, 0.007)
    assert t.cost(1, 0) == pytest.approx(0.007) and t.cost(1, 8) == pytest.approx(0.019)
    # with plain decoding timed, below the smallest timed budget the fit's mean slope carries on
    # (a CPU's every node costs), never below a plain round
    slope = (0.040 - 0.019) / (64 - 8)
    assert t.cost(1, 4) == pytest.approx(0.019 - 4 * slope) and t.cost(1, 2) == pytest.approx(0.019 - 6 * slope)
    t.set(1, 0, 0.0185)
    assert t.cost(1, 2) == pytest.approx(0.0185) and t.cost(1, 8) == pytest.approx(0.019)
    t.set(1, 0, 0.007)
    for bad in (0, -1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match="seconds"):
            t.set(1, 8, bad)
    assert t.cost(1, 8) == pytest.approx(0.019)  # a refused value changes nothing


def test_a_probe_in_a_busy_minute_is_read_against_that_minute():
    """The budget in use sets the minute's load (its last 8 times over its last 64): a probe timed
    while everything runs 2x slower is stored at the usual load; without the correction it is not."""
    for corrected in (True, False):
        t = CostTable(load_correction=corrected)
        t.record(1, 0, 0.010)
        for _ in range(16):
            t.record(1, 16, 0.015)
        for _ in range(8):  # a busy minute
            t.record(1, 16, 0.030)
        t.record(1, 0, 0.020)  # a plain-decoding probe in that minute
        assert t.current_load() == (pytest.approx(2.0) if corrected else 1.0)
        assert t.cost(1, 0) == pytest.approx(0.010 if corrected else 0.020)


# --------------------------------------------------------------------------- controller
def _table(costs: dict[int, float], batch: int = 1) -> CostTable:
    t = CostTable()
    for b, s in costs.items():
        t.record(batch, b, s)
    return t


def _feed(ctl, budget, gains, batch=1, seconds=None):
    """One round of ``budget`` whose sub-budget gains are ``gains[B']`` for every row."""
    cum = [[gains[b] for b in ctl.grid_upto(budget)]] * batch if budget else None
    ctl.observe(batch, budget, cum, seconds if seconds is not None else ctl.costs.cost(batch, budget) or 0.01)


def test_controller_calibrates_then_maximises_tokens_per_second():
    grid = (0, 4, 16, 64)
    costs = CostTable()
    ctl = BudgetController(grid, costs, explore_share=0.01)
    gains = {4: 1.0, 16: 1.8, 64: 2.2}
    seconds = {0: 0.010, 4: 0.014, 16: 0.018, 64: 0.040}
    # calibration: the largest tree, plain decoding, the middle of the grid; the first round after
    # a switch between plain decoding and the trees is not timed (it pays for the switch)
    first = []
    for _ in range(5):
        b = ctl.choose(1)
        first.append(b)
        _feed(ctl, b, gains, seconds=seconds[b])
    assert first == [64, 0, 0, 16, 16]
    # budget 4 is untimed: its cost is carried down from 16 by the fit's mean slope (12.5 ms,
    # 160 tokens/s, above 16's 156), so it runs one stint (min_gap rounds), is timed at 14 ms
    # (143 tokens/s) and left
    stint = []
    for _ in range(7):
        b = ctl.choose(1)
        stint.append(b)
        _feed(ctl, b, gains, seconds=seconds[b])
    assert stint == [4] * 6 + [16] and ctl.costs.cost(1, 4) == pytest.approx(0.014)
    # rates: plain 100, B4 143, B16 156, B64 80 tokens/s -> 16
    picks = Counter()
    for _ in range(300):
        b = ctl.choose(1)
        picks[b] += 1
        _feed(ctl, b, gains, seconds=seconds[b])
    # every other budget is a probe (up: 64, across: plain, down: 4), as often as 1 % of the time
    # pays for what they lose (64 loses ~20 ms a round, plain ~4 ms, 4 ~1 ms)
    assert picks.most_common(1)[0][0] == 16
    # (an across probe runs two rounds: the first pays the switch)
    assert 3 <= ctl._explorations <= sum(v for b, v in picks.items() if b != 16) <= 2 * ctl._explorations <= 30
    # a slow machine for trees: plain decoding wins
    slow = BudgetController(grid, _table({0: 0.010, 4: 0.05, 16: 0.06, 64: 0.2}))
    _feed(slow, 64, gains)
    assert slow.choose(1) == 0


def _run(ctl, rounds, gains, seconds):
    picks = []
    for _ in range(rounds):
        b = ctl.choose(1)
        picks.append(b)
        _feed(ctl, b, gains, seconds=seconds[b])
    return picks


def test_probes_cost_at_most_their_share_alternate_gain_and_cost_and_never_pick_an_unseen_gain():
    gains = {8: 0.2, 32: 0.3}
    for tree_cost, many in ((0.013, True), (0.05, False)):  # trees nearly as good as plain / far worse
        seconds = {0: 0.01, 8: tree_cost, 32: tree_cost * 1.5}
        ctl = BudgetController((0, 8, 32), CostTable(), explore_share=0.05)
        picks = _run(ctl, 600, gains, seconds)[5:]  # after calibration
        probes = [b for b in picks if b != 0]
        lost = sum(seconds[b] - (1 + gains[b]) * seconds[0] for b in probes)
        assert picks.count(0) > 400 and lost <= 0.05 * sum(seconds[b] for b in picks) + 0.05
        assert (len(probes) >= 50) if many else (len(probes) < 30)
        # while plain decoding wins every probe is a tree, so two rounds (the first pays the switch)
        starts = [i for i, b in enumerate(picks) if b != 0 and picks[i - 1] == 0]
        assert all(picks[i + 1] == picks[i] and (i + 2 == len(picks) or picks[i + 2] == 0) for i in starts[:-1])
        assert min(np.diff(starts)) >= ctl.min_gap and len(probes) >= 2 * len(starts) - 1
        if many:
            # trees nearly as good as plain: 32's probe would lose 6.5x 8's (> stale_loss), so
            # only the best tree is probed, and more often
            assert set(probes) == {8}
        else:
            # up probes (a larger budget than the best tree) and across probes (the tree budgets
            # timed so far, the stalest first) in turn; no down probe while plain decoding wins
            assert probes[:8] == [32, 32, 8, 8, 32, 32, 32, 32][:len(probes[:8])] and set(probes) == {8, 32}
    # a budget whose gain was never observed is not chosen (only explored)
    fresh = BudgetController((0, 8, 32), _table({0: 0.01, 8: 0.011, 32: 0.012}))
    fresh.gain = {8: 0.5}  # as if only budget-8 rounds had run
    assert fresh.best(1) == 8


def test_probes_go_up_across_and_down_around_a_winning_tree():
    """A winning tree of 16: probes time 64 (gains up to it), plain decoding (the other regime)
    and 4 (its cost was a guess, held at 16's until timed), in turn."""
    ctl = BudgetController((0, 4, 16, 64), CostTable(), explore_share=0.5)
    gains = {4: 1.0, 16: 1.8, 64: 2.2}
    seconds = {0: 0.010, 4: 0.0175, 16: 0.018, 64: 0.025}
    picks = _run(ctl, 200, gains, seconds)[5:]
    probes = [b for b in picks if b != 16]
    # the across probe (plain decoding) runs two rounds: the first one pays the switch
    assert picks.count(16) > 100 and probes[:8] == [64, 0, 0, 4, 64, 0, 0, 4]
    assert ctl.costs.cost(1, 4) == pytest.approx(0.0175)


def test_controller_rereads_a_cost_measured_in_a_slow_minute():
    """Trees timed while the machine was busy look slower than plain decoding; the cost probes
    time them again, and the choice returns to the tree once the fresh times outvote the old."""
    ctl = BudgetController((0, 16, 64), CostTable(), explore_share=0.1)
    gains = {16: 2.0, 64: 2.4}
    true = {0: 0.010, 16: 0.015, 64: 0.030}
    for b in (64, 0, 0, 16, 16):  # calibration (a switch's first round is not timed)
        assert ctl.choose(1) == b
        _feed(ctl, b, gains, seconds=true[b])
    for _ in range(4):  # a busy minute: the tree rounds take 4x longer
        _feed(ctl, 16, gains, seconds=4 * true[16])
    assert ctl.choose(1) == 0
    picks = _run(ctl, 1000, gains, true)
    back = next(i for i in range(len(picks)) if picks[i:i + 10].count(16) >= 8)
    assert 20 < back < 400 and picks[-100:].count(16) >= 80
    assert (1, 0, 16, True) in ctl.trials  # the way back was a trial, and it held


def test_a_regime_switch_is_tried_against_the_same_minute_and_undone_when_it_loses():
    """Plain decoding wins (trees cost 3x and more), but one fast probe round makes budget 8 look
    faster in the table. The switch is a trial: five rounds of 8, whose tokens per second (the
    first left out) lose to plain decoding's last rounds, so the controller goes back and waits
    32 rounds (then 64, ...) before it tries again; probes still run meanwhile."""
    grid, gains = (0, 8, 32), {8: 1.0, 32: 1.5}
    true = {0: 0.010, 8: 0.030, 32: 0.045}
    # no probes at all (no allowance, and no free across probe of the fast-looking 8: every tree
    # may be probed, the stalest first), so only the trial mechanism is at work
    # (warmup 0: every round after a pair's first is settled, so the burst stays in the window)
    ctl = BudgetController(grid, CostTable(warmup=0), explore_share=0.0, stale_loss=1e9)
    assert _run(ctl, 5, gains, true) == [32, 0, 0, 8, 8]  # calibration
    _run(ctl, 20, gains, true)
    assert ctl.state(1).current == 0 and not ctl.trials
    for _ in range(12):  # a burst of fast budget-8 rounds: its median now reads 12 ms (rate 167 > 100)
        _feed(ctl, 8, gains, seconds=0.012)
    while ctl.state(1).age < ctl.min_gap:  # up to the next re-read of the choice
        _run(ctl, 1, gains, true)
    picks = _run(ctl, 5, gains, true)
    assert picks == [8] * 5 and ctl.state(1).trial is not None  # on trial
    after = _run(ctl, 30, gains, true)
    assert ctl.trials == [(1, 0, 8, False)] and after == [0] * 30  # undone, cooling down
    # the table still reads 8 as fast (its window of 15 holds 10 of the fast rounds): after the
    # cool-down it is tried again and loses again, and each wait is twice as long as the last
    later = _run(ctl, 200, gains, true)
    assert [t[3] for t in ctl.trials] == [False] * len(ctl.trials) and 2 <= len(ctl.trials) <= 4
    assert later.count(8) == 5 * (len(ctl.trials) - 1)
    # a frozen table never tries: its choices repeat exactly (seeded runs repeat)
    frozen = BudgetController(grid, _table({0: 0.010, 8: 0.012, 32: 0.045}))
    frozen.costs.frozen = True
    _feed(frozen, 32, gains)
    assert frozen.choose(1) == 8 and frozen.state(1).trial is None


def test_gains_of_rarely_observed_budgets_follow_the_fresh_ones():
    """A larger budget is observed only by probes; its gain is the smaller budgets' fresh gain plus
    its own (older) increment, so it never falls below a smaller budget's."""
    ctl = BudgetController((0, 8, 16, 64), CostTable(), alpha=0.5)
    ctl.observe(1, 64, [[2.0, 2.5, 3.0]], 0.02)
    assert ctl.gain == pytest.approx({8: 2.0, 16: 2.5, 64: 3.0})
    for _ in range(6):  # acceptance drops: only budget-8 rounds run
        ctl.observe(1, 8, [[0.5]], 0.01)
    assert ctl.gain[8] < 0.6 and ctl.gain[16] == pytest.approx(ctl.gain[8] + 0.5)
    assert ctl.gain[64] == pytest.approx(ctl.gain[8] + 1.0)


def test_controller_keeps_its_choice_within_the_margin():
    ctl = BudgetController((0, 8, 16), _table({0: 0.01, 8: 0.020, 16: 0.0205}), margin=0.05)
    ctl.gain = {8: 1.0, 16: 1.0}
    ctl.state(1).current = 16
    assert ctl.best(1) == 16  # 8 is 2.5 % faster: not enough to switch
    ctl.costs = _table({0: 0.01, 8: 0.015, 16: 0.0205})
    assert ctl.best(1) == 8


def test_controller_arguments():
    with pytest.raises(ValueError, match="grid"):
        BudgetController((0,), CostTable())
    with pytest.raises(ValueError, match="grid"):
        BudgetController((-1, 4), CostTable())
    for bad in (dict(explore_share=1.0), dict(min_gap=0), dict(trial_rounds=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BudgetController((0, 4), CostTable(), **bad)


# ------------------------------------------------------------- the controller's steps, one by one
def _set(costs: dict[int, float], batch: int = 1, frozen: bool = False) -> CostTable:
    """A table holding exactly these seconds (no medians, no load)."""
    t = CostTable(frozen=frozen)
    for b, s in costs.items():
        t.set(batch, b, s)
    return t


def test_state_is_one_object_per_batch_size():
    ctl = BudgetController((0, 8), CostTable())
    st = ctl.state(3)
    assert st == BatchSizeState() and ctl.state(3) is st and ctl.batches == {3: st}
    assert (st.calibrated, st.current, st.age, st.trial, st.repeat, st.cooldown, st.failures) == \
        (False, None, None, None, None, 0, 0)
    ctl.observe(2, 8, [[0.5]], 0.01)
    assert ctl.state(2).last == 8 and ctl.state(3).last is None


def test_expected_tokens_and_rate():
    ctl = BudgetController((0, 8, 16), _set({0: 0.010, 8: 0.020}))
    ctl.gain = {8: 1.5}
    assert ctl.expected_tokens(0) == 1.0 and ctl.expected_tokens(8) == 2.5 and ctl.expected_tokens(16) is None
    assert ctl.rate(1, 0) == pytest.approx(100.0) and ctl.rate(1, 8) == pytest.approx(125.0)
    assert ctl.rate(1, 16) is None  # no gain yet
    ctl.gain[16] = 2.0  # cost of 16: one timed tree budget only, so none
    assert ctl.rate(1, 16) is None
    frozen = BudgetController((0, 8, 16), _set({0: 0.010, 8: 0.020, 16: 0.030}, frozen=True))
    frozen.gain = {8: 1.5, 16: 2.0}
    assert frozen.rate(1, 16) == pytest.approx(100.0)
    frozen.costs = _set({0: 0.010, 8: 0.020, 32: 0.030}, frozen=True)  # 16 held nowhere: a fit's guess
    assert frozen.rate(1, 16) is None and frozen.rate(1, 8) == pytest.approx(125.0)


def test_calibration_budget_steps():
    ctl = BudgetController((0, 4, 16, 64), CostTable())
    assert ctl.calibration_budget(1) == 64  # the largest tree: no gain, no cost
    ctl.observe(1, 64, [[1.0, 1.8, 2.2]], 0.040)
    assert ctl.calibration_budget(1) == 0  # plain decoding untimed
    ctl.observe(1, 0, None, 0.010)  # (a switch round: not timed)
    assert ctl.calibration_budget(1) == 0
    ctl.observe(1, 0, None, 0.010)
    assert ctl.calibration_budget(1) == 16  # grid[1 + 3 // 2]: the middle tree, a second fit point
    ctl.observe(1, 16, [[1.0, 1.8]], 0.018)
    ctl.observe(1, 16, [[1.0, 1.8]], 0.018)
    assert ctl.calibration_budget(1) is None  # 4 is read below 16 by the fit's slope: done
    two = BudgetController((0, 8, 32), _set({0: 0.010, 32: 0.020}))
    two.gain = {8: 1.0, 32: 2.0}
    assert two.calibration_budget(1) == 8  # the middle (32) is timed already: the smallest tree
    frozen = BudgetController(DEFAULT_GRID, _set({0: 0.010, 4: 0.030}, frozen=True))
    assert frozen.calibration_budget(1) == 4  # the largest tree with a cost, not 64
    frozen.gain = {2: 0.2, 4: 0.3}
    assert frozen.calibration_budget(1) is None  # a frozen table times nothing else


def test_scheduled_budget_repeat_then_trial_then_its_end():
    ctl = BudgetController((0, 8), _set({0: 0.010, 8: 0.030}), trial_rounds=2)
    ctl.gain = {8: 1.0}
    st = ctl.state(1)
    assert ctl.scheduled_budget(1, st) is None
    st.repeat = 0
    assert ctl.scheduled_budget(1, st) == 0 and st.repeat is None
    st.trial = Trial(0, 8, rounds=1)
    assert ctl.scheduled_budget(1, st) == 8 and st.trial is not None
    st.trial.rounds = 2  # done: ended (won: nothing timed to compare) and nothing is due
    assert ctl.scheduled_budget(1, st) is None and st.trial is None
    assert ctl.trials == [(1, 0, 8, True)] and st.current == 8 and st.cost_now == 0.030 and st.age == 0


def test_reread_switches_or_starts_a_trial_or_stays_in_the_regime():
    # rates: plain 1 / 10 ms = 100, budget 8 (1 + 1) / 12 ms = 167 tokens/s
    ctl = BudgetController((0, 8), _set({0: 0.010, 8: 0.012}))
    ctl.gain = {8: 1.0}
    st = ctl.state(1)
    assert ctl.reread(1, st) is None and (st.current, st.cost_now, st.age) == (8, 0.012, 0)
    st.current, st.age = 0, 6  # in plain decoding, with no raw plain times: switch at once
    assert ctl.reread(1, st) is None and st.current == 8 and st.trial is None
    for _ in range(4):  # four raw plain times: the switch goes on trial
        ctl.costs.record(1, 0, 0.010)
    st.current, st.age = 0, 6
    assert ctl.reread(1, st) == 8 and st.trial == Trial(0, 8) and st.current == 0 and st.age == 0
    st.trial, st.cooldown, ctl.rounds = None, 40, 39  # a failed trial lately: stay plain
    assert ctl.reread(1, st) is None and st.current == 0 and st.cost_now == pytest.approx(0.010)
    ctl.rounds = 40  # cool-down over
    assert ctl.reread(1, st) == 8


def _probing() -> BudgetController:
    """Rates: plain 100, budget 4 (2.0 / 14 ms) 142.9, 16 (2.8 / 18 ms) 155.6, 64 (3.2 / 40 ms) 80."""
    ctl = BudgetController((0, 4, 16, 64), _set({0: 0.010, 4: 0.014, 16: 0.018, 64: 0.040}))
    ctl.gain = {4: 1.0, 16: 1.8, 64: 2.2}
    return ctl


def test_probe_kinds_up_across_down():
    ctl = _probing()
    assert ctl.probe_kinds(1, 16) == (64, 0, 4)
    assert ctl.probe_kinds(1, 4) == (16, 0, None) and ctl.probe_kinds(1, 64) == (None, 0, 16)
    # plain decoding wins (within the regime margin): up from the best tree (16), across the tree
    # timed longest ago (every tree: the probe-loss cap is tested below)
    ctl.stale_loss = 1e9
    assert ctl.probe_kinds(1, 0) == (64, 4, None)  # set() stamps nothing: ties go to the first
    ctl.costs.record(1, 4, 0.014)
    ctl.costs.record(1, 64, 0.040)
    assert ctl.probe_kinds(1, 0) == (64, 16, None)  # 16 was never timed by a round
    ctl.costs.record(1, 16, 0.018)
    assert ctl.probe_kinds(1, 0)[1] == 4
    # ... among the trees whose probe loses at most stale_loss times the best tree's: with plain
    # decoding at 182 tokens/s, 16's probe loses 0.0052 s, 4's 0.0060 s, 64's 0.0448 s
    ctl.costs.set(1, 0, 0.0055)
    ctl.stale_loss = 4.0
    assert ctl.probe_kinds(1, 0) == (None, 4, None)  # 64 (up) left out: 8.6x the best tree's loss
    ctl.costs.record(1, 4, 0.014)
    assert ctl.probe_kinds(1, 0) == (None, 16, None)
    ctl.stale_loss = 2.5
    ctl.costs.record(1, 16, 0.018)
    assert ctl.probe_kinds(1, 0) == (None, 4, None)
    ctl.stale_loss = 1.1  # 4's probe loses 1.15x 16's: the best tree only
    assert ctl.probe_kinds(1, 0) == (None, 16, None)
    with pytest.raises(ValueError, match="stale_loss"):
        BudgetController((0, 8), CostTable(), stale_loss=0.5)
    assert BudgetController((2, 8), _set({2: 0.01, 8: 0.02})).probe_kinds(1, 8) == (None, None, 2)


def test_plain_decoding_on_stale_gains_probes_the_best_tree_and_returns_to_trees():
    """Measured on the shipped pair (2026-12-06, batch 1, one thread): the first call's tree rounds
    learned gains below the trees' later ones, plain decoding won by a hair, and the only across
    probe offered was the capacity (timed once, at calibration, longest ago): it loses the most,
    the allowance never paid for it, and 512 rounds ran plain with the gains never re-observed.
    The across probe is the best tree: it is paid for within ~100 rounds, its rounds re-observe
    the gains, and the controller goes back to the trees once they win."""
    grid = (0, 4, 8, 16, 64)
    ctl = BudgetController(grid, _set({0: 0.0052, 4: 0.0121, 8: 0.0133, 16: 0.0139, 64: 0.0257}))
    ctl.gain = {4: 0.95, 8: 1.31, 16: 1.44, 64: 2.44}  # stale: learned early in the first call
    for b in grid:
        ctl._n[b] = 40
    ctl._inc = {4: 0.95, 8: 0.36, 16: 0.13, 64: 1.0}
    st = ctl.state(1)
    st.calibrated, st.current, st.age, st.cost_now = True, 0, 0, 0.0052
    truth = {4: 1.1, 8: 1.64, 16: 1.84, 64: 2.44}  # what the trees gain now (fixed-budget runs)
    seconds = {0: 0.0052, 4: 0.0121, 8: 0.0124, 16: 0.0141, 64: 0.0257}
    picks = _run(ctl, 1500, truth, seconds)
    probes = [(i, b) for i, b in enumerate(picks) if b]
    assert probes[0][0] < 400 and 64 not in [b for _, b in probes[:20]]  # not the capacity first
    assert sum(b > 0 for b in picks[-300:]) > 250  # back on the trees (they win by 12 %)


def test_a_gain_observed_after_a_long_gap_moves_by_up_to_stale_weight():
    """The gains' EMA runs over rounds: a step every round observes moves by alpha, one last seen
    g rounds ago by 1 - (1 - alpha) ** g (at most stale_weight)."""
    ctl = BudgetController((0, 8, 32), _set({0: 0.01, 8: 0.02, 32: 0.03}), alpha=0.05, stale_weight=0.5)
    for _ in range(40):
        ctl.observe(1, 32, [[1.0, 1.5]], 0.03)
    assert ctl.gain == pytest.approx({8: 1.0, 32: 1.5})
    ctl.observe(1, 32, [[2.0, 3.0]], 0.03)  # the next round: weight alpha
    assert ctl.gain[8] == pytest.approx(1.05) and ctl.gain[32] == pytest.approx(1.05 + 0.5 + 0.05 * 0.5)
    for _ in range(5):
        ctl.observe(1, 0, None, 0.01)
    ctl.observe(1, 8, [[2.05]], 0.02)  # 6 rounds after the last: 1 - 0.95 ** 6 = 0.265
    assert ctl.gain[8] == pytest.approx(1.05 + (1 - 0.95 ** 6) * 1.0)
    for _ in range(300):
        ctl.observe(1, 0, None, 0.01)
    inc32 = ctl.gain[32] - ctl.gain[8]
    ctl.observe(1, 32, [[0.0, 0.0]], 0.03)  # 300 rounds later: capped at stale_weight
    assert ctl.gain[8] == pytest.approx(0.5 * (1.05 + (1 - 0.95 ** 6)))
    assert ctl.gain[32] - ctl.gain[8] == pytest.approx(0.5 * inc32)
    with pytest.raises(ValueError, match="stale_weight"):
        BudgetController((0, 8), CostTable(), alpha=0.1, stale_weight=0.05)
    assert BudgetController((0, 8), CostTable(), alpha=0.6).stale_weight == 0.6  # the default follows alpha
    for bad in (0.0, -1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            BudgetController((0, 8), CostTable(), alpha=bad)


def test_across_probes_pay_the_switch_they_cause():
    """The first round after a switch between plain decoding and the trees costs more than its
    budget's round (the drafter catches up on the plain stretch's tokens); that excess is learned
    per batch size and direction and charged to across probes, so where a switch is dear the
    trees are probed from plain decoding less often."""
    grid, gains = (0, 8), {8: 0.3}
    counts = {}
    for catch_up in (0.0, 0.02, 0.2):  # the first tree round after plain: +0 / 20 / 200 ms
        ctl = BudgetController(grid, _set({0: 0.010, 8: 0.014}), explore_share=0.05)
        ctl.gain = dict(gains)
        picks = []
        for _ in range(2000):
            b = ctl.choose(1)
            first = picks and b and not picks[-1]
            picks.append(b)
            _feed(ctl, b, gains, seconds={0: 0.010, 8: 0.014}[b] + (catch_up if first else 0.0))
        counts[catch_up] = sum(1 for i in range(1, len(picks)) if picks[i] and not picks[i - 1])
        # what was measured, at most SWITCH_CAP times the tree round (a stall must not stop the
        # probes that would measure the price again)
        assert ctl.switch.get((1, True), 0.0) == pytest.approx(min(catch_up, SWITCH_CAP * 0.014), abs=1e-9)
    assert counts[0.0] >= 200 and counts[0.02] <= counts[0.0] / 5 and 10 <= counts[0.2] <= counts[0.02]
    st = ctl.state(1)
    loss = ctl.probe_loss(1, 8, 0)
    ctl.switch[(1, False)] = 0.015  # back into plain decoding: charged too
    assert ctl.probe_loss(1, 8, 0) == pytest.approx(loss + 0.015)
    ctl.switch[(1, False)] = 1.0  # e.g. from a plan cache: at most SWITCH_CAP plain rounds
    assert ctl.probe_loss(1, 8, 0) == pytest.approx(loss + SWITCH_CAP * 0.010)
    assert ctl.probe_loss(1, 8, 8) == 0.0 and st.current == 0


def test_next_probe_turns_through_the_kinds():
    ctl = _probing()
    picks = []
    for k in range(4):
        ctl._explorations = k
        picks.append(ctl.next_probe(1, 16))
    assert picks == [64, 0, 4, 64]
    ctl._explorations = 0
    assert ctl.next_probe(1, 64) == 0  # no up: the next kind
    no_plain = BudgetController((8, 16), _set({8: 0.01, 16: 0.02}))
    no_plain._explorations = 1
    assert no_plain.next_probe(1, 16) == 8 and no_plain.next_probe(1, 8) == 16
    assert BudgetController((0, 8), CostTable()).next_probe(1, 8) == 0
    assert BudgetController((8,), CostTable()).next_probe(1, 8) is None


def test_probe_loss_by_hand():
    ctl = _probing()
    # 64 against 16: 40 ms x (1 - 80 / 155.6) = 40 ms x (1 - 1.44 / 2.8)
    assert ctl.probe_loss(1, 64, 16) == pytest.approx(0.040 * (1 - 1.44 / 2.8))
    # plain decoding against 16: two rounds of 10 ms x (1 - 100 / 155.6)
    assert ctl.probe_loss(1, 0, 16) == pytest.approx(2 * 0.010 * (1 - 1.8 / 2.8))
    assert ctl.probe_loss(1, 16, 4) == 0.0  # a faster probe loses nothing
    assert ctl.probe_loss(1, 4, 0) == pytest.approx(0.0)  # and across, twice nothing


def test_take_probe_is_paid_from_the_allowance():
    ctl = _probing()
    st = ctl.state(1)
    st.current = 16
    loss = 0.040 * (1 - 1.44 / 2.8)
    ctl.allowance = loss * 0.99
    assert ctl.take_probe(1, st) is None and ctl.allowance == loss * 0.99 and ctl._explorations == 0
    ctl.allowance, ctl._since = 0.05, 7
    assert ctl.take_probe(1, st) == 64 and st.repeat is None
    assert ctl.allowance == pytest.approx(0.05 - loss) and ctl._since == 0 and ctl._explorations == 1
    assert ctl.take_probe(1, st) == 0 and st.repeat == 0  # across: its second round is scheduled
    assert ctl.allowance == pytest.approx(0.05 - loss - 2 * 0.010 * (1 - 1.8 / 2.8))
    frozen = BudgetController((0, 8, 16), _set({0: 0.010, 8: 0.012}, frozen=True))
    frozen.gain = {8: 1.0, 16: 1.5}
    frozen.allowance = 1.0
    frozen.state(1).current = 8
    assert frozen.take_probe(1, frozen.state(1)) is None  # 16: no cost in the table, no probe


def test_regime_before_and_trial_won():
    ctl = BudgetController((0, 8), CostTable())
    for s in (0.010, 0.012, 0.011):
        ctl.costs.record(1, 0, s)
    assert ctl.regime_before(1, 0) is None  # fewer than 4 raw times
    for s in (0.009, 0.030, 0.010, 0.010, 0.008, 0.010, 0.020):
        ctl.costs.record(1, 0, s)
    assert ctl.regime_before(1, 0) == pytest.approx(0.010)  # the median of the last 8 raw times
    ctl.gain = {8: 1.0}
    # 2.5 tokens / 20 ms (median) = 125 tokens/s against 1 / 10 ms x 1.1 = 110
    trial = Trial(0, 8, rounds=4, seconds=[0.020, 0.019, 0.030], tokens=[2.0, 2.5, 3.0])
    assert ctl.trial_won(1, trial)
    ctl.regime_margin = 0.3  # against 130
    assert not ctl.trial_won(1, trial)
    assert ctl.trial_won(1, Trial(0, 8, rounds=1))  # nothing timed: kept
    ctl.costs.frozen = True
    assert ctl.regime_before(1, 0) is None and ctl.trial_won(1, trial)


def test_back_off_rounds_double_up_to_1024():
    assert [BudgetController.back_off_rounds(f) for f in (1, 2, 3, 4, 5, 6, 7, 20)] == \
        [32, 64, 128, 256, 512, 1024, 1024, 1024]


def test_end_trial_keeps_a_winner_and_backs_off_a_loser():
    ctl = BudgetController((0, 8), _set({0: 0.010, 8: 0.030}), regime_margin=0.1)
    ctl.gain = {8: 1.0}
    for _ in range(4):
        ctl.costs.record(1, 0, 0.010)
    st = ctl.state(1)
    st.current, st.failures, ctl.rounds = 0, 1, 100
    st.trial = Trial(0, 8, rounds=5, seconds=[0.030] * 4, tokens=[2.0] * 4)  # 67 tokens/s < 110
    ctl.end_trial(1, st)
    assert st.trial is None and ctl.trials == [(1, 0, 8, False)] and st.failures == 2
    assert st.cooldown == 100 + 64 and (st.current, st.cost_now, st.age) == (0, pytest.approx(0.010), 0)
    st.trial = Trial(0, 8, rounds=5, seconds=[0.015] * 4, tokens=[2.0] * 4)  # 133 tokens/s > 110
    ctl.end_trial(1, st)
    assert ctl.trials[-1] == (1, 0, 8, True) and st.failures == 0 and st.cooldown == 164
    assert (st.current, st.cost_now) == (8, 0.030)


def test_trial_record_leaves_the_first_round_out():
    t = Trial(0, 8)
    t.record(0.5, [[1.0, 2.0]])
    t.record(0.02, [[1.0, 2.0], [0.5, 1.0]])
    t.record(0.03, None)
    assert t.rounds == 3 and t.seconds == [0.02, 0.03] and t.tokens == [2.5, 1.0]


def test_observe_times_no_switch_round_and_feeds_the_trial():
    ctl = BudgetController((0, 8), CostTable())
    ctl.observe(1, 0, None, 0.010)
    ctl.observe(1, 8, [[1.0]], 0.050)  # the first tree round after plain ones: not timed
    assert ctl.costs.counts == {1: {0: 1}} and ctl.gain == {8: 1.0}
    ctl.observe(1, 8, [[1.0]], 0.020)
    assert ctl.costs.counts == {1: {0: 1, 8: 1}}
    ctl.state(1).trial = Trial(0, 8)
    ctl.observe(1, 0, None, 0.010)  # not the trial's budget
    ctl.observe(1, 8, [[1.0]], 0.05)
    ctl.observe(1, 8, [[3.0]], 0.02)
    assert ctl.state(1).trial == Trial(0, 8, rounds=2, seconds=[0.02], tokens=[4.0])


def test_learn_gains_by_hand():
    ctl = BudgetController((0, 8, 16, 64), CostTable(), alpha=0.5)
    ctl.learn_gains(16, [[1.0, 1.5], [2.0, 2.5]])  # means 1.5, 2.0: steps 1.5, 0.5
    assert ctl.gain == {8: 1.5, 16: 2.0}  # 64 never observed: no gain
    ctl.learn_gains(8, [[0.5]])  # step 8, its 2nd round: weight max(0.5, 1/2) -> 0.5 x 1.5 + 0.5 x 0.5
    assert ctl.gain == {8: 1.0, 16: 1.5}
    # steps of a 64 round: 8 -> 1.0 (3rd, weight 0.5: 1.0), 16 -> max(0, 0.8 - 1.0) = 0 (2nd: 0.25),
    # 64 -> 3.0 - 0.8 = 2.2 (1st)
    ctl.learn_gains(64, [[1.0, 0.8, 3.0]])
    assert ctl.gain == pytest.approx({8: 1.0, 16: 1.25, 64: 3.45})


# --------------------------------------------------------------------------- the runtime
class Scripted(BudgetController):
    """Chooses from a fixed cycle of budgets (what the mask buffers, deferred contexts and tree
    widths see when the real controller changes its mind), records like the real one."""

    def __init__(self, cycle, costs=None):
        super().__init__(sorted(set(cycle) | {max(cycle)}), costs or CostTable())
        self.cycle, self.i = list(cycle), 0

    def choose(self, batch):
        b = self.cycle[self.i % len(self.cycle)]
        self.i += 1
        return self._log(batch, b)


CYCLE = [0, 16, 0, 0, 2, 8, 0, 16, 4, 4, 0, 0, 0, 16]


def test_greedy_under_changing_budgets_is_plain_decoding_batched():
    """Every tree width and plain rounds in between, a ragged batch of 3 rows whose last ones
    finish early (the batch shrinks): token-identical to plain greedy decoding per row."""
    tgt = qwen3(11)
    gen = SpeculativeGenerator(tgt, OracleDrafter(tgt, V, accuracy=0.7, block_size=6))
    prompts = [[1, 5, 9, 2], [3, 3], [7, 1, 4, 4, 4, 8]]
    maxes = [40, 17, 29]
    ctl = Scripted(CYCLE)
    gen._budget_controller = lambda requests: ctl
    res = gen.generate(prompts, budget="auto", max_new_tokens=maxes, ignore_eos=True)
    for p, n, r in zip(prompts, maxes, res):
        assert r.token_ids == plain_greedy(tgt, p, n)
    used = Counter(x.budget for r in res for x in r.rounds)
    assert set(used) == set(CYCLE) and sum(x.accept_len for r in res for x in r.rounds) > 20
    assert {h[0] for h in ctl.history} >= {3, 1}  # the batch shrank


def test_auto_drafts_a_block_of_budget_plus_one_and_fixed_budgets_the_whole_block():
    """Under auto a budget-B round drafts min(K - 1, B) depths (its tree reaches depth B at most);
    a fixed budget drafts K - 1 whatever B; the shipped drafter's head returns only the depths a
    tree can reach. Greedy output stays plain decoding's."""
    tgt = qwen3(11)

    class Recording(OracleDrafter):
        def draft_rows(self, rows, roots, root_pos, tokens, depth, max_root_pos):
            seen.append(depth)
            return super().draft_rows(rows, roots, root_pos, tokens, depth, max_root_pos)

    seen = []
    gen = SpeculativeGenerator(tgt, Recording(tgt, V, accuracy=0.7, block_size=6))
    ctl = Scripted([2, 0, 16, 4, 8])
    gen._budget_controller = lambda requests: ctl
    res = gen.generate([1, 5, 9, 2], budget="auto", max_new_tokens=60, ignore_eos=True)
    assert res.token_ids == plain_greedy(tgt, [1, 5, 9, 2], 60)
    trees = [r.budget for r in res.rounds if r.budget]
    # (a row's last round has no depth left to draft: no draft call)
    assert len(seen) >= len(trees) - 1 and seen == [min(5, b) for b in trees][: len(seen)] and {2, 4, 5} <= set(seen)
    seen.clear()
    gen.generate([1, 5, 9, 2], budget=2, max_new_tokens=12, ignore_eos=True)
    assert set(seen) == {5}

    shipped = SpeculativeGenerator.from_pretrained()
    heads = []
    head = shipped.drafter._head
    shipped.drafter._head = lambda h: heads.append(h.shape[1]) or head(h)
    shipped.generate("def f(x):", budget=4, max_new_tokens=24, ignore_eos=True)
    assert set(heads[:-3]) == {4}  # the last rounds' depth caps may be smaller


def test_greedy_auto_with_the_shipped_pair_equals_plain_and_uses_several_budgets():
    gen = SpeculativeGenerator.from_pretrained()
    prompt = "def fibonacci(n):"
    plain = gen.generate(prompt, method="autoregressive", max_new_tokens=64, ignore_eos=True)
    ctl = Scripted(CYCLE)
    gen._budget_controller = lambda requests: ctl
    scripted = gen.generate(prompt, budget="auto", max_new_tokens=64, ignore_eos=True)
    del gen._budget_controller
    real = gen.generate(prompt, max_new_tokens=64, ignore_eos=True)  # the default is auto
    assert scripted.token_ids == plain.token_ids == real.token_ids
    assert {r.budget for r in real.rounds} and all(r.budget in DEFAULT_GRID for r in real.rounds)


def test_sampled_law_under_auto_is_the_target_law():
    """Budgets chosen from past rounds (the controller persists across the calls, so calls see
    different budgets, plain rounds included): the first two tokens still follow the target's law
    (chi-square against the exact law, alpha 1e-6, as the fixed budgets)."""
    vocab = 8
    tgt = qwen3(7, vocab=vocab, layers=1)
    prompt = [1, 5, 2]
    sampling = SamplingParams(temperature=1.0, top_k=5)
    with torch.no_grad():
        p1 = processed_probs(tgt(torch.tensor([prompt])).logits[:, -1].double(), sampling)[0]
        p2 = processed_probs(tgt(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1].double(), sampling)
    exact = (p1[:, None] * p2).numpy()
    gen = SpeculativeGenerator(tgt, FixedDrafter(vocab, 4, seed=2))
    gen.budget_grid = (0, 1, 2, 6)
    # a frozen cost table under which budgets are close in rate: the choice moves with the gains
    gen.cost_table = CostTable.from_json({"seconds": {"1": {"0": 0.010, "1": 0.016, "2": 0.019, "6": 0.024}}})
    n = 4000
    counts = np.zeros((vocab, vocab))
    used = Counter()
    for s in range(n):
        res = gen.generate(prompt, budget="auto", sampling=sampling, seed=s, max_new_tokens=2, ignore_eos=True)
        counts[res.token_ids[0], res.token_ids[1]] += 1
        used.update(r.budget for r in res.rounds)
    assert len(used) >= 3 and used[0] > 0, used  # plain rounds and several tree sizes
    assert chi_square_pvalue(counts, exact) > 1e-6


# --------------------------------------------------------------------------- deferred context
def test_deferred_plain_round_contexts_equal_immediate_writes():
    """Plain rounds hand the drafter one token each; it defers them and writes them with the next
    draft (later writes to a slot win, as in a cache): the draft equals writing each at once."""
    from sglang_tev.hf.dflash_runner import StaticDFlashDrafter, _last_writes
    from sglang_tev.testing.models import dflash_for

    assert _last_writes(torch.tensor([[3, 4, 3, 5]])).tolist() == [[False, True, True, True]]
    tgt = qwen3(3)
    model = dflash_for(tgt, seed=4)
    F = model.fc.in_features
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(2, 12, F, generator=g)
    rows = slice(0, 2)
    runs = []
    for deferred in (True, False):
        d = StaticDFlashDrafter(model, tgt)
        d.start(2, 64, torch.device("cpu"))
        d.add_context(rows, feats[:, :4], torch.arange(4).expand(2, 4))  # a prefill
        # a tree round's commit, padded: row 1 accepted 1 token, its slot 5 is padding...
        d.add_context(rows, feats[:, 4:6], torch.tensor([[4, 5], [4, 5]]))
        for t in range(6, 10):  # ...then plain rounds: one token per row, row 1 one step behind
            pos = torch.tensor([[t], [t - 1]])
            f = feats[:, t: t + 1].clone()
            if deferred:
                d.add_context(rows, f, pos)
            else:
                d._flush()
                d._write_context(rows, f, pos)
        roots = torch.tensor([1, 2])
        runs.append(d.draft_rows(rows, roots, torch.tensor([10, 9]), None, 4, 10))
    torch.testing.assert_close(runs[0], runs[1])


# --------------------------------------------------------------------------- CLI and bench
def test_cli_budget_auto_and_errors(capsys):
    from sglang_tev.cli import main

    assert main(["generate", "--max-new-tokens", "24", "--ignore-eos", "def f(x):"]) == 0
    err = capsys.readouterr().err
    assert "budget=auto [" in err  # the summary line names the budgets the rounds ran with
    # the Python API's spelling only: no AUTO, no +5; no empty list entries; no budget where no tree is built
    for argv, flag in ((["generate", "--budget", "many", "x"], "--budget"), (["generate", "--budget", "-3", "x"], "--budget"),
                       (["generate", "--budget", "AUTO", "x"], "--budget"), (["generate", "--budget", "+5", "x"], "--budget"),
                       (["generate", "--method", "autoregressive", "--budget", "16", "x"], "--budget"),
                       (["generate", "--method", "chain", "--budget", "auto", "x"], "--budget"),
                       (["bench", "--dataset", "humaneval", "--budgets", "4,,8"], "--budgets"),
                       (["bench", "--dataset", "humaneval", "--methods", "tev,,chain"], "--methods"),
                       (["bench", "--dataset", "humaneval", "--temperatures", "0,1,"], "--temperatures"),
                       (["tune", "--verifiers", "tev,"], "--verifiers"),
                       (["generate", "--budget", "\uff15", "x"], "--budget"),  # a fullwidth 5: not a plain integer
                       (["generate", "--method", "autoregressive", "--block-size", "5", "x"], "--block-size"),
                       (["tune", "--budgets", "0,4,"], "--budgets"),
                       (["bench", "--dataset", "humaneval", "--budgets", "auto,-1"], "--budgets")):
        assert main(argv) == 2
        assert flag in capsys.readouterr().err


def test_bench_auto_row_reports_the_budgets_it_chose(tmp_path):
    from sglang_tev.hf.bench import run_bench

    gen = SpeculativeGenerator.from_pretrained()
    recs = run_bench(gen, ["def add(a, b):", "import os\n"], budgets=["auto", 16], temperatures=[0.0],
                     max_new_tokens=24, methods=["autoregressive", "tev"], repeats=1, output_dir=tmp_path / "b")
    auto = next(r for r in recs if r["budget"] == "auto")
    fixed = next(r for r in recs if r["budget"] == 16)
    assert sum(auto["budgets_chosen"].values()) == auto["rounds"] and fixed["budgets_chosen"] is None
    saved = json.loads((tmp_path / "b" / "results.json").read_text())
    assert any(r["budget"] == "auto" for r in (saved["results"] if isinstance(saved, dict) else saved))


# --------------------------------------------------------------------------- sglang-tev tune
def test_run_tune_measures_every_configuration_and_picks_the_fastest():
    from sglang_tev.hf.tune import format_tune, run_tune

    tgt = qwen3(11)
    gen = SpeculativeGenerator(tgt, OracleDrafter(tgt, V, accuracy=0.8, block_size=6))
    prompts = [[1, 5, 9, 2], [3, 3, 7], [7, 1, 4]]
    lines = []
    res = run_tune(gen, prompts, batch_sizes=[1, 3], temperatures=[0.0, 1.0], budgets=[0, 2, 6],
                   verifiers=["tev", "sequential"], max_new_tokens=12, repeats=2, progress=lines.append)
    rows = res["rows"]
    # per batch size: T = 0 plain + 2 budgets (one verifier), T = 1 plain + 2 budgets x 2 verifiers
    assert len(rows) == 2 * (3 + 5) and len(lines) == len(rows)
    for r in rows:
        assert len(r["runs"]) == 2 and r["tokens_per_s"] > 0
        if r["budget"] == 0:
            assert r["verifier"] is None and r["speculative_num_draft_tokens"] is None
            assert r["tau"] == pytest.approx(1.0) and r["vs_plain"] == pytest.approx(1.0)
        else:
            assert r["speculative_num_draft_tokens"] == r["budget"] + 1 and r["tau"] > 1.0
    assert {r["verifier"] for r in rows if r["temperature"] == 0 and r["budget"]} == {"tev"}
    for best in res["best"]:  # ranked by the within-sweep ratio to plain decoding
        group = [r for r in rows if (r["batch"], r["temperature"]) == (best["batch"], best["temperature"])]
        assert best["vs_plain"] == max(r["vs_plain"] for r in group)
    no_plain = run_tune(gen, prompts, batch_sizes=[1], temperatures=[0.0], budgets=[2, 6], max_new_tokens=6,
                        repeats=1)
    assert no_plain["best"][0]["tokens_per_s"] == max(r["tokens_per_s"] for r in no_plain["rows"])
    assert all(r["vs_plain"] is None for r in no_plain["rows"])
    table = CostTable.from_json(res["cost_table"])
    assert table.frozen and table.measured(3, 0) and table.measured(1, 6)
    text = format_tune(res)
    assert text.count("  *") == 4 and ("--speculative-num-draft-tokens" in text or "plain decoding" in text)
    # tune timed fixed trees, and SGLang's default sizes trees from the load: its lines say fixed
    tev_lines = [ln for ln in text.splitlines() if "--speculative-algorithm TEV" in ln]
    assert all("(SGLANG_TEV_BUDGET=fixed" in ln for ln in tev_lines)


def test_run_tune_refuses_bad_arguments_before_running():
    from sglang_tev.hf.tune import run_tune

    tgt = qwen3(11)
    gen = SpeculativeGenerator(tgt, OracleDrafter(tgt, V, accuracy=0.8, block_size=6))
    calls = []
    gen.generate = lambda *a, **k: calls.append(1)
    for kw, name in (({"batch_sizes": [0]}, "batch_sizes"), ({"batch_sizes": [5]}, "batch_sizes"),
                     ({"budgets": [0]}, "budgets"), ({"budgets": [-1, 4]}, "budgets"),
                     ({"verifiers": ["greedy2"]}, "verifiers"), ({"temperatures": [float("nan")]}, "temperatures"),
                     ({"max_new_tokens": 0}, "max_new_tokens"), ({"repeats": 0}, "repeats")):
        with pytest.raises(ValueError, match=name):
            run_tune(gen, [[1, 2]] * 3, **{"batch_sizes": [1, 2], **kw})
    assert not calls


def test_cli_tune_writes_a_cost_table_that_generate_reads(tmp_path, capsys):
    from sglang_tev.cli import main

    out = tmp_path / "tune.json"
    argv = ["tune", "--batch-sizes", "1,2", "--budgets", "0,4,8", "--temperatures", "0", "--max-new-tokens", "8",
            "--repeats", "1", "--output", str(out)]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "batch 1, T=0:" in cap.out and "batch 2, T=0:" in cap.out
    assert "warning: --repeats 1" in cap.err  # one timed sweep: a slow minute decides
    data = json.loads(out.read_text())
    assert data["meta"]["command"].startswith("sglang-tev tune") and len(data["best"]) == 2
    assert set(data["cost_table"]["seconds"]) == {"1", "2"}
    assert main(argv) == 2 and "--output" in capsys.readouterr().err  # exists: refused
    assert data["meta"]["dtype"] in ("float32", "bfloat16")  # the default dtype of this machine
    assert main(["generate", "--cost-table", str(out), "--max-new-tokens", "12", "--ignore-eos", "def f(x):"]) == 0
    err = capsys.readouterr().err
    assert "budget=auto [" in err and "warning" not in err  # the dtype it was timed in
    # a table timed in another dtype is read (the user chose it) with one warning naming both
    data["meta"]["dtype"] = "float16"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert main(["generate", "--cost-table", str(other), "--max-new-tokens", "4", "def f(x):"]) == 0
    err = capsys.readouterr().err
    assert f"--cost-table {other} was timed with float16 weights and this run loads" in err and "budget=auto [" in err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    for argv, flag in ((["generate", "--cost-table", str(bad), "x"], "--cost-table"),
                       (["generate", "--cost-table", str(tmp_path / "none.json"), "x"], "--cost-table"),
                       (["generate", "--cost-table", str(tmp_path), "x"], "is a directory"),
                       (["generate", "--cost-table", str(out), "--budget", "16", "x"], "--cost-table"),
                       (["generate", "--cost-table", str(out), "--method", "chain", "x"], "--cost-table"),
                       (["tune", "--budgets", "0"], "--budgets"), (["tune", "--verifiers", "greedy"], "--verifiers"),
                       (["tune", "--batch-sizes", "0"], "--batch-sizes"), (["tune", "--output", str(tmp_path)], "--output")):
        assert main(argv) == 2
        assert flag in capsys.readouterr().err


def test_a_frozen_table_is_chosen_within_and_one_without_trees_is_refused(tmp_path):
    """A tune table that timed only some budgets: auto never runs a budget it holds no cost for
    (a frozen table times nothing, so calibrating the largest grid budget would never end)."""
    frozen = CostTable.from_json({"seconds": {"1": {"0": 0.010, "4": 0.030}}})
    ctl = BudgetController(DEFAULT_GRID, frozen)
    picks = _run(ctl, 40, {b: 0.3 for b in DEFAULT_GRID}, {b: 0.02 for b in DEFAULT_GRID})
    assert set(picks) <= {0, 4} and picks.count(0) > 30  # 1.3 tokens per 30 ms loses to 1 per 10 ms
    # where its tree wins, that tree: not budget 2, whose cost the fit would hold at 4's (a tie
    # the smaller budget would win) although the table never timed it
    fast = BudgetController(DEFAULT_GRID, CostTable.from_json({"seconds": {"1": {"0": 0.030, "4": 0.010}}}))
    picks = _run(fast, 40, {b: 0.3 for b in DEFAULT_GRID}, {b: 0.02 for b in DEFAULT_GRID})
    assert set(picks) <= {0, 4} and picks.count(4) > 30
    for bad, match in (({"seconds": {"1": {"16": True}}}, "not a number"), ({"seconds": {"1": {"5000": 0.1}}}, "budgets in 0..1024"),
                       ({}, "expected a JSON object"), ({"cost_table": None}, "expected a JSON object"),
                       ({"seconds": {"0": {"4": 0.1}}}, "batch sizes must be >= 1")):
        with pytest.raises(ValueError, match=match):
            CostTable.from_json(bad.get("cost_table", bad) if "cost_table" in bad else bad)
    for bad in ({"seconds": {}}, {"seconds": {"1": {"0": 0.01}}}):
        with pytest.raises(ValueError, match="cost_table: holds no tree budget"):
            CostTable.from_json(bad)
