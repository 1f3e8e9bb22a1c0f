"""``SGLANG_TEV_BUDGET=auto``'s policy in the SGLang worker (``sglang_tev/srt/budget.py``): the
grid under the capacity, the calibration's first widths, a steady round cut to the planner's
width (a best-first prefix of the tree it was built as), plain steps as root-only trees."""

from __future__ import annotations

import pytest
import torch

from sglang_tev import build_ddtree
from sglang_tev.autobudget import CostTable
from sglang_tev.srt.budget import ServedBudget, budget_grid
from sglang_tev.tree import root_only_tree


def test_grid_under_the_capacity():
    assert budget_grid(16) == (0, 2, 4, 8, 16)
    assert budget_grid(64) == (0, 2, 4, 8, 16, 24, 32, 48, 64)
    assert budget_grid(11) == (0, 2, 4, 8, 11)
    assert budget_grid(1) == (0, 1)
    with pytest.raises(ValueError, match="capacity"):
        budget_grid(0)


def test_root_only_tree_is_a_plain_step():
    t = root_only_tree(torch.tensor([5, 7]))
    assert t.num_nodes == 1 and t.tokens.tolist() == [[5], [7]] and t.parents.tolist() == [[-1], [-1]]


def test_rounds_calibrate_then_cut_steady_trees_to_a_prefix():
    """Synthetic rounds (a fixed cost per node, a known reach law): the first rounds calibrate at
    the capacity, plain decoding and a middle width; later steady rounds are cut, and a cut tree is
    the first w + 1 nodes of the tree it was built as."""
    now = [0.0]
    served = ServedBudget(16, block_size=8, costs=CostTable(load_correction=False), clock=lambda: now[0])
    g = torch.Generator().manual_seed(0)
    seen, cuts = [], 0
    for _ in range(120):
        plan = served.plan(2)
        b = plan.budget
        if b == 0:
            tree, drafted = root_only_tree(torch.tensor([1, 2])), None
        else:
            logits = torch.randn(2, 7, 20, generator=g) * 3
            tree = build_ddtree(logits, b, torch.tensor([1, 2]))
            drafted = logits
            before = tree
            plan, tree = served.refine(plan, tree, drafted, [0.0, 1.0])
            if tree.num_nodes < before.num_nodes:
                cuts += 1
                n = tree.num_nodes
                assert torch.equal(tree.tokens, before.tokens[:, :n]) and torch.equal(tree.parents, before.parents[:, :n])
        seen.append(plan.budget)
        # reach: the first nodes of each tree are likely, the rest are not; cost grows with nodes
        n = tree.num_nodes
        reach = [[1.0] + [0.8 ** i for i in range(1, n)] for _ in range(2)]
        cum = None if drafted is None else [[sum(r[1:x + 1]) for x in plan.reach_at] for r in reach]
        now[0] += 0.001 * (1 + 0.1 * n)  # the round took 1 ms plus 0.1 ms per node
        served.observe(plan, cum, reach if drafted is not None else None)
    assert seen[0] == 16 and 0 in seen[:10]  # calibration: the capacity, then plain decoding
    assert set(seen) <= set(budget_grid(16)) and served.rounds == 120
    assert cuts > 0, (seen, served.planner.widths)


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_tp_followers_adopt_rank0s_plans_whatever_their_own_clocks_say(layout):
    """TP: rank 0 (leader) and rank 1 (follower) run the same rounds in lockstep through a
    broadcast that hands rank 0's objects to rank 1 (as SGLang's ``broadcast_object``). The
    follower's clock says every node costs 100x more (the round's fixed part the same), yet it runs rank 0's width every round and
    cuts its own tree (built from the same draft) exactly as rank 0 cut its, per request under the
    ragged layout. Control: the same follower deciding alone (no broadcast) parts from rank 0."""

    ragged = [0]

    def run(follower_broadcast: bool):
        clocks = [[0.0], [0.0]]
        channel = []

        def bcast(rank):
            def f(obj):
                if rank == 0:
                    channel.append(obj)
                    return obj
                return channel.pop(0)
            return f

        leader = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=lambda: clocks[0][0], broadcast=bcast(0),
                              layout=layout)
        follower = (
            ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=lambda: clocks[1][0], broadcast=bcast(1),
                         leader=False, layout=layout)
            if follower_broadcast
            else ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=lambda: clocks[1][0], layout=layout)
        )
        g = torch.Generator().manual_seed(0)
        widths = []
        for _ in range(80):
            logits = torch.randn(2, 7, 20, generator=g) * torch.tensor([3.0, 1.0]).view(2, 1, 1)
            pair = []
            for rank, served in enumerate((leader, follower)):
                plan = served.plan(2)
                tree, drafted = root_only_tree(torch.tensor([1, 2])), None
                if plan.budget:
                    tree, drafted = build_ddtree(logits, plan.budget, torch.tensor([1, 2])), logits
                    plan, tree = served.refine(plan, tree, drafted, [0.0, 1.0])
                n = tree.num_nodes
                reach = [[1.0] + [0.8 ** i for i in range(1, n)] for _ in range(2)]
                cum = None if drafted is None else [[sum(r[1:x + 1]) for x in plan.reach_at] for r in reach]
                clocks[rank][0] += 0.001 + 0.0001 * n * (1 if rank == 0 else 100)
                served.observe(plan, cum, reach if drafted is not None else None)
                pair.append((plan, tree))
            widths.append((pair[0][1].num_nodes, pair[1][1].num_nodes))
            if follower_broadcast:
                (p0, t0), (p1, t1) = pair
                assert p1 == p0 and torch.equal(t1.tokens, t0.tokens) and torch.equal(t1.parents, t0.parents)
                assert torch.equal(t1.valid, t0.valid) and t0.valid.sum(1).tolist() == [
                    min(b + 1, t0.num_nodes) for b in p0.budgets] if p0.budget else True
                ragged[0] += p0.ragged
        return widths, follower

    widths, follower = run(True)
    assert all(a == b for a, b in widths) and len({a for a, _ in widths}) > 2  # widths changed, in step
    assert follower.rounds == 80
    assert (ragged[0] > 0) == (layout == "ragged"), ragged  # rows of different widths in the same round
    alone, _ = run(False)
    assert any(a != b for a, b in alone), alone  # without adoption the ranks would part


def test_a_follower_needs_a_broadcast():
    with pytest.raises(ValueError, match="broadcast"):
        ServedBudget(16, 8, leader=False)


def _serve_round(served, all_greedy: bool, ratio: float, g, tree_extra: float = 0.0, gap: float = 0.0) -> int:
    """One synthetic round of batch 2: node i of a tree is reached with probability ``ratio ** i``;
    the round costs 1 ms plus 0.1 ms per node, plus ``tree_extra`` seconds when it has a tree;
    ``gap`` seconds pass after it (SGLang's work before the next round). Returns its width."""
    plan = served.plan(2, all_greedy)
    tree, drafted = root_only_tree(torch.tensor([1, 2])), None
    if plan.budget:
        drafted = torch.randn(2, 7, 20, generator=g) * 3
        tree = build_ddtree(drafted, plan.budget, torch.tensor([1, 2]))
        plan, tree = served.refine(plan, tree, drafted, [0.0, 0.0] if all_greedy else [1.0, 1.0])
    n = tree.num_nodes
    reach = [[1.0] + [ratio ** i for i in range(1, n)] for _ in range(2)]
    cum = None if drafted is None else [[sum(r[1:x + 1]) for x in plan.reach_at] for r in reach]
    served.clock.now += 0.001 * (1 + 0.1 * n) + (tree_extra if n > 1 else 0.0)
    served.observe(plan, cum, reach if drafted is not None else None)
    served.clock.now += gap
    return plan.budget


def _serve_rounds(served, rounds: int, all_greedy: bool, ratio: float, g) -> list[int]:
    """``rounds`` rounds of :func:`_serve_round` under one law. Returns the widths run."""
    return [_serve_round(served, all_greedy, ratio, g) for _ in range(rounds)]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_greedy_and_sampled_batches_keep_their_own_controllers():
    """A server's traffic changes law: greedy rounds where trees pay (reach 0.8^i), then sampled
    rounds where no tree pays (reach 0.05^i). With one controller per law the sampled rounds run
    plain decoding once their controller has calibrated, and greedy traffic coming back runs trees
    at once; the control (one law for every round, as before) keeps running the greedy trees into
    the sampled traffic."""
    g = torch.Generator().manual_seed(0)
    served = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    greedy = _serve_rounds(served, 150, True, 0.8, g)
    assert sum(w > 0 for w in greedy[-50:]) >= 45, greedy[-50:]  # trees pay: the greedy law runs them
    sampled = _serve_rounds(served, 150, False, 0.05, g)
    assert sum(w == 0 for w in sampled[-100:]) >= 90, sampled[-100:]  # its own controller: plain steps
    assert set(served.planners) == {"greedy", "sampled"}
    back = _serve_rounds(served, 10, True, 0.8, g)
    assert all(w > 0 for w in back), back  # the greedy controller kept what it learned

    control = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    _serve_rounds(control, 150, True, 0.8, g)
    mixed = _serve_rounds(control, 150, True, 0.05, g)  # the same sampled rounds, read as one law
    assert sum(w > 0 for w in mixed[-100:]) > sum(w > 0 for w in sampled[-100:]), (mixed[-100:], sampled[-100:])


def test_each_round_is_charged_the_schedulers_work_between_rounds():
    """Every step pays SGLang's work outside the round once (the median gap from a round's end to
    the next one's start), so the cost of a round is its own seconds plus that. Here trees cost 2 ms
    more than a plain step (1.1 ms) and gain ~0.65 tokens: counted alone they lose to plain steps,
    but with 8 ms of scheduler work per step they win by ~30 %, and the server runs them. Idle
    seconds between requests (even after every other round) are not read as that work."""
    g = torch.Generator().manual_seed(0)
    alone = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    widths = [_serve_round(alone, True, 0.4, g, tree_extra=0.002) for _ in range(300)]
    assert sum(w == 0 for w in widths[-100:]) >= 90 and alone.overhead == 0.0  # no gap: plain steps win
    served = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    widths = [_serve_round(served, True, 0.4, g, tree_extra=0.002, gap=1.0 if k % 50 == 49 else 0.008)
              for k in range(300)]
    assert served.overhead == pytest.approx(0.008)
    assert sum(w > 0 for w in widths[-100:]) >= 90, widths[-100:]
    # short requests: an idle second after every other round is half the gaps, still not the overhead
    short = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    widths = [_serve_round(short, True, 0.1, g, tree_extra=0.002, gap=1.0 if k % 2 else 0.008) for k in range(300)]
    assert short.overhead == pytest.approx(0.008) and sum(w == 0 for w in widths[-100:]) >= 90
    plan = served.plan(2, True)
    served.clock.now += 0.001
    assert served.observe(plan, None, None) == pytest.approx(0.001 + 0.008)  # what the planner was charged


def _serve_law_blocks(served, blocks: int, g) -> tuple[list[int], list[int]]:
    """Traffic alternating every 20 rounds between greedy and sampled batches with the same
    reach law (0.5^i), where a sampled tree round costs 2.5 ms more than a greedy one (its verify
    computes the exit law): trees pay under the greedy law (1 ms + 0.1 ms per node), not under the
    sampled one. Returns the widths of the greedy and the sampled rounds of the second half.
    (0.6^i until the planner's segment correction, 2026-12-07: with node values that match the
    reach, a greedy tree of 0.6^i paid even at the shared table's mixed costs.)"""
    greedy, sampled = [], []
    for k in range(blocks):
        law_greedy = k % 2 == 0
        for _ in range(20):
            w = _serve_round(served, law_greedy, 0.5, g, tree_extra=0.0 if law_greedy else 0.0025)
            if k >= blocks // 2:
                (greedy if law_greedy else sampled).append(w)
    return greedy, sampled


def test_each_law_times_its_own_rounds():
    """Greedy and sampled batches alternate; the sampled law's tree rounds cost more (2.5 ms) with
    the same reach. With a cost table per law the greedy rounds run trees and the sampled ones plain
    steps, each table holding its own law's tree seconds; the control (both laws reading one table,
    as before) prices one law's trees at the other's seconds: here the sampled trees at the greedy
    ones'. (Until the segment correction stopped learning from refined rounds, 2026-12-07, that
    control also made the greedy rounds stop running trees; the sampled law's trials, which time
    both regimes raw in the same minutes, now keep both laws' choices right even on one table.)"""
    g = torch.Generator().manual_seed(0)
    served = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    greedy, sampled = _serve_law_blocks(served, 20, g)
    assert set(served.cost_tables) == {"greedy", "sampled"}
    assert served.cost_tables["sampled"].load_correction is False  # the greedy table's settings
    assert sum(w > 0 for w in greedy) >= 0.9 * len(greedy), greedy
    assert sum(w == 0 for w in sampled) >= 0.9 * len(sampled), sampled

    shared = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    shared.cost_tables["sampled"] = shared.cost_tables["greedy"]  # the control: one table for both laws
    _serve_law_blocks(shared, 20, g)
    own, other = served.cost_tables["sampled"], served.cost_tables["greedy"]
    timed = [b for b in (2, 4, 8, 16) if own.raw(2, b)]
    assert timed, "the sampled law timed none of its trees"
    for b in timed:  # each law's table: its own trees' seconds (1 ms + 0.1 ms a node, + 2.5 ms sampled)
        assert own.cost(2, b) - other.cost(2, b) == pytest.approx(0.0025, abs=3e-4), (b, own.cost(2, b), other.cost(2, b))
        # one table for both laws: the sampled trees read at the greedy ones' seconds
        assert shared.cost_tables["sampled"].cost(2, b) < own.cost(2, b) - 0.002


def test_bad_arguments_and_rounds_out_of_order_are_refused():
    for cap in (0, True, 1.5, "16", None):
        with pytest.raises(ValueError, match="capacity"):
            ServedBudget(cap, 8)
    for k in (0, 1, True, None, 8.0):
        with pytest.raises(ValueError, match="block_size"):
            ServedBudget(16, k)
    with pytest.raises(ValueError, match="layout"):
        ServedBudget(16, 8, layout="jagged")
    served = ServedBudget(16, 8, costs=CostTable(load_correction=False), clock=_Clock())
    for bs in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="bs"):
            served.plan(bs)
    with pytest.raises(ValueError, match="all_greedy"):
        served.plan(2, "False")
    with pytest.raises(RuntimeError, match="plan"):
        served.observe(None, None, None)  # no round open
    tree = root_only_tree(torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="plan"):
        served.refine(None, tree, None, [0.0, 0.0])
    plan = served.plan(2, False)
    served.observe(plan, None, None)
    with pytest.raises(RuntimeError, match="plan"):
        served.observe(plan, None, None)  # observed twice
    assert served.rounds == 1 and served.law == "sampled"
    follower = ServedBudget(16, 8, broadcast=lambda obj: obj, leader=False)
    with pytest.raises(RuntimeError, match="follower"):
        follower.planner
