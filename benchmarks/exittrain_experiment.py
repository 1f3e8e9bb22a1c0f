"""ExitTrain ablation on the shipped tiny-code pair, designed before it runs (docs/exittrain.md,
"The experiment"). Resumable in chunks: every command continues where the last one stopped.

Design (frozen in ``DESIGN`` and ``ARMS``, read from the packaged recipe
``sglang_tev/train/recipes/exittrain-tiny-code.yaml``, which ``scripts/build_tiny_code.py``'s
exittrain stage reads too; ``OUT/design.json`` records it and a changed design is refused):

* start: the shipped pair (``sglang_tev/assets/tiny-code``; its drafter as shipped when the experiment
  ran, packaged as ``draft-base/`` since), target frozen;
* data: ``TRAIN_PROMPTS`` prompts cut from the stdlib TRAINING split of
  ``scripts/build_tiny_code.py`` (its ``split.json``), answered once by the target at T = 1
  (``rollout:``, one cache shared by every run); test: ``TEST_PROMPTS`` prompts cut from the 18
  held-out files (never seen by tokenizer, target or drafter), the target's own continuations at
  T = 0 and T = 1 cached once by ``sglang-tev eval-drafter``;
* dense loss: token CE on the rollouts (response tokens only), γ = 7, lr 3e-4 (warmup 20,
  cosine to 10 %; schedule v2: chunk 1's 1e-3 failed the gate, see ``exittrain_pilot.py``), 600 steps, batch 4 × 512 tokens, 16 anchors per sequence, tree budget 64;
* λ: fixed before any arm runs from gradient norms at the shipped drafter:
  ``λ = 0.6 / median_s(|∇L_exit| / |∇L_tok|)`` over the first 8 batches of seed 0, 2 significant
  digits (``OUT/data/lambda.json``); the same λ for B, C and D;
* arms: A token only; B + prefix weights; C + exit weights; D + exit weights under the T = 0 law;
  seeds 0, 1, 2, paired (a seed fixes the batches and anchors of every arm);
* metric: ``eval-drafter`` on the test continuations (B = 64, T = 0 and 1): per-seed paired
  differences C−A, B−A, C−B, D−A with SEs over prompts; realized τ from ``sglang-tev bench``
  (tev, B = 64, T = 0 and 1, same prompts);
* gate: after A-s0 is trained and evaluated, A-s0 must improve on the shipped drafter by more
  than 5 SE (z > +5) at every temperature in ``gate_temperatures`` (v2: T = 1; chunk 1 required
  |z| > 5 at T = 0 and 1), else the driver stops (no-go: change the schedule and say so);
* decision rule, per contrast and temperature: an effect is shown when all three seeds agree in
  sign and |mean| > 2·SD/√3 (SD over the seeds' Δ).

Commands::

    python benchmarks/exittrain_experiment.py --out runs/exittrain --chunk-minutes 110 --jobs 1
    python benchmarks/exittrain_experiment.py --out runs/exittrain --collect   # -> results JSON
    python benchmarks/exittrain_experiment.py --report                          # doc tables from the JSON

A chunk runs work units in this order until ``--chunk-minutes`` would be exceeded: the data
stage, A-s0 in segments of ``--segment-steps``, the shipped drafter's and A-s0's evaluation, the
gate, then B/C/D seed 0, then seeds 1 and 2, each run's evaluation and bench as soon as it is
trained. Every unit appends its command, seed, machine and wall time to ``OUT/<run>/record.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "sglang_tev" / "assets" / "tiny-code"
# the drafter every arm starts from and the "shipped" row: the one shipped when the experiment ran,
# packaged as draft-base/ since arm D's recipe became the default drafter (scripts/build_tiny_code.py)
BASE_DRAFT = ASSET / "draft-base"  # rebound by use_recipe
RESULTS = REPO / "benchmarks" / "results" / "exittrain-experiment.json"

from sglang_tev.atomic import atomic_write  # noqa: E402
from sglang_tev.machine import machine_info  # noqa: E402
from sglang_tev.train.config import load_recipe  # noqa: E402
from sglang_tev.train.rollout import cut_prompts  # noqa: E402  (the training and test prompts)

# The design, frozen: a packaged recipe (`design`, `arms`; default sglang_tev/train/recipes/
# exittrain-tiny-code.yaml, the same file scripts/build_tiny_code.py's exittrain stage reads, arm D
# at the measured λ). `--recipe exittrain-draft2` is the DFlash2 lattice experiment (issue 38).
RECIPE_NAME = "exittrain-tiny-code"
# what the data stage and the evaluations depend on: kept when only the schedule changes
DATA_KEYS = ("train_prompts", "test_prompts", "prompt_chars", "prompt_seed", "rollout_max_new_tokens",
             "rollout_temperature", "rollout_batch_size", "rollout_seed", "eval_temperatures", "eval_budgets",
             "eval_max_new_tokens", "eval_seed")
# what λ depends on (lambda.json is measured again when one of these changes)
LAMBDA_KEYS = ("token_weight", "distill_weight", "loss_decay_gamma", "seq_len", "batch_size", "num_anchors",
               "budget", "lambda_target_ratio", "lambda_batches")
# ... and these where the recipe has them (the DFlash2 recipe; absent from v1's, whose lambda.json stays valid)
LAMBDA_KEYS_OPTIONAL = ("start_draft", "exit_tree", "selector_weight", "selector_labels")


def lambda_design() -> dict:
    """The design values λ was measured under (stored in ``OUT/data/lambda.json``)."""
    return {k: DESIGN[k] for k in LAMBDA_KEYS + tuple(k for k in LAMBDA_KEYS_OPTIONAL if k in DESIGN)}


def use_recipe(name: str) -> None:
    """Bind the driver's design to the packaged recipe ``name``: ``RECIPE``, ``DESIGN``, ``ARMS``,
    the starting drafter ``BASE_DRAFT`` (``design.start_draft`` under the shipped pair's folder;
    default ``draft-base``, the drafter the v1 experiment started from) and the default results
    file (``design.results_name``; default ``exittrain-experiment``).

    Raises:
        FileNotFoundError naming the known recipes (:func:`~sglang_tev.train.config.load_recipe`);
        ValueError when the starting drafter is not in the package.
    """
    global RECIPE_NAME, RECIPE, DESIGN, ARMS, BASE_DRAFT, RESULTS
    recipe = load_recipe(name)
    design = dict(recipe["design"])
    base = ASSET / str(design.get("start_draft", "draft-base"))
    if not (base / "config.json").is_file():
        raise ValueError(f"recipe {name!r}: design.start_draft {base.name!r} is not a drafter in {ASSET}")
    RECIPE_NAME, RECIPE, DESIGN = name, recipe, design
    ARMS = {k: (v["mode"], float(v["temperature"])) for k, v in recipe["arms"].items()}  # (loss.exit.mode, .temperature)
    BASE_DRAFT = base
    RESULTS = REPO / "benchmarks" / "results" / f"{design.get('results_name', 'exittrain-experiment')}.json"


use_recipe(RECIPE_NAME)
CONTRASTS = [("C", "A"), ("B", "A"), ("C", "B"), ("D", "A")]  # those whose arms the recipe has: contrasts()


def contrasts(arms=None) -> list[tuple[str, str]]:
    """The contrasts whose two arms are in ``arms`` (default: the recipe's ``ARMS``)."""
    arms = ARMS if arms is None else arms
    return [(x, y) for x, y in CONTRASTS if x in arms and y in arms]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))


def design_conflict(old: dict, out: Path) -> str | None:
    """Why ``out``, started with design ``old``, cannot continue under ``DESIGN`` (None: it can).
    The data stage (prompts, rollouts, test continuations) is kept across schedule changes; a
    schedule change is refused once a training run exists, since its runs would mix schedules."""
    new = json.loads(json.dumps(DESIGN))
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    data = [k for k in changed if k in DATA_KEYS]
    if data:
        return "data settings changed: " + ", ".join(data)
    # any run folder counts: a unit killed after a checkpoint leaves no record.json
    trained = [p.name for p in out.iterdir() if p.is_dir() and p.name not in ("data", "shipped")] if out.is_dir() else []
    if changed and trained:
        return f"schedule changed ({', '.join(changed)}) after runs were trained ({', '.join(sorted(trained))})"
    return None


def machine() -> dict:
    return machine_info(cpu="cpu_model", cores="cpu_count", platform="platform", python="python", torch="torch",
                        transformers="transformers")


def run_names() -> list[tuple[str, int]]:
    """(arm, seed) in schedule order: A-s0 (the gate), the recipe's other arms of seed 0, then the
    other seeds."""
    seeds, arms = DESIGN["seeds"], sorted(ARMS)
    return [("A", seeds[0])] + [(a, seeds[0]) for a in arms if a != "A"] + [(a, s) for s in seeds[1:] for a in arms]


def name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


# ----------------------------------------------------------------------------------------------
# records
# ----------------------------------------------------------------------------------------------

_lock = threading.Lock()


def record(run_dir: Path, entry: dict) -> None:
    with _lock:
        p = run_dir / "record.json"
        recs = json.loads(p.read_text()) if p.exists() else []
        recs.append(entry)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(p, json.dumps(recs, indent=1) + "\n", tmp=p.with_suffix(".tmp"))


def run_cmd(cmd: list[str], run_dir: Path, kind: str, seed: int | None, mach: dict, **extra) -> float:
    run_dir.mkdir(parents=True, exist_ok=True)
    t0, start = time.time(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(run_dir / "experiment.log", "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    record(run_dir, {"kind": kind, "command": cmd, "seed": seed, "start_utc": start, "wall_s": round(wall, 1),
                     "returncode": proc.returncode, "machine": mach, **extra})
    if proc.returncode != 0:
        raise RuntimeError(f"failed ({proc.returncode}): {' '.join(cmd)}; see {run_dir / 'experiment.log'}")
    return wall


# ----------------------------------------------------------------------------------------------
# data stage
# ----------------------------------------------------------------------------------------------

def rollout_overrides(data: Path) -> list[str]:
    d = DESIGN
    return [f"rollout.prompts={data / 'train_prompts.jsonl'}", f"rollout.cache={data / 'rollouts.jsonl'}",
            f"rollout.max_new_tokens={d['rollout_max_new_tokens']}", f"rollout.temperature={d['rollout_temperature']}",
            f"rollout.batch_size={d['rollout_batch_size']}", f"rollout.seed={d['rollout_seed']}",
            "rollout.chat_template=false"]


def train_overrides(out: Path, arm: str, seed: int, lam: float, stop_at: int) -> list[str]:
    d = DESIGN
    mode, temp = ARMS[arm]
    return [f"target={ASSET / 'target'}", f"draft_init={BASE_DRAFT}", f"output_dir={out / name(arm, seed)}",
            f"max_steps={d['steps']}", f"stop_at_step={stop_at}", f"seed={seed}", f"seq_len={d['seq_len']}",
            f"batch_size={d['batch_size']}", f"num_anchors={d['num_anchors']}",
            f"loss_decay_gamma={d['loss_decay_gamma']}", f"lr={d['lr']}", f"warmup_steps={d['warmup_steps']}",
            f"min_lr_ratio={d['min_lr_ratio']}", f"threads={d['threads']}", "save_every=25", "keep_checkpoints=1",
            "progress=false", "tensorboard=false", f"loss.token_weight={d['token_weight']}", f"loss.distill_weight={d['distill_weight']}",
            f"loss.exit.mode={mode}", f"loss.exit.lambda={lam if mode != 'none' else 0.0}",
            f"loss.exit.temperature={temp}", f"loss.exit.budget={d['budget']}", *rollout_overrides(out / "data"),
            # DFlash2 recipes: the exit term's trees and the selector's own term (kept, so the
            # selector that builds the lattice does not drift unsupervised)
            *([f"loss.exit.tree={d['exit_tree']}"] if "exit_tree" in d else []),
            *([f"loss.selector.weight={d['selector_weight']}"] if "selector_weight" in d else []),
            *([f"loss.selector.labels={d['selector_labels']}"] if "selector_labels" in d else [])]


def measure_lambda(out: Path) -> dict:
    """|∇L_exit| / |∇L_tok| of the shipped drafter on the first batches of seed 0 (arm C's config,
    λ = 1) and the λ that puts the exit gradient at ``lambda_target_ratio`` of the token gradient.
    The terms are the trainer's own (:meth:`sglang_tev.train.Trainer.loss_terms`)."""
    import torch

    from sglang_tev.train import Trainer, load_config

    torch.set_num_threads(1)
    ov = train_overrides(out, "C", DESIGN["seeds"][0], 1.0, DESIGN["steps"])
    ov = [o for o in ov if not o.startswith(("output_dir=", "stop_at_step="))] + [f"output_dir={out / 'data' / 'lambda_probe'}"]
    tr = Trainer(load_config(None, ov))
    params = [p for p in tr.draft.parameters() if p.requires_grad]
    ratios = []
    for s in range(DESIGN["lambda_batches"]):
        terms = tr.loss_terms(s).terms
        # the dense loss as the trainer combines it (one denominator per term)
        dense = sum(w * t.numerator / t.denominator for k, (w, t) in terms.items() if k != "exit" and w)
        ex = terms["exit"][1]
        g_tok = torch.autograd.grad(dense, params, retain_graph=True)
        g_ex = torch.autograd.grad(ex.numerator / ex.denominator, params)
        n_tok = torch.sqrt(sum((g.double() ** 2).sum() for g in g_tok))
        n_ex = torch.sqrt(sum((g.double() ** 2).sum() for g in g_ex))
        ratios.append(float(n_ex / n_tok))
    r = statistics.median(ratios)
    lam = float(f"{DESIGN['lambda_target_ratio'] / r:.2g}")
    return {"ratios": ratios, "median_ratio": r, "lambda": lam, "target_ratio": DESIGN["lambda_target_ratio"],
            "batches": DESIGN["lambda_batches"], "weights": "exit (arm C), T = 1"}


def data_stage(out: Path, mach: dict) -> dict:
    """Split, prompts, rollouts, test continuations and λ, each made once (skipped when present)."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    tok_dir = REPO / "runs" / "tiny-code" / "tokenizer"
    if not (tok_dir / "split.json").exists():
        run_cmd([sys.executable, "scripts/build_tiny_code.py", "--out", str(REPO / "runs" / "tiny-code"),
                 "--stages", "tokenizer"], data, "split", None, mach)
    split = json.loads((tok_dir / "split.json").read_text())
    root = Path(split["stdlib"])
    for part, key, n, seed in (("train", "train_prompts", DESIGN["train_prompts"], DESIGN["prompt_seed"]),
                               ("heldout", "test_prompts", DESIGN["test_prompts"], DESIGN["prompt_seed"] + 1)):
        p = data / f"{key}.jsonl"
        if not p.exists():
            rows = cut_prompts(root, split[part], n, seed, DESIGN["prompt_chars"])
            p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if not (data / "rollouts.done").exists():
        t0 = time.time()
        import torch

        from sglang_tev.train.config import RolloutConfig
        from sglang_tev.train.rollout import ensure_rollouts
        from sglang_tev.train.target import load_target

        torch.set_num_threads(1)
        target, tok = load_target(ASSET / "target", torch.device("cpu"), torch.float32)
        d = DESIGN
        cfg = RolloutConfig(prompts=str(data / "train_prompts.jsonl"), cache=str(data / "rollouts.jsonl"),
                            max_new_tokens=d["rollout_max_new_tokens"], temperature=d["rollout_temperature"],
                            batch_size=d["rollout_batch_size"], chat_template=False, seed=d["rollout_seed"])
        ensure_rollouts(target, tok, cfg, ASSET / "target", data, torch.device("cpu"), progress=True)
        record(data, {"kind": "rollouts", "command": "ensure_rollouts(" + json.dumps(cfg.__dict__) + ")",
                      "seed": d["rollout_seed"], "wall_s": round(time.time() - t0, 1), "machine": mach})
        (data / "rollouts.done").write_text("")
    if not (data / "continuations.done").exists():
        # the test continuations every evaluation reads, made here so that parallel evaluations
        # never write the same cache file (the key equals what eval-drafter computes)
        t0 = time.time()
        import torch

        from sglang_tev.hf.datasets import encode_prompt, load_prompts
        from sglang_tev.train.drafter_eval import continuations
        from sglang_tev.train.target import load_target

        torch.set_num_threads(1)
        target, tok = load_target(ASSET / "target", torch.device("cpu"), torch.float32)
        ids = [encode_prompt(p, tok, True) for p in load_prompts(data / "test_prompts.jsonl")]
        for t in DESIGN["eval_temperatures"]:
            continuations(target, tok, ASSET / "target", ids, float(t), DESIGN["eval_max_new_tokens"],
                          DESIGN["eval_seed"], data / "continuations", batch_size=16)
        record(data, {"kind": "test continuations", "command": "drafter_eval.continuations (as eval-drafter)",
                      "seed": DESIGN["eval_seed"], "wall_s": round(time.time() - t0, 1), "machine": mach})
        (data / "continuations.done").write_text("")
    lam_path = data / "lambda.json"
    if lam_path.exists() and json.loads(lam_path.read_text()).get("design") != lambda_design():
        os.replace(lam_path, data / f"lambda-superseded-{int(time.time())}.json")
    if not lam_path.exists():
        t0 = time.time()
        lam = measure_lambda(out)
        lam["design"] = lambda_design()
        lam["wall_s"] = round(time.time() - t0, 1)
        (data / "lambda.json").write_text(json.dumps(lam, indent=1) + "\n")
        record(data, {"kind": "lambda", "command": "measure_lambda", "seed": DESIGN["seeds"][0],
                      "wall_s": lam["wall_s"], "machine": mach})
    return json.loads((data / "lambda.json").read_text())


# ----------------------------------------------------------------------------------------------
# work units
# ----------------------------------------------------------------------------------------------

def steps_done(run_dir: Path) -> int:
    from sglang_tev.train.checkpoint import checkpoint_dirs

    cks = checkpoint_dirs(run_dir)
    return cks[-1][0] if cks else 0


def median_step_s(run_dir: Path) -> float | None:
    recs = [r for r in (json.loads((run_dir / "record.json").read_text()) if (run_dir / "record.json").exists() else [])
            if r["kind"] == "train" and r["steps"][1] > r["steps"][0]]
    if not recs:
        return None
    return statistics.median(r["wall_s"] / (r["steps"][1] - r["steps"][0]) for r in recs)


def eval_cmd(out: Path, draft: Path, dest: Path, prompts: Path | None = None, cache: Path | None = None) -> list[str]:
    """``eval-drafter`` on the test prompts (default) or ``prompts``, continuations cached in
    ``OUT/data/continuations`` (default) or ``cache``."""
    d = DESIGN
    prompts = prompts or out / "data" / "test_prompts.jsonl"
    cache = cache or out / "data" / "continuations"
    return [sys.executable, "-m", "sglang_tev.cli", "eval-drafter", "--target", str(ASSET / "target"),
            "--draft", str(draft), "--prompts", str(prompts),
            "--temperatures", ",".join(f"{t:g}" for t in d["eval_temperatures"]),
            "--budgets", ",".join(map(str, d["eval_budgets"])), "--max-new-tokens", str(d["eval_max_new_tokens"]),
            "--seed", str(d["eval_seed"]), "--cache-dir", str(cache),
            "--output", str(dest), "--overwrite", "--no-progress"]


def bench_cmd(out: Path, draft: Path, dest: Path) -> list[str]:
    d = DESIGN
    return [sys.executable, "-m", "sglang_tev.cli", "bench", "--target", str(ASSET / "target"), "--draft", str(draft),
            "--dataset", str(out / "data" / "test_prompts.jsonl"), "--budgets", "64",
            "--temperatures", ",".join(f"{t:g}" for t in d["eval_temperatures"]),
            "--max-new-tokens", str(d["eval_max_new_tokens"]), "--methods", "tev", "--repeats", "1",
            "--output", str(dest), "--overwrite", "--no-progress"]


def gate(out: Path, design: dict | None = None) -> dict | None:
    """A-s0 against the shipped drafter on the test set (None until both are evaluated), under
    ``design`` (default ``DESIGN``). v1 (chunk 1): |z| > gate_se at every temperature; v2: the
    control must improve, z > gate_se, at each of ``gate_temperatures``."""
    design = design or DESIGN
    a, s = out / name("A", design["seeds"][0]) / "eval" / "results.json", out / "shipped" / "eval" / "results.json"
    if not (a.exists() and s.exists()):
        return None
    ra, rs = load_eval(a), load_eval(s)
    res = {}
    for key in ra:
        d, se = paired(ra[key], rs[key])
        # no movement at all (the same trees everywhere) is z = 0, not an infinite z
        res[key] = {"diff": d, "se": se, "z": d / se if se > 0 else (0.0 if d == 0 else math.copysign(1e9, d))}
    gated = [f"T{t:g}-B{b}" for t in design.get("gate_temperatures", design["eval_temperatures"])
             for b in design["eval_budgets"]]
    signed = design.get("schedule_version", 1) >= 2
    res["go"] = all((res[k]["z"] if signed else abs(res[k]["z"])) > design["gate_se"] for k in gated)
    res["gated"] = gated
    return res


def archived(results: Path) -> dict:
    """The runs a results JSON of this same design holds complete (evaluated and benched) — the
    runs folder is not committed, so a later session continues from the JSON — and its gate:
    ``{"runs": {name: record}, "gate": gate or None}`` (empty for another design or no file)."""
    if not results.exists():
        return {"runs": {}, "gate": None}
    rep = json.loads(results.read_text())
    if rep.get("design") != json.loads(json.dumps(DESIGN)):
        return {"runs": {}, "gate": None}
    return {"runs": {k: v for k, v in rep.get("runs", {}).items() if "eval" in v and "tau" in v},
            "gate": rep.get("gate")}


def units(out: Path, lam: float, ignore_gate: bool, done: dict | None = None) -> list[tuple[str, str, int | None, Path, object]]:
    """The next work units from the state on disk, skipping the runs ``done`` (from
    :func:`archived`) already holds: (kind, run, seed, run dir, payload)."""
    done = done or {"runs": {}, "gate": None}
    todo = []
    shipped = out / "shipped"
    if "shipped" not in done["runs"] and not (shipped / "eval" / "results.json").exists():
        todo.append(("eval", "shipped", None, shipped, BASE_DRAFT))
    g = gate(out) or done["gate"]
    for arm, seed in run_names():
        rd = out / name(arm, seed)
        if name(arm, seed) in done["runs"]:
            continue
        if (arm, seed) != ("A", DESIGN["seeds"][0]) and not ignore_gate and (g is None or not g["go"]):
            continue
        if not (rd / "final" / "model.safetensors").exists():
            todo.append(("train", name(arm, seed), seed, rd, (arm, seed)))
        elif not (rd / "eval" / "results.json").exists():
            todo.append(("eval", name(arm, seed), seed, rd, rd / "final"))
        elif not (rd / "bench" / "results.json").exists():
            todo.append(("bench", name(arm, seed), seed, rd, rd / "final"))
    if "shipped" not in done["runs"] and not (shipped / "bench" / "results.json").exists():
        todo.append(("bench", "shipped", None, shipped, BASE_DRAFT))
    return todo


def do_unit(out: Path, lam: float, unit, segment: int, mach: dict) -> None:
    kind, run, seed, rd, payload = unit
    if kind == "train":
        arm, seed = payload
        a = steps_done(rd)
        b = min(DESIGN["steps"], a + segment)
        run_cmd([sys.executable, "-m", "sglang_tev.train", *train_overrides(out, arm, seed, lam, b)], rd, "train",
                seed, mach, steps=[a, b])
    elif kind == "eval":
        run_cmd(eval_cmd(out, payload, rd / "eval"), rd, "eval", seed, mach)
    else:
        run_cmd(bench_cmd(out, payload, rd / "bench"), rd, "bench", seed, mach)


def estimate_s(unit, segment: int, out: Path) -> float:
    kind, run, seed, rd, payload = unit
    if kind == "train":
        s = median_step_s(rd)
        if s is None:  # an arm's first segment: another run of the same kind, else a guess
            arm = payload[0]
            others = [median_step_s(out / name(arm, x)) for x in DESIGN["seeds"]]
            others = [x for x in others if x is not None]
            s = others[0] if others else (4.0 if arm == "A" else 10.0)
        return s * segment + 20
    walls = []
    for p in out.glob(f"*/record.json"):
        walls += [r["wall_s"] for r in json.loads(p.read_text()) if r["kind"] == kind]
    return statistics.median(walls) if walls else (900.0 if kind == "eval" else 600.0)


def chunk(args, mach: dict) -> int:
    t_end = time.time() + 60 * args.chunk_minutes
    out = args.out
    lam = data_stage(out, mach)["lambda"]
    print(f"[exittrain] data ready; lambda = {lam}", file=sys.stderr, flush=True)
    prior = archived(args.results)
    if prior["runs"]:
        print(f"[exittrain] complete in {args.results}: {', '.join(prior['runs'])}", file=sys.stderr, flush=True)
    running: dict = {}
    busy: set[str] = set()
    with ThreadPoolExecutor(args.jobs) as ex:
        while True:
            todo = [u for u in units(out, lam, args.ignore_gate, prior) if u[1] not in busy]
            for u in todo:
                if len(running) >= args.jobs:
                    break
                est = estimate_s(u, args.segment_steps, out)
                if time.time() + est > t_end:
                    continue
                f = ex.submit(do_unit, out, lam, u, args.segment_steps, mach)
                running[f] = u
                busy.add(u[1])
                print(f"[exittrain] start {u[0]} {u[1]} (about {est / 60:.0f} min)", file=sys.stderr, flush=True)
            if not running:
                break
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for f in done:
                u = running.pop(f)
                busy.discard(u[1])
                f.result()
    g = gate(out) or prior["gate"]
    if g is not None:
        (out / "gate.json").write_text(json.dumps(g, indent=1) + "\n")
        if not g["go"] and not args.ignore_gate:
            print("[exittrain] NO-GO: the token-only arm did not improve the paired metric by more than "
                  f"{DESIGN['gate_se']} SE at T = {DESIGN['gate_temperatures']} ({g}); change the schedule and say so",
                  file=sys.stderr)
    left = units(out, lam, args.ignore_gate, prior)
    stopped = g is not None and not g["go"] and not args.ignore_gate
    end = " — stopped at the gate (no-go)" if stopped else ("" if left else " — the experiment is complete")
    print(f"[exittrain] chunk over: {len(left)} unit(s) left{end}", file=sys.stderr)
    collect(out, args.results)
    return 0


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------

def load_eval(path: Path) -> dict:
    """{"T<t>-B<b>": {"positions": [...], "sums": [...], "block_len": .., "w_*": ..}} of one run."""
    rep = json.loads(path.read_text())
    out = {}
    for r in rep["results"]:
        out[f"T{r['temperature']:g}-B{r['budget']}"] = {
            "positions": r["per_prompt"]["positions"], "sums": r["per_prompt"]["block_len_sum"],
            **{k: r[k] for k in ("block_len", "block_len_se", "w_root", "w_inner", "w_cut", "w_horizon", "w_depth")}}
    return out


def paired(a: dict, b: dict) -> tuple[float, float]:
    """Relative paired difference a − b in % of b's mean, and its SE (over prompts)."""
    from sglang_tev.train.drafter_eval import cluster_se, paired_difference

    if a["positions"] != b["positions"]:
        raise ValueError("the two runs were not evaluated on the same positions")
    d, se = paired_difference(a["sums"], b["sums"], a["positions"])
    ref = cluster_se(b["sums"], b["positions"])[0]
    return 100 * d / ref, 100 * se / ref


def collect(out: Path, results: Path) -> dict:
    """Everything the report needs, from the run directories, into ``results`` (JSON)."""
    old = archived(results)
    runs = dict(old["runs"])  # complete runs of earlier sessions; a run folder on disk replaces its entry
    for rd in sorted(p for p in out.iterdir() if p.is_dir() and p.name != "data"):
        if rd.name in runs and not (rd / "eval" / "results.json").exists():
            continue
        rec = {}
        if (rd / "eval" / "results.json").exists():
            rec["eval"] = load_eval(rd / "eval" / "results.json")
        if (rd / "bench" / "results.json").exists():
            bench = [r for r in json.loads((rd / "bench" / "results.json").read_text()) if r["method"] == "tev"]
            rec["tau"] = {f"T{r['temperature']:g}-B{r['budget']}": r["tau"] for r in bench}
            rec["tokens_per_s"] = {f"T{r['temperature']:g}-B{r['budget']}": r["tokens_per_s"] for r in bench
                                   if r.get("tokens_per_s") is not None}
        log = rd / "train_log.jsonl"
        if log.exists():
            recs = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]
            rec["steps"] = recs[-1]["step"] if recs else 0
            for k in ("ms_draft", "ms_build", "ms_tree_forward", "ms_backward"):
                vals = [r[k] for r in recs if k in r]
                if vals:
                    rec[f"median_{k}"] = round(statistics.median(vals), 1)
            tail = recs[-50:]
            for k in ("loss_tok", "loss_exit", "coverage"):
                if tail and k in tail[0]:
                    rec[f"last50_{k}"] = round(statistics.mean(r[k] for r in tail), 5)
        if (rd / "record.json").exists():
            rec["record"] = json.loads((rd / "record.json").read_text())
        runs[rd.name] = rec
    lam = out / "data" / "lambda.json"
    design = json.loads((out / "design.json").read_text()) if (out / "design.json").exists() else DESIGN
    rep = {"design": design, "arms": {k: {"mode": m, "temperature": t} for k, (m, t) in ARMS.items()},
           "lambda": json.loads(lam.read_text()) if lam.exists() else None,
           "gate": gate(out, design) or old["gate"], "runs": dict(sorted(runs.items())),
           "data_record": json.loads((out / "data" / "record.json").read_text())
           if (out / "data" / "record.json").exists() else [],
           "collected_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(rep, indent=1) + "\n")
    return rep


def decide(deltas: list[float], n_seeds: int | None = None) -> str:
    """The pre-stated rule: all seeds agree in sign and |mean| > 2·SD/√n; pending until every one
    of ``n_seeds`` (default: the recipe's) has its Δ."""
    n_seeds = len(DESIGN["seeds"]) if n_seeds is None else int(n_seeds)
    if len(deltas) < max(2, n_seeds):
        return f"pending ({len(deltas)}/{n_seeds} seeds)"
    m, sd = statistics.mean(deltas), statistics.stdev(deltas)
    same = all(d > 0 for d in deltas) or all(d < 0 for d in deltas)
    if same and abs(m) > 2 * sd / math.sqrt(len(deltas)):
        return "shown: " + ("better" if m > 0 else "worse")
    return "not shown"


def seed_pairs(runs: dict, seeds: list[int], x: str, y: str, key: str) -> list[tuple[float, float] | None]:
    """Per seed, :func:`paired` (Δ %, SE) of arm ``x`` against arm ``y`` (``"shipped"``: the one
    unseeded run) at setting ``key``; None for a seed where either is not evaluated."""
    out = []
    for s in seeds:
        ex = runs.get(name(x, s), {}).get("eval", {})
        ey = runs.get(y if y == "shipped" else name(y, s), {}).get("eval", {})
        out.append(paired(ex[key], ey[key]) if key in ex and key in ey else None)
    return out


def ship_rule(rep: dict, keys: list[str]) -> dict:
    """The pre-stated ship rule on a results JSON: per arm, the per-seed paired Δ % against the
    shipped drafter at every setting and the decision rule's verdict (:func:`decide`); the arm with
    the best mean ``1 + C_p`` at T = 0, B = 64 over its complete seeds; and whether it ships: a
    shown gain at T0-B64 and no shown loss at T1-B64 (pending until every arm has every seed)."""
    runs, d = rep["runs"], rep["design"]
    arms = sorted(rep.get("arms") or ARMS)
    table, means = {}, {}
    for a in arms:
        row = {}
        for k in keys:
            ds = [p[0] for p in seed_pairs(runs, d["seeds"], a, "shipped", k) if p is not None]
            row[k] = {"deltas": ds, "decision": decide(ds, len(d["seeds"]))}
        table[a] = row
        vals = [runs[name(a, s)]["eval"]["T0-B64"]["block_len"] for s in d["seeds"]
                if "T0-B64" in runs.get(name(a, s), {}).get("eval", {})]
        if len(vals) == len(d["seeds"]):
            means[a] = statistics.mean(vals)
    out = {"table": table, "means_T0_B64": means, "best": None, "ships": None}
    if len(means) == len(arms) and "T0-B64" in keys and "T1-B64" in keys:
        best = max(means, key=means.get)
        row = table[best]
        out["best"] = best
        out["ships"] = row["T0-B64"]["decision"] == "shown: better" and row["T1-B64"]["decision"] != "shown: worse"
    return out


def ship_rule_lines(rep: dict, keys: list[str]) -> list[str]:
    """The ship-rule table and verdict of the DFlash2 lattice experiment (its design starts from
    ``draft2``; docs/exittrain.md states the rule before any run). The v1 experiment had its own
    rule (a realized-τ gain at T = 0; applied in docs/exittrain.md), so nothing is printed for it."""
    if "shipped" not in rep["runs"] or rep["design"].get("start_draft") != "draft2":
        return []
    r = ship_rule(rep, keys)
    seeds = rep["design"]["seeds"]
    L = ["", "| arm − shipped (ship rule) | " + " | ".join(f"{k}: " + ", ".join(f"s{s}" for s in seeds) for k in keys)
         + " | " + " | ".join(f"decision {k}" for k in keys) + " |", "| --- " * (1 + 2 * len(keys)) + "|"]
    for a, row in r["table"].items():
        L.append(f"| {a} − shipped | " + " | ".join("; ".join(f"{x:+.2f}" for x in row[k]["deltas"]) + " %"
                                                    if row[k]["deltas"] else "-" for k in keys)
                 + " | " + " | ".join(row[k]["decision"] for k in keys) + " |")
    if r["best"] is None:
        L += ["", "Ship rule: pending (every arm needs every seed evaluated)."]
    else:
        m = r["means_T0_B64"]
        L += ["", f"Ship rule: best mean 1 + C_p at T0-B64 is arm {r['best']} ({m[r['best']]:.4f}; "
              + ", ".join(f"{a} {v:.4f}" for a, v in sorted(m.items()) if a != r["best"]) + "); "
              + (f"it ships (shown better than shipped at T0-B64, not shown worse at T1-B64)." if r["ships"] else
                 f"it does not ship (T0-B64: {r['table'][r['best']]['T0-B64']['decision']}; "
                 f"T1-B64: {r['table'][r['best']]['T1-B64']['decision']}); the shipped drafter stays the default.")]
    return L


def markdown(rep: dict) -> str:
    runs, d = rep["runs"], rep["design"]
    keys = [f"T{t:g}-B{b}" for t in d["eval_temperatures"] for b in d["eval_budgets"]]
    L = []
    lam = rep.get("lambda")
    if lam:
        L += [f"λ = {lam['lambda']} (median |∇L_exit| / |∇L_tok| = {lam['median_ratio']:.4g} over "
              f"{lam['batches']} batches; target ratio {lam['target_ratio']})", ""]
    g = rep.get("gate")
    if g:
        gated = ", ".join(g.get("gated", keys))  # chunk 1's results predate "gated": every key
        rule = f"z > +{d['gate_se']:g}" if d.get("schedule_version", 1) >= 2 else f"abs(z) > {d['gate_se']:g}"
        L += ["| gate: A-s0 − shipped | " + " | ".join(keys) + f" | go ({rule} at {gated}) |", "| --- |" + " --- |" * (len(keys) + 1),
              "| Δ % ± SE (z) | " + " | ".join(f"{g[k]['diff']:+.3f} ± {g[k]['se']:.3f} ({g[k]['z']:+.1f})" for k in keys)
              + f" | {'yes' if g['go'] else 'NO'} |", ""]
    L += ["| run | steps | " + " | ".join(f"1+C_p {k}" for k in keys) + " | " + " | ".join(f"τ {k}" for k in keys)
          + " |", "| --- " * (2 + 2 * len(keys)) + "|"]
    for rn, r in runs.items():
        ev, tau = r.get("eval", {}), r.get("tau", {})
        cells = [f"{ev[k]['block_len']:.4f} ± {ev[k]['block_len_se']:.4f}" if k in ev else "-" for k in keys]
        cells += [f"{tau[k]:.3f}" if k in tau else "-" for k in keys]
        steps = r.get("steps", "-")
        if rn != "shipped" and not ("eval" in r and "tau" in r):
            steps = f"{steps} (partial: its session ended first; it is retrained)"  # runs/ is not committed
        L.append(f"| {rn} | {steps} | " + " | ".join(cells) + " |")
    speed = {rn: r["tokens_per_s"] for rn, r in runs.items() if r.get("tokens_per_s")}
    if speed:  # bench's tok/s (one thread, one repeat; wall time moves with the machine's load)
        skeys = sorted({k for v in speed.values() for k in v})
        L += ["", "| run | " + " | ".join(f"tok/s {k}" for k in skeys) + " |", "| --- " * (1 + len(skeys)) + "|"]
        L += [f"| {rn} | " + " | ".join(f"{v[k]:.1f}" if k in v else "-" for k in skeys) + " |" for rn, v in speed.items()]
    L += ["", "| run | setting | exit at root | inner nodes | budget-cut leaves | horizon | depth 1 | depth 2 | depth 3 |",
          "| --- " * 9 + "|"]
    for rn, r in runs.items():
        for k in keys:
            e = r.get("eval", {}).get(k)
            if e:
                dep = (e["w_depth"] + [0.0] * 4)[1:4]
                L.append(f"| {rn} | {k} | {e['w_root']:.3f} | {e['w_inner']:.3f} | {e['w_cut']:.3f} | "
                         f"{e['w_horizon']:.3f} | " + " | ".join(f"{x:.3f}" for x in dep) + " |")
    L += ["", "| contrast | " + " | ".join(f"{k}: " + ", ".join(f"s{s}" for s in d["seeds"]) for k in keys)
          + " | " + " | ".join(f"decision {k}" for k in keys) + " |", "| --- " * (1 + 2 * len(keys)) + "|"]
    for x, y in contrasts(rep.get("arms")):
        cells, decisions = [], []
        for k in keys:
            pairs = seed_pairs(runs, d["seeds"], x, y, k)
            ds = [p[0] for p in pairs if p is not None]
            per = [f"{p[0]:+.2f} ± {p[1]:.2f}" if p is not None else "-" for p in pairs]
            cells.append("; ".join(per) + " %")
            decisions.append(decide(ds, len(d["seeds"])))
        L.append(f"| {x} − {y} | " + " | ".join(cells) + " | " + " | ".join(decisions) + " |")
    L += ship_rule_lines(rep, keys)
    L += ["", "| run | median step (ms) | draft | build | tree forward | backward | train wall (s) |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for rn, r in runs.items():
        if "median_ms_draft" in r:
            parts = [r.get(f"median_ms_{k}", 0.0) for k in ("draft", "build", "tree_forward", "backward")]
            wall = sum(e["wall_s"] for e in r.get("record", []) if e["kind"] == "train")
            L.append(f"| {rn} | {sum(parts):.0f} | " + " | ".join(f"{p:.0f}" for p in parts) + f" | {wall:.0f} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="exittrain-tiny-code",
                   help="packaged recipe holding the design (default exittrain-tiny-code, the v1 experiment; "
                        "exittrain-draft2: the DFlash2 lattice experiment)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "exittrain")
    p.add_argument("--results", type=Path, default=None,
                   help="results JSON (written by chunks and --collect; default: the recipe's results_name)")
    p.add_argument("--chunk-minutes", type=float, default=110.0, help="wall budget of this chunk, <= 120")
    p.add_argument("--segment-steps", type=int, default=50, help="training steps per work unit (default 50)")
    p.add_argument("--jobs", type=int, default=1, help="work units in parallel, one thread each (default 1)")
    p.add_argument("--ignore-gate", action="store_true", help="run the other arms even when the gate says no-go")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--data-only", action="store_true", help="only the data stage (split, prompts, rollouts, test continuations, λ)")
    only.add_argument("--collect", action="store_true", help="only gather the runs into --results")
    only.add_argument("--report", action="store_true", help="only print the doc tables from --results")
    args = p.parse_args(argv)
    try:
        use_recipe(args.recipe)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"argument --recipe: {e}")
    if args.results is None:
        args.results = RESULTS
    if args.report:
        try:
            res = json.loads(args.results.read_text())
        except (OSError, ValueError) as e:
            p.error(f"argument --results: cannot read {args.results} as JSON ({e})")
        if not isinstance(res, dict) or not isinstance(res.get("runs"), dict) or "design" not in res:
            p.error(f"argument --results: {args.results} is not this experiment's results JSON (no 'runs'/'design')")
        print(markdown(res), end="")
        return 0
    args.out = args.out.resolve()
    if args.collect:
        if not (args.out / "design.json").exists():
            p.error(f"--out: {args.out} holds no experiment (no design.json): nothing to collect")
        collect(args.out, args.results)
        return 0
    if not 0 < args.chunk_minutes <= 120:
        p.error(f"argument --chunk-minutes: must be in (0, 120], got {args.chunk_minutes}")
    for flag, v in (("--jobs", args.jobs), ("--segment-steps", args.segment_steps)):
        if v < 1:
            p.error(f"argument {flag}: must be >= 1, got {v}")
    args.out.mkdir(parents=True, exist_ok=True)
    design = args.out / "design.json"
    if design.exists():
        bad = design_conflict(json.loads(design.read_text()), args.out)
        if bad:
            p.error(f"--out: {args.out} was started with another design ({design}: {bad}); use another --out")
    design.write_text(json.dumps(DESIGN, indent=1) + "\n")
    mach = machine()
    if args.data_only:
        data_stage(args.out, mach)
        return 0
    return chunk(args, mach)


if __name__ == "__main__":
    sys.exit(main())
