"""Test tiers by folder: every test module lives in one of the folders of :data:`TIERS`, which
sets its markers (registered in pyproject.toml), so a renamed module keeps them.

- ``core``: torch only, under a minute (``scripts/run_tests.sh --core``): the exit law, the
  verifiers, the sampling law, the tree builder, the decode spec, a few interpreted Triton cases.
- ``runtime``: the transformers runtime, the drafters, the CLI, bench / tune / eval-drafter.
- ``srt``: the SGLang plugin, its round and worker, with SGLang's modules in this process (marked
  ``sglang``: skipped without sglang unless SGLANG_TEV_REQUIRE_SGLANG=1).
- ``engine``: SGLang's real Engine and HTTP server in child processes (``sglang``, ``engine``,
  ``slow``; ~30-90 s per Engine here).
- ``train``: the trainer, ExitTrain, the shipped pair's build.

Minutes-long modules outside ``engine`` mark themselves ``pytestmark = pytest.mark.slow``;
``scripts/run_tests.sh --fast`` leaves every ``slow`` test out, CI runs everything.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

# The tests run tiny models: one thread is faster than two, and far faster when another job
# loads the second core (thread hand-offs then stall for whole scheduler slices).
torch.set_num_threads(1)
# budget="auto" would carry what one test's runtime learned into the next through the plan
# cache in ~/.cache (tests/runtime/test_plan_cache.py turns it on, in a temporary folder)
os.environ["SGLANG_TEV_PLAN_CACHE"] = "0"
# the SGLang plugin's default is load-adaptive (SGLANG_TEV_BUDGET=auto); the tests check fixed trees
# unless they set a mode themselves (monkeypatch, a host's env), whatever the shell exports
os.environ["SGLANG_TEV_BUDGET"] = "fixed"
# the helper modules shared by every tier (tiny_pair, exact_law, ...) sit in this folder
sys.path.insert(0, os.path.dirname(__file__))

HERE = Path(__file__).resolve().parent
TIERS = {
    "core": ("core",),
    "runtime": ("runtime",),
    "srt": ("srt", "sglang"),
    "engine": ("engine", "sglang", "slow"),
    "train": ("train",),
}


def tier_of(path) -> str:
    """The tier folder of a test module's path; raises pytest.UsageError for a module outside one."""
    rel = Path(path).resolve().relative_to(HERE)
    if len(rel.parts) < 2 or rel.parts[0] not in TIERS:
        raise pytest.UsageError(f"tests/{rel}: every test module lives in a tier folder ({', '.join(TIERS)})")
    return rel.parts[0]


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in TIERS[tier_of(item.path)]:
            item.add_marker(getattr(pytest.mark, marker))
