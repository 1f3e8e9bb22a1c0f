"""KV headroom past the context length: every slot a TEV decode step reserves or writes stays
inside its request's ``req_to_token`` row (the row sizing is the one SGLang setting TEV changes).

SGLang 0.5.23 sizes each request's ``req_to_token`` row as ``context_len + extra`` with
``extra = 4 + max_speculative_num_draft_tokens`` at page size 1
(``srt/mem_cache/allocation_sizing.py:96-116``, ``get_req_to_token_extra_context_len``), while every
decode step of the DFlash family reserves ``2 * speculative_num_draft_tokens`` slots past the
committed length (``srt/speculative/dflash_info_v2.py:142-154``, ``prepare_for_decode`` ->
``page_aligned_decode_alloc_lens``). With N = ``speculative_num_draft_tokens``, a request whose
committed length passes ``context_len - (N - 4)`` reserves past its row's end: SGLang's CPU path
raises in the scheduler (the server exits, every request in flight is lost) and a GPU's Triton
assign kernel, which masks only against the row's own offsets, would write into the next
request's row. Only page sizes > 1 get the 2N headroom upstream (line 112-115).

What a TEV step touches, for a request with committed length ``c <= context_len - 1``:

* the reservation: ``[c, ceil_page(c + 2N))`` (the 2N double buffer absorbs overlap scheduling's
  lagging committed length);
* the draft block: K slots from ``c``; the verify window: N slots from ``c`` (the accepted path is
  moved to the front of that window).

So a row needs ``context_len + 2 * max(N, K) + page_size - 1`` entries (:func:`required_row_extra`);
K <= 2N is already enforced at start-up. :func:`install_row_headroom_hook` makes SGLang size rows
that way for TEV servers (a ``HookRegistry`` AFTER hook: SGLang's own extension point, no installed
file is edited), and :func:`check_row_headroom` is the worker's check, on its first decode round
(the pools do not exist yet when the worker is built), that the hook took effect. The KV pool itself is guarded by SGLang's scheduler (``check_decode_mem`` retracts requests
when the next step's reservation does not fit), which TEV does not change.
"""

from __future__ import annotations

__all__ = ["required_row_extra", "overlap_reserve_need", "check_row_headroom", "install_row_headroom_hook"]

_TARGET = "sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len"
_installed = False


def required_row_extra(tree_size: int, block_size: int, page_size: int) -> int:
    """Entries a ``req_to_token`` row needs past ``context_len`` for a TEV decode step.

    Args:
        tree_size: N = B + 1 (``--speculative-num-draft-tokens``); SGLang reserves 2N per step.
        block_size: K, the drafter's block (K slots written from the committed length).
        page_size: the KV allocator's page size (the reservation is rounded up to a page).
    Returns:
        ``2 * max(N, K) + page_size - 1``.
    Raises:
        ValueError naming the argument when one is < 1.
    """
    for name, v in (("tree_size", tree_size), ("block_size", block_size), ("page_size", page_size)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return 2 * max(int(tree_size), int(block_size)) + int(page_size) - 1


def overlap_reserve_need(tree_size: int, block_size: int, max_depth: int) -> int:
    """KV slots past the scheduler's committed length that a TEV step may write under overlap
    scheduling; SGLang reserves ``2 * tree_size`` of them (``dflash_info_v2.py:142-154``).

    With overlap on, ``prepare_for_decode`` of step t + 1 runs before the result of step t is
    processed (``scheduler.py:2084-2120``, ``event_loop_overlap``), so it reserves from a committed
    length that lags the worker's by step t's commit: at most ``min(D, N - 1) + 1`` tokens (the
    accepted path plus the bonus). Step t + 1 then writes ``max(N, K)`` slots (the draft block and
    the verify window) from the worker's committed length.

    Args:
        tree_size: N; block_size: K; max_depth: D (deepest drafted node).
    Returns:
        ``max(N, K) + min(D, N - 1) + 1``; overlap is safe when it is ``<= 2 * N``.
    Raises:
        ValueError naming the argument when one is < 1.
    """
    for name, v in (("tree_size", tree_size), ("block_size", block_size), ("max_depth", max_depth)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    n, k, d = int(tree_size), int(block_size), int(max_depth)
    return max(n, k) + min(d, n - 1) + 1


def check_row_headroom(row_len: int, context_len: int, tree_size: int, block_size: int, page_size: int) -> None:
    """Refuse to serve when a ``req_to_token`` row is too short for a TEV step at the context edge
    (the worker calls it once, on its first decode round).

    Args:
        row_len: ``req_to_token.shape[1]``.
        context_len: the model's context length (``model_config.context_len``).
        tree_size, block_size, page_size: as :func:`required_row_extra`.
    Raises:
        RuntimeError saying how short the row is (the headroom hook was not applied).
    """
    need = int(context_len) + required_row_extra(tree_size, block_size, page_size)
    if int(row_len) < need:
        raise RuntimeError(
            f"TEV: req_to_token rows hold {row_len} slots but a decode step near the context length "
            f"({context_len}) reserves up to {need} (2 x max(N={tree_size}, K={block_size}) + page {page_size} - 1 "
            f"past it); the plugin's row-headroom hook on {_TARGET} was not applied"
        )


def _after_extra(result, *args, **kwargs):
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_page_size
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    if str(spec.speculative_algorithm or "").upper() != "TEV":
        return result
    n = int(spec.speculative_num_draft_tokens or 1)
    k = int(spec.speculative_dflash_block_size or 1)
    return max(int(result), required_row_extra(n, k, get_alloc_page_size()))


def install_row_headroom_hook() -> None:
    """Register :func:`required_row_extra` as a floor on SGLang's row headroom for TEV servers
    (``HookRegistry`` AFTER hook on ``get_req_to_token_extra_context_len``; ``load_plugins()``
    applies it in every SGLang process before the pools are built). Idempotent; servers running
    another algorithm keep SGLang's sizing."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(_TARGET, _after_extra, HookType.AFTER)
    _installed = True
