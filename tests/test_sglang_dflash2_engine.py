"""TEV serving a DFlash2 checkpoint in SGLang 0.5.23's real Engine on this CPU (issue 28 item 3).

The drafter: the shipped tiny-code drafter re-dressed as a DFlash2 checkpoint in z-lab's layout
(``tests/sglang_cpu/dflash2_checkpoint.py``: trained backbone, near-identity grouped conv, random
candidate selector, non-neutral logit transform), exported to a tmp folder; the target: the shipped
tiny-code target. SGLang loads it as its own ``DFlash2DraftModel`` (conv and selector are SGLang's
modules, its compiled ``_grouped_conv`` / ``_score_edges`` included); TEV drafts lattice trees from
the selector (default) or, with ``SGLANG_TEV_DFLASH2_MODE=marginal``, DDTrees from the transformed
marginals (selector ignored: the negative control).

Checked: greedy TEV = HF greedy (bf16, near-tie rule of tests/test_sglang_engine.py) at N = 17 and
N = 65, one batch of prompts; lattice and marginal mode draft different trees on the same first
round (recorded with tests/sglang_cpu/tp_trace.py) and lattice trees branch at most
``selector_top_k`` ways, while their tokens are equal; a refused feature stops the start-up with a
one-line error naming it. One Engine alive at a time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "sglang_cpu"))
from hosts import TARGET, EngineHost, EnginePool, hf_greedy_ids, hf_target, require_sglang, tev_kwargs  # noqa: E402

require_sglang()

import tp_trace  # noqa: E402
from dflash2_checkpoint import DFLASH2_KEYS, write_shipped_as_dflash2  # noqa: E402
from test_sglang_engine import assert_same_ids  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "def read_lines(path):\n    with open(path) as f:",
    "for i in range(10):\n",
    "x",
]
MAX_NEW = [40, 32, 32, 24, 17, 9]


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


@pytest.fixture(scope="module")
def lattice17(hosts, ckpt, prompt_ids, tmp_path_factory):
    """Lattice mode (the default with a selector), N = 17: (ids, accept lengths, first-round trees)."""
    folder = str(tmp_path_factory.mktemp("trace_lattice"))
    eng = hosts.get("lattice17", tev_kwargs(17, speculative_draft_model_path=ckpt), env={tp_trace.ENV: folder})
    ids, acc = _greedy(eng, prompt_ids)
    hosts.close("lattice17")
    return ids, acc, _first_trees(folder, prompt_ids, [o[0] for o in ids])


def test_lattice_greedy_equals_hf_at_n17(lattice17, hf_greedy, prompt_ids, hf_model):
    ids, acc, trees = lattice17
    assert_same_ids(ids, hf_greedy, prompt_ids, hf_model, "TEV DFlash2 lattice N=17")
    assert sum(map(len, acc)) < sum(map(len, ids))  # drafts were accepted: fewer rounds than tokens
    # each node's children are candidates of one transition row: at most selector_top_k of them
    assert len(trees) == len(PROMPTS)
    assert all(_max_children(p) <= DFLASH2_KEYS["selector_top_k"] for p, _ in trees.values())


def test_lattice_greedy_equals_hf_at_n65(hosts, ckpt, prompt_ids, hf_greedy, hf_model):
    eng = hosts.get("lattice65", tev_kwargs(65, speculative_draft_model_path=ckpt))
    ids, acc = _greedy(eng, prompt_ids)
    hosts.close("lattice65")
    assert_same_ids(ids, hf_greedy, prompt_ids, hf_model, "TEV DFlash2 lattice N=65")
    assert sum(map(len, acc)) < sum(map(len, ids))


def test_marginal_mode_is_the_negative_control(hosts, ckpt, prompt_ids, hf_greedy, hf_model, lattice17,
                                               tmp_path_factory):
    """SGLANG_TEV_DFLASH2_MODE=marginal (selector ignored; the transformed full-vocabulary
    marginals into DDTree): the same tokens, other trees on the same first rounds, other accept
    lengths. Its root branches wider than the selector's top-k on some prompt (DDTree's lists are
    B = 16 wide there)."""
    lat_ids, lat_acc, lat_trees = lattice17
    folder = str(tmp_path_factory.mktemp("trace_marginal"))
    eng = hosts.get("marginal17", tev_kwargs(17, speculative_draft_model_path=ckpt),
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
    eng = hosts.get("noselect17", tev_kwargs(17, speculative_draft_model_path=noselect, log_level="info"))
    ids, acc = _greedy(eng, prompt_ids)
    log = Path(eng.log.name).read_text(errors="replace")
    hosts.close("noselect17")
    assert ("TEV DFlash2 drafter: mode=marginal, conv taps=3 (SGLang DFlashGroupedConv), transform x*0.9, "
            "softcap 40 on the full-vocabulary logits") in log
    assert_same_ids(ids, hf_greedy, prompt_ids, hf_model, "TEV DFlash2-style (no selector) N=17")
    assert sum(map(len, acc)) < sum(map(len, ids))
