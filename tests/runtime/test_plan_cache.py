"""budget="auto" keeps what it learned across processes (sglang_tev.hf.plan_cache): a second runtime
with the same key starts from the first's cost table, gains and calibration (no calibration
rounds); another key, a corrupted file or a frozen table is not trusted / not touched."""

import copy
import json

import pytest
import torch

from sglang_tev.autobudget import CostTable
from sglang_tev.costs import RESTORED_MIN_ROUNDS
from sglang_tev.hf.plan_cache import PlanCache, cache_key, model_fingerprint
from sglang_tev.hf.runtime import SpeculativeGenerator


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TEV_CACHE", str(tmp_path))
    monkeypatch.setenv("SGLANG_TEV_PLAN_CACHE", "1")
    return tmp_path / "plan"


@pytest.fixture(scope="module")
def shipped():
    return SpeculativeGenerator.from_pretrained(plan_cache=False)


@pytest.fixture
def _gen(shipped):
    # fresh runtimes over the shipped pair's models: what a new process would build
    return lambda: SpeculativeGenerator(shipped.target, shipped.drafter, tokenizer=shipped.tokenizer)


def _files(folder):
    return sorted(folder.glob("*.json")) if folder.exists() else []


def test_a_second_runtime_starts_where_the_first_left_off(cache_home, _gen):
    prompt = torch.arange(3, 11)
    g1 = _gen()
    r1 = g1.generate(prompt, budget="auto", max_new_tokens=24)
    files = _files(cache_home)
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["cost_table"]["seconds"] and saved["gains"] and saved["calibration"]["means"]
    # a fresh runtime (same models, same machine): loads it, runs no calibration round
    g2 = _gen()
    r2 = g2.generate(prompt, budget="auto", max_new_tokens=24)
    assert r2.token_ids == r1.token_ids  # greedy: plain decoding's tokens either way
    ctl1 = next(iter(g1._controllers.values()))
    ctl2 = next(iter(g2._controllers.values()))
    # the first process calibrated (its first round: the largest tree); the second starts steady
    # on the first one's choice, with its gains and costs
    assert ctl1.history[0][1] == ctl1.max_budget and ctl1.rounds < len(ctl1.history)
    # only the tree costs the first process timed in fewer than RESTORED_MIN_ROUNDS rounds are
    # timed again (one cold round of a busy minute must not hold a cost for good)
    dropped = [b for b, c in saved["cost_table"]["counts"]["1"].items() if b != "0" and c < RESTORED_MIN_ROUNDS]
    assert len(ctl2.history) - ctl2.rounds <= len(dropped)
    assert set(ctl2.gain) >= set(ctl1.gain)
    assert g2.cost_table.counts  # started from the saved table
    assert g2.calibration.means.get("greedy") is not None


def test_the_switch_prices_are_kept_and_checked(cache_home, _gen):
    """What a switch between plain decoding and the trees costs (charged to across probes) is
    saved with the gains; a cache from before it was kept loads without it; a bad entry is not
    trusted."""
    g1 = _gen()
    g1.generate(torch.arange(3, 11), budget="auto", max_new_tokens=12)
    ctl = next(iter(g1._controllers.values()))
    ctl.switch = {(1, True): 0.004, (3, False): 0.001}
    g1._save_plan_cache()
    g2 = _gen()
    g2.generate(torch.arange(3, 11), budget="auto", max_new_tokens=4)
    ctl2 = next(iter(g2._controllers.values()))
    assert ctl2.switch[(1, True)] == pytest.approx(0.004, rel=0.5) and ctl2.switch[(3, False)] == 0.001
    store = g2._plan_store
    data = json.loads(store.path.read_text())
    for v in data["gains"].values():
        v.pop("switch")
    store.path.write_text(json.dumps(data))
    assert store.load() is not None and all(not v["switch"] for v in store.load()["gains"].values())
    for bad in ({"1:sideways": 0.1}, {"0:trees": 0.1}, {"1:trees": -1.0}, {"1:trees": float("nan")},
                {"x:trees": 0.1}, {"1:trees": True}, {"1:trees": [0.1]}, [0.1]):
        for v in data["gains"].values():
            v["switch"] = bad
        store.path.write_text(json.dumps(data))
        assert store.load() is None and "switch" in store.refused, bad
    for v in data["gains"].values():  # and a gain that is not a finite number
        v.pop("switch")
        v["inc"] = {b: float("nan") for b in v["inc"]}
    store.path.write_text(json.dumps(data))
    assert store.load() is None and "finite" in store.refused


def test_another_model_or_a_bad_file_is_not_trusted(cache_home, _gen):
    g1 = _gen()
    g1.generate(torch.arange(3, 11), budget="auto", max_new_tokens=12)
    # another drafter (retrained in place, same config): another fingerprint, so another key
    other = copy.deepcopy(g1.drafter.model)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    assert model_fingerprint(other) != model_fingerprint(g1.drafter.model)
    # the same weights from another folder (a moved checkout, a hub snapshot): the same fingerprint
    moved = copy.deepcopy(g1.target)
    moved.config._name_or_path = "/elsewhere/target"
    assert g1.target.config._name_or_path != "/elsewhere/target"
    assert model_fingerprint(moved) == model_fingerprint(g1.target)
    # (review) config values JSON cannot hold read the same in every process, and differ when they differ
    class _Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _M(torch.nn.Module):
        def __init__(self, **kw):
            super().__init__()
            self.config = _Cfg(**kw)

    a = model_fingerprint(_M(tags={"b", "a", "c"}, ids={1: "x", "1": "y"}, obj=object(), _name_or_path="/a"))
    assert a == model_fingerprint(_M(tags={"c", "a", "b"}, ids={1: "x", "1": "y"}, obj=object(), _name_or_path="/b"))
    assert a != model_fingerprint(_M(tags={"a", "b"}, ids={1: "x", "1": "y"}, obj=object()))
    # a file whose stored key is another (copied by hand), and one that does not parse
    key = cache_key(g1.target, g1.drafter.model, g1._target.float_dtype, "cpu")
    store = PlanCache(key, cache_home)
    assert store.path.exists()
    data = json.loads(store.path.read_text())
    data["key"]["threads"] = 99
    store.path.write_text(json.dumps(data))
    assert store.load() is None and "threads" in store.refused
    store.path.write_text("{not json")
    assert store.load() is None and store.refused
    # the runtime ignores it, decodes, and rewrites it whole
    g2 = SpeculativeGenerator(g1.target, g1.drafter)
    g2.generate(torch.arange(3, 11), budget="auto", max_new_tokens=12)
    assert PlanCache(key, cache_home).load() is not None


def test_off_switches_and_frozen_tables_leave_the_cache_alone(cache_home, monkeypatch, _gen):
    frozen = CostTable(frozen=True)
    frozen.set(1, 0, 1.0)
    frozen.set(1, 8, 1.2)
    g = _gen()
    g.cost_table = frozen
    g.generate(torch.arange(3, 11), budget="auto", max_new_tokens=12)
    assert _files(cache_home) == []
    g = _gen()
    g.plan_cache = False
    g.generate(torch.arange(3, 11), budget="auto", max_new_tokens=12)
    assert _files(cache_home) == []
    monkeypatch.setenv("SGLANG_TEV_PLAN_CACHE", "off")
    g = _gen()
    g.generate(torch.arange(3, 11), budget="auto", max_new_tokens=12)
    assert _files(cache_home) == []
    # a fixed budget never touches it
    monkeypatch.setenv("SGLANG_TEV_PLAN_CACHE", "1")
    _gen().generate(torch.arange(3, 11), budget=8, max_new_tokens=12)
    assert _files(cache_home) == []


def test_an_unwritable_cache_folder_logs_one_line_and_the_call_succeeds(cache_home, monkeypatch, caplog, _gen):
    import logging

    from sglang_tev.hf import plan_cache as pc

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pc.PlanCache, "save", refuse)
    gen = _gen()
    with caplog.at_level(logging.WARNING, logger=pc.log.name):
        res = gen.generate("def f(x):", max_new_tokens=8, budget="auto")
    assert len(res.token_ids) == 8
    msgs = [r.getMessage() for r in caplog.records if r.name == pc.log.name]
    assert len(msgs) == 1 and msgs[0].startswith("plan cache not saved (") and "Permission denied" in msgs[0]
