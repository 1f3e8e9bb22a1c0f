"""Tensor parallel at the round level: two gloo ranks, each holding half of the vocabulary,
take the same TEV decisions as each other and as one process holding all of it.

Under ``--tp-size 2`` every rank runs ``TEVWorker._tev_decode`` on its own: SGLang gathers the
vocabulary-parallel verify logits on every rank (``LogitsProcessor.finish_deferred_gather`` /
the all-gather in ``_get_logits``), the drafter's candidates with ``candidate_topk`` (local top-k
per shard, all-gather of values, ids and shard log-sum-exps, global top-k; ``models/dflash.py:
107-154``), and each rank builds the tree, verifies and commits by itself. The worker does NOT
broadcast its decision from rank 0 (SGLang's DFlash does: ``SpecTpSync``,
``speculative/dflash_worker_v2.py:2209-2229``); the ranks agree only because their inputs are
bit-identical after the gathers and their randomness is too: ``TEVWorker._tev_generator`` is
seeded from ``server_args.random_seed`` on every rank, and seeded requests use
``round.seeded_uniforms`` (a hash of seed and length).

Here two processes (``torch.distributed``, backend gloo, world size 2) replay that: per round
each rank gets its vocabulary shard of the drafter's and the target's logits, gathers them as
SGLang does, and runs the worker's round functions (``build_trees``, ``verify_batch``,
``commit_outputs``, ``seeded_uniforms``) with the worker's generator. Batches mix greedy and
sampled rows (temperature, top-k, top-p, min-p), with and without per-request seeds, and an
all-greedy batch. The target's logits of a node depend on the tree (its depth and token), and
each round starts from the previous round's bonus and lengths, so a decision that differs between
ranks changes every later input. Negative control: generators seeded differently per rank
(``random_seed + rank``) do diverge, so the agreement test can fail.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.multiprocessing as mp

from sglang_tev.srt.round import (
    TOP_K_ALL,
    adopt_rank0_decision,
    build_trees,
    commit_outputs,
    sampling_params_from_info,
    seeded_uniforms,
    verify_batch,
)
from sglang_tev.verify import num_uniforms

VOCAB = 512  # split in two shards of 256
BS = 6
DEPTH = 4  # drafted depths (K - 1)
TOPK = 4
BUDGET = 12  # N = 13
ROUNDS = 40
RANDOM_SEED = 7  # server_args.random_seed
SCENARIOS = ("mixed", "mixed_seeded", "all_greedy")
RECORD = ("parents", "valid", "tokens", "exit_node", "accept_len", "bonus", "commit_lens", "out_tokens")


def _sampling_info(scenario: str) -> types.SimpleNamespace:
    """SGLang's ``SamplingBatchInfo`` fields the worker reads (greedy rows as SGLang normalises
    temperature 0: ``top_k = 1``, ``temperature = 1``)."""
    if scenario == "all_greedy":
        return types.SimpleNamespace(
            is_all_greedy=True,
            temperatures=torch.ones(BS, 1),
            top_ks=torch.ones(BS, dtype=torch.int32),
            top_ps=torch.ones(BS),
            min_ps=torch.zeros(BS),
            sampling_seed=None,
        )
    info = types.SimpleNamespace(
        is_all_greedy=False,
        temperatures=torch.tensor([[1.0], [1.0], [0.7], [1.0], [1.3], [0.9]]),
        top_ks=torch.tensor([1, 1, TOP_K_ALL, 20, TOP_K_ALL, 8], dtype=torch.int32),
        top_ps=torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 0.95]),
        min_ps=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0]),
        need_top_k_sampling=True,
        need_top_p_sampling=True,
        need_min_p_sampling=True,
        sampling_seed=None,
    )
    if scenario == "mixed_seeded":
        info.sampling_seed = torch.tensor([101, 202, 303, 404, 505, 606], dtype=torch.int64)
    return info


def _world(scenario: str, rnd: int):
    """The round's full-vocabulary "model outputs", the same on every rank (the models' weights
    and inputs are): drafter logits [BS, DEPTH, V] and per-node noise [BS, N, V]."""
    g = torch.Generator().manual_seed(1000 * SCENARIOS.index(scenario) + rnd)
    draft = torch.randn(BS, DEPTH, VOCAB, generator=g) * 2.5
    noise = torch.randn(BS, BUDGET + 1, VOCAB, generator=g)
    return draft, noise


def _target_logits(tree, draft, noise):
    """float32 [BS * N, V]: node i predicts depth(i) + 1; the target mostly agrees with the
    drafter there (so drafts get accepted), with node-specific noise and a shift by the node's
    token (so the law depends on the tree, not only on the round)."""
    b, n = tree.parents.shape
    depth = torch.where(tree.valid, tree.depth, 0).clamp(max=DEPTH - 1)
    base = torch.gather(draft, 1, depth.view(b, n, 1).expand(b, n, VOCAB))
    shift = torch.roll(noise, shifts=1, dims=-1) * (tree.tokens % 3).view(b, n, 1).float() * 0.3
    return (1.2 * base + 0.6 * noise + shift).reshape(b * n, VOCAB).float()


class _Gather:
    """Vocabulary shards -> full rows, as SGLang's TP all-gathers concatenate shards in rank
    order; with ``world`` 1 it is the identity (one process, TP 1)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.width = VOCAB // world

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.rank * self.width : (self.rank + 1) * self.width].contiguous()

    def cat(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def _candidate_topk(shard_logits: torch.Tensor, gather: _Gather):
    """``candidate_topk(..., with_partition=True)`` under TP on one shard [rows, V / tp]:
    local top-k, global ids, all-gather of values / ids / shard lse, global top-k, lse of lses.
    Returns (log q [rows, k] float32, ids [rows, k] int64)."""
    vals, ids = torch.topk(shard_logits.float(), TOPK, dim=-1)
    lse = torch.logsumexp(shard_logits.float(), dim=-1)
    ids = ids + gather.rank * gather.width
    gvals, gids = gather.cat(vals), gather.cat(ids)
    top, sel = torch.topk(gvals, TOPK, dim=-1)
    lse = torch.logsumexp(gather.cat(lse.unsqueeze(-1)), dim=-1)
    return top - lse.unsqueeze(-1), torch.gather(gids, -1, sel)


def run_rounds(scenario: str, gather: _Gather, generator: torch.Generator, seed_shift: int = 0, broadcast=None) -> dict:
    """``ROUNDS`` TEV rounds of one batch as ``TEVWorker._tev_decode`` runs them on one rank
    (steps 1 and 3 of the worker; the forwards are replaced by :func:`_world`'s logits, sharded).
    ``seed_shift`` is added to the per-request seeds of ``mixed_seeded``; ``broadcast`` (a gloo
    broadcast from rank 0) makes the round adopt rank 0's decision, as the worker does with
    SGLang's ``SpecTpSync`` on. Returns
    {name: int64 tensor [ROUNDS, ...]} for the names in :data:`RECORD`."""
    info = _sampling_info(scenario)
    if info.sampling_seed is not None:
        info.sampling_seed = info.sampling_seed + seed_shift
    seq_lens = torch.tensor([9, 3, 30, 17, 1, 44], dtype=torch.int64)
    roots = torch.tensor([5, 77, 300, 411, 2, 260], dtype=torch.int64)
    rec = {k: [] for k in RECORD}
    for rnd in range(ROUNDS):
        draft_full, noise_full = _world(scenario, rnd)
        # 1) drafter: each rank projects its vocabulary shard; candidate_topk gathers
        logq, ids = _candidate_topk(gather.shard(draft_full).view(BS * DEPTH, -1), gather)
        tree = build_trees(logq.view(BS, DEPTH, TOPK), ids.view(BS, DEPTH, TOPK), BUDGET, roots, DEPTH)
        # 2) target verify: each rank's lm-head shard of the tree's logits, then the gather
        logits = gather.cat(gather.shard(_target_logits(tree, draft_full, noise_full)))
        # 3) the worker's verification step, verbatim
        sampling = sampling_params_from_info(info)
        uniforms = None
        seeds = getattr(info, "sampling_seed", None)
        if seeds is not None and not sampling.all_greedy():
            uniforms = seeded_uniforms(seeds, seq_lens, num_uniforms("tev", tree.parents.shape[1]))
        out = verify_batch(tree, logits, sampling, "tev", generator=generator, uniforms=uniforms)
        if broadcast is not None:
            out = adopt_rank0_decision(tree, out, broadcast)
        plan = commit_outputs(tree, out, seq_lens)
        for k, v in (
            ("parents", tree.parents),
            ("valid", tree.valid),
            ("tokens", tree.tokens),
            ("exit_node", out.exit_node),
            ("accept_len", out.accept_len),
            ("bonus", out.bonus),
            ("commit_lens", plan.commit_lens),
            ("out_tokens", plan.out_tokens),
        ):
            rec[k].append(v.to(torch.int64).clone())
        roots, seq_lens = out.bonus.view(-1).to(torch.int64), plan.new_seq_lens.to(torch.int64)
    return {k: torch.stack(v) for k, v in rec.items()}


def _generator(rank: int, per_rank_seed: bool) -> torch.Generator:
    """The worker's ``_tev_generator``: ``manual_seed(server_args.random_seed)`` on every rank;
    ``per_rank_seed`` is the negative control (``random_seed + rank``)."""
    return torch.Generator().manual_seed(RANDOM_SEED + (rank if per_rank_seed else 0))


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        gather = _Gather(rank, world)
        result = {}
        for per_rank_seed in (False, True):
            for scenario in SCENARIOS:
                result[(scenario, per_rank_seed)] = run_rounds(scenario, gather, _generator(rank, per_rank_seed))

        def from_rank0(t):
            dist.broadcast(t, src=0)
            return t

        # the worker's insurance: rank-dependent generators, decisions broadcast from rank 0
        result[("mixed", "broadcast")] = run_rounds("mixed", gather, _generator(rank, True), broadcast=from_rank0)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' records, {(scenario, per_rank_seed): {name: tensor}} per rank."""
    d = tmp_path_factory.mktemp("tp_ranks")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, 2, str(d / "init"), str(d))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "a gloo rank failed (see its stderr above)"
    return [torch.load(d / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def tp1():
    """The same rounds in one process holding the whole vocabulary (TP 1)."""
    return {s: run_rounds(s, _Gather(0, 1), _generator(0, False)) for s in SCENARIOS}


def _differing_rounds(a: dict, b: dict) -> list:
    return [r for r in range(ROUNDS) if any(not torch.equal(a[k][r], b[k][r]) for k in RECORD)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_ranks_take_identical_decisions(ranks, scenario):
    r0, r1 = ranks[0][(scenario, False)], ranks[1][(scenario, False)]
    assert _differing_rounds(r0, r1) == []
    # the rounds are not trivial: drafts are accepted, trees branch, several depths are reached
    acc = r0["accept_len"]
    assert int(acc.sum()) > ROUNDS * BS // 2
    assert int(acc.max()) >= 3
    assert int(torch.unique(acc).numel()) >= 3
    par = torch.where(r0["valid"].bool(), r0["parents"], -1)  # [ROUNDS, BS, N], padded nodes left out
    child = par >= 0
    siblings = (par.unsqueeze(-1) == par.unsqueeze(-2)) & child.unsqueeze(-1) & ~torch.eye(BUDGET + 1, dtype=torch.bool)
    assert float(siblings.any(-1).any(-1).float().mean()) > 0.5  # most trees branch (not chains)
    assert torch.equal(r0["commit_lens"], acc + 1)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tp2_decisions_equal_tp1(ranks, tp1, scenario):
    """The gathered shards are the full logits bit for bit, so TP 2 decides as TP 1 does."""
    assert _differing_rounds(ranks[0][(scenario, False)], tp1[scenario]) == []


def test_seeded_rows_follow_their_seeds(tp1):
    """The seeded scenario's agreement is not vacuous: other per-request seeds change the sampled
    rows' decisions (round 0 has the same inputs; greedy rows 0 and 1 keep theirs there)."""
    other = run_rounds("mixed_seeded", _Gather(0, 1), _generator(0, False), seed_shift=1)
    ref = tp1["mixed_seeded"]
    assert torch.equal(other["exit_node"][0, :2], ref["exit_node"][0, :2])
    assert torch.equal(other["bonus"][0, :2], ref["bonus"][0, :2])
    assert _differing_rounds(other, ref)[0] < 5


def test_negative_control_rank_dependent_generator_diverges(ranks):
    """With the generator seeded ``random_seed + rank`` the ranks take different decisions on
    unseeded sampled rows within a few rounds; the other scenarios never read the generator
    (seeded rows use their hash uniforms, greedy rows none), so they still agree."""
    diff = _differing_rounds(ranks[0][("mixed", True)], ranks[1][("mixed", True)])
    assert diff, "rank-dependent generators took identical decisions: the agreement test could not fail"
    assert diff[0] < 5
    for scenario in ("mixed_seeded", "all_greedy"):
        assert _differing_rounds(ranks[0][(scenario, True)], ranks[1][(scenario, True)]) == []
        assert _differing_rounds(ranks[0][(scenario, True)], ranks[0][(scenario, False)]) == []


def test_shard_gather_is_exact():
    """The two ranks' shards concatenated in rank order are the full rows (the premise of the
    agreement); gloo is not needed to check the slicing."""
    x = torch.randn(3, VOCAB)
    shards = [_Gather(r, 2).shard(x) for r in range(2)]
    assert all(s.shape == (3, VOCAB // 2) for s in shards)
    assert torch.equal(torch.cat(shards, dim=-1), x)



def test_rank0_broadcast_makes_diverging_ranks_agree(ranks, tp1):
    """With the generators seeded per rank (the negative control above, which diverges) and the
    worker's ``adopt_rank0_decision`` on (SGLang's ``SpecTpSync``, on by default at TP > 1), both
    ranks commit rank 0's decisions in every round, and those are the decisions one process
    with rank 0's generator (``random_seed + 0``, the TP 1 run) takes."""
    r0, r1 = ranks[0][("mixed", "broadcast")], ranks[1][("mixed", "broadcast")]
    assert _differing_rounds(r0, r1) == []
    assert _differing_rounds(r0, tp1["mixed"]) == []
