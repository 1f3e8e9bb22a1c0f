"""One decoding round of the transformers runtime, for every active row at once (DESIGN §1, §3,
§5), as functions of one :class:`BatchState` (``srt/round.py`` does the same in SGLang's layouts)::

    draft           drafter(context, roots) -> per-depth draft logits [b, K - 1, V], or (DFlash2,
                    draft mode "lattice") the selector's candidate lattice [b, K - 1, k(, k)]
    build           DDTree over the marginals or over the lattice (or the argmax / selector chain,
                    or the root alone) -> DraftTree [b, N = 1 + B]
    forward_inputs  per-row tree masks (attention windows per layer type), positions
                    past_len + depth (never >= the model's max positions, padded nodes included),
                    cache slots; part of the build stage
    tree_forward    one target forward over the b x N nodes, K/V written into the static cache
    verify          generation controls at every node -> verify_tree -> the round's ONE host sync
                    (paths, bonus tokens, accept lengths, coverage, first non-finite node)
    commit          per layer one gather moves each row's accepted path to the front of its tree
                    window; the path's target features go to the drafter; stops cut the block

The root of a round is the last committed token: it has no KV yet and is fed with the tree;
``past_len`` counts the tokens whose KV is cached and node v sits at ``past_len + depth(v)``.

Host syncs: one per round (the decision), plus one per stage on CUDA when ``time_stages`` is set.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..draft.ddtree import build_ddtree
from ..draft.dflash2 import SelectorLattice
from ..draft.lattice import build_lattice_tree, selector_chain
from ..native import native
from ..plan import BudgetPolicy, RoundPlan
from ..planner import regime_of
from ..sampling import SamplingParams
from ..tree import DraftTree, root_only_tree
from ..verify import num_uniforms, verify_tree
from .control_state import ControlState
from .masks import KEPT_MASK_MAX_ROWS, KeptTreeMask, tree_masks
from .records import RoundStats, Row
from .static_cache import StaticKVCache
from .stops import cut_block, leaf_tokens
from .transfer import to_device
from .target import TargetModel

__all__ = ["NonFiniteLogitsError", "BatchState", "run_round", "draft", "build", "build_chain", "forward_inputs",
           "tree_forward", "eager_tree_forward", "verify", "commit", "flush_context",
           "gather_nodes", "root_only_tree"]


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN / +inf (or only -inf) logits at a valid tree node: an exact verifier
    cannot use them (the exit law would move to that node), so the call stops with this error."""


@dataclass(eq=False)
class BatchState:
    """What a round reads and writes. The scheduler (``hf/scheduler.py``) makes it once per call,
    owns its buffers (it fills, refills and moves their rows) and runs :func:`run_round` on it.

    The call:
        method: a ``GENERATION_METHODS`` entry; verifier: the verify method; policy: the
        :class:`~sglang_tev.plan.BudgetPolicy` asked for each round's :class:`~sglang_tev.plan.RoundPlan`;
        draft_mode: ``"marginal"`` (per-depth draft logits: DDTree / argmax chain) or
        ``"lattice"`` (a DFlash2 selector lattice: lattice DDTree / the selector's chain), resolved
        by the generator (see ``SpeculativeGenerator.generate``);
        block_size: K (None: autoregressive); n_nodes: N = 1 + the policy's capacity (the chain's
        K), the largest tree width any round may use: buffers and static shapes are sized by it;
        static: fixed forward shapes (the attention reads the whole cache); time_stages: sync the
        device after each stage; stream: ``fn(request index, ids)`` or None; tokenizer: for stop
        strings (or None).
    The models:
        target; drafter (None: autoregressive); layer_ids: target layers whose hidden states the
        drafter reads (None: no features); need_tokens: the drafter or the controls read ``tokens``.
    The buffers (slot i of each is row i of ``rows``):
        cache: the static KV cache; tokens: int64 [cap, max_len] committed tokens; controls: the
        control state; kept_mask: the kept tree mask; static_slots: slot tensors per (rows, nodes)
        with static shapes; graphs: captured tree forwards or None; slot_ids: int64 arange.
    Carried from round to round:
        rows: the active rows; pending_context: the last commit's path features for the drafter;
        plan: the current round's plan (budgets per row, draft depth, sub-budgets to report);
        sampling_key / sampling: the batch's SamplingParams and the rows it was made for (the
        scheduler sets the key to None when rows change); first: no round verified yet;
        round_no.
    """

    method: str
    verifier: str
    policy: BudgetPolicy
    block_size: int | None
    n_nodes: int
    static: bool
    time_stages: bool
    stream: Callable | None
    tokenizer: object
    target: TargetModel
    drafter: object
    layer_ids: Sequence[int] | None
    need_tokens: bool
    cache: StaticKVCache
    tokens: torch.Tensor
    controls: ControlState
    kept_mask: KeptTreeMask
    static_slots: dict
    slot_ids: torch.Tensor
    graphs: Callable | None = None
    rows: list[Row] = field(default_factory=list)
    pending_context: tuple | None = None
    sampling_key: tuple | None = None
    sampling: SamplingParams | None = None
    first: bool = True
    round_no: int = 0
    draft_mode: str = "marginal"
    plan: RoundPlan | None = None

    @property
    def budget(self) -> int:
        """This round's tree budget B (the plan's; the largest row's)."""
        return self.plan.budget

    @property
    def speculative(self) -> bool:
        return self.method != "autoregressive"

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]


def run_round(state: BatchState) -> list[int]:
    """draft -> build -> tree forward -> verify (one host sync) -> commit. Returns the slots of
    the rows that finished (increasing); the scheduler retires them."""
    times: dict[str, float] = {}
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        if state.time_stages:
            state.target.sync()
        now = time.perf_counter()
        times[stage] = (now - clock[0]) * 1e3
        clock[0] = now

    rows = state.rows
    b = len(rows)
    sl = slice(0, b)
    t0 = clock[0]
    plan = state.plan = state.policy.plan(b)
    lens = to_device([r.past_len for r in rows], torch.int64, state.device)
    roots = to_device([r.ids[-1] for r in rows], torch.int64, state.device)
    # a plain decoding step (budget 0 under auto) drafts nothing: no depth caps to read
    plain_step = state.budget == 0 and state.method != "chain"
    depth_cap = [0] * b if plain_step else [row_depth_cap(state, r) for r in rows]

    drafted = draft(state, sl, roots, lens, depth_cap)
    lap("draft")
    tree = build(state, drafted, roots, depth_cap)
    learns = drafted is not None and state.method != "chain" and hasattr(state.policy, "refine")
    if learns:  # the planner cuts the tree to this round's draft
        tree = refine(state, tree, drafted)
        plan = state.plan
    inputs = forward_inputs(state, sl, tree, lens)
    lap("build")
    logits, feats = tree_forward(state, tree, inputs)
    lap("tree_forward")
    reach_at = plan.reach_at if drafted is not None else None
    decision = verify(state, tree, logits, reach_at, reach_nodes=learns)
    lap("verify")
    finished = commit(state, sl, tree, lens, feats, decision, times)
    lap("commit")
    if learns:
        state.policy.observe(plan, decision.reach_cum, time.perf_counter() - t0, reach_nodes=decision.reach_nodes)
    else:
        state.policy.observe(plan, decision.reach_cum, time.perf_counter() - t0)
    state.round_no += 1
    return finished


def row_depth_cap(state: BatchState, r: Row) -> int:
    """Deepest node a row's tree may hold: K - 1, one less than the tokens left (the bonus
    token comes on top), and the last position the model has."""
    if not state.speculative:
        return 0
    return max(0, min(state.block_size - 1, r.remaining - 1, state.target.max_positions - 1 - r.past_len))


# ---------------------------------------------------------------------- draft
def flush_context(state: BatchState) -> None:
    """Hand the last commit's path features to the drafter (done in the draft stage, where the
    reference's draft forward does it too, or before rows move)."""
    if state.pending_context is not None:
        state.drafter.add_context(*state.pending_context)
        state.pending_context = None


def draft(state: BatchState, sl: slice, roots, lens, depth_cap: list[int]) -> torch.Tensor | SelectorLattice | None:
    """Per-depth draft logits float32 [b, D, V] (draft mode "marginal"), the DFlash2 selector's
    :class:`~sglang_tev.draft.dflash2.SelectorLattice` over D slots (draft mode "lattice":
    ``candidate_ids`` [b, D, k], ``transition_logq`` [b, D, k, k]), or None when no row may draft;
    D = the plan's draft depth (K - 1 when it gives none), or fewer with a ``partial_slots`` drafter.

    The block is K tokens whatever the rows' depth caps: attention inside a DFlash block is
    bidirectional, so a shorter block would change every depth's logits; so a row's drafts do not
    depend on its neighbours' caps (nor on the batch), and the draft forward has one shape; the
    builder caps each row's tree instead. A drafter with ``partial_slots`` returns only the
    depths this round's trees can reach (``min(B, deepest cap)``; their logits do not change).
    A plan with a ``draft_depth`` (``budget="auto"``: ``min(K - 1, B)``, a tree of B nodes reaches
    depth B at most) drafts a block of ``draft_depth + 1`` tokens: chosen from past rounds only,
    so the output law is untouched; the drafts of the depths kept may move a little (tau
    unchanged on the shipped pair), and the policy's gains are those of the blocks it runs.
    """
    flush_context(state)
    deepest = max(depth_cap)
    if deepest <= 0:
        return None  # nothing to draft (run_round gives a plain decoding step zero caps)
    fn = state.drafter.draft_lattice_rows if state.draft_mode == "lattice" else state.drafter.draft_rows
    depth = state.block_size - 1
    kw = {}
    if state.method != "chain":
        if state.plan.draft_depth is not None:
            # the plan cuts the block (auto: B + 1 tokens; the depths past it would only be
            # attended to; up to 20 % cheaper drafts on CPU), chosen from past rounds only
            depth = min(depth, state.plan.draft_depth)
        if getattr(state.drafter, "partial_slots", False):
            # the drafter's head skips the slots no tree of this round can reach
            kw["slots"] = min(deepest, state.budget, depth)
    return fn(sl, roots, lens, state.tokens[sl], depth, max(r.past_len for r in state.rows), **kw)


# ---------------------------------------------------------------------- build
def build(state: BatchState, drafted, roots, depth_cap: list[int]) -> DraftTree:
    """The round's trees, depth capped per row, stop tokens kept as leaves: from draft logits
    DDTree (``build_ddtree``) or the per-depth argmax chain; from a selector lattice the lattice
    DDTree (``build_lattice_tree``: a node's children scored by the transition row of its own
    candidate) or the selector's chain (``selector_chain``: greedy for greedy rows, sampled at the
    row's temperature with uniforms from the row's generator otherwise); or the root alone."""
    if drafted is None:
        return root_only_tree(roots)
    leaf = leaf_tokens([r.stops for r in state.rows], state.device)
    # no limit when every row may use the whole block (the common case: no tensor to make)
    cap_t = None if min(depth_cap) >= state.block_size - 1 else to_device(depth_cap, torch.int64, state.device)
    if isinstance(drafted, SelectorLattice):
        ids, trans = drafted.candidate_ids, drafted.transition_logq
        if state.method == "chain":
            temperature, uniforms = _chain_draws(state, ids.shape[1])
            return selector_chain(ids, trans, roots, temperature, validate=state.first, uniforms=uniforms,
                                  depth_limit=cap_t, leaf_tokens=leaf)
        return build_lattice_tree(ids, trans, state.budget, roots, validate=state.first, depth_limit=cap_t,
                                  leaf_tokens=leaf)
    if state.method == "chain":
        return build_chain(drafted, roots, depth_cap, leaf, state.n_nodes)
    return build_ddtree(drafted, state.budget, roots, validate=state.first, depth_limit=cap_t, leaf_tokens=leaf)


def refine(state: BatchState, tree: DraftTree, drafted) -> DraftTree:
    """Ask the planner (:meth:`sglang_tev.plan.TreePlanner.refine`) for this round's width from
    the tree's draft path scores, and cut the tree to it: a best-first tree's first ``w`` nodes
    are its budget-``w`` tree. Sets ``state.plan`` to the refined plan."""
    regimes = [regime_of(0.0 if r.greedy else _first(r.req.sampling.temperature)) for r in state.rows]
    state.plan, tree = state.policy.refine_tree(state.plan, tree, drafted, regimes)
    return tree


def _chain_draws(state: BatchState, slots: int):
    """The selector chain's temperature (the rows' target temperatures, 0 for greedy rows: a
    Python float when all rows share it, else float64 [b]) and its uniforms float64 [b, slots]
    (each sampled row draws them from its own generator, before the verifier's; greedy rows draw
    nothing and read zeros), or None when every row is greedy."""
    temperature = row_sampling(state).temperature
    if all(r.greedy for r in state.rows):
        return 0.0, None
    u = torch.zeros(len(state.rows), slots, dtype=torch.float64, device=state.device)
    for i, r in enumerate(state.rows):
        if not r.greedy:
            u[i] = torch.rand(slots, dtype=torch.float64, device=state.device, generator=r.generator)
    return temperature, u


def build_chain(draft_logits: torch.Tensor, roots: torch.Tensor, depth_cap: list[int], leaf: torch.Tensor | None,
                width: int) -> DraftTree:
    """The linear DFlash block: per-depth argmax, ``parents[i] = i - 1``.

    Args:
        draft_logits: float [b, H, V]; roots: int64 [b].
        depth_cap: per row, the deepest node it may hold.
        leaf: int64 [b, S] stop tokens (-1 padded; nothing is drafted below one) or None.
        width: N, the static width (K): the tree is padded to it.
    """
    b = roots.shape[0]
    dev = roots.device
    H = min(draft_logits.shape[1], max(depth_cap))
    chain = draft_logits[:, :H].argmax(-1)  # [b, H]
    parents = torch.arange(-1, H, device=dev).expand(b, H + 1)
    tokens = torch.cat([roots.view(b, 1), chain], 1)
    ok = torch.arange(1, H + 1, device=dev).view(1, H) <= torch.tensor(depth_cap, device=dev).view(b, 1)
    if leaf is not None:  # nothing below a stop token
        stop_before = torch.zeros_like(ok)
        stop_before[:, 1:] = (chain[:, :-1].unsqueeze(-1) == leaf.unsqueeze(1)).any(-1).cummax(1).values[:, :]
        ok &= ~stop_before
    valid = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), ok], 1)
    valid = valid.to(torch.int8).cummin(1).values.bool()
    tree = DraftTree.from_parents(parents.contiguous(), tokens, valid, validate=False)
    if tree.num_nodes < width:  # static width K even when H < K - 1
        tree = _pad_to(tree, width)
    return tree


def _pad_to(tree: DraftTree, n: int) -> DraftTree:
    b, n0 = tree.parents.shape
    z = lambda dt: torch.zeros(b, n - n0, dtype=dt, device=tree.device)  # noqa: E731
    return DraftTree.from_parents(torch.cat([tree.parents, z(torch.int64)], 1), torch.cat([tree.tokens, z(torch.int64)], 1),
                                  torch.cat([tree.valid, z(torch.bool)], 1), validate=False)


def forward_inputs(state: BatchState, sl: slice, tree: DraftTree, lens) -> dict:
    """The tree forward's positions (past_len + depth) and masks, and where its K/V go (slots
    past_len + node index of each row); part of the build stage, as the reference's compile.
    With static shapes the attention reads the whole cache and the slots live in a static
    buffer per (rows, nodes), so a captured graph sees the same tensors every round."""
    target, rows, dev = state.target, state.rows, state.device
    b, n = tree.parents.shape
    if state.static:
        kv_len = state.max_len
        slots = state.static_slots.get((b, n))
        if slots is None:
            slots = state.static_slots[(b, n)] = torch.zeros(b, n, dtype=torch.int64, device=dev)
        slots.copy_(lens.view(b, 1) + torch.arange(n, device=dev))
    else:
        kv_len = max(r.past_len for r in rows) + n
        slots = rows[0].past_len if b == 1 else lens.view(b, 1) + torch.arange(n, device=dev)
    if state.static or target.layout.windows != {"full_attention": None} or b > KEPT_MASK_MAX_ROWS:
        masks = target.attention_mask(tree_masks(target.layout, lens, tree.depth, tree.ancestor_mask, kv_len))
    else:
        masks = state.kept_mask.update(tree, rows, kv_len)  # already additive
    depth = tree.depth
    if n > 1 and max(r.past_len for r in rows) >= target.max_positions - 1:
        # a row at its last position has a root-only tree but still N - 1 padded nodes (depth 1
        # by the DraftTree contract): they sit at the root's position instead, so no position
        # >= the limit is fed (dynamic-NTK RoPE would rescale the whole forward)
        depth = torch.where(tree.valid, depth, 0)
    positions = depth + rows[0].past_len if b == 1 else lens.view(b, 1) + depth
    return {"rows": sl, "positions": positions, "masks": masks, "slots": slots, "kv_len": kv_len}


# ---------------------------------------------------------------------- tree forward
def tree_forward(state: BatchState, tree: DraftTree, inputs: dict):
    """One target forward over every row's tree: logits float32 [b, N, V], features or None
    (a CUDA-graph replay when captured)."""
    state.cache.begin(inputs["rows"], inputs["slots"], inputs["kv_len"])
    if state.graphs is not None:
        return state.graphs(tree.tokens, inputs["positions"], inputs["masks"])
    return eager_tree_forward(state, tree.tokens, inputs["positions"], inputs["masks"])


def eager_tree_forward(state: BatchState, tokens, positions, masks):
    """The tree forward itself (what a CUDA graph captures): ``(logits float32, features or None)``."""
    out, feats = state.target.forward(tokens, positions, masks, state.cache, state.layer_ids)
    return out.logits.float(), feats


# ---------------------------------------------------------------------- verify
def _first(x) -> float:
    """A request's sampling value as a float (a Python number as is; a tensor's first entry)."""
    return float(x) if isinstance(x, (int, float)) else float(torch.as_tensor(x).reshape(-1)[0])


def row_sampling(state: BatchState) -> SamplingParams:
    """The batch's SamplingParams: Python scalars when every row shares them (fast paths),
    else [b] tensors. Rebuilt only when the active rows change."""
    key = tuple(id(r) for r in state.rows)
    if key != state.sampling_key:
        sps = [r.req.sampling for r in state.rows]
        vals = {f: [_first(getattr(s, f)) for s in sps] for f in ("temperature", "top_k", "top_p", "min_p")}
        vals["temperature"] = [0.0 if r.greedy else t for r, t in zip(state.rows, vals["temperature"])]
        if all(len(set(v)) == 1 for v in vals.values()):
            sp = SamplingParams(temperature=vals["temperature"][0], top_k=int(vals["top_k"][0]),
                                top_p=vals["top_p"][0], min_p=vals["min_p"][0])
        else:
            t = lambda k, dt: torch.tensor(vals[k], dtype=dt, device=state.device)  # noqa: E731
            sp = SamplingParams(temperature=t("temperature", torch.float64), top_k=t("top_k", torch.int64),
                                top_p=t("top_p", torch.float64), min_p=t("min_p", torch.float64))
        state.sampling_key, state.sampling = key, sp
    return state.sampling


def row_uniforms(state: BatchState, n: int) -> torch.Tensor | None:
    """float64 [b, U]: each sampled row draws from its own generator; greedy rows draw nothing."""
    if all(r.greedy for r in state.rows):
        return None
    u_count = num_uniforms(state.verifier, n)
    u = torch.zeros(len(state.rows), u_count, dtype=torch.float64, device=state.device)
    for i, r in enumerate(state.rows):
        if not r.greedy:
            u[i] = torch.rand(u_count, dtype=torch.float64, device=state.device, generator=r.generator)
    return u


def verify(state: BatchState, tree: DraftTree, logits: torch.Tensor, reach_at: Sequence[int] | None = None,
           reach_nodes: bool = False):
    """Controls at every node, the verifier, and the round's one host sync: the decision and
    each row's first valid node with non-finite logits (the finiteness check) read back
    together (:meth:`~sglang_tev.verify.VerifyOutput.host`).

    Raises:
        NonFiniteLogitsError: NaN / +inf (or only -inf) logits at a valid node of some row.
    """
    b, n = tree.parents.shape
    rows = state.rows
    if state.controls.active:
        logits = state.controls.apply(logits, tree, [r.controls for r in rows],
                                      lambda i: state.tokens[i, : rows[i].past_len + 1])
    sampling = row_sampling(state)
    vout = verify_tree(tree, logits, method=state.verifier, sampling=sampling, uniforms=row_uniforms(state, n),
                       validate=False)
    # non-finite logits at any valid node (NaN, +inf, or only -inf in a row) stop the call
    dec = vout.host(tree, check_finite=logits, reach_at=reach_at or None,  # the one host sync of the round
                    reach_nodes=reach_nodes)
    for i, v in enumerate(dec.first_nonfinite):
        if v >= 0:
            r = rows[i]
            raise NonFiniteLogitsError(
                f"target logits are not finite (NaN, +inf or all -inf) at round {state.round_no}, prompt {r.index}, "
                f"tree node {v} (depth {int(tree.depth[i, v])}, token {int(tree.tokens[i, v])}); "
                f"{len(r.result.token_ids)} tokens were emitted before it. Check the model's dtype (fp16 overflow?)")
    state.first = False
    return dec


# ---------------------------------------------------------------------- commit
def commit(state: BatchState, sl: slice, tree: DraftTree, lens, feats, dec, times: dict[str, float]) -> list[int]:
    """Move each row's accepted path KV to the front of its tree window (one gather per layer,
    skipped when every path is already in place), keep the path's features for the drafter, cut
    blocks at stops / max_new_tokens, advance. Returns the slots of the rows that finished."""
    rows, dev = state.rows, state.device
    b = len(rows)
    paths = dec.paths
    w = max(len(p) for p in paths)
    if feats is not None or w > 1:
        # nodes 0..a already sit in slots 0..a (always so for root-only paths)
        in_place = w == 1 or all(p == list(range(len(p))) for p in paths)
        if b == 1:  # one row: slices, a C move and one index_select, no index grids
            start = rows[0].past_len
            dst = state.slot_ids[start: start + w].view(1, w)
            if not in_place:
                state.cache.compact_row(sl.start, [start + v for v in paths[0]], start)
            ctx = None
            if feats is not None:
                ctx = feats[:, :w] if in_place else gather_nodes(feats, paths[0])
        else:
            dst = lens.view(b, 1) + state.slot_ids[:w]
            ctx = None if feats is None else feats[:, :w]
            if not in_place:  # rows with shorter paths move their own slots onto themselves
                src = to_device([p + list(range(len(p), w)) for p in paths], torch.int64, dev)
                if w > 1:
                    state.cache.compact(sl, lens.view(b, 1) + src, dst)
                if feats is not None:
                    ctx = feats.gather(1, src.unsqueeze(-1).expand(b, w, feats.shape[-1]))
        if feats is not None:
            # a CUDA graph's outputs are overwritten by its next replay, and the drafter may keep
            # the context over plain rounds (budget auto): hand it a copy there
            state.pending_context = (sl, ctx if state.graphs is None else ctx.clone(), dst)
    # host bookkeeping
    finished = []
    writes_r, writes_c, writes_t = [], [], []
    for i, r in enumerate(rows):
        acc = dec.accept_len[i]
        block = dec.path_tokens[i][1:] + [dec.bonus[i]]
        block, reason = cut_block(block, r.result.token_ids, r.stops, r.req.stop_strings, r.remaining, state.tokenizer)
        m = len(block)
        for k, t in enumerate(block):
            writes_r.append(i)
            writes_c.append(r.past_len + 1 + k)
            writes_t.append(t)
        r.ids.extend(block)
        r.past_len += m  # the KV of root + the first m - 1 block tokens is cached (m - 1 <= acc)
        r.result.token_ids.extend(block)
        r.result.rounds.append(RoundStats(min(acc, m), m, dec.coverage[i], dec.tree_nodes[i], times,
                                          verified_accept_len=acc, batch_rows=b,
                                          budget=state.budget if state.method not in ("chain", "autoregressive") else None))
        if state.stream is not None and block:
            state.stream(r.index, block)
        if reason is not None:
            r.result.finish_reason = reason
            finished.append(i)
    if writes_r and state.need_tokens:
        wr = to_device(writes_r, torch.int64, dev)
        wt = to_device(writes_t, torch.int64, dev)
        state.tokens[wr, to_device(writes_c, torch.int64, dev)] = wt
        state.controls.record(wr, wt, b)
    return finished


def gather_nodes(feats: torch.Tensor, nodes: list[int]) -> torch.Tensor:
    """``feats[:, nodes]`` of one row's features [1, N, F] (on CPU one C copy, no index tensor)."""
    gather = native("gather_rows") if feats.device.type == "cpu" and feats.is_contiguous() else None
    if gather is None:
        return feats.index_select(1, torch.tensor(nodes, device=feats.device))
    out = feats.new_empty(1, len(nodes), feats.shape[-1])
    row_bytes = feats.shape[-1] * feats.element_size()
    idx = (ctypes.c_int64 * len(nodes))(*nodes)
    gather(feats.data_ptr(), row_bytes, ctypes.addressof(idx), len(nodes), out.data_ptr())
    return out
