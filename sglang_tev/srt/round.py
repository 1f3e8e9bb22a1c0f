"""The tensor logic of one TEV decode round in SGLang's batch layouts (pure torch, no sglang).

The worker (``worker.py``) wires these functions between SGLang's forwards; each is checked on
CPU tensors against an independent computation (``tests/srt/test_srt_round.py``). Layouts follow
SGLang 0.5.23 (``../shared/notes/sglang-0.5.23-internals.md`` §2-§3):

* a batch of ``bs`` requests, ``N`` tree nodes each; request b's nodes are the global rows
  ``b * N + i`` of every ``[bs * N, ...]`` tensor (``draft_token``, ``positions``, target logits,
  hidden states, ``out_cache_loc``); node 0 is the root (the previous round's bonus token, whose
  KV is not cached yet) at position ``seq_lens[b]``;
* the custom attention mask is SGLang's FULL layout, the one its FlashInfer and Triton backends
  read on TARGET_VERIFY: per request ``N`` rows of ``seq_lens[b] + N`` bools (True = attend),
  row-major, requests concatenated; request b starts at ``N * sum_{j<b} seq_lens[j] + N * N * b``;
* retrieve arrays are those of SGLang's ``reconstruct_indices_from_tree_mask`` (global row index,
  first child, next sibling in index order; -1 = none), restricted to valid nodes.

No function here performs a host sync unless its docstring says so.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch

from ..draft.ddtree import build_ddtree_topk
from ..draft.lattice import build_lattice_tree
from ..sampling import SamplingParams
from ..spec import is_scalar_greedy
from ..tree import DraftTree
from ..verify import VerifyOutput, num_uniforms, verify_tree

__all__ = [
    "TOP_K_ALL",
    "TreeVerifyLayout",
    "build_trees",
    "build_lattice_trees",
    "request_depth_caps",
    "tree_custom_mask",
    "tree_retrieve_arrays",
    "tree_verify_layout",
    "RaggedPack",
    "ragged_pack",
    "sampling_params_from_info",
    "as_float32",
    "verify_batch",
    "seeded_uniforms",
    "adopt_rank0_decision",
    "commit_outputs",
    "CommitPlan",
    "compact_rows",
]

TOP_K_ALL = 1 << 30
"""SGLang's "no top-k" value (``sglang.srt.sampling.sampling_params.TOP_K_ALL``)."""


# ---------------------------------------------------------------------- draft -> tree
def build_trees(
    topk_logprobs: torch.Tensor,
    topk_ids: torch.Tensor,
    budget: int,
    root_tokens: torch.Tensor,
    max_depth: int,
    depth_cap: Optional[torch.Tensor] = None,
) -> DraftTree:
    """Batched DDTree from the drafter's per-depth top-k lists, capped at ``max_depth`` (and per
    request at ``depth_cap``).

    Args:
        topk_logprobs: float [bs, H, k], log q_d of the listed tokens normalised over the full
            vocabulary (``vals - lse`` of SGLang's ``candidate_topk(..., with_partition=True)``);
            row j is depth j + 1 (block slot j + 1); H = K - 1, or the depths the round's head
            read (``draft_block.py``).
        topk_ids: int64 [bs, H, k].
        budget: B >= 0 drafted nodes per tree.
        root_tokens: int64 [bs], the bonus tokens of the previous round.
        max_depth: D, rows beyond it are dropped (1 <= D <= H).
        depth_cap: optional int64 [bs], the deepest node each request's tree may hold, values
            clamped to [0, D] (0: a root-only tree, as plain decoding). A request whose root sits
            at position ``seq_lens[b]`` must get no node past the model's last position:
            :func:`request_depth_caps` gives that cap. None: D for every request.
    Returns:
        :class:`DraftTree` with N = B + 1 nodes (``build_ddtree_topk``; padded when fewer fit).
    Raises:
        ValueError naming ``max_depth`` when outside [1, H], ``depth_cap`` when not int64 [bs]
        (no host sync otherwise).
    """
    if not 1 <= max_depth <= topk_logprobs.shape[1]:
        raise ValueError(f"max_depth must be in [1, {topk_logprobs.shape[1]}], got {max_depth}")
    bs = topk_logprobs.shape[0]
    if depth_cap is not None:
        if not isinstance(depth_cap, torch.Tensor) or depth_cap.dtype != torch.int64 or tuple(depth_cap.shape) != (bs,):
            raise ValueError(f"depth_cap must be an int64 tensor [{bs}], got {getattr(depth_cap, 'shape', depth_cap)!r}")
        depth_cap = depth_cap.to(topk_logprobs.device).clamp(0, max_depth)
    return build_ddtree_topk(
        topk_logprobs[:, :max_depth], topk_ids[:, :max_depth].to(torch.int64), budget, root_tokens, validate=False,
        depth_limit=depth_cap,
    )


def build_lattice_trees(
    candidate_ids: torch.Tensor,
    trans_logq: torch.Tensor,
    budget: int,
    root_tokens: torch.Tensor,
    max_depth: int,
    depth_cap: Optional[torch.Tensor] = None,
) -> DraftTree:
    """Batched DDTree over DFlash2 selector lattices (parent-dependent child lists), capped as
    :func:`build_trees`.

    Args:
        candidate_ids: int64 [bs, K - 1, k], slot j's candidates (depth j + 1), distinct per slot
            (the top-k of SGLang's ``compute_candidates``).
        trans_logq: float [bs, K - 1, k, k], ``log_softmax`` of SGLang's lattice scores over the
            last dim (``srt/dflash2.selector_lattice_from_hidden``); slot 0 reads row 0 only.
        budget, root_tokens, max_depth, depth_cap: as :func:`build_trees`.
    Returns:
        :class:`DraftTree` with N = B + 1 nodes (``draft.lattice.build_lattice_tree`` without
        validation: the host heap on CPU, the level-wise search with no host sync elsewhere).
    Raises:
        ValueError naming ``max_depth`` when outside [1, K - 1], ``depth_cap`` when not int64 [bs].
    """
    if not 1 <= max_depth <= candidate_ids.shape[1]:
        raise ValueError(f"max_depth must be in [1, {candidate_ids.shape[1]}], got {max_depth}")
    bs = candidate_ids.shape[0]
    if depth_cap is None:
        depth_cap = torch.full((bs,), max_depth, dtype=torch.int64, device=candidate_ids.device)
    elif not isinstance(depth_cap, torch.Tensor) or depth_cap.dtype != torch.int64 or tuple(depth_cap.shape) != (bs,):
        raise ValueError(f"depth_cap must be an int64 tensor [{bs}], got {getattr(depth_cap, 'shape', depth_cap)!r}")
    depth_cap = depth_cap.to(candidate_ids.device).clamp(0, max_depth)
    return build_lattice_tree(
        candidate_ids[:, :max_depth].to(torch.int64), trans_logq[:, :max_depth], budget, root_tokens.to(torch.int64),
        validate=False, depth_limit=depth_cap,
    )


def request_depth_caps(seq_lens: torch.Tensor, max_depth: int, context_len: int) -> torch.Tensor:
    """Per-request depth cap that keeps every tree node inside the model's positions.

    The root of request b sits at position ``seq_lens[b]``, a node of depth d at
    ``seq_lens[b] + d``; positions run ``0 .. context_len - 1``. So the cap is
    ``clamp(context_len - 1 - seq_lens[b], 0, max_depth)`` (0 at the last position: root only).

    Args:
        seq_lens: int [bs], cached tokens per request (device tensor; no host sync).
        max_depth: D, the round's depth bound.
        context_len: the model's positions (SGLang's ``model_config.context_len``).
    Returns:
        int64 [bs], for :func:`build_trees`'s ``depth_cap``.
    """
    return (int(context_len) - 1 - seq_lens.to(torch.int64)).clamp(0, int(max_depth))


# ---------------------------------------------------------------------- tree -> verify input
def tree_custom_mask(tree: DraftTree, seq_lens: torch.Tensor, seq_lens_sum: int) -> torch.Tensor:
    """SGLang's FULL custom mask for a batch of trees.

    Args:
        tree: N nodes per request.
        seq_lens: int [bs], cached tokens per request (the root sits at position seq_lens[b]).
        seq_lens_sum: int, ``sum(seq_lens)`` known on the host (SGLang carries it on the batch).
    Returns:
        bool [N * seq_lens_sum + N * N * bs]: request b's rows are ``N`` rows of
        ``seq_lens[b] + N`` entries: all True over the prefix, then ``tree.ancestor_mask[b]``
        (each node sees its ancestors and itself; a padded node sees the root and itself).
    """
    b, n = tree.parents.shape
    return _full_mask(tree, seq_lens, n * int(seq_lens_sum) + n * n * b)


def _full_mask(tree: DraftTree, seq_lens: torch.Tensor, total: int, q: torch.Tensor | None = None) -> torch.Tensor:
    """The FULL layout of request b's first ``q[b]`` nodes (all N when ``q`` is None): ``q[b]`` rows
    of ``seq_lens[b] + q[b]`` entries, all True over the prefix, then the tree's ancestor mask;
    ``total`` entries in all (a host int, so no read)."""
    b, n = tree.parents.shape
    dev = tree.device
    seq = seq_lens.to(device=dev, dtype=torch.int64)
    width = n if q is None else q.view(b)
    row_len = seq + width  # [bs]
    req_len = width * row_len
    start = torch.cumsum(req_len, 0) - req_len  # [bs]
    mask = torch.ones(total + (q is not None), dtype=torch.bool, device=dev)  # ragged: + a spare entry
    i = torch.arange(n, device=dev).view(1, n, 1)
    j = torch.arange(n, device=dev).view(1, 1, n)
    idx = start.view(b, 1, 1) + i * row_len.view(b, 1, 1) + seq.view(b, 1, 1) + j  # [bs, N, N]
    if q is not None:  # cut nodes write the spare entry: a scatter, where boolean indexing would read to the host
        idx = torch.where((i < q.view(b, 1, 1)) & (j < q.view(b, 1, 1)), idx, total)
    mask[idx.reshape(-1)] = tree.ancestor_mask.reshape(-1)
    return mask[:total]


def tree_retrieve_arrays(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Retrieve arrays with the semantics of SGLang's ``reconstruct_indices_from_tree_mask``.

    A torch port of its rule applied to the parents: parent = the ancestor with the largest
    index; ``retrieve_index[b, i] = b * N + i``; ``retrieve_next_token[b, i]`` = the smallest-index
    child of i, else -1; ``retrieve_next_sibling[b, i]`` = the smallest index > i with the same
    parent, else -1 (and -1 at the root). Padded (invalid) nodes are left out of every link and get
    -1 links themselves, so SGLang's tree walkers (grammar, logprobs) never reach them.

    Returns:
        (retrieve_index, retrieve_next_token, retrieve_next_sibling), each int64 [bs, N].
    """
    b, n = tree.parents.shape
    dev = tree.device
    idx = torch.arange(n, device=dev).expand(b, n)
    retrieve_index = idx + (torch.arange(b, device=dev) * n).view(b, 1)
    is_child = tree.valid.clone()
    is_child[:, 0] = False
    par = tree.parents.clamp(min=0)
    big = torch.full((b, n), n, dtype=torch.int64, device=dev)
    cand = torch.where(is_child, idx, big)
    first_child = big.clone().scatter_reduce_(1, par, cand, reduce="amin")
    next_token = torch.where(first_child < n, first_child, torch.full_like(first_child, -1))
    # next sibling: smallest k > i with parents[k] == parents[i] (both valid non-root)
    same = (par.unsqueeze(2) == par.unsqueeze(1)) & is_child.unsqueeze(2) & is_child.unsqueeze(1)
    later = idx.unsqueeze(2) < idx.unsqueeze(1)  # [b, i, k]: k > i
    cand_sib = torch.where(same & later, idx.unsqueeze(1).expand(b, n, n), torch.full((b, n, n), n, device=dev))
    sib = cand_sib.amin(2)
    next_sibling = torch.where(sib < n, sib, torch.full_like(sib, -1))
    return retrieve_index, next_token, next_sibling


@dataclass(frozen=True)
class TreeVerifyLayout:
    """Verify input of one round in SGLang's layout.

    Attributes:
        draft_token: int64 [bs * N], node tokens (root first per request; padded nodes carry 0).
        positions: int64 [bs * N], ``seq_lens[b] + depth`` of valid nodes; padded nodes sit at
            the root's position ``seq_lens[b]`` (no one attends to them), so a request whose tree
            is capped near the context limit feeds no position past its root's.
        custom_mask: bool, FULL layout (:func:`tree_custom_mask`); None when not asked for (a
            root-only round without graphs: causal attention is the tree's mask there).
        retrieve_index, retrieve_next_token, retrieve_next_sibling: int64 [bs, N].
        max_tree_depth: D + 1 (width of accepted paths, root included).
    """

    draft_token: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor | None
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    max_tree_depth: int


def tree_verify_layout(tree: DraftTree, seq_lens: torch.Tensor, seq_lens_sum: int, with_mask: bool = True) -> TreeVerifyLayout:
    """Everything the target's TARGET_VERIFY forward needs from the trees (see the module doc).
    ``with_mask=False`` leaves the custom mask out (None): for root-only trees (N = 1), where
    TARGET_VERIFY's causal attention without a mask (SGLang's chain-verify mode) is the same mask,
    and building ``sum_b (seq_len_b + 1)`` all-True entries a round is only cost."""
    b, n = tree.parents.shape
    depth = torch.where(tree.valid, tree.depth, 0)  # padded nodes: depth 1 in the tree, here the root's position
    positions = depth + seq_lens.to(device=tree.device, dtype=torch.int64).view(b, 1)
    ri, nt, ns = tree_retrieve_arrays(tree)
    return TreeVerifyLayout(
        draft_token=tree.tokens.reshape(-1),
        positions=positions.reshape(-1),
        custom_mask=tree_custom_mask(tree, seq_lens, seq_lens_sum) if with_mask else None,
        retrieve_index=ri,
        retrieve_next_token=nt,
        retrieve_next_sibling=ns,
        max_tree_depth=tree.max_depth + 1,
    )


@dataclass(frozen=True)
class RaggedPack:
    """The verify input of trees of different sizes packed request after request (SGLang's ragged
    verify: ``RaggedVerifyLayout``, per-request ``qo_indptr``), cut from the padded
    :class:`TreeVerifyLayout` of the same trees.

    Attributes:
        lens: host list, per request the nodes it verifies (its first ``lens[b]`` nodes, root
            included; ``1 <= lens[b] <= N``).
        cols: int64 [T], T = ``sum(lens)``: the padded row ``b * N + i`` of each packed token (what
            SGLang's ``KVLocPlan`` calls the window columns of a ragged verify's packed rows).
        indptr: int32 [bs + 1], request b's packed rows ``indptr[b] .. indptr[b + 1]`` (SGLang's
            ``qo_indptr``).
        expand: int64 [bs * N]: for each padded row ``b * N + i`` the packed row that stands for it
            (its own for ``i < lens[b]``; a cut node reads its request's root row, and is never
            reached): ``packed.index_select(0, expand)`` is the padded layout in one pass.
        draft_token, positions: int64 [T], the padded layout's at ``cols``.
        custom_mask: bool, FULL layout over the packed rows: request b's ``lens[b]`` rows of
            ``seq_lens[b] + lens[b]`` entries (all True over the prefix, then its tree's ancestor
            mask), requests concatenated; None when the layout has none.
    """

    lens: list
    cols: torch.Tensor
    indptr: torch.Tensor
    expand: torch.Tensor
    draft_token: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor | None


def ragged_pack(tree: DraftTree, layout: TreeVerifyLayout, seq_lens: torch.Tensor, lens: list, seq_lens_cpu: list) -> RaggedPack:
    """Pack the first ``lens[b]`` nodes of each request's tree for one ragged verify forward.

    A best-first tree's first ``n`` nodes are its budget ``n - 1`` tree (a parent comes before its
    children), so the packed rows of request b are a whole tree whose nodes see exactly what they
    saw in the padded layout.

    Args:
        tree: N nodes per request; nodes at or past ``lens[b]`` must be invalid (cut).
        layout: :func:`tree_verify_layout` of ``tree``.
        seq_lens: int [bs] (device), cached tokens per request.
        lens: host ints, ``1 <= lens[b] <= N``.
        seq_lens_cpu: host ints, the same ``seq_lens`` (the mask's size is known without a read).
    Raises:
        ValueError naming ``lens`` (wrong length or out of [1, N]) or ``seq_lens_cpu``.
    """
    b, n = tree.parents.shape
    lens = [int(x) for x in lens]
    if len(lens) != b or any(not 1 <= x <= n for x in lens):
        raise ValueError(f"lens must be {b} ints in [1, {n}] (nodes verified per request), got {lens}")
    seq_host = [int(x) for x in seq_lens_cpu]
    if len(seq_host) != b:
        raise ValueError(f"seq_lens_cpu must hold {b} lengths, got {len(seq_host)}")
    dev = tree.device
    q = torch.tensor(lens, dtype=torch.int64, device=dev)
    rows = torch.repeat_interleave(torch.arange(b, device=dev), q)
    first = torch.cumsum(q, 0) - q
    cols = rows * n + torch.arange(int(q.sum()), device=dev) - first[rows]
    i = torch.arange(n, device=dev).view(1, n)
    expand = (first.view(b, 1) + torch.where(i < q.view(b, 1), i, 0)).reshape(-1)
    mask = None
    if layout.custom_mask is not None:
        mask = _full_mask(tree, seq_lens, sum(x * (s + x) for x, s in zip(lens, seq_host)), q)
    indptr = torch.nn.functional.pad(torch.cumsum(q, 0), (1, 0)).to(torch.int32)
    return RaggedPack(lens=lens, cols=cols, indptr=indptr, expand=expand, draft_token=layout.draft_token[cols], positions=layout.positions[cols], custom_mask=mask)


# ---------------------------------------------------------------------- target law
def sampling_params_from_info(sampling_info, reqs=None) -> SamplingParams:
    """This project's :class:`SamplingParams` from SGLang's ``SamplingBatchInfo``.

    SGLang normalises a request with temperature 0 to ``top_k = 1, temperature = 1``; rows with
    ``top_k <= 1`` are greedy here (temperature 0: one-hot at the argmax, ties to the lowest id).
    ``top_k`` of ``TOP_K_ALL`` (or <= 0) is off. Temperatures, top-p and min-p are per request.
    The law is then softmax(logits / T) -> top-k -> top-p -> min-p, as SGLang's own sampler
    applies them for plain decoding (its tree verifier skips min-p; TEV does not).

    Args:
        sampling_info: an object with ``temperatures [bs, 1]``, ``top_ks [bs]``, ``top_ps [bs]``,
            ``min_ps [bs]``, ``is_all_greedy`` and optionally SGLang's ``need_top_k_sampling`` /
            ``need_top_p_sampling`` / ``need_min_p_sampling`` (a stage no row uses is skipped).
        reqs: optional, the batch's requests in row order (SGLang's ``Req``, whose host-side
            ``sampling_params`` the tensors were built from, ``sampling_batch_info.py:133-155``).
            When every request has the same temperature, top-k, top-p and min-p, the law is
            returned as scalars: the same law, drawn with fewer operations over the vocabulary and
            no device read where a host value is needed (the planner's temperature regime).
    Returns:
        SamplingParams with [bs] tensors; scalars when every row is greedy or, given ``reqs``,
        when every row has the same parameters.
    """
    if bool(getattr(sampling_info, "is_all_greedy", False)):
        return SamplingParams(temperature=0.0)
    if reqs:
        shared = {(r.sampling_params.temperature, r.sampling_params.top_k, r.sampling_params.top_p, r.sampling_params.min_p)
                  for r in reqs}
        if len(shared) == 1:
            t, k, p, m = shared.pop()
            if k <= 1:
                return SamplingParams(temperature=0.0)
            # the float32 values SGLang's tensors hold: the same law (stages the scalars skip
            # were no-ops in the tensors, up to their renormalising rounding)
            return SamplingParams(temperature=as_float32(t), top_k=0 if k >= TOP_K_ALL else int(k), top_p=as_float32(p),
                                  min_p=as_float32(m))
    top_ks = sampling_info.top_ks.view(-1).to(torch.int64)
    temps = sampling_info.temperatures.view(-1).to(torch.float32)
    greedy = top_ks <= 1
    temperature = torch.where(greedy, torch.zeros_like(temps), temps)
    top_k = torch.where((top_ks >= TOP_K_ALL) | greedy, torch.zeros_like(top_ks), top_ks)
    # SGLang's need_* flags say whether any row uses a stage; an unused stage becomes a Python
    # scalar, which processed_probs skips without touching the [bs, N, V] law (no sort)
    return SamplingParams(
        temperature=temperature,
        top_k=top_k if getattr(sampling_info, "need_top_k_sampling", True) else 0,
        top_p=sampling_info.top_ps.view(-1).to(torch.float32) if getattr(sampling_info, "need_top_p_sampling", True) else 1.0,
        min_p=sampling_info.min_ps.view(-1).to(torch.float32) if getattr(sampling_info, "need_min_p_sampling", True) else 0.0,
    )


def as_float32(x: float) -> float:
    """``x`` rounded to float32 (what SGLang's sampling tensors hold), as a Python float."""
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def seeded_uniforms(seeds: torch.Tensor, seq_lens: torch.Tensor, count: int) -> torch.Tensor:
    """Per-request uniforms that depend only on (seed, seq_len, column): reproducible and
    identical on every tensor-parallel rank.

    A splitmix64-style integer hash in int64 arithmetic (wrapping), 53 bits mapped to [0, 1).

    Args:
        seeds: int64 [bs] per-request sampling seeds.
        seq_lens: int [bs], committed length at this round.
        count: uniforms per request.
    Returns:
        float64 [bs, count] in [0, 1).
    """
    b = seeds.shape[0]
    dev = seeds.device
    col = torch.arange(count, device=dev, dtype=torch.int64).view(1, count)
    x = seeds.to(torch.int64).view(b, 1) * 0x9E3779B97F4A7C1 + seq_lens.to(torch.int64).view(b, 1) * 0x2545F4914F6CDD1D
    x = x + (col + 1) * 0x632BE59BD9B4E019
    for mul in (0x3C79AC492BA7B653, 0x1C69B3F74AC4AE35):
        x = x ^ ((x >> 31) & ((1 << 33) - 1))
        x = x * mul
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    bits = (x >> 11) & ((1 << 53) - 1)
    return bits.to(torch.float64) * (1.0 / (1 << 53))


def verify_batch(
    tree: DraftTree,
    next_token_logits: torch.Tensor,
    sampling: SamplingParams,
    method: str = "tev",
    generator: Optional[torch.Generator] = None,
    uniforms: Optional[torch.Tensor] = None,
) -> VerifyOutput:
    """Verify every request's tree on SGLang's verify logits.

    Args:
        tree: bs trees, N nodes.
        next_token_logits: float [bs * N, V], the target's verify logits (penalties and logit bias
            already applied), row b * N + i = node i of request b.
        sampling: per-request law (:func:`sampling_params_from_info`).
        method: ``tev``, ``predraw`` or ``sequential``; a scalar temperature below 1e-5 takes the
            greedy path (argmax follow) whatever the method.
        generator, uniforms: randomness as in :func:`sglang_tev.verify_tree`.
    Returns:
        :class:`sglang_tev.VerifyOutput` (path, accept_len, bonus, exit_node, coverage), equal to
        ``verify_tree`` on the [bs, N, V] view (no validation, no host sync for ``tev``).
    """
    b, n = tree.parents.shape
    logits = next_token_logits.view(b, n, -1)
    if is_scalar_greedy(sampling.temperature):
        method = "greedy"
    elif uniforms is None:
        uniforms = torch.rand(b, num_uniforms(method, n), dtype=torch.float64, device=tree.device, generator=generator)
    return verify_tree(tree, logits, method=method, sampling=sampling, uniforms=uniforms, validate=False)


# ---------------------------------------------------------------------- commit
@dataclass(frozen=True)
class CommitPlan:
    """What a round commits, in SGLang's result layout.

    Attributes:
        out_tokens: int64 [bs, N]: the accepted drafted tokens (depth 1..a), then the bonus,
            then 0; SGLang reads ``out_tokens[b, :commit_lens[b]]``.
        commit_lens: int32 [bs], a + 1 (accepted drafts plus the bonus); GenerationBatchResult's
            ``accept_lens``.
        accept_index: int64 [bs, D + 1], global rows ``b * N + path[b, d]`` of the accepted path
            (root first), -1 past it; EAGLE's ``accept_index``.
        src_rows: int64 [bs, D + 1], the row each front slot d takes its KV / hidden state from:
            ``b * N + path[b, d]`` for d <= a, else ``b * N + d`` (a no-op move).
        dst_rows: int64 [bs, D + 1], ``b * N + d``. Sources can be later destinations: apply the
            move gather-first or in this (increasing d) order, never in decreasing d
            (:func:`commit_outputs`).
        new_seq_lens: int [bs], ``seq_lens + commit_lens``.
    """

    out_tokens: torch.Tensor
    commit_lens: torch.Tensor
    accept_index: torch.Tensor
    src_rows: torch.Tensor
    dst_rows: torch.Tensor
    new_seq_lens: torch.Tensor


def adopt_rank0_decision(tree: DraftTree, out: VerifyOutput, broadcast) -> VerifyOutput:
    """Every tensor-parallel rank takes rank 0's verify decision (the exit node and the bonus).

    The ranks already decide alike (the same gathered logits, the same seeded generator, the same
    tree), as SGLang's DFlash does without its broadcast; this is its insurance against a rank
    that drew or rounded differently (``SpecTpSync``, ``dflash_worker_v2.py:2209-2229``: accept
    lengths and bonus tokens from rank 0), which would otherwise let the ranks' KV caches drift
    apart silently. The tree must be the same on every rank (it is built from all-gathered drafter
    candidates); only the decision over it is broadcast.

    Args:
        tree: the round's trees [b, N].
        out: this rank's decision.
        broadcast: ``fn(int64 tensor) -> tensor`` with rank 0's values (in place, as
            ``GroupCoordinator.broadcast``).
    Returns:
        A :class:`VerifyOutput` on rank 0's exit nodes and bonus tokens (path and accept length
        recomputed from the tree; this rank's coverage kept: it is a report, not a decision).
    """
    exit_node = broadcast(out.exit_node.to(torch.int64).contiguous())
    bonus = broadcast(out.bonus.to(torch.int64).contiguous())
    accept_len = torch.gather(tree.depth, 1, exit_node.view(-1, 1)).squeeze(1).to(torch.int64)
    return VerifyOutput(tree.path(exit_node), accept_len, bonus, exit_node, out.coverage)


def commit_outputs(tree: DraftTree, out: VerifyOutput, seq_lens: torch.Tensor) -> CommitPlan:
    """Turn verification results into SGLang's commit layout (see :class:`CommitPlan`).

    The accepted path's node at depth d moves to front slot d of its request's window (EAGLE's
    ``_compact_accept_to_front`` convention). Since parents precede children,
    ``path[d] >= d``, but a source may also be the destination of a deeper slot: with path
    ``[0, 2, 3]`` slot 1 takes slot 2 and slot 2 takes slot 3. So a move must either read every
    source before it writes any destination (a gather then a scatter: ``x[dst] = x[src]`` in
    torch, :func:`compact_rows`, SGLang 0.5.23's ``move_kv_cache`` on GPU, whose tiled Triton
    kernel loads all locations of a byte tile before storing them; its CPU kernel, from
    ``sgl_kernel``, was not checked here), or copy one slot at a time in
    increasing d, the row-major order of ``src_rows`` / ``dst_rows`` (slot d's source
    ``path[d]`` >= d is then never a slot already written). Decreasing d, or an unordered
    in-place kernel, overwrites a source before it is read (slot 2 <- 3 first, then slot 1
    reads slot 3's row).
    """
    b, n = tree.parents.shape
    if n == 1:  # a root-only round (a plain step): the root's own row, the bonus its one token
        rows = torch.arange(b, device=tree.device).view(b, 1)
        ones = torch.ones(b, dtype=torch.int32, device=tree.device)
        # out_tokens a copy: the bonus is also the next round's root
        return CommitPlan(out.bonus.view(b, 1).to(torch.int64, copy=True), ones, rows, rows.clone(), rows.clone(),
                          seq_lens + ones.to(seq_lens.dtype).to(seq_lens.device))
    return _commit_tree(tree, out, seq_lens)


def _commit_tree(tree: DraftTree, out: VerifyOutput, seq_lens: torch.Tensor) -> CommitPlan:
    """:func:`commit_outputs` for any tree (root-only ones included)."""
    b, n = tree.parents.shape
    dev = tree.device
    width = tree.max_depth + 1
    path = out.path[:, :width]
    a = out.accept_len
    d = torch.arange(width, device=dev).view(1, width)
    on_path = d <= a.view(b, 1)
    base = (torch.arange(b, device=dev) * n).view(b, 1)
    accept_index = torch.where(on_path, base + path.clamp(min=0), torch.full_like(path, -1))
    dst_rows = (base + d).expand(b, width).contiguous()
    src_rows = torch.where(on_path, accept_index, dst_rows)
    # accepted drafted tokens = tokens of path[1..a]; the bonus goes at slot a
    path_tok = torch.gather(tree.tokens, 1, path.clamp(min=0))  # [b, width]
    out_tokens = torch.zeros(b, n, dtype=torch.int64, device=dev)
    drafted = path_tok[:, 1:]  # depth 1..D
    keep = (d[:, 1:] <= a.view(b, 1)) & (d[:, 1:] < width)
    out_tokens[:, : width - 1] = torch.where(keep, drafted, torch.zeros_like(drafted))
    out_tokens.scatter_(1, a.view(b, 1), out.bonus.view(b, 1))
    commit_lens = (a + 1).to(torch.int32)
    new_seq_lens = seq_lens + commit_lens.to(seq_lens.dtype).to(seq_lens.device)
    return CommitPlan(out_tokens, commit_lens, accept_index, src_rows, dst_rows, new_seq_lens)


def compact_rows(x: torch.Tensor, plan: CommitPlan) -> torch.Tensor:
    """Move the accepted path's rows of a node-indexed tensor to the front of each request.

    Args:
        x: [bs * N, ...] (hidden states, logits, cache locations).
    Returns:
        a new tensor: row ``b * N + d`` = ``x[b * N + path[b, d]]`` for d <= accept_len; other rows
        unchanged.
    """
    out = x.clone()
    out[plan.dst_rows.reshape(-1)] = x[plan.src_rows.reshape(-1)]
    return out
