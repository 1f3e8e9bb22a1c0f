"""The load-adaptive planner (sglang_tev.planner, sglang_tev.plan.TreePlanner): its allocation equals
brute force, its calibration converges to a known reach law, its plans stay within the capacity,
and the path scores it reads are the builders' own."""

import itertools
import math
import random

import pytest
import torch

from sglang_tev.draft.ddtree import build_ddtree
from sglang_tev.draft.lattice import build_lattice_tree
from sglang_tev.autobudget import BudgetController, CostTable
from sglang_tev.plan import RoundPlan, TreePlanner
from sglang_tev.planner import SCORE_EDGES, ReachCalibration, allocate, node_path_scores, regime_of
from sglang_tev.spec import SpecError


def _brute(values, cost, layout, rate):
    b = len(values)
    best = None
    for budgets in itertools.product(*[range(len(r) + 1) for r in values]):
        size = sum(budgets) if layout == "ragged" else max(budgets)
        sec = cost(size)
        if sec is None:
            continue
        if layout == "padded" and any(x != min(size, len(r)) for x, r in zip(budgets, values)):
            # padded: every row pays for the width; fewer nodes than it never help
            continue
        tokens = b + sum(sum(r[:x]) for r, x in zip(values, budgets))
        key = tokens / sec if rate is None else tokens - rate * sec
        if best is None or key > best + 1e-12:
            best = key
    return best


def _random_case(rng):
    b = rng.randint(1, 3)
    values = [sorted((rng.random() ** 2 for _ in range(rng.randint(0, 4))), reverse=True) for _ in range(b)]
    base, per, jump = rng.uniform(0.5, 2), rng.uniform(0.01, 0.5), rng.uniform(0, 0.5)
    holes = {s for s in range(13) if rng.random() < 0.2}
    return values, (lambda s: None if s in holes else base + per * s + (jump if s > 4 else 0.0))


@pytest.mark.parametrize("layout", ["ragged", "padded"])
@pytest.mark.parametrize("use_rate", [False, True])
def test_allocation_equals_brute_force_on_small_cases(layout, use_rate):
    rng = random.Random(7 + use_rate + 10 * (layout == "padded"))
    checked = 0
    for _ in range(300):
        values, cost = _random_case(rng)
        rate = rng.uniform(0.5, 4) if use_rate else None
        got = allocate(values, cost, layout=layout, rate=rate)
        want = _brute(values, cost, layout, rate)
        if want is None:
            assert got is None
            continue
        key = got.tokens / got.seconds if rate is None else got.tokens - rate * got.seconds
        assert key == pytest.approx(want, abs=1e-9)
        # the budgets are what the objective was read at
        assert got.tokens == pytest.approx(len(values) + sum(sum(r[:x]) for r, x in zip(values, got.budgets)))
        assert all(0 <= x <= len(r) for x, r in zip(got.budgets, values))
        assert got.size == (sum(got.budgets) if layout == "ragged" else max(got.budgets))
        checked += 1
    assert checked > 200


def test_ragged_allocation_ranks_nodes_of_all_rows_together():
    # a confident row and an unconfident one: at a cost of 0.3 s per node and a rate of 2 tok/s,
    # every node worth more than 0.6 tokens joins, whichever row it is in
    values = [[0.95, 0.9, 0.8, 0.7], [0.5, 0.1]]
    got = allocate(values, lambda s: 1.0 + 0.3 * s, layout="ragged", rate=2.0)
    assert got.budgets == (4, 0)
    # only the sizes given are chosen
    got = allocate(values, lambda s: 1.0 + 0.3 * s, layout="ragged", sizes=[0, 2], rate=2.0)
    assert got.budgets == (2, 0) and got.size == 2


def test_allocation_refuses_bad_values_by_name():
    with pytest.raises(SpecError, match="values"):
        allocate([], lambda s: 1.0)
    with pytest.raises(SpecError, match="non-increasing"):
        allocate([[0.2, 0.5]], lambda s: 1.0)
    with pytest.raises(SpecError, match=r"\[0, 1\]"):
        allocate([[1.5]], lambda s: 1.0)
    with pytest.raises(SpecError, match="layout"):
        allocate([[0.5]], lambda s: 1.0, layout="packed")
    with pytest.raises(SpecError, match="rate"):
        allocate([[0.5]], lambda s: 1.0, rate=0.0)
    with pytest.raises(ValueError, match="cost"):
        allocate([[0.5]], lambda s: 0.0)


def test_calibration_converges_to_a_known_reach_law():
    # synthetic rounds: a node of score s is reached with probability 0.8 * exp(s / 2)
    # (an over-confident drafter at the top, under-confident deep)
    rng = random.Random(0)
    law = lambda s: 0.8 * math.exp(s / 2)  # noqa: E731
    cal = ReachCalibration(alpha=0.002)
    for _ in range(4000):
        scores = sorted((-rng.expovariate(0.5) for _ in range(16)), reverse=True)
        cal.update("T1", scores, [float(rng.random() < law(s)) for s in scores])
    table = cal.table("T1")
    assert all(a >= b for a, b in zip(table, table[1:]))  # non-increasing
    for i in range(len(SCORE_EDGES) - 2):
        hi, lo = SCORE_EDGES[i], SCORE_EDGES[i + 1]
        if lo < -8:  # too few labels that deep
            break
        assert law(lo) - 0.05 <= table[i] <= law(hi) + 0.05, (i, table[i], law(hi), law(lo))
    # greedy rows keep their own regime; before any label a regime reads the prior exp(s)
    assert cal.value("greedy", -0.6) == pytest.approx(math.exp(-0.6), rel=1e-9)
    assert regime_of(0.0) == "greedy" and regime_of(0.7) == "T0.7" and regime_of(1.0) == "T1"


def test_calibration_round_trips_and_refuses_foreign_data():
    cal = ReachCalibration()
    cal.update("greedy", [-0.1, -3.0], [1.0, 0.0])
    back = ReachCalibration.from_json(cal.to_json())
    assert back.table("greedy") == cal.table("greedy")
    data = cal.to_json()
    data["edges"] = [0.0, -1.0]
    with pytest.raises(ValueError, match="score bins"):
        ReachCalibration.from_json(data)
    data = cal.to_json()
    data["means"]["greedy"] = [2.0] * len(SCORE_EDGES)
    with pytest.raises(ValueError, match="out of range"):
        ReachCalibration.from_json(data)
    with pytest.raises(SpecError, match="alpha"):
        ReachCalibration(alpha=0)


def test_node_path_scores_are_the_builders_scores():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 11, generator=g) * 2
    roots = torch.tensor([1, 2])
    tree = build_ddtree(logits, 9, roots)
    got = node_path_scores(tree, logits)
    lq = torch.log_softmax(logits.double(), -1)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for r in range(2):
        want = [0.0]
        for i in range(1, tree.num_nodes):
            if not bool(tree.valid[r, i]):
                assert got[r, i] == float("-inf")
                continue
            want.append(want[parents[r][i]] + float(lq[r, int(tree.depth[r, i]) - 1, tokens[r][i]]))
            assert float(got[r, i]) == pytest.approx(want[i], abs=1e-5)
        # best-first: scores in pop order never increase
        row = [x for x in got[r, 1:].tolist() if x != float("-inf")]
        assert all(a >= b - 1e-9 for a, b in zip(row, row[1:]))


def test_node_path_scores_from_top_k_lists_equal_the_full_logits_ones():
    """The SGLang worker's marginal mode hands the top-k lists (log q normalised over the whole
    vocabulary): the scores equal those read from the full logits."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 13, generator=g) * 2
    tree = build_ddtree(logits, 12, torch.tensor([1, 2, 3]))
    lq = torch.log_softmax(logits.double(), -1)
    vals, ids = lq.topk(6, dim=-1)
    got = node_path_scores(tree, (vals.float(), ids))
    want = node_path_scores(tree, logits)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], atol=1e-5)


def test_node_path_scores_follow_the_lattice_transition_rows():
    g = torch.Generator().manual_seed(5)
    b, D, k = 2, 3, 4
    ids = torch.stack([torch.randperm(20, generator=g)[:k] for _ in range(b * D)]).view(b, D, k)
    trans = torch.log_softmax(torch.randn(b, D, k, k, generator=g) * 2, -1)
    tree = build_lattice_tree(ids, trans, 10, torch.tensor([0, 1]))
    got = node_path_scores(tree, type("L", (), {"candidate_ids": ids, "transition_logq": trans})())
    for r in range(b):
        score, cand = {0: 0.0}, {0: 0}
        for i in range(1, tree.num_nodes):
            if not bool(tree.valid[r, i]):
                continue
            d, p, t = int(tree.depth[r, i]), int(tree.parents[r, i]), int(tree.tokens[r, i])
            c = ids[r, d - 1].tolist().index(t)
            row = 0 if d == 1 else cand[p]
            score[i], cand[i] = score[p] + float(trans[r, d - 1, row, c]), c
            assert float(got[r, i]) == pytest.approx(score[i], abs=1e-5)


def _planner(grid=(0, 2, 4, 8, 16)):
    costs = CostTable(load_correction=False)
    for bs in (1, 4):
        costs.set(bs, 0, 1.0 * bs, count=10)
        for w in grid[1:]:
            costs.set(bs, w, (1.3 + 0.05 * w) * bs, count=10)
    ctl = BudgetController(grid, costs, explore_share=0.0)
    for w in grid[1:]:
        ctl.learn_gains(grid[-1], [[min(0.9 * x, 3.0) for x in ctl.grid_upto(grid[-1])]])
    for bs in (1, 4):
        st = ctl.state(bs)
        st.calibrated = True
    return TreePlanner(ctl, block_size=16)


def test_planner_plans_never_exceed_the_capacity_and_cut_to_the_draft():
    pol = _planner()
    rng = random.Random(1)
    widths = set()
    for _ in range(200):
        batch = rng.choice([1, 4])
        plan = pol.plan(batch)
        assert isinstance(plan, RoundPlan) and plan.budget <= pol.capacity == 16
        confident = rng.random() < 0.5
        scores = [sorted(((-rng.random() * (0.05 if confident else 6)) for _ in range(plan.budget)), reverse=True)
                  for _ in range(batch)]
        out = pol.refine(plan, scores, ["greedy"] * batch)
        assert out.budget <= plan.budget <= pol.capacity and len(out.budgets) == batch
        assert out.reach_at == tuple(pol.controller.grid_upto(out.budget))
        widths.add((confident, out.budget))
        reach = [[1.0] + [1.0 if confident else 0.0] * out.budget for _ in range(batch)]
        cum = [[float(min(x, out.budget)) if confident else 0.0 for x in out.reach_at] for _ in range(batch)]
        pol.observe(out, cum, 1.0, reach_nodes=reach)
    # confident drafts get wider trees than unconfident ones
    conf = [w for c, w in widths if c]
    unconf = [w for c, w in widths if not c]
    assert conf and unconf and max(conf) > min(unconf)
    with pytest.raises(SpecError, match="rate_alpha"):
        TreePlanner(pol.controller, rate_alpha=0)


def _ragged_planner():
    pol = _planner()
    return TreePlanner(pol.controller, block_size=16, layout="ragged")


def test_ragged_refine_equals_brute_force_over_per_row_budgets():
    # every vector of per-row budgets up to the uniform width the padded allocation picks (itself
    # checked against brute force above), charged as a uniform round of total / batch nodes (the
    # table interpolated between integer widths, at least width 1), scored tokens - rate * seconds
    rng = random.Random(3)
    checked = 0
    for _ in range(40):
        pol = _ragged_planner()
        batch = 4
        pol._rate[batch] = [rng.uniform(2, 8), 4.0]  # a rate of 0.5-2 tok/s
        plan = pol.plan(batch)
        assert plan.budget > 0 and getattr(plan, "refinable", False)
        scores = [sorted((-rng.random() * rng.choice([0.05, 1, 6]) for _ in range(rng.randint(0, 4))), reverse=True)
                  for _ in range(batch)]
        out = pol.refine(plan, scores, ["greedy"] * batch)
        values = [pol.calibration.values("greedy", s) for s in scores]
        costs, rate = pol.controller.costs, pol.rate(batch)
        sizes = pol.controller.grid_upto(plan.budget)
        alloc = allocate(values, lambda w: costs.cost(batch, w), layout="padded", sizes=sizes, rate=rate)
        width = plan.budget if alloc is None else max(1, alloc.size)
        width = min(plan.budget, next((g for g in sizes if g >= width), plan.budget))
        values = [v[:width] for v in values]

        def seconds(total):
            w = max(1.0, total / batch)
            lo = int(w)
            c0, c1 = costs.cost(batch, lo), costs.cost(batch, lo + 1)
            return c0 + (c1 - c0) * (w - lo)

        best, best_b = None, None
        for budgets in itertools.product(*[range(len(v) + 1) for v in values]):
            if sum(budgets) == 0:
                continue
            key = batch + sum(sum(v[:x]) for v, x in zip(values, budgets)) - rate * seconds(sum(budgets))
            if best is None or key > best + 1e-12:
                best, best_b = key, budgets
        if best is None:  # no node drafted: the plan stays uniform
            assert not out.ragged
            continue
        got = batch + sum(sum(v[:x]) for v, x in zip(values, out.budgets)) - rate * seconds(sum(out.budgets))
        assert got == pytest.approx(best, abs=1e-9), (out.budgets, best_b)
        assert all(0 <= x <= len(v) for x, v in zip(out.budgets, values)) and out.budget <= width
        # the controller learns gains only from sub-budgets every row verified in full
        assert out.reach_at == tuple(pol.controller.grid_upto(min(out.budgets)))
        checked += out.ragged
    assert checked >= 10


def test_ragged_rounds_label_each_row_only_up_to_its_own_cut():
    pol = _ragged_planner()
    plan = pol.plan(2)
    # row 0 confident, row 1 not: the ranking gives row 0 its nodes and row 1 none
    out = pol.refine(plan, [[-0.01] * plan.budget, [-9.0] * plan.budget], ["greedy", "greedy"])
    assert out.ragged and out.budgets[1] < out.budgets[0], out.budgets
    before = [list(x) for x in pol.calibration._regime("greedy")]
    seen = []
    pol.calibration.update = lambda g, s, p: seen.append((g, list(s), list(p)))
    n0, n1 = out.budgets
    # reach as verified: row 1's nodes past its cut were not verified (reach 0 in the exit law)
    reach = [[1.0] + [0.9] * n0 + [0.0] * (plan.budget - n0), [1.0] + [0.5] * n1 + [0.0] * (plan.budget - n1)]
    cum = [[0.9 * min(x, n0) for x in out.reach_at], [0.5 * min(x, n1) for x in out.reach_at]] if out.reach_at else None
    pol.observe(out, cum, 2.0, reach_nodes=reach)
    assert [len(s) for _, s, _ in seen] == [n0, n1] and all(p == [0.9] * n0 or p == [0.5] * n1 for _, _, p in seen)
    assert before  # the calibration held its prior before
    # timed as the uniform round of the same token count
    w_eq = max(1, round((n0 + n1) / 2))
    assert pol.controller.costs.measured(2, w_eq)
    # expected tokens of the round: one per row plus every verified node's reach
    assert pol._rate[2][0] == pytest.approx(2 + 0.9 * n0 + 0.5 * n1)


def test_cut_rows_keeps_each_rows_best_first_prefix():
    from sglang_tev.plan import cut_rows

    g = torch.Generator().manual_seed(0)
    lq = torch.log_softmax(torch.randn(3, 4, 30, generator=g), -1)
    tree = build_ddtree(lq, 8, torch.tensor([1, 2, 3]))
    out = cut_rows(tree, [5, 0, 2])
    assert out.num_nodes == 6 and out.valid.sum(1).tolist() == [6, 1, 3]
    for b, n in enumerate([6, 1, 3]):
        assert torch.equal(out.tokens[b, :n], tree.tokens[b, :n]) and torch.equal(out.parents[b, 1:n], tree.parents[b, 1:n])
        assert torch.equal(out.ancestor_mask[b, :n, :n], tree.ancestor_mask[b, :n, :n])
    assert cut_rows(tree, [3, 3, 3]).valid.all()
    for bad in ([1, 2], [1, -1, 2], [1, 2.0, 3], [True, 1, 1]):
        with pytest.raises(ValueError, match="budgets must be 3 non-negative ints"):
            cut_rows(tree, bad)
    with pytest.raises(SpecError, match="layout"):
        TreePlanner(_planner().controller, layout="jagged")
