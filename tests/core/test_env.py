"""The registry of ``SGLANG_TEV_*`` variables (``sglang_tev/env.py``, ``docs/env.md``): one
declaration per variable, the docs list exactly those, unknown names refused with the closest
suggested, bad values named, no other module reading one from ``os.environ``, and every parser
equal to the reader it replaced."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tev import env
from sglang_tev.env import EnvError, check_environment
from sglang_tev.spec import SpecError

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "sglang_tev"
NAME_RE = re.compile(r"SGLANG_TEV_[A-Z0-9_]*[A-Z0-9]")


# ------------------------------------------------------------------ (a) docs/env.md = the registry

def _doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "docs" / "env.md").read_text().splitlines():
        m = re.match(r"\|\s*`(SGLANG_TEV_[A-Z0-9_]+)`\s*\|", line)
        if m:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            assert m.group(1) not in rows, f"docs/env.md lists {m.group(1)} twice"
            rows[m.group(1)] = cells
    return rows


def test_docs_list_exactly_the_registry():
    rows = _doc_rows()
    assert list(rows) == list(env.REGISTRY)  # same names, same order
    for name, cells in rows.items():
        assert len(cells) == 5, (name, cells)
        assert cells[-1] == env.REGISTRY[name].audience, name


def test_every_name_the_repository_mentions_is_registered():
    """A name used anywhere (the package, the harness, tests, scripts, CI, docs) but missing from
    the registry would be refused by check_environment at start-up."""
    files = [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*"),
             *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md",
             *(ROOT / ".ci").glob("*")]
    seen = {}
    for f in files:
        if not f.is_file() or f.resolve() == Path(__file__).resolve():
            continue
        for name in NAME_RE.findall(f.read_text(errors="replace")):
            seen.setdefault(name, f.relative_to(ROOT))
    example = "SGLANG_TEV_" + "VERIFER"  # the refused typo env.py and docs/env.md quote
    missing = {n: str(f) for n, f in seen.items() if n not in env.REGISTRY and n != example}
    assert not missing, f"SGLANG_TEV_* names used but not in sglang_tev/env.py: {missing}"


def test_registry_declarations():
    assert len(env.REGISTRY) == len(set(env.REGISTRY)) == 18
    for name, var in env.REGISTRY.items():
        assert name == var.name and name.startswith(env.PREFIX)
        assert var.audience in (env.USER, env.TESTING)
        assert var.doc and var.values
        assert var.read({}) == var.default  # unset -> the default
    assert set(env.names(env.USER)) | set(env.names(env.TESTING)) == set(env.names())
    assert env.names(env.USER) == ("SGLANG_TEV_VERIFIER", "SGLANG_TEV_TOPK", "SGLANG_TEV_DFLASH2_MODE",
                                   "SGLANG_TEV_BUDGET", "SGLANG_TEV_GRAPH_TREE_SIZES", "SGLANG_TEV_CACHE",
                                   "SGLANG_TEV_NATIVE", "SGLANG_TEV_PLAN_CACHE",
                                   "SGLANG_TEV_REFERENCE_ATTENTION")


# ------------------------------------------------------------------ (b) unknown names

def test_unknown_name_is_refused_with_the_closest_suggested():
    typo = "SGLANG_TEV_VERIF" + "ER"
    with pytest.raises(EnvError) as e:
        check_environment({typo: "tev", "PATH": "/bin"})
    assert isinstance(e.value, SpecError) and isinstance(e.value, ValueError)
    assert e.value.arg == typo and e.value.suggestion == "SGLANG_TEV_VERIFIER"
    msg = str(e.value)
    assert msg.startswith(f"{typo} is not a known sglang-tev variable; did you mean SGLANG_TEV_VERIFIER? (known: ")
    assert all(n in msg for n in env.REGISTRY)


@pytest.mark.parametrize("typo,close", [
    ("SGLANG_TEV_TOP_K", "SGLANG_TEV_TOPK"),
    ("SGLANG_TEV_DFLASH_MODE", "SGLANG_TEV_DFLASH2_MODE"),
    ("SGLANG_TEV_NATIV", "SGLANG_TEV_NATIVE"),
    ("sglang_tev_verifier", "SGLANG_TEV_VERIFIER"),  # lower case is caught too
    ("SGLANG_TEV_KEEP_LOG", "SGLANG_TEV_KEEP_LOGS"),
])
def test_typos_suggest_their_variable(typo, close):
    with pytest.raises(EnvError, match=f"did you mean {close}\\?") as e:
        check_environment({typo: "1"})
    assert e.value.arg == typo


def test_unknown_name_without_a_close_one_and_several_unknowns():
    far = "SGLANG_TEV_" + "ZZZZZZZZZZZZZZZZZZZZ"
    with pytest.raises(EnvError) as e:
        check_environment({far: "1"})
    assert e.value.suggestion is None and "did you mean" not in str(e.value) and "(known: " in str(e.value)
    other = "SGLANG_TEV_" + "VERIFIERS"
    with pytest.raises(EnvError, match=f"also unknown: {far}$") as e:
        check_environment({far: "1", other: "1"})
    assert e.value.arg == other and e.value.suggestion == "SGLANG_TEV_VERIFIER"  # the first, sorted


def test_known_and_foreign_names_pass():
    check_environment({})
    check_environment({n: "garbage" for n in env.REGISTRY})  # values are the readers' business
    check_environment({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_TEVX": "1", "TEV_VERIFIER": "x"})
    with pytest.raises(KeyError, match="did you mean SGLANG_TEV_TOPK"):
        env.get("SGLANG_TEV_TOPKK")


def test_check_runs_where_sglang_tev_starts(monkeypatch, tmp_path):
    typo = "SGLANG_TEV_VERIF" + "ER"
    # the SGLang plugin's validate_server_args hook: first thing it does
    from sglang_tev.srt.config import validate_server_args

    with pytest.raises(EnvError, match="did you mean SGLANG_TEV_VERIFIER"):
        validate_server_args(object(), {typo: "tev"})
    # the TEV worker's constructor (the module needs sglang: read its source instead)
    tree = ast.parse((PKG / "srt" / "worker.py").read_text())
    worker = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TEVWorker")
    init = next(n for n in worker.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    first = init.body[0]
    assert isinstance(first, ast.Expr) and ast.unparse(first.value) == "check_environment()"
    # the trainer's entry point: exit status 2, the message on stderr
    from sglang_tev.train.__main__ import main

    monkeypatch.setenv(typo, "tev")
    assert main(["lr=3e-4"]) == 2
    # the transformers runtime: before anything loads
    from sglang_tev.hf.runtime import SpeculativeGenerator

    with pytest.raises(EnvError, match="did you mean SGLANG_TEV_VERIFIER"):
        SpeculativeGenerator(None)
    with pytest.raises(EnvError, match="did you mean SGLANG_TEV_VERIFIER"):
        SpeculativeGenerator.from_pretrained(tmp_path / "nowhere")


def test_import_never_raises_for_the_environment():
    code = "import sglang_tev, sglang_tev.env, sglang_tev.spec, sglang_tev.srt.config, sglang_tev.native; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **{"SGLANG_TEV_" + "BOGUS": "1"}), cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_env_module_is_torch_free():
    code = ("import sys, sglang_tev.env; "
            "assert 'torch' not in sys.modules; "
            "assert {m for m in sys.modules if m.startswith('sglang_tev')} <= {'sglang_tev', 'sglang_tev.env', 'sglang_tev.spec'}")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


# ------------------------------------------------------------------ (c) bad values

@pytest.mark.parametrize("name,raw,match", [
    ("SGLANG_TEV_VERIFIER", "greedy", r"^SGLANG_TEV_VERIFIER must be one of \('tev', 'predraw', 'sequential'\), got 'greedy'$"),
    ("SGLANG_TEV_TOPK", "0", r"^SGLANG_TEV_TOPK must be an integer >= 1, got '0'$"),
    ("SGLANG_TEV_TOPK", " four ", r"^SGLANG_TEV_TOPK must be an integer >= 1, got 'four'$"),
    ("SGLANG_TEV_DFLASH2_MODE", "walk", r"^SGLANG_TEV_DFLASH2_MODE must be one of \('lattice', 'marginal'\), got 'walk'$"),
    ("SGLANG_TEV_CPU_ATTN_IGNORE_MASK", "maybe", r"^SGLANG_TEV_CPU_ATTN_IGNORE_MASK must be 0 or 1, got 'maybe'$"),
])
def test_bad_value_names_the_variable_and_the_values(name, raw, match):
    with pytest.raises(EnvError, match=match) as e:
        env.get(name, {name: raw})
    assert e.value.arg == name and e.value.suggestion is None


def test_readers_pass_the_registrys_errors_on(monkeypatch):
    from sglang_tev.srt.config import read_dflash2_mode, read_env

    with pytest.raises(EnvError, match="SGLANG_TEV_VERIFIER"):
        read_env({"SGLANG_TEV_VERIFIER": "eagle"})
    with pytest.raises(EnvError, match="SGLANG_TEV_DFLASH2_MODE"):
        read_dflash2_mode({"SGLANG_TEV_DFLASH2_MODE": "selector"})
    monkeypatch.setenv("SGLANG_TEV_TOPK", "-3")
    with pytest.raises(EnvError, match="SGLANG_TEV_TOPK"):
        read_env()  # os.environ by default


# ------------------------------------------------------------------ (d) no other reader

_READ = re.compile(r"""(os\.environ(\.get)?|os\.getenv|environ\.get|\benv\.get)\s*[\[(]\s*f?["']SGLANG_TEV_""")


def _package_modules():
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        if rel == Path("env.py"):
            continue
        yield rel, f.read_text()


def test_no_module_but_env_reads_a_tev_variable():
    offenders = []
    for rel, text in _package_modules():
        for i, line in enumerate(text.splitlines(), 1):
            if _READ.search(line):
                offenders.append(f"sglang_tev/{rel}:{i}: {line.strip()}")
        # names as bare string constants (ENV = "SGLANG_TEV_X"; "SGLANG_TEV_" + suffix) are how a
        # module would read one indirectly: the names come from sglang_tev.env instead
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"SGLANG_TEV_[A-Z0-9_]*", node.value):
                offenders.append(f"sglang_tev/{rel}:{node.lineno}: {node.value!r}")
    assert not offenders, "read SGLANG_TEV_* through sglang_tev.env:\n" + "\n".join(offenders)


def test_the_check_catches_a_reader():
    for line in ('x = os.environ.get("SGLANG_TEV_CACHE")', "os.environ['SGLANG_TEV_NATIVE']",
                 'os.getenv("SGLANG_TEV_X", "1")', 'env.get("SGLANG_TEV_TOPK", "")'):
        assert _READ.search(line), line
    assert not _READ.search('_env.get(_env.CACHE)')


# ------------------------------------------------------------------ (e) the old readers' semantics

# Verbatim copies of the readers the registry replaced (before issue 36 item 9), as
# fn(environ) -> value; a raise is compared as "raises a ValueError naming the variable".

def _old_verifier(e):
    v = e.get("SGLANG_TEV_VERIFIER", "tev").strip().lower() or "tev"
    if v not in ("tev", "predraw", "sequential"):
        raise ValueError(f"TEV: SGLANG_TEV_VERIFIER must be one of ..., got {e.get('SGLANG_TEV_VERIFIER')!r}")
    return v


def _old_topk(e):
    raw = e.get("SGLANG_TEV_TOPK", "").strip()
    topk = None
    if raw:
        try:
            topk = int(raw)
        except ValueError:
            raise ValueError("TEV: SGLANG_TEV_TOPK must be an integer >= 1") from None
        if topk < 1:
            raise ValueError("TEV: SGLANG_TEV_TOPK must be an integer >= 1")
    return topk


def _old_dflash2_mode(e):
    raw = e.get("SGLANG_TEV_DFLASH2_MODE", "")
    mode = raw.strip().lower()
    if not mode:
        return None
    if mode not in ("lattice", "marginal"):
        raise ValueError("TEV: SGLANG_TEV_DFLASH2_MODE must be one of ...")
    return mode


def _old_cache(e):
    return e.get("SGLANG_TEV_CACHE") or None  # native._cache_dir: a falsy value -> the XDG default


def _old_native(e):
    return not (e.get("SGLANG_TEV_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"))


def _old_reference_attention(e):
    return e.get("SGLANG_TEV_REFERENCE_ATTENTION", "0") == "1"


def _old_ignore_mask(e):
    raw = e.get("SGLANG_TEV_CPU_ATTN_IGNORE_MASK", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError("SGLANG_TEV_CPU_ATTN_IGNORE_MASK must be 0 or 1")


def _old_exactly_one(name):
    return lambda e: e.get(name) == "1"  # the harness: sitecustomize, hosts._remove, required.py


def _old_path(name):
    return lambda e: e.get(name) or None  # the harness: `if os.environ.get(ENV): ... os.environ[ENV]`


def _old_choice(raw: str, choices: tuple, default: str) -> str:
    value = raw.strip().lower() or default
    if value not in choices:
        raise ValueError(raw)
    return value


def _old_tree_sizes(e):
    # new with the graph tiers: auto (or empty) = None, "off" = (), else tree sizes >= 1 ("0" refused)
    v = e.get("SGLANG_TEV_GRAPH_TREE_SIZES", "").strip().lower()
    if v in ("", "auto"):
        return None
    if v == "off":
        return ()
    sizes = tuple(int(x) for x in v.split(","))
    if min(sizes) < 1:
        raise ValueError(v)
    return sizes


OLD = {
    "SGLANG_TEV_VERIFIER": _old_verifier,
    "SGLANG_TEV_TOPK": _old_topk,
    "SGLANG_TEV_DFLASH2_MODE": _old_dflash2_mode,
    "SGLANG_TEV_CACHE": _old_cache,
    "SGLANG_TEV_NATIVE": _old_native,
    # new with the plan cache: the same on/off words as NATIVE
    # new with the served auto budget: fixed | auto (| auto-ragged since the ragged verify), stripped,
    # any case; empty = auto since auto became the default (with the graph tiers)
    "SGLANG_TEV_BUDGET": lambda e: _old_choice(e.get("SGLANG_TEV_BUDGET", ""), ("fixed", "auto", "auto-ragged"), "auto"),
    "SGLANG_TEV_GRAPH_TREE_SIZES": _old_tree_sizes,
    "SGLANG_TEV_PLAN_CACHE": lambda e: e.get("SGLANG_TEV_PLAN_CACHE", "1").strip().lower() not in ("0", "false", "no", "off"),
    "SGLANG_TEV_REFERENCE_ATTENTION": _old_reference_attention,
    "SGLANG_TEV_CPU_ATTN_IGNORE_MASK": _old_ignore_mask,
    "SGLANG_TEV_CPU_HARNESS": _old_exactly_one("SGLANG_TEV_CPU_HARNESS"),
    "SGLANG_TEV_TP_TRACE": _old_path("SGLANG_TEV_TP_TRACE"),
    "SGLANG_TEV_SYNC_PROBE": _old_path("SGLANG_TEV_SYNC_PROBE"),
    # new with the CPU harness's plain-step hooks: the same readers as CPU_HARNESS / SYNC_PROBE
    "SGLANG_TEV_PLAIN_STEPS": _old_exactly_one("SGLANG_TEV_PLAIN_STEPS"),
    "SGLANG_TEV_RAGGED_CUTS": _old_exactly_one("SGLANG_TEV_RAGGED_CUTS"),
    "SGLANG_TEV_STEP_TRACE": _old_path("SGLANG_TEV_STEP_TRACE"),
    "SGLANG_TEV_KEEP_LOGS": _old_exactly_one("SGLANG_TEV_KEEP_LOGS"),
    "SGLANG_TEV_REQUIRE_SGLANG": _old_exactly_one("SGLANG_TEV_REQUIRE_SGLANG"),
}

RAWS = [None, "", " ", "1", "0", " 1 ", "true", "TRUE", "yes", "on", "false", "No", " off ", "2", "-1", "08",
        "8", " 16 ", "+4", "four", "tev", "Sequential", " predraw ", "greedy", "lattice", "MARGINAL",
        "walk", "/tmp/x", "maybe", "auto-ragged", " Auto-Ragged ", "auto", "1,5, 9", "9,0", "5,,9"]


def test_old_readers_are_all_covered():
    assert set(OLD) == set(env.REGISTRY)


@pytest.mark.parametrize("name", list(OLD))
def test_each_accessor_keeps_the_old_semantics(name):
    for raw in RAWS:
        environ = {} if raw is None else {name: raw}
        try:
            want = ("value", OLD[name](environ))
        except ValueError:
            want = ("raises",)
        try:
            got = ("value", env.get(name, environ))
        except EnvError as e:
            assert e.arg == name and str(e).startswith(name)
            got = ("raises",)
        assert got == want, (name, raw)


def test_user_defaults_are_the_old_ones():
    assert env.get(env.VERIFIER, {}) == "tev"
    assert env.get(env.TOPK, {}) is None  # -> the budget B = N - 1 (config.resolve_server_args)
    assert env.get(env.DFLASH2_MODE, {}) is None  # -> the drafter decides (srt/dflash2)
    assert env.get(env.CACHE, {}) is None  # -> $XDG_CACHE_HOME/sglang_tev or ~/.cache/sglang_tev
    assert env.get(env.NATIVE, {}) is True
    assert env.get(env.REFERENCE_ATTENTION, {}) is False


def test_sites_read_through_the_registry(monkeypatch, tmp_path):
    from sglang_tev import native
    from sglang_tev.srt.config import read_dflash2_mode, read_env
    from sglang_tev.srt.plugin import wants_cpu_attention

    assert read_env({}) == ("tev", None)
    assert read_env({"SGLANG_TEV_VERIFIER": " Predraw ", "SGLANG_TEV_TOPK": " 8 "}) == ("predraw", 8)
    assert read_dflash2_mode({"SGLANG_TEV_DFLASH2_MODE": "Lattice"}) == "lattice"
    assert wants_cpu_attention({"SGLANG_TEV_REFERENCE_ATTENTION": "1"})
    assert not wants_cpu_attention({"SGLANG_TEV_REFERENCE_ATTENTION": "true"})  # exactly "1", as before
    monkeypatch.setenv("SGLANG_TEV_CACHE", str(tmp_path))
    assert native._cache_dir() == str(tmp_path)
    monkeypatch.setenv("SGLANG_TEV_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native._cache_dir() == str(tmp_path / "xdg" / "sglang_tev")
    for raw, off in (("0", True), ("OFF", True), ("1", False), ("maybe", False)):
        monkeypatch.setenv("SGLANG_TEV_NATIVE", raw)
        assert native._disabled() is off


@pytest.mark.parametrize("command", [["generate", "x"], ["draw-tree", "--prompt", "x"], ["bench", "--dataset", "x.jsonl"]])
def test_every_cli_command_refuses_a_typo_before_loading_anything(command):
    """The CLI checks the environment before running any command: no argument is blamed, and no
    model (nor torch) is loaded first."""
    typo = "SGLANG_TEV_PLAN_CAC" + "H"
    code = ("import sys; from sglang_tev.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, *command], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **{typo: "0"}), cwd=ROOT)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert line.count("\n") == 0 and "did you mean SGLANG_TEV_PLAN_CACHE?" in line and "argument" not in line
