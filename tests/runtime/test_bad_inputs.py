"""Every bad input raises one clear ValueError naming the argument (DESIGN §3 Rules)."""

from __future__ import annotations

import pytest
import torch

from sglang_tev import DraftTree, SamplingParams, build_ddtree, build_ddtree_topk, exit_law, verify_tree


def good_tree():
    return DraftTree.from_parents(torch.tensor([[-1, 0, 0, 1]]), torch.tensor([[5, 1, 2, 3]]))


def good_logits(v=6):
    return torch.randn(1, 4, v, generator=torch.Generator().manual_seed(0))


TREE_CASES = [
    ("parents", dict(parents=torch.tensor([[-1, 0, 0]], dtype=torch.int32), tokens=torch.tensor([[1, 2, 3]]))),
    ("parents", dict(parents=torch.tensor([-1, 0, 0]), tokens=torch.tensor([1, 2, 3]))),
    ("tokens", dict(parents=torch.tensor([[-1, 0, 0]]), tokens=torch.tensor([[1, 2]]))),
    ("parents\\[:, 0\\]", dict(parents=torch.tensor([[0, 0, 0]]), tokens=torch.tensor([[1, 2, 3]]))),
    ("parents must precede children", dict(parents=torch.tensor([[-1, 2, 0]]), tokens=torch.tensor([[1, 2, 3]]))),
    ("parents must precede children", dict(parents=torch.tensor([[-1, 1, 0]]), tokens=torch.tensor([[1, 2, 3]]))),
    ("distinct tokens", dict(parents=torch.tensor([[-1, 0, 0]]), tokens=torch.tensor([[1, 2, 2]]))),
    ("valid must be a prefix mask", dict(parents=torch.tensor([[-1, 0, 0]]), tokens=torch.tensor([[1, 2, 3]]), valid=torch.tensor([[True, False, True]]))),
    ("valid\\[:, 0\\]", dict(parents=torch.tensor([[-1, 0]]), tokens=torch.tensor([[1, 2]]), valid=torch.tensor([[False, False]]))),
    ("tokens of valid nodes", dict(parents=torch.tensor([[-1, 0]]), tokens=torch.tensor([[1, -2]]))),
]


@pytest.mark.parametrize("match,kw", TREE_CASES)
def test_bad_tree(match, kw):
    with pytest.raises(ValueError, match=match):
        DraftTree.from_parents(**kw)


def test_duplicate_tokens_in_padding_are_fine():
    t = DraftTree.from_parents(torch.tensor([[-1, 0, 0]]), torch.tensor([[1, 2, 2]]), torch.tensor([[True, True, False]]))
    assert t.num_valid().tolist() == [2]


def nan_logits():
    x = good_logits()
    x[0, 1, 2] = float("nan")
    return x


def pinf_logits():
    x = good_logits()
    x[0, 3, 0] = float("inf")
    return x


def dead_row():
    x = good_logits()
    x[0, 2] = float("-inf")
    return x


VERIFY_CASES = [
    ("target_logits must have shape", dict(target_logits=torch.randn(1, 3, 6))),
    ("target_logits must be a floating", dict(target_logits=torch.ones(1, 4, 6, dtype=torch.int64))),
    ("target_logits contains NaN", dict(target_logits=nan_logits())),
    ("target_logits contains NaN or \\+inf", dict(target_logits=pinf_logits())),
    ("all -inf", dict(target_logits=dead_row())),
    ("temperature must be >= 0", dict(sampling=SamplingParams(temperature=-0.1))),
    ("top_p must be in", dict(sampling=SamplingParams(top_p=0.0))),
    ("top_p must be in", dict(sampling=SamplingParams(top_p=1.5))),
    ("min_p must be in", dict(sampling=SamplingParams(min_p=-0.1))),
    ("min_p must be in", dict(sampling=SamplingParams(min_p=1.1))),
    ("temperature must be a scalar or a \\[1\\]", dict(sampling=SamplingParams(temperature=torch.ones(3)))),
    ("method must be one of", dict(method="beam")),
    ("method 'greedy' is exact only", dict(method="greedy", sampling=SamplingParams(temperature=0.5))),
    ("uniforms must have shape", dict(uniforms=torch.rand(1, 3, dtype=torch.float64))),
    ("uniforms must be a float64", dict(uniforms=torch.rand(1, 2))),
    ("uniforms must lie in", dict(uniforms=torch.tensor([[0.5, 1.0]], dtype=torch.float64))),
]


@pytest.mark.parametrize("match,kw", VERIFY_CASES)
def test_bad_verify(match, kw):
    args = dict(tree=good_tree(), target_logits=good_logits())
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        verify_tree(**args)


def test_single_neg_inf_is_valid_and_greedy_at_zero_temperature_is_fine():
    x = good_logits()
    x[0, 0, 1] = float("-inf")
    out = verify_tree(good_tree(), x, "tev")
    assert out.bonus.shape == (1,)
    out = verify_tree(good_tree(), x, "greedy", sampling=SamplingParams(temperature=0.0))
    assert int(out.exit_node[0]) in range(4)


def test_exit_law_bad_shape():
    with pytest.raises(ValueError, match="target_probs must have shape"):
        exit_law(good_tree(), torch.rand(1, 5, 6))


@pytest.mark.parametrize("budget,match", [(-1, "budget must be >= 0"), (2.0, "budget must be an int"), (True, "budget must be an int")])
def test_bad_budget(budget, match):
    with pytest.raises(ValueError, match=match):
        build_ddtree(torch.randn(1, 3, 5), budget, torch.tensor([0]))


BUILD_CASES = [
    ("draft_logits must be a floating tensor", dict(draft_logits=torch.randn(3, 5))),
    ("root_tokens must have shape", dict(root_tokens=torch.tensor([0, 1]))),
    ("root_tokens must be an int64", dict(root_tokens=torch.tensor([0], dtype=torch.int32))),
    ("draft_logits contains NaN", dict(draft_logits=torch.full((1, 3, 5), float("nan")))),
    ("all -inf", dict(draft_logits=torch.full((1, 3, 5), float("-inf")))),
]


@pytest.mark.parametrize("match,kw", BUILD_CASES)
def test_bad_build(match, kw):
    args = dict(draft_logits=torch.randn(1, 3, 5), budget=4, root_tokens=torch.tensor([0]))
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        build_ddtree(**args)


def test_bad_build_topk():
    with pytest.raises(ValueError, match="topk_ids must be int64"):
        build_ddtree_topk(torch.randn(1, 2, 3), torch.zeros(1, 2, 2, dtype=torch.int64), 3, torch.tensor([0]))
    with pytest.raises(ValueError, match="topk_logprobs contains NaN"):
        build_ddtree_topk(torch.full((1, 2, 3), float("nan")), torch.zeros(1, 2, 3, dtype=torch.int64), 3, torch.tensor([0]))
