"""StaticDFlashDrafter's deferred context: the fused [context ; block] projection in draft_rows
gives the draft logits and context K/V of an eager add_context + block-only forward and of the
one-sequence DFlashDraftModel.draft_logits; a pending context is written before anything reads
or moves the buffers."""

from __future__ import annotations

import pytest
import torch
from sglang_tev.testing.models import dflash_for, qwen3

from sglang_tev.hf.dflash_runner import StaticDFlashDrafter
from runtime_helpers import SIM_BLOCK, SIM_TOL, Sim

K, TOL = SIM_BLOCK, SIM_TOL


@pytest.fixture(scope="module")
def pair():
    target = qwen3(0)
    return target, dflash_for(target, seed=2, block_size=K, num_hidden_layers=2)


def test_fused_single_row_equals_eager_and_reference(pair):
    sim = Sim(pair, [9])
    for acc in [0, 3, K - 1, 1, 2]:
        sim.draft()
        sim.commit([acc])
        assert sim.fused._pending is not None  # deferred: a path is at most K wide
    sim.draft()
    sim.check_kv(sim.fused)


def test_fused_ragged_rows_with_move_row_between(pair):
    sim = Sim(pair, [5, 13, 8], seed=1)
    sim.draft()
    for accepted in [[0, 4, 2], [K - 1, 0, 1], [2, 2, 0]]:
        sim.commit(accepted)
        sim.draft()
    sim.commit([1, 3, 0])
    sim.retire(0)  # move_row flushes the pending context before moving row 2's K/V into slot 0
    assert sim.fused._pending is None
    sim.draft()
    sim.commit([4, 1])
    sim.draft()
    sim.check_kv(sim.fused)
    sim.check_kv(sim.eager)


def test_context_for_other_rows_is_written_before_the_draft(pair):
    """A refilled slot: add_context for rows 1:2 only, then draft_rows over 0:2."""
    sim = Sim(pair, [7, 4], seed=2)
    sim.draft()
    sim.commit([2, 1])
    sim.draft()
    new = sim.feats(3)
    sim.hist[1] = torch.cat([sim.hist[1], new])
    pos = torch.tensor([[len(sim.hist[1]) - 3 + i for i in range(3)]])
    sim.add(slice(1, 2), new[None], pos)
    assert sim.fused._pending is not None
    sim.draft()
    sim.check_kv(sim.fused)


def test_pending_context_flushed_by_context_kv_and_move_row(pair):
    target, dm = pair
    d = StaticDFlashDrafter(dm, target)
    d.start(2, 40, "cpu")
    feats = torch.randn(1, 4, dm.fc.in_features, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = dm._project_context(feats, torch.arange(4), 1)
    d.add_context(slice(0, 1), feats, torch.arange(4)[None])
    assert d._pending is not None
    k, v = d.context_kv(0, 4, 1)  # flushes
    assert d._pending is None
    torch.testing.assert_close(k, want[1][0], **TOL)
    torch.testing.assert_close(v, want[1][1], **TOL)
    d.start(2, 40, "cpu")  # same shape: the buffers are kept
    for buf in (*d.keys, *d.values):
        buf.zero_()
    d.add_context(slice(0, 1), feats, torch.arange(4)[None])
    d.move_row(0, 1, 4)
    for layer in range(len(dm.layers)):
        torch.testing.assert_close(d.keys[layer][1:2, :, :4], want[layer][0], **TOL)
        torch.testing.assert_close(d.values[layer][1:2, :, :4], want[layer][1], **TOL)
    # a second add_context writes the first; a new call (start) drops a pending one: its rows are done
    d.add_context(slice(1, 2), feats, torch.arange(4)[None] + 4)
    d.add_context(slice(0, 1), feats, torch.arange(4)[None] + 4)
    assert d._pending[0] == slice(0, 1)
    shifted = _shifted(dm, feats, 4)
    torch.testing.assert_close(d.keys[0][1:2, :, 4:8], shifted[0][0], **TOL)
    before = d.keys[0][0:1, :, 4:8].clone()
    d.start(2, 40, "cpu")
    assert d._pending is None
    torch.testing.assert_close(d.keys[0][0:1, :, 4:8], before, **TOL)


def _shifted(dm, feats, start):
    with torch.inference_mode():
        return dm._project_context(feats, torch.arange(feats.shape[1]) + start, 1)


def test_fused_draft_writes_the_context(pair):
    """Fails if draft_rows used the deferred context for its logits but never stored its K/V."""
    target, dm = pair
    d = StaticDFlashDrafter(dm, target)
    d.start(1, 40, "cpu")
    g = torch.Generator().manual_seed(7)
    hist = torch.randn(1, 10, dm.fc.in_features, generator=g)
    d.add_context(slice(0, 1), hist[:, :7], torch.arange(7)[None])  # a prefill: written at once
    assert d._pending is None
    d.add_context(slice(0, 1), hist[:, 7:], torch.arange(7, 10)[None])
    assert d._pending is not None
    d.draft_rows(slice(0, 1), torch.tensor([3]), torch.tensor([10]), None, K - 1, 10)
    assert d._pending is None
    with torch.inference_mode():
        want = dm._project_context(hist, torch.arange(10), 1)
    for layer in range(len(dm.layers)):
        torch.testing.assert_close(d.keys[layer][:, :, :10], want[layer][0], **TOL)
        torch.testing.assert_close(d.values[layer][:, :, :10], want[layer][1], **TOL)


@pytest.mark.parametrize("dflash2", [False, True])
def test_slots_are_the_first_depths_of_the_full_draft(dflash2):
    """``slots=S`` returns the first S depths of the full draft (the block stays whole: the head
    and the last layer's queries skip the rest), marginal and lattice; bad ``slots`` are refused
    before anything is written."""
    from sglang_tev.testing.models import dflash_for, qwen3

    target = qwen3(0)
    if dflash2:
        from test_dflash2 import _runtime_dflash2

        dm = _runtime_dflash2(target)
    else:
        dm = dflash_for(target, seed=2, block_size=K, num_hidden_layers=2)
    k = dm.block_size
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(2, 9, dm.fc.in_features, generator=g)
    roots, root_pos = torch.tensor([4, 7]), torch.tensor([9, 6])
    outs = {}
    for s in (None, 1, 3, k - 1):
        d = StaticDFlashDrafter(dm, target)
        d.start(2, 40, "cpu")
        d.add_context(slice(0, 2), feats, torch.arange(9).expand(2, 9))
        outs[s] = d.draft_rows(slice(0, 2), roots, root_pos, None, k - 1, 9, slots=s)
        if dflash2 and s is not None:
            d.add_context(slice(0, 2), feats[:, :2], torch.tensor([[9, 10], [6, 7]]))
            lat = d.draft_lattice_rows(slice(0, 2), roots, root_pos, None, k - 1, 9, slots=s)
            assert lat.candidate_ids.shape == (2, s, dm.config.selector_top_k)
    full = outs[None]
    assert full.shape[1] == k - 1
    for s in (1, 3, k - 1):
        assert outs[s].shape == (2, s, full.shape[2])
        torch.testing.assert_close(outs[s], full[:, :s], **TOL)
    d = StaticDFlashDrafter(dm, target)
    with pytest.raises(RuntimeError, match="start"):  # no buffers yet
        d.draft_rows(slice(0, 2), roots, root_pos, None, k - 1, 9)
    d.start(2, 40, "cpu")
    for bad in (0, k, 2.5, True):
        with pytest.raises(ValueError, match="slots"):
            d.draft_rows(slice(0, 2), roots, root_pos, None, k - 1, 9, slots=bad)
    for bad in (0, k, -1):  # a block longer than the drafter's, or empty
        with pytest.raises(ValueError, match="depth"):
            d.draft_rows(slice(0, 2), roots, root_pos, None, bad, 9)


def test_fused_weights_follow_a_change_between_calls(pair):
    """The block forward's fused weights are rebuilt by start() when a parameter changed in place
    (a training step between evaluations): the draft then equals the model's own with the new
    weights, not the old fused copy."""
    target, dm = pair
    dm = __import__("copy").deepcopy(dm)
    g = torch.Generator().manual_seed(9)
    feats = torch.randn(1, 7, dm.fc.in_features, generator=g)
    roots, root_pos = torch.tensor([5]), torch.tensor([7])
    d = StaticDFlashDrafter(dm, target)
    outs = []
    for step in range(2):
        if step:
            with torch.no_grad():
                dm.layers[0].self_attn.q_proj.weight.mul_(-1.5)
                dm.layers[1].mlp.up_proj.weight.add_(0.05)
        d.start(1, 32, "cpu")
        d.add_context(slice(0, 1), feats, torch.arange(7)[None])
        outs.append(d.draft_rows(slice(0, 1), roots, root_pos, None, K - 1, 7))
        with torch.inference_mode():
            want = dm.draft_logits(target.get_input_embeddings(), target.get_output_embeddings(), roots, 7, feats,
                                   dm.new_cache(), block_size=K)
        torch.testing.assert_close(outs[-1], want, **TOL)
    assert (outs[0] - outs[1]).abs().max() > 1e-2
