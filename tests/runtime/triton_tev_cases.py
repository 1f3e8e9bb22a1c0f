"""Fused Triton TEV against the torch reference (run by tests/runtime/test_triton_tev.py).

Not collected on its own (no ``test_`` prefix): the kernel needs a GPU or ``TRITON_INTERPRET=1``
set before Triton is imported, so test_triton_tev.py runs this file in a subprocess with the
interpreter on CPU. On a CUDA machine it can be run directly: ``python -m pytest tests/runtime/triton_tev_cases.py``.

The case builder and the chi-square of the kernel's draws live in
:mod:`sglang_tev.testing.triton_cases` (shared with scripts/gpu_check.py).

Every case feeds the SAME logits, sampling parameters and uniforms to the kernel and to the torch
reference and requires equal exit node, bonus, path and accept length, and the exit law
(P, rho, w, coverage) within 1e-6. Vocabularies are tiny and the vocabulary tile is 4 or 8, so
each row spans several tiles (online max, running tie ranks and the bonus scan cross tiles).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from exact_law import stack_trees

from sglang_tev import DraftTree, SamplingParams, processed_probs, verify_tree
from sglang_tev.testing.triton_cases import ALPHA, DEVICE, MC_CASES, MC_ROWS, kernel_draws_against_law, make_case
from sglang_tev.verify import tev as torch_tev
from sglang_tev.verify import triton_tev

if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 set before import", allow_module_level=True)


def uniforms_for(b: int, seed: int) -> torch.Tensor:
    return torch.rand(b, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def assert_same(tree: DraftTree, logits, sampling, u, block_v: int):
    """Kernel == torch reference on the same uniforms; also the reference == the probs-based spec."""
    tree_d, logits_d, u_d = tree.to(DEVICE), logits.to(DEVICE), u.to(DEVICE)
    sampling_d = SamplingParams(*(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (
        sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)))  # fmt: skip
    ex_k, bonus_k, law_k = triton_tev.triton_tev_verify(tree_d, logits_d, sampling_d, u_d, block_v=block_v)
    ex_t, bonus_t, law_t = torch_tev.tev_verify_logits(tree, logits, sampling, u)
    assert torch.equal(ex_k.cpu(), ex_t), (ex_k, ex_t)
    assert torch.equal(bonus_k.cpu(), bonus_t), (bonus_k, bonus_t)
    for name in ("P", "rho", "w"):
        got, want = getattr(law_k, name).cpu().double(), getattr(law_t, name).double()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
    torch.testing.assert_close(law_k.coverage.cpu().double(), law_t.coverage.double(), rtol=0, atol=1e-6)
    # the fast torch reference is the probs-based spec (tev_verify on processed_probs)
    ex_s, bonus_s, _ = torch_tev.tev_verify(tree, processed_probs(logits, sampling), u)
    assert torch.equal(ex_s, ex_t) and torch.equal(bonus_s, bonus_t)
    return ex_k.cpu(), bonus_k.cpu()


SAMPLINGS = {
    "T1": SamplingParams(),
    "T0.6": SamplingParams(temperature=0.6),
    "T1.5": SamplingParams(temperature=1.5),
    "top_k2": SamplingParams(top_k=2),
    "top_p0.7": SamplingParams(top_p=0.7),
    "min_p0.2": SamplingParams(min_p=0.2),
    "top_k3_top_p0.8": SamplingParams(temperature=0.9, top_k=3, top_p=0.8),
    "top_k4_min_p0.1": SamplingParams(temperature=1.2, top_k=4, min_p=0.1),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_equal_to_reference(name):
    seed = list(SAMPLINGS).index(name)
    # four ragged trees (one root-only) in one padded batch; V = 11 spans 2 tiles of 8
    trees, tree, logits = make_case(200 + seed, 11, sizes=[10, 5, 1, 8])
    u = uniforms_for(len(trees), seed)
    ex, _ = assert_same(tree, logits, SAMPLINGS[name], u, block_v=8)
    assert int(tree.depth.gather(1, ex[:, None]).max()) >= 1  # not only root exits


def test_many_uniforms_reach_deep_exits():
    """One tree, 8 uniform pairs spread over [0, 1): exits at several depths, all equal; tiles of 4."""
    trees, tree, logits = make_case(7, 9, sizes=[10], deep=4.0)
    r = 8
    big = DraftTree.from_parents(tree.parents.repeat(r, 1), tree.tokens.repeat(r, 1), tree.valid.repeat(r, 1))
    u = torch.stack([(torch.arange(r, dtype=torch.float64) + 0.5) / r, uniforms_for(r, 1)[:, 1]], 1)
    ex, _ = assert_same(big, logits.repeat(r, 1, 1), SamplingParams(temperature=0.8), u, block_v=4)
    assert len(set(big.depth.gather(1, ex[:, None]).flatten().tolist())) >= 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    """bf16 / fp16 logits are read in their dtype; the reference upcasts the same values."""
    trees, tree, logits = make_case(31, 10, sizes=[8, 6])
    logits = torch.where(torch.isnan(logits), logits, logits.to(dtype).float()).to(dtype)
    for i, sp in enumerate([SamplingParams(), SamplingParams(top_k=3, top_p=0.75)]):
        assert_same(tree, logits, sp, uniforms_for(2, 40 + i), block_v=8)


def test_ties_at_the_top_p_cut():
    """Logits on a coarse grid give many exactly tied probabilities; the top-p cut falls inside a
    tie and keeps the lowest token ids first (the reference's stable sort)."""
    trees, tree, logits = make_case(41, 12, sizes=[8, 7, 4], deep=1.0)
    logits = torch.where(torch.isfinite(logits), torch.round(logits), logits)
    for i, sp in enumerate([SamplingParams(top_p=0.5), SamplingParams(top_p=0.9, top_k=6), SamplingParams(top_k=3)]):
        assert_same(tree, logits, sp, uniforms_for(3, 50 + i), block_v=4)


def test_top_k_at_most_children_gives_zero_rho():
    """top-k <= #drafted children whose tokens are the top ones: rho = 0 exactly, w = 0 there."""
    parents = [-1, 0, 0, 0, 1, 1]
    tokens = [7, 0, 1, 2, 3, 1]
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(1, 6, 9))).float()
    logits[0, 0, [0, 1]] += 6.0
    logits[0, 1, [3, 1]] += 6.0
    tree = stack_trees([(parents, tokens)], 6)
    r = 4
    big = DraftTree.from_parents(tree.parents.repeat(r, 1), tree.tokens.repeat(r, 1), tree.valid.repeat(r, 1))
    sp = SamplingParams(top_k=2)
    launch = triton_tev._prepare(big.to(DEVICE), logits.repeat(r, 1, 1).to(DEVICE), sp, 4)
    u = uniforms_for(r, 9).to(DEVICE)
    ex, _, law = triton_tev._launch_decide(launch, triton_tev._launch_rows(launch), u)
    assert float(law.rho[0, 0]) == 0.0 and float(law.rho[0, 1]) == 0.0 and float(law.w[0, 0]) == 0.0
    assert not bool(((ex == 0) | (ex == 1)).any())  # never exits where rho = 0
    assert_same(big, logits.repeat(r, 1, 1), sp, u.cpu(), block_v=4)


def test_per_row_sampling_and_greedy_rows():
    """Per-row temperature (one greedy row), top-k, top-p and min-p tensors."""
    trees, tree, logits = make_case(61, 10, sizes=[7, 9, 5, 8])
    sp = SamplingParams(
        temperature=torch.tensor([0.7, 0.0, 1.3, 1.0]),
        top_k=torch.tensor([0, 5, 3, 0]),
        top_p=torch.tensor([0.8, 1.0, 0.9, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.05, 0.3]),
    )
    ex, bonus = assert_same(tree, logits, sp, uniforms_for(4, 62), block_v=4)
    # the greedy row follows the argmax
    cur = 0
    kids = {int(tree.tokens[1, i]): i for i in range(1, 9) if int(tree.parents[1, i]) == cur}
    while int(logits[1, cur].argmax()) in kids:
        cur = kids[int(logits[1, cur].argmax())]
        kids = {int(tree.tokens[1, i]): i for i in range(1, 9) if int(tree.parents[1, i]) == cur}
    assert int(ex[1]) == cur and int(bonus[1]) == int(logits[1, cur].argmax())


def test_dispatch_through_verify_tree():
    """verify_tree(backend="triton") runs the kernel and returns the reference's VerifyOutput."""
    trees, tree, logits = make_case(71, 8, sizes=[8, 3])
    u = uniforms_for(2, 72)
    sp = SamplingParams(temperature=0.7, top_p=0.9)
    a = verify_tree(tree.to(DEVICE), logits.to(DEVICE), "tev", sampling=sp, uniforms=u.to(DEVICE), backend="triton")
    b = verify_tree(tree, logits, "tev", sampling=sp, uniforms=u, backend="torch")
    for name in ("path", "accept_len", "bonus", "exit_node"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name)), name
    torch.testing.assert_close(a.coverage.cpu(), b.coverage, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(MC_CASES))
def test_kernel_draws_follow_the_enumerated_law(name, rows=MC_ROWS):
    """Chi-square of the kernel's draws against the enumerated law; E[accept_len] = coverage."""
    got = kernel_draws_against_law(name, rows)
    assert got["pvalue"] > ALPHA, f"chi-square p = {got['pvalue']:.3g}"
    assert abs(got["accept_mean"] - got["coverage"]) < got["accept_bound"]
    assert got["kernel_coverage"] == pytest.approx(got["coverage"], abs=1e-6)
