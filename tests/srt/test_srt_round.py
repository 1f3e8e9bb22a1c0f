"""The TEV round's tensor logic in SGLang's layouts, on CPU, against independent computations.

Layout references are SGLang 0.5.23's own code where it runs on CPU (``SamplingBatchInfo``,
``apply_dflash_verify_logits_adjustments``, ``_compact_accept_to_front``, the NGRAM worker's
``_derive_tree_links``) and hand ports of its CUDA kernels otherwise.
"""

from __future__ import annotations

import ast
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_pair import plain_greedy

from sglang_tev import DraftTree, SamplingParams, build_ddtree_topk, processed_probs, verify_tree
from sglang_tev.srt.round import (
    build_trees,
    commit_outputs,
    compact_rows,
    sampling_params_from_info,
    seeded_uniforms,
    tree_custom_mask,
    tree_retrieve_arrays,
    tree_verify_layout,
    verify_batch,
)
from sglang_tev.verify import VerifyOutput

from sglang_tev.testing.sglang_cpu.required import have_sglang, needs_sglang  # noqa: E402

HAVE_SGLANG = have_sglang()


def random_trees(bs=4, depth=5, k=3, budget=12, seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, vocab, generator=g) * 2
    lq = torch.log_softmax(logits, -1)
    vals, ids = lq.topk(k, -1)
    roots = torch.randint(0, vocab, (bs,), generator=g)
    return build_ddtree_topk(vals, ids, budget, roots)


def python_ancestors(parents_row, valid_row, i):
    """Ancestors of node i (itself included), walking parents; a padded node sees root + self."""
    if not valid_row[i]:
        return {0, i}
    out, cur = {i}, i
    while parents_row[cur] >= 0:
        cur = parents_row[cur]
        out.add(cur)
    return out


# ---------------------------------------------------------------------- custom mask, positions
def test_custom_mask_is_sglang_full_layout_per_request():
    tree = random_trees(bs=4, budget=12, k=3)
    # a padded tree as well: tiny lists cannot fill the budget
    padded = build_ddtree_topk(torch.log(torch.tensor([[[0.6], [0.5]]])), torch.tensor([[[3], [4]]]), 5, torch.tensor([9]))
    assert not bool(padded.valid.all())
    for t, seq in ((tree, [7, 0, 3, 11]), (padded, [4])):
        b, n = t.parents.shape
        seq_lens = torch.tensor(seq)
        mask = tree_custom_mask(t, seq_lens, sum(seq))
        # independent: request by request, row by row, prefix columns then tree columns
        expect = []
        par, val = t.parents.tolist(), t.valid.tolist()
        for r in range(b):
            for i in range(n):
                anc = python_ancestors(par[r], val[r], i)
                expect += [True] * seq[r] + [j in anc for j in range(n)]
        assert mask.dtype == torch.bool
        assert mask.tolist() == expect
        # the size SGLang's generate_attn_arg_prefill expects: N * sum(seq) + N^2 * bs
        assert mask.numel() == n * sum(seq) + n * n * b
        # request b starts at N*N*b + N*sum_{j<b} seq_j (notes §3.1)
        for r in range(b):
            start = n * n * r + n * sum(seq[:r])
            assert mask[start : start + seq[r]].all()


def test_positions_and_tokens_layout():
    tree = random_trees(bs=3, budget=9)
    seq = torch.tensor([5, 1, 8])
    lay = tree_verify_layout(tree, seq, int(seq.sum()))
    n = tree.num_nodes
    for r in range(3):
        for i in range(n):
            d = len(python_ancestors(tree.parents[r].tolist(), tree.valid[r].tolist(), i)) - 1
            d = d if bool(tree.valid[r, i]) else 0  # a padded node sits at its root's position
            assert int(lay.positions[r * n + i]) == int(seq[r]) + d
            assert int(lay.draft_token[r * n + i]) == int(tree.tokens[r, i])
    assert lay.max_tree_depth == tree.max_depth + 1


# ---------------------------------------------------------------------- retrieve arrays
def kernel_port(mask_flat, bs, n):
    """Line-by-line Python port of SGLang's reconstructIndicesFromTreeMask CUDA kernel
    (sgl_kernel/speculative/ngram.cuh) on a QLEN mask [bs*N*N]."""
    m = mask_flat.tolist()
    ri, nt, ns = [[0] * n for _ in range(bs)], [[0] * n for _ in range(bs)], [[0] * n for _ in range(bs)]
    for bid in range(bs):
        off = bid * n * n
        for tid in range(n):
            parent = -1
            for i in range(tid - 1, -1, -1):
                if m[off + tid * n + i]:
                    if parent == -1:
                        parent = i
            ri[bid][tid] = bid * n + tid
            nxt = -1
            for i in range(tid + 1, n):
                if m[off + i * n + tid]:
                    nxt = i
                    break
            nt[bid][tid] = nxt
            sib = -1
            if parent != -1:
                for i in range(tid + 1, n):
                    if m[off + i * n + parent]:
                        if not any(m[off + i * n + j] for j in range(parent + 1, i)):
                            sib = i
                            break
            ns[bid][tid] = sib
    return ri, nt, ns


def load_derive_tree_links():
    """SGLang's own host-side reference, ``_derive_tree_links`` of the NGRAM worker, taken from
    its source (the module itself needs CUDA kernels to import)."""
    import sglang

    path = sglang.__path__[0] + "/srt/speculative/ngram_worker.py"
    src = open(path).read()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_derive_tree_links")
    ns = {"np": np, "torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), ns)
    return ns["_derive_tree_links"]


def test_retrieve_arrays_on_the_documented_rule_example():
    # root 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; parents precede children
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    tree = DraftTree.from_parents(parents, torch.tensor([[9, 1, 2, 3, 4, 5]]))
    ri, nt, ns = tree_retrieve_arrays(tree)
    assert ri.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert nt.tolist() == [[1, 3, 5, -1, -1, -1]]  # first child
    assert ns.tolist() == [[-1, 2, -1, 4, -1, -1]]  # next sibling, -1 at the root


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retrieve_arrays_equal_sglang_reconstruct_semantics(seed):
    tree = random_trees(bs=4, budget=15, k=4, seed=seed)
    assert bool(tree.valid.all())
    b, n = tree.parents.shape
    qlen = tree.ancestor_mask.reshape(-1)
    ri, nt, ns = tree_retrieve_arrays(tree)
    kri, knt, kns = kernel_port(qlen, b, n)
    assert ri.tolist() == kri and nt.tolist() == knt and ns.tolist() == kns
    if HAVE_SGLANG:
        derive = load_derive_tree_links()
        t2, s2 = derive(tree.ancestor_mask.numpy(), b, n)
        assert torch.equal(nt, t2) and torch.equal(ns, s2)


def test_retrieve_arrays_leave_padded_nodes_out():
    padded = build_ddtree_topk(torch.log(torch.tensor([[[0.6, 0.3], [0.5, 0.2]]])), torch.tensor([[[3, 7], [4, 8]]]), 9, torch.tensor([1]))
    v = padded.valid[0]
    assert not bool(v.all())
    ri, nt, ns = tree_retrieve_arrays(padded)
    links = torch.cat([nt[0], ns[0]])
    pad_idx = set(torch.nonzero(~v).view(-1).tolist())
    assert not (set(links.tolist()) & pad_idx)
    assert (nt[0][~v] == -1).all() and (ns[0][~v] == -1).all()
    # on the valid part the kernel rule holds
    nv = int(v.sum())
    sub = padded.ancestor_mask[:, :nv, :nv].reshape(-1)
    _, knt, kns = kernel_port(sub, 1, nv)
    assert nt[0, :nv].tolist() == knt[0] and ns[0, :nv].tolist() == kns[0]


# ---------------------------------------------------------------------- draft -> tree
def test_build_trees_caps_depth_and_matches_builder():
    g = torch.Generator().manual_seed(3)
    lq = torch.log_softmax(torch.randn(4, 15, 40, generator=g), -1)
    vals, ids = lq.topk(4, -1)
    roots = torch.arange(4)
    t = build_trees(vals, ids, 30, roots, max_depth=3)
    assert t.max_depth <= 3
    ref = build_ddtree_topk(vals[:, :3], ids[:, :3], 30, roots)
    assert torch.equal(t.parents, ref.parents) and torch.equal(t.tokens, ref.tokens)
    with pytest.raises(ValueError, match="max_depth"):
        build_trees(vals, ids, 30, roots, max_depth=16)
    with pytest.raises(ValueError, match="max_depth"):
        build_trees(vals, ids, 30, roots, max_depth=0)


def test_requests_near_the_context_limit_get_no_node_past_it():
    """Context 32: a request whose root sits at position 31 gets a root-only tree, one at 29 a
    tree of depth <= 2, one far from the limit the full depth; no position fed (padded nodes
    included) reaches 32, and the capped trees are the builder's with that depth limit."""
    from sglang_tev.srt.round import request_depth_caps

    g = torch.Generator().manual_seed(5)
    lq = torch.log_softmax(4 * torch.randn(3, 7, 40, generator=g), -1)  # peaked: deep trees
    vals, ids = lq.topk(3, -1)
    roots = torch.tensor([4, 5, 6])
    seq = torch.tensor([31, 29, 3])
    caps = request_depth_caps(seq, max_depth=6, context_len=32)
    assert caps.tolist() == [0, 2, 6] and caps.dtype == torch.int64
    tree = build_trees(vals, ids, 12, roots, max_depth=6, depth_cap=caps)
    assert tree.valid[0].sum() == 1 and tree.valid[1].sum() > 2 and tree.valid[2].sum() == 13
    deepest = torch.where(tree.valid, tree.depth, 0).amax(1).tolist()
    assert deepest[:2] == [0, 2] and 2 < deepest[2] <= 6
    ref = build_ddtree_topk(vals[:, :6], ids[:, :6], 12, roots, depth_limit=caps)
    assert torch.equal(tree.parents, ref.parents) and torch.equal(tree.tokens, ref.tokens)
    lay = tree_verify_layout(tree, seq, int(seq.sum()))
    assert int(lay.positions.max()) == 31 and lay.positions.view(3, -1)[0].tolist() == [31] * 13
    with pytest.raises(ValueError, match="depth_cap"):
        build_trees(vals, ids, 12, roots, max_depth=6, depth_cap=caps.to(torch.int32))
    with pytest.raises(ValueError, match="depth_cap"):
        build_trees(vals, ids, 12, roots, max_depth=6, depth_cap=caps[:2])


# ---------------------------------------------------------------------- batched verification
@pytest.mark.parametrize("method", ["tev", "predraw", "sequential"])
def test_verify_batch_equals_verify_tree_per_request(method):
    tree = random_trees(bs=4, budget=10, k=3, vocab=12, seed=5)
    b, n = tree.parents.shape
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(b * n, 12, generator=g) * 2
    sp = SamplingParams(
        temperature=torch.tensor([0.7, 1.0, 1.3, 0.0]),
        top_k=torch.tensor([0, 5, 0, 0]),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.05, 0.0]),
    )
    from sglang_tev.verify import num_uniforms

    u = torch.rand(b, num_uniforms(method, n), dtype=torch.float64, generator=g)
    out = verify_batch(tree, logits, sp, method, uniforms=u)
    for r in range(b):
        sub = DraftTree.from_parents(tree.parents[r : r + 1], tree.tokens[r : r + 1], tree.valid[r : r + 1])
        one = SamplingParams(*(getattr(sp, f)[r].item() for f in ("temperature", "top_k", "top_p", "min_p")))
        ref = verify_tree(sub, logits.view(b, n, -1)[r : r + 1], method=method, sampling=one, uniforms=u[r : r + 1])
        assert int(out.exit_node[r]) == int(ref.exit_node[0])
        assert int(out.bonus[r]) == int(ref.bonus[0])
        assert int(out.accept_len[r]) == int(ref.accept_len[0])
        assert torch.equal(out.path[r, : sub.num_nodes], ref.path[0])


def test_verify_batch_greedy_is_argmax_follow():
    tree = random_trees(bs=3, budget=8, k=2, vocab=10, seed=7)
    b, n = tree.parents.shape
    # make the target agree with the tree along node 0 -> its first child -> ...
    logits = torch.randn(b * n, 10)
    out = verify_batch(tree, logits, SamplingParams(temperature=0.0), "tev")
    ref = verify_tree(tree, logits.view(b, n, -1), method="greedy", sampling=SamplingParams(temperature=0.0))
    assert torch.equal(out.exit_node, ref.exit_node) and torch.equal(out.bonus, ref.bonus)
    for r in range(b):
        node = 0
        while True:
            want = int(logits.view(b, n, -1)[r, node].argmax())
            kids = [c for c in range(1, n) if tree.valid[r, c] and int(tree.parents[r, c]) == node and int(tree.tokens[r, c]) == want]
            if not kids:
                assert int(out.exit_node[r]) == node and int(out.bonus[r]) == want
                break
            node = kids[0]


# ---------------------------------------------------------------------- commit and compaction
def ragged_case():
    """bs = 5 requests with different trees and chosen exits of different depths (0 included)."""
    tree = random_trees(bs=5, depth=4, budget=14, k=3, seed=9)
    b, n = tree.parents.shape
    exits = []
    for r in range(b):
        deepest = int(torch.argmax(torch.where(tree.valid[r], tree.depth[r], -1)))
        exits.append([0, 1, deepest, deepest, 2][r])
    exit_node = torch.tensor(exits)
    accept_len = torch.gather(tree.depth, 1, exit_node.view(b, 1)).view(b)
    assert len(set(accept_len.tolist())) >= 3  # ragged
    bonus = torch.tensor([101, 102, 103, 104, 105])
    out = VerifyOutput(tree.path(exit_node), accept_len, bonus, exit_node, torch.zeros(b))
    return tree, out


def test_commit_outputs_tokens_lengths_and_indices():
    tree, out = ragged_case()
    b, n = tree.parents.shape
    seq = torch.tensor([10, 3, 0, 7, 21])
    plan = commit_outputs(tree, out, seq)
    for r in range(b):
        a = int(out.accept_len[r])
        node, path = int(out.exit_node[r]), []
        while node >= 0:
            path.append(node)
            node = int(tree.parents[r, node])
        path = path[::-1]  # root first
        assert len(path) == a + 1
        toks = [int(tree.tokens[r, v]) for v in path[1:]] + [int(out.bonus[r])]
        assert plan.out_tokens[r, : a + 1].tolist() == toks
        assert (plan.out_tokens[r, a + 1 :] == 0).all()
        assert int(plan.commit_lens[r]) == a + 1
        assert int(plan.new_seq_lens[r]) == int(seq[r]) + a + 1
        width = plan.accept_index.shape[1]
        assert plan.accept_index[r].tolist() == [r * n + v for v in path] + [-1] * (width - a - 1)
    assert plan.commit_lens.dtype == torch.int32


@pytest.mark.parametrize("seq_dtype", [torch.int64, torch.int32])
def test_commit_of_a_root_only_round_equals_the_general_commit(seq_dtype):
    """A plain step's commit (the root-only shortcut) is field for field the general one's."""
    from sglang_tev.srt.round import _commit_tree
    from sglang_tev.tree import root_only_tree

    b = 5
    tree = root_only_tree(torch.tensor([3, 1, 4, 1, 5]))
    zero = torch.zeros(b, dtype=torch.int64)
    out = VerifyOutput(tree.path(zero), zero, torch.tensor([101, 102, 103, 104, 105]), zero, torch.ones(b))
    seq = torch.tensor([10, 3, 0, 7, 21], dtype=seq_dtype)
    fast, general = commit_outputs(tree, out, seq), _commit_tree(tree, out, seq)
    for name in ("out_tokens", "commit_lens", "accept_index", "src_rows", "dst_rows", "new_seq_lens"):
        a, g = getattr(fast, name), getattr(general, name)
        assert a.dtype == g.dtype and torch.equal(a, g), name
    assert fast.out_tokens[:, 0].tolist() == [101, 102, 103, 104, 105]
    assert fast.out_tokens.data_ptr() != out.bonus.data_ptr()  # the bonus is also the next round's root
    assert fast.src_rows.data_ptr() != fast.accept_index.data_ptr()


def test_compaction_matches_sglang_and_moves_kv_front():
    tree, out = ragged_case()
    b, n = tree.parents.shape
    plan = commit_outputs(tree, out, torch.zeros(b, dtype=torch.int64))
    hidden = torch.randn(b * n, 6)
    ours = compact_rows(hidden, plan)
    if HAVE_SGLANG:
        from sglang.srt.speculative.eagle_worker_common import _compact_accept_to_front

        theirs = _compact_accept_to_front(hidden, plan.accept_index, b, num_draft_tokens=n)
        for r in range(b):
            a = int(out.accept_len[r])
            # rows 0..a are the accepted path in both; past it SGLang leaves clamped junk, we keep rows
            assert torch.equal(ours[r * n : r * n + a + 1], theirs[r * n : r * n + a + 1])
    # independent: the front of each window holds the path's rows, the rest is untouched
    for r in range(b):
        a = int(out.accept_len[r])
        path = out.path[r, : a + 1].tolist()
        assert torch.equal(ours[r * n : r * n + a + 1], hidden[[r * n + v for v in path]])
        assert torch.equal(ours[r * n + a + 1 : (r + 1) * n], hidden[r * n + a + 1 : (r + 1) * n])
    # KV move as the worker does it: slots from out_cache_loc, one gather-then-scatter, and also
    # move by move in order (the two agree because path[d] >= d)
    out_cache_loc = torch.randperm(1000)[: b * n]
    kv = torch.randn(1000, 4)
    src = out_cache_loc[plan.src_rows.reshape(-1)]
    dst = out_cache_loc[plan.dst_rows.reshape(-1)]
    kv1 = kv.clone()
    kv1[dst] = kv[src]
    kv2 = kv.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        kv2[d] = kv2[s]
    assert torch.equal(kv1, kv2)
    for r in range(b):
        a = int(out.accept_len[r])
        for d in range(a + 1):
            assert torch.equal(kv1[out_cache_loc[r * n + d]], kv[out_cache_loc[r * n + int(out.path[r, d])]])


def chain_case():
    """One request whose accepted path [0, 2, 3] makes slot 2 both a source (of slot 1) and a
    destination (of slot 3's row): the case where the order of an in-place move matters."""
    parents = torch.tensor([[-1, 0, 0, 2, 0]])
    tree = DraftTree.from_parents(parents, torch.tensor([[9, 4, 5, 6, 7]]))
    exit_node = torch.tensor([3])
    out = VerifyOutput(tree.path(exit_node), torch.tensor([2]), torch.tensor([8]), exit_node, torch.zeros(1))
    return tree, out


def in_place_move(x, dst, src):
    """A move kernel that copies one row at a time, in place, in the order given."""
    for d, s in zip(dst.tolist(), src.tolist()):
        x[d] = x[s]
    return x


def test_commit_move_order_is_stated_and_sufficient():
    """``commit_outputs``' plan moved in place one slot at a time in its increasing-d order equals
    the gather-then-scatter move; the decreasing order (which the docstring used to allow: "any
    order") overwrites slot 2 before slot 1 reads it."""
    for tree, out in (chain_case(), ragged_case()):
        b, n = tree.parents.shape
        plan = commit_outputs(tree, out, torch.zeros(b, dtype=torch.int64))
        x = torch.randn(b * n, 3)
        want = compact_rows(x, plan)
        src, dst = plan.src_rows.reshape(-1), plan.dst_rows.reshape(-1)
        assert torch.equal(in_place_move(x.clone(), dst, src), want)
    tree, out = chain_case()
    plan = commit_outputs(tree, out, torch.zeros(1, dtype=torch.int64))
    assert plan.src_rows.tolist() == [[0, 2, 3]] and plan.dst_rows.tolist() == [[0, 1, 2]]
    x = torch.arange(5.0).view(5, 1)
    bad = in_place_move(x.clone(), plan.dst_rows.reshape(-1).flip(0), plan.src_rows.reshape(-1).flip(0))
    assert bad[:3].flatten().tolist() == [0.0, 3.0, 3.0] != compact_rows(x, plan)[:3].flatten().tolist()
    doc = " ".join(commit_outputs.__doc__.split())
    assert "any order" not in doc and "increasing d" in doc and "gather" in doc


@needs_sglang
def test_sglang_move_kernel_reads_every_source_first(tmp_path):
    """SGLang's ``copy_all_layer_kv_cache_tiled`` (behind ``move_kv_cache`` on GPU), run by
    Triton's interpreter on CPU, moves the chain case like a gather then a scatter."""
    import subprocess
    import sys

    code = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled
buf = torch.randn(8, 16)
want = buf.clone()
tgt, src = torch.tensor([0, 1, 2]), torch.tensor([0, 2, 3])
want[tgt] = want[src]
ptrs = torch.tensor([buf.data_ptr()], dtype=torch.uint64)
strides = torch.tensor([buf.stride(0) * buf.element_size()], dtype=torch.int64)
copy_all_layer_kv_cache_tiled[(1, 1)](ptrs, strides, tgt, src, 3, 4, BYTES_PER_TILE=64)
assert torch.equal(buf, want)
print("ok")
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ---------------------------------------------------------------------- sampling info -> law
@needs_sglang
def test_sampling_info_law_equals_sampling_params_law():
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams as SglParams

    requests = [  # (temperature, top_k, top_p, min_p) as a user passes them to SGLang
        (0.0, -1, 1.0, 0.0),
        (0.7, -1, 0.9, 0.0),
        (1.0, 5, 1.0, 0.0),
        (1.3, 8, 0.8, 0.1),
        (0.5, -1, 1.0, 0.2),
    ]
    norm = []
    for t, k, p, m in requests:
        s = SglParams(temperature=t, top_k=k, top_p=p, min_p=m)
        s.normalize(None)
        norm.append(s)
    V = 16
    info = SamplingBatchInfo(
        temperatures=torch.tensor([[s.temperature] for s in norm]),
        top_ps=torch.tensor([s.top_p for s in norm]),
        top_ks=torch.tensor([s.top_k for s in norm], dtype=torch.int32),
        min_ps=torch.tensor([s.min_p for s in norm]),
        is_all_greedy=all(s.top_k <= 1 for s in norm),
        is_any_greedy=any(s.top_k <= 1 for s in norm),
        need_top_p_sampling=True,
        need_top_k_sampling=True,
        need_min_p_sampling=True,
        vocab_size=V,
        device="cpu",
    )
    sp = sampling_params_from_info(info)
    logits = torch.randn(5, 3, V, dtype=torch.float64)
    got = processed_probs(logits, sp)
    for r, (t, k, p, m) in enumerate(requests):
        want = processed_probs(logits[r : r + 1], SamplingParams(temperature=t, top_k=max(k, 0), top_p=p, min_p=m))
        torch.testing.assert_close(got[r : r + 1], want, rtol=1e-6, atol=1e-7)
    # the greedy request is one-hot at the argmax
    assert torch.equal(got[0].argmax(-1), logits[0].argmax(-1)) and bool((got[0].max(-1).values == 1).all())
    # stages no row uses are passed as scalars (skipped); the law is unchanged
    info.need_top_p_sampling = info.need_min_p_sampling = False
    info.top_ps = torch.ones(5)
    info.min_ps = torch.zeros(5)
    sp2 = sampling_params_from_info(info)
    assert sp2.top_p == 1.0 and sp2.min_p == 0.0
    torch.testing.assert_close(processed_probs(logits, sp2), processed_probs(logits, sampling_params_from_info(
        SamplingBatchInfo(temperatures=info.temperatures, top_ps=info.top_ps, top_ks=info.top_ks, min_ps=info.min_ps,
                          is_all_greedy=False, is_any_greedy=True, need_top_p_sampling=True, need_top_k_sampling=True,
                          need_min_p_sampling=True, vocab_size=V, device="cpu"))))
    # all greedy -> a scalar 0 temperature, i.e. the argmax-follow path
    info.is_all_greedy = True
    assert sampling_params_from_info(info).temperature == 0.0


@needs_sglang
def test_requests_sharing_their_law_give_scalars_with_the_same_law():
    """Given the batch's requests, a law every request shares comes back as scalars (the verifier's
    short path, no device read for the planner's regime) and equals the per-row tensors' law;
    requests with different laws keep the tensors."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams as SglParams

    from sglang_tev.tree import root_only_tree

    V, bs = 32, 3
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(bs, 2, V, generator=g) * 3

    def batch(params):
        reqs = []
        for t, k, p, m in params:
            s = SglParams(temperature=t, top_k=k, top_p=p, min_p=m)
            s.normalize(None)
            reqs.append(SimpleNamespace(sampling_params=s))
        sp = [r.sampling_params for r in reqs]
        info = SamplingBatchInfo(
            temperatures=torch.tensor([[s.temperature] for s in sp]), top_ps=torch.tensor([s.top_p for s in sp]),
            top_ks=torch.tensor([s.top_k for s in sp], dtype=torch.int32), min_ps=torch.tensor([s.min_p for s in sp]),
            is_all_greedy=all(s.top_k <= 1 for s in sp), is_any_greedy=any(s.top_k <= 1 for s in sp),
            need_top_p_sampling=True, need_top_k_sampling=True, need_min_p_sampling=True, vocab_size=V, device="cpu")
        return info, reqs

    for law in [(0.7, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (1.3, 8, 0.8, 0.1), (0.5, 5, 1.0, 0.2), (0.0, -1, 1.0, 0.0)]:
        info, reqs = batch([law] * bs)
        scalars, rows = sampling_params_from_info(info, reqs), sampling_params_from_info(info)
        assert not any(torch.is_tensor(getattr(scalars, f)) for f in ("temperature", "top_k", "top_p", "min_p")), law
        torch.testing.assert_close(processed_probs(logits, scalars), processed_probs(logits, rows), rtol=1e-6, atol=1e-7)
        if law[0] == 0.7:  # the verifier's short path for a plain step: the same draws
            tree, u = root_only_tree(torch.zeros(bs, dtype=torch.int64)), torch.rand(bs, 2, generator=g, dtype=torch.float64)
            a = verify_tree(tree, logits[:, :1], "tev", scalars, uniforms=u)
            b = verify_tree(tree, logits[:, :1], "tev", rows, uniforms=u)
            assert torch.equal(a.bonus, b.bonus)
    assert sampling_params_from_info(*batch([(0.0, -1, 1.0, 0.0)] * bs)).temperature == 0.0
    mixed_info, mixed = batch([(0.7, -1, 1.0, 0.0), (0.7, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0)])
    got = sampling_params_from_info(mixed_info, mixed)
    assert torch.is_tensor(got.temperature) and torch.is_tensor(got.top_k)
    assert sampling_params_from_info(mixed_info, []).temperature is not None  # no requests: the tensors


@needs_sglang
def test_sglang_logit_adjustments_on_the_tree_layout():
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments

    bs, n, V = 3, 4, 7
    bias = torch.zeros(bs, V)
    bias[0, 2] = 5.0
    bias[2, 6] = -3.0
    info = SamplingBatchInfo(
        temperatures=torch.ones(bs, 1),
        top_ps=torch.ones(bs),
        top_ks=torch.full((bs,), 1 << 30, dtype=torch.int32),
        min_ps=torch.zeros(bs),
        is_all_greedy=False,
        is_any_greedy=False,
        need_top_p_sampling=False,
        need_top_k_sampling=False,
        need_min_p_sampling=False,
        vocab_size=V,
        device="cpu",
        logit_bias=bias,
    )
    logits = torch.randn(bs * n, V)
    adj = logits.clone()
    apply_dflash_verify_logits_adjustments(next_token_logits=adj, sampling_info=info, draft_token_num=n)
    # every node row of request b gets request b's bias
    torch.testing.assert_close(adj.view(bs, n, V), logits.view(bs, n, V) + bias.view(bs, 1, V))


# ---------------------------------------------------------------------- seeded uniforms
def test_seeded_uniforms_reproducible_and_uniform():
    seeds = torch.tensor([42, 42, 7, 123456789])
    seq = torch.tensor([10, 11, 10, 10])
    u = seeded_uniforms(seeds, seq, 2)
    assert u.dtype == torch.float64 and u.shape == (4, 2)
    assert torch.equal(u, seeded_uniforms(seeds, seq, 2))
    assert bool(((u >= 0) & (u < 1)).all())
    assert len(set(u.view(-1).tolist())) == 8  # seed, length and column all matter
    # distribution: 20k draws over lengths pass a KS test and are uncorrelated across columns
    from scipy import stats

    many = seeded_uniforms(torch.full((20000,), 3), torch.arange(20000), 2)
    assert stats.kstest(many[:, 0].numpy(), "uniform").pvalue > 1e-6
    assert stats.kstest(many[:, 1].numpy(), "uniform").pvalue > 1e-6
    assert abs(float(np.corrcoef(many[:, 0].numpy(), many[:, 1].numpy())[0, 1])) < 0.05
    assert math.isclose(float(many.mean()), 0.5, abs_tol=0.01)


# ---------------------------------------------------------------------- the round, composed
def test_rounds_in_sglang_layout_are_greedy_identical_to_plain_decoding():
    """Batched rounds of 4 requests with ragged prompt lengths on the shipped tiny target: tree
    from an oracle drafter -> verify layout (flat FULL mask, positions) -> one target forward per
    request that reads ONLY the flat layout -> verify_batch -> commit_outputs. The committed tokens
    equal plain greedy decoding, and drafts are accepted (mean accept length >= 2)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(
        Path(__file__).resolve().parents[2] / "sglang_tev" / "assets" / "tiny-code" / "target", dtype=torch.float32
    ).eval()
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, vocab, (L,), generator=g).tolist() for L in (5, 9, 3, 12)]
    new_tokens, H, k, budget = 24, 5, 3, 16

    refs = [p + plain_greedy(target, p, new_tokens + 2 * (H + 1)) for p in prompts]
    ctx = [list(p) for p in prompts]
    accepts = []
    while min(len(c) - len(p) for c, p in zip(ctx, prompts)) < new_tokens:
        bs = len(ctx)
        seq = torch.tensor([len(c) - 1 for c in ctx])  # cached tokens; the last token is the root
        roots = torch.tensor([c[-1] for c in ctx])
        # oracle drafter: depth j's list ranks the true greedy token first with probability 0.85
        lq = torch.log(torch.tensor([0.6, 0.25, 0.15])).expand(bs, H, k).clone()  # siblings pop before deep nodes
        ids = torch.randint(5, vocab, (bs, H, k), generator=g)
        for b in range(bs):
            for j in range(H):
                if len(ctx[b]) + j >= len(refs[b]):  # finished requests keep decoding unchecked
                    continue
                truth = refs[b][len(ctx[b]) + j]
                if float(torch.rand((), generator=g)) < 0.85:
                    ids[b, j][ids[b, j] == truth] = (truth + 1) % vocab
                    ids[b, j, 0] = truth  # the best-ranked token (lists are sorted best first)
                else:
                    ids[b, j][ids[b, j] == truth] = (truth + 1) % vocab
                # distinct ids within a row
                while len(set(ids[b, j].tolist())) < k:
                    ids[b, j, 1:] = torch.randint(5, vocab, (k - 1,), generator=g)
        tree = build_trees(lq, ids, budget, roots, max_depth=H)
        lay = tree_verify_layout(tree, seq, int(seq.sum()))
        n = tree.num_nodes
        logits = torch.empty(bs * n, vocab)
        start = 0
        for b in range(bs):
            s = int(seq[b])
            rows = lay.custom_mask[start : start + n * (s + n)].view(n, s + n)  # request b's block
            start += n * (s + n)
            L = s + n
            full = torch.zeros(L, L, dtype=torch.bool)
            full[:s, :s] = torch.ones(s, s, dtype=torch.bool).tril()
            full[s:] = rows
            add = torch.zeros(1, 1, L, L).masked_fill_(~full, torch.finfo(torch.float32).min)
            inp = torch.tensor([ctx[b][:-1] + lay.draft_token[b * n : (b + 1) * n].tolist()])
            pos = torch.cat([torch.arange(s), lay.positions[b * n : (b + 1) * n]]).view(1, L)
            with torch.no_grad():
                logits[b * n : (b + 1) * n] = target(inp, position_ids=pos, attention_mask=add).logits[0, s:]
        assert start == lay.custom_mask.numel()
        out = verify_batch(tree, logits, SamplingParams(temperature=0.0))
        plan = commit_outputs(tree, out, seq)
        for b in range(bs):
            c = int(plan.commit_lens[b])
            ctx[b] += plan.out_tokens[b, :c].tolist()
            assert int(plan.new_seq_lens[b]) == len(ctx[b]) - 1
        accepts += out.accept_len.tolist()
    for b in range(len(ctx)):
        assert ctx[b][: len(prompts[b]) + new_tokens] == refs[b][: len(prompts[b]) + new_tokens]
    assert sum(accepts) / len(accepts) >= 2.0


@pytest.mark.parametrize("budget", [1, 2, 5, 8, 16])
def test_a_budget_b_tree_needs_only_the_top_b_tokens_per_depth(budget):
    """The worker drafts at most ``budget`` tokens per depth under ``auto`` (``_draft_topk``): a
    best-first tree of B nodes holds no token ranked below B at any depth, so building it from the
    top-B lists gives the same tree as from the top-64 (float32 logits, no ties)."""
    g = torch.Generator().manual_seed(budget)
    bs, depth, vocab = 3, 6, 200
    lq = torch.log_softmax(torch.randn(bs, depth, vocab, generator=g) * 1.5, -1)
    roots = torch.randint(0, vocab, (bs,), generator=g)
    wide = build_trees(*lq.topk(64, -1), budget, roots, depth)
    narrow = build_trees(*lq.topk(budget, -1), budget, roots, depth)
    for name in ("parents", "tokens", "valid", "depth"):
        assert torch.equal(getattr(wide, name), getattr(narrow, name)), name
    assert int(wide.valid.sum()) == bs * (budget + 1)  # full trees: the claim is not vacuous
