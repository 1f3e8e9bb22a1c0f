"""The transformers runtime's round makes one host sync (DESIGN §5): counted on CPU with
``HostSyncCounter`` on the round's GPU code path (``gpu_code_paths``), the shipped tiny pair.

Per generate call there is set-up (validating the sampling parameters, the first round's draft
checks, the cache's slot tables); per round there must be exactly the one read of the verify
decision (``VerifyOutput.host``) and nothing else: the round's index lists go to the device as
pinned non-blocking copies (``hf/transfer.py``), never as ``torch.tensor(list, device=...)``,
which copies from pageable memory and waits for the stream.
"""

from __future__ import annotations

import pytest
import torch

from sglang_tev.sampling import SamplingParams
from sglang_tev.testing.host_sync import HostSyncCounter, gpu_code_paths

DECISION = "sglang_tev/verify/output.py"


@pytest.fixture(scope="module")
def gen():
    from sglang_tev.hf.runtime import SpeculativeGenerator

    return SpeculativeGenerator.from_pretrained()


PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, logit_bias={7: -2.0, 11: 1.5})


@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_one_host_sync_per_round(gen, temperature, penalties):
    """Also with repetition / frequency / presence penalties and a logit bias on: their per-round
    parameter rows go to the device as the index lists do (``hf/transfer.py``)."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    with gpu_code_paths(), HostSyncCounter(include=("sglang_tev/",)) as c:
        results = gen.generate(prompts, method="tev", budget=16, max_new_tokens=[40, 24, 32],
                               sampling=SamplingParams(temperature=temperature), seed=3, **(PENALTIES if penalties else {}))
    per_row = [len(r.rounds) for r in results]
    sites = c.by_site()
    decision = sum(n for (file, _, op), n in sites.items() if file.endswith(DECISION))
    # one decision read per batched round: at least the longest row's rounds, at most all rows'
    assert max(per_row) >= 8 and max(per_row) <= decision <= sum(per_row), (per_row, c.format())
    # everything else is per call (a handful each), never per round
    others = {k: n for k, n in sites.items() if not k[0].endswith(DECISION)}
    assert all(n <= 4 for n in others.values()), others


def test_the_counter_sees_a_per_round_copy(gen, monkeypatch):
    """Negative control: the round's index lists copied the blocking way show up once per round."""
    from sglang_tev.hf import round as hf_round

    monkeypatch.setattr(hf_round, "to_device", lambda data, dtype, device: torch.tensor(data, dtype=dtype, device=device))
    with gpu_code_paths(), HostSyncCounter(include=("sglang_tev/", "test_hf_host_syncs.py")) as c:
        result = gen.generate("def fibonacci(n):", method="tev", budget=16, max_new_tokens=40)
    copies = [n for (file, _, op), n in c.by_site().items() if file.endswith("test_hf_host_syncs.py") and op.startswith("to_device")]
    assert copies and max(copies) >= len(result.rounds) >= 8, c.format()
