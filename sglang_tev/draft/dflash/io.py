"""The drafter's checkpoint on disk, z-lab layout: a directory holding ``config.json`` (the
:meth:`~sglang_tev.draft.dflash.config.DFlashConfig.to_dict` dict plus the weights' ``dtype``) and
one ``model.safetensors`` (z-lab tensor names, metadata ``{"format": "pt"}``).

:func:`is_dflash_checkpoint` tells a drafter directory from a target's. :func:`read_checkpoint` /
:func:`write_checkpoint` are the file side of
:meth:`~sglang_tev.draft.dflash.model.DFlashDraftModel.from_pretrained` /
:meth:`~sglang_tev.draft.dflash.model.DFlashDraftModel.save_pretrained`, which build and check
the module. Writes are published whole through :func:`sglang_tev.atomic.atomic_dir`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

from ...atomic import atomic_dir
from .config import DFlashConfig

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "is_dflash_checkpoint", "read_checkpoint",
           "write_checkpoint"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def is_dflash_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path/config.json`` describes a DFlash drafter (a ``dflash_config`` block or a
    ``DFlash*`` architecture), e.g. to refuse one where a target model is expected: transformers
    would load it as a Qwen3 causal LM with randomly initialised missing weights. False when
    there is no readable config."""
    try:
        cfg = json.loads((Path(path) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    archs = cfg.get("architectures") or []
    return "dflash_config" in cfg or any(isinstance(a, str) and "DFlash" in a for a in archs)

def read_checkpoint(path: str | os.PathLike) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """The parsed config and the stored tensors (on CPU, in their stored dtypes) of the z-lab
    layout checkpoint at ``path``; the tensors are not checked against the config here.

    Raises ``FileNotFoundError`` (argument ``path``) when the directory or either file is missing;
    ``ValueError`` naming the key for invalid JSON or config keys.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"path: {root} is not a directory")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (root / name).is_file():
            raise FileNotFoundError(f"path: {root} has no {name} (z-lab DFlash layout: "
                                    f"{CONFIG_NAME} + a single {WEIGHTS_NAME})")
    config = DFlashConfig.from_json_file(root / CONFIG_NAME)
    return config, load_file(str(root / WEIGHTS_NAME), device="cpu")


def write_checkpoint(path: str | os.PathLike, config: DFlashConfig,
                     state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Write ``config.json`` (``config.to_dict()`` with ``"dtype"`` = ``dtype``'s name, e.g.
    ``"bfloat16"``, and no ``torch_dtype``; keys sorted, indent 2) and ``model.safetensors``
    (``state``'s tensors detached, copied to CPU, contiguous) atomically.

    Both files are written to a temporary directory beside ``path`` and renamed into place;
    an existing checkpoint at ``path`` is replaced only after the new one is complete (on
    failure the old one is left intact and the temporary directory removed). Raises
    ``FileNotFoundError`` if the parent directory is missing and ``ValueError`` if ``path`` is
    a file or a directory holding files other than a checkpoint (never deleted); both before
    anything is written.
    """
    dest = Path(path)
    parent = dest.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"path: parent directory {parent} does not exist")
    if dest.exists():
        if not dest.is_dir():
            raise ValueError(f"path: {dest} exists and is not a directory")
        others = sorted(p.name for p in dest.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME))
        if others:
            raise ValueError(f"path: {dest} holds files other than a checkpoint {others}; "
                             "refusing to replace it")
    cfg = config.to_dict()
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg.pop("torch_dtype", None)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    with atomic_dir(dest) as tmp:  # files fsynced before the rename publishes them
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
