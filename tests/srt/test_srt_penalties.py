"""Penalties and ``min_new_tokens`` at every tree node (``sglang_tev/penalties.py``,
``sglang_tev/srt/penalties.py``), against SGLang 0.5.23's own penalizers (no Engine).

Reference: for each node, a fresh SGLang ``BatchedPenalizerOrchestrator`` fed the node's explicit
history (committed output + root + the path's tokens) one token at a time through its public
``cumulate_output_tokens``, and SGLang's sampler code path (``SamplingBatchInfo.copy_for_forward``
+ ``apply_logits_bias``) applied to the node's raw logits. The law of (exit node, bonus) is then
enumerated by following continuations with the penalties recomputed from each continuation's own
history, and TEV's samples must follow it (chi-square).
"""

from __future__ import annotations

import importlib.util
import os
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from exact_law import chi_square_pvalue, random_tree, stack_trees

from sglang_tev import DraftTree, SamplingParams, build_ddtree, exit_law, processed_probs, verify_tree
from sglang_tev.penalties import apply_sglang_penalties, path_counts, path_multiplicity, path_tokens

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("SGLANG_TEV_REQUIRE_SGLANG") == "1":  # set by .ci/run: never skip in CI
        raise RuntimeError("SGLANG_TEV_REQUIRE_SGLANG=1 but sglang is not installed")
    pytest.skip("sglang is not installed (pip install 'sglang-tev[sglang]')", allow_module_level=True)

ALPHA = 1e-6
EOS, STOP, EXTRA = 0, 3, 5  # the request's eos, its stop_token_ids, the tokenizer's additional stop


@pytest.fixture(autouse=True)
def _eager_scaling(monkeypatch):
    """SGLang's ``apply_scaling_penalties`` is ``torch.compile``d (~50 s of inductor on this CPU);
    the tests run its eager body (the same function)."""
    from sglang.srt.sampling import sampling_batch_info
    from sglang.srt.sampling.penaltylib import repetition_penalty

    eager = repetition_penalty.apply_scaling_penalties.__wrapped__
    monkeypatch.setattr(repetition_penalty, "apply_scaling_penalties", eager)
    monkeypatch.setattr(sampling_batch_info, "apply_scaling_penalties", eager)


# ---------------------------------------------------------------------- SGLang pieces
class FakeBatch:
    """What SGLang's penalizers read of a ``ScheduleBatch``: ``reqs``, ``device`` (weakref-able)."""

    def __init__(self, reqs, algorithm="TEV"):
        self.reqs = reqs
        self.device = "cpu"
        self.spec_algorithm = SimpleNamespace(name=algorithm)


def make_req(freq=0.0, pres=0.0, rep=1.0, min_new=0):
    sp = SimpleNamespace(frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep, min_new_tokens=min_new,
                         stop_token_ids={STOP})  # fmt: skip
    tok = SimpleNamespace(additional_stop_token_ids={EXTRA}, eos_token_id=EOS)
    return SimpleNamespace(sampling_params=sp, eos_token_ids={EOS}, tokenizer=tok)


def orchestrator(reqs, vocab, algorithm="TEV"):
    """A real ``BatchedPenalizerOrchestrator`` over ``reqs`` (the batch is returned too: the
    orchestrator holds it by weakref)."""
    from sglang.srt.sampling import penaltylib as P

    batch = FakeBatch(reqs, algorithm)
    pens = {P.BatchedFrequencyPenalizer, P.BatchedMinNewTokensPenalizer, P.BatchedPresencePenalizer, P.BatchedRepetitionPenalizer}
    return P.BatchedPenalizerOrchestrator(vocab_size=vocab, batch=batch, penalizers=pens), batch


def sampling_info(orch, bs, vocab):
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo(
        temperatures=torch.ones(bs, 1), top_ps=torch.ones(bs), top_ks=torch.ones(bs, dtype=torch.int32),
        min_ps=torch.zeros(bs), is_all_greedy=True, is_any_greedy=True, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=vocab, device="cpu",
        penalizer_orchestrator=orch,
    )  # fmt: skip


def sglang_logits(req, history, raw):
    """SGLang's plain-decoding logits after ``history`` (output tokens) for one request: its
    orchestrator fed token by token, then its sampler's transforms (``copy_for_forward`` ->
    ``apply_logits_bias``, the order of overlap scheduling)."""
    v = raw.shape[-1]
    orch, batch = orchestrator([req], v)
    for t in history:
        orch.cumulate_output_tokens(torch.tensor([t]))
    fwd = sampling_info(orch, 1, v).copy_for_forward()
    out = raw.clone().view(1, v)
    fwd.apply_logits_bias(out)
    del batch
    return out.view(v)


def host_path(tree, r, i):
    """Drafted tokens from the root (excluded) down to node i, by walking parents."""
    par, tok = tree.parents[r].tolist(), tree.tokens[r].tolist()
    out = []
    while i > 0:
        out.append(tok[i])
        i = par[i]
    return out[::-1]


def ddtrees(seed, bs, vocab, depth, budget, roots):
    g = torch.Generator().manual_seed(seed)
    return build_ddtree(torch.randn(bs, depth, vocab, generator=g) * 2, budget, roots)


# ---------------------------------------------------------------------- path tokens
def test_path_tokens_are_each_nodes_ancestors():
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, n, 6) for n in (1, 4, 9, 13)]
    for tree in (stack_trees(trees, 13), ddtrees(1, 3, 7, 5, 12, torch.tensor([1, 2, 3]))):
        tok = path_tokens(tree)
        mult = path_multiplicity(tok)
        b, n = tree.parents.shape
        for r in range(b):
            for i in range(n):
                if not bool(tree.valid[r, i]):
                    continue
                want = host_path(tree, r, i)
                got = [t for t in tok[r, i].tolist() if t >= 0]
                assert got == want[::-1], (r, i)  # self first, then up the tree
                assert mult[r, i, : len(got)].tolist() == [want.count(t) for t in got]


def _path_counts_before(tree, vocab):
    """``hf/controls.path_counts`` before it moved to ``sglang_tev/penalties.py`` (verbatim)."""
    b, n = tree.parents.shape
    counts = torch.zeros(b, n, vocab, dtype=torch.float32)
    nonroot = tree.ancestor_mask.clone()
    nonroot[:, :, 0] = False
    tok = tree.tokens.clamp(0, vocab - 1)
    counts.scatter_add_(2, tok.view(b, 1, n).expand(b, n, n), nonroot.to(torch.float32))
    return counts


def test_path_counts_unchanged_for_the_transformers_runtime():
    rng = np.random.default_rng(1)
    cases = [stack_trees([random_tree(rng, n, 5) for n in (1, 3, 8)], 8), ddtrees(2, 2, 6, 4, 9, torch.tensor([0, 5]))]
    cases.append(stack_trees([([-1], [2]), ([-1], [4])], 3))  # root-only trees with padding
    for tree in cases:
        assert torch.equal(path_counts(tree, 9), _path_counts_before(tree, 9))
    from sglang_tev.hf import controls

    assert controls.path_counts is path_counts


# ---------------------------------------------------------------------- per-node logits
CASES = {
    "frequency": [dict(freq=0.7), dict(freq=-0.4), dict()],
    "presence": [dict(pres=0.9), dict(pres=-1.1), dict(pres=0.3)],
    "repetition": [dict(rep=1.3), dict(rep=0.7), dict()],
    "min_new_tokens": [dict(min_new=5), dict(min_new=7), dict(min_new=0)],
    "all": [dict(freq=0.6, pres=0.4, rep=1.2, min_new=6), dict(freq=1.5, rep=1.7), dict(pres=-0.5, min_new=9)],
}


def _round_case(seed, vocab=10, committed=3, depth=5, budget=14):
    """Three requests' committed outputs, their trees (root = the last committed token) and raw
    logits. A small vocabulary makes tokens repeat along paths and within the history."""
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, vocab, (3, committed), generator=g)
    roots = torch.randint(0, vocab, (3,), generator=g)
    tree = ddtrees(seed, 3, vocab, depth, budget, roots)
    raw = torch.randn(3, budget + 1, vocab, generator=g) * 3
    return hist, roots, tree, raw


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_node_logits_equal_sglang_after_each_nodes_history(name, seed):
    from sglang_tev.srt.penalties import STATE_ATTR, _keep_orchestrator, apply_tree_penalties

    vocab = 10
    hist, roots, tree, raw = _round_case(seed, vocab)
    reqs = [make_req(**kw) for kw in CASES[name]]
    orch, batch = orchestrator(reqs, vocab)
    for t in hist.T:  # the committed outputs, one step at a time (plain decoding's feeding)
        orch.cumulate_output_tokens(t)
    info = sampling_info(orch, 3, vocab)
    fwd = _keep_orchestrator(info.copy_for_forward(), info)  # the plugin's hook on the forward copy
    assert getattr(fwd, STATE_ATTR) is orch and fwd.penalizer_orchestrator is None
    logits = raw.clone().view(-1, vocab)
    assert apply_tree_penalties(logits, tree, fwd) is orch
    logits = logits.view(raw.shape)
    b, n = tree.parents.shape
    changed = 0
    for r in range(b):
        for i in range(n):
            if not bool(tree.valid[r, i]):
                continue
            history = hist[r].tolist() + [int(roots[r])] + host_path(tree, r, i)
            want = sglang_logits(reqs[r], history, raw[r, i])
            assert torch.equal(logits[r, i], want), (name, r, i, logits[r, i], want)
            changed += not torch.equal(want, raw[r, i])
    assert changed >= 3  # the penalties did something
    # the root was fed: SGLang's state now holds the committed outputs and the root
    for r in range(b):
        ref, _b = orchestrator([reqs[r]], vocab)
        for t in hist[r].tolist() + [int(roots[r])]:
            ref.cumulate_output_tokens(torch.tensor([t]))
        _assert_same_state(orch, ref, r)


def test_min_new_tokens_masks_stop_tokens_while_the_output_is_short():
    """Stops (eos, stop_token_ids, the tokenizer's additional stops) are -inf exactly at nodes
    whose generated length (committed + root + depth) is below min_new_tokens."""
    from sglang_tev.srt.penalties import _keep_orchestrator, apply_tree_penalties

    vocab = 10
    hist, roots, tree, raw = _round_case(3, vocab, committed=2)
    mins = [4, 6, 0]
    reqs = [make_req(min_new=m) for m in mins]
    orch, batch = orchestrator(reqs, vocab)
    for t in hist.T:
        orch.cumulate_output_tokens(t)
    info = sampling_info(orch, 3, vocab)
    logits = raw.clone().view(-1, vocab)
    apply_tree_penalties(logits, tree, _keep_orchestrator(info.copy_for_forward(), info))
    logits = logits.view(raw.shape)
    stops = [EOS, STOP, EXTRA]
    others = [t for t in range(vocab) if t not in stops]
    depths = set()
    for r in range(3):
        for i in range(tree.parents.shape[1]):
            if not bool(tree.valid[r, i]):
                continue
            d = int(tree.depth[r, i])
            masked = 2 + 1 + d < mins[r]
            depths.add((r, masked))
            assert bool(torch.isneginf(logits[r, i, stops]).all()) == masked, (r, i, d)
            assert not bool(torch.isneginf(logits[r, i, stops]).any()) or masked
            assert torch.equal(logits[r, i, others], raw[r, i, others])
    assert {(0, True), (0, False), (1, True), (1, False), (2, False)} <= depths  # both sides hit


# ---------------------------------------------------------------------- counting accepted tokens
def _assert_same_state(orch, ref, row):
    for cls, pen in orch.penalizers.items():
        other = ref.penalizers[cls]
        assert pen.is_prepared() == other.is_prepared() or not other.is_prepared(), cls
        if not other.is_prepared():
            continue
        for name in ("cumulated_frequency_penalties", "cumulated_presence_penalties", "cumulated_repetition_penalties",
                     "len_output_tokens", "stop_token_penalties"):  # fmt: skip
            if hasattr(other, name):
                assert torch.equal(getattr(pen, name)[row], getattr(other, name)[0]), (cls.__name__, name, row)


def test_count_accepted_equals_feeding_each_request_alone_and_survives_filter_merge():
    from sglang_tev.srt.penalties import count_accepted

    vocab = 9
    reqs = [make_req(freq=0.3, pres=0.5, rep=1.4, min_new=8), make_req(freq=1.1), make_req(rep=0.8, min_new=3),
            make_req(pres=-0.7), make_req()]  # fmt: skip
    orch, batch = orchestrator(reqs, vocab)
    first = torch.tensor([1, 2, 3, 4, 5])
    orch.cumulate_output_tokens(first)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (5, 6), generator=g)  # repeats within a row
    tokens[0, 4:] = 7  # past the count: must not be counted
    counts = torch.tensor([3, 6, 0, 1, 2])
    count_accepted(orch, tokens, counts)
    refs = []
    for r, req in enumerate(reqs):
        ref, rb = orchestrator([req], vocab)
        for t in [int(first[r])] + tokens[r, : int(counts[r])].tolist():
            ref.cumulate_output_tokens(torch.tensor([t]))
        refs.append((ref, rb))
        _assert_same_state(orch, ref, r)
    # SGLang's filter / merge keep working on the fed state (retraction filters the batch too)
    keep = [0, 2, 3]
    batch.reqs = [reqs[i] for i in keep]
    orch.filter(torch.tensor(keep))
    for j, i in enumerate(keep):
        _assert_same_state(orch, refs[i][0], j)
    newcomer, nb = orchestrator([make_req(freq=0.9, min_new=2)], vocab)
    newcomer.cumulate_output_tokens(torch.tensor([6]))
    orch.merge(newcomer)
    batch.reqs = batch.reqs + nb.reqs
    count_accepted(orch, torch.tensor([[2], [2], [2], [6]]), torch.tensor([1, 0, 1, 1]))
    ref, rb = orchestrator([nb.reqs[0]], vocab)
    for t in (6, 6):
        ref.cumulate_output_tokens(torch.tensor([t]))
    _assert_same_state(orch, ref, 3)
    ref0, rb0 = orchestrator([reqs[0]], vocab)
    for t in [1] + tokens[0, :3].tolist() + [2]:
        ref0.cumulate_output_tokens(torch.tensor([t]))
    _assert_same_state(orch, ref0, 0)


# ---------------------------------------------------------------------- hook and state access
def test_hook_keeps_the_orchestrator_only_for_tev_batches_with_penalties():
    from sglang_tev.srt.penalties import STATE_ATTR, _keep_orchestrator, batch_penalizer

    vocab = 6
    for algorithm, reqs, kept in (("TEV", [make_req(freq=0.5)], True), ("EAGLE", [make_req(freq=0.5)], False),
                                  ("TEV", [make_req()], False)):  # fmt: skip
        orch, batch = orchestrator(reqs, vocab, algorithm)
        info = sampling_info(orch, 1, vocab)
        fwd = _keep_orchestrator(info.copy_for_forward(), info)
        assert (getattr(fwd, STATE_ATTR, None) is orch) == kept
        if kept:
            assert batch_penalizer(fwd) is orch
        elif algorithm == "TEV":
            assert batch_penalizer(fwd) is None  # no penalties: nothing to do
    # penalties active but the state unreachable (hook not applied): loud, never silently dropped
    orch, batch = orchestrator([make_req(rep=1.2)], vocab)
    info = sampling_info(orch, 1, vocab)
    with pytest.raises(RuntimeError, match="penalizer state"):
        batch_penalizer(info.copy_for_forward())


def test_install_admission_hook_installs_the_penalizer_hook(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import sglang_tev.srt.admission as A
    import sglang_tev.srt.penalties as Pn

    registered = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, t, h, k=HookType.AFTER, **kw: registered.append((t, h, k))))
    monkeypatch.setattr(A, "_installed", False)
    monkeypatch.setattr(Pn, "_installed", False)
    A.install_admission_hook()
    # the penalizer hook, and the admission check (prompts the scheduler cannot run; no option is refused)
    assert registered == [(Pn._TARGET, Pn._keep_orchestrator, HookType.AFTER), (A._TARGET, A._after_validate, HookType.AFTER)]
    import pkgutil

    owner, attr = Pn._TARGET.rsplit(".", 1)
    assert callable(getattr(pkgutil.resolve_name(owner), attr))  # the target exists in this SGLang


# ---------------------------------------------------------------------- the exact law
def _enumerate_penalised(tree, raw, req, committed, temperature):
    """Law of (exit node, bonus) for ONE tree, following every continuation with the law SGLang
    would sample after that continuation's own history (independent of the per-node code)."""
    par, tok = tree.parents[0].tolist(), tree.tokens[0].tolist()
    n, v = raw.shape
    children = {i: {} for i in range(n)}
    for i in range(1, n):
        if bool(tree.valid[0, i]):
            children[par[i]][tok[i]] = i
    out = np.zeros((n, v))

    def walk(node, history, mass):
        p = torch.softmax(sglang_logits(req, history, raw[node]).double() / temperature, -1).numpy()
        for a in range(v):
            if p[a] == 0.0:
                continue
            if a in children[node]:
                walk(children[node][a], history + [a], mass * p[a])
            else:
                out[node, a] += mass * p[a]

    walk(0, committed + [tok[0]], 1.0)
    return out


@pytest.mark.parametrize(
    "kw", [dict(freq=1.5, pres=0.5), dict(rep=1.6), dict(freq=0.8, pres=0.3, rep=1.3, min_new=4)], ids=["freq_pres", "rep", "all"]
)
def test_tev_samples_follow_the_penalised_continuation_law(kw):
    from sglang_tev.srt.penalties import _keep_orchestrator, apply_tree_penalties

    vocab, rows = 6, 20_000
    g = torch.Generator().manual_seed(5)
    committed = [2, 4, 2]
    root = 1
    # a tree whose paths repeat tokens (1 -> 2 -> 2, 1 -> 4 -> 1 ...) and hold a stop token
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 2, 4, 6]])
    tokens = torch.tensor([[root, 2, 4, 0, 2, 1, 1, 2, 4]])
    tree = DraftTree.from_parents(parents, tokens)
    raw = torch.randn(1, 9, vocab, generator=g) * 1.5
    req = make_req(**kw)
    orch, batch = orchestrator([req], vocab)
    for t in committed:
        orch.cumulate_output_tokens(torch.tensor([t]))
    info = sampling_info(orch, 1, vocab)
    logits = raw.clone().view(-1, vocab)
    apply_tree_penalties(logits, tree, _keep_orchestrator(info.copy_for_forward(), info))
    logits = logits.view(raw.shape)
    sampling = SamplingParams(temperature=1.0)
    exact = _enumerate_penalised(tree, raw[0], req, committed, 1.0)
    # the exit law on the per-node penalised law is the enumerated continuation law
    law = exit_law(tree, processed_probs(logits.double(), sampling))
    np.testing.assert_allclose(law.w[0].numpy(), exact.sum(1), rtol=0, atol=1e-6)
    plain = _enumerate_penalised(tree, raw[0], make_req(), committed, 1.0)
    assert np.abs(plain - exact).sum() > 0.05  # the penalties move the law
    # TEV's (exit node, bonus) samples against it
    big = DraftTree.from_parents(parents.expand(rows, -1), tokens.expand(rows, -1))
    out = verify_tree(big, logits.expand(rows, -1, -1), method="tev", sampling=sampling, generator=torch.Generator().manual_seed(0))
    counts = np.zeros(exact.shape)
    np.add.at(counts, (out.exit_node.numpy(), out.bonus.numpy()), 1)
    assert chi_square_pvalue(counts, exact) > ALPHA
    unpenalised = verify_tree(big, raw.expand(rows, -1, -1), method="tev", sampling=sampling, generator=torch.Generator().manual_seed(0))
    counts_raw = np.zeros(exact.shape)
    np.add.at(counts_raw, (unpenalised.exit_node.numpy(), unpenalised.bonus.numpy()), 1)
    assert chi_square_pvalue(counts_raw, exact) < ALPHA  # the test can tell the difference
