"""The processed target law against HF transformers' logits warpers (same order, same rules)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sglang_tev import SamplingParams, processed_probs


def hf_law(logits, temperature, top_k, top_p, min_p):
    x = logits.clone()
    ids = torch.zeros(x.shape[0], 1, dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, x)
    if 0 < top_k < x.shape[-1]:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p > 0:
        x = MinPLogitsWarper(min_p)(ids, x)
    return torch.softmax(x, -1)


@pytest.mark.parametrize(
    "t,k,p,m",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1),
     (0.8, 10, 0.9, 0.0), (1.3, 7, 0.6, 0.05), (1.0, 100, 1.0, 0.0)],
)
def test_matches_hf_warpers(t, k, p, m):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, dtype=torch.float64, generator=g) * 2
    ours = processed_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m))
    torch.testing.assert_close(ours, hf_law(logits, t, k, p, m), rtol=0, atol=1e-12)


def test_top_p_keeps_crossing_token_and_ties_lower_id():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]], dtype=torch.float64))
    out = processed_probs(logits, SamplingParams(top_p=0.65))
    # 0.4 + 0.3 = 0.7 crosses 0.65: tokens 1 and 2 kept
    assert (out[0] > 0).tolist() == [False, True, True, False]
    tie = torch.log(torch.tensor([[0.3, 0.3, 0.4]], dtype=torch.float64))
    out = processed_probs(tie, SamplingParams(top_p=0.5))  # 0.4 then the lower-id 0.3
    assert (out[0] > 0).tolist() == [True, False, True]


def test_top_k_keeps_ties_and_greedy_ties_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    out = processed_probs(logits, SamplingParams(top_k=1))
    assert (out[0] > 0).tolist() == [False, True, True, False]
    g = processed_probs(logits, SamplingParams(temperature=0.0))
    assert g[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_per_row_tensors_and_neg_inf():
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0], [0.0, 1.0, 2.0, 3.0]])
    s = SamplingParams(temperature=torch.tensor([1.0, 0.0]), top_k=torch.tensor([2, 0]))
    out = processed_probs(logits, s)
    assert out[1].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert float(out[0, 2]) == 0.0 and float(out[0, 0]) == 0.0 and abs(float(out[0].sum()) - 1) < 1e-6
    torch.testing.assert_close(out[0, [1, 3]], torch.softmax(torch.tensor([1.0, 2.0]), 0))
