"""The frozen target of a run: its device, config, tokenizer and weights (``requires_grad=False``,
eval mode), checked to be a target and not a drafter before anything loads."""

from __future__ import annotations

import os

import torch

from ..draft.dflash import is_dflash_checkpoint
from .config import ConfigError

__all__ = ["resolve_device", "load_target_config", "load_target_tokenizer", "load_target", "text_config",
           "separator_ids"]


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{local_rank}"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{name!r} requested but torch.cuda.is_available() is False")
    return dev


def _check_target_dir(path: str | os.PathLike) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"target: no model directory at {os.fspath(path)!r}")
    if is_dflash_checkpoint(path):
        raise ValueError(f"target: {os.fspath(path)!r} is a DFlash drafter (z-lab layout), not a target "
                         "model; give it as the draft (draft_init in a training config)")


def load_target_config(path: str | os.PathLike):
    """The target's (text) config without its weights. Raises ``FileNotFoundError`` /
    ``ValueError`` naming ``target``."""
    from transformers import AutoConfig

    _check_target_dir(path)
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"target: cannot read a model config in {os.fspath(path)!r}: {e}") from e
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def load_target_tokenizer(path: str | os.PathLike):
    """The target directory's tokenizer, or None when it has none."""
    from transformers import AutoTokenizer

    _check_target_dir(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def load_target(path: str | os.PathLike, device: torch.device, dtype: torch.dtype, tokenizer: bool = True):
    """Frozen HF causal LM + its tokenizer (None when the directory has none or ``tokenizer`` is
    False).

    Every parameter gets ``requires_grad=False``; the model is in eval mode; transformers'
    weight-loading progress bar is silenced. Raises ``FileNotFoundError`` / ``ValueError`` naming
    ``target``.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    _check_target_dir(path)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as e:
        raise ValueError(f"target: cannot load a causal LM from {os.fspath(path)!r}: {e}") from e
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.to(device).eval().requires_grad_(False)
    return model, (load_target_tokenizer(path) if tokenizer else None)


def text_config(model):
    """The (text) config of an HF model: ``config.get_text_config()`` where it exists."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg



def separator_ids(target, tokenizer) -> list[int]:
    """The document separators of the data: the tokenizer's EOS id(s), else the target config's;
    [] when neither has one."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(text_config(target), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
