"""Start SGLang 0.5.23 on this CPU for the end-to-end tests: an Engine host or an HTTP server.

Both run in child processes with the CPU harness (:func:`.harness.harness_env`); nothing here
imports sglang. Settings shared by every test Engine/server: the shipped tiny pair, bf16 (the
drafter's embeddings arrive in bf16; see the notes), no CUDA graphs (SGLang has no CPU graph
runner for speculative algorithms), overlap scheduling ON (SGLang's default; TEV turns it off
itself where its KV reserve is too small, e.g. N = 9 with the 16-token block), a small KV pool, and ``sleep_on_idle`` (keep as few hosts alive at once as possible all the same:
on 2 cores every live scheduler costs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_tev import env as tev_env
from sglang_tev.hf.assets import ASSETS_DIR

from . import harness
from .required import require_sglang  # noqa: F401  (the test modules import it from here too)

ASSETS = Path(ASSETS_DIR)
# the children's working folder: not the repository (nothing there may shadow the installed package)
_CHILD_CWD = tempfile.gettempdir()
TARGET, DRAFT = str(ASSETS / "target"), str(ASSETS / "draft")

BASE = dict(
    model_path=TARGET,
    device="cpu",
    dtype="bfloat16",
    disable_cuda_graph=True,
    disable_overlap_schedule=False,
    mem_fraction_static=0.3,  # of free RAM; the pool itself is capped by max_total_tokens
    max_total_tokens=8192,
    max_running_requests=16,
    chunked_prefill_size=512,
    log_level="warning",
    random_seed=0,
    # an idle scheduler otherwise spins at ~half a core, which slows every other process here
    sleep_on_idle=True,
)


def prompt_token_ids(prompts) -> list:
    """The shipped target's tokenizer's ids of each prompt (no special tokens added by it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    return [tok(p).input_ids for p in prompts]


def hf_target():
    """The shipped target in HF transformers, bf16 (the Engines' dtype), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.bfloat16).eval()


def hf_greedy_ids(model, prompt_ids, max_new) -> list:
    """HF ``generate(do_sample=False)`` of each prompt alone (no padding): the new ids, the
    reference every Engine test compares greedy output with."""
    import torch

    out = []
    with torch.no_grad():
        for ids, n in zip(prompt_ids, max_new):
            y = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0)
            out.append(y[0, len(ids) :].tolist())
    return out


def tev_kwargs(tree_size: int, **extra) -> dict:
    """Engine kwargs for TEV with the shipped drafter and tree size N = B + 1."""
    kw = dict(BASE, speculative_algorithm="TEV", speculative_draft_model_path=DRAFT, speculative_num_draft_tokens=tree_size)
    kw.update(extra)
    return kw


def dflash_kwargs(**extra) -> dict:
    """Engine kwargs for SGLang's own DFLASH (chain drafts) with the shipped drafter on
    ``tev_cpu``; the block size comes from the drafter's config (``block_size`` 16), as SGLang
    infers it when ``speculative_num_draft_tokens`` is unset (``speculative_hook.py:388-426``)."""
    kw = dict(BASE, speculative_algorithm="DFLASH", speculative_draft_model_path=DRAFT, attention_backend="tev_cpu")
    kw.update(extra)
    return kw


def plain_kwargs(**extra) -> dict:
    kw = dict(BASE, attention_backend="tev_cpu")
    kw.update(extra)
    return kw


def _env(extra_env: dict | None) -> dict:
    env = harness.harness_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    # the tests and benchmarks time and check fixed trees unless they ask for a load-adaptive mode
    # (SGLANG_TEV_BUDGET=auto, the plugin's default, is set explicitly where it is under test)
    env.setdefault(tev_env.BUDGET, "fixed")
    env.update(extra_env or {})
    return env


class EngineHost:
    """``sglang.Engine(**kwargs)`` in a child process (``engine_host.py``); :meth:`call` sends one
    command and returns its result, raising ``EngineError`` for an error reply."""

    class Error(RuntimeError):
        pass

    def __init__(self, kwargs: dict, env: dict | None = None, start_timeout: float = 600.0):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tev-engine-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_tev.testing.sglang_cpu.engine_host", json.dumps(kwargs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=_env(env),
            cwd=_CHILD_CWD,
        )
        try:
            self.started = self._read(start_timeout)
        except BaseException:  # a failed or interrupted start leaves no Engine behind
            _abandon(self.proc)
            raise

    def _read(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine host exited ({self.proc.poll()}); log:\n{self.tail()}")
            if line.startswith("@@tev-engine-host@@ "):
                reply = json.loads(line[len("@@tev-engine-host@@ ") :])
                if not reply["ok"]:
                    raise EngineHost.Error(reply["error"])
                return reply["result"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine host: no reply in {timeout} s; log:\n{self.tail()}")

    def call(self, op: str, timeout: float = 600.0, **kw):
        self.proc.stdin.write(json.dumps(dict(op=op, **kw)) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def generate(self, input_ids, sampling_params, **kw):
        return self.call("generate", input_ids=input_ids, sampling_params=sampling_params, **kw)

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        return "".join(Path(self.log.name).read_text(errors="replace").splitlines(True)[-n:])

    def close(self):
        children = _children(self.proc.pid)
        if self.proc.poll() is None:
            try:
                self.call("shutdown", timeout=120)
                self.proc.wait(timeout=120)
            except Exception:
                self.proc.kill()
        _kill(children)  # SGLang's scheduler / detokenizer, if the shutdown left any
        _remove(self.log)


def first_divergence(a, b):
    """The first index where token lists ``a`` and ``b`` differ (the shorter length when one is a
    prefix of the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class EnginePool:
    """Engines by name for one test module: each started once, lazily (``get``), closed by
    ``close`` or ``close_all`` (an idle Engine still costs CPU on 2 cores: close what is done)."""

    def __init__(self):
        self.hosts = {}

    def get(self, name, kwargs, env=None):
        if name not in self.hosts:
            self.hosts[name] = EngineHost(kwargs, env=env)
        return self.hosts[name]

    def close(self, name):
        h = self.hosts.pop(name, None)
        if h is not None:
            h.close()

    def close_all(self):
        for name in list(self.hosts):
            self.close(name)


def _remove(log) -> None:
    """Delete a host's log (failures quote its tail in their message; ``SGLANG_TEV_KEEP_LOGS=1``
    keeps it)."""
    log.close()
    if not tev_env.get(tev_env.KEEP_LOGS):
        try:
            os.unlink(log.name)
        except FileNotFoundError:
            pass


def _abandon(proc) -> None:
    """Kill a host process that never became ready, and everything it started (SGLang's scheduler
    and detokenizer outlive their parent otherwise)."""
    children = _children(proc.pid)
    proc.kill()
    _kill(children)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _children(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill(procs) -> None:
    import psutil

    for c in procs:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(kwargs: dict) -> list[str]:
    args = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        elif v is False or v is None:
            continue
        else:
            args += [flag, str(v)]
    return args


class ServerHost:
    """``python -m sglang_tev.testing.sglang_cpu.serve`` (``sglang.launch_server`` with the CPU
    harness, the documented way to try the server on a CPU) on 127.0.0.1; JSON helpers."""

    def __init__(self, kwargs: dict, env: dict | None = None, start_timeout: float = 600.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tev-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "sglang_tev.testing.sglang_cpu.serve", *_cli(kwargs), "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=_env(env), cwd=_CHILD_CWD)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:  # a failed or interrupted start leaves no server behind
            _abandon(self.proc)
            raise

    def _wait_healthy(self, start_timeout: float) -> None:
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log:\n{self.tail()}")
            try:
                if self.get("/health_generate", timeout=30)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy in {start_timeout} s; log:\n{self.tail()}")
            time.sleep(1.0)

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        return "".join(Path(self.log.name).read_text(errors="replace").splitlines(True)[-n:])

    def get(self, path: str, timeout: float = 60.0):
        try:
            with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: dict, timeout: float = 300.0):
        """POST JSON; returns (status, parsed JSON or raw text)."""
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def stream(self, path: str, body: dict, timeout: float = 300.0, stop_after: int | None = None):
        """POST with ``stream: true``; the list of parsed ``data:`` events (``[DONE]`` excluded).
        ``stop_after`` closes the connection after that many events (a client that goes away)."""
        req = urllib.request.Request(
            self.base + path, data=json.dumps(dict(body, stream=True)).encode(), headers={"Content-Type": "application/json"}
        )
        events = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                events.append(json.loads(data))
                if stop_after is not None and len(events) >= stop_after:
                    break
        return events

    def close(self):
        children = _children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        _kill(children)
        _remove(self.log)
