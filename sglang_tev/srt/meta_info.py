"""TEV's per-round values in each request's ``meta_info``, complete on long and streamed requests,
and the periodic log line of a TEV server.

Each verify round appends, per request, ``tev_accept_length`` (tokens emitted: accepted drafts plus
the bonus token), ``tev_exit_depth`` (depth of the exit node), ``tev_coverage`` (the tree's coverage
of the target law, 1 + C_p of the paper's Eq. 6 counted from the root) and ``tev_budget`` (drafted
nodes in the request's tree this round: the planned budget B, fewer near the context's end) through
SGLang's ``customized_info``.

Why hooks: SGLang 0.5.23 treats ``customized_info`` values as per-output-token lists. The scheduler
appends one element per forward (``batch_result_processor.py:192-211``) and, at every send, slices
``values[send_token_offset : len(output_ids)]`` (``output_streamer.py:700-707``); a non-streamed
request is sent whenever its output length is a multiple of 50 (``output_streamer.py:476``), a
streamed one every few tokens. One element per round indexed as if per token loses every round
after the first send (169 of 205 rounds came back on a long request). So:

* scheduler side (:func:`align_round_values`, around ``_maybe_collect_customized_info``): a round's
  value is stored at the index of the round's last visible output token, ``None`` at the others,
  so the list is token-aligned and every slice carries exactly the rounds whose tokens it sends;
* tokenizer side (:func:`compact_round_values`, after ``TokenizerManager.update_request_meta_info``,
  which accumulates the slices): the ``None`` fillers are dropped, so a user reads one value per
  round, as before.

Both hooks touch only :data:`META_INFO_KEYS`; a server running another algorithm is unaffected.
Without the tokenizer-side hook (a front end that does not load plugins) a user still gets every
round, as a per-token list with ``None`` between rounds.
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "META_INFO_KEYS",
    "RoundColumn",
    "round_info_to_host",
    "align_round_values",
    "compact_round_values",
    "install_meta_info_hooks",
    "RoundLog",
]

META_INFO_KEYS = ("tev_accept_length", "tev_exit_depth", "tev_coverage", "tev_budget")
"""Per-round values appended to each request's ``meta_info`` (SGLang's ``customized_info``)."""

_COLLECT = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._maybe_collect_customized_info"
_ACCUMULATE = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"
_installed = False

logger = logging.getLogger(__name__)
_MAX_UNREAD = 2  # rounds a log line may wait for (the newest one or two are in flight under overlap)


class RoundColumn:
    """One per-round value per request (a ``customized_info`` column) in host memory.

    SGLang's result processor reads ``column[i]`` for request i
    (``batch_result_processor.py:192-211``) only after ``copy_done.synchronize()``
    (``:957-958``); the scheduler records ``copy_done`` on a stream ordered after the forward
    (``scheduler.py:4731-4745, 4854-4863, 5019-5042``), so the non-blocking copy that filled
    ``host`` has completed by then: reading it costs no device sync of its own.

    Args:
        host: float32 [len(META_INFO_KEYS), bs] in host memory (pinned on CUDA).
        row: which row; cast: ``int`` or ``float`` for the values handed out.
    """

    __slots__ = ("host", "row", "cast", "_values")

    def __init__(self, host: torch.Tensor, row: int, cast) -> None:
        self.host, self.row, self.cast, self._values = host, row, cast, None

    def _read(self) -> list:
        if self._values is None:
            self._values = [self.cast(v) for v in self.host[self.row].tolist()]
        return self._values

    def __getitem__(self, i):
        return self._read()[i]

    def peek(self) -> list | None:
        """The values if the scheduler has read them already, else None (never reads ``host``)."""
        return self._values

    def __len__(self) -> int:
        return int(self.host.shape[1])

    def __iter__(self):
        return iter(self._read())


def round_info_to_host(
    commit_lens: torch.Tensor, exit_depth: torch.Tensor, coverage: torch.Tensor, budget: torch.Tensor
) -> dict:
    """The round's ``customized_info`` (:data:`META_INFO_KEYS`) with ONE non-blocking copy.

    Args:
        commit_lens: int [bs] tokens emitted this round; exit_depth: int [bs] depth of the exit
            node; coverage: float [bs] the tree's coverage of the target law; budget: int [bs]
            drafted nodes in each request's tree this round.
    Returns:
        ``{key: RoundColumn}`` over one host tensor float32 [len(META_INFO_KEYS), bs]: on CUDA a
        pinned buffer filled by ``copy_(non_blocking=True)`` (fenced by the scheduler's
        ``copy_done``), on CPU the stacked tensor itself. SGLang's scheduler keeps the values
        token-aligned and its tokenizer manager hands out one per round (``meta_info.py``).
    """
    info = torch.stack([commit_lens.float(), exit_depth.float(), coverage.float(), budget.float()])
    if info.is_cuda:
        host = torch.empty(info.shape, dtype=info.dtype, pin_memory=True)
        host.copy_(info, non_blocking=True)
    else:
        host = info
    return round_columns(host)


def plain_round_host(bs: int) -> torch.Tensor:
    """The host values of a plain step's ``customized_info`` (every request's tree root-only): one
    token committed, exit depth 0, coverage 0, budget 0. Built on the host: no device read. The same
    every plain step of ``bs`` requests, so a worker may keep it; each round still needs columns of
    its own (:func:`round_columns`): :class:`RoundLog` tracks what the scheduler read per column.

    Args:
        bs: requests in the batch.
    Returns:
        float32 [len(META_INFO_KEYS), bs] CPU tensor.
    """
    host = torch.zeros(len(META_INFO_KEYS), bs, dtype=torch.float32)
    host[META_INFO_KEYS.index("tev_accept_length")] = 1.0
    return host


def round_columns(host: torch.Tensor) -> dict:
    """A round's ``{key: RoundColumn}`` over its host values float32 [len(META_INFO_KEYS), bs]
    (fresh column objects: each keeps whether it was read)."""
    return {key: RoundColumn(host, row, cast) for row, (key, cast) in enumerate(zip(META_INFO_KEYS, (int, int, float, int)))}


def align_round_values(req) -> None:
    """Move the round value just appended under each TEV key of ``req.customized_info`` to the
    index of the round's last visible output token (``None`` fills the tokens before it).

    Args:
        req: SGLang's ``Req`` right after ``_maybe_collect_customized_info`` appended this round's
            values; its ``output_ids`` already hold the round's tokens and ``finished_len`` (set
            when a stop condition cut the round) bounds what is sent.
    A list already as long as the visible output (a retracted and re-prefilled request whose
    output restarted) keeps the value at its end: nothing is dropped.
    """
    info = getattr(req, "customized_info", None)
    if not info:
        return
    visible = len(req.output_ids) if req.finished_len is None else min(req.finished_len, len(req.output_ids))
    for key in META_INFO_KEYS:
        values = info.get(key)
        if not values:
            continue
        value = values.pop()
        missing = visible - 1 - len(values)
        if missing > 0:
            values.extend([None] * missing)
        values.append(value)


def compact_round_values(meta_info: dict, state) -> None:
    """Drop the ``None`` fillers from the accumulated TEV lists of one request (in place, so the
    list ``meta_info`` holds, which is the same object, reads one value per round).

    Args:
        meta_info: the response's ``meta_info`` dict; state: SGLang's ``ReqState`` (its
            ``customized_info_accumulated`` holds the lists SGLang extends with each slice).
    """
    acc = getattr(state, "customized_info_accumulated", None)
    if not acc:
        return
    for key in META_INFO_KEYS:
        values = acc.get(key)
        if values is None or None not in values:
            continue
        values[:] = [v for v in values if v is not None]
        if key in meta_info:
            meta_info[key] = values


def _collect_around(original, self, i, req, logits_output, *args, **kwargs):
    result = original(self, i, req, logits_output, *args, **kwargs)
    info = getattr(logits_output, "customized_info", None) if logits_output is not None else None
    if info and META_INFO_KEYS[0] in info:
        align_round_values(req)
    return result


def _after_update(result, self, meta_info, state, customized_info, *args, **kwargs):
    if customized_info and META_INFO_KEYS[0] in customized_info:
        compact_round_values(meta_info, state)
    return result


def install_meta_info_hooks() -> None:
    """Register :func:`align_round_values` (around the scheduler's
    ``SchedulerBatchResultProcessor._maybe_collect_customized_info``) and
    :func:`compact_round_values` (after ``TokenizerManager.update_request_meta_info``) with SGLang's
    ``HookRegistry`` (``load_plugins()`` applies them in each process); idempotent."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_COLLECT, _collect_around, HookType.AROUND)
    HookRegistry.register(_ACCUMULATE, _after_update, HookType.AFTER)
    _installed = True


class RoundLog:
    """The TEV line of a server's periodic log: every ``interval`` rounds (SGLang's
    ``--decode-log-interval``), the mean planned budget, accept length, exit depth and coverage per
    request-round since the last line.

    It reads only values the scheduler has already read: each round's ``customized_info`` columns
    (``srt/worker.py`` ``RoundColumn``) are read by SGLang's result processor after its
    ``copy_done`` fence; the log takes their Python lists (:meth:`RoundColumn.peek`) and never
    touches the host tensor itself, so it costs no device sync and no tensor op inside the round.
    A round not read yet (the newest, in flight under overlap) waits for the next line; a round
    the scheduler never read (every request of it already finished) is skipped.

    Args:
        interval: rounds between lines (>= 1).
        log: a ``logging.Logger``-like object with ``info``; None = this module's logger.
    Raises:
        ValueError when ``interval`` is below 1.
    """

    def __init__(self, interval: int, log=None) -> None:
        if int(interval) < 1:
            raise ValueError(f"interval must be at least 1, got {interval!r}")
        self.interval = int(interval)
        self.log = log if log is not None else logger
        self._pending: list = []
        self._rounds = 0

    def record(self, columns) -> None:
        """One round's ``{key: column}`` (:data:`META_INFO_KEYS`; a column has ``peek()`` -> its
        per-request values once read, else None); emits a line every ``interval`` rounds."""
        self._pending.append(columns)
        self._rounds += 1
        if self._rounds % self.interval == 0:
            self.emit()

    def emit(self) -> str | None:
        """Log (and return) the line over every pending round already read; None when none is."""
        values = [[col.peek() for col in (r[k] for k in META_INFO_KEYS)] for r in self._pending]
        read = [i for i, v in enumerate(values) if all(col is not None for col in v)]
        last = read[-1] if read else -1
        # unread rounds after the newest read one wait (in flight under overlap: one or two), at
        # most _MAX_UNREAD of them, so a server whose rounds are never read keeps no growing list
        self._pending = self._pending[last + 1 :][-_MAX_UNREAD:]
        ready = [values[i] for i in read]
        if not ready:
            return None
        sums = [0.0] * len(META_INFO_KEYS)
        count = 0
        for rows in ready:
            count += len(rows[0])
            for k, row in enumerate(rows):
                sums[k] += sum(row)
        if count == 0:
            return None
        acc, depth, cov, budget = (s / count for s in sums)
        line = (
            f"TEV: {len(ready)} rounds, {count} request-rounds: mean budget {budget:.1f}, "
            f"accept length {acc:.2f}, exit depth {depth:.2f}, coverage {cov:.2f}"
        )
        self.log.info(line)
        return line
