"""The transformers runtime: batched lossless tree speculative decoding over a static KV cache.

One round, for every active row at once (DESIGN §1, §3, §5)::

    draft         drafter(context, roots) -> per-depth draft logits [b, H, V]
    build         DDTree (or a chain, or the root alone) -> DraftTree [b, N = 1 + B], and the
                  forward's inputs: per-row tree masks (attention windows per layer type),
                  positions past_len + depth (never >= the model's max positions, padded
                  nodes included), cache slots
    tree_forward  one target forward over the b x N nodes, K/V written into the static cache
    verify        generation controls at every node -> finiteness check -> verify_tree -> the
                  round's ONE host sync (paths, bonus tokens, accept lengths, coverage, bad nodes)
    commit        per layer one gather moves each row's accepted path to the front of its tree
                  window; the path's target features go to the drafter; stops cut the block

The root of a round is the last committed token: it has no KV yet and is fed with the tree, so the
prefill covers the prompt minus its last token and every new token comes out of a verify step.
``past_len`` counts the tokens whose KV is cached; node v sits at position ``past_len + depth(v)``.

Rows: every request has its own prompt length, sampling law, seed, stops, max_new_tokens and
controls. Active rows are packed at the front of a fixed-capacity batch; a finished row's slot is
refilled with the next waiting prompt, or the last active row moves into it and the batch shrinks,
so a finished row costs nothing afterwards. Each row draws its verifier uniforms from its own
generator (seeded by its own seed), so its law does not depend on its neighbours.

Host syncs: one per round (the packed decision), plus one per round for stage timings on CUDA
when ``time_stages`` is set (the benchmark sets it). On CPU everything is host memory anyway.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..draft.ddtree import build_ddtree
from ..draft.host_native import native
from ..sampling import SamplingParams
from ..tree import DraftTree, additive_mask
from ..verify import METHODS as VERIFIERS
from ..verify import num_uniforms, verify_tree
from .controls import Controls, apply_controls
from .static_cache import StaticKVCache, attention_layout, prefill_masks, tree_masks
from .assets import shipped_pair_default

__all__ = ["SpeculativeGenerator", "GenerationResult", "RoundStats", "Request", "Controls",
           "GENERATION_METHODS", "STAGES", "MAX_BUDGET", "NonFiniteLogitsError"]

GENERATION_METHODS = ("autoregressive", "chain", "tev", "predraw", "sequential", "greedy")
"""``autoregressive``: plain decoding (a root-only tree per step); ``chain``: the linear DFlash
block (per-depth argmax, parents[i] = i - 1) checked by ``verifier``; the rest: DDTree verified by
that method."""

STAGES = ("draft", "build", "tree_forward", "verify", "commit")

MAX_BUDGET = 1024
"""Largest DDTree budget the runtime accepts (the largest the DDTree reference benchmarks): the
builder's memory grows as budget x min(budget, V)."""


KEPT_MASK_MAX_ROWS = 4
"""Batches of at most this many rows update one kept tree-mask buffer in place (per row one C
call, or two slice writes); larger ones build the mask in one vectorised pass
(``static_cache.tree_masks``)."""


class NonFiniteLogitsError(RuntimeError):
    """The target produced NaN / +inf (or only -inf) logits at a valid tree node: an exact verifier
    cannot use them (the exit law would move to that node), so the call stops with this error."""


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
    """

    accept_len: int
    emitted: int
    coverage: float
    tree_nodes: int
    stage_ms: dict[str, float]
    verified_accept_len: int = -1
    batch_rows: int = 1

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


def cache_kwarg_name(model) -> str:
    """The KV-cache keyword of ``model.forward``: ``cache`` where transformers has renamed it
    (the signature says so; 5.2x), else ``past_key_values`` (which newer releases accept only
    until their removal)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{cache_kwarg_name(model): cache}``, to pass a KV cache to ``model(...)``."""
    return {cache_kwarg_name(model): cache}


def _quiet_cache_rename(fn):
    """transformers >= 5.2x renames ``past_key_values``; :func:`cache_kwarg_name` passes the new
    name when ``forward`` declares it. A forward that hides it behind ``**kwargs`` still gets the
    old one, whose FutureWarning on every forward would break the CLI's one-line stderr contract."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*", category=FutureWarning)
            return fn(*args, **kwargs)

    return wrapper


def _one_call_at_a_time(fn):
    """Serialise calls on one generator: a call holds its cache, drafter buffers and
    ``committed`` / ``past_len`` from start to end, so other threads wait for the lock (HF
    pipelines and async servers share one generator). A call from inside a running call on the
    same thread (a stream callback) would wait for itself: it raises instead."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        me = threading.get_ident()
        if self._call_owner == me:
            raise RuntimeError("SpeculativeGenerator is busy: generate() was called from inside a running call on "
                               "this generator (a stream callback?); call it after that one returns")
        with self._call_lock:
            self._call_owner = me
            try:
                return fn(self, *args, **kwargs)
            finally:
                self._call_owner = None

    return wrapper


def _path_error(name: str, path) -> None:
    if path is None or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{name} must be a path, got {path!r}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{name}: no model directory at {os.fspath(path)!r}")



def _is_prompt_list(prompt) -> bool:
    """A list of prompts (texts or id sequences), as opposed to one prompt of token ids."""
    if isinstance(prompt, (str, torch.Tensor)) or not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt)


class _Run:
    """One :meth:`SpeculativeGenerator.generate_batch` call: the static batch and its rounds.

    Slots ``[0, n_active)`` hold the active rows (``self.active[i]`` is in slot i); device
    buffers are indexed by slot.
    """

    def __init__(self, gen: SpeculativeGenerator, rows: list[_Row], cap: int, method: str, vmethod: str,
                 budget: int, K: int | None, stream) -> None:
        self.g = gen
        self.dev = gen.device
        self.method, self.vmethod, self.budget, self.K, self.stream = method, vmethod, budget, K, stream
        self.speculative = method != "autoregressive"
        self.n_nodes = 1 if not self.speculative else (K if method == "chain" else 1 + budget)
        self.waiting = list(rows)
        self.active: list[_Row] = []
        self.cap = cap
        self.round_no = 0
        self.first = True
        longest = max(min(len(r.ids) + r.req.max_new_tokens, gen.max_positions) for r in rows)
        self.max_len = longest + self.n_nodes + 1
        self.need_feats = self.speculative and bool(getattr(gen.drafter, "target_layer_ids", None))
        reuse = gen.cuda_graphs and gen._graph_key is not None and gen._graph_key[0] == cap \
            and gen._graph_key[1] >= self.max_len
        if gen.cuda_graphs:  # captured graphs hold the cache's buffers: keep them across calls
            self.max_len = gen._graph_key[1] if reuse else -(-self.max_len // 256) * 256
        if not reuse:
            gen.cache = StaticKVCache(cap, self.max_len, gen.config.num_hidden_layers, self.dev, gen.target.dtype)
            gen._graphs, gen._static_slots = None, {}
            gen._graph_key = (cap, self.max_len) if gen.cuda_graphs else None
        self.cache = gen.cache
        self.tokens = torch.zeros(cap, self.max_len, dtype=torch.int64, device=self.dev)
        V = gen.vocab_size
        ctl = [r.controls for r in rows]
        self.use_seen = any(c.repetition_penalty != 1.0 for c in ctl)
        self.use_counts = any(c.frequency_penalty != 0.0 or c.presence_penalty != 0.0 for c in ctl)
        self.use_bias = any(c.logit_bias for c in ctl)
        self.use_controls = any(c.active for c in ctl)
        self.seen = torch.zeros(cap, V, dtype=torch.bool, device=self.dev) if self.use_seen else None
        self.counts = torch.zeros(cap, V, dtype=torch.float32, device=self.dev) if self.use_counts else None
        self.bias = torch.zeros(cap, V, dtype=torch.float32, device=self.dev) if self.use_bias else None
        self.any_stops = any(r.stops for r in rows)
        # the committed-token buffer feeds drafters that read tokens and user processors / penalties
        self.need_tokens = (self.speculative and getattr(gen.drafter, "reads_tokens", True)) or self.use_controls
        if self.speculative:
            gen.drafter.start(cap, self.max_len, self.dev)
        self._sampling_key = None
        self._sampling = None
        self.pending_ctx = None
        self.static = gen.static_shapes or gen.cuda_graphs
        self.static_slots: dict[tuple[int, int], torch.Tensor] = gen._static_slots
        self.graphs = None
        self._slots = torch.arange(self.max_len + self.n_nodes, device=self.dev)  # slot / position ids, sliced
        self._mask_buf: torch.Tensor | None = None  # _kept_tree_mask's buffer and per-slot (row, context columns set)
        self._mask_rows: list = []
        if gen.cuda_graphs:
            from .cuda_graphs import GraphedTreeForward

            if gen._graphs is None:
                gen._graphs = GraphedTreeForward(self._eager_forward)
            else:  # the captured forwards run on this call's cache (the same buffers)
                gen._graphs.forward = self._eager_forward
            self.graphs = gen._graphs
            gen.graph_stats = self.graphs.stats

    # ------------------------------------------------------------------ batch management
    def loop(self) -> None:
        self._fill(list(range(self.cap)))
        while self.active:
            self._retire_finished_before_round()
            if not self.active:
                break
            self.round()

    def _fill(self, slots: list[int]) -> None:
        """Prefill waiting requests into ``slots`` (contiguous, from the end of the active list)."""
        new = []
        for s in slots:
            if not self.waiting:
                break
            row = self.waiting.pop(0)
            assert s == len(self.active)
            self.active.append(row)
            new.append(row)
        if new:
            self._prefill(len(self.active) - len(new), new)

    def _prefill(self, first_slot: int, rows: list[_Row]) -> None:
        """Ragged prefill of the prompts (minus their last token) of ``rows`` into consecutive slots."""
        g, dev = self.g, self.dev
        t0 = time.perf_counter()
        b = len(rows)
        sl = slice(first_slot, first_slot + b)
        lens = [len(r.ids) - 1 for r in rows]
        for i, r in enumerate(rows):
            self.tokens[first_slot + i, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.int64)
            c = r.controls
            if self.seen is not None:
                self.seen[first_slot + i] = False
                self.seen[first_slot + i, torch.tensor(r.ids, device=dev)] = True
            if self.counts is not None:
                self.counts[first_slot + i] = 0
            if self.bias is not None:
                self.bias[first_slot + i] = 0
                if c.logit_bias:
                    self.bias[first_slot + i, torch.tensor(list(c.logit_bias), device=dev)] = torch.tensor(
                        list(c.logit_bias.values()), dtype=torch.float32, device=dev)
        t = max(lens)
        if t > 0:
            ids = self.tokens[sl, :t]
            pos = torch.arange(t, device=dev).expand(b, t)
            lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
            self.cache.begin(sl, 0, t)
            out = g.target(ids, position_ids=pos, attention_mask=g._mask(prefill_masks(g.layout, lens_t, t)),
                           **{g._cache_kw: self.cache}, use_cache=True, output_hidden_states=self.need_feats,
                           logits_to_keep=1)
            if self.need_feats:
                g.drafter.add_context(sl, g._features(out.hidden_states), pos)
        g._sync()
        now = time.perf_counter()
        for r in rows:
            r.result.prefill_s = (now - t0) / b
            r.t_start = now
        self._sampling_key = None

    def _retire(self, slot: int) -> None:
        """Row in ``slot`` is done: refill the slot from the waiting list, or move the last active
        row into it and shrink the batch."""
        self._flush_context()
        row = self.active[slot]
        row.result.decode_s = time.perf_counter() - row.t_start
        last = len(self.active) - 1
        if self.waiting:
            nxt = self.waiting.pop(0)
            self.active[slot] = nxt
            self._prefill(slot, [nxt])
            return
        if slot != last:
            moved = self.active[last]
            length = moved.past_len + 1
            self.cache.move_row(last, slot, moved.past_len)
            self.tokens[slot, :length] = self.tokens[last, :length]
            for buf in (self.seen, self.counts, self.bias):
                if buf is not None:
                    buf[slot] = buf[last]
            if self.speculative:
                self.g.drafter.move_row(last, slot, moved.past_len)
            self.active[slot] = moved
        self.active.pop()
        self._sampling_key = None

    def _retire_finished_before_round(self) -> None:
        """Rows that cannot take another round (position limit) finish here."""
        i = 0
        while i < len(self.active):
            r = self.active[i]
            if self.g.max_positions - 1 - r.past_len < 0:
                r.result.finish_reason = "position_limit"
                self._retire(i)
                continue
            i += 1

    # ------------------------------------------------------------------ the round
    def round(self) -> None:
        """draft -> build -> tree forward -> verify (one host sync) -> commit."""
        times: dict[str, float] = {}
        clock = [time.perf_counter()]

        def lap(stage: str) -> None:
            self.g._stage_sync()
            now = time.perf_counter()
            times[stage] = (now - clock[0]) * 1e3
            clock[0] = now

        rows = self.active
        b = len(rows)
        sl = slice(0, b)
        lens = torch.tensor([r.past_len for r in rows], dtype=torch.int64, device=self.dev)
        roots = torch.tensor([r.ids[-1] for r in rows], dtype=torch.int64, device=self.dev)
        depth_cap = [self._depth_cap(r) for r in rows]

        draft_logits = self.draft(sl, roots, lens, depth_cap)
        lap("draft")
        tree = self.build(draft_logits, roots, depth_cap)
        inputs = self.forward_inputs(sl, tree, lens)
        lap("build")
        logits, feats = self.tree_forward(tree, inputs)
        lap("tree_forward")
        decision = self.verify(tree, logits)
        lap("verify")
        self.commit(sl, tree, lens, feats, decision, times, lap)

    def _depth_cap(self, r: _Row) -> int:
        """Deepest node a row's tree may hold: K - 1, one less than the tokens left (the bonus
        token comes on top), and the last position the model has."""
        if not self.speculative:
            return 0
        return max(0, min(self.K - 1, r.remaining - 1, self.g.max_positions - 1 - r.past_len))

    def _flush_context(self) -> None:
        """Hand the last commit's path features to the drafter (done in the draft stage, where the
        reference's draft forward does it too, or before rows move)."""
        if self.pending_ctx is not None:
            self.g.drafter.add_context(*self.pending_ctx)
            self.pending_ctx = None

    def draft(self, sl: slice, roots, lens, depth_cap: list[int]) -> torch.Tensor | None:
        """Per-depth draft logits [b, K - 1, V], or None when no row may draft.

        Always the full block: attention inside a DFlash block is bidirectional, so a shorter block
        would change every depth's logits; with the full block a row's drafts do not depend on its
        neighbours' depth caps (nor on the batch), and the draft forward has one shape. The tree's
        depth is capped per row by the builder instead."""
        self._flush_context()
        if max(depth_cap) <= 0:
            return None
        return self.g.drafter.draft_rows(sl, roots, lens, self.tokens[sl], self.K - 1, max(r.past_len for r in self.active))

    def build(self, draft_logits, roots, depth_cap: list[int]) -> DraftTree:
        """The round's trees: DDTree (depth capped per row, stop tokens kept as leaves), the
        argmax chain, or the root alone."""
        b = roots.shape[0]
        dev = self.dev
        if draft_logits is None:
            return _root_only(roots)
        # no limit when every row may use the whole block (the common case: no tensor to make)
        cap_t = None if min(depth_cap) >= self.K - 1 else torch.tensor(depth_cap, dtype=torch.int64, device=dev)
        leaf = self._leaf_tokens()
        if self.method == "chain":
            H = min(draft_logits.shape[1], max(depth_cap))
            chain = draft_logits[:, :H].argmax(-1)  # [b, H]
            parents = torch.arange(-1, H, device=dev).expand(b, H + 1)
            tokens = torch.cat([roots.view(b, 1), chain], 1)
            ok = torch.arange(1, H + 1, device=dev).view(1, H) <= torch.tensor(depth_cap, device=dev).view(b, 1)
            if leaf is not None:  # nothing below a stop token
                stop_before = torch.zeros_like(ok)
                stop_before[:, 1:] = (chain[:, :-1].unsqueeze(-1) == leaf.unsqueeze(1)).any(-1).cummax(1).values[:, :]
                ok &= ~stop_before
            valid = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=dev), ok], 1)
            valid = valid.to(torch.int8).cummin(1).values.bool()
            tree = DraftTree.from_parents(parents.contiguous(), tokens, valid, validate=False)
            if tree.num_nodes < self.n_nodes:  # static width K even when H < K - 1
                tree = _pad_to(tree, self.n_nodes)
            return tree
        return build_ddtree(draft_logits, self.budget, roots, validate=self.first, depth_limit=cap_t, leaf_tokens=leaf)

    def _leaf_tokens(self) -> torch.Tensor | None:
        if not self.any_stops:
            return None
        s = max(len(r.stops) for r in self.active)
        if s == 0:
            return None
        rows = [sorted(r.stops) + [-1] * (s - len(r.stops)) for r in self.active]
        return torch.tensor(rows, dtype=torch.int64, device=self.dev)

    def forward_inputs(self, sl: slice, tree: DraftTree, lens) -> dict:
        """The tree forward's positions (past_len + depth) and masks, and where its K/V go (slots
        past_len + node index of each row); part of the build stage, as the reference's compile.
        With static shapes the attention reads the whole cache and the slots live in a static
        buffer per (rows, nodes), so a captured graph sees the same tensors every round."""
        g = self.g
        b, n = tree.parents.shape
        if self.static:
            kv_len = self.max_len
            slots = self.static_slots.get((b, n))
            if slots is None:
                slots = self.static_slots[(b, n)] = torch.zeros(b, n, dtype=torch.int64, device=self.dev)
            slots.copy_(lens.view(b, 1) + torch.arange(n, device=self.dev))
        else:
            kv_len = max(r.past_len for r in self.active) + n
            slots = self.active[0].past_len if b == 1 else lens.view(b, 1) + torch.arange(n, device=self.dev)
        if self.static or g.layout.windows != {"full_attention": None} or b > KEPT_MASK_MAX_ROWS:
            masks = g._mask(tree_masks(g.layout, lens, tree.depth, tree.ancestor_mask, kv_len))
        else:
            masks = self._kept_tree_mask(tree, kv_len)  # already additive
        depth = tree.depth
        if n > 1 and max(r.past_len for r in self.active) >= g.max_positions - 1:
            # a row at its last position has a root-only tree but still N - 1 padded nodes (depth 1
            # by the DraftTree contract): they sit at the root's position instead, so no position
            # >= the limit is fed (dynamic-NTK RoPE would rescale the whole forward)
            depth = torch.where(tree.valid, depth, 0)
        positions = depth + self.active[0].past_len if b == 1 else lens.view(b, 1) + depth
        return {"rows": sl, "positions": positions, "masks": masks, "slots": slots, "kv_len": kv_len}

    def _kept_tree_mask(self, tree: DraftTree, kv_len: int) -> torch.Tensor:
        """The full-attention tree mask (as :func:`~sglang_tev.hf.static_cache.tree_masks`) as HF's
        additive float mask (0 = attend, ``finfo.min`` = masked), kept in one buffer
        [cap, 1, N, max_len] and updated in place as the reference keeps its mask: per row, the
        columns that became context since its last round are zeroed and its tree window gets the
        ancestor mask (one C call on CPU float32, else a fill and a ``where``). Columns past a row's window were never
        opened for it (rows only grow), so they stay masked; a slot that changes hands is reset
        first. Float, so SDPA does not convert a bool mask in every layer."""
        b, n = tree.parents.shape
        g = self.g
        if self._mask_buf is None or self._mask_buf.shape[2] != n:
            dt = g.target.dtype if g.target.dtype.is_floating_point else torch.float32
            low = torch.finfo(dt).min
            self._mask_buf = torch.full((self.cap, 1, n, self.max_len), low, dtype=dt, device=self.dev)
            self._mask_rows = [(None, 0)] * self.cap
            self._mask_vals = (torch.zeros((), dtype=dt, device=self.dev), torch.full((), low, dtype=dt, device=self.dev), low)
        buf = self._mask_buf
        zero, low, low_f = self._mask_vals  # 0-d tensors for torch.where; the Python float for C
        anc = tree.ancestor_mask
        update = None
        if buf.device.type == "cpu" and buf.dtype == torch.float32 and anc.is_contiguous():
            update = native("mask_update")  # one C call per row: no tensor op
        for i, r in enumerate(self.active):
            owner, done = self._mask_rows[i]
            L = r.past_len
            if owner is not r or done > L:
                buf[i].fill_(low_f)
                done = 0
            if update is not None:
                update(buf.data_ptr() + buf.element_size() * i * buf.stride(0), n, self.max_len, done, L,
                       anc.data_ptr() + i * n * n, low_f)
            else:
                if L > done:
                    buf[i, 0, :, done:L] = 0
                torch.where(anc[i], zero, low, out=buf[i, 0, :, L: L + n])
            self._mask_rows[i] = (r, L)
        return buf[:b, :, :, :kv_len]

    def tree_forward(self, tree: DraftTree, inputs: dict):
        """One target forward over every row's tree: logits float32 [b, N, V], features or None
        (a CUDA-graph replay when captured)."""
        self.cache.begin(inputs["rows"], inputs["slots"], inputs["kv_len"])
        if self.graphs is not None:
            return self.graphs(tree.tokens, inputs["positions"], inputs["masks"])
        return self._eager_forward(tree.tokens, inputs["positions"], inputs["masks"])

    def _eager_forward(self, tokens, positions, masks):
        g = self.g
        out = g.target(tokens, position_ids=positions, attention_mask=masks, **{g._cache_kw: self.cache},
                       use_cache=True, output_hidden_states=self.need_feats)
        feats = g._features(out.hidden_states) if self.need_feats else None
        return out.logits.float(), feats

    def _row_sampling(self) -> SamplingParams:
        """The batch's SamplingParams: Python scalars when every row shares them (fast paths),
        else [b] tensors. Rebuilt only when the active rows change."""
        key = tuple(id(r) for r in self.active)
        if key != self._sampling_key:
            sps = [r.req.sampling for r in self.active]
            vals = {f: [float(torch.as_tensor(getattr(s, f)).reshape(-1)[0]) for s in sps]
                    for f in ("temperature", "top_k", "top_p", "min_p")}
            vals["temperature"] = [0.0 if r.greedy else t for r, t in zip(self.active, vals["temperature"])]
            if all(len(set(v)) == 1 for v in vals.values()):
                sp = SamplingParams(temperature=vals["temperature"][0], top_k=int(vals["top_k"][0]),
                                    top_p=vals["top_p"][0], min_p=vals["min_p"][0])
            else:
                t = lambda k, dt: torch.tensor(vals[k], dtype=dt, device=self.dev)  # noqa: E731
                sp = SamplingParams(temperature=t("temperature", torch.float64), top_k=t("top_k", torch.int64),
                                    top_p=t("top_p", torch.float64), min_p=t("min_p", torch.float64))
            self._sampling_key, self._sampling = key, sp
        return self._sampling

    def _uniforms(self, n: int) -> torch.Tensor | None:
        """float64 [b, U]: each sampled row draws from its own generator; greedy rows draw nothing."""
        if all(r.greedy for r in self.active):
            return None
        u_count = num_uniforms(self.vmethod, n)
        u = torch.zeros(len(self.active), u_count, dtype=torch.float64, device=self.dev)
        for i, r in enumerate(self.active):
            if not r.greedy:
                u[i] = torch.rand(u_count, dtype=torch.float64, device=self.dev, generator=r.generator)
        return u

    def verify(self, tree: DraftTree, logits: torch.Tensor):
        """Controls at every node, the verifier, and the round's one host sync: the decision and
        each row's first valid node with non-finite logits (the finiteness check) read back
        together (:meth:`~sglang_tev.verify.VerifyOutput.host`)."""
        b, n = tree.parents.shape
        if self.use_controls:
            logits = apply_controls(logits, tree, [r.controls for r in self.active], self.counts[:b] if self.counts is not None else None,
                                    self.seen[:b] if self.seen is not None else None,
                                    self.bias[:b] if self.bias is not None else None,
                                    lambda i: self.tokens[i, : self.active[i].past_len + 1])
        sampling = self._row_sampling()
        vout = verify_tree(tree, logits, method=self.vmethod, sampling=sampling, uniforms=self._uniforms(n),
                           validate=False)
        # non-finite logits at any valid node (NaN, +inf, or only -inf in a row) stop the call
        dec = vout.host(tree, check_finite=logits)  # the one host sync of the round
        for i, v in enumerate(dec.first_nonfinite):
            if v >= 0:
                r = self.active[i]
                raise NonFiniteLogitsError(
                    f"target logits are not finite (NaN, +inf or all -inf) at round {self.round_no}, prompt {r.index}, "
                    f"tree node {v} (depth {int(tree.depth[i, v])}, token {int(tree.tokens[i, v])}); "
                    f"{len(r.result.token_ids)} tokens were emitted before it. Check the model's dtype (fp16 overflow?)")
        self.first = False
        return dec

    def commit(self, sl: slice, tree: DraftTree, lens, feats, dec, times, lap) -> None:
        """Move each row's accepted path KV to the front of its tree window (one gather per layer,
        skipped when every path is already in place), hand the path's features to the drafter, cut
        blocks at stops / max_new_tokens, advance."""
        b = len(self.active)
        paths = dec.paths
        w = max(len(p) for p in paths)
        if feats is not None or w > 1:
            in_place = all(p == list(range(len(p))) for p in paths)  # nodes 0..a already sit in slots 0..a
            if b == 1:  # one row: slices, a C move and one index_select, no index grids
                start = self.active[0].past_len
                dst = self._slots[start: start + w].view(1, w)
                if not in_place:
                    self.cache.compact_row(sl.start, [start + v for v in paths[0]], start)
                ctx = None
                if feats is not None:
                    ctx = feats[:, :w] if in_place else _gather_nodes(feats, paths[0])
            else:
                dst = lens.view(b, 1) + self._slots[:w]
                ctx = None if feats is None else feats[:, :w]
                if not in_place:  # rows with shorter paths move their own slots onto themselves
                    src = torch.tensor([p + list(range(len(p), w)) for p in paths], dtype=torch.int64, device=self.dev)
                    if w > 1:
                        self.cache.compact(sl, lens.view(b, 1) + src, dst)
                    if feats is not None:
                        ctx = feats.gather(1, src.unsqueeze(-1).expand(b, w, feats.shape[-1]))
            if feats is not None:
                self.pending_ctx = (sl, ctx, dst)
        # host bookkeeping
        finished = []
        writes_r, writes_c, writes_t = [], [], []
        for i, r in enumerate(self.active):
            acc = dec.accept_len[i]
            block = dec.path_tokens[i][1:] + [dec.bonus[i]]
            block, reason = self.g._cut(block, r.result.token_ids, r.stops, r.req.stop_strings, r.remaining)
            m = len(block)
            for k, t in enumerate(block):
                writes_r.append(i)
                writes_c.append(r.past_len + 1 + k)
                writes_t.append(t)
            r.ids.extend(block)
            r.past_len += m  # the KV of root + the first m - 1 block tokens is cached (m - 1 <= acc)
            r.result.token_ids.extend(block)
            r.result.rounds.append(RoundStats(min(acc, m), m, dec.coverage[i], dec.tree_nodes[i], times,
                                              verified_accept_len=acc, batch_rows=b))
            if self.stream is not None and block:
                self.stream(r.index, block)
            if reason is not None:
                r.result.finish_reason = reason
                finished.append(i)
        if writes_r and self.need_tokens:
            wr = torch.tensor(writes_r, device=self.dev)
            wt = torch.tensor(writes_t, dtype=torch.int64, device=self.dev)
            self.tokens[wr, torch.tensor(writes_c, device=self.dev)] = wt
            if self.counts is not None:
                self.counts[:b].index_put_((wr, wt), torch.ones(len(writes_t), device=self.dev), accumulate=True)
            if self.seen is not None:
                self.seen[wr, wt] = True
        lap("commit")
        self.round_no += 1
        for i in reversed(finished):
            self._retire(i)


class _Row:
    """Host-side state of one active request (the device state lives in the batch buffers)."""

    def __init__(self, index: int, req: Request, ids: list[int], stops: set[int], greedy: bool, generator) -> None:
        self.index = index
        self.req = req
        self.ids = ids  # committed tokens, prompt included; the last one is the next root
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
        return self.req.max_new_tokens - len(self.result.token_ids)


class SpeculativeGenerator:
    """Tree speculative decoding over a transformers causal LM, batched.

    Args:
        target: an HF causal LM (Qwen2/3, Llama, Mistral, Gemma families: anything taking
            ``position_ids``, a 4-D ``attention_mask`` (or a dict of them per layer type) and a
            cache object with ``update``). Put in eval mode here.
        drafter: a :class:`~sglang_tev.hf.drafters.BatchDrafter`, a ``DFlashDrafter`` (run over
            a static context cache), a one-sequence :class:`~sglang_tev.hf.drafters.Drafter`
            (batch size 1 only), or None for autoregressive decoding only.
        tokenizer: optional HF tokenizer (text prompts, stop strings, EOS, decoded output).

    Attributes:
        time_stages: on CUDA, synchronise after each stage so ``RoundStats.stage_ms`` adds up
            (default False: one host sync per round). No effect on CPU.
        static_shapes: every tree forward of a (rows, nodes) pair has fixed shapes (the attention
            reads the whole static cache): what CUDA graphs need; runs eagerly anywhere.
        cuda_graphs: capture the tree forward per (rows, nodes) in a CUDA graph and replay it
            (implies static_shapes; CUDA only; a failed capture is logged and runs eagerly;
            ``graph_stats`` holds captures, capture seconds and fallbacks). Not measured here.
        committed, past_len: after a call with ONE prompt, its committed tokens (int64 [1, L]) and
            ``L - 1`` (the KV of positions [0, past_len) is in ``cache`` row 0); None after a batch.
            With several threads they describe whichever call finished last: use the result.

    Threads: one generator may be shared; its calls run one at a time (a lock: the others wait),
    each with the output it would have alone. A call from inside a running call on the same
    thread (a stream callback) raises ``RuntimeError`` ("busy"). For throughput, batch prompts
    in one call instead of calling from many threads.

    Raises:
        ValueError: a DFlash drafter that does not fit the target (hidden size, vocabulary,
        target_layer_ids, mask token); a target with attention layers the runtime cannot serve
        (layer types other than full and sliding attention).
    """

    def __init__(self, target, drafter=None, tokenizer=None, *, static_shapes: bool = False,
                 cuda_graphs: bool = False) -> None:
        from .dflash_runner import StaticDFlashDrafter
        from .drafters import DFlashDrafter, SequenceDrafterAdapter

        self.target = target.eval()
        self.tokenizer = tokenizer
        self.config = target.config
        self._cache_kw = cache_kwarg_name(target)  # resolved once: signature inspection is not free
        self.device = next(target.parameters()).device
        self.layout = attention_layout(self.config)
        attn_impl = getattr(self.config, "_attn_implementation", "sdpa")
        self._additive_mask = attn_impl == "eager"  # SDPA takes bool masks; eager adds them
        model = getattr(drafter, "model", None)
        if model is not None and hasattr(model, "validate_against_target"):
            model.validate_against_target(self.config)
        if isinstance(drafter, DFlashDrafter):
            drafter = StaticDFlashDrafter(drafter.model, target)
        elif drafter is not None and not hasattr(drafter, "draft_rows"):
            drafter = SequenceDrafterAdapter(drafter)
        self.drafter = drafter
        self.time_stages = False
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs: needs the target on a CUDA device, it is on {self.device}")
        self.static_shapes = bool(static_shapes)
        self.cuda_graphs = bool(cuda_graphs)
        self.graph_stats: dict | None = None
        self._graphs = None
        self._graph_key = None
        self._static_slots: dict = {}
        self.cache: StaticKVCache | None = None
        self.committed: torch.Tensor | None = None
        self.past_len: int | None = None
        self._call_lock = threading.Lock()
        self._call_owner: int | None = None

    @classmethod
    @shipped_pair_default  # target None / "tiny-code": the shipped pair; no progress bars while loading
    def from_pretrained(
        cls,
        target: str | os.PathLike | None = None,
        draft: str | os.PathLike | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        **options,
    ) -> "SpeculativeGenerator":
        """Load a target (HF directory with tokenizer) and a z-lab DFlash drafter from disk.

        Args:
            target: directory of the target model and its tokenizer; None or ``"tiny-code"``: the
                pair shipped in the package (hf/assets.py), its drafter too unless ``draft`` is
                given (``draft=False``: none).
            draft: directory of the DFlash drafter (z-lab layout), or None.
            dtype: default float32 on CPU, bfloat16 on CUDA.
            device: default CUDA when available, else CPU.
            options: ``static_shapes`` / ``cuda_graphs`` (see the class).
        Raises:
            FileNotFoundError / ValueError naming ``target`` or ``draft``; ValueError when the
            drafter does not fit the target or ``target`` is a DFlash drafter directory.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..draft.dflash import DFlashDraftModel, is_dflash_checkpoint
        from .drafters import DFlashDrafter

        _path_error("target", target)
        if draft is not None:
            _path_error("draft", draft)
        if is_dflash_checkpoint(target):
            raise ValueError(f"target: {os.fspath(target)!r} is a DFlash drafter (z-lab layout), not a target "
                             "model; pass it as the draft")
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa")
        except (OSError, ValueError) as e:
            raise ValueError(f"target: cannot load a causal LM from {os.fspath(target)!r}: {e}") from e
        model.to(device)
        tok = None
        try:
            tok = AutoTokenizer.from_pretrained(target)
        except (OSError, ValueError):
            tok = None
        if tok is not None and len(tok) == 0:  # no tokenizer files: transformers returns an empty one
            tok = None
        drafter = None
        if draft is not None:
            dm = DFlashDraftModel.from_pretrained(draft, dtype=dtype, device=device)
            dm.validate_against_target(model.config)
            drafter = DFlashDrafter(dm.eval(), model)
        return cls(model, drafter, tok, **options)

    # ------------------------------------------------------------------ helpers
    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def vocab_size(self) -> int:
        return int(self.target.get_output_embeddings().weight.shape[0])

    def encode(self, prompt: str, chat_template: bool = True) -> list[int]:
        """Token ids of a text prompt; applies the tokenizer's chat template when it has one."""
        if self.tokenizer is None:
            raise ValueError("prompt: a text prompt needs a tokenizer; pass token ids instead")
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _stage_sync(self) -> None:
        if self.time_stages:
            self._sync()

    def _features(self, hidden_states) -> torch.Tensor | None:
        ids = getattr(self.drafter, "target_layer_ids", None)
        if not ids:
            return None
        return torch.cat([hidden_states[i + 1] for i in ids], dim=-1)

    def _stop_ids(self, stop_token_ids, ignore_eos: bool) -> set[int]:
        stops = set(int(t) for t in (stop_token_ids or []))
        if not ignore_eos:
            eos = getattr(getattr(self.target, "generation_config", None), "eos_token_id", None)
            if eos is None and self.tokenizer is not None:
                eos = self.tokenizer.eos_token_id
            if eos is None:
                eos = getattr(self.config, "eos_token_id", None)
            if isinstance(eos, int):
                stops.add(eos)
            elif eos is not None:
                stops.update(int(e) for e in eos)
        return stops

    def _mask(self, m):
        """Bool masks as the attention implementation wants them (eager: additive float)."""
        if not self._additive_mask:
            return m
        if isinstance(m, dict):
            return {k: self._mask(v) for k, v in m.items()}
        dt = self.target.dtype if self.target.dtype.is_floating_point else torch.float32
        return additive_mask(m, dt)

    # ------------------------------------------------------------------ generation API
    @_quiet_cache_rename
    @torch.inference_mode()
    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor | Sequence[str | Sequence[int]],
        *,
        method: str = "tev",
        budget: int = 64,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        seed: int | Sequence[int] = 0,
        max_new_tokens: int | Sequence[int] = 256,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] | None = None,
        ignore_eos: bool = False,
        block_size: int | None = None,
        verifier: str = "tev",
        chat_template: bool = True,
        stream: Callable | None = None,
        batch_size: int | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: dict | None = None,
        logits_processor: Callable | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` (or after each of several).

        Args:
            prompt: text (needs a tokenizer; chat template applied when ``chat_template`` and the
                tokenizer has one), token ids (list or int64 [L] / [1, L]), or a list of those
                (several prompts: a list of results comes back, in input order). A list of ints
                is ONE prompt of token ids.
            method: one of :data:`GENERATION_METHODS`.
            budget: DDTree budget B (non-root nodes), in [0, MAX_BUDGET].
            sampling: the target law (default greedy: temperature 0); one, or one per prompt.
            seed: seed of the verifier's uniforms; one, or one per prompt.
            max_new_tokens: >= 1, never exceeded; one, or one per prompt.
            stop_token_ids: extra stop tokens; EOS is one unless ``ignore_eos``. The builder
                does not expand nodes below a stop token.
            stop_strings: the output is cut right after the token that completes one of them.
            block_size: K (default: the drafter's); a round drafts at most K - 1 depths.
            verifier: the verifier of ``chain`` (``tev`` / ``predraw`` / ``sequential`` / ``greedy``).
            stream: one prompt: called with each round's emitted token ids (after stop handling);
                several: called as ``stream(prompt_index, ids)``.
            batch_size: rows decoded together (default: all prompts); waiting prompts fill the
                slots of finished rows.
            repetition_penalty, frequency_penalty, presence_penalty, logit_bias,
            logits_processor: generation controls applied at every tree node with its own prefix
                (:mod:`sglang_tev.hf.controls`), so the output law is plain decoding's with them.

        Returns:
            :class:`GenerationResult`, or a list of them for a list of prompts. After a call with
            one prompt, ``self.committed`` / ``self.past_len`` / ``self.cache`` row 0 describe it.

        Raises:
            ValueError naming the argument: unknown method or verifier, budget out of range,
            max_new_tokens < 1, an empty prompt or one longer than the position limit, block_size
            out of range, a speculative method without a drafter, invalid sampling values or
            controls, per-prompt lists of the wrong length, batch_size < 1.
            NonFiniteLogitsError: NaN / +inf target logits at a valid tree node (names the round,
            the prompt and the node).
            RuntimeError ("busy"): called from inside a running call on this generator (a stream
            callback). Calls from other threads wait for the running one instead.

        Exactness: every method's output has the law of plain sampling from the processed target
        law with the same controls (greedy: token-identical to plain greedy decoding), per row.
        """
        many = _is_prompt_list(prompt)
        prompts = list(prompt) if many else [prompt]
        n = len(prompts)
        if n == 0:
            raise ValueError("prompt: an empty list of prompts")

        def per(name, value, kind):
            if isinstance(value, (list, tuple)) and not isinstance(value, kind):
                if len(value) != n:
                    raise ValueError(f"{name}: {len(value)} values for {n} prompts")
                return list(value)
            return [value] * n

        samplings = per("sampling", sampling, SamplingParams)
        seeds = per("seed", seed, int)
        maxes = per("max_new_tokens", max_new_tokens, int)
        controls = Controls(repetition_penalty, frequency_penalty, presence_penalty, logit_bias, logits_processor)
        reqs = [Request(p, samplings[i], seeds[i], maxes[i], stop_token_ids, stop_strings, ignore_eos, controls)
                for i, p in enumerate(prompts)]
        wrapped = stream
        if stream is not None and not many:
            wrapped = lambda _i, ids: stream(ids)  # noqa: E731
        results = self.generate_batch(reqs, method=method, budget=budget, block_size=block_size, verifier=verifier,
                                      chat_template=chat_template, stream=wrapped, batch_size=batch_size)
        return results if many else results[0]

    @_one_call_at_a_time
    @_quiet_cache_rename
    @torch.inference_mode()
    def generate_batch(
        self,
        requests: Sequence[Request],
        *,
        method: str = "tev",
        budget: int = 64,
        block_size: int | None = None,
        verifier: str = "tev",
        chat_template: bool = True,
        stream: Callable[[int, list[int]], None] | None = None,
        batch_size: int | None = None,
    ) -> list[GenerationResult]:
        """Decode several :class:`Request` s, each with its own settings, ``batch_size`` rows at a
        time; results in input order. Arguments and errors as :meth:`generate`."""
        if not requests:
            raise ValueError("requests: at least one Request is needed")
        K, vmethod = self._check_call(method, budget, block_size, verifier, requests, batch_size)
        rows = self._prepare(requests, chat_template, vmethod)
        cap = min(len(rows), batch_size or len(rows))
        if self.drafter is not None and getattr(self.drafter, "max_rows", None) is not None:
            if cap > self.drafter.max_rows and method != "autoregressive":
                raise ValueError(f"batch_size: the drafter {type(getattr(self.drafter, 'inner', self.drafter)).__name__} "
                                 f"serves one sequence at a time; use batch_size=1 or a BatchDrafter")
        run = _Run(self, rows, cap, method, vmethod, budget, K, stream)
        run.loop()
        self._finish(rows, single=len(rows) == 1, run=run)
        return [r.result for r in rows]

    # ------------------------------------------------------------------ argument checks
    def _check_call(self, method, budget, block_size, verifier, requests, batch_size):
        if method not in GENERATION_METHODS:
            raise ValueError(f"method must be one of {GENERATION_METHODS}, got {method!r}")
        if verifier not in VERIFIERS:
            raise ValueError(f"verifier must be one of {VERIFIERS}, got {verifier!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget must be an int >= 0, got {budget!r}")
        if budget > MAX_BUDGET:
            raise ValueError(f"budget must be <= {MAX_BUDGET} (the builder holds budget x min(budget, V) candidates), got {budget}")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        vmethod = method if method in VERIFIERS else verifier
        speculative = method != "autoregressive"
        if speculative and self.drafter is None:
            raise ValueError(f"method {method!r} needs a drafter; load one or use method='autoregressive'")
        K = None
        if speculative:
            K = self.drafter.block_size if block_size is None else block_size
            if isinstance(K, bool) or not isinstance(K, int) or not 2 <= K <= self.drafter.block_size:
                raise ValueError(f"block_size must be an int in [2, {self.drafter.block_size}], got {block_size!r}")
        for req in requests:
            m = req.max_new_tokens
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"max_new_tokens must be an int >= 1, got {m!r}")
            sp = SamplingParams(temperature=0.0) if req.sampling is None else req.sampling
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling must be a SamplingParams, got {type(sp).__name__}")
            sp.validate(1)
            for name in ("temperature", "top_k", "top_p", "min_p"):
                if isinstance(getattr(sp, name), torch.Tensor) and getattr(sp, name).numel() != 1:
                    raise ValueError(f"sampling.{name}: one value per request (pass a list of SamplingParams)")
            if vmethod == "greedy" and not sp.all_greedy():
                raise ValueError("verifier 'greedy' is exact only at temperature < 1e-5; use tev, predraw or sequential")
            if isinstance(req.seed, bool) or not isinstance(req.seed, int):
                raise ValueError(f"seed must be an int, got {req.seed!r}")
            ss = req.stop_strings
            if ss is not None:
                if isinstance(ss, str) or not all(isinstance(s, str) and s for s in ss):
                    raise ValueError("stop_strings must be a list of non-empty strings")
                if self.tokenizer is None:
                    raise ValueError("stop_strings need a tokenizer")
            (req.controls or Controls()).validate(self.vocab_size)
        return K, vmethod

    def _prepare(self, requests, chat_template, vmethod) -> list[_Row]:
        rows = []
        for i, req in enumerate(requests):
            p = req.prompt
            if isinstance(p, str):
                ids = self.encode(p, chat_template)
            elif isinstance(p, torch.Tensor):
                ids = p.reshape(-1).tolist()
            else:
                ids = [int(t) for t in p]
            if len(ids) == 0:
                raise ValueError("prompt must hold at least one token")
            if len(ids) > self.max_positions:
                raise ValueError(f"prompt has {len(ids)} tokens, more than the model's {self.max_positions} positions")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
            sp = SamplingParams(temperature=0.0) if req.sampling is None else req.sampling
            req = Request(ids, sp, req.seed, req.max_new_tokens, req.stop_token_ids, req.stop_strings, req.ignore_eos,
                          req.controls)
            greedy = sp.all_greedy()
            gen = None if greedy else torch.Generator(device=self.device).manual_seed(req.seed)
            rows.append(_Row(i, req, ids, self._stop_ids(req.stop_token_ids, req.ignore_eos), greedy, gen))
        return rows

    def _finish(self, rows: list[_Row], single: bool, run) -> None:
        unknown: set[int] = set()
        ntok = None
        if self.tokenizer is not None and hasattr(self.tokenizer, "__len__"):
            ntok = len(self.tokenizer)
        for r in rows:
            res = r.result
            if self.tokenizer is not None:
                res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
                if ntok is not None:
                    res.unknown_token_ids = [t for t in res.token_ids if t >= ntok]
                unknown.update(res.unknown_token_ids)
        if unknown:
            warnings.warn(f"generated token ids {sorted(unknown)} are past the tokenizer ({ntok} tokens; the model has "
                          f"{self.vocab_size} rows): they are in token_ids and counted, but not in the text. The law "
                          "is exact (plain decoding would emit them too).", stacklevel=3)
        if single:
            r = rows[0]
            self.committed = torch.tensor([r.ids], dtype=torch.int64, device=self.device)
            self.past_len = r.past_len
        else:
            self.committed, self.past_len = None, None

    def _cut(self, block, so_far, stops, stop_strings, remaining):
        """Cut a round's block at the first stop token / stop string (inclusive) and at the budget."""
        reason = None
        if len(block) >= remaining:
            block = block[:remaining]
            reason = "length"
        for i, tok in enumerate(block):
            if tok in stops:
                return block[: i + 1], "stop"
        if stop_strings:
            base = len(so_far)
            full = so_far + block
            # Decode only a window of recent tokens: an occurrence completed by token i ends in
            # it, and a character spans at most 4 byte-level tokens, so 4 * len + 8 tokens cover
            # it with room at the left edge (where a partial character or a tokenizer's stripped
            # leading space may differ from the full decode). Earlier occurrences would have
            # stopped earlier rounds. Cost per token: O(longest stop string), not O(output).
            window = 4 * max(len(s) for s in stop_strings) + 8
            for i in range(len(block)):
                end = base + i + 1
                text = self.tokenizer.decode(full[max(0, end - window): end], skip_special_tokens=False)
                if any(s in text for s in stop_strings):
                    return block[: i + 1], "stop"
        return block, reason


def _gather_nodes(feats: torch.Tensor, nodes: list[int]) -> torch.Tensor:
    """``feats[:, nodes]`` of one row's features [1, N, F] (on CPU one C copy, no index tensor)."""
    gather = native("gather_rows") if feats.device.type == "cpu" and feats.is_contiguous() else None
    if gather is None:
        return feats.index_select(1, torch.tensor(nodes, device=feats.device))
    out = feats.new_empty(1, len(nodes), feats.shape[-1])
    row_bytes = feats.shape[-1] * feats.element_size()
    idx = (ctypes.c_int64 * len(nodes))(*nodes)
    gather(feats.data_ptr(), row_bytes, ctypes.addressof(idx), len(nodes), out.data_ptr())
    return out


def _root_only(roots: torch.Tensor) -> DraftTree:
    """Root-only trees (autoregressive steps), built without a host sync."""
    b = roots.shape[0]
    dev = roots.device
    return DraftTree(torch.full((b, 1), -1, dtype=torch.int64, device=dev), roots.view(b, 1).clone(),
                     torch.ones(b, 1, dtype=torch.bool, device=dev), torch.zeros(b, 1, dtype=torch.int64, device=dev),
                     torch.ones(b, 1, 1, dtype=torch.bool, device=dev), 0)


def _pad_to(tree: DraftTree, n: int) -> DraftTree:
    b, n0 = tree.parents.shape
    z = lambda dt: torch.zeros(b, n - n0, dtype=dt, device=tree.device)  # noqa: E731
    return DraftTree.from_parents(torch.cat([tree.parents, z(torch.int64)], 1), torch.cat([tree.tokens, z(torch.int64)], 1),
                                  torch.cat([tree.valid, z(torch.bool)], 1), validate=False)
