"""``SGLANG_TEV_BUDGET=auto`` keeps what it learned across server starts (``sglang_tev/srt/plan_store.py``):
a restarted server's planner starts steady from the saved cost tables, gains and reach calibration;
a file written for another key is not trusted; an unwritable folder never fails a round."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang_tev import build_ddtree
from sglang_tev.autobudget import CostTable
from sglang_tev.costs import RESTORED_MIN_ROUNDS
from sglang_tev.srt.budget import ServedBudget
from sglang_tev.srt.plan_store import ServedPlanStore
from sglang_tev.tree import root_only_tree

KEY = {"schema": 1, "runtime": "sglang", "target": "t", "drafter": "d", "capacity": 16, "block_size": 8}


def _serve(served: ServedBudget, rounds: int, all_greedy: bool = True, seed: int = 0) -> list[int]:
    """Synthetic rounds (1 ms + 0.1 ms a node, reach 0.8 ** depth-ish): the widths planned."""
    now = [0.0]
    served.clock = lambda: now[0]
    g = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(rounds):
        plan = served.plan(2, all_greedy)
        seen.append(plan.budget)
        tree, drafted = root_only_tree(torch.tensor([1, 2])), None
        if plan.budget:
            logits = torch.randn(2, 7, 20, generator=g) * 3
            tree, drafted = build_ddtree(logits, plan.budget, torch.tensor([1, 2])), logits
            plan, tree = served.refine(plan, tree, drafted, [0.0, 0.0] if all_greedy else [1.0, 1.0])
        n = tree.num_nodes
        reach = [[1.0] + [0.8 ** i for i in range(1, n)] for _ in range(2)]
        cum = None if drafted is None else [[sum(r[1:x + 1]) for x in plan.reach_at] for r in reach]
        now[0] += 0.001 * (1 + 0.1 * n)
        served.observe(plan, cum, reach if drafted is not None else None)
    return seen


def test_a_restarted_server_starts_where_the_last_one_left_off(tmp_path):
    first = ServedBudget(16, 8, costs=CostTable(load_correction=False))
    cold = _serve(first, 60)
    _serve(first, 30, all_greedy=False, seed=1)
    assert cold[0] == 16 and 0 in cold[:5]  # a cold server calibrates: the capacity, a plain step, ...
    ServedPlanStore(KEY, tmp_path).save_from(first)
    assert len(list(tmp_path.iterdir())) == 2  # one file per target law

    second = ServedBudget(16, 8, costs=CostTable(load_correction=False))
    assert ServedPlanStore(KEY, tmp_path).load_into(second) == ["greedy", "sampled"]
    for law in ("greedy", "sampled"):
        # tree costs timed in fewer than RESTORED_MIN_ROUNDS rounds are left out (timed again)
        want = first.cost_tables[law].to_json()
        keep = {b: {k for k, c in r.items() if k == "0" or c >= RESTORED_MIN_ROUNDS} for b, r in want["counts"].items()}
        want = {f: {b: {k: v for k, v in r.items() if k in keep[b]} for b, r in want[f].items()} for f in want}
        want = {f: {b: r for b, r in rows.items() if r} for f, rows in want.items()}
        assert second.cost_tables[law].to_json() == want
        second.law = law  # the planner of that law, built over the restored gains
        assert second.planner.controller.gain == first.planners[law].controller.gain
    assert second.calibration.to_json() == first.calibration.to_json()
    warm = _serve(second, 10)
    # no calibration round: neither the capacity's nor a plain step opens the restarted server
    assert 0 not in warm[:5] and warm[0] == cold[-1], (cold[-10:], warm)
    # a server with nothing saved yet restores nothing
    assert ServedPlanStore(KEY, tmp_path / "empty").load_into(ServedBudget(16, 8)) == []


def test_a_file_for_another_key_is_not_trusted(tmp_path, caplog):
    first = ServedBudget(16, 8, costs=CostTable(load_correction=False))
    _serve(first, 40)
    store = ServedPlanStore(KEY, tmp_path)
    store.save_from(first)
    # the same file name, another key inside (a hand-copied file): refused with a warning
    other = ServedPlanStore({**KEY, "capacity": 64}, tmp_path)
    for law, f in other.files.items():
        f.path = store.files[law].path
    second = ServedBudget(16, 8)
    with caplog.at_level(logging.WARNING):
        assert other.load_into(second) == []
    assert "written for another capacity" in caplog.text
    assert _serve(second, 1)[0] == 16  # it calibrates from scratch


def test_restore_only_before_the_first_round_and_saves_never_fail_a_round(tmp_path, caplog):
    served = ServedBudget(16, 8, costs=CostTable(load_correction=False))
    _serve(served, 20)
    with pytest.raises(ValueError, match="law"):
        served.restore("argmax", CostTable(), None, served.calibration)
    with pytest.raises(RuntimeError, match="before the first"):
        served.restore("greedy", CostTable(), None, served.calibration)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    store = ServedPlanStore(KEY, blocked)
    with caplog.at_level(logging.WARNING):
        store.save_from(served)
        store.save_from(served)
    assert caplog.text.count("plan cache not saved") == 1
