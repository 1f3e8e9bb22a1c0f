"""A DFlash2 checkpoint exported by sglang_tev against SGLang 0.5.23's DFlash2 pieces, without an
Engine: ``parse_dflash_draft_config`` reads our config.json, SGLang's ``DFlashGroupedConv`` and
``CandidateSelector`` load our stored tensors strictly, and the uncompiled bodies of its
``_grouped_conv`` (blocks flattened, ``position % block_size``), ``_score_edges``,
``DFlash2DraftModel._transform_unary_logits`` (top-K values only) and ``sample_path`` (CPU walk)
give our conv, lattice scores and walk. Separate from tests/runtime/test_dflash2.py: importing SGLang's
model module takes ~20 s on a loaded CPU.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from sglang_tev.testing.sglang_cpu.required import require_sglang

require_sglang()

import sglang.srt.models.dflash as sg  # noqa: E402
from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config  # noqa: E402

from sglang_tev.draft.dflash2 import SelectorLattice, grouped_causal_conv, selector_walk  # noqa: E402
from dflash2_helpers import DFLASH2, GROUP, H, K, MASK, RANK, TAPS, TOL, TOPK, V, _ours  # noqa: E402


def _orig(fn):
    """The Python body of a torch.compile'd SGLang function (no inductor build on CPU)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = _ours(seed=5)
    path = tmp_path_factory.mktemp("d2sg") / "draft"
    model.save_pretrained(path)
    return model, json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def test_sglang_parses_our_config(exported):
    _, cfg, _ = exported
    parsed = parse_dflash_draft_config(draft_hf_config=cfg)
    assert (parsed.conv_kernel_size, parsed.conv_group_size) == (TAPS, GROUP)
    assert (parsed.selector_rank, parsed.selector_top_k) == (RANK, TOPK)
    assert parsed.output_multiplier == DFLASH2["output_multiplier"]
    assert parsed.final_logit_softcapping == DFLASH2["final_logit_softcapping"]
    assert parsed.block_size == K and parsed.mask_token_id == MASK
    assert cfg["architectures"] == ["DFlash2DraftModel"]


def test_sglang_modules_load_our_tensors_strictly(exported):
    model, _, stored = exported
    sel = sg.CandidateSelector(hidden_size=H, vocab_size=V, state_rank=RANK, top_k=TOPK)
    prefix = "candidate_selector."
    sel.load_state_dict({k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}, strict=True)
    assert torch.equal(sel.predecessor_codebook, model.candidate_selector.predecessor_codebook)
    for i in range(len(model.layers)):
        for side in ("attention_conv", "mlp_conv"):
            conv = sg.DFlashGroupedConv(H, K, TAPS, GROUP)
            prefix = f"layers.{i}.{side}."
            conv.load_state_dict({k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)},
                                 strict=True)
            assert torch.equal(conv.base_kernel, getattr(model.layers[i], side).base_kernel)


def test_conv_equals_sglangs_flattened_block_conv(exported):
    model, _, _ = exported
    conv = model.layers[0].attention_conv
    g = torch.Generator().manual_seed(0)
    b = 3
    x = torch.randn(b, K, H, generator=g)
    with torch.no_grad():
        delta = conv.kernel_projection(x).view(b, K, 2, TAPS, H // GROUP)
        for side in (0, 1):
            ours = grouped_causal_conv(x, conv.base_kernel[side], delta[:, :, side], GROUP)
            # SGLang: all requests' blocks flattened to [b*K, H], restarted by position % block_size
            theirs = _orig(sg._grouped_conv)(x.reshape(b * K, H), delta[:, :, side].reshape(b * K, TAPS, -1),
                                             conv.base_kernel[side], K, H // GROUP, GROUP, TAPS)
            torch.testing.assert_close(ours, theirs.view(b, K, H), **TOL)


def test_scores_transform_and_walk_equal_sglangs(exported, monkeypatch):
    model, cfg, _ = exported
    g = torch.Generator().manual_seed(1)
    b, D = 4, K - 1
    hidden = torch.randn(b, D, H, generator=g)
    raw = 3 * torch.randn(b, D, V, generator=g)
    anchor = torch.randint(0, V, (b,), generator=g)
    with torch.no_grad():
        lat = model.candidate_selector.lattice(hidden, model.transform_logits(raw), anchor)
        # SGLang transforms the top-K raw values only: the same candidates and values (monotone)
        vals, ids = torch.topk(raw, TOPK, dim=-1)
        unary = sg.DFlash2DraftModel._transform_unary_logits(
            SimpleNamespace(draft_config=parse_dflash_draft_config(draft_hf_config=cfg)), vals)
        assert torch.equal(ids, lat.candidate_ids)
        sel = model.candidate_selector
        scores = _orig(sg._score_edges)(predecessor_table=sel.predecessor_codebook, successor_table=sel.successor_codebook,
                                        candidate_ids=ids, unary_logits=unary, hidden=sel.hidden_projection(hidden),
                                        anchor_token_ids=anchor, top_k=TOPK)
    torch.testing.assert_close(lat.scores, scores, **TOL)
    # SGLang's CPU walk (its compiled _follow_maps swapped for its body), greedy and sampled rows
    monkeypatch.setattr(sg, "_follow_maps", _orig(sg._follow_maps))
    sg_sel = sg.CandidateSelector(hidden_size=H, vocab_size=V, state_rank=RANK, top_k=TOPK)
    u = torch.rand(b, D, generator=g, dtype=torch.float64)
    greedy = torch.tensor([True, False, True, False])
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3])
    tokens, q = sg_sel.sample_path(candidate_ids=lat.candidate_ids, scores=lat.scores, uniforms=u.float(),
                                   temperatures=temps, greedy_mask=greedy)
    for row in range(b):
        one = SelectorLattice(*(t[row:row + 1] for t in (lat.candidate_ids, lat.unary_logq, lat.scores,
                                                         lat.transition_logq)))
        t_ours, _, q_ours = selector_walk(one, 0.0 if greedy[row] else float(temps[row]), uniforms=u[row:row + 1])
        assert torch.equal(t_ours[0], tokens[row]), row
        torch.testing.assert_close(q_ours[0], q[row], **TOL)
