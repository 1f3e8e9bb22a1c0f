"""A run's state on disk: checkpoint directories written atomically, the RNG state and config
fingerprint they carry, which checkpoint a run resumes and whether its config may resume it
exactly, and the logs cut back to the checkpoint resumed.

Layout: ``output_dir/checkpoints/step_NNNNNNNN/`` holds ``draft/`` (z-lab layout) and
``trainer_state.pt`` (``{"version", "step", "optimizer", "scheduler", "rng", "threads",
"world_size", "device", "fingerprint", "torch"}``, written by the trainer).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ..atomic import atomic_dir, atomic_write
from .config import ConfigError, TrainConfig, config_to_dict, schema_default

__all__ = ["CHECKPOINT_DIR", "STATE_NAME", "STATE_VERSION", "RUN_CONTROL_KEYS", "checkpoint_dirs",
           "latest_checkpoint", "save_checkpoint", "clean_stale_tmp", "rng_state", "set_rng_state",
           "flatten", "fingerprint", "truncate_log", "find_resume", "check_world_size", "load_resume_state"]

CHECKPOINT_DIR = "checkpoints"
STATE_NAME = "trainer_state.pt"
STATE_VERSION = 1
# Config keys that do not change what is computed: excluded from the resume fingerprint.
RUN_CONTROL_KEYS = frozenset({
    "output_dir", "resume", "save_every", "keep_checkpoints", "eval_every", "eval_data",
    "eval_windows", "eval_stride", "eval_budget", "eval_temperatures", "log_every", "progress",
    "tensorboard", "threads", "allow_thread_change", "export_dtype", "stop_at_step", "device",
})


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``output_dir/checkpoints``, ``[(step, path)]`` oldest first."""
    root = Path(output_dir) / CHECKPOINT_DIR
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith("step_") and p.name[5:].isdigit() and (p / STATE_NAME).is_file() \
                    and (p / "draft").is_dir():
                out.append((int(p.name[5:]), p))
    return sorted(out)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory, or None."""
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1][1] if dirs else None


def save_checkpoint(output_dir: str | os.PathLike, step: int, draft, state: dict, keep: int) -> Path:
    """Write ``checkpoints/step_<step>/`` atomically and keep the newest ``keep`` checkpoints.

    Everything goes to ``checkpoints/.tmp-step_<step>-<random>/`` first (drafter via
    ``save_pretrained``, then ``trainer_state.pt``, fsynced) and one ``os.replace`` publishes it
    (:func:`sglang_tev.atomic.atomic_dir`); any failure removes the temporary directory and leaves the
    previous checkpoints untouched.
    """
    root = Path(output_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    # replaces `final` only when a run re-saves a step it already saved
    with atomic_dir(final) as tmp:
        draft.save_pretrained(tmp / "draft")
        atomic_write(tmp / STATE_NAME, lambda f: torch.save(state, f))
    for _, p in checkpoint_dirs(output_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def clean_stale_tmp(output_dir: str | os.PathLike) -> None:
    """Remove what a killed :func:`save_checkpoint` left (``.tmp-*`` / ``.old-*`` directories)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict:
    """torch, Python and NumPy RNG states (and CUDA's when it is initialised)."""
    st = {"torch": torch.get_rng_state(), "python": random.getstate(),
          "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def flatten(d: Mapping, prefix: str = "") -> dict:
    """A nested mapping as ``{"dotted.key": value}``."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint(cfg: TrainConfig) -> dict:
    """The config keys that change what a step computes, flattened to dotted keys."""
    return flatten({k: v for k, v in config_to_dict(cfg).items() if k not in RUN_CONTROL_KEYS})


def truncate_log(path: str | os.PathLike, step: int) -> None:
    """Drop the JSON-lines records of ``path`` past ``step`` (a killed run may have logged beyond
    its last checkpoint), and blank lines; a missing file stays missing."""
    path = Path(path)
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))


def find_resume(cfg: TrainConfig, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint a run resumes from under ``resume`` (``auto``: the newest in ``output_dir``,
    None when there is none; ``never``: None, refusing an ``output_dir`` that holds checkpoints; a
    path: that checkpoint). Raises :class:`ConfigError` naming ``resume``."""
    out = Path(output_dir)
    if cfg.resume == "never":
        if checkpoint_dirs(out):
            raise ConfigError("resume", f"'never' but {out / CHECKPOINT_DIR} holds "
                                        "checkpoints; use another output_dir or resume=auto")
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(out)
    p = Path(cfg.resume)
    if not (p / STATE_NAME).is_file() or not (p / "draft").is_dir():
        raise ConfigError("resume", f"{p} is not a checkpoint directory (needs {STATE_NAME} "
                                    "and draft/)")
    return p


def check_world_size(path: Path, cfg: TrainConfig, world: int) -> None:
    """Elastic resume: step s reads positions s*G .. (s+1)*G - 1 of the sample stream and
    anchors drawn per global row, G = batch_size x world size, so another world size resumes
    exactly (same global batch, same sample order from the next unseen sample) when G is
    kept. Otherwise ConfigError naming ``batch_size``, the world sizes and the way to go on.
    Checked before the target loads (the state is memory-mapped: only small fields are read)."""
    st = torch.load(path / STATE_NAME, map_location="cpu", weights_only=False, mmap=True)
    if st.get("version") != STATE_VERSION:
        return  # load_resume_state names the version
    world0 = int(st["world_size"])
    batch0 = int(flatten(st["fingerprint"]).get("batch_size", cfg.batch_size))
    global0, global_ = batch0 * world0, cfg.batch_size * world
    if world0 == world or global_ == global0:
        return
    how = (f"set batch_size={global0 // world} ({world} x {global0 // world} = global batch {global0})"
           if global0 % world == 0 else f"use a world size that divides the global batch {global0}")
    raise ConfigError("batch_size", (
        f"checkpoint {path} was written with world size {world0} x batch_size {batch0} = global batch "
        f"{global0}; this run has world size {world} x batch_size {cfg.batch_size} = {global_}, which "
        f"would skip or repeat samples (step s reads samples s*G .. (s+1)*G - 1 of the stream). To resume "
        f"exactly, {how}, or resume with world size {world0}; to train on with another global batch, "
        f"start a new output_dir with draft_init={path / 'draft'}"))


def load_resume_state(path: Path, cfg: TrainConfig, world: int, threads: int,
                      report: bool = True) -> tuple[dict, bool]:
    """The trainer state of checkpoint ``path`` checked against this run: ``(state, extend)``,
    ``extend`` True when only ``max_steps`` grew past the checkpoint's step (the run continues with
    the schedule re-derived).

    Raises ``ValueError`` naming ``resume`` for another state version, :class:`ConfigError` naming
    the first config key that changes what a step computes (a key added after the checkpoint was
    written counts as unchanged at its schema default; ``batch_size`` is checked globally under
    another world size) or ``threads`` for another thread count (unless ``allow_thread_change``).
    With ``report``, a note on stderr says what another world size keeps."""
    st = torch.load(path / STATE_NAME, map_location="cpu", weights_only=False)
    if st.get("version") != STATE_VERSION:
        raise ValueError(f"resume: {path} has trainer state version {st.get('version')}, "
                         f"expected {STATE_VERSION}")
    mine, theirs = fingerprint(cfg), flatten(st["fingerprint"])
    # a key added after the checkpoint was written computes what it did then at its default
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)
                  and not (k not in theirs and mine.get(k) == schema_default(k)))
    world0 = int(st["world_size"])
    batch0, global_ = int(theirs["batch_size"]), cfg.batch_size * world
    if world0 != world:  # the per-rank batch follows the world size; the global one is checked
        diff = [k for k in diff if k != "batch_size"]
    extend = diff == ["max_steps"] and mine["max_steps"] > int(st["step"])
    if diff and not extend:
        changes = ", ".join(f"{k}: {theirs.get(k)!r} -> {mine.get(k)!r}" for k in diff)
        if diff == ["max_steps"]:
            hint = (f"max_steps may only grow past the checkpoint's step {int(st['step'])} "
                    "(the run then continues with the schedule re-derived)")
        else:
            hint = (f"a run resumes with the config it started with; to continue from this "
                    f"drafter under new settings, start a new output_dir with "
                    f"draft_init={path / 'draft'}")
        raise ConfigError(diff[0], f"differs from the checkpoint {path} ({changes}): {hint}")
    if st["threads"] != threads and not cfg.allow_thread_change:
        raise ConfigError("threads", f"checkpoint {path} was written with {st['threads']} "
                                     f"threads, this run uses {threads}: CPU float results "
                                     "depend on it; set threads to match or "
                                     "allow_thread_change=true")
    if world0 != world and report:  # same global batch (checked in check_world_size)
        print(f"[sglang_tev.train] note: checkpoint world size {world0} x batch_size {batch0} -> world "
              f"size {world} x batch_size {cfg.batch_size}: the same global batch ({global_}) and "
              f"sample order continue from sample {int(st['step']) * global_} of the stream; sums over "
              f"ranks change order, so the weights match a run at one world size only to float "
              f"rounding", file=sys.stderr)
    return st, extend
