"""The fused Triton TEV kernel on a CPU, in the core tier: the tiny hand-computed cases of
triton_interpreted_cases.py (arithmetic in its docstring) under Triton's interpreter. The
interpreter must be switched on before Triton is imported, hence the subprocess. The full
kernel-equals-reference sweep is tests/runtime/test_triton_tev.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_hand_computed_kernel_cases_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, "triton_interpreted_cases.py")],
        cwd=HERE, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "2 passed" in out and "skipped" not in out, out[-2000:]
