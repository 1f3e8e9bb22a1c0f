"""benchmarks/sglang_paired_prompts.py: its argument checks refuse before any server starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_paired_prompts.py"


@pytest.mark.parametrize("args,match", [
    (["--modes", "tev17"], "--modes"),              # one mode: nothing to compare
    (["--modes", "tev17,bogus"], "--modes"),        # an unknown mode
    (["--num-prompts", "1"], "--num-prompts"),
    (["--modes", "tev17,tev17"], "--modes"),        # the same server twice
    (["--modes", "tev17,auto65@"], "no checkout"),  # '@' and nothing after it
    (["--modes", f"auto65@{Path(__file__).resolve().parents[2]},auto65@{Path(__file__).resolve().parents[2]}/"],
     "twice"),                                       # one checkout spelt two ways
    (["--modes", "tev17,auto65@/nonexistent"], "not a checkout"),  # a peer that is no checkout
])
def test_bad_arguments_are_refused_naming_them(args, match):
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and match in res.stderr, res.stderr
