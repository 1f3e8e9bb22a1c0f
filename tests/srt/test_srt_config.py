"""TEV settings resolution without sglang (plain objects standing in for ServerArgs).

The same functions run inside SGLang's pipeline in tests/srt/test_srt_plugin.py; here they are
checked on their own, so they are covered even where sglang is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from sglang_tev.srt.kv_headroom import overlap_reserve_need
from sglang_tev.srt.config import (
    DEFAULT_TREE_SIZE,
    TevSettings,
    read_env,
    resolve_server_args,
    settings_from_server_args,
    validate_server_args,
)


def args(**kw):
    base = dict(
        device="cuda", pp_size=1, attn_dp_size=1, enable_dp_attention=False, disaggregation_mode="null",
        speculative_draft_model_path="drafter", speculative_num_draft_tokens=None, speculative_dflash_block_size=None,
        speculative_num_steps=None, speculative_eagle_topk=None, speculative_draft_window_size=None,
        speculative_use_rejection_sampling=False, speculative_use_block_verification=False,
        speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0,
        attention_backend="flashinfer", prefill_attention_backend=None, decode_attention_backend=None,
        speculative_draft_attention_backend=None, disable_overlap_schedule=False, cuda_graph_config=None,
        cuda_graph_backend_decode=None, max_running_requests=None,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def test_defaults_from_the_drafter_and_plain_writes():
    sa = args(attention_backend="fa3", _raw_input={"attention_backend": None})  # fa3 was SGLang's automatic choice
    s = resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={})
    assert s == TevSettings(tree_size=DEFAULT_TREE_SIZE, block_size=16, max_depth=15, topk=64, verifier="tev")
    assert s.budget == 64
    assert (sa.speculative_num_draft_tokens, sa.speculative_dflash_block_size, sa.speculative_num_steps) == (65, 16, 15)
    # fa3 ignores the tree mask: the default replacement is Triton (sync-free masked graph replay)
    assert sa.attention_backend == "triton" and sa.speculative_draft_attention_backend == "triton"
    # overlap scheduling stays on (65 + 15 + 1 <= 2 x 65: the KV reserve covers a lagging step)
    assert sa.disable_overlap_schedule is False and sa.max_running_requests == 48 and sa.speculative_eagle_topk == 1
    # a worker process rebuilds the same settings from the resolved fields
    assert settings_from_server_args(sa, environ={}) == s


@pytest.mark.parametrize(
    "n,k,d,overlap",
    [(65, 16, 15, True), (17, 16, 15, True), (9, 16, 15, False), (9, 16, 7, False), (13, 16, 9, True), (9, 8, 7, True),
     (2, 4, 3, False), (3, 4, 1, True)],
)
def test_overlap_stays_on_only_where_the_kv_reserve_covers_a_lagging_step(n, k, d, overlap, caplog):
    """Overlap scheduling reserves 2N slots from a committed length one step behind the worker's,
    so it stays on only when max(N, K) + min(D, N - 1) + 1 <= 2N; otherwise it is turned off with a
    warning naming the flags (the server keeps serving, without overlap)."""
    sa = args(speculative_num_draft_tokens=n, speculative_dflash_block_size=k, speculative_num_steps=d)
    with caplog.at_level("WARNING", logger="sglang_tev.srt.config"):
        resolve_server_args(sa, environ={})
    assert sa.disable_overlap_schedule is (not overlap)
    warned = [r.getMessage() for r in caplog.records if "overlap scheduling disabled" in r.getMessage()]
    assert bool(warned) is (not overlap)
    if warned:
        assert f"N={n}, K={k}, D={d}" in warned[0] and "--speculative-num-steps" in warned[0]
        # the smallest tree size that keeps overlap with this block and depth is named, and it does
        smallest = int(warned[0].split("--speculative-num-draft-tokens >= ")[1].split(",")[0])
        assert overlap_reserve_need(smallest, k, d) <= 2 * smallest and overlap_reserve_need(smallest - 1, k, d) > 2 * (smallest - 1)
    # an operator who turned overlap off keeps it off
    off = args(speculative_num_draft_tokens=n, speculative_dflash_block_size=k, speculative_num_steps=d, disable_overlap_schedule=True)
    resolve_server_args(off, environ={})
    assert off.disable_overlap_schedule is True


@dataclass
class _Phase:  # the fields of SGLang's PhaseConfig that TEV reads or writes
    backend: str = "full"
    bs: tuple = (1, 2, 4, 8)


@dataclass
class _GraphConfig:  # stands in for SGLang's CudaGraphConfig (a dataclass of two phases)
    decode: _Phase = field(default_factory=_Phase)
    prefill: _Phase = field(default_factory=lambda: _Phase(backend="breakable"))


@pytest.mark.parametrize("explicit", [None, "full", "breakable", "disabled"])
def test_cuda_keeps_decode_graphs_the_target_verify_captures_with_the_tree_mask(explicit, caplog):
    """On CUDA TEV keeps SGLang's decode-graph choice (full by default) and accepts an explicit
    ``--cuda-graph-backend-decode``: the target's verify graph is captured with the tree mask
    (``graphs``), and both attention backends TEV accepts apply it under capture."""
    for backend in ("triton", "flashinfer"):
        cfg = _GraphConfig(decode=_Phase(backend=explicit or "full"))
        sa = args(attention_backend=backend, cuda_graph_config=cfg, cuda_graph_backend_decode=explicit)
        with caplog.at_level("INFO", logger="sglang_tev.srt.config"):
            resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={})
        assert sa.cuda_graph_config is cfg and cfg.decode.backend == (explicit or "full")
        assert sa.attention_backend == backend and sa.speculative_draft_attention_backend == backend
    # the only word on graphs: auto's (the default) tiers, captured beside SGLang's at N (none when disabled)
    said = {r.getMessage() for r in caplog.records if "graph" in r.getMessage()}
    tiers = {"TEV: SGLANG_TEV_BUDGET=auto captures target verify graphs at tree sizes 1, 5, 9, 17, 33, 65 "
             "(SGLANG_TEV_GRAPH_TREE_SIZES)"}
    assert said == (set() if explicit == "disabled" else tiers), said


def test_cpu_turns_decode_graphs_off_and_says_why(caplog):
    """``--device cpu``: SGLang's CPU graph runner has no speculative path, so the decode phase is
    set to disabled (prefill untouched), with a log line giving the reason."""
    cfg = _GraphConfig()
    sa = args(device="cpu", attention_backend=None, cuda_graph_config=cfg, _raw_input={"attention_backend": None})
    with caplog.at_level("INFO", logger="sglang_tev.srt.config"):
        resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={"SGLANG_USE_CPU_ENGINE": "1"})
    assert sa.cuda_graph_config.decode.backend == "disabled" and sa.cuda_graph_config.prefill.backend == "breakable"
    assert cfg.decode.backend == "full"  # replaced, not mutated (SGLang's resolution declares values)
    assert any("no CPU graph runner for speculative decoding" in r.getMessage() for r in caplog.records)
    # an explicit "disabled" is accepted on CPU
    validate_server_args(args(device="cpu", attention_backend=None, cuda_graph_backend_decode="disabled"),
                         environ={"SGLANG_USE_CPU_ENGINE": "1"})  # fmt: skip


def test_auto_budget_keeps_graphs_per_tier_and_reaches_the_worker(caplog):
    """SGLANG_TEV_BUDGET=auto on CUDA keeps the decode graphs (one target tier per tree size,
    graph_tiers; the sizes in the log); with SGLANG_TEV_GRAPH_TREE_SIZES=off, and under auto-ragged,
    the decode runs eagerly (said in the log); a tier above N is refused on every device before
    any write; the worker's rebuilt settings carry the mode; auto is the default."""
    cfg = _GraphConfig()
    sa = args(attention_backend="triton", cuda_graph_config=cfg)
    env = {"SGLANG_TEV_BUDGET": "Auto"}
    with caplog.at_level("INFO", logger="sglang_tev.srt.config"):
        s = resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ=env)
    assert s.budget_mode == "auto" and settings_from_server_args(sa, environ=env) == s
    assert sa.cuda_graph_config.decode.backend == "full"
    assert any("graphs at tree sizes 1, 5, 9, 17, 33, 65" in r.getMessage() for r in caplog.records)
    caplog.clear()
    sa = args(attention_backend="triton", cuda_graph_config=_GraphConfig())
    with caplog.at_level("WARNING", logger="sglang_tev.srt.config"):
        resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={**env, "SGLANG_TEV_GRAPH_TREE_SIZES": "off"})
    assert sa.cuda_graph_config.decode.backend == "disabled" and cfg.decode.backend == "full"
    assert any("runs the decode eagerly (SGLANG_TEV_GRAPH_TREE_SIZES=off)" in r.getMessage() for r in caplog.records)
    for device, backend in (("cuda", "triton"), ("cpu", None)):
        sa = args(device=device, attention_backend=backend, cuda_graph_config=_GraphConfig(),
                  speculative_num_draft_tokens=17)  # fmt: skip
        before = dict(vars(sa))
        with pytest.raises(ValueError, match=r"SGLANG_TEV_GRAPH_TREE_SIZES: tree sizes must be in \[1, N = 17\].*\[33\]"):
            resolve_server_args(sa, read_draft_block_size=lambda _: 16,
                                environ={**env, "SGLANG_TEV_GRAPH_TREE_SIZES": "9,33", "SGLANG_USE_CPU_ENGINE": "1"})
        assert vars(sa) == before  # refused before any write
    for bad in ("nine", "0", "1,,3", "-1"):  # "0" is a tree size (refused), not a word for off
        with pytest.raises(ValueError, match="SGLANG_TEV_GRAPH_TREE_SIZES must be auto, off or comma-separated"):
            validate_server_args(args(attention_backend="triton"), environ={"SGLANG_TEV_GRAPH_TREE_SIZES": bad})
    # two-batch overlap / PD multiplexing: SGLang's graphs at N stay, no tiers (said)
    for flag in ("enable_two_batch_overlap", "enable_pdmux"):
        sa = args(attention_backend="triton", cuda_graph_config=_GraphConfig(), **{flag: True})
        caplog.clear()
        with caplog.at_level("WARNING", logger="sglang_tev.srt.config"):
            resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ=env)
        assert sa.cuda_graph_config.decode.backend == "full"
        assert any("captures no graph tiers: rounds below N = 65 run eagerly" in r.getMessage() for r in caplog.records)
    # auto is the default; fixed keeps SGLang's graphs at N only
    sa = args(attention_backend="triton", cuda_graph_config=_GraphConfig())
    assert resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={}).budget_mode == "auto"
    assert sa.cuda_graph_config.decode.backend == "full"
    sa = args(attention_backend="triton", cuda_graph_config=_GraphConfig())
    s = resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={"SGLANG_TEV_BUDGET": "fixed"})
    assert s.budget_mode == "fixed" and sa.cuda_graph_config.decode.backend == "full"
    # TP > 1 is served (rank 0 plans, every rank adopts: srt/budget.py)
    sa = args(attention_backend="triton", tp_size=2, cuda_graph_config=_GraphConfig())
    assert resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ=env).budget_mode == "auto"
    # auto-ragged (per-request sizes where the backend takes ragged verifies) runs eagerly
    sa = args(attention_backend="flashinfer", cuda_graph_config=_GraphConfig())
    s = resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={"SGLANG_TEV_BUDGET": "Auto-Ragged"})
    assert s.budget_mode == "auto-ragged" and sa.cuda_graph_config.decode.backend == "disabled"


def test_the_verify_layout_is_read_from_the_backend_object():
    from types import SimpleNamespace

    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sglang_tev.srt.config import verify_layout_for
    from sglang_tev.srt.cpu_attention import TorchCPUAttnBackend

    cpu, triton = object.__new__(TorchCPUAttnBackend), object.__new__(TritonAttnBackend)
    assert verify_layout_for(cpu) == "ragged" and verify_layout_for(triton) == "padded"
    # SGLang's hybrid backend: both halves must take ragged verifies
    assert verify_layout_for(SimpleNamespace(prefill_backend=cpu, decode_backend=cpu)) == "ragged"
    assert verify_layout_for(SimpleNamespace(prefill_backend=cpu, decode_backend=triton)) == "padded"
    assert verify_layout_for(None) == "padded"


def test_env_settings():
    assert read_env({}) == ("tev", None)
    assert read_env({"SGLANG_TEV_VERIFIER": "Sequential", "SGLANG_TEV_TOPK": "8"}) == ("sequential", 8)
    sa = args(speculative_num_draft_tokens=33, speculative_dflash_block_size=8, speculative_num_steps=3, attention_backend="triton")
    s = resolve_server_args(sa, environ={"SGLANG_TEV_VERIFIER": "predraw", "SGLANG_TEV_TOPK": "4"})
    assert (s.tree_size, s.block_size, s.max_depth, s.topk, s.verifier) == (33, 8, 3, 4, "predraw")
    assert sa.attention_backend == "triton"


@pytest.mark.parametrize(
    "kw,env,match",
    [
        (dict(speculative_num_steps=16), {}, "max tree depth"),
        (dict(speculative_num_draft_tokens=2048), {}, r"\[2, 1024\]"),
        (dict(speculative_num_draft_tokens=3.5), {}, "must be an integer"),
        (dict(speculative_dflash_block_size=40, speculative_num_draft_tokens=9), {}, "exceeds 2 x the tree size"),
        (dict(_raw_input={"attention_backend": "fa3"}), {}, "--attention-backend 'fa3'"),
        (dict(device="npu"), {}, r"--device 'npu' is not supported; accepted: --device cuda with --attention-backend triton or flashinfer; --device cpu with --attention-backend tev_cpu"),
        (dict(device="cpu", _raw_input={"attention_backend": "flashinfer"}), {}, "'flashinfer' on --device cpu"),
        (dict(_raw_input={"attention_backend": "tev_cpu"}), {}, "'tev_cpu' on --device cuda"),
        (dict(_raw_input={"speculative_draft_attention_backend": "fa3"}), {}, "--speculative-draft-attention-backend 'fa3'"),
        (dict(pp_size=2), {}, "--pp-size"),
        (dict(attn_dp_size=2), {}, "data parallelism"),
        (dict(speculative_draft_model_path=None), {}, "draft-model-path is required"),
        (dict(speculative_eagle_topk=2), {}, "eagle-topk"),
        (dict(speculative_use_block_verification=True), {}, "block-verification"),
        (dict(speculative_accept_threshold_single=0.9), {}, "threshold-single"),
        (dict(cuda_graph_backend_decode="piecewise"), {}, r"--cuda-graph-backend-decode 'piecewise' on --device cuda: accepted there: full, breakable, disabled"),
        (dict(device="cpu", attention_backend=None, cuda_graph_backend_decode="full"), {"SGLANG_USE_CPU_ENGINE": "1"},
         "'full' on --device cpu: accepted there: disabled .SGLang has no CPU graph runner for speculative decoding"),
        (dict(device="cpu", attention_backend=None, enable_torch_compile=True), {"SGLANG_USE_CPU_ENGINE": "1"},
         "--enable-torch-compile on --device cpu"),
        (dict(), {"SGLANG_TEV_VERIFIER": "greedy"}, "SGLANG_TEV_VERIFIER"),
        (dict(), {"SGLANG_TEV_TOPK": "-1"}, "SGLANG_TEV_TOPK"),
        (dict(), {"SGLANG_TEV_BUDGET": "ragged"}, "SGLANG_TEV_BUDGET"),
    ],
)
def test_bad_settings_raise_one_clear_error(kw, env, match):
    sa = args(**kw)
    before = dict(vars(sa))
    with pytest.raises(ValueError, match=match):
        resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ=env)
    if "speculative_num_steps" not in kw and "speculative_dflash_block_size" not in kw:
        assert vars(sa) == before  # refused before any write


def test_admission_refuses_what_the_table_lists(monkeypatch):
    """Nothing is refused per request today (penalties and min_new_tokens are served since issue
    25); the check still refuses, by name, whatever :data:`REFUSED_OPTIONS` lists."""
    import sglang_tev.srt.admission as A

    assert A.REFUSED_OPTIONS == {}
    monkeypatch.setattr(A, "REFUSED_OPTIONS", {"frequency_penalty": (0.0, "a test reason")})
    with pytest.raises(ValueError, match="TEV: sampling parameter frequency_penalty=0.5 .*a test reason"):
        A.check_sampling_params({"frequency_penalty": 0.5, "temperature": 0.7})
    A.check_sampling_params({"frequency_penalty": 0.0})
    tev = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="TEV"), model_config=SimpleNamespace(vocab_size=8))
    other = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="EAGLE"))
    req = SimpleNamespace(sampling_params={"frequency_penalty": 0.5})
    with pytest.raises(ValueError, match="frequency_penalty=0.5"):
        A._after_validate(None, tev, req, [1, 2])
    assert A._after_validate("ok", other, req, [1, 2]) == "ok"  # other algorithms are not touched
    # the prompt check runs in the same hook, before the options
    with pytest.raises(ValueError, match="prompt is empty"):
        A._after_validate(None, tev, req, [])
    with pytest.raises(ValueError, match="out-of-vocabulary token id 8"):
        A._after_validate(None, tev, SimpleNamespace(sampling_params={}, input_embeds=None), input_ids=[8])


def test_served_options_pass_admission():
    from sglang_tev.srt.admission import check_sampling_params

    check_sampling_params(None)
    check_sampling_params(
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "frequency_penalty": 0.5, "presence_penalty": -1.0,
         "repetition_penalty": 1.1, "min_new_tokens": 3, "logit_bias": {"5": 1.0}, "regex": "[a-z]+", "n": 2}
    )  # fmt: skip


def test_cpu_device_takes_the_torch_reference_backend():
    sa = args(device="cpu", attention_backend=None, _raw_input={"attention_backend": None})
    with pytest.raises(ValueError, match="--device cpu runs on SGLang's CPU engine: set SGLANG_USE_CPU_ENGINE=1"):
        resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={})
    resolve_server_args(sa, read_draft_block_size=lambda _: 16, environ={"SGLANG_USE_CPU_ENGINE": "1"})
    assert sa.attention_backend == "tev_cpu" and sa.speculative_draft_attention_backend == "tev_cpu"


def test_unknown_block_size_asks_for_the_flag():
    with pytest.raises(ValueError, match="pass --speculative-dflash-block-size"):
        resolve_server_args(args(), read_draft_block_size=lambda _: None, environ={})
    with pytest.raises(ValueError, match="were not resolved"):
        settings_from_server_args(args(), environ={})
    validate_server_args(args(), environ={})  # the defaults themselves are fine


def test_import_sglang_tev_does_not_import_sglang():
    code = "import sys, sglang_tev, sglang_tev.srt, sglang_tev.srt.config, sglang_tev.srt.round; print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_prompts_the_scheduler_cannot_run_are_refused_at_admission():
    """An empty prompt and an out-of-vocabulary id made SGLang's scheduler exit (found by a
    fresh-user trial); TEV refuses them with one error each (HTTP 400 on a server)."""
    from sglang_tev.srt.admission import check_input_ids

    check_input_ids([0, 5, 4095], 4096)
    check_input_ids(None, 4096)  # an input_embeds request
    with pytest.raises(ValueError, match="prompt is empty"):
        check_input_ids([], 4096)
    with pytest.raises(ValueError, match=r"out-of-vocabulary token id 4096; valid range is \[0, 4096\)"):
        check_input_ids([1, 4096], 4096)
    with pytest.raises(ValueError, match="out-of-vocabulary token id -1"):
        check_input_ids([-1], 4096)



def test_min_p_is_refused_only_under_deterministic_inference():
    """SGLang's seeded sampler asserts on min-p and its scheduler exits (plain decoding too); a
    server with deterministic inference (every request seeded) refuses min-p by name instead."""
    import sglang_tev.srt.admission as A

    A.check_deterministic_min_p({"min_p": 0.05, "temperature": 1.0}, deterministic=False)
    A.check_deterministic_min_p({"min_p": 0.0}, deterministic=True)
    A.check_deterministic_min_p(None, deterministic=True)
    with pytest.raises(ValueError, match=r"min_p=0.05 with --enable-deterministic-inference"):
        A.check_deterministic_min_p({"min_p": 0.05}, deterministic=True)
    det = SimpleNamespace(
        server_args=SimpleNamespace(speculative_algorithm="TEV", enable_deterministic_inference=True),
        model_config=SimpleNamespace(vocab_size=8),
    )
    with pytest.raises(ValueError, match="min_p"):
        A._after_validate(None, det, SimpleNamespace(sampling_params={"min_p": 0.1}, input_embeds=None), [1])
    plain = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm="TEV"), model_config=SimpleNamespace(vocab_size=8))
    assert A._after_validate("ok", plain, SimpleNamespace(sampling_params={"min_p": 0.1}, input_embeds=None), [1]) == "ok"
