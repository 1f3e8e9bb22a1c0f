"""benchmarks/exittrain_experiment.py: the pieces of the design that decide outcomes without a
run — prompt cutting, the pre-stated decision rule, the gate and the report from a results JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def X():
    spec = importlib.util.spec_from_file_location("exittrain_experiment", ROOT / "benchmarks" / "exittrain_experiment.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["exittrain_experiment"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_prompts_are_cut_at_line_starts_from_the_given_files_only(X, tmp_path):
    files = []
    for i in range(3):
        rel = f"pkg/m{i}.py"
        (tmp_path / "pkg").mkdir(exist_ok=True)
        (tmp_path / rel).write_text("".join(f"x{i}_{j} = {j}  # line {j} of module {i}\n" for j in range(60)))
        files.append(rel)
    a = X.cut_prompts(tmp_path, files, 20, seed=3, max_chars=300)
    assert a == X.cut_prompts(tmp_path, files, 20, seed=3, max_chars=300)       # seeded
    assert a != X.cut_prompts(tmp_path, files, 20, seed=4, max_chars=300)
    assert len(a) == 20 and len({r["id"] for r in a}) == 20
    for r in a:
        rel, line = r["id"].rsplit(":", 1)
        text = (tmp_path / rel).read_text()
        cut = sum(len(ln) for ln in text.splitlines(keepends=True)[: int(line) - 1])
        assert text[:cut].endswith(r["prompt"]) and r["prompt"].endswith("\n")
        assert 0 < len(r["prompt"]) <= 300 and (cut - len(r["prompt"]) == 0 or text[cut - len(r["prompt"]) - 1] == "\n")
    assert {r["id"].rsplit(":", 1)[0] for r in a[:3]} == set(files)                # round-robin over files
    with pytest.raises(SystemExit, match="only"):
        X.cut_prompts(tmp_path, files, 10_000, seed=0, max_chars=300)


def test_decision_rule_needs_every_seed_and_agreement_beyond_two_sd_over_root_n(X):
    assert X.decide([1.0, 2.0]).startswith("pending")
    assert X.decide([5.0, 5.2, 4.9]) == "shown: better"
    assert X.decide([-5.0, -5.2, -4.9]) == "shown: worse"
    assert X.decide([5.0, -0.1, 4.9]) == "not shown"                  # one seed disagrees
    assert X.decide([0.1, 3.0, 6.0]) == "not shown"                   # mean 3.03 < 2 * 2.95 / sqrt(3)


def _eval(values, positions=(10, 20, 30)):
    return {"T0-B64": {"positions": list(positions), "sums": [v * n for v, n in zip(values, positions)],
                       "block_len": 2.0, "block_len_se": 0.01, "w_root": 0.1, "w_inner": 0.2, "w_cut": 0.6,
                       "w_horizon": 0.1, "w_depth": [0.1, 0.9]}}


def test_report_from_a_results_json_pairs_arms_per_seed(X, monkeypatch):
    monkeypatch.setitem(X.DESIGN, "eval_temperatures", [0.0])
    runs = {"shipped": {"eval": _eval([2.0, 2.0, 2.0])}}
    for s in X.DESIGN["seeds"]:
        runs[f"A-s{s}"] = {"eval": _eval([2.0, 2.1, 1.9]), "steps": 600}
        runs[f"C-s{s}"] = {"eval": _eval([2.2, 2.3, 2.05 + 0.01 * s]), "steps": 600}
    rep = {"design": X.DESIGN, "runs": runs, "lambda": {"lambda": 40.0, "median_ratio": 0.015, "batches": 8,
                                                         "target_ratio": 0.6}, "gate": None}
    md = X.markdown(json.loads(json.dumps(rep)))
    row = next(ln for ln in md.splitlines() if ln.startswith("| C − A"))
    assert "shown: better" in row and row.count("+") == 3
    assert "pending (0/3 seeds)" in next(ln for ln in md.splitlines() if ln.startswith("| B − A"))
    d, se = X.paired(runs["C-s0"]["eval"]["T0-B64"], runs["A-s0"]["eval"]["T0-B64"])
    assert d == pytest.approx(100 * (0.2 * 10 + 0.2 * 20 + 0.15 * 30) / (2.0 * 10 + 2.1 * 20 + 1.9 * 30)) and se > 0
    with pytest.raises(ValueError, match="same positions"):
        X.paired(_eval([2.0] * 3)["T0-B64"], _eval([2.0] * 3, positions=(1, 2, 3))["T0-B64"])
