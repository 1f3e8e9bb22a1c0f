"""Drafter training (DESIGN §6): the dense DFlash objective on a frozen target.

    python -m sglang_tev.train --config run.yaml [key=value ...]

Python API: :func:`train` (config path / mapping / :class:`TrainConfig` + overrides) ->
:class:`TrainResult`; :func:`evaluate` (held-out per-depth accuracy and CE);
:func:`load_config` (validated config). ExitTrain's tree term (``loss.exit.mode``) is not
implemented yet. Docs: ``docs/training.md``.
"""

from .config import ConfigError, DraftArchConfig, ExitLossConfig, LossConfig, TrainConfig, load_config
from .data import load_dataset
from .trainer import TrainResult, Trainer, evaluate, latest_checkpoint, load_target, train

__all__ = ["train", "evaluate", "load_config", "load_dataset", "load_target", "latest_checkpoint",
           "Trainer", "TrainResult", "TrainConfig", "DraftArchConfig", "LossConfig",
           "ExitLossConfig", "ConfigError"]
