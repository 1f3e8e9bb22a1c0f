"""scripts/gpu_check.py: its dry run runs every step's code and records every check and figure,
so the GPU check cannot rot between the rare hours a GPU is available.

The dry run is the script's own code path at tiny shapes on CPU (the Triton kernel under
``TRITON_INTERPRET=1`` in the step's own process): 30-70 s on the loaded 2-core machine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes here: scripts/run_tests.sh --fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)
HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_script(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # the script sets it for its own step processes
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / gpu_check.RESULTS).read_text().splitlines()]


def test_dry_run_runs_every_step_and_records_every_check(tmp_path):
    out = tmp_path / "out"
    p = run_script("--dry-run", "--out", str(out))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:] + (out / gpu_check.LOG).read_text()[-4000:]
    recs = records(out)
    planned = gpu_check.plan(gpu_check.DRY)
    assert set(planned) == set(gpu_check.STEPS)
    checks = {r["name"]: r for r in recs if r["type"] == "check"}
    for step, cs in planned.items():
        assert cs, step
        # each step ran in its own process, recorded its machine and finished
        assert any(r["type"] == "meta" and r["step"] == step for r in recs), step
        assert [r["status"] for r in recs if r["type"] == "step" and r["step"] == step] == ["done"], step
        for c in cs:
            r = checks[c.name]  # one record per planned check, written by the step itself
            if not HAS_TRITON and c.name.startswith("triton/"):
                assert r["status"] == "skipped" and "triton is not installed" in r["reason"]
                continue
            assert r["status"] == "pass", r
            assert r["seconds"] >= 0 and isinstance(r["detail"], dict)
    assert len(checks) == sum(len(cs) for cs in planned.values())
    # the checks looked at real outputs: trees of every depth, tau of the trained pair, chi-square p
    if HAS_TRITON:
        eq = [r["detail"] for n, r in checks.items() if n.startswith("triton/equal/")]
        assert len(eq) == len(gpu_check.DRY["samplings"])
        assert all(d["rows_differing"] == dict.fromkeys(gpu_check.FIELDS, 0) for d in eq)
        assert max(max(d["accept_lens_seen"]) for d in eq) >= 2
        assert 0 < checks["triton/chi2/T1"]["detail"]["pvalue"] <= 1
    assert max(checks["runtime/tiny-code/b4/eager=plain"]["detail"]["tau"]) >= 2.0
    auto = checks["runtime/tiny-code/b4/auto=plain"]["detail"]  # budget auto: greedy = plain, speed recorded
    assert sum(auto["budgets"].values()) > 0 and auto["auto_x_plain"] > 0 and auto["auto_tok_s"] > 0
    assert checks["runtime/random/b4/graphs=plain"]["detail"]["options"] == {"static_shapes": True}
    # every planned figure was measured (tev-triton needs Triton)
    figs = {r["name"]: r for r in recs if r["type"] == "figure"}
    for cs in planned.values():
        for c in cs:
            for name in c.figures:
                if "/tev-triton/" in name and not HAS_TRITON:
                    continue
                assert math.isfinite(figs[name]["value"]) and figs[name]["value"] > 0, name
                assert figs[name]["anchor"] == "" and figs[name]["goal"] is None  # tiny shapes: nothing to compare
    assert {n.split("/")[0] for n in figs} == {"verifier", "round", "ar"}
    # the final table lists every check and figure; the short table comes last on stdout
    md = (out / gpu_check.SUMMARY).read_text()
    for name in list(checks) + list(figs):
        assert f"`{name}`" in md, name
    tail = p.stdout.strip().splitlines()
    assert tail[-1].startswith("(all checks and figures: summary.md")
    assert any(line.split()[:1] == ["timing"] for line in tail[-60:])


def test_time_budget_zero_skips_every_check_and_existing_results_are_kept(tmp_path):
    out = tmp_path / "out"
    p = run_script("--dry-run", "--time-budget", "0", "--out", str(out), timeout=120)
    assert p.returncode == 0, p.stderr
    recs = records(out)
    checks = [r for r in recs if r["type"] == "check"]
    assert len(checks) == sum(len(cs) for cs in gpu_check.plan(gpu_check.DRY).values())
    assert all(r["status"] == "skipped" and "time budget" in r["reason"] for r in checks)
    assert not [r for r in recs if r["type"] in ("meta", "figure")]  # no step process started
    assert "0 pass, 0 fail, " in p.stdout
    before = (out / gpu_check.RESULTS).read_text()
    p = run_script("--dry-run", "--out", str(out), timeout=120)
    assert p.returncode == 2 and "argument --out:" in p.stderr and "--overwrite" in p.stderr
    assert (out / gpu_check.RESULTS).read_text() == before
    p = run_script("--dry-run", "--time-budget", "-1", "--out", str(out), "--overwrite", timeout=120)
    assert p.returncode == 2 and "--time-budget" in p.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU is present")
def test_without_cuda_only_the_dry_run_runs(tmp_path):
    p = run_script("--out", str(tmp_path / "out"), timeout=120)
    assert p.returncode == 2 and "no CUDA GPU" in p.stderr and "--dry-run" in p.stderr
    assert not (tmp_path / "out").exists()


def test_guard_records_failures_and_goes_on(tmp_path, capsys):
    """A check that raises or finds a wrong result is recorded as failed (traceback in the log),
    the next one still runs; a check that no longer fits the time budget is skipped; figures on
    the GPU carry their H200 anchor and goal."""
    rec = gpu_check.Recorder(tmp_path, "timing", deadline=gpu_check.time.time() + 100, gpu=True)
    ran = []

    def boom(ctx, r):
        raise ZeroDivisionError("planted")

    def wrong(ctx, r):
        return dict(ok=False, why="planted mismatch", rows=3)

    def fine(ctx, r):
        ran.append(1)
        r.figure("verifier/tev-triton/V151936/B64/T0.6/b1", 42.0, "us", cuda_graph=True)
        r.figure("round/graphs/T0/B64/overhead", 0.7, "ms")
        return dict(x=1)

    C = gpu_check.Check
    statuses = [rec.run(c, {}) for c in (C("a", boom, 1), C("b", wrong, 1), C("c", fine, 1), C("d", fine, 1000))]
    assert statuses == ["fail", "fail", "pass", "skipped"] and ran == [1]
    recs = records(tmp_path)
    by = {r["name"]: r for r in recs}
    assert by["a"]["error"] == "ZeroDivisionError: planted"
    assert by["b"]["error"] == "planted mismatch" and by["b"]["detail"] == {"rows": 3}
    assert "time budget" in by["d"]["reason"]
    log = (tmp_path / gpu_check.LOG).read_text()
    assert "Traceback" in log and "ZeroDivisionError: planted" in log
    tev = by["verifier/tev-triton/V151936/B64/T0.6/b1"]
    assert "TEV reference style 434 us" in tev["anchor"] and tev["goal"]["max"] == 50.0 and tev["meets_goal"]
    ovh = by["round/graphs/T0/B64/overhead"]
    assert "3.34 ms" in ovh["anchor"] and ovh["goal"]["max"] == 0.5 and ovh["meets_goal"] is False
    assert "[timing] fail    a" in capsys.readouterr().out


def test_anchors_beside_every_gpu_figure_that_has_one():
    """Every GPU figure of a method / stage the anchors measured gets its anchor; goals as the issues say."""
    names = [f for cs in gpu_check.plan(gpu_check.GPU).values() for c in cs for f in c.figures]
    assert len(names) == len(set(names))
    for n in names:
        a = gpu_check.anchor_for(n)
        method_or_stage = n.split("/")[1] if n.startswith("verifier/") else n.rsplit("/", 1)[1]
        has_anchor = method_or_stage in ("tev", "tev-triton", "predraw", "draft", "build", "tree_forward",
                                         "verify_commit", "overhead", "step")  # not sequential, greedy, verify, commit
        assert bool(a) == has_anchor, (n, a)
    assert "tree build + compile 1.10 ms" in gpu_check.anchor_for("round/eager/T0/B64/build")
    assert "5.42 ms" in gpu_check.anchor_for("round/eager/T1/B128/overhead")
    assert "6.91 ms" in gpu_check.anchor_for("ar/graphs/step") and "30.2 ms" in gpu_check.anchor_for("ar/eager/tree_forward")
    goals = {n: gpu_check.goal_for(n)["max"] for n in names if gpu_check.goal_for(n)}
    assert goals == {"verifier/tev-triton/V151936/B64/T0.6/b1": 50.0, "verifier/tev-triton/V151936/B64/T1/b1": 50.0,
                     "round/eager/T0/B64/overhead": 0.5, "round/eager/T1/B64/overhead": 0.5,
                     "round/graphs/T0/B64/overhead": 0.5, "round/graphs/T1/B64/overhead": 0.5,
                     "round/graphs/T0/B64/tree_forward": 7.5, "round/graphs/T1/B64/tree_forward": 7.5,
                     "ar/graphs/step": 6.9}


def test_a_step_that_dies_blames_its_running_check(tmp_path):
    """A step process that dies (a CUDA fault, say) leaves the check it was running failed and the
    rest of its checks skipped; a step that could not start leaves all of its checks skipped."""
    cfg = gpu_check.DRY
    planned = gpu_check.plan(cfg)
    first = planned["triton"][0].name
    (tmp_path / gpu_check.RESULTS).write_text(json.dumps(dict(type="check", step="triton", name=first,
                                                              status="pass")) + "\n")
    recs = gpu_check.finish_records(tmp_path, cfg, {"triton": dict(status="crashed", why="exit status -11"),
                                                    "runtime": dict(status="done")})
    by = {r["name"]: r for r in recs if r["type"] == "check"}
    tri = [by[c.name]["status"] for c in planned["triton"]]
    assert tri[0] == "pass" and tri[1] == "fail" and set(tri[2:]) == {"skipped"}
    assert "exit status -11" in by[planned["triton"][1].name]["error"]
    assert {by[c.name]["status"] for c in planned["timing"]} == {"skipped"}
    assert len(records(tmp_path)) == sum(len(cs) for cs in planned.values())


@pytest.mark.parametrize("wrong", ["kernel", "float32 reference"])
def test_triton_equal_fails_a_wrong_kernel_and_forgives_a_rounding_tie(monkeypatch, wrong):
    """The comparison itself can fail: a kernel whose bonus is off in one row fails the check;
    where the float32 reference is the one off (what rounding at an inverse-CDF boundary does)
    and the float64 law agrees with the kernel, the check passes and counts the row."""
    import numpy as np
    import torch
    from exact_law import random_tree, stack_trees

    import sglang_tev
    from sglang_tev import VerifyOutput

    V, B, T = 48, 6, 0.6
    rng = np.random.default_rng(0)
    tree = stack_trees([random_tree(rng, n, V) for n in gpu_check.ragged_sizes(B)], 1 + B)
    logits = torch.randn(4, 1 + B, V, generator=torch.Generator().manual_seed(1)) * 2
    real = sglang_tev.verify_tree
    off = "triton" if wrong == "kernel" else "torch"

    def verify_tree(tree, logits, method, backend=None, **kw):
        path, acc, bonus, ex, cov = real(tree, logits, method, backend="torch", **kw)
        if backend == off and logits.dtype != torch.float64:
            bonus = bonus.clone()
            bonus[0] = (bonus[0] + 1) % V
        return VerifyOutput(path, acc, bonus, ex, cov)

    monkeypatch.setattr(sglang_tev, "verify_tree", verify_tree)
    monkeypatch.setattr(gpu_check, "need_triton", lambda cfg: None)
    cfg = dict(gpu_check.DRY, draws=3)
    got = gpu_check._triton_equal({("triton-case", B, T): (tree, logits)}, None, cfg, B, "float32", T, "plain")
    assert got["rows_differing"] == dict(exit_node=0, bonus=3, path=0, accept_len=0)
    if wrong == "kernel":
        assert got["ok"] is False and "3 rows where the kernel differs" in got["why"]
    else:
        assert got["ok"] is True and got["rows_float64_agrees_with_kernel"] == 3
