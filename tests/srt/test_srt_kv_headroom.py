"""The ``req_to_token`` row headroom (``sglang_tev.srt.kv_headroom``): the arithmetic over a grid
of tree sizes, block sizes, page sizes and overlap lags against SGLang's own reservation function,
and the hook through SGLang's real ``load_plugins()`` in a fresh process (issue 25, item 1).

The end-to-end sweep on the real Engine is in ``tests/engine/test_sglang_kv_edges.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_tev.testing.sglang_cpu.hosts import require_sglang  # noqa: E402

require_sglang()

from sglang_tev.srt.kv_headroom import check_row_headroom, overlap_reserve_need, required_row_extra  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "sglang_tev" / "assets" / "tiny-code"
CONTEXT = 2048


def _reserved_end(committed: int, allocated: int, reserve: int, page_size: int) -> int:
    """The end of a request's reservation after SGLang's ``prepare_for_decode``
    (``allocation_sizing.page_aligned_decode_alloc_lens``, the function itself)."""
    from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens

    req = SimpleNamespace(kv=SimpleNamespace(kv_committed_len=committed, kv_allocated_len=allocated))
    _, nxt, _ = page_aligned_decode_alloc_lens([req], reserve=reserve, page_size=page_size)
    return nxt[0]


GRID = [(n, k, p) for n in (2, 9, 17, 65, 129, 1024) for k in (2, 8, 16, 32) for p in (1, 16, 64) if k <= 2 * n]


@pytest.mark.parametrize("n,k,page", GRID, ids=[f"N{n}-K{k}-page{p}" for n, k, p in GRID])
def test_every_slot_a_step_touches_lies_inside_the_row(n, k, page):
    """For every committed length up to the last position and an overlap lag of 0 or D + 1 tokens
    (the reservation is made from a committed length that lags the worker's): the reservation
    (2N from the lagging length, page-rounded), the draft block (K) and the verify window (N) from
    the worker's committed length all end inside ``context + required_row_extra``."""
    row = CONTEXT + required_row_extra(n, k, page)
    d = k - 1
    for lag in (0, d + 1):
        allocated = 0
        for c in range(max(0, CONTEXT - 3 * max(n, k) - page), CONTEXT):
            seen = max(0, c - lag)
            allocated = max(allocated, _reserved_end(seen, allocated, 2 * n, page))
            assert allocated <= row, (c, lag)
            assert c + max(n, k) <= row, (c, lag)


OVERLAP_GRID = [(n, k, d, p) for n in (2, 3, 9, 13, 17, 65) for k in (4, 8, 16) for d in (1, 3, k - 1) for p in (1, 16)]


@pytest.mark.parametrize("n,k,d,page", OVERLAP_GRID, ids=[f"N{n}-K{k}-D{d}-page{p}" for n, k, d, p in OVERLAP_GRID])
def test_overlap_reserve_covers_a_lagging_step_exactly_when_the_rule_says(n, k, d, page):
    """Overlap scheduling: the reservation of step t + 1 is made from the committed length before
    step t's commit (SGLang's ``page_aligned_decode_alloc_lens``, the function itself); step t
    commits up to min(D, N - 1) + 1 tokens; step t + 1 writes max(N, K) slots from the true
    committed length. Worst-case commits every step: the writes stay inside the allocation when
    ``overlap_reserve_need <= 2N``, and at page size 1 only then."""
    commit = min(d, n - 1) + 1
    c_seen, c_true, allocated, overflow = 0, 0, 0, False
    for _ in range(8):
        allocated = max(allocated, _reserved_end(c_seen, allocated, 2 * n, page))
        # this step writes its draft block and verify window from the worker's committed length
        overflow |= c_true + max(n, k) > allocated
        c_seen, c_true = c_true, c_true + commit  # the scheduler learns of a step one step late
    fits = overlap_reserve_need(n, k, d) <= 2 * n
    if fits:
        assert not overflow
    if page == 1:  # page rounding can only add room; at page size 1 the rule is exact
        assert overflow is (not fits), (overlap_reserve_need(n, k, d), 2 * n)


def test_overlap_reserve_need_arguments():
    assert overlap_reserve_need(65, 16, 15) == 81 and overlap_reserve_need(9, 16, 15) == 25
    assert overlap_reserve_need(3, 8, 7) == 11  # the accepted path is at most N - 1 deep
    for bad in ({"tree_size": 0}, {"block_size": 0}, {"max_depth": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            overlap_reserve_need(**{**dict(tree_size=9, block_size=16, max_depth=3), **bad})


def test_sglang_row_sizing_alone_overruns_at_page_size_one():
    """The bug this module fixes: SGLang's row headroom (4 + max(N, K) at page size 1) is shorter
    than a step's reservation once the committed length passes context - (N - 4)."""
    n, k = 65, 16
    sglang_row = CONTEXT + 4 + max(n, k)
    ends = [_reserved_end(c, 0, 2 * n, 1) for c in range(CONTEXT - 70, CONTEXT)]
    overruns = [c for c, e in zip(range(CONTEXT - 70, CONTEXT), ends) if e > sglang_row]
    assert overruns and overruns[0] == CONTEXT - (n - 4) + 1  # the first length past context - (N - 4)
    assert max(ends) <= CONTEXT + required_row_extra(n, k, 1)


def test_required_row_extra_and_the_startup_check():
    assert required_row_extra(65, 16, 1) == 130
    assert required_row_extra(9, 16, 1) == 32  # the draft block is wider than the tree
    assert required_row_extra(17, 16, 64) == 34 + 63
    for bad in ({"tree_size": 0}, {"block_size": 0}, {"page_size": 0}):
        kw = {**dict(tree_size=9, block_size=16, page_size=1), **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            required_row_extra(**kw)
    check_row_headroom(row_len=CONTEXT + 130, context_len=CONTEXT, tree_size=65, block_size=16, page_size=1)
    with pytest.raises(RuntimeError, match=r"reserves up to 2178 .*hook .* was not applied"):
        check_row_headroom(row_len=CONTEXT + 69, context_len=CONTEXT, tree_size=65, block_size=16, page_size=1)


def test_load_plugins_raises_the_row_headroom_for_tev_only(tmp_path):
    """In a fresh process, after SGLang's ``load_plugins()``: a TEV scheduler's
    ``get_req_to_token_extra_context_len`` (and the binding ``kv_cache_configurator`` builds the
    pool with) answers ``2 * max(N, K) + page - 1``; a DFLASH scheduler keeps SGLang's own
    ``4 + N``."""
    code = textwrap.dedent(
        f"""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.mem_cache import allocation_sizing, kv_cache_configurator
        from sglang.srt.runtime_context import publish, reset_context
        from sglang.srt.server_args import prepare_server_args
        base = ["--model-path", {str(TINY / "target")!r}, "--speculative-draft-model-path", {str(TINY / "draft")!r},
                "--device", "cuda"]
        for algo, n in (("TEV", 65), ("TEV", 9), ("DFLASH", 16)):
            sa = prepare_server_args(base + ["--speculative-algorithm", algo, "--speculative-num-draft-tokens", str(n)])
            sa.resolve_once()
            publish(sa, role="scheduler")
            print(algo, n, allocation_sizing.get_req_to_token_extra_context_len(),
                  kv_cache_configurator.get_req_to_token_extra_context_len())
            reset_context()
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()[-3:]
    assert lines == ["TEV 65 130 130", "TEV 9 32 32", "DFLASH 16 20 20"], res.stdout[-2000:]
