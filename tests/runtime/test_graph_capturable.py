"""The TEV round's device (GPU) path is capturable: no graph break, no host sync.

Evidence on CPU for issue 27 item 4 (notes/sglang-0.5.23-graphs-overlap-dflash2.md §2.3, §4
"What can be tested on CPU instead"), in two independent checks on the same calls:

1. ``torch.compile(fn, fullgraph=True, backend=...)`` traces each function of
   ``sglang_tev/srt/round.py`` and the verifier core (``sglang_tev/verify/``) into ONE graph:
   dynamo raises on every graph break (a Python branch on a tensor value, NumPy, an unsupported
   call). The backend is ``"eager"`` plus one check (:func:`eager_without_data_dependent_ops`):
   torch 2.14's dynamo no longer breaks the graph at ``.item()``, ``int(t)``, ``.tolist()``,
   ``nonzero``, boolean-mask indexing, ``unique`` or ``repeat_interleave`` without
   ``output_size`` (even with ``capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``
   False it puts them in the graph as ops with unbacked symbolic outputs), yet each is a host
   sync on CUDA that capture refuses. So the backend fails when any node of the traced graph
   carries an unbacked symbol, then runs the graph eagerly (the same ATen ops, no codegen):
   compiled and eager outputs are compared for equality on random trees.
2. :class:`~sglang_tev.testing.host_sync.HostSyncCounter` (CPU emulation: every op counts as if
   its tensor were on the device) records every blocking call the eager run makes from
   ``sglang_tev/``. Dynamo folds Python scalars into constants, so it cannot see a blocking
   host-to-device copy such as ``torch.as_tensor(0.7, device=dev)``; the counter does.

The device path is forced (:func:`device_path`): on CPU the code takes host shortcuts that are
cheaper there and are not what runs on a GPU (``sglang_tev.execution``): the DDTree heap builder,
the exact ``max_depth`` read back by the level-wise builder, the host walk of greedy verification
and NumPy's argmax. :func:`test_the_checks_fail_on_the_cpu_host_path` shows each
check fails on those host paths, so neither check is vacuous.

Static variants compiled (host-side settings pick one graph each, as CUDA-graph capture would
need one graph per combination): verifier ``tev`` / ``predraw`` / ``sequential`` with (a) a Python
scalar temperature and no truncation (the ``plain`` fast path of ``tev``), (b) per-request [b]
tensors for temperature, top-k, top-p, min-p (SGLang's ``sampling_params_from_info`` with every
``need_*`` flag on), and ``greedy`` (scalar temperature 0: every verifier is argmax-follow).
The uniforms are a tensor argument: they are drawn outside any graph (``seeded_uniforms`` is
compiled on its own). Not compiled here: the fused Triton TEV kernel (CUDA / TRITON_INTERPRET
only; its launch wrapper builds scalars with ``torch.full``), ``VerifyOutput.host`` (the round's
one deliberate transfer) and validation (``validate=True`` syncs by design).

``tree_verify_layout`` / ``tree_custom_mask`` are traced with ``seq_lens_sum`` a Python int: the
FULL mask has ``N * seq_lens_sum + N * N * bs`` entries, a size that changes every round. SGLang
provides ``seq_lens_sum`` from the host (``ScheduleBatch.seq_lens_sum``) and builds the verify
input outside the captured graph, so it is a host value there too, not a sync; a graph over the
layout would be specialised to one ``seq_lens_sum`` (dynamo guards on it).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from sglang_tev import SamplingParams
from sglang_tev.srt import round as R
from sglang_tev.testing.host_sync import HostSyncCounter
from sglang_tev.tree import exit_law
from sglang_tev.verify import num_uniforms
from sglang_tev.verify.greedy import greedy_verify
from sglang_tev.verify.predraw import predraw_verify
from sglang_tev.verify.sequential import sequential_verify
from sglang_tev.verify.tev import tev_verify, tev_verify_logits
from graph_checks import REFUSED, assert_same, compiled

V = 16


@pytest.fixture
def device_path():
    """Take the code paths a CUDA device takes (see the module doc)."""
    from sglang_tev.testing.host_sync import gpu_code_paths

    with gpu_code_paths():
        yield


def test_the_device_policy_is_what_a_device_chooses():
    """DEVICE_PATHS makes every chooser on CPU tensors take what it takes for a non-CPU tensor
    (meta here); the default policy takes the CPU shortcuts."""
    from sglang_tev import execution
    from sglang_tev.draft import ddtree
    from sglang_tev.verify import _common

    dev, cpu = torch.empty(2, 3, device="meta"), torch.zeros(2)
    assert ddtree._use_heap("auto", dev) is False and ddtree._use_heap("auto", cpu) is True
    assert ddtree._exact_max_depth(dev.device) is False and ddtree._exact_max_depth(torch.device("cpu")) is True
    assert _common._numpy_view(dev) is None and _common._numpy_view(cpu) is not None
    with execution.use(execution.DEVICE_PATHS):
        assert ddtree._use_heap("auto", cpu) is False and ddtree._use_heap("heap", cpu) is True
        assert ddtree._exact_max_depth(torch.device("cpu")) is False
        assert _common._numpy_view(cpu) is None
        assert execution.current().host_walk_max_nodes < 0
    assert execution.current() == execution.CPU_SHORTCUTS
    # the greedy host walk is taken only for CPU logits (verify/dispatch.py): no size bound applies elsewhere
    import inspect

    from sglang_tev.verify import dispatch

    assert 'logits.device.type == "cpu" and b * n <= execution.current().host_walk_max_nodes' in inspect.getsource(
        dispatch.verify_tree)


# seeds x (bs, H, k, budget): deep and wide trees, and lists too short to fill the budget (padding)
CASES = [(0, (3, 5, 3, 10)), (1, (2, 4, 2, 12)), (2, (4, 3, 1, 6))]


def draft_lists(seed, bs, H, k, budget):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(3 * torch.randn(bs, H, V, generator=g), -1)
    vals, ids = lq.topk(k, -1)
    roots = torch.randint(0, V, (bs,), generator=g)
    seq = torch.randint(0, 30, (bs,), generator=g)
    seq[0] = 32  # at the last position of a 33-position context: a root-only (padded) tree
    return vals, ids, roots, seq, g


def round_inputs(seed, bs, H, k, budget):
    vals, ids, roots, seq, g = draft_lists(seed, bs, H, k, budget)
    caps = R.request_depth_caps(seq, H, context_len=33)  # requests near position 32 get capped trees
    tree = R.build_trees(vals, ids, budget, roots, H, caps)
    n = budget + 1
    logits = 2 * torch.randn(bs, n, V, generator=g)
    # the target likes the drafted children (their parent's row), so paths of depth >= 2 get accepted
    rows = torch.arange(bs).view(bs, 1).expand(bs, n)[tree.valid]
    logits[rows, tree.parents.clamp(min=0)[tree.valid], tree.tokens[tree.valid]] += 6.0
    logits[..., 3] = float("-inf")  # masked tokens (grammar, logit bias) are allowed
    return tree, seq, logits.view(bs * n, V), g


SAMPLINGS = {
    "scalar": lambda bs: SamplingParams(temperature=0.8),
    "per_request": lambda bs: SamplingParams(
        temperature=torch.linspace(0.0, 1.5, bs), top_k=torch.arange(bs) % 3 * 2,
        top_p=torch.linspace(1.0, 0.6, bs), min_p=torch.linspace(0.0, 0.1, bs)),
}


# ---------------------------------------------------------------------- 1. fullgraph + equality
@pytest.mark.parametrize("seed,shape", CASES)
def test_draft_to_tree_and_layout_compile_fullgraph(device_path, seed, shape):
    """request_depth_caps -> build_trees (level-wise DDTree) -> tree_verify_layout: one graph each,
    outputs equal to eager (trees, positions, FULL mask, retrieve arrays)."""
    bs, H, k, budget = shape
    vals, ids, roots, seq, _ = draft_lists(seed, bs, H, k, budget)
    caps = R.request_depth_caps(seq, H, context_len=33)
    assert_same(compiled(lambda s: R.request_depth_caps(s, H, context_len=33))(seq), caps)
    for cap in (None, caps) if seed == 0 else (caps,):
        fn = lambda v, i, r, c: R.build_trees(v, i, budget, r, H, c)  # noqa: E731
        tree = fn(vals, ids, roots, cap)
        assert_same(compiled(fn)(vals, ids, roots, cap), tree)
    assert tree.max_depth == min(H, budget)  # the static bound on the device path
    seq_sum = int(seq.sum())  # a host int in SGLang (ScheduleBatch.seq_lens_sum)
    fn = lambda t, s: R.tree_verify_layout(t, s, seq_sum)  # noqa: E731
    assert_same(compiled(fn)(tree, seq), fn(tree, seq))


@pytest.mark.parametrize("method", ["tev", "predraw", "sequential"])
@pytest.mark.parametrize("law", sorted(SAMPLINGS))
def test_verify_batch_compiles_fullgraph(device_path, method, law):
    """verify_batch (verify_tree with validate=False) for each verifier and sampling variant, the
    uniforms a tensor argument: one graph, the same exit nodes, bonus tokens, paths, coverage on
    three random rounds (one compile: same shapes)."""
    shape = CASES[0][1]
    sp = SAMPLINGS[law](shape[0])
    fn = lambda t, x, u: tuple(R.verify_batch(t, x, sp, method, uniforms=u))  # noqa: E731
    graph = compiled(fn)
    exits, deepest = set(), 0
    for seed in range(3):
        tree, _, logits, g = round_inputs(seed, *shape)
        bs, n = tree.parents.shape
        u = torch.rand(bs, num_uniforms(method, n), dtype=torch.float64, generator=g)
        out = fn(tree, logits, u)
        assert_same(graph(tree, logits, u), out)
        exits |= set(out[3].tolist())
        deepest = max(deepest, int(out[1].max()))
    assert len(exits) >= 2 and deepest >= 2  # different exits, accepted paths of depth >= 2


@pytest.mark.parametrize("seed,shape", CASES)
def test_greedy_verify_commit_and_compaction_compile_fullgraph(device_path, seed, shape):
    """Greedy verification (the tensor walk), commit_outputs, compact_rows and seeded_uniforms."""
    tree, seq, logits, _ = round_inputs(seed, *shape)
    bs, n = tree.parents.shape
    greedy = lambda t, x: tuple(R.verify_batch(t, x, SamplingParams(temperature=0.0)))  # noqa: E731
    out = greedy(tree, logits)
    assert_same(compiled(greedy)(tree, logits), out)
    vout = R.VerifyOutput(*out)
    commit = lambda t, p, a, b, e, c, s: R.commit_outputs(t, R.VerifyOutput(p, a, b, e, c), s)  # noqa: E731
    plan = commit(tree, *out, seq)
    assert_same(compiled(commit)(tree, *out, seq), plan)
    hidden = torch.randn(bs * n, 8)
    assert_same(compiled(R.compact_rows)(hidden, plan), R.compact_rows(hidden, plan))
    seeds = torch.arange(bs) * 7919 + seed
    fn = lambda s, l: R.seeded_uniforms(s, l, 2)  # noqa: E731
    assert_same(compiled(fn)(seeds, seq), fn(seeds, seq))
    assert vout.accept_len.max() >= 0


@pytest.mark.parametrize("law", sorted(SAMPLINGS))
def test_verifier_core_functions_compile_fullgraph(device_path, law):
    """The verifier files' own entry points on the processed law or the logits: tev_verify,
    tev_verify_logits, predraw_verify, sequential_verify, greedy_verify, exit_law."""
    from sglang_tev.sampling import processed_probs

    tree, _, logits, g = round_inputs(0, *CASES[0][1])
    bs, n = tree.parents.shape
    x = logits.view(bs, n, V)
    sp = SAMPLINGS[law](bs)
    probs = processed_probs(x, sp)
    u2 = torch.rand(bs, 2, dtype=torch.float64, generator=g)
    un = torch.rand(bs, n, dtype=torch.float64, generator=g)
    calls = {
        "tev_verify": (lambda t, p, u: tev_verify(t, p, u), (tree, probs, u2)),
        "tev_verify_logits": (lambda t, x, u: tev_verify_logits(t, x, sp, u), (tree, x, u2)),
        "predraw_verify": (predraw_verify, (tree, probs, un)),
        "sequential_verify": (sequential_verify, (tree, probs, un)),
        "greedy_verify": (greedy_verify, (tree, x)),
        "exit_law": (lambda t, p: exit_law(t, p, validate=False), (tree, probs)),
        "processed_probs": (lambda x: processed_probs(x, sp), (x,)),
    }
    for name, (fn, args) in calls.items():
        assert_same(compiled(fn)(*args), fn(*args)), name


# ---------------------------------------------------------------------- 2. no host sync
def one_round(tree, seq, seq_sum, logits, method, sp):
    bs, n = tree.parents.shape
    u = R.seeded_uniforms(torch.arange(bs), seq, num_uniforms(method, n)) if method != "greedy" else None
    R.tree_verify_layout(tree, seq, seq_sum)
    out = R.verify_batch(tree, logits, sp, method if method != "greedy" else "tev", uniforms=u)
    plan = R.commit_outputs(tree, out, seq)
    R.compact_rows(torch.randn(bs * n, 4), plan)
    return out


@pytest.mark.parametrize("method", ["tev", "predraw", "sequential", "greedy"])
def test_round_device_path_has_no_host_sync(device_path, method):
    """The whole device round, eager, from sglang_tev/: caps, level-wise build, layout, verify,
    commit, compaction. No blocking call, with per-request tensor laws (SGLang's ``need_*`` flags
    on) and the plain scalar temperature of tev; greedy with scalar temperature 0."""
    for seed, shape in CASES:
        vals, ids, roots, seq, g = draft_lists(seed, *shape)
        bs, H, k, budget = shape
        laws = [SamplingParams(temperature=0.0)] if method == "greedy" else [SAMPLINGS["per_request"](bs)]
        if method == "tev":
            laws.append(SAMPLINGS["scalar"](bs))
        seq_sum = int(seq.sum())  # SGLang's host-side seq_lens_sum
        for sp in laws:
            with HostSyncCounter(include=("sglang_tev/",)) as c:
                caps = R.request_depth_caps(seq, H, context_len=33)
                tree = R.build_trees(vals, ids, budget, roots, H, caps)
                logits = torch.randn(bs * (budget + 1), V, generator=g)
                one_round(tree, seq, seq_sum, logits, method, sp)
            assert c.events == [], c.format()


def test_scalar_sampling_parameters_do_not_copy_to_the_device(device_path):
    """processed_probs (predraw / sequential, and tev with a per-request temperature but a scalar
    top-k / top-p / min-p: SGLang's ``need_*`` flags off) with Python-scalar parameters: the
    scalars become rows by a device fill (``sampling._as_rows``), not by ``torch.as_tensor``'s
    blocking host-to-device copy. Dynamo folds the scalars, so only the counter sees the copy."""
    tree, seq, logits, g = round_inputs(0, *CASES[0][1])
    bs = tree.parents.shape[0]
    sp = SamplingParams(temperature=torch.full((bs,), 0.8), top_k=0, top_p=1.0, min_p=0.0)
    seq_sum = int(seq.sum())
    with HostSyncCounter(include=("sglang_tev/",)) as c:
        one_round(tree, seq, seq_sum, logits, "tev", sp)
    assert c.events == [], c.format()


# ---------------------------------------------------------------------- the checks can fail
def test_the_checks_fail_on_the_cpu_host_path():
    """Without :func:`device_path` the CPU shortcuts run: the heap builder (NumPy, ``.tolist()``),
    the level-wise builder's exact max_depth (``int(tensor)``), the greedy host walk. The compile
    check refuses each (the heap: a graph break; ``int(tensor)``: the data-dependent-op check of
    the backend, which plain ``backend="eager"`` lets through in torch 2.14) and the counter
    reports them at their lines."""
    tree, seq, logits, _ = round_inputs(0, *CASES[0][1])  # heap-built on CPU
    vals, ids, roots, seq, _ = draft_lists(0, *CASES[0][1])
    bs, H, k, budget = CASES[0][1]
    from sglang_tev.draft.ddtree import build_ddtree_topk

    breaks = {
        "heap": lambda v, i, r: R.build_trees(v, i, budget, r, H),
        "levels, exact max_depth": lambda v, i, r: build_ddtree_topk(v, i, budget, r, validate=False, impl="levels"),
    }
    for name, fn in breaks.items():
        with pytest.raises(REFUSED):
            compiled(fn)(vals, ids, roots)
    plain = torch.compile(breaks["levels, exact max_depth"], fullgraph=True, backend="eager", dynamic=False)
    torch._dynamo.reset()
    assert plain(vals, ids, roots).max_depth >= 1  # plain "eager" traces int(tensor) without a break
    with pytest.raises(REFUSED, match="data-dependent"):
        compiled(breaks["levels, exact max_depth"])(vals, ids, roots)
    with pytest.raises(REFUSED):
        compiled(lambda t, x: tuple(R.verify_batch(t, x, SamplingParams(temperature=0.0))))(tree, logits)
    with HostSyncCounter(include=("sglang_tev/",)) as c:
        R.build_trees(vals, ids, budget, roots, H)
        build_ddtree_topk(vals, ids, budget, roots, validate=False, impl="levels")
        R.verify_batch(tree, logits, SamplingParams(temperature=0.0)).host(tree)
    files = {e.file.rsplit("sglang_tev/", 1)[1] for e in c.events}
    assert {"draft/ddtree.py", "verify/greedy.py"} <= files, c.format()
    assert any(e.op == "read:Tensor.__int__" for e in c.events)  # int(max depth) in _build_levels
