"""TEV's per-round ``meta_info`` lists through SGLang 0.5.23's own output path, no Engine: a real
``Req`` advanced round by round, SGLang's ``_maybe_collect_customized_info`` (wrapped by the
plugin's hook), SGLang's output streamer deciding when to send and slicing what it sends, and
``TokenizerManager.update_request_meta_info`` accumulating the slices (wrapped by the tokenizer-side
hook). Every round must come back, once, in order, streamed or not, past the 50-token sends, with
a round cut by max_new_tokens or a stop token; without the hooks SGLang drops rounds (the control).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("SGLANG_TEV_REQUIRE_SGLANG") == "1":  # set by .ci/run: never skip in CI
        raise RuntimeError("SGLANG_TEV_REQUIRE_SGLANG=1 but sglang is not installed")
    pytest.skip("sglang is not installed (pip install 'sglang-tev[sglang]')", allow_module_level=True)

from sglang_tev.srt.meta_info import (  # noqa: E402
    META_INFO_KEYS,
    RoundLog,
    _after_update,
    _collect_around,
    align_round_values,
    compact_round_values,
)


def _sglang():
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.managers.scheduler_components.output_streamer import (
        DEFAULT_FORCE_STREAM_INTERVAL,
        _GenerationStreamAccumulator,
    )
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SimpleNamespace(**locals())


def serve(rounds, *, stream, stream_interval=1, max_new_tokens=None, stop_token=None, hooks=True):
    """Run one request through SGLang's output path: the prefill token, then one decode round per
    entry of ``rounds`` (tokens emitted) until the request finishes. Returns (per-round values the
    scheduler produced, the final ``meta_info``, the number of sends)."""
    s = _sglang()
    if max_new_tokens is None:  # the last round ends exactly at the length cap
        max_new_tokens = 1 + sum(rounds)
    sp = s.SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=None if stop_token is None else [stop_token])
    sp.normalize(None)
    req = s.Req("r0", "", [1, 2, 3], sp, stream=stream)
    req.sampling_params.stream_interval = stream_interval
    collect = s.SchedulerBatchResultProcessor._maybe_collect_customized_info
    tm = SimpleNamespace(_accumulate_request_meta_info=s.TokenizerManager._accumulate_request_meta_info)
    update = s.TokenizerManager.update_request_meta_info
    state = SimpleNamespace(customized_info_accumulated={}, customized_info_reported_keys=set())
    meta, sends, produced = {}, 0, []

    def send():
        nonlocal sends
        acc = s._GenerationStreamAccumulator(
            return_logprob=False, return_hidden_states=False, return_routed_experts=False,
            return_indexer_topk=False, spec_algorithm=s.SpeculativeAlgorithm.NONE,
            disaggregation_mode=s.DisaggregationMode.NULL, default_stream_interval=1,
            default_force_stream_interval=s.DEFAULT_FORCE_STREAM_INTERVAL,
            get_cached_tokens_details=lambda r: None, is_request_level_customized_info_key=lambda k: False,
            current_weight_version=None, rust_server_mode=True,
        )
        acc.accept(req=req)
        if not acc.rids:
            return
        sends += 1
        info = {k: v for k, v in acc.customized_info.items()}
        update(tm, meta, state, info, 0, None)
        if hooks:
            _after_update(None, tm, meta, state, info, 0, None)

    req.output_ids.append(7)  # the prefill's token (no customized_info: TEV's rounds start after it)
    req.update_finish_state(1)
    send()
    token = 10
    for r, k in enumerate(rounds):
        if req.finished():
            break
        new = list(range(token, token + k))
        token += k
        if stop_token is not None and r == len(rounds) // 2:
            new[k // 2] = stop_token  # a stop inside this round's block
        req.output_ids.extend(new)
        req.update_finish_state(k)
        values = (k, k - 1, 0.5 * r, 16 - r % 3)
        produced.append(values)
        out = SimpleNamespace(customized_info={key: [v] for key, v in zip(META_INFO_KEYS, values)})
        if hooks:
            _collect_around(collect, None, 0, req, out)
        else:
            collect(None, 0, req, out)
        send()
    assert req.finished()
    return produced, meta, sends


ROUNDS = [3, 1, 5, 2, 8, 1, 1, 4, 6, 2, 3, 7, 1, 2, 5, 9, 1, 3, 2, 4, 6, 1, 1, 2, 8, 3, 5, 2, 1, 4] * 3


@pytest.mark.parametrize(
    "case",
    [
        dict(stream=False),  # sent at each multiple of 50 output tokens and at the end
        dict(stream=True, stream_interval=1),
        dict(stream=True, stream_interval=7),
        dict(stream=False, max_new_tokens=123),  # the last round is cut by the length cap
        dict(stream=True, stream_interval=3, stop_token=5),  # a stop token inside a round
        dict(stream=False, stop_token=5),
    ],
    ids=["nonstream", "stream1", "stream7", "length-cut", "stream-stop", "stop"],
)
def test_every_round_comes_back_once_in_order(case):
    produced, meta, sends = serve(ROUNDS, **case)
    assert sends >= 2, "the request was sent before its end too (the case the slicing broke)"
    for k, key in enumerate(META_INFO_KEYS):
        assert meta[key] == [v[k] for v in produced], key


def test_without_the_hooks_sglang_drops_rounds():
    """The control: SGLang's per-token slicing of one value per round loses the rounds after the
    first send (what the hooks fix)."""
    produced, meta, _ = serve(ROUNDS, stream=False, hooks=False)
    assert len(meta["tev_accept_length"]) < len(produced)
    produced, meta, _ = serve(ROUNDS, stream=True, hooks=False)
    assert len(meta["tev_accept_length"]) < len(produced)


def test_align_and_compact_by_hand():
    req = SimpleNamespace(output_ids=[7, 1, 2, 3], finished_len=None, customized_info={"tev_accept_length": [3]})
    align_round_values(req)
    assert req.customized_info["tev_accept_length"] == [None, None, None, 3]
    req.output_ids += [4, 5]
    req.finished_len = 5  # a stop at the 5th token: the 6th is not sent
    req.customized_info["tev_accept_length"].append(2)
    align_round_values(req)
    assert req.customized_info["tev_accept_length"] == [None, None, None, 3, 2]
    # other keys (another algorithm's) are left alone
    req = SimpleNamespace(output_ids=[1, 2, 3], finished_len=None, customized_info={"other": [9]})
    align_round_values(req)
    assert req.customized_info == {"other": [9]}
    state = SimpleNamespace(customized_info_accumulated={"tev_coverage": [None, 1.5, None, 2.0], "other": [None, 1]})
    meta = {"tev_coverage": state.customized_info_accumulated["tev_coverage"]}
    compact_round_values(meta, state)
    assert meta["tev_coverage"] == [1.5, 2.0] and state.customized_info_accumulated["other"] == [None, 1]


def test_plugin_registers_both_hooks():
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_tev.srt import meta_info
    from sglang_tev.srt.plugin import register

    register()
    meta_info.install_meta_info_hooks()  # idempotent
    for target, hook in ((meta_info._COLLECT, _collect_around), (meta_info._ACCUMULATE, _after_update)):
        assert sum(h is hook for _, h, _ in HookRegistry._hooks[target]) == 1, target


def test_round_log_lines(caplog):
    """The log line averages the rounds the scheduler has read; an unread round (the newest, in
    flight) waits for the next line, one never read (all its requests finished) is skipped, and
    the log itself runs no tensor op (it reads the columns' Python lists)."""
    from sglang_tev.srt.meta_info import round_info_to_host
    from sglang_tev.testing.host_sync import HostSyncCounter

    def round_(acc, depth, cov, budget, read=True):
        cols = round_info_to_host(*(torch.tensor(v) for v in (acc, depth, cov, budget)))
        if read:
            list(cols[META_INFO_KEYS[0]])  # what SGLang's result processor does, request by request
            for k in META_INFO_KEYS[1:]:
                cols[k][0]
        return cols

    log = logging.getLogger("test_round_log")
    rl = RoundLog(2, log)
    with caplog.at_level(logging.INFO, logger="test_round_log"):
        rl.record(round_([3, 1], [2, 0], [2.5, 1.0], [16, 8]))
        assert not caplog.records
        newest = round_([5], [4], [4.0], [32], read=False)
        with HostSyncCounter() as probe:
            rl.record(newest)  # a line over the one read round; the newest waits
        assert probe.events == []
        (line,) = [r.getMessage() for r in caplog.records]
        assert line == (
            "TEV: 1 rounds, 2 request-rounds: mean budget 12.0, accept length 2.00, exit depth 1.00, coverage 1.75"
        )
        newest[META_INFO_KEYS[0]][0], [newest[k][0] for k in META_INFO_KEYS[1:]]  # now the scheduler reads it
        rl.record(round_([9], [9], [9.0], [9], read=False))  # never read: skipped once a later one is
        rl.record(round_([1], [0], [1.0], [4]))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1] == (
        "TEV: 2 rounds, 2 request-rounds: mean budget 18.0, accept length 3.00, exit depth 2.00, coverage 2.50"
    )
    assert rl.emit() is None  # nothing pending
    for _ in range(50):  # rounds nobody reads: no line, and no growing backlog
        rl.record(round_([1], [0], [1.0], [4], read=False))
    assert len(rl._pending) <= 2 and rl.emit() is None
    with pytest.raises(ValueError, match="interval"):
        RoundLog(0)


def test_round_log_keeps_a_tree_round_in_flight_between_plain_steps(caplog):
    """Plain steps share their host values (``plain_round_host``, kept per batch size by the worker)
    but each gets columns of its own: a plain step the scheduler has not read yet is not counted,
    and a tree round still in flight when a later plain step is recorded is logged once read."""
    from sglang_tev.srt.meta_info import plain_round_host, round_columns, round_info_to_host

    def read(cols):
        for k in META_INFO_KEYS:
            list(cols[k])

    host = plain_round_host(2)
    log = logging.getLogger("test_round_log_plain")
    rl = RoundLog(2, log)
    with caplog.at_level(logging.INFO, logger="test_round_log_plain"):
        for _ in range(2):  # two plain steps, read
            c = round_columns(host)
            rl.record(c)
            read(c)
        tree = round_info_to_host(torch.tensor([5, 5]), torch.tensor([4, 4]), torch.tensor([3.0, 3.0]), torch.tensor([16, 16]))
        rl.record(tree)  # in flight
        rl.record(round_columns(host))  # a line: the two read plain steps; the tree round waits
        read(tree)
        for _ in range(2):
            c = round_columns(host)
            rl.record(c)
            read(c)
    lines = [r.getMessage().split(":")[1].split(",")[:3] for r in caplog.records]
    # a line every 2 rounds over the rounds read by then: the plain step recorded while the tree
    # round was in flight is never read (skipped), the tree round is counted once read
    assert lines == [[" 1 rounds", " 2 request-rounds"], [" 1 rounds", " 2 request-rounds"], [" 2 rounds", " 4 request-rounds"]], lines
    assert "mean budget 8.0" in caplog.records[-1].getMessage()
    assert round_columns(host)[META_INFO_KEYS[0]] is not round_columns(host)[META_INFO_KEYS[0]]
