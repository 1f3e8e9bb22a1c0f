"""SGLang 0.5.23's real Engine and HTTP server on a CPU without sgl-kernel's CPU build: stand-ins
for the few sgl_kernel ops and CUDA-only calls SGLang reaches (:mod:`.harness`), loaded in every
SGLang process by ``pythonpath/sitecustomize.py``; Engine and server hosts in child processes
(:mod:`.hosts`); a host-sync probe and a TP round trace for tests (:mod:`.sync_probe`,
:mod:`.tp_trace`); a DFlash2 checkpoint builder (:mod:`.dflash2_checkpoint`); the prompts the
Engine tests and benchmarks share (:func:`engine_prompts`).

For trying and testing, not for speed: the stand-ins are plain torch. Nothing here is imported by
the package itself. Submodules import torch; this one does not.
"""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parent / "engine_prompts.json"


def engine_prompts() -> list[str]:
    """The prompts of the Engine tests (``engine_prompts.json``): short Python heads, one a single
    character, for the shipped tiny-code pair."""
    with open(PROMPTS_FILE, encoding="utf-8") as f:
        return json.load(f)["prompts"]
