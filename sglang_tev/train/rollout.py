"""Online target rollouts (paper App. D: "the frozen target model generates rollout responses
during training, and the drafter is updated on these target-generated trajectories").

The frozen target answers every prompt of ``rollout.prompts`` once, by plain sampling (HF
``generate``, batched with left padding: the output law is the target's own); the responses are
appended batch by batch to a jsonl cache with their generation settings beside it
(``<cache>.meta.json``). A rerun — a resumed run, or another run pointing ``rollout.cache`` at the
same file — reuses the finished rows and completes a partial cache; a cache made with other
settings is refused. Training then reads the cache as ``prompt_ids`` + ``response_ids`` rows
(:mod:`.data`): only response tokens are supervised.

Prompt rows: ``{"messages": [{role, content}, ...]}`` (rendered with the tokenizer's chat
template and its generation prompt), ``{"prompt": "..."}`` (rendered with the chat template
when ``chat_template`` is true and the tokenizer has one, else used as raw text) or
``{"prompt_ids": [...]}`` (token ids, used as they are).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write
from .config import ConfigError, RolloutConfig, config_to_dict
from .data import jsonl_rows

__all__ = ["check_prompt_file", "read_prompts", "rollout_settings", "cache_path", "ensure_rollouts", "cut_prompts"]

KEY = "rollout.prompts"


def _usable(row: Any, lineno: int, path: Path) -> bool:
    """Structural check of one prompt row; raises for a malformed row, False for an empty one."""
    if not isinstance(row, dict) or sum(k in row for k in ("prompt", "messages", "prompt_ids")) != 1:
        raise ValueError(f"{KEY}: line {lineno} of {path} must be an object with exactly one of "
                         "'prompt', 'messages' or 'prompt_ids'")
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise ValueError(f"{KEY}: line {lineno}: 'prompt_ids' must be a list of token ids (ints >= 0)")
        return bool(ids)
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError(f"{KEY}: line {lineno}: 'prompt' must be a string")
        return bool(row["prompt"].strip())
    msgs = row["messages"]
    if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                             and "role" in m for m in msgs):
        raise ValueError(f"{KEY}: line {lineno}: 'messages' must be a list of {{role, content}} objects")
    # a trailing assistant turn would be answered again; drop it as chat SFT data usually is
    return bool(msgs) and any(m["role"] == "user" for m in msgs)


def check_prompt_file(path: str | os.PathLike) -> int:
    """Number of usable prompt rows (cheap: no tokenizer). Raises ``FileNotFoundError`` /
    ``ValueError`` naming ``rollout.prompts`` for a missing file, a malformed row or no usable row."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{KEY}: no file at {os.fspath(p)!r}")
    n = sum(_usable(row, lineno, p) for lineno, row in jsonl_rows(p, KEY))
    if n == 0:
        raise ValueError(f"{KEY}: {os.fspath(p)!r} has no usable row (a non-empty 'prompt' or "
                         "'messages' with a user turn)")
    return n


def read_prompts(path: str | os.PathLike, tokenizer, chat_template: bool = True,
                 limit: int | None = None) -> list[tuple[str, list[int]]]:
    """``[(rendered text, token ids)]`` of the usable prompt rows, in file order (first ``limit``).

    Raises ``ValueError`` naming ``rollout.prompts`` as :func:`check_prompt_file`, and for
    ``messages`` rows when the tokenizer has no chat template.
    """
    p = Path(path)
    check_prompt_file(p)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for lineno, row in jsonl_rows(p, KEY):
        if not _usable(row, lineno, p):
            continue
        if "prompt_ids" in row:  # already tokenized (``eval-drafter`` writes these)
            out.append((tokenizer.decode(row["prompt_ids"]), list(row["prompt_ids"])))
            if limit is not None and len(out) >= limit:
                break
            continue
        if "messages" in row:
            if not has_template:
                raise ValueError(f"{KEY}: line {lineno}: chat 'messages' need a tokenizer with a chat template")
            msgs = row["messages"]
            while msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        elif chat_template and has_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                 tokenize=False, add_generation_prompt=True)
        else:
            text = row["prompt"]
        ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if ids:
            out.append((text, ids))
        if limit is not None and len(out) >= limit:
            break
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rollout_settings(cfg: RolloutConfig, target_path: str | os.PathLike) -> dict:
    """What a cache's responses depend on: the target, the prompt file's content and every
    generation setting (``cache`` itself excluded)."""
    d = {k: v for k, v in config_to_dict(cfg).items() if k != "cache"}
    d["prompts_sha256"] = _sha256(Path(cfg.prompts))
    d["target"] = os.path.realpath(target_path)
    return d


def cache_path(cfg: RolloutConfig, output_dir: str | os.PathLike) -> Path:
    """``rollout.cache``, or ``<output_dir>/rollouts.jsonl``."""
    return Path(cfg.cache) if cfg.cache is not None else Path(output_dir) / "rollouts.jsonl"


def _complete_rows(path: Path) -> int:
    """Rows fully written to ``path``; a torn last line (killed mid-write) is cut off."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return data[:end].count(b"\n")


def _generate(target, tokenizer, prompts: list[list[int]], cfg: RolloutConfig, seed: int,
              device: torch.device) -> list[tuple[list[int], str]]:
    """One batch: ``[(response ids, finish_reason)]``, EOS kept (the drafter learns to propose it)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), L), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token at column L-1
        ids[i, L - len(p):] = torch.tensor(p)
        attn[i, L - len(p):] = 1
    sample = cfg.temperature > 0
    kw = dict(do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k or None, top_p=cfg.top_p) \
        if sample else dict(do_sample=False)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():  # the trainer's RNG stays untouched
        torch.manual_seed(seed)
        out = target.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                              max_new_tokens=cfg.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                              **kw)
    res = []
    for row in out[:, L:].tolist():
        if eos is not None and eos in row:
            res.append((row[: row.index(eos) + 1], "stop"))
        else:
            res.append((row, "length"))
    return res


def ensure_rollouts(target, tokenizer, cfg: RolloutConfig, target_path: str | os.PathLike,
                    output_dir: str | os.PathLike, device: torch.device, progress: bool = True) -> Path:
    """Generate (or reuse / complete) the rollout cache; returns its path.

    Batches of ``cfg.batch_size`` prompts in file order; batch i samples with seed
    ``cfg.seed * 1_000_003 + i``, so a completed partial cache equals an uninterrupted one.
    Raises ``ConfigError`` naming ``rollout`` when the cache was made with other settings,
    ``ValueError`` naming ``rollout.prompts`` for unusable prompts.
    """
    from tqdm import tqdm

    if tokenizer is None:
        raise ValueError(f"{KEY}: rollouts need the target's tokenizer, none was found")
    path = cache_path(cfg, output_dir)
    meta_path = path.with_name(path.name + ".meta.json")
    settings = rollout_settings(cfg, target_path)
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if diff:
            raise ConfigError("rollout", f"the cache {os.fspath(path)!r} was generated with other settings "
                                         f"({', '.join(f'{k}: {old.get(k)!r} -> {settings.get(k)!r}' for k in diff)}); "
                                         "point rollout.cache at a new file")
    elif path.exists() and path.stat().st_size:
        raise ConfigError("rollout.cache", f"{os.fspath(path)!r} exists without {meta_path.name}: it was not "
                                           "written by a rollout; point rollout.cache at a new file")
    prompts = read_prompts(cfg.prompts, tokenizer, cfg.chat_template, cfg.limit)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not meta_path.exists():
        atomic_write(meta_path, json.dumps(settings, indent=2) + "\n")
    done = _complete_rows(path)
    if done >= len(prompts):
        return path
    bar = tqdm(total=len(prompts), initial=done, desc="rollout", unit="prompt", file=sys.stderr,
               dynamic_ncols=True, disable=not progress, mininterval=0.5 if sys.stderr.isatty() else 30)
    was_training = target.training
    target.eval()
    n_tok, t0 = 0, time.perf_counter()
    try:
        with open(path, "a", encoding="utf-8") as f:
            for start in range(done - done % cfg.batch_size, len(prompts), cfg.batch_size):
                batch = prompts[start:start + cfg.batch_size]
                outs = _generate(target, tokenizer, [ids for _, ids in batch], cfg,
                                 cfg.seed * 1_000_003 + start // cfg.batch_size, device)
                lines = []
                for i, ((text, p_ids), (r_ids, reason)) in enumerate(zip(batch, outs)):
                    if start + i < done:  # rows a killed run already wrote (batch seeds are fixed)
                        continue
                    lines.append(json.dumps({"index": start + i, "prompt": text, "prompt_ids": p_ids,
                                             "response": tokenizer.decode(r_ids, skip_special_tokens=True),
                                             "response_ids": r_ids, "finish_reason": reason}) + "\n")
                    n_tok += len(r_ids)
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(lines))
                bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}")
    finally:
        bar.close()
        target.train(was_training)
    return path


def cut_prompts(root: str | os.PathLike, files: list[str], n: int, seed: int, max_chars: int) -> list[dict]:
    """``n`` rollout prompts cut from source files: each is the text before a seeded random line
    start (at least 5 lines and 200 characters into its file), beginning at the first line start
    at most ``max_chars`` characters earlier. Files (paths relative to ``root``) are visited
    round-robin in a seeded order; each cut point is used once, so a longer list extends a
    shorter one with the same ``seed`` without changing its head. Unreadable or non-UTF-8 files
    are skipped.

    Returns rows ``{"id": "<file>:<line>", "prompt": str}`` (the ``rollout.prompts`` format).
    Raises ``ValueError`` naming ``n`` when the files hold fewer than ``n`` cut points.
    """
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    cuts = {}
    for rel in order:
        try:
            text = (Path(root) / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        starts, off = [], 0
        for line in text.splitlines(keepends=True):
            starts.append(off)
            off += len(line)
        cand = [i for i in range(5, len(starts)) if starts[i] >= 200 and text[starts[i]:starts[i] + 1].strip()]
        rng.shuffle(cand)
        if cand:
            cuts[rel] = (text, starts, cand)
    out = []
    while len(out) < n and any(c[2] for c in cuts.values()):
        for rel in order:
            if rel not in cuts or not cuts[rel][2] or len(out) >= n:
                continue
            text, starts, cand = cuts[rel]
            i = cand.pop()
            end = starts[i]
            begin = next(s for s in starts if s >= end - max_chars)
            out.append({"id": f"{rel}:{i + 1}", "prompt": text[begin:end]})
    if len(out) < n:
        raise ValueError(f"n: only {len(out)} prompts could be cut from {len(files)} files, {n} wanted")
    return out
