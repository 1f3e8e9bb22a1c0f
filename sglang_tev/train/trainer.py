"""DFlash drafter training loop (DESIGN §6): frozen target, trainable drafter, exact resume.

One step::

    ids, loss_mask  = batch of step s (pure function of (seed, s), data.batch_indices)
    features        = target(ids, output_hidden_states).hidden_states[id + 1] concat   (no grad)
    anchors, keep   = sample_anchors(valid_anchor_positions(...), num_anchors, keys(seed, s))
    logits, labels  = drafter.forward_train on [x_a, MASK x (K-1)] blocks -> target lm_head
    loss            = Σ w_k CE / Σ w_k over valid slots (global over ranks; losses.py)
                      [+ distillation term] [+ λ · L_exit on the drafter's own trees (exit.py)]
    AdamW step (drafter parameters only), cosine schedule with warmup, grad clipping

The target (embedding and LM head included) is frozen: ``requires_grad=False`` and never in the
optimizer. Checkpoints (``output_dir/checkpoints/step_NNNNNNNN/``: ``draft/`` in the z-lab layout
plus ``trainer_state.pt``) are written to a temporary directory and renamed into place; the
newest one is resumed automatically and training continues bit-identically on CPU with the same
thread count (stored in the checkpoint and checked). The final drafter is exported to
``output_dir/final/`` (z-lab layout, :meth:`DFlashDraftModel.save_pretrained`).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..hf.runtime import cache_kwargs
from ..draft.dflash import DFlashConfig, DFlashDraftModel, build_target_layer_ids, \
    extract_context_features, is_dflash_checkpoint
from .config import ConfigError, DraftArchConfig, TrainConfig, config_to_dict, load_config
from .data import TokenDataset, anchor_keys, batch_indices, collate, load_dataset, \
    sample_anchors, valid_anchor_positions
from .exit import anchor_trees, check_tree_support, kv_reuse_forward, score_trees, weights_from_law
from .losses import block_logits, combine_terms, decay_weights, depth_stats, distill_loss, \
    exit_loss, slot_ce, stats_to_metrics, token_loss
from .rollout import cache_path, check_prompt_file, ensure_rollouts

__all__ = ["train", "Trainer", "TrainResult", "evaluate", "load_target", "latest_checkpoint",
           "CHECKPOINT_DIR", "STATE_NAME"]

CHECKPOINT_DIR = "checkpoints"
STATE_NAME = "trainer_state.pt"
STATE_VERSION = 1
# Config keys that do not change what is computed: excluded from the resume fingerprint.
_RUN_CONTROL_KEYS = frozenset({
    "output_dir", "resume", "save_every", "keep_checkpoints", "eval_every", "eval_data",
    "eval_windows", "eval_stride", "eval_budget", "eval_temperatures", "log_every", "progress",
    "tensorboard", "threads", "allow_thread_change", "export_dtype", "stop_at_step", "device",
})
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

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


def _target_text_config(target):
    cfg = target.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _mask_token_id(cfg: TrainConfig, tokenizer) -> int:
    if cfg.draft is not None and cfg.draft.mask_token_id is not None:
        return cfg.draft.mask_token_id
    mid = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mid is None:
        raise ConfigError("draft.mask_token_id", "is not set and the target's tokenizer has no "
                                                 "mask token; set it explicitly")
    return int(mid)


def build_drafter(cfg: TrainConfig, target, tokenizer) -> DFlashDraftModel:
    """The drafter to train, float32: warm-started from ``draft_init`` or freshly initialised.

    Fresh init (``draft:``): Qwen3 dims of the target unless overridden; Linear weights
    ~ N(0, init_std²) from a generator seeded by ``seed``, norms 1. Raises ``ValueError`` naming
    the key when the drafter does not fit the target.
    """
    tcfg = _target_text_config(target)
    if cfg.draft_init is not None:
        if not os.path.isdir(cfg.draft_init):
            raise FileNotFoundError(f"draft_init: no drafter directory at {cfg.draft_init!r}")
        try:
            draft = DFlashDraftModel.from_pretrained(cfg.draft_init, dtype=torch.float32)
            draft.validate_against_target(tcfg)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError("draft_init", str(e)) from None
        return draft
    arch = cfg.draft or DraftArchConfig()
    n_target = int(tcfg.num_hidden_layers)
    ids = arch.target_layer_ids or build_target_layer_ids(n_target, arch.num_hidden_layers)
    heads = arch.num_attention_heads or int(tcfg.num_attention_heads)
    fields = {
        "hidden_size": int(tcfg.hidden_size),
        "intermediate_size": arch.intermediate_size or int(tcfg.intermediate_size),
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": arch.num_key_value_heads or int(getattr(tcfg, "num_key_value_heads", None) or heads),
        "head_dim": arch.head_dim or int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads),
        "num_target_layers": n_target,
        "mask_token_id": _mask_token_id(cfg, tokenizer),
        "target_layer_ids": tuple(ids),
        "block_size": arch.block_size or cfg.block_size or 16,
        "rms_norm_eps": float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(tcfg),
        "max_position_embeddings": int(getattr(tcfg, "max_position_embeddings", 32768)),
        "vocab_size": int(tcfg.vocab_size),
    }
    try:
        dcfg = DFlashConfig(**fields)
        dcfg.validate_against_target(tcfg)
    except ValueError as e:
        raise ConfigError("draft", str(e)) from None
    draft = DFlashDraftModel(dcfg)
    g = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * arch.init_std)
            else:
                p.fill_(1.0)
    return draft


def _rope_theta(tcfg) -> float:
    params = getattr(tcfg, "rope_parameters", None)
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(getattr(tcfg, "rope_theta", None) or 10000.0)


def _separator_ids(target, tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(_target_text_config(target), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


# ----------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


def save_checkpoint(output_dir: str | os.PathLike, step: int, draft: DFlashDraftModel,
                    state: dict, keep: int) -> Path:
    """Write ``checkpoints/step_<step>/`` atomically and keep the newest ``keep`` checkpoints.

    Everything goes to ``checkpoints/.tmp-step_<step>-<random>/`` first (drafter via
    ``save_pretrained``, then ``trainer_state.pt``, fsynced) and one ``os.replace`` publishes it;
    any failure removes the temporary directory and leaves the previous checkpoints untouched.
    """
    root = Path(output_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        draft.save_pretrained(tmp / "draft")
        with open(tmp / STATE_NAME, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # only when a run re-saves a step it already saved
            old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():
            os.replace(old, final)
            old = None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for _, p in checkpoint_dirs(output_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def _clean_stale_tmp(output_dir: Path) -> None:
    root = output_dir / CHECKPOINT_DIR
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate(),
          "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _flatten(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _fingerprint(cfg: TrainConfig) -> dict:
    """The config keys that change what a step computes, flattened to dotted keys."""
    return _flatten({k: v for k, v in config_to_dict(cfg).items() if k not in _RUN_CONTROL_KEYS})


def _schema_default(dotted: str) -> Any:
    """The schema default of a dotted config key (``loss.exit.temperature`` -> 1.0); a sentinel
    object (equal to nothing) for a required or unknown key."""
    import dataclasses

    from .config import _key_of

    cls, parts = TrainConfig, dotted.split(".")
    for i, part in enumerate(parts):
        f = next((f for f in dataclasses.fields(cls) if _key_of(f) == part), None)
        if f is None:
            return object()
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            return object()
        if i == len(parts) - 1:
            return value
        if not dataclasses.is_dataclass(value):
            return object()
        cls = type(value)
    return object()


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past ``step`` (a killed run may have logged beyond its last checkpoint)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))


# ----------------------------------------------------------------------------------------------
# Distributed
# ----------------------------------------------------------------------------------------------

@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            import torch.distributed as dist
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def _init_distributed(device_name: str) -> _Dist:
    """torchrun: WORLD_SIZE > 1 in the environment -> init the default process group
    (nccl on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return _Dist()
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        return _Dist(dist.get_rank(), dist.get_world_size(), local, False)
    use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return _Dist(rank, world, local, True)


class _ForwardTrain(torch.nn.Module):
    """``forward = DFlashDraftModel.forward_train`` so that DDP's hooks see the training forward."""

    def __init__(self, draft: DFlashDraftModel) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, features, embeds, positions, mask):
        return self.draft.forward_train(features, embeds, positions, mask)


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(draft: DFlashDraftModel, target, data: TokenDataset, *, block_size: int | None = None,
             stride: int = 4, max_windows: int | None = None, batch_size: int = 4,
             sep_ids: Sequence[int] = (), device: torch.device | None = None,
             autocast_dtype: torch.dtype | None = None, exit_budget: int | None = None,
             temperatures: Sequence[float] = (0.0, 1.0)) -> dict:
    """Held-out per-depth top-1 accuracy and CE of a drafter against its target's data, and the
    expected block length ``1 + C_p`` of its trees there (the metric of ``sglang-tev eval-drafter``).

    Deterministic anchors: every valid position ``a`` (rule of :mod:`.data`) with
    ``(a - 1) % stride == 0``, in the first ``max_windows`` samples spread evenly over ``data``
    (all when None). Returns :func:`~.losses.stats_to_metrics`: ``acc``/``ce`` lists for depths
    1..K-1 (CE in nats), ``acc_mean``, ``ce_mean``, ``anchors``, ``accept_len_data``, plus
    ``windows`` and ``tokens``. With ``exit_budget`` (a DDTree budget B), also, per temperature T
    of ``temperatures``: ``block_len_T<T>`` (mean ``1 + C_p`` of the drafter's budget-B tree at
    those anchors under the target's law at T, :func:`.drafter_eval.exit_breakdown`) and
    ``w_root_T<T>`` (mean exit mass at the root); keys like ``block_len_T0``, ``block_len_T1``.
    """
    K = block_size or draft.config.block_size
    device = device or next(draft.parameters()).device
    n = len(data)
    idx = list(range(n)) if max_windows is None or max_windows >= n else \
        [i * n // max_windows for i in range(max_windows)]
    pad = sep_ids[0] if sep_ids else 0
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    decoder = target.get_decoder()
    was_training = draft.training
    draft.eval()
    total = None
    tokens = 0
    temps = [float(t) for t in temperatures] if exit_budget is not None else []
    tree_sums = torch.zeros(len(temps), 2, dtype=torch.float64)
    amp = dict(device_type=device.type, dtype=autocast_dtype or torch.bfloat16,
               enabled=autocast_dtype is not None)
    for start in range(0, len(idx), batch_size):
        ids, lmask = collate(data, idx[start:start + batch_size], pad)
        ids, lmask = ids.to(device), lmask.to(device)
        tokens += int(lmask.sum())
        b, S = ids.shape
        valid = valid_anchor_positions(ids, lmask, K, sep_ids)
        anchors = torch.arange(1, max(S - K + 1, 1), stride, device=device)[None].expand(b, -1)
        if anchors.shape[1] == 0:
            continue
        keep = valid.gather(1, anchors)
        cache = None
        if temps:
            from transformers import DynamicCache
            cache = DynamicCache()
        with torch.autocast(**amp):
            out = decoder(input_ids=ids, output_hidden_states=True, use_cache=cache is not None,
                          **(cache_kwargs(decoder, cache) if cache is not None else {}))
            feats = extract_context_features(out.hidden_states, draft.config.target_layer_ids)
            logits, labels = block_logits(draft.forward_train, embed, head, feats, ids, anchors,
                                          keep, K, draft.config.mask_token_id)
        st = depth_stats(logits, labels, keep)
        total = st if total is None else total + st
        if temps and bool(keep.any()):
            from .drafter_eval import exit_breakdown, laws_by_temperature

            kept = keep.reshape(-1)
            tree = anchor_trees(logits.reshape(-1, K - 1, logits.shape[-1]), exit_budget,
                                ids.gather(1, anchors).reshape(-1), kept)
            mask_dtype = autocast_dtype or next(target.parameters()).dtype
            with torch.autocast(**amp):
                laws = laws_by_temperature(kv_reuse_forward(decoder, cache), head, out.last_hidden_state, tree,
                                           anchors, temps, mask_dtype=mask_dtype)
            for i, law in enumerate(laws):
                br = exit_breakdown(tree, law, K - 1)
                tree_sums[i, 0] += br.block_len[kept].sum().cpu()
                tree_sums[i, 1] += br.w_root[kept].sum().cpu()
    draft.train(was_training)
    if total is None:
        raise ValueError(f"data: {data.source} has no valid anchor for block size {K}")
    out = stats_to_metrics(total)
    out.update(windows=len(idx), tokens=tokens)
    for i, t in enumerate(temps):
        a = out["anchors"]
        out[f"block_len_T{t:g}"] = float(tree_sums[i, 0]) / a if a else math.nan
        out[f"w_root_T{t:g}"] = float(tree_sums[i, 1]) / a if a else math.nan
    return out


# ----------------------------------------------------------------------------------------------
# Trainer
# ----------------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        output_dir: the run directory.
        step: optimizer steps done.
        complete: True when ``max_steps`` was reached (then ``final_dir`` holds the export).
        final_dir: ``output_dir/final`` (z-lab layout) or None.
        last_log: the last train-log record (None when no step ran in this call).
        eval: the last evaluation (None without ``eval_data``).
    """

    output_dir: Path
    step: int
    complete: bool
    final_dir: Path | None
    last_log: dict | None
    eval: dict | None


def _lr_lambda(warmup: int, total: int, floor: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))
    return f


class Trainer:
    """Holds models, data and optimizer of one run; :meth:`run` trains to the end (or
    ``stop_at_step``). See the module docstring; ``train(cfg)`` is the usual entry point."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.threads = torch.get_num_threads()
        self.dist = _init_distributed(cfg.device)
        self.device = resolve_device(cfg.device, self.dist.local_rank)
        self.out = Path(cfg.output_dir)
        self.is_main = self.dist.rank == 0
        use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and self.device.type == "cuda")
        self.amp_dtype = torch.bfloat16 if use_bf16 else None
        target_dtype = torch.bfloat16 if (use_bf16 and self.device.type == "cuda") else torch.float32
        # Everything cheap is checked before the target's weights load (seconds to minutes).
        self.tokenizer = load_target_tokenizer(cfg.target)
        tcfg = load_target_config(cfg.target)
        max_pos = getattr(tcfg, "max_position_embeddings", None)
        if max_pos is not None and cfg.seq_len > int(max_pos):
            raise ConfigError("seq_len", f"must be <= the target's max_position_embeddings "
                                         f"({int(max_pos)}), got {cfg.seq_len}")
        self.data = None
        if cfg.data is not None:
            self.data = load_dataset(cfg.data, cfg.seq_len, self.tokenizer, key="data")
        else:
            check_prompt_file(cfg.rollout.prompts)
        self.eval_data = None
        if cfg.eval_data is not None:
            self.eval_data = load_dataset(cfg.eval_data, cfg.seq_len, self.tokenizer, key="eval_data")
        self.resume_from = self._find_resume()
        if self.resume_from is not None:
            self._check_world_size(self.resume_from)

        self.target, _ = load_target(cfg.target, self.device, target_dtype, tokenizer=False)
        if cfg.loss.exit.mode != "none":
            try:
                check_tree_support(self.target)
            except ValueError as e:
                raise ConfigError("loss.exit.mode", str(e)) from None
        if self.eval_data is not None and cfg.eval_budget is not None:
            try:
                check_tree_support(self.target)
            except ValueError as e:
                raise ConfigError("eval_budget", f"{e} (or eval_budget=null: no block-length evaluation)") from None
        self.embed = self.target.get_input_embeddings()
        self.lm_head = self.target.get_output_embeddings()
        self.decoder = self.target.get_decoder()
        self.sep_ids = _separator_ids(self.target, self.tokenizer)
        self.pad_id = self.sep_ids[0] if self.sep_ids else 0
        if cfg.rollout is not None:
            self.data = self._rollout_data()

        if self.resume_from is not None:
            self.draft = DFlashDraftModel.from_pretrained(self.resume_from / "draft",
                                                          dtype=torch.float32)
            self.draft.validate_against_target(_target_text_config(self.target))
        else:
            self.draft = build_drafter(cfg, self.target, self.tokenizer)
        self.draft.to(self.device).train()
        self.block_size = cfg.block_size or self.draft.config.block_size
        if cfg.seq_len < self.block_size + 1:
            raise ConfigError("seq_len", f"must be >= block_size + 1 = {self.block_size + 1}")
        self._check_trainable()

        decay, no_decay = [], []
        for _, p in self.draft.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=tuple(cfg.betas))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(cfg.warmup, cfg.max_steps, cfg.min_lr_ratio))
        frozen = {id(p) for p in self.target.parameters()}
        assert not any(id(p) in frozen for g in self.optimizer.param_groups for p in g["params"])
        self.step_module: torch.nn.Module = _ForwardTrain(self.draft)
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.step_module = DDP(self.step_module,
                                   device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.decay = decay_weights(self.block_size, cfg.loss_decay_gamma, self.device)
        self.step = 0
        if self.resume_from is not None:
            self._load_state(self.resume_from)
        self._tb = None

    # -- resume -------------------------------------------------------------------------------
    def _check_trainable(self) -> None:
        """Refuse data in which no sample holds a single valid anchor: every step would train
        nothing (loss 0, no gradient) and still export an unchanged drafter. Stops at the first
        sample that has one, so this costs one sample on usable data."""
        K = self.block_size
        for i in range(len(self.data)):
            ids, lmask = collate(self.data, [i], self.pad_id)
            if bool(valid_anchor_positions(ids, lmask, K, self.sep_ids).any()):
                return
        key = "rollout.max_new_tokens" if self.cfg.rollout is not None else "data"
        raise ConfigError(key, f"no sample of {self.data.source} holds a trainable block: a block needs "
                               f"{K - 1} supervised labels after its anchor (block size {K}) inside one "
                               "document; use longer texts / responses or a smaller block_size")

    def _rollout_data(self) -> TokenDataset:
        """Target responses to ``rollout.prompts`` (generated by rank 0 once, cached), as data."""
        cfg = self.cfg
        if self.is_main:
            ensure_rollouts(self.target, self.tokenizer, cfg.rollout, cfg.target, self.out,
                                   self.device, progress=cfg.progress)
        if self.dist.enabled:
            import torch.distributed as dist
            dist.barrier()
        path = cache_path(cfg.rollout, self.out)
        return load_dataset(path, cfg.seq_len, self.tokenizer, key="rollout.cache")

    def _find_resume(self) -> Path | None:
        cfg = self.cfg
        if cfg.resume == "never":
            if checkpoint_dirs(self.out):
                raise ConfigError("resume", f"'never' but {self.out / CHECKPOINT_DIR} holds "
                                            "checkpoints; use another output_dir or resume=auto")
            return None
        if cfg.resume == "auto":
            return latest_checkpoint(self.out)
        p = Path(cfg.resume)
        if not (p / STATE_NAME).is_file() or not (p / "draft").is_dir():
            raise ConfigError("resume", f"{p} is not a checkpoint directory (needs {STATE_NAME} "
                                        "and draft/)")
        return p

    def _check_world_size(self, path: Path) -> None:
        """Elastic resume: step s reads positions s*G .. (s+1)*G - 1 of the sample stream and
        anchors drawn per global row, G = batch_size x world size, so another world size resumes
        exactly (same global batch, same sample order from the next unseen sample) when G is
        kept. Otherwise ConfigError naming ``batch_size``, the world sizes and the way to go on.
        Checked before the target loads (the state is memory-mapped: only small fields are read)."""
        st = torch.load(path / STATE_NAME, map_location="cpu", weights_only=False, mmap=True)
        if st.get("version") != STATE_VERSION:
            return  # _load_state names the version
        world0, world = int(st["world_size"]), self.dist.world_size
        batch0 = int(_flatten(st["fingerprint"]).get("batch_size", self.cfg.batch_size))
        global0, global_ = batch0 * world0, self.cfg.batch_size * world
        if world0 == world or global_ == global0:
            return
        how = (f"set batch_size={global0 // world} ({world} x {global0 // world} = global batch {global0})"
               if global0 % world == 0 else f"use a world size that divides the global batch {global0}")
        raise ConfigError("batch_size", (
            f"checkpoint {path} was written with world size {world0} x batch_size {batch0} = global batch "
            f"{global0}; this run has world size {world} x batch_size {self.cfg.batch_size} = {global_}, which "
            f"would skip or repeat samples (step s reads samples s*G .. (s+1)*G - 1 of the stream). To resume "
            f"exactly, {how}, or resume with world size {world0}; to train on with another global batch, "
            f"start a new output_dir with draft_init={path / 'draft'}"))

    def _load_state(self, path: Path) -> None:
        st = torch.load(path / STATE_NAME, map_location="cpu", weights_only=False)
        if st.get("version") != STATE_VERSION:
            raise ValueError(f"resume: {path} has trainer state version {st.get('version')}, "
                             f"expected {STATE_VERSION}")
        mine, theirs = _fingerprint(self.cfg), _flatten(st["fingerprint"])
        # a key added after the checkpoint was written computes what it did then at its default
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k)
                      and not (k not in theirs and mine.get(k) == _schema_default(k)))
        world0, world = int(st["world_size"]), self.dist.world_size
        batch0, global_ = int(theirs["batch_size"]), self.cfg.batch_size * world
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
        if st["threads"] != self.threads and not self.cfg.allow_thread_change:
            raise ConfigError("threads", f"checkpoint {path} was written with {st['threads']} "
                                         f"threads, this run uses {self.threads}: CPU float results "
                                         "depend on it; set threads to match or "
                                         "allow_thread_change=true")
        if world0 != world:  # same global batch (checked in _check_world_size)
            if self.is_main:
                print(f"[sglang_tev.train] note: checkpoint world size {world0} x batch_size {batch0} -> world "
                      f"size {world} x batch_size {self.cfg.batch_size}: the same global batch ({global_}) and "
                      f"sample order continue from sample {int(st['step']) * global_} of the stream; sums over "
                      f"ranks change order, so the weights match a run at one world size only to float "
                      f"rounding", file=sys.stderr)
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        _set_rng_state(st["rng"])
        self.step = int(st["step"])
        if extend:  # HF Trainer semantics: more steps on the same run, LR schedule over the new total
            for g in self.optimizer.param_groups:
                g["lr"] = self.scheduler.lr_lambdas[0](self.step) * g["initial_lr"]
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
            if self.is_main:
                print(f"[sglang_tev.train] max_steps {theirs['max_steps']} -> {mine['max_steps']}: "
                      f"continuing from step {self.step} with the LR schedule (warmup "
                      f"{self.cfg.warmup} steps, cosine) re-derived for {mine['max_steps']} steps",
                      file=sys.stderr)

    def _state(self) -> dict:
        return {"version": STATE_VERSION, "step": self.step,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": _rng_state(), "threads": self.threads, "world_size": self.dist.world_size,
                "device": self.device.type, "fingerprint": _fingerprint(self.cfg),
                "torch": torch.__version__}

    # -- one step -----------------------------------------------------------------------------
    def _features(self, ids: torch.Tensor, keep_kv: bool = False):
        """(context features ``[b, S, n*H]``, final-normed last hidden state ``[b, S, H]``, the
        sequence's KV cache when ``keep_kv`` else None) of one frozen target forward."""
        from transformers import DynamicCache

        cache = DynamicCache() if keep_kv else None
        kv = cache_kwargs(self.decoder, cache) if keep_kv else {}
        out = self.decoder(input_ids=ids, output_hidden_states=True, use_cache=keep_kv, **kv)
        feats = extract_context_features(out.hidden_states, self.draft.config.target_layer_ids)
        return feats.detach(), out.last_hidden_state.detach(), cache

    def _target_logits(self, last_hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The target's logits for the label of slot k of each block: position ``a + k - 1``
        (teacher-forced), ``[b, n, K-1, V]``. Positions past the sequence are clamped; their
        blocks have ``keep = False`` and weight 0."""
        b, S, H = last_hidden.shape
        pos = (anchors[..., None] + torch.arange(self.block_size - 1, device=anchors.device)).clamp_max(S - 1)
        h = last_hidden.gather(1, pos.reshape(b, -1, 1).expand(-1, -1, H))
        return self.lm_head(h).reshape(*pos.shape, -1)

    def _dense_terms(self, logits, labels, anchors, keep, last_hidden, amp, ce=None) -> dict:
        """The dense loss terms ``{"tok": (token_weight, LossTerm), ["distill": (distill_weight,
        LossTerm)]}`` of one batch, per-slot weights ``keep · decay``; ``tok`` is always present
        (it is logged even at weight 0). ``ce``: the slot CE when already computed."""
        cfg = self.cfg
        weights = keep[..., None].float() * self.decay
        terms = {"tok": (cfg.loss.token_weight, token_loss(logits, labels, weights, ce=ce))}
        if cfg.loss.distill_weight:
            with torch.no_grad(), torch.autocast(**amp):
                target_logits = self._target_logits(last_hidden, anchors)
            terms["distill"] = (cfg.loss.distill_weight, distill_loss(logits, target_logits, weights))
        return terms

    def _exit_term(self, logits, ids, anchors, keep, last_hidden, seq_cache, amp, times):
        """ExitTrain's term (paper Eq. 14) and its diagnostics ``[Σ C_p, Σ w(root), trees]``."""
        ecfg = self.cfg.loss.exit
        b, n, H, V = logits.shape
        draft = logits.reshape(b * n, H, V)
        t = time.perf_counter()
        tree = anchor_trees(draft, ecfg.budget, ids.gather(1, anchors).reshape(-1), keep.reshape(-1))
        times["build"] = time.perf_counter() - t
        t = time.perf_counter()
        mask_dtype = self.amp_dtype or next(self.target.parameters()).dtype
        with torch.no_grad(), torch.autocast(**amp):
            law = score_trees(kv_reuse_forward(self.decoder, seq_cache), self.lm_head, last_hidden, tree, anchors,
                              ecfg.anchors_per_forward, mask_dtype, temperature=ecfg.temperature)
        times["tree_forward"] = time.perf_counter() - t
        weights = weights_from_law(tree, law, ecfg.mode, ecfg.include_horizon_leaves, horizon=H)
        kept = keep.reshape(-1)
        diag = torch.stack([law.coverage[kept].sum(), law.w[kept, 0].sum(), kept.sum()]).double()
        return exit_loss(draft, tree, weights), diag

    def train_step(self) -> dict:
        """One optimizer step at ``self.step``; returns its log record (global over ranks).

        Record: ``loss`` (the optimised total), ``loss_tok`` / ``loss_distill`` / ``loss_exit``
        (each term's global mean, present when its weight is > 0; ``loss_tok`` always), per-depth
        ``acc``, ``lr``, ``grad_norm``, ``anchors``, ``tokens_per_s``, the step's wall time split
        in ms (``ms_draft``: target + drafter forwards and dense losses, ``ms_build``,
        ``ms_tree_forward``, ``ms_backward``: backward + optimizer) and, with the exit term, the
        training trees' mean coverage C_p, mean w(root) and ``est_tau`` = 1 + C_p.
        """
        cfg, dev, K = self.cfg, self.device, self.block_size
        use_exit = cfg.loss.exit.mode != "none"
        t0 = time.perf_counter()
        times: dict[str, float] = {}
        idx = batch_indices(self.step, cfg.batch_size, len(self.data), cfg.seed,
                            self.dist.rank, self.dist.world_size)
        ids, lmask = collate(self.data, idx, self.pad_id)
        ids, lmask = ids.to(dev), lmask.to(dev)
        amp = dict(device_type=dev.type, dtype=self.amp_dtype or torch.bfloat16,
                   enabled=self.amp_dtype is not None)
        with torch.no_grad(), torch.autocast(**amp):
            features, last_hidden, seq_cache = self._features(ids, keep_kv=use_exit)
        valid = valid_anchor_positions(ids, lmask, K, self.sep_ids)
        keys = anchor_keys(cfg.seed, self.step, cfg.batch_size, cfg.seq_len, self.dist.rank)
        anchors, keep = sample_anchors(valid, cfg.num_anchors, keys)
        with torch.autocast(**amp):
            logits, labels = block_logits(self.step_module, self.embed, self.lm_head, features,
                                          ids, anchors, keep, K, self.draft.config.mask_token_id)
        ce = slot_ce(logits, labels)                                   # [b, n, K-1]
        terms = self._dense_terms(logits, labels, anchors, keep, last_hidden, amp, ce=ce)
        times["draft"] = time.perf_counter() - t0
        diag = torch.zeros(3, dtype=torch.float64, device=dev)
        if use_exit:
            ex, diag = self._exit_term(logits, ids, anchors, keep, last_hidden, seq_cache, amp, times)
            terms["exit"] = (cfg.loss.exit.lambda_, ex)
        t = time.perf_counter()
        loss, dens = combine_terms(list(terms.values()), self.dist.all_reduce, self.dist.world_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip = cfg.grad_clip if cfg.grad_clip is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        times["backward"] = time.perf_counter() - t
        nums = torch.stack([term.numerator.detach().double() for _, term in terms.values()])
        stats = torch.cat([depth_stats(logits.detach(), labels, keep, ce=ce.detach()), nums, diag])
        self.dist.all_reduce(stats)
        m = stats_to_metrics(stats[:-3 - len(terms)])
        term_means = {name: float(num) / d if d else 0.0
                      for name, num, d in zip(terms, stats[-3 - len(terms):-3].tolist(), dens)}
        dt = time.perf_counter() - t0
        rec = {"step": self.step,
               "loss": sum(lam * term_means[k] for k, (lam, _) in terms.items()),
               **{f"loss_{k}": v for k, v in term_means.items() if k == "tok" or terms[k][0]},
               "acc": m["acc"], "lr": lr, "grad_norm": float(grad_norm),
               "anchors": m["anchors"],
               "tokens_per_s": round(ids.numel() * self.dist.world_size / dt, 1),
               **{f"ms_{k}": round(v * 1e3, 2) for k, v in times.items()}}
        if use_exit:
            c_sum, w_root, trees = stats[-3:].tolist()
            coverage = c_sum / trees if trees else 0.0
            rec.update(coverage=coverage, w_root=w_root / trees if trees else 0.0, est_tau=1.0 + coverage)
        return rec

    # -- loop ---------------------------------------------------------------------------------
    def _tensorboard(self):
        if not (self.cfg.tensorboard and self.is_main):
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("[sglang_tev.train] note: tensorboard is not installed; logging to jsonl only",
                  file=sys.stderr)
            return None
        return SummaryWriter(log_dir=str(self.out / "tensorboard"), purge_step=self.step + 1)

    def _save(self) -> None:
        if self.is_main:
            save_checkpoint(self.out, self.step, self.draft, self._state(), self.cfg.keep_checkpoints)

    def run(self) -> TrainResult:
        from tqdm import tqdm

        cfg = self.cfg
        stop = cfg.max_steps if cfg.stop_at_step is None else min(cfg.max_steps, cfg.stop_at_step)
        log_path, eval_path = self.out / "train_log.jsonl", self.out / "eval_log.jsonl"
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            _clean_stale_tmp(self.out)
            _truncate_log(log_path, self.step)
            _truncate_log(eval_path, self.step)
            import yaml
            (self.out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            if self.resume_from is not None:
                print(f"[sglang_tev.train] resuming from {self.resume_from} at step {self.step}",
                      file=sys.stderr)
        tb = self._tensorboard()
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="draft", unit="step",
                   file=sys.stderr, dynamic_ncols=True, disable=not (cfg.progress and self.is_main),
                   mininterval=0.5 if sys.stderr.isatty() else 30)
        last, last_eval = None, None
        saved_at = self.step
        try:
            with open(log_path, "a") if self.is_main else open(os.devnull, "w") as log:
                while self.step < stop:
                    rec = self.train_step()
                    last = rec
                    bar.update(1)
                    if self.is_main and (self.step % cfg.log_every == 0 or self.step == stop):
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc1=f"{rec['acc'][0]:.3f}")
                        if tb is not None:
                            for k, v in rec.items():
                                if k not in ("step", "acc", "anchors"):
                                    tb.add_scalar(f"train/{k}", v, self.step)
                            for d, a in enumerate(rec["acc"], 1):
                                tb.add_scalar(f"train/acc_d{d}", a, self.step)
                    if cfg.eval_every and self.eval_data is not None and self.is_main and \
                            self.step % cfg.eval_every == 0:
                        last_eval = self._evaluate()
                        with open(eval_path, "a") as f:
                            f.write(json.dumps({"step": self.step, **last_eval}) + "\n")
                        if tb is not None:
                            tb.add_scalar("eval/ce_mean", last_eval["ce_mean"], self.step)
                            tb.add_scalar("eval/acc_mean", last_eval["acc_mean"], self.step)
                            tb.add_scalar("eval/accept_len_data", last_eval["accept_len_data"], self.step)
                            for k, v in last_eval.items():
                                if k.startswith("block_len_"):
                                    tb.add_scalar(f"eval/{k}", v, self.step)
                    if self.step % cfg.save_every == 0 or self.step == stop:
                        self._save()
                        saved_at = self.step
        finally:
            bar.close()
            if tb is not None:
                tb.close()
        if saved_at != self.step:
            self._save()
        complete = self.step >= cfg.max_steps
        final_dir = None
        if complete and self.is_main:
            final_dir = self.out / "final"
            export = self.draft
            if cfg.export_dtype is not None and _DTYPES[cfg.export_dtype] != torch.float32:
                import copy
                export = copy.deepcopy(self.draft).to(_DTYPES[cfg.export_dtype])
            export.save_pretrained(final_dir)
            if self.eval_data is not None and last_eval is None:
                last_eval = self._evaluate()
            if last_eval is not None:
                (self.out / "final_eval.json").write_text(
                    json.dumps({"step": self.step, **last_eval}, indent=2) + "\n")
        if self.dist.enabled:
            import torch.distributed as dist
            dist.barrier()
        return TrainResult(self.out, self.step, complete, final_dir, last, last_eval)

    def _evaluate(self) -> dict:
        return evaluate(self.draft, self.target, self.eval_data, block_size=self.block_size,
                        stride=self.cfg.eval_stride, max_windows=self.cfg.eval_windows,
                        batch_size=self.cfg.batch_size, sep_ids=self.sep_ids, device=self.device,
                        autocast_dtype=self.amp_dtype, exit_budget=self.cfg.eval_budget,
                        temperatures=self.cfg.eval_temperatures)

    def close(self) -> None:
        if self.dist.initialized_here:
            import torch.distributed as dist
            dist.destroy_process_group()


def train(config: TrainConfig | Mapping[str, Any] | str | os.PathLike | None = None,
          overrides: Sequence[str] | Mapping[str, Any] = ()) -> TrainResult:
    """Train a DFlash drafter (Python API of ``python -m sglang_tev.train``).

    config : a :class:`TrainConfig`, a mapping, a YAML path or None; overrides : ``key=value``
    strings or a nested mapping merged over it. Resumes from the newest checkpoint in
    ``output_dir`` (``resume: auto``). Raises :class:`ConfigError` naming the key for invalid
    settings (also a config that differs from the checkpoint being resumed, or another thread
    count), ``FileNotFoundError`` / ``ValueError`` naming ``target`` / ``data`` / ``draft_init``
    for unusable inputs (also ``rollout.prompts`` / ``rollout.cache``).
    """
    cfg = load_config(config, overrides)
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()
