"""TEV serving a DFlash2 checkpoint in SGLang 0.5.23's real Engine on this CPU (issue 28 item 3).

The drafter: the shipped tiny-code drafter re-dressed as a DFlash2 checkpoint in z-lab's layout
(``sglang_tev/testing/sglang_cpu/dflash2_checkpoint.py``: trained backbone, near-identity grouped conv, random
candidate selector, non-neutral logit transform), exported to a tmp folder; the target: the shipped
tiny-code target. SGLang loads it as its own ``DFlash2DraftModel`` (conv and selector are SGLang's
modules, its compiled ``_grouped_conv`` / ``_score_edges`` included); TEV drafts lattice trees from
the selector (default) or, with ``SGLANG_TEV_DFLASH2_MODE=marginal``, DDTrees from the transformed
marginals (selector ignored: the negative control).

Checked: greedy TEV = HF greedy (bf16, near-tie rule of tests/engine/test_sglang_engine.py) at N = 17 and
N = 65, one batch of prompts; SGLang's TEV and the transformers runtime (the same DFlash2 folder,
``draft_mode="lattice"``, budget N - 1) agree token by token and, wherever both start a round at
the same position, on at least 85 % of those rounds' accept lengths (``assert_rounds_agree``, shared
with the v1 test), at N = 17 and 65; at T = 1 (and T = 1 with top-k 8) the first two tokens of 400
requests on the lattice Engine follow the HF target's exact law (chi-square, ``check_first_two_tokens``);
in a batch mixing greedy and sampled rows the greedy rows still equal HF greedy; lattice and marginal
mode draft different trees on the same first round (recorded with sglang_tev/testing/sglang_cpu/tp_trace.py) and
lattice trees branch at most ``selector_top_k`` ways, while their tokens are equal; a refused feature
stops the start-up with a one-line error naming it. One Engine alive at a time (``_sole``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang_tev.testing.sglang_cpu.hosts import TARGET, EngineHost, EnginePool, hf_greedy_ids, hf_target, require_sglang, tev_kwargs

require_sglang()

from sglang_tev.testing.sglang_cpu import tp_trace
from sglang_tev.testing.sglang_cpu.dflash2_checkpoint import DFLASH2_KEYS, write_shipped_as_dflash2
from engine_checks import assert_rounds_agree, assert_same_ids, check_first_two_tokens

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_lines(path):\n    with open(path) as f:",
    "for i in range(10):\n",
    "x",
]
MAX_NEW = [40, 32, 32, 24, 17, 9]
_LAW_PROMPT_TEXT = "# Parse command-line arguments\nimport argparse\n\nparser = argparse.ArgumentParser("
"""The sampled-law prompt of tests/engine/test_sglang_engine.py (its first-two-token law is spread enough
for a 400-sample chi-square to have power)."""


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_model():
    return hf_target()


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids, hf_model):
    return hf_greedy_ids(hf_model, prompt_ids, MAX_NEW)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_shipped_as_dflash2(tmp_path_factory.mktemp("dflash2") / "draft"))


@pytest.fixture(scope="module")
def hosts():
    h = EnginePool()
    yield h
    h.close_all()


def _greedy(host, prompt_ids):
    res = host.generate(prompt_ids, [{"temperature": 0, "max_new_tokens": n} for n in MAX_NEW])
    return [r["output_ids"] for r in res], [r["meta_info"]["tev_accept_length"] for r in res]


def _first_trees(folder, prompt_ids, first_tokens):
    """{prompt index: (parents, tokens)} of each prompt's FIRST decode round (root = the prompt's
    first output token at position len(prompt)), from the trace of one Engine."""
    want = {(len(p), t): i for i, (p, t) in enumerate(zip(prompt_ids, first_tokens))}
    out = {}
    for rec in tp_trace.read(folder)[0]:
        for b, (s, tok) in enumerate(zip(rec["seq_lens"], rec["tokens"])):
            i = want.get((s, tok[0]))
            if i is not None and i not in out:
                out[i] = (rec["parents"][b], tok)
    return out


def _max_children(parents):
    counts = {}
    for p in parents[1:]:
        if p >= 0:
            counts[p] = counts.get(p, 0) + 1
    return max(counts.values())


def _sole(hosts, name, kwargs, env=None):
    """The Engine ``name``, after closing every other Engine of the module (one alive at a time,
    whatever subset of the tests runs)."""
    for other in list(hosts.hosts):
        if other != name:
            hosts.close(other)
    return hosts.get(name, kwargs, env=env)


@pytest.fixture(scope="module")
def trace17(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trace_lattice"))


def _lattice17(hosts, ckpt, trace17):
    """The lattice-mode Engine at N = 17 (left open for the sampled tests after the greedy one)."""
    return _sole(hosts, "lattice17", tev_kwargs(17, speculative_draft_model_path=ckpt), env={tp_trace.ENV: trace17})


@pytest.fixture(scope="module")
def lattice17(hosts, ckpt, prompt_ids, trace17):
    """Lattice mode (the default with a selector), N = 17: (ids, accept lengths, first-round trees).
    The trace is read right after the greedy batch (one line appended per round, before the round's
    tokens come back), so later requests on this Engine do not enter it."""
    ids, acc = _greedy(_lattice17(hosts, ckpt, trace17), prompt_ids)
    return ids, acc, _first_trees(trace17, prompt_ids, [o[0] for o in ids])


@pytest.fixture(scope="module")
def lattice65(hosts, ckpt, prompt_ids):
    """Lattice mode at N = 65: (ids, accept lengths)."""
    ids, acc = _greedy(_sole(hosts, "lattice65", tev_kwargs(65, speculative_draft_model_path=ckpt)), prompt_ids)
    hosts.close("lattice65")
    return ids, acc


def test_lattice_greedy_equals_hf_at_n17(lattice17, hf_greedy, prompt_ids, hf_model):
    ids, acc, trees = lattice17
    assert_same_ids(ids, hf_greedy, prompt_ids, hf_model, "TEV DFlash2 lattice N=17")
    assert sum(map(len, acc)) < sum(map(len, ids))  # drafts were accepted: fewer rounds than tokens
    # each node's children are candidates of one transition row: at most selector_top_k of them
    assert len(trees) == len(PROMPTS)
    assert all(_max_children(p) <= DFLASH2_KEYS["selector_top_k"] for p, _ in trees.values())


@pytest.mark.parametrize(
    "params", [{"temperature": 1.0}, {"temperature": 1.0, "top_k": 8}], ids=["temperature", "top_k"])
def test_lattice_first_two_sampled_tokens_follow_the_target_law(hosts, ckpt, trace17, lattice17, tokenizer, hf_model,
                                                                 params):
    """T = 1 on the lattice Engine (N = 17): 400 requests (unseeded: this Engine runs without
    deterministic inference) against the exact law of the first two tokens of the HF target
    (tests/engine/test_sglang_engine.py ``check_first_two_tokens``; the second token comes out of TEV's
    first round). TEV is exact whatever tree it verifies, so the selector's lattice, which differs
    from the drafter's marginals, must not move the law. top_k = 8 = the selector's top-k: the
    lattice's children can cover the whole processed law of a node."""
    check_first_two_tokens(_lattice17(hosts, ckpt, trace17), tokenizer(_LAW_PROMPT_TEXT).input_ids, hf_model, params,
                            seeded=False)


def test_lattice_mixed_batch_keeps_greedy_rows_exact(hosts, ckpt, trace17, lattice17, prompt_ids, hf_greedy, hf_model):
    """Each prompt twice in one batch, greedy next to T = 1 / top-k 40: the greedy rows still equal
    HF greedy, and the sampled rows really sampled (they differ from greedy somewhere)."""
    sps, ids = [], []
    for p, n in zip(prompt_ids, MAX_NEW):
        ids += [p, p]
        sps += [{"temperature": 0, "max_new_tokens": n}, {"temperature": 1.0, "top_k": 40, "max_new_tokens": n}]
    out = _lattice17(hosts, ckpt, trace17).generate(ids, sps)
    greedy = [o["output_ids"] for o in out[0::2]]
    assert_same_ids(greedy, hf_greedy, prompt_ids, hf_model, "TEV DFlash2 lattice N=17: greedy rows of a mixed batch")
    assert sum(o["output_ids"] != g for o, g in zip(out[1::2], greedy)) >= len(PROMPTS) // 2
    assert all(len(o["meta_info"]["tev_accept_length"]) >= 1 for o in out[1::2])


def test_lattice_greedy_equals_hf_at_n65(lattice65, prompt_ids, hf_greedy, hf_model):
    ids, acc = lattice65
    assert_same_ids(ids, hf_greedy, prompt_ids, hf_model, "TEV DFlash2 lattice N=65")
    assert sum(map(len, acc)) < sum(map(len, ids))


@pytest.mark.parametrize("tree_size", [17, 65])
def test_runtimes_agree_round_by_round(request, ckpt, prompt_ids, hf_model, tree_size):
    """SGLang's TEV (lattice mode, N = 17 and 65) and the transformers runtime with the same
    DFlash2 folder (``draft_mode="lattice"``, budget N - 1, bf16), same prompts, greedy: the same
    tokens (up to a bf16 near-tie), and wherever both start a round at the same position, the same
    accept length in at least 85 % of those rounds (tests/engine/test_sglang_engine.py
    ``assert_rounds_agree``: the alignment of the two runtimes' round boundaries and why near-ties
    in the drafter's bf16 scores need an allowance). The two codebases compute the conv, the
    selector's edge scores and the lattice tree each on their own: other trees disagree on most
    rounds (SGLang in marginal mode against the runtime in lattice mode, N = 17: 13 of 43 aligned
    rounds agree), and so does a misaligned round start (27 of 51). A wrong budget barely shows:
    this drafter's accepted paths are short (~1.6 tokens a round), and the runtime at budget 8
    agreed with SGLang at N = 17 on 71 of 81 rounds (88 %)."""
    from sglang_tev.hf.runtime import SpeculativeGenerator

    ids, acc = request.getfixturevalue(f"lattice{tree_size}")[:2]
    out = [{"output_ids": o, "meta_info": {"tev_accept_length": a}} for o, a in zip(ids, acc)]
    gen = _hf_generator(ckpt)
    runs = [gen.generate(p, method="tev", budget=tree_size - 1, max_new_tokens=n, draft_mode="lattice")
            for p, n in zip(prompt_ids, MAX_NEW)]
    assert isinstance(gen, SpeculativeGenerator) and gen.has_selector
    assert_same_ids([list(r.token_ids) for r in runs], ids, prompt_ids, hf_model,
                    f"transformers runtime vs SGLang, DFlash2 lattice N={tree_size}")
    assert_rounds_agree(out, runs, prompt_ids, min_same=40)


_HF_GEN = {}


def _hf_generator(ckpt):
    """The transformers runtime with the target and the DFlash2 folder, bf16 (loaded once)."""
    from sglang_tev.hf.runtime import SpeculativeGenerator

    if ckpt not in _HF_GEN:
        _HF_GEN[ckpt] = SpeculativeGenerator.from_pretrained(TARGET, ckpt, dtype=torch.bfloat16)
    return _HF_GEN[ckpt]


def test_marginal_mode_is_the_negative_control(hosts, ckpt, prompt_ids, hf_greedy, hf_model, lattice17,
                                               tmp_path_factory):
    """SGLANG_TEV_DFLASH2_MODE=marginal (selector ignored; the transformed full-vocabulary
    marginals into DDTree): the same tokens, other trees on the same first rounds, other accept
    lengths. Its root branches wider than the selector's top-k on some prompt (DDTree's lists are
    B = 16 wide there)."""
    lat_ids, lat_acc, lat_trees = lattice17
    folder = str(tmp_path_factory.mktemp("trace_marginal"))
    eng = _sole(hosts, "marginal17", tev_kwargs(17, speculative_draft_model_path=ckpt),
                    env={tp_trace.ENV: folder, "SGLANG_TEV_DFLASH2_MODE": "marginal"})
    ids, acc = _greedy(eng, prompt_ids)
    log = Path(eng.log.name).read_text(errors="replace")
    hosts.close("marginal17")
    # not silent: the unused selector is a start-up warning (the test Engines log warnings only)
    assert "TEV DFlash2 drafter: mode=marginal" in log and "selector top_k=8: IGNORED" in log
    assert_same_ids(ids, hf_greedy, prompt_ids, hf_model, "TEV DFlash2 marginal N=17")
    assert_same_ids(ids, lat_ids, prompt_ids, hf_model, "marginal vs lattice")
    trees = _first_trees(folder, prompt_ids, [o[0] for o in ids])
    common = sorted(set(trees) & set(lat_trees))
    assert len(common) >= len(PROMPTS) - 1, (sorted(trees), sorted(lat_trees))
    differ = [i for i in common if trees[i] != lat_trees[i]]
    assert len(differ) >= len(common) // 2, differ
    assert acc != lat_acc


@pytest.fixture(scope="module")
def noselect(tmp_path_factory):
    """A DFlash2-style drafter without a selector: conv + transform, ``architectures``
    ``DFlashDraftModel`` (SGLang builds its conv for any DFlash-family model, and no selector)."""
    return str(write_shipped_as_dflash2(tmp_path_factory.mktemp("noselect") / "draft",
                                        architecture="DFlashDraftModel", selector_rank=None))


def test_refused_feature_stops_the_start_up(noselect):
    """SGLANG_TEV_DFLASH2_MODE=lattice with a drafter that has no selector: refused before any
    model loads, naming the feature."""
    with pytest.raises((EngineHost.Error, RuntimeError), match="SGLANG_TEV_DFLASH2_MODE=lattice needs a DFlash2 "
                                                                "candidate selector"):
        h = EngineHost(tev_kwargs(17, speculative_draft_model_path=noselect),
                       env={"SGLANG_TEV_DFLASH2_MODE": "lattice"}, start_timeout=300)
        h.close()


def test_selectorless_drafter_serves_the_transformed_marginals(hosts, noselect, prompt_ids, hf_greedy, hf_model):
    """The same drafter without the variable: marginal mode with the full-vocabulary transform
    (logged), greedy = HF greedy at N = 17."""
    eng = _sole(hosts, "noselect17", tev_kwargs(17, speculative_draft_model_path=noselect, log_level="info"))
    ids, acc = _greedy(eng, prompt_ids)
    log = Path(eng.log.name).read_text(errors="replace")
    hosts.close("noselect17")
    assert ("TEV DFlash2 drafter: mode=marginal, conv taps=3 (SGLang DFlashGroupedConv), transform x*0.9, "
            "softcap 40 on the full-vocabulary logits") in log
    assert_same_ids(ids, hf_greedy, prompt_ids, hf_model, "TEV DFlash2-style (no selector) N=17")
    assert sum(map(len, acc)) < sum(map(len, ids))
