"""Fused Triton TEV (sglang_tev/verify/triton_tev.py) and the backend dispatch of verify_tree.

The kernel cases live in tests/runtime/triton_tev_cases.py. Triton's CPU interpreter must be switched on
before Triton is imported, so on CPU they run in a subprocess with ``TRITON_INTERPRET=1``
(about two minutes on two cores). The torch-side tests below need no Triton.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from exact_law import random_tree, stack_trees

from sglang_tev import SamplingParams, processed_probs, verify_tree
from sglang_tev.verify import tev as tev_module
from sglang_tev.verify.tev import tev_verify, tev_verify_logits

pytestmark = pytest.mark.slow  # minutes here: scripts/run_tests.sh --fast leaves it out

HERE = os.path.dirname(__file__)
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_equals_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.join(HERE, "triton_tev_cases.py")],
        cwd=os.path.dirname(HERE),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out, out[-2000:]


def _case(seed: int, vocab: int, sizes: list[int]):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, n, vocab) for n in sizes]
    tree = stack_trees(trees, max(sizes))
    logits = torch.from_numpy(rng.normal(size=(len(sizes), max(sizes), vocab)) * 2)
    return trees, tree, logits


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.6), SamplingParams(top_k=2, top_p=0.8), SamplingParams(min_p=0.3)],
    ids=["T1", "T0.6", "top_k2_top_p0.8", "min_p0.3"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1 << 20, 20, 1], ids=["one_chunk", "chunks_of_2_rows", "row_by_row"])
def test_one_pass_reference_equals_probs_spec(sampling, dtype, chunk, monkeypatch):
    """tev_verify_logits (children zeroed per chunk of rows, one sum) == tev_verify on
    processed_probs, on the same uniforms: exit node and bonus equal, law within rounding."""
    monkeypatch.setattr(tev_module, "CHUNK_ELEMENTS", chunk * 4)  # b = 4 trees, V = 7
    trees, tree, logits = _case(5, 7, sizes=[9, 4, 12, 1])
    logits = logits.to(dtype)
    logits[1, 4:] = float("nan")  # padded rows of tree 1 (4 nodes) are ignored
    u = torch.rand(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for shift in np.linspace(0.0, 0.95, 12):
        uu = (u + float(shift)) % 1.0
        ex_a, bonus_a, law_a = tev_verify_logits(tree, logits, sampling, uu)
        ex_b, bonus_b, law_b = tev_verify(tree, processed_probs(logits, sampling), uu)
        assert torch.equal(ex_a, ex_b) and torch.equal(bonus_a, bonus_b)
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(law_a.w, law_b.w, rtol=0, atol=tol)
        torch.testing.assert_close(law_a.coverage, law_b.coverage, rtol=0, atol=tol)


def test_one_pass_reference_rho_exactly_zero_when_children_cover_support():
    """Plain temperature, -inf everywhere but the drafted children: rho is exactly 0 (the masked
    non-child sum), so the node is never the exit; 1 - sum would leave rounding mass there."""
    parents, tokens = [-1, 0, 0, 1], [5, 0, 1, 2]
    tree = stack_trees([(parents, tokens)], 4)
    logits = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(1))
    logits[0, 0, 2:] = float("-inf")  # the root's support is exactly its children {0, 1}
    u = torch.rand(64, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    big = stack_trees([(parents, tokens)] * 64, 4)
    ex, bonus, law = tev_verify_logits(big, logits.repeat(64, 1, 1), SamplingParams(temperature=0.7), u)
    assert float(law.rho[0, 0]) == 0.0 and float(law.w[0, 0]) == 0.0
    assert not bool((ex == 0).any())
    assert float(law.w[0].sum()) == pytest.approx(1.0, abs=1e-6)


def test_backend_auto_on_cpu_is_the_torch_reference():
    trees, tree, logits = _case(3, 6, sizes=[7, 5])
    u = torch.rand(2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    a = verify_tree(tree, logits.float(), "tev", uniforms=u)
    b = verify_tree(tree, logits.float(), "tev", uniforms=u, backend="torch")
    assert torch.equal(a.path, b.path) and torch.equal(a.bonus, b.bonus)
    assert torch.equal(a.coverage, b.coverage)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(backend="cuda"), "backend must be one of"),
        (dict(backend="triton", method="predraw"), "only for method 'tev'"),
        (dict(backend="triton", dtype=torch.float64), "bf16 / fp16 / fp32"),
    ],
)
def test_bad_backend(kw, match):
    trees, tree, logits = _case(8, 6, sizes=[5])
    kw = dict(kw)
    logits = logits.to(kw.pop("dtype", torch.float32))
    with pytest.raises(ValueError, match=match):
        verify_tree(tree, logits, kw.pop("method", "tev"), **kw)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="interpreter is on here")
def test_backend_triton_on_cpu_without_interpreter_is_refused():
    trees, tree, logits = _case(9, 6, sizes=[5])
    with pytest.raises(ValueError, match="backend 'triton'"):
        verify_tree(tree, logits.float(), "tev", backend="triton")
