"""The records of a generation call: what it takes per prompt (:class:`Request`), what it keeps
per request while decoding (:class:`Row`), and what it returns (:class:`GenerationResult` with one
:class:`RoundStats` per round)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..sampling import SamplingParams
from .controls import Controls

__all__ = ["STAGES", "RoundStats", "GenerationResult", "Request", "Row"]

STAGES = ("draft", "build", "tree_forward", "verify", "commit")
"""The stages of a round (``hf/round.py``), the keys of :attr:`RoundStats.stage_ms`."""


@dataclass
class RoundStats:
    """One decoding round of one row.

    Attributes:
        accept_len: accepted draft tokens that were emitted (a block cut by a stop or by
            max_new_tokens counts only the drafted tokens it kept).
        emitted: tokens this round added to the output (accept_len + 1 unless cut).
        coverage: target coverage C_p of the round's tree (E[accept_len] it allowed; paper Eq. 6).
        tree_nodes: valid nodes of the tree, root included.
        stage_ms: wall milliseconds per stage of the (batched) round.
        verified_accept_len: accepted draft tokens before any cut (the verifier's accept length).
        batch_rows: rows in the round's batch.
        budget: the round's budget B (with ``budget="auto"`` the one chosen for it; 0 = a plain
            decoding round, no draft), None for ``chain`` / ``autoregressive``.
    """

    accept_len: int
    emitted: int
    coverage: float
    tree_nodes: int
    stage_ms: dict[str, float]
    verified_accept_len: int = -1
    batch_rows: int = 1
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.verified_accept_len < 0:
            self.verified_accept_len = self.accept_len


@dataclass
class GenerationResult:
    """Output of :meth:`SpeculativeGenerator.generate` for one prompt.

    Attributes:
        token_ids: the new tokens (prompt excluded).
        text: ``tokenizer.decode(token_ids, skip_special_tokens=True)`` (EOS and other special
            tokens not shown, as HF and vLLM print them) when a tokenizer is known, else None.
        prompt_len: prompt tokens.
        finish_reason: ``"stop"`` (stop token or string), ``"length"`` (max_new_tokens) or
            ``"position_limit"`` (the model's max positions).
        rounds: per-round statistics.
        prefill_s: seconds spent on this prompt's prefill.
        decode_s: seconds from the end of its prefill to its last round (shared with the other rows
            of a batch).
        unknown_token_ids: emitted ids the tokenizer cannot decode (>= len(tokenizer): padded
            embedding rows); they are in ``token_ids`` but not in ``text``.
    """

    token_ids: list[int]
    text: str | None
    prompt_len: int
    finish_reason: str
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    unknown_token_ids: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per round (accept_len + 1, or what a truncated round emitted)."""
        return sum(r.emitted for r in self.rounds) / max(1, len(self.rounds))

    @property
    def accept_len_mean(self) -> float:
        return sum(r.accept_len for r in self.rounds) / max(1, len(self.rounds))

    @property
    def coverage_mean(self) -> float:
        return sum(r.coverage for r in self.rounds) / max(1, len(self.rounds))

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding (prefill excluded)."""
        return len(self.token_ids) / self.decode_s if self.decode_s > 0 else float("nan")

    def stage_ms(self) -> dict[str, float]:
        """Total milliseconds per stage over all rounds."""
        return {s: sum(r.stage_ms.get(s, 0.0) for r in self.rounds) for s in STAGES}


@dataclass
class Request:
    """One prompt of a batch with its own settings (see :meth:`SpeculativeGenerator.generate`).

    Attributes:
        prompt: text or token ids.
        sampling: the target law (None: greedy).
        seed: seed of this row's verifier uniforms.
        max_new_tokens: >= 1.
        stop_token_ids: extra stop tokens; EOS is one unless ``ignore_eos``.
        stop_strings: the output is cut right after the token that completes one of them.
        ignore_eos: do not stop at EOS.
        controls: penalties, logit bias, logits processor (:class:`~sglang_tev.hf.controls.Controls`).
    """

    prompt: str | Sequence[int] | torch.Tensor
    sampling: SamplingParams | None = None
    seed: int = 0
    max_new_tokens: int = 256
    stop_token_ids: Sequence[int] | None = None
    stop_strings: Sequence[str] | None = None
    ignore_eos: bool = False
    controls: Controls | None = None


class Row:
    """Host-side state of one request while it is decoded (its device state lives in the batch
    buffers, at the slot the scheduler gave it).

    Attributes:
        index: the request's position in the call (results and stream callbacks use it).
        req: the checked request, its prompt as token ids and its sampling law set.
        ids: committed tokens, prompt included; the last one is the next round's root.
        past_len: tokens whose KV is cached (``len(ids) - 1``).
        stops: stop token ids (EOS included unless ignored).
        greedy: the row's law is greedy (it draws no uniforms).
        generator: the row's own ``torch.Generator`` for verifier uniforms (None when greedy).
        controls: its generation controls.
        result: the :class:`GenerationResult` being filled.
        t_start: ``perf_counter`` at the end of its prefill.
    """

    def __init__(self, index: int, req: Request, ids: list[int], stops: set[int], greedy: bool, generator) -> None:
        self.index = index
        self.req = req
        self.ids = ids
        self.prompt_len = len(ids)
        self.past_len = len(ids) - 1
        self.stops = stops
        self.greedy = greedy
        self.generator = generator
        self.controls = req.controls or Controls()
        self.result = GenerationResult([], None, len(ids), "length")
        self.t_start = 0.0

    @property
    def remaining(self) -> int:
        """Tokens it may still emit (``max_new_tokens`` minus those emitted)."""
        return self.req.max_new_tokens - len(self.result.token_ids)
