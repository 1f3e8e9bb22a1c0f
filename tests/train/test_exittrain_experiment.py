"""benchmarks/exittrain_experiment.py: the pieces of the design that decide outcomes without a
run — prompt cutting, the pre-stated decision rule, the gate and the report from a results JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    with pytest.raises(ValueError, match="^n: only"):
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


def test_ship_rule_takes_the_best_arm_at_t0_b64_and_needs_a_shown_gain_and_no_shown_loss(X):
    """The pre-stated ship rule on a results JSON: the arm of the best mean 1 + C_p at T0-B64
    ships only if it beats the shipped drafter there by a shown effect (every seed) and is not
    shown worse at T1-B64; pending while any arm lacks a seed."""
    def ev(t0, t1, bl):
        e = _eval(t0)
        e["T0-B64"]["block_len"] = bl
        e["T1-B64"] = dict(_eval(t1)["T0-B64"])
        return e

    seeds = [0, 1]  # the results' design, not the recipe's (three seeds), sets what "every seed" is
    design = dict(X.DESIGN, seeds=seeds, eval_temperatures=[0.0, 1.0], eval_budgets=[64], start_draft="draft2")
    keys = ["T0-B64", "T1-B64"]

    def rep(d_t1):
        runs = {"shipped": {"eval": ev([2.0, 2.0, 2.0], [1.5, 1.5, 1.5], 2.0)}}
        for s in seeds:
            runs[f"A-s{s}"] = {"eval": ev([2.0, 2.0, 1.98 + 0.01 * s], [1.5, 1.5, 1.5], 1.99)}
            runs[f"C-s{s}"] = {"eval": ev([2.1, 2.0, 2.0], [1.5, 1.51, 1.49 + 0.02 * s], 2.02)}
            runs[f"D-s{s}"] = {"eval": ev([2.3, 2.2, 2.25 + 0.01 * s], d_t1(s), 2.2)}
        return {"design": design, "arms": {"A": {}, "C": {}, "D": {}}, "runs": runs}

    r = X.ship_rule(rep(lambda s: [1.5, 1.49, 1.51]), keys)
    assert r["best"] == "D" and r["ships"] is True
    assert r["table"]["D"]["T0-B64"]["decision"] == "shown: better"
    r = X.ship_rule(rep(lambda s: [1.4, 1.41, 1.4 + 0.01 * s]), keys)  # D costs mass at T = 1 on every seed
    assert r["best"] == "D" and r["table"]["D"]["T1-B64"]["decision"] == "shown: worse" and r["ships"] is False
    md = "\n".join(X.ship_rule_lines(rep(lambda s: [1.4, 1.41, 1.4 + 0.01 * s]), keys))
    assert "does not ship" in md and "| D − shipped |" in md
    v1 = rep(lambda s: [1.4, 1.41, 1.4 + 0.01 * s])  # the v1 design had its own rule (a realized-τ gain)
    v1["design"] = {k: v for k, v in design.items() if k != "start_draft"}
    assert X.ship_rule_lines(v1, keys) == []
    partial = rep(lambda s: [1.5, 1.49, 1.51])
    del partial["runs"]["C-s1"]
    r = X.ship_rule(partial, keys)
    assert r["best"] is None and r["ships"] is None and "pending" in r["table"]["C"]["T0-B64"]["decision"]


def test_a_schedule_change_keeps_the_data_stage_until_a_run_is_trained(X, tmp_path):
    old = json.loads(json.dumps(X.DESIGN))
    assert X.design_conflict(old, tmp_path) is None
    sched = dict(old, lr=old["lr"] * 3, loss_decay_gamma=old["loss_decay_gamma"] + 1)
    assert X.design_conflict(sched, tmp_path) is None                      # nothing trained yet
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "record.json").write_text("[]")               # the shipped drafter's eval is schedule-free
    assert X.design_conflict(sched, tmp_path) is None
    (tmp_path / "A-s0" / "checkpoints" / "step-25").mkdir(parents=True)    # killed before its record was written
    msg = X.design_conflict(sched, tmp_path)
    assert "schedule changed" in msg and "loss_decay_gamma" in msg and "lr" in msg and "A-s0" in msg
    data = dict(old, rollout_temperature=0.5)
    assert "rollout_temperature" in X.design_conflict(data, tmp_path.parent / "nothing-here")
    assert set(X.DATA_KEYS) <= set(X.DESIGN) and set(X.LAMBDA_KEYS) <= set(X.DESIGN)
    assert not set(X.DATA_KEYS) & {"lr", "steps", "token_weight", "distill_weight", "loss_decay_gamma"}


def test_the_driver_says_when_it_stopped_at_the_gate(X, tmp_path, monkeypatch, capsys):
    """A no-go chunk must not report the experiment as complete (chunk 1 did)."""
    monkeypatch.setattr(X, "data_stage", lambda out, mach: {"lambda": 36.0})
    monkeypatch.setattr(X, "units", lambda out, lam, ignore, prior=None: [])
    monkeypatch.setattr(X, "gate", lambda out: {"T0-B64": {"diff": -1.0, "se": 0.4, "z": -2.5}, "go": False})
    monkeypatch.setattr(X, "collect", lambda out, results: {})
    args = type("A", (), {"chunk_minutes": 1, "out": tmp_path, "jobs": 1, "ignore_gate": False,
                          "segment_steps": 50, "results": tmp_path / "r.json"})()
    X.chunk(args, {})
    err = capsys.readouterr().err
    assert "stopped at the gate" in err and "complete" not in err


@pytest.fixture(scope="module")
def P(X):
    spec = importlib.util.spec_from_file_location("exittrain_pilot", ROOT / "benchmarks" / "exittrain_pilot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_eval(path, temps_values, positions=(10, 20, 30)):
    path.mkdir(parents=True, exist_ok=True)
    res = [{"temperature": t, "budget": 64, "per_prompt": {"positions": list(positions),
                                                            "block_len_sum": [v * n for v, n in zip(vals, positions)]},
            "block_len": sum(vals) / 3, "block_len_se": 0.01, "w_root": 0.1, "w_inner": 0.2, "w_cut": 0.6,
            "w_horizon": 0.1, "w_depth": [0.1, 0.9]} for t, vals in temps_values.items()]
    (path / "results.json").write_text(json.dumps({"results": res}))


def test_pilot_selection_rule_prefers_a_token_only_schedule_that_improves_both_temperatures(P, tmp_path, monkeypatch):
    monkeypatch.setattr(P, "RESULTS", tmp_path / "pilot.json")
    base = {0.0: [3.0, 3.1, 2.9], 1.0: [2.0, 2.1, 1.9]}
    _write_eval(tmp_path / "shipped" / "eval", base)
    bump = lambda d, a, b: {0.0: [x + a + 0.001 * i for i, x in enumerate(d[0.0])],
                            1.0: [x + b + 0.001 * i for i, x in enumerate(d[1.0])]}
    variants = list(P.VARIANTS)
    tok = [v for v in variants if P.VARIANTS[v][1] == 0]
    dis = [v for v in variants if P.VARIANTS[v][1] > 0]
    for v, (a, b) in zip(tok, [(0.05, -0.01), (0.02, 0.01), (-0.1, 0.2)]):   # only tok[1] improves both
        _write_eval(tmp_path / v / "eval", bump(base, a, b))
        (tmp_path / v / "record.json").write_text(json.dumps([{"kind": "train", "wall_s": 1.0}]))
    for v in dis:
        _write_eval(tmp_path / v / "eval", bump(base, 0.2, 0.2))
        (tmp_path / v / "record.json").write_text(json.dumps([{"kind": "train", "wall_s": 1.0}]))
    rep = P.collect(tmp_path)
    assert rep["complete"] and rep["chosen"] == tok[1]                     # token-only first, even if distill is better
    assert rep["variants"][tok[1]]["vs_shipped"]["T0-B64"]["diff"] > 0
    import shutil
    shutil.rmtree(tmp_path / tok[1] / "eval")                              # now no token-only schedule improves both
    _write_eval(tmp_path / tok[1] / "eval", bump(base, -0.01, 0.01))
    assert P.collect(tmp_path)["chosen"] == dis[0]
    for v in dis:
        shutil.rmtree(tmp_path / v / "eval")
        _write_eval(tmp_path / v / "eval", bump(base, -0.2, 0.2))
    assert P.collect(tmp_path)["chosen"] is None
    assert "chosen: None" in P.report(json.loads((tmp_path / "pilot.json").read_text()))



def test_the_gate_reads_only_the_gated_temperatures(X, tmp_path, monkeypatch):
    """Schedule v2 gates on T = 1 only: a control that moves T = 1 by > 5 SE passes whatever T = 0 does."""
    base = {0.0: [3.0, 3.1, 2.9], 1.0: [2.0, 2.1, 1.9]}
    _write_eval(tmp_path / "shipped" / "eval", base)
    _write_eval(tmp_path / "A-s0" / "eval", {0.0: [x + 0.001 * i for i, x in enumerate(base[0.0])],
                                             1.0: [x + 0.05 + 0.001 * i for i, x in enumerate(base[1.0])]})
    monkeypatch.setitem(X.DESIGN, "gate_temperatures", [1.0])
    g = X.gate(tmp_path)
    assert g["go"] and g["gated"] == ["T1-B64"] and abs(g["T0-B64"]["z"]) < 5 < g["T1-B64"]["z"]
    monkeypatch.setitem(X.DESIGN, "gate_temperatures", [0.0, 1.0])
    assert not X.gate(tmp_path)["go"]
    # v2 needs an improvement: chunk 1's control moved T = 1 by z = -9.4, which v1's |z| rule read as movement
    _write_eval(tmp_path / "A-s0" / "eval", {0.0: base[0.0], 1.0: [x - 0.05 + 0.001 * i for i, x in enumerate(base[1.0])]})
    monkeypatch.setitem(X.DESIGN, "gate_temperatures", [1.0])
    g = X.gate(tmp_path)
    assert g["T1-B64"]["z"] < -5 and not g["go"]
    v1 = {k: v for k, v in X.DESIGN.items() if k not in ("gate_temperatures", "schedule_version")}
    v1_gate = X.gate(tmp_path, v1)                                         # v1 gated both, on |z|
    assert v1_gate["gated"] == ["T0-B64", "T1-B64"] and not v1_gate["go"]
    _write_eval(tmp_path / "A-s0" / "eval", {0.0: [x - 0.3 + 0.001 * i for i, x in enumerate(base[0.0])],
                                             1.0: [x - 0.05 + 0.001 * i for i, x in enumerate(base[1.0])]})
    assert X.gate(tmp_path, v1)["go"] and not X.gate(tmp_path)["go"]


def test_a_new_session_continues_from_the_results_json(X, tmp_path):
    """runs/ is not committed: complete runs (evaluated and benched) in a results JSON of the same
    design are not trained again, and --collect keeps them next to the runs on disk."""
    design = json.loads(json.dumps(X.DESIGN))
    done = {n: {"eval": _eval([2.0, 2.1, 1.9]), "tau": {"T0-B64": 2.0}} for n in ("shipped", "A-s0", "B-s0")}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"design": design, "gate": {"go": True}, "runs": {**done, "C-s0": {"steps": 100}}}))
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "design.json").write_text(json.dumps(design))
    prior = X.archived(results)
    assert sorted(prior["runs"]) == ["A-s0", "B-s0", "shipped"] and prior["gate"]["go"]   # C-s0 is partial
    todo = [(u[0], u[1]) for u in X.units(out, 36.0, False, prior)]
    assert todo[0] == ("train", "C-s0") and not {"shipped", "A-s0", "B-s0"} & {u[1] for u in todo}
    assert ("train", "A-s1") in todo
    assert [(u[0], u[1]) for u in X.units(out, 36.0, False)][:2] == [("eval", "shipped"), ("train", "A-s0")]
    (out / "C-s1").mkdir()
    (out / "C-s1" / "train_log.jsonl").write_text(json.dumps({"step": 50, "ms_draft": 1.0}) + "\n")
    rep = X.collect(out, results)
    assert sorted(rep["runs"]) == ["A-s0", "B-s0", "C-s1", "shipped"] and rep["gate"]["go"]
    assert rep["runs"]["B-s0"] == json.loads(json.dumps(done["B-s0"]))
    other = dict(design, lr=1.0)                                           # another design: nothing carries over
    results.write_text(json.dumps({"design": other, "gate": {"go": True}, "runs": done}))
    assert X.archived(results) == {"runs": {}, "gate": None}


@pytest.mark.parametrize("content", [None, "{not json", "{}", "[]"])
def test_report_refuses_an_unreadable_results_file_in_one_line(X, tmp_path, capsys, content):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        X.main(["--report", "--results", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --results" in err and str(path) in err


def test_only_one_of_report_collect_and_data_only(X, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        X.main(["--report", "--collect", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    assert "not allowed with" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_build_scripts_exittrain_stage_is_arm_d_as_measured(X):
    """The package's default drafter is made by scripts/build_tiny_code.py's exittrain stage; its
    recipe must be the experiment's arm D (design, arm and the λ the experiment measured). Both read
    ONE packaged recipe file, so they cannot drift apart: the test checks they read the same file
    and that what the build makes of it is the experiment's arm D at the measured λ."""
    import dataclasses

    import yaml

    from sglang_tev.train.config import RECIPES, load_recipe

    spec = importlib.util.spec_from_file_location("build_tiny_code", ROOT / "scripts" / "build_tiny_code.py")
    btc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = btc
    spec.loader.exec_module(btc)
    assert btc.EXIT_RECIPE == X.RECIPE_NAME
    path = RECIPES / f"{X.RECIPE_NAME}.yaml"
    recipe = yaml.safe_load(path.read_text())
    assert load_recipe(X.RECIPE_NAME) == recipe == X.RECIPE
    assert X.DESIGN == recipe["design"] and X.ARMS == {k: (v["mode"], v["temperature"]) for k, v in recipe["arms"].items()}
    # the build reads the same file: change a value there and FULL_EXIT follows
    E, D = btc.FULL_EXIT, X.DESIGN
    assert E == btc.exit_recipe(recipe)
    moved = json.loads(json.dumps(recipe))
    moved["design"]["lr"] *= 2
    assert btc.exit_recipe(moved) == dataclasses.replace(E, lr=2 * D["lr"])
    pairs = btc.EXIT_RECIPE_KEYS
    assert set(pairs) | {"exit_mode", "exit_lambda", "exit_temperature", "ckpt_every", "log_every"} == \
        {f.name for f in dataclasses.fields(E)}
    assert {k: getattr(E, k) for k in pairs} == {k: D[v] for k, v in pairs.items()}
    assert D["distill_weight"] == 0.0 and recipe["shipped"]["arm"] == "D"
    assert (E.exit_mode, E.exit_temperature) == X.ARMS["D"] == ("exit", 0.0)
    results = json.loads((ROOT / "benchmarks" / "results" / "exittrain-experiment.json").read_text())
    assert E.exit_lambda == results["lambda"]["lambda"]
    # the experiment's results were made under this design (a later session continues from them)
    assert results["design"] == json.loads(json.dumps(D))
    # the recipe ships with the package
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"train/recipes/*.yaml"' in pyproject
    assert (ROOT / "sglang_tev" / "train" / "recipes" / path.name).read_text() == path.read_text()


def test_the_draft2_recipe_binds_its_start_arms_results_and_lattice_overrides(X, tmp_path, capsys):
    try:
        X.use_recipe("exittrain-draft2")
        assert X.BASE_DRAFT.name == "draft2" and X.RESULTS.name == "exittrain-draft2-experiment.json"
        assert sorted(X.ARMS) == ["A", "C", "D"] and X.DESIGN["eval_budgets"] == [32, 64]
        names = X.run_names()
        assert names[0] == ("A", 0) and ("B", 0) not in names and len(names) == 3 * len(X.DESIGN["seeds"])
        assert X.contrasts() == [("C", "A"), ("D", "A")]
        ov = X.train_overrides(tmp_path, "C", 0, 36.0, 50)
        assert {"loss.exit.tree=lattice", "loss.selector.weight=1.0", "draft_init=" + str(X.BASE_DRAFT)} <= set(ov)
        # the data stage's settings are v1's, so its OUT/data folder can be reused
        v1 = X.load_recipe("exittrain-tiny-code")["design"]
        assert [k for k in X.DATA_KEYS if k != "eval_budgets" and v1[k] != X.DESIGN[k]] == []
    finally:
        X.use_recipe("exittrain-tiny-code")
    assert X.BASE_DRAFT.name == "draft-base" and sorted(X.ARMS) == ["A", "B", "C", "D"]
    with pytest.raises(SystemExit):
        X.main(["--recipe", "nope", "--report"])
    assert "argument --recipe" in capsys.readouterr().err
