"""The README's first-hour instructions agree with what CI runs and with the tests' own skips."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def commands(block: str) -> list[str]:
    """Shell commands of a bash block, comments dropped, `python -m pip` -> `pip`, `-q` dropped."""
    out = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(re.sub(r"\s+-q\b", "", line.replace("python -m pip ", "pip ")))
    return out


def test_readme_test_command_is_one_command_that_ci_runs_and_names_what_enables_the_skipped_tests():
    block = re.search(r"```bash\n(.*?)```", section("Run the tests"), re.S).group(1)
    assert commands(block) == ["scripts/run_tests.sh"]  # one command on a fresh clone
    ci = commands((ROOT / ".ci" / "run").read_text())
    assert "scripts/run_tests.sh" in ci and "export SGLANG_TEV_REQUIRE_SGLANG=1" in ci
    assert not [c for c in ci if c.startswith(("pip ", "python "))]  # CI runs the README's command, nothing else
    script = commands((ROOT / "scripts" / "run_tests.sh").read_text())
    assert 'pip install -e ".[test,sglang]"' in script  # the sglang extra: plugin tests run, not skip
    assert 'pip install --no-deps "dflash==0.1.0"' in script
    assert "export SGLANG_TEV_REQUIRE_SGLANG=1" in script
    # -q dropped by commands(); the whole suite without arguments (FAST is empty unless --fast);
    # --durations only prints the slowest tests (CI's time budget is read from it)
    assert script[-1] == 'python -m pytest --durations=25 "${FAST[@]}" "$@"' and "FAST=()" in script
    text = (ROOT / "scripts" / "run_tests.sh").read_text()
    assert '--fast) FAST=(-m "not slow"); INSTALL=0' in text  # --fast: the inner loop, no install
    assert "-q" in (ROOT / "scripts" / "run_tests.sh").read_text().splitlines()[-1]
    assert 'pip install --no-deps "dflash==0.1.0"' in section("Run the tests")
    skip_reason = (ROOT / "tests" / "runtime" / "test_dflash.py").read_text()
    assert "pip install --no-deps dflash==0.1.0" in skip_reason  # the skip message names the same command
    assert "5 skipped" in section("Run the tests")


def test_readme_says_what_a_cpu_only_install_pulls_and_how_to_avoid_it():
    install = section("Install")
    assert "6 GB" in install and "https://download.pytorch.org/whl/cpu" in install


def test_readme_shows_what_the_tiny_pair_prints():
    main_job = section("Run the main job")
    assert "plausible-looking, repetitive" in main_job and "[sglang-tev] 256 tokens" in main_job
