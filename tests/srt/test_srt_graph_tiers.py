"""Target verify graphs per tree-size tier for ``SGLANG_TEV_BUDGET=auto`` (``sglang_tev.srt.graph_tiers``).

No GPU here, so this checks what can be checked without one: which tiers a server captures, that each
tier's backend and runner are built at the tier's width (SGLang's ``speculative_num_draft_tokens``
overridden, as UNO builds its private backend) with the model runner bound to the tier's backend
during capture and restored after (also when a capture fails), and that a round's binding swaps the
model runner's graph runner and restores it. A whole worker round replaying the tier of its width is
emulated in ``tests/srt/test_srt_graphs.py::test_graph_tiers_replay_each_rounds_width_and_keep_plain_greedy``;
the real capture and replay are ``scripts/sglang_smoke.py``'s ``TEV-auto`` on a GPU.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_tev.testing.sglang_cpu.required import require_sglang

require_sglang()

from sglang_tev.srt import graph_tiers as G  # noqa: E402
from sglang_tev.srt.budget import ServedBudget  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "sglang_tev/assets/tiny-code"


def test_tier_sizes_default_requested_and_refused():
    assert G.tier_sizes(65) == (1, 5, 9, 17, 33, 65)
    assert G.tier_sizes(17) == (1, 5, 9, 17)
    assert G.tier_sizes(2) == (1, 2)
    assert G.tier_sizes(17, (9,)) == (1, 9, 17)  # 1 (a plain step) and N always added
    assert G.tier_sizes(17, (17, 3, 3)) == (1, 3, 17)
    with pytest.raises(ValueError, match=r"SGLANG_TEV_GRAPH_TREE_SIZES.*\[1, N = 17\].*\[18\]"):
        G.tier_sizes(17, (5, 18))
    for bad in (0, 1, 2.0, True, "17"):
        with pytest.raises(ValueError, match="tree_size must be an integer >= 2"):
            G.tier_sizes(bad)
    for bad in (["a"], [True], [5.0]):
        with pytest.raises(ValueError, match="requested must be integer tree sizes"):
            G.tier_sizes(17, bad)


class _Runner(SimpleNamespace):
    pass


def test_binding_swaps_the_runner_and_its_backend_for_the_round_and_restores_them(caplog):
    b9, b5 = object(), object()
    main, r5 = _Runner(captured_req_width=9, attn_backend=b9), _Runner(captured_req_width=5, attn_backend=object())
    mr = SimpleNamespace(decode_cuda_graph_runner=main, attn_backend=b9)
    r5.attn_backend = b5
    tiers = G.GraphTiers(mr, {9: main, 5: r5, 1: _Runner(captured_req_width=1, attn_backend=object())})
    assert tiers.sizes == (1, 5, 9) and tiers.budgets == (0, 4, 8)
    with tiers.bound(5) as r:  # what runs outside the graph reads the model runner's backend: the tier's
        assert r is r5 and mr.decode_cuda_graph_runner is r5 and mr.attn_backend is b5
    assert mr.decode_cuda_graph_runner is main and mr.attn_backend is b9
    with tiers.bound(3) as r:  # no tier: the forward runs eagerly on SGLang's own backend
        assert r is None and mr.decode_cuda_graph_runner is None and mr.attn_backend is b9
    with pytest.raises(RuntimeError, match="boom"), tiers.bound(1):
        raise RuntimeError("boom")
    assert mr.decode_cuda_graph_runner is main and mr.attn_backend is b9
    with pytest.raises(ValueError, match="runners: the runner under tree size 5 was captured at 9"):
        G.GraphTiers(mr, {5: main})
    with pytest.raises(ValueError, match=r"tree size 5 \(N\) must be the model runner's own"):
        G.GraphTiers(mr, {5: r5, 1: _Runner(captured_req_width=1)})
    with pytest.raises(ValueError, match="runners must hold at least SGLang's runner at N"):
        G.GraphTiers(mr, {})
    with pytest.raises(ValueError, match="the runner under tree size 1 was captured at None"):
        G.GraphTiers(mr, {9: main, 1: _Runner()})
    with caplog.at_level("INFO", logger=G.__name__):  # each size's first replay is said once (the smoke test counts them)
        for w in (5, 5, 9, 1, 5):
            tiers.replayed(w)
    assert sorted(r.getMessage() for r in caplog.records if "first replay" in r.getMessage()) == [
        f"TEV: first replay of the target verify graph at tree size {w}" for w in (1, 5, 9)]
    # SGLang recaptured its runner (a weight update): N replays the new one, the tiers below go eager
    new_main = _Runner(captured_req_width=9, attn_backend=b9)
    mr.decode_cuda_graph_runner = new_main
    with caplog.at_level("WARNING", logger=G.__name__):
        assert tiers.runner_for(9) is new_main and tiers.runner_for(5) is None and tiers.runner_for(1) is None
        with tiers.bound(5) as r:
            assert r is None and mr.decode_cuda_graph_runner is None
    assert mr.decode_cuda_graph_runner is new_main
    assert sum("recaptured" in r.getMessage() for r in caplog.records) == 1
    assert tiers.runners == {9: main}  # the stale tiers' graphs are released


@pytest.fixture
def widths(monkeypatch):
    """SGLang's ``speculative_num_draft_tokens`` as the override context sets it (a stand-in)."""
    state = {"width": 65}

    @contextlib.contextmanager
    def spec_width(w):
        saved, state["width"] = state["width"], w
        try:
            yield
        finally:
            state["width"] = saved

    monkeypatch.setattr(G, "_spec_width", spec_width)
    return state


def test_tier_backends_are_built_at_each_tiers_width(widths):
    made = []

    class MR:
        def _get_attention_backend(self, init_new_workspace=False):
            made.append((widths["width"], init_new_workspace))
            return SimpleNamespace(width=widths["width"])

    mr = MR()
    backends = G.build_tier_backends(mr, (1, 5, 9, 17), 17)
    assert sorted(made) == [(1, False), (5, False), (9, False)]  # N's is SGLang's own; the workspace shared
    assert {w: b.width for w, b in backends.items()} == {1: 1, 5: 5, 9: 9}
    assert widths["width"] == 65
    assert G.build_tier_backends(mr, (), 17) == {}

    class Short(MR):
        def _get_attention_backend(self, init_new_workspace=False):
            raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match=r"attention backend of graph tier 1 failed \(RuntimeError: CUDA out of memory\)"
                                           r".*SGLANG_TEV_GRAPH_TREE_SIZES=off"):
        G.build_tier_backends(Short(), (1, 17), 17)


def test_capture_binds_the_tiers_backend_and_restores_the_runner(widths):
    main_backend, main = object(), _Runner(captured_req_width=17)
    seen = []

    class Runner:
        def __init__(self, model_runner, *, attn_backend, speculative_num_draft_tokens):
            # capture reads the model runner's backend and must not see the main runner
            assert model_runner.attn_backend is attn_backend and model_runner.decode_cuda_graph_runner is None
            assert speculative_num_draft_tokens == widths["width"] == attn_backend.width
            self.captured_req_width = speculative_num_draft_tokens
            seen.append(speculative_num_draft_tokens)

    mr = SimpleNamespace(attn_backend=main_backend, decode_cuda_graph_runner=main, _decode_cuda_graph_runner_cls=lambda: Runner)
    backends = {w: SimpleNamespace(width=w) for w in (1, 5, 9)}
    served = ServedBudget(16, 8)
    tiers = G.capture_tiers(mr, backends, 17, served=served, log_rank0=False)
    assert seen == [9, 5, 1]  # widest first, as SGLang captures its buckets
    assert tiers.sizes == (1, 5, 9, 17) and tiers.runner_for(17) is main
    assert mr.attn_backend is main_backend and mr.decode_cuda_graph_runner is main
    assert served.grid == (0, 4, 8, 16)
    # no target graph (graphs off) or no tiers: nothing captured, every round eager
    assert G.capture_tiers(SimpleNamespace(decode_cuda_graph_runner=None), backends, 17) is None
    assert G.capture_tiers(mr, {}, 17) is None

    class Failing(Runner):
        def __init__(self, model_runner, **kw):
            raise RuntimeError("out of memory")

    mr._decode_cuda_graph_runner_cls = lambda: Failing
    with pytest.raises(RuntimeError, match=r"tree size 9 failed \(RuntimeError: out of memory\).*SGLANG_TEV_GRAPH_TREE_SIZES=off"):
        G.capture_tiers(mr, backends, 17)
    assert mr.attn_backend is main_backend and mr.decode_cuda_graph_runner is main


def test_served_grid_takes_the_tiers_budgets_before_the_first_round():
    served = ServedBudget(16, 8)
    for bad in ((4, 8, 16), (0, 4, 8), (0, 4, 17, 16), ()):
        with pytest.raises(ValueError, match="budgets must lie in"):
            served.use_grid(bad)
    served.use_grid((16, 0, 8))
    assert served.grid == (0, 8, 16)
    plan = served.plan(2)
    assert plan.budget in served.grid
    with pytest.raises(RuntimeError, match="before the first round"):
        served.use_grid((0, 16))


def test_which_servers_capture_tiers(monkeypatch):
    import sglang.srt.runtime_context as rc

    backend, tbo, pdmux = {"value": "full"}, {"on": False}, {"on": False}
    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(graph=SimpleNamespace(
        cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend=backend["value"]))),
        overlap=SimpleNamespace(enable_two_batch_overlap=tbo["on"])))  # fmt: skip
    monkeypatch.setattr(rc, "get_disagg", lambda: SimpleNamespace(enable_pdmux=pdmux["on"]))
    auto = SimpleNamespace(budget_mode="auto", tree_size=33)
    assert G.wanted_tier_sizes(auto, "cuda:0", environ={}) == (1, 5, 9, 17, 33)
    assert G.wanted_tier_sizes(auto, "cuda", environ={"SGLANG_TEV_GRAPH_TREE_SIZES": "9"}) == (1, 9, 33)
    assert G.wanted_tier_sizes(auto, "cuda", environ={"SGLANG_TEV_GRAPH_TREE_SIZES": "off"}) == ()
    assert G.wanted_tier_sizes(auto, "cpu", environ={}) == ()
    for mode in ("fixed", "auto-ragged"):
        assert G.wanted_tier_sizes(SimpleNamespace(budget_mode=mode, tree_size=33), "cuda", environ={}) == ()
    for flag in (tbo, pdmux):  # both re-wrap the backends per runner: no tiers (SGLang's runner at N stays)
        flag["on"] = True
        assert G.wanted_tier_sizes(auto, "cuda", environ={}) == ()
        flag["on"] = False
    backend["value"] = "disabled"
    assert G.wanted_tier_sizes(auto, "cuda", environ={}) == ()


def test_the_width_override_is_sglangs_spec_config():
    """``_spec_width`` sets what SGLang's backends and runners read at construction, and restores it
    (on a DFLASH server's published config: the field is the same for every speculative algorithm)."""
    from sglang.srt.runtime_context import get_spec, publish, reset_context
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(["--model-path", str(TINY / "target"), "--speculative-algorithm", "DFLASH",
                              "--speculative-draft-model-path", str(TINY / "draft"), "--device", "cuda",
                              "--speculative-num-draft-tokens", "33"])  # fmt: skip
    sa.resolve_once()
    try:
        publish(sa, role="scheduler")
        with G._spec_width(9):
            assert get_spec().speculative_num_draft_tokens == 9
        assert get_spec().speculative_num_draft_tokens == 33
    finally:
        reset_context()
