"""benchmarks/verifier.py: a rerun never overwrites the committed results by default."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--budgets", "4", "--vocabs", "16", "--methods", "tev,greedy", "--device", "cpu", "--repeats", "1"]


def run(script, cwd, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script), *SMALL, *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


def test_default_output_leaves_committed_results_alone(tmp_path):
    # a copy of the script beside a stand-in for the committed file, so a regression cannot touch the real one
    bench = tmp_path / "repo" / "benchmarks"
    (bench / "results").mkdir(parents=True)
    script = bench / "verifier.py"
    shutil.copy(ROOT / "benchmarks" / "verifier.py", script)
    committed = bench / "results" / "verifier-cpu.json"
    committed.write_text('{"committed": true}\n')
    work = tmp_path / "work"
    work.mkdir()
    p = run(script, work)
    assert p.returncode == 0, p.stderr
    assert committed.read_text() == '{"committed": true}\n'
    written = list((work / "bench-results").glob("verifier-cpu-*.json"))
    assert len(written) == 1 and f"wrote {written[0].relative_to(work)}" in p.stdout
    data = json.loads(written[0].read_text())
    assert {r["method"] for r in data["results"]} == {"tev", "greedy"} and data["meta"]["repeats"] == 1
    # an explicit --out that exists is refused unless --overwrite (one line, status 2)
    p = run(script, work, "--out", str(committed))
    assert p.returncode == 2 and "argument --out:" in p.stderr and "--overwrite" in p.stderr, p.stderr
    assert committed.read_text() == '{"committed": true}\n'
    p = run(script, work, "--out", str(committed), "--overwrite")
    assert p.returncode == 0 and json.loads(committed.read_text())["meta"]["repeats"] == 1
