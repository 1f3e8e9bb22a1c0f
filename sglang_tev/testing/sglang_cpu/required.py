"""Whether the SGLang plugin tests can run: one rule for every test module that needs sglang.

Without sglang they skip, saying why, unless CI requires it (``SGLANG_TEV_REQUIRE_SGLANG=1``,
set by ``scripts/run_tests.sh`` after installing it): then a missing sglang is an error, so a
broken install cannot turn into a green run of skipped tests.
"""

from __future__ import annotations

import importlib.util

import pytest

from sglang_tev import env

SKIP_REASON = "sglang is not installed (pip install 'sglang-tev[sglang]')"


def have_sglang() -> bool:
    """True when sglang imports here; raises RuntimeError when it is missing and CI requires it."""
    try:
        found = importlib.util.find_spec("sglang") is not None
    except ValueError:
        found = False
    if not found and env.get(env.REQUIRE_SGLANG):
        raise RuntimeError("SGLANG_TEV_REQUIRE_SGLANG=1 but sglang is not installed")
    return found


def require_sglang() -> None:
    """Skip the calling module without sglang (see the module docstring)."""
    if not have_sglang():
        pytest.skip(SKIP_REASON, allow_module_level=True)


needs_sglang = pytest.mark.skipif(not have_sglang(), reason=SKIP_REASON)
"""Marks single tests that need sglang in a module that runs without it."""
