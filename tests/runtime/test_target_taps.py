"""The drafter's context features read by hooks on a few target layers (``TargetModel.forward``,
``LayerTaps``) are HF's ``output_hidden_states`` features exactly, and the hooks stay out of the
way: off outside a forward that asks, shared by every wrapper over one module, per thread."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from sglang_tev.hf.target import LayerTaps, TargetModel
from sglang_tev.testing.models import RAGGED, V, dflash_for, plain_greedy, qwen3


def _llama(seed=0, layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    from sglang_tev.testing.models import randomize

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
    return randomize(LlamaForCausalLM(cfg), seed)


def _hf_features(module, ids, layer_ids):
    with torch.no_grad():
        hs = module(ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


def _forward(tm, ids, layer_ids):
    pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        return tm.forward(ids, pos, None, None, layer_ids)


@pytest.mark.parametrize("make,layer_ids", [(lambda: qwen3(layers=4), [0, 2]), (lambda: qwen3(layers=4), [2, 0, 2]),
                                            (lambda: _llama(layers=4), [1, 2])])
def test_tapped_features_equal_output_hidden_states(make, layer_ids):
    module = make()
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    tm = TargetModel(module)
    out, feats = _forward(tm, ids, layer_ids)
    assert isinstance(tm._taps[tuple(layer_ids)], LayerTaps)  # the hooks ran, not the fallback
    assert out.hidden_states is None
    assert torch.equal(feats, _hf_features(module, ids, layer_ids))
    assert torch.equal(out.logits, module(ids).logits)


def test_last_layer_falls_back_to_output_hidden_states():
    # HF gives the final-normed output as the last layer's hidden state: hooks would not
    module = qwen3(layers=3)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1))
    tm = TargetModel(module)
    _, feats = _forward(tm, ids, [0, 2])
    assert tm._taps[(0, 2)] is None
    assert torch.equal(feats, _hf_features(module, ids, [0, 2]))
    with pytest.raises(IndexError):
        _forward(TargetModel(module), ids, [3])  # past the layers: as before, an error


def test_no_features_asked_no_features_kept():
    module = qwen3(layers=4)
    ids = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(2))
    tm = TargetModel(module)
    _forward(tm, ids, [0, 1])
    taps = tm._taps[(0, 1)]
    out, feats = _forward(tm, ids, None)
    assert feats is None and out.hidden_states is None
    with torch.no_grad():
        module(ids)  # the user's own call: the hooks keep nothing
    assert getattr(taps._state, "got", None) is None


def test_one_set_of_hooks_per_module_and_layers():
    module = qwen3(layers=4)
    ids = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(3))
    hooks = lambda: sum(len(m._forward_hooks) for m in module.modules())  # noqa: E731
    _forward(TargetModel(module), ids, [0, 1])
    n = hooks()
    assert n == 2
    _forward(TargetModel(module), ids, [0, 1])  # a second generator over the same model
    assert hooks() == n
    module.model.layers[1] = copy.deepcopy(module.model.layers[1])  # a layer swapped by the user
    module.model.layers[1]._forward_hooks.clear()
    _, feats = _forward(TargetModel(module), ids, [0, 1])
    assert torch.equal(feats, _hf_features(module, ids, [0, 1]))
    twin = copy.deepcopy(module)  # a deep copy reads its own layers
    _, feats = _forward(TargetModel(twin), ids, [0, 1])
    assert torch.equal(feats, _hf_features(module, ids, [0, 1]))


def test_taps_are_per_thread():
    module = qwen3(layers=4)
    tm = TargetModel(module)
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(4))
    _forward(tm, ids, [0, 1])
    taps = tm._taps[(0, 1)]
    seen = {}
    with taps:  # this thread is inside a forward that asks; another thread's forward must not write here
        t = threading.Thread(target=lambda: seen.update(ok=torch.equal(_forward(tm, ids[:, :3], [0, 1])[1],
                                                                       _hf_features(module, ids[:, :3], [0, 1]))))
        t.start()
        t.join()
        assert taps._state.got == {}
    assert seen["ok"]


def test_greedy_through_the_tapped_layers_is_plain_decoding():
    from sglang_tev.hf.drafters import DFlashDrafter
    from sglang_tev.hf.runtime import SpeculativeGenerator
    from sglang_tev.sampling import SamplingParams

    target = qwen3(layers=4)
    dm = dflash_for(target, dflash_config=dict(mask_token_id=V - 1, target_layer_ids=[0, 2]))
    gen = SpeculativeGenerator(target, DFlashDrafter(dm, target))
    greedy = SamplingParams(temperature=0.0)
    for prompt in RAGGED[:2]:
        for budget in (8, "auto"):
            out = gen.generate(prompt, sampling=greedy, max_new_tokens=24, budget=budget)
            assert out.token_ids == plain_greedy(target, prompt, 24)
    assert isinstance(gen._target._taps[(0, 2)], LayerTaps)
    outs = gen.generate(RAGGED, sampling=greedy, max_new_tokens=16, budget=8)  # a batch: rows of other lengths
    assert [o.token_ids for o in outs] == [plain_greedy(target, p, 16) for p in RAGGED]
