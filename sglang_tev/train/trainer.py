"""The training loop (DESIGN §6): one run's models, data, optimizer and steps, distributed set-up,
logging, periodic evaluation and checkpoints, export — frozen target, trainable drafter, exact resume.

One step::

    ids, loss_mask  = batch of step s (pure function of (seed, s), data.batch_indices)
    features        = target(ids, output_hidden_states).hidden_states[id + 1] concat   (no grad)
    anchors, keep   = sample_anchors(valid_anchor_positions(...), num_anchors, keys(seed, s))
    logits, labels  = drafter.forward_train on [x_a, MASK x (K-1)] blocks -> target lm_head
    loss            = Σ w_k CE / Σ w_k over valid slots (global over ranks; losses.py)
                      [+ distillation term] [+ λ · L_exit on the drafter's own trees (exit.py)]
    AdamW step (drafter parameters only), cosine schedule with warmup (schedule.py), grad clipping

The target (embedding and LM head included) is frozen: ``requires_grad=False`` and never in the
optimizer. Checkpoints (``output_dir/checkpoints/step_NNNNNNNN/``, :mod:`.checkpoint`) are written
atomically; the newest one is resumed automatically and training continues bit-identically on CPU
with the same thread count (stored in the checkpoint and checked). The final drafter is exported
to ``output_dir/final/`` (z-lab layout, :meth:`DFlashDraftModel.save_pretrained`).

The target (:mod:`.target`), the initial drafter (:mod:`.draft_init`), checkpoints
(:mod:`.checkpoint`) and the held-out metrics (:mod:`.metrics`) have their own modules; their
public names are importable from here too, as before the split.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from ..compat import cache_kwargs
from ..draft.dflash import DFlashDraftModel, extract_context_features
from .checkpoint import (CHECKPOINT_DIR, STATE_NAME, STATE_VERSION, check_world_size, checkpoint_dirs,
                         clean_stale_tmp, find_resume, fingerprint, latest_checkpoint, load_resume_state, rng_state,
                         save_checkpoint, set_rng_state, truncate_log)
from .config import ConfigError, TrainConfig, config_to_dict, load_config
from .data import TokenDataset, anchor_keys, batch_indices, collate, load_dataset, \
    sample_anchors, valid_anchor_positions
from .draft_init import build_drafter
from .exit import anchor_trees, check_tree_support, kv_reuse_forward, score_trees, weights_from_law
from .losses import LossTerm, block_logits, combine_terms, decay_weights, depth_stats, distill_loss, \
    exit_loss, lattice_exit_loss, selector_loss, slot_ce, stats_to_metrics, token_loss
from .metrics import evaluate, resolve_tree_mode
from .rollout import cache_path, check_prompt_file, ensure_rollouts
from .schedule import lr_lambda
from .target import load_target, load_target_config, load_target_tokenizer, resolve_device, separator_ids, \
    text_config

__all__ = ["train", "Trainer", "TrainResult", "BatchLoss", "evaluate", "load_target", "latest_checkpoint",
           "checkpoint_dirs", "build_drafter", "CHECKPOINT_DIR", "STATE_NAME"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


class BatchLoss(NamedTuple):
    """One batch's loss terms and what the step's metrics read (:meth:`Trainer.loss_terms`).

    terms: ``{name: (weight, LossTerm)}``, names ``tok`` [``distill``] [``selector``] [``exit``], in that order.
    logits: float [b, n, K-1, V], the drafter's block logits (with grad); labels: int64 [b, n, K-1];
    keep: bool [b, n] (valid anchors); ce: float [b, n, K-1], the slot CE.
    tree_stats: float64 [3], ``[Σ C_p, Σ w(root), trees]`` of the exit term's trees (zeros without it).
    tokens: tokens in the batch (``b · S``).
    sel_stats: float64 [4], the selector term's sums (:func:`~.losses.selector_loss`; zeros without it).
    """

    terms: dict[str, tuple[float, LossTerm]]
    logits: torch.Tensor
    labels: torch.Tensor
    keep: torch.Tensor
    ce: torch.Tensor
    tree_stats: torch.Tensor
    tokens: int
    sel_stats: torch.Tensor


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
        self.resume_from = find_resume(cfg, self.out)
        if self.resume_from is not None:
            check_world_size(self.resume_from, cfg, self.dist.world_size)

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
        self.sep_ids = separator_ids(self.target, self.tokenizer)
        self.pad_id = self.sep_ids[0] if self.sep_ids else 0
        if cfg.rollout is not None:
            self.data = self._rollout_data()

        if self.resume_from is not None:
            self.draft = DFlashDraftModel.from_pretrained(self.resume_from / "draft",
                                                          dtype=torch.float32)
            self.draft.validate_against_target(text_config(self.target))
        else:
            self.draft = build_drafter(cfg, self.target, self.tokenizer)
        self.draft.to(self.device).train()
        self.block_size = cfg.block_size or self.draft.config.block_size
        if cfg.seq_len < self.block_size + 1:
            raise ConfigError("seq_len", f"must be >= block_size + 1 = {self.block_size + 1}")
        self._check_trainable()
        self.has_selector = self.draft.config.selector_rank is not None
        try:
            self.exit_tree = resolve_tree_mode(self.draft, cfg.loss.exit.tree)
        except ValueError as e:
            raise ConfigError("loss.exit.tree", str(e)) from None

        decay, no_decay = [], []
        for _, p in self.draft.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=tuple(cfg.betas))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.warmup, cfg.max_steps, cfg.min_lr_ratio))
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

    # -- data and resume ----------------------------------------------------------------------
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

    def _load_state(self, path: Path) -> None:
        st, extend = load_resume_state(path, self.cfg, self.dist.world_size, self.threads, report=self.is_main)
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        set_rng_state(st["rng"])
        self.step = int(st["step"])
        if extend:  # HF Trainer semantics: more steps on the same run, LR schedule over the new total
            for g in self.optimizer.param_groups:
                g["lr"] = self.scheduler.lr_lambdas[0](self.step) * g["initial_lr"]
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
            if self.is_main:
                print(f"[sglang_tev.train] max_steps {st['fingerprint']['max_steps']} -> {self.cfg.max_steps}: "
                      f"continuing from step {self.step} with the LR schedule (warmup "
                      f"{self.cfg.warmup} steps, cosine) re-derived for {self.cfg.max_steps} steps",
                      file=sys.stderr)

    def _state(self) -> dict:
        return {"version": STATE_VERSION, "step": self.step,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(), "threads": self.threads, "world_size": self.dist.world_size,
                "device": self.device.type, "fingerprint": fingerprint(self.cfg),
                "torch": torch.__version__}

    # -- one step -----------------------------------------------------------------------------
    def _features(self, ids: torch.Tensor, keep_kv: bool = False):
        """(context features ``[b, S, n*hidden]``, final-normed last hidden state ``[b, S, hidden]``, the
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
        b, S, hidden = last_hidden.shape
        pos = (anchors[..., None] + torch.arange(self.block_size - 1, device=anchors.device)).clamp_max(S - 1)
        h = last_hidden.gather(1, pos.reshape(b, -1, 1).expand(-1, -1, hidden))
        return self.lm_head(h).reshape(*pos.shape, -1)

    def _dense_terms(self, logits, labels, anchors, keep, last_hidden, amp, ce=None, hidden=None, ids=None):
        """The dense loss terms ``{"tok": (token_weight, LossTerm), ["distill": (distill_weight,
        LossTerm)], ["selector": (selector weight, LossTerm)]}`` of one batch, per-slot weights
        ``keep · decay``, and the selector's stats (float64 [4], zeros without it); ``tok`` is
        always present (it is logged even at weight 0). ``ce``: the slot CE when already computed;
        ``hidden`` / ``ids``: the slot hidden states and the batch's ids (the selector term)."""
        cfg = self.cfg
        weights = keep[..., None].float() * self.decay
        terms = {"tok": (cfg.loss.token_weight, token_loss(logits, labels, weights, ce=ce))}
        scfg = cfg.loss.selector
        use_sel = self.has_selector and scfg.weight > 0
        target_logits = None
        if cfg.loss.distill_weight or (use_sel and scfg.labels == "target"):
            with torch.no_grad(), torch.autocast(**amp):
                target_logits = self._target_logits(last_hidden, anchors)
        if cfg.loss.distill_weight:
            terms["distill"] = (cfg.loss.distill_weight, distill_loss(logits, target_logits, weights))
        sel_stats = torch.zeros(4, dtype=torch.float64, device=logits.device)
        if use_sel:
            term, sel_stats = selector_loss(self.draft.candidate_selector, hidden.float(), logits,
                                            ids.gather(1, anchors), labels, weights,
                                            target_logits=target_logits if scfg.labels == "target" else None,
                                            gold=scfg.gold)
            terms["selector"] = (scfg.weight, term)
        return terms, sel_stats

    def _exit_term(self, logits, ids, anchors, keep, last_hidden, seq_cache, amp, times, hidden=None):
        """ExitTrain's term (paper Eq. 14) and its diagnostics ``[Σ C_p, Σ w(root), trees]``; on
        the selector's lattice trees (``loss.exit.tree`` resolved to ``lattice``) each node's draft
        log-q is its lattice transition (:func:`~.losses.lattice_exit_loss`)."""
        ecfg = self.cfg.loss.exit
        b, n, H, V = logits.shape
        draft = logits.reshape(b * n, H, V)
        roots = ids.gather(1, anchors).reshape(-1)
        t = time.perf_counter()
        lattice = None
        if self.exit_tree == "lattice":
            lattice = self.draft.candidate_selector.lattice(hidden.reshape(b * n, H, -1).float(), draft, roots)
        tree = anchor_trees(draft, ecfg.budget, roots, keep.reshape(-1), lattice=lattice, mode=self.exit_tree)
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
        if lattice is not None:
            return lattice_exit_loss(lattice.transition_logq, lattice.candidate_ids, tree, weights), diag
        return exit_loss(draft, tree, weights), diag

    def loss_terms(self, step: int | None = None, times: dict | None = None) -> "BatchLoss":
        """The loss terms of the batch of ``step`` (default ``self.step``) on this rank, with their
        graphs, without any optimizer step: what :meth:`train_step` optimises (it calls this).

        ``BatchLoss.terms``: ``{"tok": (token_weight, LossTerm), ["distill": (distill_weight,
        LossTerm)], ["exit": (λ_exit, LossTerm)]}`` (``tok`` always; ``distill`` when its weight is
        set; ``exit`` when ``loss.exit.mode`` is not ``none``); each :class:`~.losses.LossTerm` is
        this rank's (numerator, denominator). The batch and anchors are those of ``step`` (pure
        functions of seed and step). ``times``, when given, receives the wall seconds of
        ``draft`` (target + drafter forwards and dense terms), ``build`` and ``tree_forward``.
        """
        cfg, dev, K = self.cfg, self.device, self.block_size
        step = self.step if step is None else step
        times = {} if times is None else times
        use_exit = cfg.loss.exit.mode != "none"
        t0 = time.perf_counter()
        idx = batch_indices(step, cfg.batch_size, len(self.data), cfg.seed,
                            self.dist.rank, self.dist.world_size)
        ids, lmask = collate(self.data, idx, self.pad_id)
        ids, lmask = ids.to(dev), lmask.to(dev)
        amp = dict(device_type=dev.type, dtype=self.amp_dtype or torch.bfloat16,
                   enabled=self.amp_dtype is not None)
        with torch.no_grad(), torch.autocast(**amp):
            features, last_hidden, seq_cache = self._features(ids, keep_kv=use_exit)
        valid = valid_anchor_positions(ids, lmask, K, self.sep_ids)
        keys = anchor_keys(cfg.seed, step, cfg.batch_size, cfg.seq_len, self.dist.rank)
        anchors, keep = sample_anchors(valid, cfg.num_anchors, keys)
        with torch.autocast(**amp):
            logits, labels, hidden = block_logits(self.step_module, self.embed, self.lm_head, features,
                                                  ids, anchors, keep, K, self.draft.config.mask_token_id,
                                                  transform=self.draft.transform_logits, return_hidden=True)
        ce = slot_ce(logits, labels)                                   # [b, n, K-1]
        terms, sel_stats = self._dense_terms(logits, labels, anchors, keep, last_hidden, amp, ce=ce,
                                             hidden=hidden, ids=ids)
        times["draft"] = time.perf_counter() - t0
        diag = torch.zeros(3, dtype=torch.float64, device=dev)
        if use_exit:
            ex, diag = self._exit_term(logits, ids, anchors, keep, last_hidden, seq_cache, amp, times, hidden=hidden)
            terms["exit"] = (cfg.loss.exit.lambda_, ex)
        return BatchLoss(terms, logits, labels, keep, ce, diag, ids.numel(), sel_stats)

    def train_step(self) -> dict:
        """One optimizer step at ``self.step``; returns its log record (global over ranks).

        Record: ``loss`` (the optimised total), ``loss_tok`` / ``loss_distill`` / ``loss_exit``
        (each term's global mean, present when its weight is > 0; ``loss_tok`` always), per-depth
        ``acc``, ``lr``, ``grad_norm``, ``anchors``, ``tokens_per_s``, the step's wall time split
        in ms (``ms_draft``: target + drafter forwards and dense losses, ``ms_build``,
        ``ms_tree_forward``, ``ms_backward``: backward + optimizer) and, with the exit term, the
        training trees' mean coverage C_p, mean w(root) and ``est_tau`` = 1 + C_p.
        """
        cfg = self.cfg
        use_exit = cfg.loss.exit.mode != "none"
        t0 = time.perf_counter()
        times: dict[str, float] = {}
        batch = self.loss_terms(self.step, times)
        terms = batch.terms
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
        stats = torch.cat([depth_stats(batch.logits.detach(), batch.labels, batch.keep, ce=batch.ce.detach()),
                           nums, batch.tree_stats, batch.sel_stats])
        self.dist.all_reduce(stats)
        stats, sel = stats[:-4], stats[-4:].tolist()
        m = stats_to_metrics(stats[:-3 - len(terms)])
        term_means = {name: float(num) / d if d else 0.0
                      for name, num, d in zip(terms, stats[-3 - len(terms):-3].tolist(), dens)}
        dt = time.perf_counter() - t0
        rec = {"step": self.step,
               "loss": sum(lam * term_means[k] for k, (lam, _) in terms.items()),
               **{f"loss_{k}": v for k, v in term_means.items() if k == "tok" or terms[k][0]},
               "acc": m["acc"], "lr": lr, "grad_norm": float(grad_norm),
               "anchors": m["anchors"],
               "tokens_per_s": round(batch.tokens * self.dist.world_size / dt, 1),
               **{f"ms_{k}": round(v * 1e3, 2) for k, v in times.items()}}
        if "selector" in terms:
            tot, cov, hit_sel, hit_uni = sel
            rec.update(sel_recall=cov / tot if tot else 0.0, sel_acc=hit_sel / cov if cov else 0.0,
                       unary_acc=hit_uni / cov if cov else 0.0)
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
            clean_stale_tmp(self.out)
            truncate_log(log_path, self.step)
            truncate_log(eval_path, self.step)
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
