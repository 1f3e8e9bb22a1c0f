"""The scheduler of one ``generate_batch`` call: which request sits in which batch slot, and the
device buffers the rounds run on.

Active rows are packed at the front of a fixed-capacity batch (``rows[i]`` is in slot i of every
buffer). Waiting prompts are prefilled into free slots; a finished row's slot is refilled with the
next waiting prompt, or the last active row moves into it and the batch shrinks, so a finished row
costs nothing afterwards. The prefill covers a prompt minus its last token (the first round's
root). The static KV cache and the captured CUDA graphs that hold its buffers outlive a call: the
generator keeps them in :class:`DecodeBuffers` and hands them in; everything else (committed
tokens, control state, kept tree mask) belongs to the call. Each round is ``hf/round.py``'s
:func:`~sglang_tev.hf.round.run_round` on the one :class:`~sglang_tev.hf.round.BatchState`.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch

from ..plan import BudgetPolicy
from .control_state import ControlState
from .masks import KeptTreeMask, prefill_masks
from .records import Row
from .round import BatchState, eager_tree_forward, flush_context, run_round
from .static_cache import StaticKVCache
from .target import TargetModel

__all__ = ["DecodeBuffers", "Scheduler"]


class DecodeBuffers:
    """The device state one generator keeps across its calls: the static KV cache, the captured
    tree forwards (they hold the cache's buffers, so with CUDA graphs a call that fits reuses both)
    and the static slot tensors per (rows, nodes).

    Args:
        cuda_graphs: capture the tree forwards (CUDA only, unless ``graph_backend`` stands in).
        graph_backend: the capture / replay backend of
            :class:`~sglang_tev.hf.cuda_graphs.GraphedTreeForward` (None: CUDA graphs).

    Attributes:
        cache: the last call's :class:`StaticKVCache` (None before the first call).
        graphs: :class:`~sglang_tev.hf.cuda_graphs.GraphedTreeForward` or None.
    """

    def __init__(self, cuda_graphs: bool, graph_backend=None) -> None:
        self.cuda_graphs = cuda_graphs
        self.graph_backend = graph_backend
        self.cache: StaticKVCache | None = None
        self.graphs = None
        self.static_slots: dict = {}
        self._key: tuple[int, int] | None = None  # (rows, max_len) the graphs were captured for

    def claim(self, cap: int, max_len: int, num_layers: int, device, dtype) -> int:
        """Make the cache ready for ``cap`` rows of at least ``max_len`` slots; returns its slots
        per row. With CUDA graphs the length is rounded up to a multiple of 256 and a cache (and its
        graphs) that already fits is kept; otherwise every call gets a new one."""
        reuse = self.cuda_graphs and self._key is not None and self._key[0] == cap and self._key[1] >= max_len
        if self.cuda_graphs:
            max_len = self._key[1] if reuse else -(-max_len // 256) * 256
        if not reuse:
            self.cache = StaticKVCache(cap, max_len, num_layers, device, dtype)
            self.graphs, self.static_slots = None, {}
            self._key = (cap, max_len) if self.cuda_graphs else None
        return max_len

    def graphed(self, forward: Callable):
        """The captured tree forwards, now running ``forward`` (the eager forward on this call's
        state: the same cache buffers); None without CUDA graphs."""
        if not self.cuda_graphs:
            return None
        from .cuda_graphs import GraphedTreeForward

        if self.graphs is None:
            self.graphs = GraphedTreeForward(forward, backend=self.graph_backend)
        else:
            self.graphs.forward = forward
        return self.graphs


class Scheduler:
    """One call's batch: its waiting and active rows, its buffers, its rounds.

    Args:
        target: the :class:`TargetModel`; drafter: a BatchDrafter or None.
        buffers: the generator's :class:`DecodeBuffers`.
        rows: the call's requests as :class:`Row` s, in input order.
        cap: batch slots.
        method, verifier, block_size: checked by the generator.
        policy: the call's :class:`~sglang_tev.plan.BudgetPolicy`; its ``capacity`` sizes the
            buffers (N = 1 + capacity), each round runs the plan it returns.
        stream: ``fn(request index, ids)`` or None.
        tokenizer: for stop strings (or None).
        static: fixed shapes for every tree forward; time_stages: sync after each stage (CUDA).
        draft_mode: ``"marginal"`` or ``"lattice"`` (resolved by the generator; None or anything
            else for autoregressive calls reads as marginal).
    """

    def __init__(self, target: TargetModel, drafter, buffers: DecodeBuffers, rows: list[Row], cap: int, method: str,
                 verifier: str, policy: BudgetPolicy, block_size: int | None, stream, *, tokenizer, static: bool,
                 time_stages: bool, draft_mode: str | None = "marginal") -> None:
        self.target, self.drafter = target, drafter
        dev = target.device
        speculative = method != "autoregressive"
        n_nodes = 1 if not speculative else (block_size if method == "chain" else 1 + policy.capacity)
        self.waiting = list(rows)
        self.cap = cap
        longest = max(min(len(r.ids) + r.req.max_new_tokens, target.max_positions) for r in rows)
        max_len = buffers.claim(cap, longest + n_nodes + 1, target.num_layers, dev, target.dtype)
        layer_ids = getattr(drafter, "target_layer_ids", None) if speculative else None
        controls = ControlState([r.controls for r in rows], cap, target.vocab_size, dev)
        tokens = torch.zeros(cap, max_len, dtype=torch.int64, device=dev)
        if speculative:
            drafter.start(cap, max_len, dev)
        self.state = BatchState(
            method=method, verifier=verifier, policy=policy, block_size=block_size, n_nodes=n_nodes, static=static,
            time_stages=time_stages, stream=stream, tokenizer=tokenizer, target=target, drafter=drafter,
            layer_ids=layer_ids if layer_ids else None,
            # the committed-token buffer feeds drafters that read tokens and user processors / penalties
            need_tokens=(speculative and getattr(drafter, "reads_tokens", True)) or controls.active,
            cache=buffers.cache, tokens=tokens, controls=controls, kept_mask=KeptTreeMask(cap, max_len, target.float_dtype, dev),
            static_slots=buffers.static_slots, slot_ids=torch.arange(max_len + n_nodes, device=dev),  # slot / position ids, sliced
            draft_mode="lattice" if speculative and draft_mode == "lattice" else "marginal",
        )
        self.state.graphs = buffers.graphed(functools.partial(eager_tree_forward, self.state))

    @property
    def active(self) -> list[Row]:
        return self.state.rows

    def run(self) -> None:
        """Decode every row to its end."""
        self._fill(list(range(self.cap)))
        while self.active:
            self._retire_at_position_limit()
            if not self.active:
                break
            for slot in reversed(run_round(self.state)):
                self._retire(slot)

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

    def _prefill(self, first_slot: int, rows: list[Row]) -> None:
        """Ragged prefill of the prompts (minus their last token) of ``rows`` into consecutive slots."""
        st, target, dev = self.state, self.target, self.target.device
        t0 = time.perf_counter()
        b = len(rows)
        sl = slice(first_slot, first_slot + b)
        lens = [len(r.ids) - 1 for r in rows]
        for i, r in enumerate(rows):
            st.tokens[first_slot + i, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.int64)
            st.controls.start_row(first_slot + i, r.ids, r.controls)
        t = max(lens)
        if t > 0:
            ids = st.tokens[sl, :t]
            pos = torch.arange(t, device=dev).expand(b, t)
            lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
            st.cache.begin(sl, 0, t)
            _, feats = target.forward(ids, pos, target.attention_mask(prefill_masks(target.layout, lens_t, t)), st.cache,
                                      st.layer_ids, logits_to_keep=1)
            if feats is not None:
                self.drafter.add_context(sl, feats, pos)
        target.sync()
        now = time.perf_counter()
        for r in rows:
            r.result.prefill_s = (now - t0) / b
            r.t_start = now
        st.sampling_key = None  # rows changed: the batch's SamplingParams are rebuilt

    def _retire(self, slot: int) -> None:
        """Row in ``slot`` is done: refill the slot from the waiting list, or move the last active
        row into it and shrink the batch."""
        st = self.state
        flush_context(st)
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
            st.cache.move_row(last, slot, moved.past_len)
            st.tokens[slot, :length] = st.tokens[last, :length]
            st.controls.move_row(last, slot)
            if st.speculative:
                self.drafter.move_row(last, slot, moved.past_len)
            self.active[slot] = moved
        self.active.pop()
        st.sampling_key = None

    def _retire_at_position_limit(self) -> None:
        """Rows that cannot take another round (position limit) finish here."""
        i = 0
        while i < len(self.active):
            r = self.active[i]
            if self.target.max_positions - 1 - r.past_len < 0:
                r.result.finish_reason = "position_limit"
                self._retire(i)
                continue
            i += 1
