"""benchmarks/sglang_step_trace.py: its per-step summary and its argument checks (no server)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sglang_step_trace.py"


def _module():
    spec = importlib.util.spec_from_file_location("sglang_step_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_counts_only_decode_steps_followed_by_decode_steps():
    # kind t0 t1 mode bs tokens: a prefill (x) between decode steps breaks the pairs around it
    lines = [
        "tev 0.000 0.010 d 2 4",   # work 10 ms, gap 2 ms to the next decode step
        "tev 0.012 0.020 d 2 2",   # followed by a prefill: left out
        "tev 0.021 0.050 x 1 0",
        "tev 0.051 0.061 d 2 6",   # work 10 ms, gap 4 ms
        "tev 0.065 0.070 d 2 2",   # last call: no next step
    ]
    row = _module().summarize(lines)
    assert row["steps"] == 2
    assert row["work_ms"] == pytest.approx(10.0)
    assert row["gap_ms"] == pytest.approx(3.0)
    assert row["step_ms"] == pytest.approx(13.0)
    assert row["tokens_per_step"] == pytest.approx((4 / 2 + 6 / 2) / 2)
    assert _module().summarize(["tev 0 1 x 1 0"]) == {"steps": 0}
    assert list(row["by_width"]) == ["-1"]  # six-field lines: the width is unknown
    # a last line cut short (a server killed while writing it) is skipped
    assert _module().summarize(lines + ["tev 0.080 0.09"]) == row


def test_summary_splits_steps_by_round_width():
    lines = [
        "tev 0.000 0.010 d 1 1 0",   # plain step: work 10, gap 1
        "tev 0.011 0.031 d 1 3 16",  # 16 nodes: work 20, gap 3
        "tev 0.034 0.044 d 1 1 0",   # plain: work 10, gap 2
        "tev 0.046 0.066 d 1 2 16",  # 16 nodes: work 20, gap 5
        "tev 0.071 0.080 d 1 1 0",
    ]
    by = _module().summarize(lines)["by_width"]
    assert list(by) == ["0", "16"]
    assert by["0"]["steps"] == 2 and by["0"]["gap_ms"] == pytest.approx(1.5) and by["0"]["start_ms"] == pytest.approx(11.5)
    assert by["16"]["work_ms"] == pytest.approx(20.0) and by["16"]["start_ms"] == pytest.approx(24.0)
    assert by["16"]["tokens_per_step"] == pytest.approx(2.5)
    assert "forward_ms" not in by["0"]  # seven-field lines: no forward time


def test_summary_sets_what_the_planner_was_charged_beside_its_table():
    lines = [  # ... forward charged load stored (the auto columns)
        "tev 0.000 0.020 d 1 3 16 0.015 0.0210 1.0000 0.0300",
        "tev 0.021 0.041 d 1 3 16 0.015 0.0230 1.1000 0.0250",
        "tev 0.042 0.052 d 1 1 0 0.008 0.0110 1.1000 -1.000000",  # no table entry yet: none read
        "tev 0.053 0.073 d 1 3 16 0.015",  # a line without them (a fixed server's)
        "tev 0.074 0.080 d 1 1 0 0.005 0.0090 1.0 0.0100",
    ]
    by = _module().summarize(lines)["by_width"]
    assert by["16"]["charged_ms"] == pytest.approx(22.0) and by["16"]["table_ms"] == pytest.approx(25.0)
    assert by["0"]["charged_ms"] == pytest.approx(11.0) and by["0"]["table_ms"] is None
    assert "charged_ms" not in _module().summarize([x[:32] for x in lines])["by_width"]["16"]


def test_summary_splits_the_work_into_forward_and_own():
    lines = [
        "tev 0.000 0.010 d 1 1 0 0.008",   # work 10: forward 8, own 2
        "tev 0.011 0.023 d 1 1 0 0.009",   # work 12: forward 9, own 3
        "tev 0.024 0.038 d 1 1 0 0.0095",  # work 14: forward 9.5, own 4.5
        "tev 0.040 0.050 d 1 1 0 0.008",
    ]
    row = _module().summarize(lines)
    assert row["forward_ms"] == pytest.approx(9.0) and row["own_ms"] == pytest.approx(3.0)
    assert row["by_width"]["0"]["own_ms"] == pytest.approx(3.0)
    # a mix of old and new lines reports no split rather than one over part of the steps
    assert "forward_ms" not in _module().summarize(lines[:2] + ["tev 0.024 0.038 d 1 1 0"] + lines[3:])


@pytest.mark.parametrize("args, needle", [(["--modes", "nope"], "--modes"), (["--modes", ","], "--modes"),
                                          (["--seconds", "0"], "--seconds"), (["--seconds", "nan"], "--seconds"),
                                          (["--seconds", "inf"], "--seconds"), (["--temperature", "-1"], "--temperature"),
                                          (["--concurrency", "0"], "--concurrency"), (["--output-len", "1"], "--output-len"),
                                          (["--output", "/nonexistent-dir-x/r.json"], "--output"),
                                          (["--paired", "-1"], "--paired"),
                                          (["--paired", "3", "--concurrency", "2"], "--paired"),
                                          (["--paired", "3", "--modes", "plain,plain"], "--paired")])
def test_bad_arguments_are_refused_before_any_server_starts(args, needle):
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr
