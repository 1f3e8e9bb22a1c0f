"""The decode spec (sglang_tev/spec.py) and the budget plan (sglang_tev/plan.py): one home per
decision, read by every caller."""

import subprocess
import sys

import pytest
import torch

from sglang_tev import DraftTree, SamplingParams, verify_tree
from sglang_tev.plan import AutoBudget, FixedBudget, RoundPlan
from sglang_tev.spec import (GREEDY_EPS, MAX_BUDGET, SGLANG_MAX_TREE_SIZE, VERIFIERS, SpecError, check_budget,
                             greedy_temperature, is_greedy, is_scalar_greedy, num_uniforms, resolve_draft_mode)


def test_spec_imports_no_torch_and_cli_neither():
    code = "import sys, sglang_tev.spec, sglang_tev.plan, sglang_tev.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_every_copy_reads_the_spec():
    from sglang_tev import sampling
    from sglang_tev.draft import lattice
    from sglang_tev import autobudget
    from sglang_tev.hf import bench, runtime
    from sglang_tev.srt import config as srt_config
    from sglang_tev.train import exit as train_exit
    from sglang_tev import cli, spec
    from sglang_tev import verify

    assert sampling.GREEDY_EPS is spec.GREEDY_EPS and lattice.GREEDY_EPS is spec.GREEDY_EPS
    assert autobudget.MAX_BUDGET == runtime.MAX_BUDGET == cli.MAX_BUDGET == MAX_BUDGET
    assert srt_config.MAX_TREE_SIZE == SGLANG_MAX_TREE_SIZE == MAX_BUDGET  # SGLang's kernels: N <= 1024
    assert verify.METHODS is bench.TREE_METHODS is cli.VERIFIERS is spec.VERIFIERS
    assert runtime.GENERATION_METHODS is cli.METHODS and runtime.DRAFT_MODES is cli.DRAFT_MODES
    assert train_exit.TREE_MODES is spec.TREE_MODES
    assert srt_config.VERIFIERS == ("tev", "predraw", "sequential")


def test_greedy_threshold_is_one_rule():
    assert is_greedy(0) and is_greedy(GREEDY_EPS / 2) and not is_greedy(GREEDY_EPS) and not is_greedy(0.7)
    assert is_greedy(torch.tensor(0.0))  # a 0-d tensor reads through float()
    assert is_scalar_greedy(0.0) and not is_scalar_greedy(1.0)
    assert not is_scalar_greedy(torch.tensor(0.0))  # per-row tensors are decided on the device
    assert not is_scalar_greedy(True)
    assert greedy_temperature(1e-7) == 0.0 and greedy_temperature(0.8) == 0.8
    # the same threshold in the target law
    mask = SamplingParams(temperature=torch.tensor([0.0, GREEDY_EPS / 2, GREEDY_EPS, 1.0], dtype=torch.float64)).greedy_mask(4, "cpu")
    assert mask.tolist() == [True, True, False, False]


def test_resolve_draft_mode():
    assert resolve_draft_mode("auto", True) == "lattice"
    assert resolve_draft_mode("auto", False) == "marginal"
    assert resolve_draft_mode("marginal", True) == "marginal"
    with pytest.raises(SpecError, match="candidate selector") as e:
        resolve_draft_mode("lattice", False)
    assert e.value.arg == "draft_mode"
    with pytest.raises(SpecError, match="must be one of") as e:
        resolve_draft_mode("chain", True, arg="mode")
    assert e.value.arg == "mode" and str(e.value).startswith("mode must be one of")
    assert resolve_draft_mode("chain", True, modes=("auto", "marginal", "lattice", "chain")) == "chain"


def _tree(n):
    parents = torch.tensor([[-1] + list(range(n - 1))])
    tokens = torch.arange(n).reshape(1, n)
    return DraftTree.from_parents(parents, tokens)


@pytest.mark.parametrize("method", ["tev", "predraw", "sequential"])
def test_num_uniforms_is_what_the_verifier_takes(method):
    n, v = 4, 6
    tree = _tree(n)
    logits = torch.randn(1, n, v, generator=torch.Generator().manual_seed(0))
    u = num_uniforms(method, n)
    assert u == (2 if method == "tev" else n)
    out = verify_tree(tree, logits, method=method, sampling=SamplingParams(temperature=1.0),
                      uniforms=torch.full((1, u), 0.5, dtype=torch.float64))
    assert int(out.accept_len) >= 0
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree(tree, logits, method=method, sampling=SamplingParams(temperature=1.0),
                    uniforms=torch.full((1, u + 1), 0.5, dtype=torch.float64))


def test_num_uniforms_errors_name_the_method():
    assert num_uniforms("greedy", 9) == 0
    with pytest.raises(SpecError, match="method must be one of") as e:
        num_uniforms("beam", 4)
    assert e.value.arg == "method"
    assert set(VERIFIERS) == {"tev", "predraw", "sequential", "greedy"}


def test_check_budget():
    check_budget("auto")
    check_budget(0)
    check_budget(MAX_BUDGET)
    for bad in (-1, MAX_BUDGET + 1, 2.0, True, "4"):
        with pytest.raises(SpecError) as e:
            check_budget(bad)
        assert e.value.arg == "budget"
    with pytest.raises(SpecError, match="an int >= 0"):
        check_budget("auto", allow_auto=False)


def test_cli_maps_spec_errors_by_argument_not_words():
    from sglang_tev import cli

    u = cli._usage_from(SpecError("budget", "words the old mapper never saw"), "PROMPT")
    assert u.arg == "--budget" and "words the old mapper never saw" in str(u)
    u = cli._usage_from(SpecError("draft_mode", "budget is not the argument here"), "PROMPT")
    assert u.arg == "--draft-mode"


# ------------------------------------------------------------------------------------------- plan
def test_round_plan_checks_its_budgets():
    p = RoundPlan((4, 0, 2), capacity=8)
    assert p.budget == 4 and not p.plain and p.draft_depth is None and p.reach_at == ()
    assert RoundPlan((0, 0), capacity=8).plain
    for bad in ((), (9,), (-1,), (2.0,), (True,)):
        with pytest.raises(SpecError) as e:
            RoundPlan(bad, capacity=8)
        assert e.value.arg == "budgets"


def test_fixed_budget_plans_every_row_the_same_whole_block():
    pol = FixedBudget(16)
    assert pol.capacity == 16
    p = pol.plan(3)
    assert p.budgets == (16, 16, 16) and p.draft_depth is None and p.reach_at == ()
    assert pol.plan(3) is p  # one plan per batch size, no work per round
    pol.observe(p, None, 0.1)  # learns nothing
    assert pol.plan(1).budgets == (16,)
    for bad in (-1, MAX_BUDGET + 1, "auto"):
        with pytest.raises(SpecError):
            FixedBudget(bad)


class _Controller:
    """A recording stand-in for autobudget.BudgetController."""

    def __init__(self, choices):
        self.grid = (0, 2, 4, 8, 32)
        self.choices = list(choices)
        self.seen = []

    def choose(self, batch):
        return self.choices.pop(0)

    def grid_upto(self, budget):
        return [b for b in self.grid if 0 < b <= budget]

    def observe(self, batch, budget, reach_cum, seconds):
        self.seen.append((batch, budget, reach_cum, seconds))


def test_auto_budget_cuts_the_block_and_feeds_back():
    ctl = _Controller([8, 0, 32])
    pol = AutoBudget(ctl, block_size=16)
    assert pol.capacity == 32
    p = pol.plan(2)
    assert p.budgets == (8, 8) and p.draft_depth == 8 and p.reach_at == (2, 4, 8)
    pol.observe(p, [[0.5, 0.7, 0.9]] * 2, 0.01)
    assert ctl.seen == [(2, 8, [[0.5, 0.7, 0.9]] * 2, 0.01)]
    p = pol.plan(2)
    assert p.plain and p.draft_depth == 0 and p.reach_at == ()
    p = pol.plan(1)
    assert p.budgets == (32,) and p.draft_depth == 15  # K - 1 caps the depth
    ctl.choices.append(32)
    assert pol.plan(1) is p  # one plan per (rows, budget): no allocation per round
    with pytest.raises(SpecError, match="grid"):
        AutoBudget(type("C", (), {"grid": ()})())


# ----------------------------------------------------------------------------- public seams
def test_draft_tree_with_host_lists():
    tree = _tree(3)
    assert tree.host() == ([[-1, 0, 1]], [[0, 1, 2]])  # read from the tensors
    calls = []
    lists = ([[-1, 0, 1]], [[0, 1, 2]])
    t2 = _tree(3).with_host_lists(reader=lambda: calls.append(1) or lists)
    assert t2.host() is lists and t2.host() is lists and calls == [1]  # read once, cached
    t3 = _tree(3)
    assert t3.with_host_lists(lists) is t3 and t3.host() is lists
    with pytest.raises(ValueError, match="exactly one"):
        _tree(3).with_host_lists()
    with pytest.raises(ValueError, match="exactly one"):
        _tree(3).with_host_lists(lists, reader=lambda: lists)


def test_verify_output_from_host_builds_tensors_on_read():
    from sglang_tev import VerifyOutput

    out = VerifyOutput.from_host(([[0, 2]], [[5, 7]], [1], [9], [1.0], [3], [None]), 3, torch.float32)
    assert out.decided_on_host
    assert out.path.tolist() == [[0, 2, -1]] and out.accept_len.tolist() == [1] and out.bonus.tolist() == [9]
    assert out.exit_node.tolist() == [2] and out.coverage.dtype == torch.float32
