"""The README's first-hour instructions agree with what CI runs and with the tests' own skips."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def test_readme_test_command_is_what_ci_runs_and_names_what_enables_the_skipped_tests():
    block = re.search(r"```bash\n(.*?)```", section("Run the tests"), re.S).group(1)
    readme = commands(block)
    ci = [c for c in commands((ROOT / ".ci" / "run").read_text()) if c.startswith(("pip ", "python "))]
    assert readme == ci, (readme, ci)  # the README runs the whole suite, as CI does
    assert 'pip install --no-deps "dflash==0.1.0"' in readme
    skip_reason = (ROOT / "tests" / "test_dflash.py").read_text()
    assert "pip install --no-deps dflash==0.1.0" in skip_reason  # the skip message names the same command
    assert "5 skipped" in section("Run the tests")


def test_readme_says_what_a_cpu_only_install_pulls_and_how_to_avoid_it():
    install = section("Install")
    assert "6 GB" in install and "https://download.pytorch.org/whl/cpu" in install


def test_readme_shows_what_the_tiny_pair_prints():
    main_job = section("Run the main job")
    assert "plausible-looking, repetitive" in main_job and "[sglang-tev] 256 tokens" in main_job
