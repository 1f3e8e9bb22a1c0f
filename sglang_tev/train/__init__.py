"""Drafter training (DESIGN §6): the dense DFlash objective and ExitTrain's exit-guided tree
term (paper §5) on a frozen target, on fixed data or the target's own rollouts.

    python -m sglang_tev.train --config run.yaml [key=value ...]

Python API: :func:`train` (config path / mapping / :class:`TrainConfig` + overrides) ->
:class:`TrainResult`; :func:`evaluate` (held-out per-depth accuracy and CE);
:func:`load_config` (validated config); :func:`exit_weights` / :func:`exit_loss` (ExitTrain's
weights and loss). Docs: ``docs/training.md``, ``docs/exittrain.md``.

Modules, one job each: ``config`` (run configs, packaged recipes), ``data`` (datasets, batches,
anchors), ``rollout`` (the target's rollouts as data), ``losses`` (dense objective and loss terms),
``exit`` (ExitTrain's trees and weights), ``target`` (the frozen target), ``draft_init`` (the
drafter a run starts from), ``schedule`` (learning rate), ``checkpoint``
(checkpoints, RNG state, fingerprints; whole-or-nothing writes come from ``sglang_tev.atomic``),
``trainer`` (the loop), ``metrics`` (drafter metrics: held-out accuracy/CE and the tree metric),
``drafter_eval`` (drafter comparison, ``sglang-tev eval-drafter``).
"""

from .config import (ConfigError, DraftArchConfig, ExitLossConfig, LossConfig, RolloutConfig, TrainConfig,
                     load_config)
from .exit import exit_weights
from .losses import exit_loss
from .data import load_dataset
from .checkpoint import latest_checkpoint
from .metrics import evaluate
from .target import load_target
from .trainer import TrainResult, Trainer, train

__all__ = ["train", "evaluate", "load_config", "load_dataset", "load_target", "latest_checkpoint",
           "Trainer", "TrainResult", "TrainConfig", "DraftArchConfig", "LossConfig",
           "ExitLossConfig", "RolloutConfig", "ConfigError", "exit_weights", "exit_loss"]
