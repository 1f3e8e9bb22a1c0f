"""Tiny fused-TEV kernel cases with the exit law worked out by hand (run by
test_triton_interpreted.py in a subprocess with ``TRITON_INTERPRET=1``; not collected on its own).

One tree: root r with children a (token 0) and b (token 1); a has one child c (token 2). N = 4,
V = 4, vocabulary tile 2, so each row spans two tiles. Target probabilities (logits = their logs,
temperature 1) per node row:

    at r:  [1/2, 1/4, 1/8, 1/8]      at a:  [1/4, 1/4, 1/2, 0]      b, c: any (leaves)

Reach P(v) (the target's probability of walking to v): P(r) = 1, P(a) = 1/2, P(b) = 1/4,
P(c) = P(a) * p_a(2) = 1/4. Residual rho(v) = 1 - (mass of v's drafted children):
rho(r) = 1 - 3/4 = 1/4, rho(a) = 1 - 1/2 = 1/2, rho(b) = rho(c) = 1 (leaves).
Exit mass w = P * rho: w = [1/4, 1/4, 1/4, 1/4] (sums to 1), coverage C = P(a) + P(b) + P(c) = 1.
The bonus token is drawn from the exit node's residual law, p_v with v's drafted children taken out
and renormalised: at r, tokens 2 and 3, 1/2 each; at a, [1/4, 1/4, 0, 0] / (1/2): tokens 0 and 1,
1/2 each; at the leaves b and c, their whole rows (c: token 0 only).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from sglang_tev import DraftTree, SamplingParams
from sglang_tev.verify import tev as torch_tev
from sglang_tev.verify import triton_tev

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 set before Triton is imported", allow_module_level=True)

NEG = -math.inf


def _case():
    tree = DraftTree.from_parents(torch.tensor([[-1, 0, 0, 1]]), torch.tensor([[3, 0, 1, 2]]))
    rows = [
        [1 / 2, 1 / 4, 1 / 8, 1 / 8],  # r
        [1 / 4, 1 / 4, 1 / 2, 0.0],  # a
        [1 / 4, 1 / 4, 1 / 4, 1 / 4],  # b (leaf)
        [1.0, 0.0, 0.0, 0.0],  # c (leaf): its bonus is token 0
    ]
    logits = torch.tensor([[[math.log(p) if p > 0 else NEG for p in row] for row in rows]], dtype=torch.float32)
    return tree, logits


@pytest.fixture(scope="module")
def draws():
    """One kernel call over 20 x 2 evenly spaced uniforms (u1 picks the exit node, u2 the bonus),
    and the torch reference's draws on the same uniforms."""
    tree, logits = _case()
    grid = (torch.arange(20, dtype=torch.float64) + 0.5) / 20
    u = torch.stack(torch.meshgrid(grid, torch.tensor([0.25, 0.75], dtype=torch.float64), indexing="ij"), -1).reshape(-1, 2)
    b = u.shape[0]
    trees = DraftTree.from_parents(tree.parents.expand(b, 4).clone(), tree.tokens.expand(b, 4).clone())
    logits = logits.expand(b, 4, 4).contiguous()
    kernel = triton_tev.triton_tev_verify(trees, logits, SamplingParams(), u, block_v=2)
    return kernel, torch_tev.tev_verify_logits(trees, logits, SamplingParams(), u)


def test_exit_law_is_the_hand_computed_one(draws):
    law = draws[0][2]
    torch.testing.assert_close(law.P[0].double(), torch.tensor([1, 1 / 2, 1 / 4, 1 / 4], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(law.rho[0].double(), torch.tensor([1 / 4, 1 / 2, 1, 1], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(law.w[0].double(), torch.full((4,), 1 / 4, dtype=torch.float64), atol=1e-6, rtol=0)
    assert abs(float(law.coverage[0]) - 1.0) < 1e-6


def test_exit_nodes_and_bonus_tokens_follow_the_law_on_a_grid_of_uniforms(draws):
    """Each node is the exit for 1/4 of the evenly spaced u1 (its w), every bonus lies in its exit
    node's residual support, and every draw equals the torch reference's on the same uniforms."""
    (ex, bonus, _), (ex_t, bonus_t, _) = draws
    assert torch.equal(ex, ex_t) and torch.equal(bonus, bonus_t)
    assert torch.bincount(ex, minlength=4).tolist() == [10, 10, 10, 10]
    support = {0: {2, 3}, 1: {0, 1}, 2: {0, 1, 2, 3}, 3: {0}}
    assert all(int(t) in support[int(e)] for e, t in zip(ex, bonus))
    # the second uniform splits each two-token residual in half: both tokens drawn
    assert {int(t) for e, t in zip(ex, bonus) if int(e) == 0} == {2, 3}
    assert {int(t) for e, t in zip(ex, bonus) if int(e) == 1} == {0, 1}
