"""The SGLang plugin with the real sglang 0.5.23: discovery, registration, TevAlgo predicates and
server-args resolution from real CLI lines (CPU; ``--device cuda`` is given so SGLang's resolution
pipeline runs without a GPU to detect).

Skipped only when sglang is not installed; CI (``.ci/run``) installs it, so they run there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from sglang_tev.testing.sglang_cpu.required import require_sglang  # noqa: E402

require_sglang()

import torch  # noqa: E402

pytestmark = pytest.mark.slow  # minutes here: scripts/run_tests.sh --fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "sglang_tev" / "assets" / "tiny-code"
BASE = [
    "--model-path", str(TINY / "target"),
    "--speculative-algorithm", "TEV",
    "--speculative-draft-model-path", str(TINY / "draft"),
    "--device", "cuda",
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def registered():
    from sglang_tev.srt.plugin import register

    register()
    yield


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("SGLANG_TEV_VERIFIER", raising=False)
    monkeypatch.delenv("SGLANG_TEV_TOPK", raising=False)


def resolve(extra=()):
    """Real CLI parsing (``prepare_server_args``) + SGLang's full resolution pipeline."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(BASE + list(extra))
    sa.resolve_once()
    return sa, resolving_view(sa)


# ---------------------------------------------------------------------- discovery
def test_load_plugins_discovers_the_entry_point(tmp_path):
    """SGLang's own load_plugins() finds ``tev`` in group sglang.srt.plugins and registers TEV.

    When the installed sglang-tev metadata predates the entry point (an editable install of an
    older checkout), the entry point declared in this checkout's pyproject.toml is exposed through
    a dist-info in a temporary directory instead; the declaration under test is the same.
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("SGLANG_PLUGINS", None)
    from importlib.metadata import entry_points

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sglang.srt.plugins"]
    assert declared == {"tev": "sglang_tev.srt.plugin:register"}
    if not any(ep.name == "tev" for ep in entry_points(group="sglang.srt.plugins")):
        info = tmp_path / "sglang_tev_checkout-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-tev-checkout\nVersion: 0.0.0\n")
        (info / "entry_points.txt").write_text("[sglang.srt.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{tmp_path}"
    code = textwrap.dedent(
        """
        import sys
        from sglang.srt.plugins import load_plugins
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        load_plugins()
        algo = SpeculativeAlgorithm.from_string("TEV")
        print(type(algo).__module__, type(algo).__name__, algo.name)
        print("worker_imported", "sglang_tev.srt.worker" in sys.modules)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[-2] == "sglang_tev.srt.algo TevAlgo TEV"
    assert lines[-1] == "worker_imported False"  # the worker is imported lazily


# ---------------------------------------------------------------------- registration
def test_register_is_idempotent_and_from_string_returns_tev():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_tev.srt.algo import TevAlgo
    from sglang_tev.srt.plugin import register

    first = SpeculativeAlgorithm.from_string("TEV")
    register()
    register()
    assert SpeculativeAlgorithm.from_string("tev") is first
    assert isinstance(first, TevAlgo)
    # V2 schema: no deprecated-V1 warning at worker creation; overlap itself is turned off by TEV
    assert first.supports_overlap is True


def test_tev_cpu_is_registered_only_when_asked_for():
    """``tev_cpu`` joins SGLang's attention-backend choices (target and draft) with SGLang's CPU
    engine or ``SGLANG_TEV_REFERENCE_ATTENTION=1``; a GPU server's lists stay SGLang's own."""
    from sglang_tev.srt.plugin import wants_cpu_attention

    assert wants_cpu_attention({"SGLANG_USE_CPU_ENGINE": "1"})
    assert wants_cpu_attention({"SGLANG_TEV_REFERENCE_ATTENTION": "1"})
    assert not wants_cpu_attention({}) and not wants_cpu_attention({"SGLANG_USE_CPU_ENGINE": "0"})
    code = textwrap.dedent(
        """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        SpeculativeAlgorithm.from_string("TEV")
        print("tev_cpu" in ATTENTION_BACKEND_CHOICES, "tev_cpu" in DRAFT_ATTENTION_BACKEND_CHOICES)
        """
    )
    for flag, want in (("1", "True True"), ("0", "False False")):
        env = dict(os.environ, OMP_NUM_THREADS="1", SGLANG_TEV_REFERENCE_ATTENTION=flag)
        env.pop("SGLANG_USE_CPU_ENGINE", None)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip().splitlines()[-1] == want, (flag, res.stdout[-500:])


def test_tev_algo_passes_sglang_conformance_and_predicates():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import _assert_custom_spec_algo_conforms

    from sglang_tev.srt.algo import TevAlgo

    _assert_custom_spec_algo_conforms(TevAlgo)  # raises TypeError on a missing predicate
    algo = SpeculativeAlgorithm.from_string("TEV")
    # every method of the enum's interface exists, including the four CustomSpecAlgo lacks
    for name in vars(SpeculativeAlgorithm):
        if name.startswith(("is_", "supports_")) or name in (
            "create_future_map", "carries_draft_hidden_states", "need_topk", "get_platform_worker_cls",
            "get_num_tokens_per_req_for_target_verify", "resolve_max_speculative_num_draft_tokens", "has_draft_kv",
        ):  # fmt: skip
            assert callable(getattr(algo, name)), name
    assert algo.is_dflash_family() and algo.supports_target_verify_for_draft() and algo.is_speculative()
    assert not (algo.is_dflash() or algo.is_eagle() or algo.is_ngram() or algo.is_dspark() or algo.is_none())
    assert algo.has_draft_kv() and not algo.carries_draft_hidden_states() and not algo.need_topk()
    assert algo.get_platform_worker_cls() is None
    assert not algo.supports_grammar_overlap() and not algo.supports_mixed_chunk()


def test_future_map_from_tev_algo_on_cpu():
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    fm = SpeculativeAlgorithm.from_string("TEV").create_future_map("cpu", pool)
    assert isinstance(fm, FutureMap) and fm.need_topk is False and fm.req_pool_size == pool.req_to_token.shape[0]


# ---------------------------------------------------------------------- resolution
def test_issue_cli_line_resolves_tree_block_depth():
    sa, cfg = resolve(["--speculative-num-draft-tokens", "65"])
    assert cfg.speculative_algorithm == "TEV"
    assert cfg.speculative_num_draft_tokens == 65  # N = B + 1
    assert cfg.speculative_dflash_block_size == 16  # from the drafter's config.json
    assert cfg.speculative_num_steps == 15  # max depth K - 1
    assert cfg.speculative_eagle_topk == 1
    assert cfg.disable_overlap_schedule is False  # overlap scheduling on, as SGLang's default
    # decode CUDA graphs stay on (SGLang's default, full): the target verify graph carries the tree
    # mask (graphs.py); fa3, the automatic choice on a Hopper GPU, ignores it and becomes triton
    assert cfg.cuda_graph_config.decode.backend == "full"
    assert cfg.attention_backend in ("flashinfer", "triton")
    assert cfg.speculative_draft_attention_backend in ("flashinfer", "triton")
    assert cfg.max_running_requests == 48


def test_explicit_settings_and_worker_view(monkeypatch):
    from sglang.srt.runtime_context import get_spec, publish, reset_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_tev.srt.config import settings_from_server_args

    monkeypatch.setenv("SGLANG_TEV_VERIFIER", "predraw")
    monkeypatch.setenv("SGLANG_TEV_TOPK", "6")
    sa, cfg = resolve(
        ["--speculative-num-draft-tokens", "33", "--speculative-dflash-block-size", "8", "--speculative-num-steps", "5",
         "--attention-backend", "triton", "--max-running-requests", "8"]
    )  # fmt: skip
    assert (cfg.speculative_num_draft_tokens, cfg.speculative_dflash_block_size, cfg.speculative_num_steps) == (33, 8, 5)
    assert cfg.attention_backend == "triton" and cfg.max_running_requests == 8
    algo = SpeculativeAlgorithm.from_string("TEV")
    assert algo.resolve_max_speculative_num_draft_tokens(sa) == 33
    try:
        publish(sa, role="scheduler")  # what a scheduler process sees
        s = settings_from_server_args(get_spec())
        assert (s.tree_size, s.budget, s.block_size, s.max_depth, s.topk, s.verifier) == (33, 32, 8, 5, 6, "predraw")
        # draft runner verifies the K-token block; the target the N-node tree
        assert algo.get_num_tokens_per_req_for_target_verify(33, True) == 8
        assert algo.get_num_tokens_per_req_for_target_verify(33, False) == 33
    finally:
        reset_context()


def test_engine_kwargs_resolve_like_the_cli():
    """``sglang.Engine(..., speculative_algorithm="TEV")`` builds ServerArgs from keywords."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=str(TINY / "target"),
        speculative_algorithm="TEV",
        speculative_draft_model_path=str(TINY / "draft"),
        speculative_num_draft_tokens=17,
        device="cuda",
    )
    sa.resolve_once()
    cfg = resolving_view(sa)
    assert (cfg.speculative_num_draft_tokens, cfg.speculative_dflash_block_size, cfg.speculative_num_steps) == (17, 16, 15)


BAD = [
    (["--speculative-num-steps", "16"], "num-steps is the max tree depth"),  # depth >= block size
    (["--speculative-num-steps", "0"], "num-steps is the max tree depth"),
    (["--speculative-num-draft-tokens", "1025"], r"must be in \[2, 1024\]"),  # tree larger than SGLang's limit
    (["--speculative-num-draft-tokens", "1"], r"must be in \[2, 1024\]"),
    (["--speculative-num-draft-tokens", "9", "--speculative-dflash-block-size", "40"], "exceeds 2 x the tree size"),
    (["--speculative-dflash-block-size", "1"], "block-size must be >= 2"),
    (["--attention-backend", "fa3"], "--attention-backend 'fa3' on --device cuda: TEV needs a backend that applies the tree mask"),
    (["--decode-attention-backend", "fa3", "--attention-backend", "triton"], "--decode-attention-backend 'fa3'"),
    (["--prefill-attention-backend", "fa3", "--attention-backend", "triton"], "--prefill-attention-backend 'fa3'"),
    (["--device", "cpu", "--cuda-graph-backend-decode", "full"],
     "--cuda-graph-backend-decode 'full' on --device cpu: accepted there: disabled .SGLang has no CPU graph runner"),
    (["--pp-size", "2"], "--pp-size must be 1"),
    (["--speculative-eagle-topk", "4"], "eagle-topk must be 1"),
    (["--speculative-draft-window-size", "64"], "draft-window-size"),
    (["--speculative-use-rejection-sampling"], "rejection-sampling does not apply"),
    (["--speculative-accept-threshold-acc", "0.5"], "threshold-acc must be 1.0"),
    (["--device", "cpu", "--attention-backend", "torch_native"], "'torch_native' on --device cpu.*accepted: .*--device cpu with --attention-backend tev_cpu"),
    (["--disaggregation-mode", "decode"], "disaggregation"),
    (["--enable-custom-logit-processor"], "--enable-custom-logit-processor is not supported"),
    (["--enable-return-hidden-states"], "--enable-return-hidden-states is not supported"),
    (["--return-hidden-states-mode", "last"], "--return-hidden-states-mode is not supported"),
    (["--enable-lora"], "--enable-lora is not supported"),
]


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("graph", ["full", "breakable", "disabled"])
def test_explicit_decode_graph_backend_is_kept_on_cuda(backend, graph):
    """``--cuda-graph-backend-decode`` with a tree-mask backend resolves as given (it was refused
    before the target verify graph carried the mask)."""
    _, cfg = resolve(["--attention-backend", backend, "--cuda-graph-backend-decode", graph])
    assert cfg.cuda_graph_config.decode.backend == graph
    assert cfg.attention_backend == backend and cfg.speculative_draft_attention_backend == backend


@pytest.mark.parametrize("extra,match", BAD, ids=[" ".join(e) for e, _ in BAD])
def test_each_bad_combination_raises_our_error(extra, match):
    with pytest.raises(ValueError, match="TEV: .*" + match):
        resolve(extra)


@pytest.mark.parametrize(
    "var,value,match",
    [
        ("SGLANG_TEV_VERIFIER", "greedy", "SGLANG_TEV_VERIFIER must be one of"),
        ("SGLANG_TEV_VERIFIER", "eagle", "SGLANG_TEV_VERIFIER must be one of"),
        ("SGLANG_TEV_TOPK", "0", "SGLANG_TEV_TOPK must be an integer >= 1"),
        ("SGLANG_TEV_TOPK", "four", "SGLANG_TEV_TOPK must be an integer >= 1"),
    ],
)
def test_bad_environment_is_refused_at_startup(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        resolve()


def test_missing_drafter_is_refused():
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", str(TINY / "target"), "--speculative-algorithm", "TEV", "--device", "cuda"])
    with pytest.raises(ValueError, match="TEV: --speculative-draft-model-path is required"):
        sa.resolve_once()


def test_worker_module_imports_on_cpu_and_subclasses_dflash_v2():
    """The GPU worker cannot run here; its module must still import against sglang 0.5.23 and
    plug into the factory SGLang calls."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_tev.srt.worker import META_INFO_KEYS, TEVWorker

    assert issubclass(TEVWorker, DFlashWorkerV2)
    algo = SpeculativeAlgorithm.from_string("TEV")
    sa = ServerArgs(model_path="dummy", disable_overlap_schedule=True)
    assert algo.create_worker(sa) is TEVWorker
    assert META_INFO_KEYS == ("tev_accept_length", "tev_exit_depth", "tev_coverage", "tev_budget")
    assert torch.is_tensor(torch.zeros(1))


def test_smoke_script_refuses_without_a_gpu():
    """scripts/sglang_smoke.py parses its arguments and, with no CUDA GPU, exits 2 saying why."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run scripts/sglang_smoke.py itself")
    script = ROOT / "scripts" / "sglang_smoke.py"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script), "--budget", "8", "--batch", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "no CUDA GPU" in res.stderr
    res = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--budget" in res.stdout


def test_algo_helpers_without_a_published_or_readable_config():
    from types import SimpleNamespace

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_tev.srt.algo import read_draft_block_size

    algo = SpeculativeAlgorithm.from_string("TEV")
    ns = SimpleNamespace(speculative_num_draft_tokens=9, speculative_dflash_block_size=16)
    assert algo.resolve_max_speculative_num_draft_tokens(ns) == 16  # the block is wider than the tree
    ns = SimpleNamespace(speculative_num_draft_tokens=None, speculative_dflash_block_size=None)
    assert algo.resolve_max_speculative_num_draft_tokens(ns) is None
    missing = SimpleNamespace(
        speculative_draft_model_path=str(ROOT / "no-such-drafter"), trust_remote_code=False,
        speculative_draft_model_revision=None, json_model_override_args="{}",
    )  # fmt: skip
    assert read_draft_block_size(missing) is None  # resolve_server_args then asks for the flag
    found = SimpleNamespace(**{**vars(missing), "speculative_draft_model_path": str(TINY / "draft")})
    assert read_draft_block_size(found) == 16
