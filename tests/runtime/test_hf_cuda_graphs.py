"""The transformers runtime's CUDA-graph path on CPU (issue 27 item 4): ``GraphedTreeForward``
(``hf/cuda_graphs.py``) with a CPU stand-in for CUDA graphs
(:class:`~sglang_tev.testing.graph_replay.EmulatedCudaGraphs`) injected through
``SpeculativeGenerator(cuda_graphs=True, graph_backend=...)``.

* The function a CUDA graph captures, the static-shape tree forward (``hf/round.py``
  ``eager_tree_forward``: the HF model over the static KV cache, whole-cache masks, static slot
  buffer), traces into ONE dynamo graph (``fullgraph=True``) with no data-dependent op, with the
  shipped tiny model (Qwen3, transformers 5.19) and a random one: ``EmulatedCudaGraphs(trace=True)``
  does that trace at every capture, then replays the traced graph on the captured tensors, so
  Python state is frozen at capture as in a real graph. Nothing in HF's model code breaks the
  graph here, so no part of it had to be left out.
* Replay emulation: ``generate`` through the graphed path gives exactly the eager tokens (greedy,
  ragged prompts, several rounds per captured shape, and a second call that reuses the cache and
  its graphs); broken variants (inputs not copied into the static buffers, outputs not written in
  place) give other tokens, so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from sglang_tev.hf import cuda_graphs
from sglang_tev.hf.runtime import SpeculativeGenerator
from sglang_tev.testing.drafters import OracleDrafter
from sglang_tev.testing.graph_replay import EmulatedCudaGraphs, EmulatedGraph
from sglang_tev.testing.models import RAGGED, V, plain_greedy, qwen3

MAXES = [30, 20, 40, 25]


@pytest.fixture(scope="module")
def target():
    return qwen3(0)


@pytest.fixture(scope="module")
def refs(target):
    return [plain_greedy(target, p, m) for p, m in zip(RAGGED, MAXES)]


def graphed(target, trace=True):
    emu = EmulatedCudaGraphs(trace=trace)
    gen = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.85, block_size=8, seed=1), cuda_graphs=True,
                               graph_backend=emu)
    return gen, emu


def run(gen, n=4, bs=3):
    res = gen.generate(RAGGED[:n], budget=16, max_new_tokens=MAXES[:n], ignore_eos=True, batch_size=bs)
    return [r.token_ids for r in res], res


def test_graphed_generate_equals_eager_and_reuses_graphs(target, refs, monkeypatch):
    """Four ragged prompts, three slots (a slot refilled, then the batch shrinks): every tree forward
    is a replay of a traced capture, the tokens are plain greedy decoding's (= the eager runtime's),
    each captured (rows, N) is replayed over several rounds, and a second call reuses the cache and
    its graphs (no new capture for a shape already seen)."""
    calls = []
    call = cuda_graphs.GraphedTreeForward.__call__
    monkeypatch.setattr(cuda_graphs.GraphedTreeForward, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    gen, emu = graphed(target)
    toks, res = run(gen)
    assert toks == refs
    assert sum(x.accept_len for r in res for x in r.rounds) / sum(len(r.rounds) for r in res) >= 2
    stats = dict(gen.graph_stats)
    assert stats["fallbacks"] == 0 and stats["captures"] == len(emu.graphs) >= 2
    assert all(g.graph_module is not None for g in emu.graphs)  # traced: one FX graph per shape
    shapes = list(gen._buffers.graphs.graphs)
    assert (3, 17) in shapes and max(g.replays for g in emu.graphs) >= 4
    assert sum(g.replays for g in emu.graphs) == len(calls) >= 6  # every round's tree forward was a replay
    before = {k: v[0].replays for k, v in gen._buffers.graphs.graphs.items()}
    toks2, _ = run(gen, n=3)
    assert toks2 == refs[:3]
    after = gen._buffers.graphs.graphs
    assert after[(3, 17)][0].replays > before[(3, 17)]  # the first call's graph replayed again
    assert gen.graph_stats["captures"] == len(after)
    static = SpeculativeGenerator(target, OracleDrafter(target, V, accuracy=0.85, block_size=8, seed=1), static_shapes=True)
    assert run(static)[0] == refs  # the eager static-shape runtime gives the same tokens


def test_untraced_replay_equals_eager(target, refs):
    """The cheaper stand-in (a replay calls the forward again on the static buffers) agrees too."""
    gen, emu = graphed(target, trace=False)
    assert run(gen)[0] == refs
    assert all(g.graph_module is None and g.replays >= 1 for g in emu.graphs)


def _call_without_input_copies(self, tokens, positions, masks):
    """GraphedTreeForward.__call__ with the copies into the static buffers left out."""
    key = tuple(tokens.shape)
    if key not in self.graphs:
        self._capture(key, tokens, positions, masks)
    graph, s_tok, s_pos, s_masks, out = self.graphs[key]
    self.backend.replay(graph)
    return out


def _replay_without_output_writes(self):
    self._run()  # the outputs are computed but the captured tensors keep the capture's values
    self.replays += 1


@pytest.mark.parametrize("broken", ["inputs not copied", "outputs not written in place"])
def test_a_broken_graph_path_gives_other_tokens(target, refs, monkeypatch, broken):
    """The equality above can fail: a replay that reads stale static inputs, or returns stale
    outputs, changes the decoded tokens."""
    if broken == "inputs not copied":
        monkeypatch.setattr(cuda_graphs.GraphedTreeForward, "__call__", _call_without_input_copies)
    else:
        monkeypatch.setattr(EmulatedGraph, "replay", _replay_without_output_writes)
    gen, _ = graphed(target, trace=False)
    assert run(gen)[0] != refs


def test_capture_failure_falls_back_to_eager_and_data_dependent_ops_are_refused(target, refs, monkeypatch, caplog):
    """A forward with a host sync inside (``.item()``, which torch 2.14's dynamo traces without a
    graph break) cannot be captured: the traced stand-in refuses it as CUDA capture would, the
    runtime logs the failure and runs that shape eagerly, with the same tokens."""
    from sglang_tev.hf import round as hf_round

    eager = hf_round.eager_tree_forward

    def syncing(state, tokens, positions, masks):
        logits, feats = eager(state, tokens, positions, masks)
        return logits + 0 * logits.max().item(), feats

    monkeypatch.setattr(hf_round, "eager_tree_forward", syncing)
    from sglang_tev.hf import scheduler

    monkeypatch.setattr(scheduler, "eager_tree_forward", syncing)
    gen, emu = graphed(target)
    with caplog.at_level("WARNING", logger="sglang_tev"):
        assert run(gen, n=2, bs=2)[0] == refs[:2]
    stats = gen.graph_stats
    assert stats["captures"] == 0 and stats["fallbacks"] >= 1 and emu.graphs == []
    assert "data-dependent" in caplog.text and "running eagerly" in caplog.text


def test_graph_backend_needs_cuda_graphs(target):
    with pytest.raises(ValueError, match="graph_backend"):
        SpeculativeGenerator(target, graph_backend=EmulatedCudaGraphs())
    with pytest.raises(ValueError, match="cuda_graphs"):
        SpeculativeGenerator(target, cuda_graphs=True)  # a CPU target without a stand-in


def test_shipped_model_tree_forward_captures_in_one_graph():
    """The shipped tiny pair (Qwen3 target, 6 layers, its DFlash drafter: the forward also returns
    the drafter's context features): the tree forward traces into one graph without data-dependent
    ops (``EmulatedCudaGraphs(trace=True)`` raises otherwise and the run would fall back), and the
    replayed graph gives the eager static-shape tokens. One prompt: one captured shape."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    emu = EmulatedCudaGraphs(trace=True)
    gen = SpeculativeGenerator.from_pretrained(cuda_graphs=True, graph_backend=emu)
    out = gen.generate(prompt, budget=8, max_new_tokens=24, ignore_eos=True)
    assert gen.graph_stats["captures"] == 1 and gen.graph_stats["fallbacks"] == 0
    (graph,) = emu.graphs
    assert graph.replays == len(out.rounds) >= 3
    assert isinstance(graph.out[1], torch.Tensor)  # the context features are a graph output too
    eager = SpeculativeGenerator(gen.target, gen.drafter, gen.tokenizer, static_shapes=True)  # the same drafter
    assert eager.generate(prompt, budget=8, max_new_tokens=24, ignore_eos=True).token_ids == out.token_ids


def test_context_kept_over_plain_rounds_survives_the_next_replays(monkeypatch):
    """``budget="auto"`` keeps the drafter's context of plain rounds for the next draft, and a
    graph's outputs (the context features among them) are overwritten by its next replay: the
    graphed runtime hands the drafter copies, so its drafts, and so its accept lengths, are the
    eager static-shape runtime's over a script of tree rounds with plain stretches between them
    (without the copies the kept context is the last plain round's, repeated)."""
    from sglang_tev.autobudget import BudgetController

    script = [8, 0, 0, 0, 8, 0, 0, 8, 8, 0, 0, 0, 0, 8] * 3

    def scripted(self, batch):
        return self._log(batch, script[len(self.history) % len(script)])

    monkeypatch.setattr(BudgetController, "choose", scripted)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    gen = SpeculativeGenerator.from_pretrained(cuda_graphs=True, graph_backend=EmulatedCudaGraphs(trace=False))
    eager = SpeculativeGenerator(gen.target, gen.drafter, gen.tokenizer, static_shapes=True)
    runs = [g.generate(prompt, budget="auto", max_new_tokens=60, ignore_eos=True) for g in (gen, eager)]
    assert gen.graph_stats["captures"] == 2 and gen.graph_stats["fallbacks"] == 0  # (1, 9) and (1, 1)
    assert [r.budget for r in runs[0].rounds] == [r.budget for r in runs[1].rounds]
    assert [r.accept_len for r in runs[0].rounds] == [r.accept_len for r in runs[1].rounds]
    assert runs[0].token_ids == runs[1].token_ids
    assert sum(r.accept_len for r in runs[0].rounds if r.budget) >= 10  # the drafts are accepted
