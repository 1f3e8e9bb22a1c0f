#!/usr/bin/env bash
# Install sglang-tev with everything its tests use, then run the test suite (CPU only, no network
# at test time). What .ci/run runs on a clean checkout.
#
#   scripts/run_tests.sh                       install, then the whole suite
#   scripts/run_tests.sh tests/core/test_tree.py    install, then pytest on those arguments
#   scripts/run_tests.sh --no-install [ARGS]   skip the install (already done), run pytest
#   scripts/run_tests.sh --fast [ARGS]         the inner loop: no install, `-m "not slow"` (no
#                                              SGLang Engines/servers, no training or build runs)
#   scripts/run_tests.sh --core [ARGS]         no install, the core tier only (tests/core: torch
#                                              only, under a minute)
#
# Installs: the package in editable mode with the `test` and `sglang` extras (sglang 0.5.23 for
# the plugin tests; it pins torch 2.14.1 and transformers 5.19), and z-lab's reference drafter
# `dflash==0.1.0` (the CPU oracle of tests/runtime/test_dflash.py) with --no-deps, because it pins exact
# old versions of tqdm, datasets and requests; its own imports are ours.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
FAST=()
INSTALL=1
# the script's own flags come first, in any order (--fast implies --no-install)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --fast) FAST=(-m "not slow"); INSTALL=0; shift ;;
        --core) FAST=(tests/core); INSTALL=0; shift ;;
        --no-install) INSTALL=0; shift ;;
        *) break ;;
    esac
done
if [[ $INSTALL == 1 ]]; then
    python -m pip install -q -e ".[test,sglang]"
    python -m pip install -q --no-deps "dflash==0.1.0"
    # sglang was installed above: its tests must run, not skip
    export SGLANG_TEV_REQUIRE_SGLANG=1
fi
python -m pytest -q --durations=25 "${FAST[@]}" "$@"
