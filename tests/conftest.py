import os
import sys

import pytest
import torch

# The tests run tiny models: one thread is faster than two, and far faster when another job
# loads the second core (thread hand-offs then stall for whole scheduler slices).
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

# Markers by module (registered in pyproject.toml). `sglang`: needs sglang installed (the plugin
# and its round; skipped without it unless SGLANG_TEV_REQUIRE_SGLANG=1). `engine`: starts SGLang
# Engines or HTTP servers in child processes (~30-90 s each here). `slow`: the engine modules and
# the modules that train, build or benchmark for minutes; `scripts/run_tests.sh --fast` runs the
# rest (`-m "not slow"`), CI runs everything.
ENGINE_MODULES = {
    "test_sglang_engine",
    "test_sglang_server",
    "test_sglang_kv_edges",
    "test_sglang_penalties",
    "test_sglang_dflash_cpu",
    "test_sglang_cpu_harness",
    "test_sglang_overlap",
    "test_sglang_tp",
    "test_sglang_dflash2_engine",
}
SLOW_MODULES = ENGINE_MODULES | {
    # each over ~25 s on the 2-core VM (full suite, 2026-12-02): subprocess SGLang imports, the
    # interpreted Triton kernel, 200-token greedy runs, builds and CUDA-graph checks on CPU
    "test_hf_runtime",
    "test_triton_tev",
    "test_srt_plugin",
    "test_build_tiny_code",
    "test_gpu_check",
    "test_assets",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if name.startswith(("test_srt_", "test_sglang_")):
            item.add_marker(pytest.mark.sglang)
        if name in ENGINE_MODULES:
            item.add_marker(pytest.mark.engine)
        if name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
