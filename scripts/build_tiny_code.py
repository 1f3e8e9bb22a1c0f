#!/usr/bin/env python
"""Build the small code model pair shipped in ``sglang_tev/assets`` (DESIGN.md §2, §8).

Nothing can be downloaded, so the pair is trained here, seeded and reproducible, in stages:

  tokenizer  byte-level BPE trained on the running interpreter's stdlib sources, a seeded held-out
             split by file, and the token ids of both splits (documents joined with <|endoftext|>)
  target     Qwen3ForCausalLM (~5.8 M parameters) trained as a causal LM on the training split;
             resumes from atomic checkpoints in OUTDIR/target.work/
  draft      DFlash drafter (2 layers, block size 16) trained by sglang_tev.train on the target's
             own features over the training split; resumes from the trainer's checkpoints in
             OUTDIR/draft_train/; ships bf16 in the z-lab layout; held-out per-depth accuracy/CE
  draft2     (opt-in) a DFlash2 drafter (grouped conv + candidate selector) with the draft stage's
             recipe and compute, plus the selector's teacher-forced term; OUTDIR/draft2_train/
  exittrain  that drafter fine-tuned by ExitTrain on 1,024 target rollouts of prompts cut from the
             training split (token CE + exit loss under the T = 0 law; docs/exittrain.md, arm D);
             resumes from OUTDIR/exittrain_train/; held-out accuracy and 1 + C_p before and after
  bench      sglang-tev bench on HumanEval prompts with the exittrain drafter (every method;
             budgets 32/64/128; T 0 and 1)
  ship       (only when asked for) copy target/, exittrain/ (as draft/), draft/ (as
             draft-base/) and, when built, draft2/ into sglang_tev/assets/tiny-code/

Each stage writes OUTDIR/<stage>/ through a temp dir and one rename, so a stage directory either
is complete or does not exist; a complete stage is skipped unless --force. Docs: docs/tiny-code.md.

    python scripts/build_tiny_code.py --out runs/tiny-code --threads 2          # tokenizer .. bench
    python scripts/build_tiny_code.py --out runs/tiny-code --stages ship        # into sglang_tev/assets

``--from-assets`` takes the target and draft stages from the packaged pair instead of training
them (the tokenizer stage must equal the packaged tokenizer): the exittrain, bench and ship stages
then run on what is shipped, without the ~70-minute retrain.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

EOS, MASK = "<|endoftext|>", "<|mask|>"


class UsageExit(SystemExit):
    """A bad argument found after parsing (e.g. a stage run before the one it reads): exit
    status 2, as argparse's own errors; ``str()`` is the message, printed by :func:`main`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2


# Path parts never trained on: third-party code, the test suites (huge, repetitive and full of
# deliberately odd code), pydoc_data (one 750 kB prose blob) and encodings (generated codec tables).
SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data", "encodings"}


@dataclasses.dataclass(frozen=True)
class Config:
    # tokenizer stage
    vocab_size: int = 4096          # BPE vocabulary, special tokens included
    heldout_frac: float = 0.03      # fraction of files kept apart from all training
    max_files: int | None = None    # None: every file that passes SKIP_PARTS
    # target model: Qwen3 dims, ~5.8 M parameters with vocab 4096 and tied embeddings
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    max_positions: int = 2048       # HumanEval prompts reach ~500 tokens, plus generation
    rope_theta: float = 10000.0
    # target training; `steps` is the budget (measurements in docs/tiny-code.md)
    # 4096 tokens/update; 2 threads measured ~3.0k tokens/s -> ~39 min; 1 thread ~1.65k -> ~70 min
    seq_len: int = 1024             # positions up to 1024 are trained: HumanEval prompt + completion
    batch: int = 4
    steps: int = 1700               # ~7.0 M tokens, ~2.6 epochs of the 2.7 M-token training split
    lr: float = 2e-3
    min_lr_frac: float = 0.1        # cosine decays to lr * min_lr_frac
    warmup: int = 100
    weight_decay: float = 0.1
    ckpt_every: int = 50
    log_every: int = 10


FULL = Config()
QUICK = Config(vocab_size=384, max_files=24, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32,
               intermediate=128, max_positions=256, seq_len=64, batch=4, steps=6, warmup=2,
               ckpt_every=2, log_every=1)


# ---------------------------------------------------------------------------------------------
# helpers

def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_json(path: Path, obj) -> None:
    """Written whole or not at all (a killed write leaves the old file or none)."""
    from sglang_tev.atomic import atomic_write

    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fresh_tmp(out: Path, name: str) -> Path:
    """Empty staging dir for stage `name`; a leftover from a killed run is discarded."""
    tmp = out / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Move a fully written stage dir into place (one rename: readers never see a half-written
    stage). An old complete dir only exists here under --force."""
    from sglang_tev.atomic import publish_dir

    publish_dir(tmp, final)


def build_device(args):
    """The torch device of --device (auto: cuda when present, else cpu)."""
    import torch

    return torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                        ("cpu" if args.device == "auto" else args.device))


def stage_record(out: Path, name: str) -> dict | None:
    """The stage.json of a complete stage, else None (stage.json is written last, before publish)."""
    p = out / name / "stage.json"
    return json.loads(p.read_text()) if p.exists() else None


def stdlib_files(max_files: int | None) -> tuple[Path, list[str]]:
    """Relative paths of the stdlib's *.py files we train on, sorted: the corpus order is fixed."""
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    rels = [r for r in rels if not SKIP_PARTS.intersection(r.split("/")[:-1])
            and not r.rsplit("/", 1)[-1].startswith("test_")]
    if max_files is not None and max_files < len(rels):
        # evenly spaced, so a small subset still spans the whole library
        rels = [rels[i * len(rels) // max_files] for i in range(max_files)]
    return root, rels


# ---------------------------------------------------------------------------------------------
# stage 1: tokenizer + split + token ids

def tokenizer_fingerprint(cfg: Config, seed: int) -> dict:
    return {"vocab_size": cfg.vocab_size, "heldout_frac": cfg.heldout_frac, "max_files": cfg.max_files,
            "seed": seed, "stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0]}


def build_tokenizer(args, cfg: Config, out: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    root, rels = stdlib_files(cfg.max_files)
    docs: dict[str, str] = {}
    for rel in rels:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # a handful of latin-1 test fixtures at most; not worth guessing
            continue
        if text.strip():            # empty __init__.py files would only add lone <|endoftext|>s
            docs[rel] = text
    names = list(docs)
    n_held = max(1, round(cfg.heldout_frac * len(names)))
    if len(names) - n_held < 1:
        raise UsageExit(f"argument --max-files: {len(names)} usable files leave nothing to train on")
    held = set(random.Random(args.seed).sample(range(len(names)), n_held))
    split = {"train": [n for i, n in enumerate(names) if i not in held],
             "heldout": [n for i, n in enumerate(names) if i in held]}

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOS, MASK],  # ids 0 and 1
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([docs[n] for n in split["train"]], trainer=trainer)  # held-out never seen
    eos_id = tok.token_to_id(EOS)

    ids, n_tokens = {}, {}
    for part, files in split.items():
        texts = [docs[n] for n in files]
        enc = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        bad = [f for f, d, t in zip(files, tok.decode_batch(enc), texts) if d != t]
        if bad:  # byte-level BPE is lossless; anything else is a bug worth stopping for
            raise RuntimeError(f"tokenizer does not round-trip {bad[:3]}")
        flat = [i for e in enc for i in (*e, eos_id)]  # doc <|endoftext|> doc <|endoftext|> ...
        ids[part] = np.asarray(flat, dtype=np.uint16)
        n_tokens[part] = len(flat)

    tmp = fresh_tmp(out, "tokenizer")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, mask_token=MASK,
                                   clean_up_tokenization_spaces=False, model_max_length=cfg.max_positions)
    fast.save_pretrained(tmp)
    for part, arr in ids.items():
        np.save(tmp / f"{part}.npy", arr)
    write_json(tmp / "split.json", {"stdlib": str(root), "skip_parts": sorted(SKIP_PARTS), **split})
    summary = {"files_train": len(split["train"]), "files_heldout": n_held, "vocab": tok.get_vocab_size(),
               "tokens_train": n_tokens["train"], "tokens_heldout": n_tokens["heldout"],
               "eos_id": eos_id, "mask_id": tok.token_to_id(MASK),
               "chars_per_token": round(sum(map(len, docs.values())) / sum(n_tokens.values()), 3)}
    write_json(tmp / "stage.json", {"fingerprint": tokenizer_fingerprint(cfg, args.seed), "summary": summary})
    publish(tmp, out / "tokenizer")
    return summary


# ---------------------------------------------------------------------------------------------
# stage 2: target

def target_fingerprint(cfg: Config, seed: int, out: Path) -> dict:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)}
    for k in ("vocab_size", "heldout_frac", "max_files"):
        fields.pop(k)  # covered by the tokenizer's hash
    return {**fields, "seed": seed, "tokenizer_sha256": sha256_file(out / "tokenizer" / "tokenizer.json")}


def lr_at(cfg: Config, step: int) -> float:
    """Linear warmup over `warmup` updates, then cosine decay to lr * min_lr_frac at `steps` (the
    trainer's schedule, :func:`sglang_tev.train.schedule.lr_at`)."""
    from sglang_tev.train.schedule import lr_at as schedule_lr

    return schedule_lr(step, cfg.warmup, cfg.steps, cfg.min_lr_frac, base=cfg.lr)


def build_target(args, cfg: Config, out: Path) -> dict | None:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from sglang_tev.atomic import atomic_write
    from sglang_tev.train.checkpoint import truncate_log

    tokdir = out / "tokenizer"
    if stage_record(out, "tokenizer") is None:
        raise UsageExit(f"argument --stages: 'target' needs {tokdir}; run the tokenizer stage first")
    tok = PreTrainedTokenizerFast.from_pretrained(tokdir)
    train = torch.from_numpy(np.load(tokdir / "train.npy").astype(np.int64))
    held = torch.from_numpy(np.load(tokdir / "heldout.npy").astype(np.int64))
    L, B = cfg.seq_len, cfg.batch
    n_chunks = (len(train) - 1) // L
    if n_chunks < 1:
        raise UsageExit(f"argument --max-files: {len(train)} training tokens < seq_len {L}")
    device = build_device(args)

    config = Qwen3Config(
        vocab_size=-(-len(tok) // 64) * 64,  # rounded up to a multiple of 64 for kernel-friendly shapes
        hidden_size=cfg.hidden, intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(args.seed)  # the model init is the only random draw of this stage
    model = Qwen3ForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    work = out / "target.work"
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = work / "ckpt.pt", work / "train_log.jsonl"
    fingerprint = target_fingerprint(cfg, args.seed, out)
    step, train_s = 0, 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        if state["fingerprint"] != fingerprint:
            raise UsageExit(f"argument --force: {ckpt_path} is from another config; pass --force to restart")
        if state["threads"] != torch.get_num_threads() or state["device"] != device.type:
            print(f"warning: resuming a {state['device']} run made with {state['threads']} threads on "
                  f"{device.type} with {torch.get_num_threads()}; results may differ in the last bits",
                  file=sys.stderr)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step, train_s = state["step"], state["train_s"]
        print(f"target: resuming at step {step}/{cfg.steps}", file=sys.stderr)
    truncate_log(log_path, step)  # the log may run past the last checkpoint when a run was killed

    perms: dict[int, torch.Tensor] = {}

    def batch_at(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch of update `s`: a pure function of (seed, s), which is what makes resume exact.
        Each epoch visits every packed chunk once, in a seeded order."""
        starts = []
        for pos in range(s * B, (s + 1) * B):
            epoch, i = divmod(pos, n_chunks)
            if epoch not in perms:
                g = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
                perms[epoch] = torch.randperm(n_chunks, generator=g)
            starts.append(int(perms[epoch][i]) * L)
        x = torch.stack([train[a:a + L] for a in starts])
        y = torch.stack([train[a + 1:a + L + 1] for a in starts])
        return x.to(device), y.to(device)

    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    stop = cfg.steps if args.max_steps is None else min(cfg.steps, args.max_steps)
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="target", unit="step", dynamic_ncols=True,
               mininterval=0.5 if sys.stderr.isatty() else 30)
    win_loss, win_steps, win_s = 0.0, 0, 0.0
    with open(log_path, "a") as log:
        while step < stop:
            t0 = time.perf_counter()
            x, y = batch_at(step)
            lr = lr_at(cfg, step)
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(**amp):
                logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            win_loss += loss.item()
            win_steps += 1
            dt = time.perf_counter() - t0
            win_s += dt
            train_s += dt
            bar.update(1)
            if step % cfg.log_every == 0 or step == stop:
                rec = {"step": step, "loss": round(win_loss / win_steps, 5), "lr": lr,
                       "tokens_per_s": round(win_steps * B * L / win_s, 1), "train_s": round(train_s, 1)}
                log.write(json.dumps(rec) + "\n")
                log.flush()
                bar.set_postfix(loss=rec["loss"], tok_s=rec["tokens_per_s"])
                win_loss, win_steps, win_s = 0.0, 0, 0.0
            if step % cfg.ckpt_every == 0 or step == stop:
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "train_s": train_s,
                         "fingerprint": fingerprint, "threads": torch.get_num_threads(), "device": device.type}
                atomic_write(ckpt_path, lambda f: torch.save(state, f))  # a crash keeps the previous one
    bar.close()
    if step < cfg.steps:
        print(f"target: stopped at step {step}/{cfg.steps} (--max-steps); rerun to resume", file=sys.stderr)
        return None

    # Ship bf16; evaluate the shipped (bf16-rounded) weights, computing in fp32 on CPU.
    fp32_sha = hashlib.sha256(b"".join(v.detach().cpu().float().numpy().tobytes()
                                       for _, v in sorted(model.state_dict().items()))).hexdigest()
    tmp = fresh_tmp(out, "target")
    model.to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    model.float().eval()
    nll, count = 0.0, 0
    with torch.no_grad(), torch.autocast(**amp):
        for a in range(0, len(held) - 1, L * B):  # non-overlapping windows, B at a time
            seg = held[a:a + L * B + 1]
            n = (len(seg) - 1) // L * L
            xs = [seg[:n].view(-1, L)] + ([seg[n:-1][None]] if len(seg) - 1 > n else [])
            ys = [seg[1:n + 1].view(-1, L)] + ([seg[n + 1:][None]] if len(seg) - 1 > n else [])
            for xb, yb in zip(xs, ys):
                if xb.numel():
                    lg = model(input_ids=xb.to(device), use_cache=False).logits.float()
                    nll += F.cross_entropy(lg.flatten(0, 1), yb.to(device).flatten(), reduction="sum").item()
                    count += yb.numel()
    heldout_loss = nll / count
    logs = [json.loads(ln) for ln in log_path.read_text().splitlines()]
    summary = {"params": n_params, "steps": cfg.steps, "tokens_seen": cfg.steps * B * L,
               "epochs": round(cfg.steps * B / n_chunks, 3), "train_s": round(train_s, 1),
               "tokens_per_s": round(cfg.steps * B * L / train_s, 1), "final_train_loss": logs[-1]["loss"],
               "heldout_tokens": count, "heldout_loss": heldout_loss, "heldout_ppl": math.exp(heldout_loss),
               "fp32_sha256": fp32_sha, "device": device.type, "threads": torch.get_num_threads(),
               "torch": torch.__version__}
    write_json(tmp / "metrics.json", summary)
    shutil.copyfile(log_path, tmp / "train_log.jsonl")
    write_json(tmp / "stage.json", {"fingerprint": fingerprint, "summary": summary})
    publish(tmp, out / "target")
    shutil.rmtree(work)  # the checkpoint is only for resuming; the stage is complete now
    print(f"target: held-out loss {heldout_loss:.4f}  ppl {math.exp(heldout_loss):.3f}  ({count} tokens)")
    return summary


# ---------------------------------------------------------------------------------------------
# stage 3: draft (sglang_tev.train)

@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """The drafter and its training run. Kept apart from `Config` so that adding this stage did
    not change the tokenizer/target fingerprints of builds already under way."""
    layers: int = 2
    intermediate: int = 768
    block_size: int = 16
    # z-lab's default for 6 target layers / 2 draft layers is [1, 3] (spread over [1, L-3]); we add
    # layer 4, the deepest whose HF hidden state is a raw layer output (hidden_states[6] is the
    # final-normed one, which SGLang's aux capture would not reproduce).
    target_layer_ids: tuple = (1, 3, 4)
    # training. A 250-step A/B on this corpus (docs/tiny-code.md, "Drafter recipe") showed the
    # SpecForge recipe (data CE, gamma 7, lr 1e-3, 1024-token windows) sitting at the unigram
    # for hundreds of steps; distilling the target's distribution with the loss focused on the
    # first depths (gamma 2) and lr 3e-3 left that plateau in < 100 steps. 512-token windows keep
    # relative distances up to a HumanEval prompt + completion in training at half the cost.
    seq_len: int = 512
    batch: int = 4
    anchors: int = 32               # blocks per sequence: 128 blocks x 15 labels per step
    steps: int = 3000
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.0
    gamma: float | None = 2.0
    token_weight: float = 0.0       # CE on the data tokens
    distill_weight: float = 1.0     # soft-target CE on the target's own distribution
    ckpt_every: int = 100
    log_every: int = 10
    eval_windows: int = 64          # held-out windows of seq_len tokens
    eval_stride: int = 16           # one anchor every 16 positions


FULL_DRAFT = DraftConfig()
QUICK_DRAFT = DraftConfig(layers=1, intermediate=96, target_layer_ids=(0,), seq_len=64, batch=2,
                          anchors=8, steps=6, warmup=2, ckpt_every=2, log_every=1, eval_windows=4,
                          eval_stride=4)


def is_quick(cfg: Config) -> bool:
    """Whether ``cfg`` is the --quick config (whatever --max-files): later stages pick their quick size by it."""
    return dataclasses.replace(cfg, max_files=None) == dataclasses.replace(QUICK, max_files=None)


def draft_config_for(cfg: Config) -> DraftConfig:
    """QUICK_DRAFT for a --quick build (whatever --max-files), else FULL_DRAFT."""
    return QUICK_DRAFT if is_quick(cfg) else FULL_DRAFT


def draft_fingerprint(cfg: Config, seed: int, out: Path) -> dict:
    dcfg = draft_config_for(cfg)
    return {**{f.name: getattr(dcfg, f.name) for f in dataclasses.fields(DraftConfig)},
            "target_layer_ids": list(dcfg.target_layer_ids), "seed": seed,
            "tokenizer_sha256": sha256_file(out / "tokenizer" / "tokenizer.json"),
            "target_sha256": sha256_file(out / "target" / "model.safetensors")}


@dataclasses.dataclass(frozen=True)
class Draft2Config:
    """What the draft2 stage (a DFlash2 drafter, issue 28) adds to the draft stage's DraftConfig:
    the same layers, data, steps, batch, anchors, schedule and distillation (the same compute as
    `draft-base/`), plus the grouped conv and the candidate selector with its teacher-forced term.
    Conv taps / group and selector top-k follow the public DFlash2 configs (SpecForge's
    qwen3.6-27b-dflash2.json: kernel 2, group 16, top-k 16); the rank is scaled to the tiny hidden
    size (that config: 256 at hidden 5120). Selector labels: the target's law over the candidates,
    as the backbone distils the target's law."""
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 16
    selector_weight: float = 1.0
    selector_labels: str = "target"


FULL_DRAFT2 = Draft2Config()
QUICK_DRAFT2 = Draft2Config(selector_rank=8, selector_top_k=8)


def draft2_config_for(cfg: Config) -> Draft2Config:
    return QUICK_DRAFT2 if is_quick(cfg) else FULL_DRAFT2


def draft2_fingerprint(cfg: Config, seed: int, out: Path) -> dict:
    d2 = draft2_config_for(cfg)
    return {**draft_fingerprint(cfg, seed, out), **{f"dflash2_{f.name}": getattr(d2, f.name)
                                                   for f in dataclasses.fields(Draft2Config)}}


def training_dir(args, work: Path, fingerprint: dict, input_name: str) -> Path:
    """The resume directory of a stage that runs sglang_tev.train: emptied by --force, refused
    when it holds another config's (or another ``input_name``'s) checkpoints, stamped with the
    stage fingerprint."""
    fp_path = work / "stage_fingerprint.json"
    if args.force:
        shutil.rmtree(work, ignore_errors=True)
    if work.exists() and (not fp_path.exists() or json.loads(fp_path.read_text()) != fingerprint):
        raise UsageExit(f"argument --force: {work} is from another config or {input_name}; pass --force to restart")
    work.mkdir(parents=True, exist_ok=True)
    write_json(fp_path, fingerprint)
    return work


def run_trainer(run_cfg: dict):
    """sglang_tev.train.train(run_cfg); a thread count that differs from the checkpoint's is a bad --threads."""
    from sglang_tev.train import ConfigError, train

    try:
        return train(run_cfg)
    except ConfigError as e:
        if e.key == "threads":
            raise UsageExit(f"argument --threads: {e}") from None
        raise


def build_draft(args, cfg: Config, out: Path) -> dict | None:
    return _train_drafter(args, cfg, out, "draft")


def build_draft2(args, cfg: Config, out: Path) -> dict | None:
    """The draft stage's recipe and compute for a DFlash2 drafter (conv + selector), from scratch."""
    return _train_drafter(args, cfg, out, "draft2")


def _train_drafter(args, cfg: Config, out: Path, stage: str) -> dict | None:
    import torch

    if stage_record(out, "target") is None:
        raise UsageExit(f"argument --stages: '{stage}' needs {out / 'target'}; run the target stage first")
    dcfg = draft_config_for(cfg)
    d2 = draft2_config_for(cfg) if stage == "draft2" else None
    fingerprint = (draft2_fingerprint if d2 else draft_fingerprint)(cfg, args.seed, out)
    work = training_dir(args, out / f"{stage}_train", fingerprint, "target")
    mask_id = stage_record(out, "tokenizer")["summary"]["mask_id"]
    run_cfg = {
        "target": str(out / "target"), "data": str(out / "tokenizer" / "train.npy"),
        "output_dir": str(work), "max_steps": dcfg.steps, "seq_len": dcfg.seq_len,
        "batch_size": dcfg.batch, "num_anchors": dcfg.anchors, "block_size": dcfg.block_size,
        "loss_decay_gamma": dcfg.gamma, "lr": dcfg.lr, "min_lr_ratio": dcfg.min_lr_frac,
        "warmup_steps": dcfg.warmup, "weight_decay": dcfg.weight_decay, "grad_clip": 1.0,
        "loss": {"token_weight": dcfg.token_weight, "distill_weight": dcfg.distill_weight},
        "seed": args.seed, "threads": args.threads, "save_every": dcfg.ckpt_every,
        "keep_checkpoints": 1, "log_every": dcfg.log_every, "device": args.device,
        "export_dtype": "bfloat16", "tensorboard": False, "stop_at_step": args.max_steps,
        "draft": {"num_hidden_layers": dcfg.layers, "intermediate_size": dcfg.intermediate,
                  "block_size": dcfg.block_size, "target_layer_ids": list(dcfg.target_layer_ids),
                  "mask_token_id": mask_id},
    }
    if d2 is not None:
        run_cfg["draft"].update(architecture="DFlash2DraftModel", conv_kernel_size=d2.conv_kernel_size,
                                conv_group_size=d2.conv_group_size, selector_rank=d2.selector_rank,
                                selector_top_k=d2.selector_top_k)
        run_cfg["loss"]["selector"] = {"weight": d2.selector_weight, "labels": d2.selector_labels}
    t0 = time.perf_counter()
    res = run_trainer(run_cfg)
    if not res.complete:
        print(f"{stage}: stopped at step {res.step}/{dcfg.steps} (--max-steps); rerun to resume", file=sys.stderr)
        return None
    logs = [json.loads(ln) for ln in (work / "train_log.jsonl").read_text().splitlines()]

    drafter, ev = heldout_eval(args, out, res.final_dir, dcfg)
    train_s = round(time.perf_counter() - t0, 1)
    tail = logs[-max(1, len(logs) // 10):]
    summary = {"params": sum(p.numel() for p in drafter.parameters()), "layers": dcfg.layers,
               "block_size": dcfg.block_size, "target_layer_ids": list(dcfg.target_layer_ids),
               "steps": dcfg.steps, "tokens_seen": dcfg.steps * dcfg.batch * dcfg.seq_len,
               "final_train_loss": round(sum(r["loss"] for r in tail) / len(tail), 5),
               "heldout_anchors": ev["anchors"], "heldout_ce_mean": round(ev["ce_mean"], 5),
               "heldout_acc_mean": round(ev["acc_mean"], 5),
               "heldout_accept_len_data": round(ev["accept_len_data"], 4),
               "heldout_acc": _clean(ev["acc"], 4), "heldout_ce": _clean(ev["ce"], 4),
               "wall_s": train_s, "device": next(drafter.parameters()).device.type,
               "threads": torch.get_num_threads(), "torch": torch.__version__}
    if d2 is not None:
        summary.update(architecture="DFlash2DraftModel", **{f"dflash2_{k}": v for k, v in dataclasses.asdict(d2).items()},
                       heldout_sel_recall=round(ev["sel_recall"], 4), heldout_sel_acc=round(ev["sel_acc"], 4),
                       heldout_unary_acc=round(ev["unary_acc"], 4))
    tmp = fresh_tmp(out, stage)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(res.final_dir / name, tmp / name)
    write_json(tmp / "metrics.json", {**summary, "heldout": ev})
    shutil.copyfile(work / "train_log.jsonl", tmp / "train_log.jsonl")
    write_json(tmp / "stage.json", {"fingerprint": fingerprint, "summary": summary})
    publish(tmp, out / stage)
    shutil.rmtree(work)  # checkpoints only serve resuming; the stage is complete now
    print_heldout(stage, ev)
    return summary


def _clean(xs, nd):
    """json-stable rounding (no NaN: the skipped-stage summary must compare equal)."""
    return [None if x != x else round(x, nd) for x in xs]


def heldout_eval(args, out: Path, drafter_dir: Path, dcfg: DraftConfig, exit_budget: int | None = None):
    """(drafter, metrics) of the drafter in ``drafter_dir`` (bf16 files as shipped, computed in
    fp32; bf16 autocast on CUDA) on the held-out split: ``sglang_tev.train.evaluate`` with the
    draft stage's windows and stride, plus 1 + C_p at T = 0 and 1 when ``exit_budget`` is given."""
    import torch
    from sglang_tev.draft.dflash import DFlashDraftModel
    from sglang_tev.train import evaluate, load_dataset, load_target

    device = build_device(args)
    target, tok = load_target(out / "target", device, torch.float32)
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32, device=device)
    held = load_dataset(out / "tokenizer" / "heldout.npy", dcfg.seq_len, key="heldout")
    ev = evaluate(drafter, target, held, stride=dcfg.eval_stride, max_windows=dcfg.eval_windows,
                  batch_size=dcfg.batch, sep_ids=[tok.eos_token_id if tok is not None else target.config.eos_token_id],
                  device=device, autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
                  exit_budget=exit_budget)
    return drafter, ev


def print_heldout(stage: str, ev: dict) -> None:
    print(f"{stage}: held-out per-depth top-1 accuracy / CE (nats), bf16 weights, "
          f"{ev['anchors']} anchors in {ev['windows']} windows")
    print("  depth " + " ".join(f"{d:>6}" for d in range(1, len(ev["acc"]) + 1)))
    print("  acc   " + " ".join(f"{a:6.3f}" for a in ev["acc"]))
    print("  ce    " + " ".join(f"{c:6.3f}" for c in ev["ce"]))
    print(f"  mean acc {ev['acc_mean']:.4f}  mean ce {ev['ce_mean']:.4f}  "
          f"leading-correct depths (accept length on the data) {ev['accept_len_data']:.3f}"
          + "".join(f"  1 + C_p at T = {k[len('block_len_T'):]}: {v:.4f}"
                    for k, v in ev.items() if k.startswith("block_len_T")))


# ---------------------------------------------------------------------------------------------
# stage 4: exittrain (ExitTrain fine-tuning of the drafter on the target's own rollouts)

EXIT_RECIPE = "exittrain-tiny-code"  # sglang_tev/train/recipes/<name>.yaml


@dataclasses.dataclass(frozen=True)
class ExitConfig:
    """ExitTrain fine-tuning of the draft stage's drafter: arm D of
    ``benchmarks/exittrain_experiment.py`` (token CE + λ·exit loss under the target's T = 0 law),
    the arm that beat the previously shipped drafter by +8 % tau at T = 0 on held-out prompts
    (``docs/exittrain.md``). The recipe is the packaged file both read (``EXIT_RECIPE``,
    :func:`exit_recipe`); ``threads`` is pinned there to 1 so that the stage reproduces the
    experiment's run bit for bit whatever ``--threads`` says. Field names are the stage's (they
    are its fingerprint and ``metrics.json``'s ``exittrain`` record)."""
    prompts: int                    # cut from the training split's files (never the held-out ones)
    prompt_chars: int
    prompt_seed: int
    rollout_max_new_tokens: int
    rollout_temperature: float      # the target's own sampled answers (paper App. D)
    rollout_batch: int
    rollout_seed: int
    steps: int
    lr: float
    warmup: int
    min_lr_frac: float
    seq_len: int
    batch: int
    anchors: int
    gamma: float
    token_weight: float             # dense loss: token CE on the response tokens
    exit_mode: str                  # the paper's w(v) = P(v)·rho(v)
    exit_lambda: float              # fixed in advance by the experiment: exit gradient at 0.6x the token gradient
    exit_temperature: float         # weights from the target's greedy law (arm D)
    budget: int
    threads: int
    ckpt_every: int = 25
    log_every: int = 10


# ExitConfig field -> key of the recipe's `design`
EXIT_RECIPE_KEYS = {"prompts": "train_prompts", "prompt_chars": "prompt_chars", "prompt_seed": "prompt_seed",
                    "rollout_max_new_tokens": "rollout_max_new_tokens", "rollout_temperature": "rollout_temperature",
                    "rollout_batch": "rollout_batch_size", "rollout_seed": "rollout_seed", "steps": "steps",
                    "lr": "lr", "warmup": "warmup_steps", "min_lr_frac": "min_lr_ratio", "seq_len": "seq_len",
                    "batch": "batch_size", "anchors": "num_anchors", "gamma": "loss_decay_gamma",
                    "token_weight": "token_weight", "budget": "budget", "threads": "threads"}


def exit_recipe(recipe: dict | None = None) -> ExitConfig:
    """The exittrain stage's config from the packaged recipe (``EXIT_RECIPE``): the design's
    training keys, the loss of arm ``shipped.arm`` and the λ ``shipped.lambda``."""
    from sglang_tev.train.config import load_recipe

    r = load_recipe(EXIT_RECIPE) if recipe is None else recipe
    design, shipped = r["design"], r["shipped"]
    arm = r["arms"][shipped["arm"]]
    return ExitConfig(**{f: design[k] for f, k in EXIT_RECIPE_KEYS.items()}, exit_mode=arm["mode"],
                      exit_lambda=float(shipped["lambda"]), exit_temperature=float(arm["temperature"]))


@functools.cache
def exit_configs() -> dict[str, ExitConfig]:
    """``{"full": FULL_EXIT, "quick": QUICK_EXIT}``, read from the recipe on first use (importing
    the package costs seconds: argument errors and --help stay instant)."""
    full = exit_recipe()
    quick = dataclasses.replace(full, prompts=8, prompt_chars=120, rollout_max_new_tokens=32, rollout_batch=4,
                                steps=3, warmup=1, seq_len=128, batch=2, anchors=8, budget=16, ckpt_every=1,
                                log_every=1)
    return {"full": full, "quick": quick}


def __getattr__(name: str):
    """``FULL_EXIT`` / ``QUICK_EXIT`` as module attributes (PEP 562), from :func:`exit_configs`."""
    if name in ("FULL_EXIT", "QUICK_EXIT"):
        return exit_configs()[name.split("_")[0].lower()]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def exit_config_for(cfg: Config) -> ExitConfig:
    return exit_configs()["quick" if is_quick(cfg) else "full"]


def exittrain_fingerprint(cfg: Config, seed: int, out: Path) -> dict:
    return {**dataclasses.asdict(exit_config_for(cfg)), "seed": seed,
            "draft_sha256": sha256_file(out / "draft" / "model.safetensors"),
            "target_sha256": sha256_file(out / "target" / "model.safetensors")}


def build_exittrain(args, cfg: Config, out: Path) -> dict | None:
    """Rollouts of the target on prompts cut from the training split, then ``sglang_tev.train``
    from the draft stage's drafter with ExitConfig's loss; held-out accuracy and 1 + C_p of the
    drafter before and after. Resumes from the trainer's checkpoints and the rollout cache in
    OUTDIR/exittrain_train/."""
    import torch
    from sglang_tev.atomic import atomic_write
    from sglang_tev.train.rollout import cut_prompts

    if stage_record(out, "draft") is None:
        raise UsageExit(f"argument --stages: 'exittrain' needs {out / 'draft'}; run the draft stage first")
    ecfg, dcfg = exit_config_for(cfg), draft_config_for(cfg)
    fingerprint = exittrain_fingerprint(cfg, args.seed, out)
    work = training_dir(args, out / "exittrain_train", fingerprint, "drafter")
    prompts = work / "train_prompts.jsonl"
    if not prompts.exists():
        split = json.loads((out / "tokenizer" / "split.json").read_text())
        try:
            rows = cut_prompts(split["stdlib"], split["train"], ecfg.prompts, ecfg.prompt_seed, ecfg.prompt_chars)
        except ValueError as e:
            raise UsageExit(f"argument --max-files: the training files are too few for the exittrain stage ({e})") from None
        atomic_write(prompts, "".join(json.dumps(r) + "\n" for r in rows), tmp=prompts.with_suffix(".tmp"))
    run_cfg = {
        "target": str(out / "target"), "draft_init": str(out / "draft"), "output_dir": str(work),
        "max_steps": ecfg.steps, "seq_len": ecfg.seq_len, "batch_size": ecfg.batch,
        "num_anchors": ecfg.anchors, "loss_decay_gamma": ecfg.gamma, "lr": ecfg.lr,
        "warmup_steps": ecfg.warmup, "min_lr_ratio": ecfg.min_lr_frac,
        "loss": {"token_weight": ecfg.token_weight, "distill_weight": 0.0,
                 "exit": {"mode": ecfg.exit_mode, "lambda": ecfg.exit_lambda,
                          "temperature": ecfg.exit_temperature, "budget": ecfg.budget}},
        "rollout": {"prompts": str(prompts), "cache": str(work / "rollouts.jsonl"),
                    "max_new_tokens": ecfg.rollout_max_new_tokens, "temperature": ecfg.rollout_temperature,
                    "batch_size": ecfg.rollout_batch, "seed": ecfg.rollout_seed, "chat_template": False},
        "seed": args.seed, "threads": ecfg.threads, "save_every": ecfg.ckpt_every, "keep_checkpoints": 1,
        "log_every": ecfg.log_every, "device": args.device, "export_dtype": "bfloat16",
        "tensorboard": False, "stop_at_step": args.max_steps,
    }
    t0 = time.perf_counter()
    try:  # training and the evaluations run on ExitConfig.threads: the metrics too are --threads-free
        res = run_trainer(run_cfg)
        if not res.complete:
            print(f"exittrain: stopped at step {res.step}/{ecfg.steps} (--max-steps); rerun to resume",
                  file=sys.stderr)
            return None
        train_s = round(time.perf_counter() - t0, 1)
        torch.set_num_threads(ecfg.threads)
        _, before = heldout_eval(args, out, out / "draft", dcfg, exit_budget=ecfg.budget)
        drafter, ev = heldout_eval(args, out, res.final_dir, dcfg, exit_budget=ecfg.budget)
    finally:
        torch.set_num_threads(args.threads)
    with open(work / "rollouts.jsonl", encoding="utf-8") as f:
        n_rollouts = sum(1 for _ in f)
    summary = {"params": sum(p.numel() for p in drafter.parameters()), "layers": dcfg.layers,
               "block_size": dcfg.block_size, "target_layer_ids": list(dcfg.target_layer_ids),
               "steps": ecfg.steps, "rollouts": n_rollouts,
               "heldout_anchors": ev["anchors"], "heldout_ce_mean": round(ev["ce_mean"], 5),
               "heldout_acc_mean": round(ev["acc_mean"], 5),
               "heldout_accept_len_data": round(ev["accept_len_data"], 4),
               "heldout_acc": _clean(ev["acc"], 4), "heldout_ce": _clean(ev["ce"], 4),
               "heldout_block_len": {f"T{t:g}": round(ev[f"block_len_T{t:g}"], 4) for t in (0.0, 1.0)},
               "before": {"heldout_acc_mean": round(before["acc_mean"], 5),
                          "heldout_ce_mean": round(before["ce_mean"], 5),
                          "heldout_block_len": {f"T{t:g}": round(before[f"block_len_T{t:g}"], 4) for t in (0.0, 1.0)}},
               "wall_s": train_s, "device": next(drafter.parameters()).device.type, "threads": ecfg.threads,
               "torch": torch.__version__}
    tmp = fresh_tmp(out, "exittrain")
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(res.final_dir / name, tmp / name)
    write_json(tmp / "metrics.json", {**summary, "heldout": ev, "exittrain": dataclasses.asdict(ecfg)})
    for name in ("train_log.jsonl", "config.yaml", "train_prompts.jsonl", "rollouts.jsonl.meta.json"):
        if (work / name).exists():
            shutil.copyfile(work / name, tmp / name)
    write_json(tmp / "stage.json", {"fingerprint": fingerprint, "summary": summary})
    publish(tmp, out / "exittrain")
    shutil.rmtree(work)
    print("exittrain: before -> after, held-out: mean acc {:.4f} -> {:.4f}; 1 + C_p (B = {}) T = 0 {:.4f} -> {:.4f}, "
          "T = 1 {:.4f} -> {:.4f}".format(before["acc_mean"], ev["acc_mean"], ecfg.budget, before["block_len_T0"],
                                         ev["block_len_T0"], before["block_len_T1"], ev["block_len_T1"]))
    print_heldout("exittrain", ev)
    return summary


# ---------------------------------------------------------------------------------------------
# stage 5: bench (sglang_tev.hf.bench on HumanEval) and stage 6: ship (package data)

@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The HumanEval measurement of the built pair (bf16 weights reloaded, computed in fp32)."""
    limit: int = 40
    budgets: tuple = (32, 64, 128)
    temperatures: tuple = (0.0, 1.0)
    max_new_tokens: int = 128
    # predraw/sequential follow the same law as tev (paper Theorem 1; tests/core/test_verify_exact.py)
    # and at T = 0 the same token path, so the build measures tev only: the stage stays near
    # 6 minutes on 2 cores instead of ~15. `sglang-tev bench` runs all five methods by default.
    methods: tuple = ("autoregressive", "chain", "tev")


FULL_BENCH = BenchConfig()
QUICK_BENCH = BenchConfig(limit=2, budgets=(4,), temperatures=(0.0,), max_new_tokens=8,
                          methods=("autoregressive", "chain", "tev", "predraw", "sequential"))
ASSETS = Path(__file__).resolve().parent.parent / "sglang_tev" / "assets" / "tiny-code"


def bench_config_for(cfg: Config) -> BenchConfig:
    return QUICK_BENCH if is_quick(cfg) else FULL_BENCH


def bench_fingerprint(cfg: Config, seed: int, out: Path) -> dict:
    fp = {**dataclasses.asdict(bench_config_for(cfg)), "seed": seed,
          "draft_sha256": sha256_file(out / "exittrain" / "model.safetensors"),
          "target_sha256": sha256_file(out / "target" / "model.safetensors")}
    return json.loads(json.dumps(fp))  # tuples -> lists, as stage.json stores them


def build_bench(args, cfg: Config, out: Path) -> dict | None:
    """`sglang-tev bench --dataset humaneval` on the pair as shipped (the target and the exittrain
    stage's drafter; bf16 files, loaded in fp32 on CPU, bf16 on CUDA): every method, budget and
    temperature of BenchConfig."""
    from sglang_tev.hf.bench import format_table, run_bench
    from sglang_tev.hf.datasets import load_humaneval
    from sglang_tev.hf.runtime import SpeculativeGenerator

    if stage_record(out, "exittrain") is None:
        raise UsageExit(f"argument --stages: 'bench' needs {out / 'exittrain'}; run the exittrain stage first")
    bcfg = bench_config_for(cfg)
    device = None if args.device == "auto" else args.device
    gen = SpeculativeGenerator.from_pretrained(out / "target", out / "exittrain", device=device)
    tmp = fresh_tmp(out, "bench")
    cmd = (f"sglang-tev bench --target {out / 'target'} --draft {out / 'exittrain'} --dataset humaneval "
           f"--limit {bcfg.limit} --budgets {','.join(map(str, bcfg.budgets))} "
           f"--temperatures {','.join(map(str, bcfg.temperatures))} --max-new-tokens {bcfg.max_new_tokens} "
           f"--methods {','.join(bcfg.methods)} --seed {args.seed} --repeats 1")
    # one repeat: this stage measures tau (the same at every repeat), not speed
    records = run_bench(gen, load_humaneval(bcfg.limit), budgets=bcfg.budgets, temperatures=bcfg.temperatures,
                        max_new_tokens=bcfg.max_new_tokens, seed=args.seed, output_dir=tmp, command=cmd,
                        methods=bcfg.methods, repeats=1)
    print(format_table(records))
    fingerprint = bench_fingerprint(cfg, args.seed, out)
    tau = {f"{r['method']}{'' if r['budget'] is None else '@' + str(r['budget'])}_T{r['temperature']:g}": r["tau"]
           for r in records}
    summary = {"prompts": bcfg.limit, "max_new_tokens": bcfg.max_new_tokens, "tau": tau}
    write_json(tmp / "stage.json", {"fingerprint": fingerprint, "summary": summary})
    publish(tmp, out / "bench")
    return summary


def ship_fingerprint(cfg: Config, seed: int, out: Path) -> dict:
    return {"draft_sha256": sha256_file(out / "exittrain" / "model.safetensors"),
            "draft_base_sha256": sha256_file(out / "draft" / "model.safetensors"),
            **({"draft2_sha256": sha256_file(out / "draft2" / "model.safetensors")}
               if (out / "draft2" / "model.safetensors").exists() else {}),
            "target_sha256": sha256_file(out / "target" / "model.safetensors")}


# packaged dir -> (stage dir it is copied from, files)
SHIP_FILES = {"target": ("target", ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                    "tokenizer_config.json", "special_tokens_map.json", "metrics.json")),
              "draft": ("exittrain", ("config.json", "model.safetensors", "metrics.json")),
              "draft-base": ("draft", ("config.json", "model.safetensors", "metrics.json")),
              "draft2": ("draft2", ("config.json", "model.safetensors", "metrics.json"))}
OPTIONAL_SHIP = {"draft2"}  # shipped when its stage is complete


def model_card(out: Path) -> str:
    """The shipped pair's README, filled from the stages' measurements."""
    tok = stage_record(out, "tokenizer")["summary"]
    tgt = json.loads((out / "target" / "metrics.json").read_text())
    base = json.loads((out / "draft" / "metrics.json").read_text())
    drf = json.loads((out / "exittrain" / "metrics.json").read_text())
    draft2_row = ""
    if (out / "draft2" / "metrics.json").exists():  # the opt-in draft2 stage (issue 28)
        d2 = json.loads((out / "draft2" / "metrics.json").read_text())
        draft2_row = (f"| DFlash2 drafter (default) | DFlash2, the same layers, grouped conv (kernel {d2['dflash2_conv_kernel_size']}, "
                      f"group {d2['dflash2_conv_group_size']}), candidate selector (rank {d2['dflash2_selector_rank']}, "
                      f"top-k {d2['dflash2_selector_top_k']}); draft-base/'s recipe and steps | {d2['params']:,} | "
                      "`draft2/model.safetensors` (bf16, z-lab layout; `docs/tiny-code.md`, stage draft2) |\n")
    records = json.loads((out / "bench" / "results.json").read_text())
    E = ExitConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in drf["exittrain"].items()})
    bl, bl0 = drf["heldout_block_len"], drf["before"]["heldout_block_len"]
    meta = json.loads((out / "bench" / "meta.json").read_text())
    acc = drf["heldout_acc"]
    tc = json.loads((out / "target" / "config.json").read_text())
    tau64 = next((r["tau"] for r in records if r["method"] == "tev" and r["budget"] == 64
                  and r["temperature"] == 0), None)
    if tau64 is not None and tau64 >= 2.5:
        bar_line = (f"The drafter is small and weak next to real DFlash drafters (depth-1 top-1 above); tev at "
                    f"budget 64, T = 0 reaches tau {tau64:.2f} (project bar: 2.5). At T = 1 tau is lower: "
                    f"the target's sampled tokens are harder to draft than its greedy ones.")
    else:
        bar_line = (f"The drafter is weak (depth-1 top-1 above): tev at budget 64, T = 0 reaches tau "
                    f"{'?' if tau64 is None else format(tau64, '.2f')}, below the project's bar of 2.5; "
                    f"`docs/tiny-code.md` says why and what should raise it.")
    best = max((r for r in records if r["method"] == "tev" and r["speedup"] is not None),
               key=lambda r: r["speedup"], default=None)
    if best is not None and best["speedup"] > 1:
        cpu_line = (f"On a CPU every tree node costs target compute, so speed-ups are small (at most "
                    f"{best['speedup']:.2f}x above, tev at budget {best['budget']}, T = {best['temperature']:g}) and "
                    f"below 1 where tau is low; the speed-ups of tree speculation come from memory-bound GPU "
                    f"decoding. tau and coverage are the numbers to read on CPU.")
    else:
        cpu_line = ("On a CPU every tree node costs target compute, so speculative decoding is slower than "
                    "autoregressive decoding here (speed-up < 1 above); the speed-ups of tree speculation come "
                    "from memory-bound GPU decoding. tau and coverage are the numbers to read on CPU.")
    rows = "\n".join(
        f"| {r['method']} | {'-' if r['budget'] is None else r['budget']} | {r['temperature']:g} | {r['tau']:.2f} | "
        f"{r['accept_len_mean']:.2f} | {'-' if r['coverage_mean'] is None else format(r['coverage_mean'], '.2f')} | "
        f"{r['tokens_per_s']:.1f} | {'-' if r['speedup'] is None else format(r['speedup'], '.2f')} |"
        for r in records)
    return f"""# tiny-code: a small code model pair for sglang-tev

The default model pair of `sglang-tev generate` / `bench` when no `--target/--draft` is given:
a Qwen3-architecture base code model and a DFlash drafter for it, trained from scratch by
`scripts/build_tiny_code.py` on a 2-core CPU. It is small enough to ship in the package and to
run anywhere, and genuinely trained, so speculative decoding accepts real drafts. It is not a
useful code assistant: expect plausible-looking Python, not correct programs.

## Data

The Python standard library of CPython {sys.version.split()[0]} (`*.py`, test suites and
generated tables excluded): {tok.get("files_train", "?")} training files, {tok.get("files_heldout", "?")} held-out files
(by file, seeded). Licence of the data: PSF License Agreement (Python Software Foundation).

## Models

| part | architecture | parameters | file |
|---|---|---|---|
| tokenizer | byte-level BPE, {tok.get("vocab", "?")} tokens, `<|endoftext|>` (EOS), `<|mask|>` (DFlash mask) | - | `target/tokenizer.json` |
| target | Qwen3ForCausalLM, hidden {tc["hidden_size"]}, {tc["num_hidden_layers"]} layers, {tc["num_attention_heads"]}/{tc["num_key_value_heads"]} heads, tied embeddings, {tc["max_position_embeddings"]} positions | {tgt.get("params", "?"):,} | `target/model.safetensors` (bf16) |
| {"DFlash drafter (the default before draft2)" if draft2_row else "drafter (default)"} | DFlash, {drf["layers"]} layers, block size {drf["block_size"]}, target layers {drf["target_layer_ids"]}, ExitTrain fine-tuned | {drf["params"]:,} | `draft/model.safetensors` (bf16, z-lab layout) |
| drafter before ExitTrain | the same architecture | {base["params"]:,} | `draft-base/model.safetensors` (bf16, z-lab layout) |
{draft2_row}
Training: the target is a causal LM on the training split ({tgt.get("steps", "?")} updates); the drafter is trained
by `sglang_tev.train` on the frozen target's features, {FULL_DRAFT.steps} steps x {FULL_DRAFT.batch * FULL_DRAFT.anchors} blocks
of {FULL_DRAFT.block_size} over {FULL_DRAFT.seq_len}-token windows, loss = soft-target CE against the target's own
next-token distribution (`loss.distill_weight: {FULL_DRAFT.distill_weight:g}`, `loss.token_weight: {FULL_DRAFT.token_weight:g}`),
decay gamma {FULL_DRAFT.gamma:g}, lr {FULL_DRAFT.lr:g} (recipe and its A/B: `docs/tiny-code.md`); that drafter
is `draft-base/`. The {"DFlash drafter `draft/` (the default until `draft2/`)" if draft2_row else "default drafter `draft/`"} is `draft-base/` fine-tuned by ExitTrain: {drf.get("rollouts", E.prompts)} target
rollouts (T = {E.rollout_temperature:g}, up to {E.rollout_max_new_tokens} tokens) of prompts cut from the training split, {E.steps} steps,
loss = token CE on the responses + lambda {E.exit_lambda:g} x exit loss (`loss.exit.mode: {E.exit_mode}`, the paper's
P(v)·rho(v) weights, computed under the target's T = {E.exit_temperature:g} law, budget {E.budget}), gamma {E.gamma:g},
lr {E.lr:g}: arm D of the ExitTrain experiment, which beat `draft-base/` by +8 % tau at T = 0 on
held-out prompts (`docs/exittrain.md`).

## Measured

- Target held-out loss {tgt.get("heldout_loss", float("nan")):.3f} nats/token, perplexity {tgt.get("heldout_ppl", float("nan")):.1f}
  (bf16 weights computed in fp32).
- Drafter held-out top-1 accuracy per depth 1..{len(acc)}: {", ".join(f"{a:.2f}" for a in acc)}
  (mean CE {drf["heldout_ce_mean"]:.3f}; before ExitTrain: mean accuracy {drf["before"]["heldout_acc_mean"]:.3f},
  mean CE {drf["before"]["heldout_ce_mean"]:.3f}). Expected block length 1 + C_p of its budget-{E.budget} trees
  on the held-out split: {bl["T0"]:.3f} at T = 0, {bl["T1"]:.3f} at T = 1 (before ExitTrain: {bl0["T0"]:.3f}, {bl0["T1"]:.3f}).
- `sglang-tev bench` on the first {meta.get("prompts")} HumanEval prompts (up to {meta.get("max_new_tokens", 128)} new tokens each),
  the shipped bf16 files loaded in {meta.get("dtype")} on {meta.get("device")} ({meta["machine"].get("cpu_count")}-core
  {meta["machine"].get("platform")}, {meta["machine"].get("torch_threads")} threads, torch {meta["versions"]["torch"]},
  {meta.get("date", "")}).
  tau = tokens emitted per round (accepted drafts + bonus); speed-up vs autoregressive through the same runtime:

| method | budget | T | tau | accept len | coverage | tok/s | speed-up |
|---|---|---|---|---|---|---|---|
{rows}

Command: `{meta.get("command", "")}`

## Limitations

- {bar_line}
- {cpu_line}
- ExitTrain's exit weights come from the target's T = 0 law: it raised the held-out 1 + C_p at
  T = 0 ({bl0["T0"]:.3f} -> {bl["T0"]:.3f}) and lowered it at T = 1 ({bl0["T1"]:.3f} -> {bl["T1"]:.3f}). For sampling
  at T = 1, `draft-base/` drafts slightly better.
- Only tev is measured here; predraw and sequential sample the same law (paper Theorem 1,
  `tests/core/test_verify_exact.py`) and `sglang-tev bench` runs them by default.

## Rebuild

```bash
python scripts/build_tiny_code.py --out runs/tiny-code --threads 2      # tokenizer, target, draft, exittrain, bench
python scripts/build_tiny_code.py --out runs/tiny-code --stages ship    # copy into sglang_tev/assets
```

Seeded and resumable; about 2 hours on a 2-core CPU (tokenizer 8 s, target ~43 min, drafter ~26 min,
ExitTrain single-threaded: rollouts 19-36 min and 600 steps ~35-63 min, bench ~6-17 min). See `docs/tiny-code.md`.
"""


def build_ship(args, cfg: Config, out: Path) -> dict | None:
    """Copy the pair into the package (sglang_tev/assets/tiny-code/{target,draft,draft-base}, see
    SHIP_FILES) through a temp dir and one rename, plus OUTDIR/ship/stage.json. A --quick build is
    never shipped."""
    for need in ("target", "draft", "exittrain", "bench"):
        if stage_record(out, need) is None:
            raise UsageExit(f"argument --stages: 'ship' needs {out / need}; run the {need} stage first")
    if bench_config_for(cfg) is QUICK_BENCH:
        raise UsageExit("argument --quick: a quick build is not shipped")
    staging = ASSETS.parent / ".tiny-code.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    total = 0
    for part, (stage, names) in SHIP_FILES.items():
        if part in OPTIONAL_SHIP and stage_record(out, stage) is None:
            continue
        (staging / part).mkdir(parents=True)
        for name in names:
            src = out / stage / name
            if src.exists():
                shutil.copyfile(src, staging / part / name)
                total += src.stat().st_size
    shutil.copyfile(out / "bench" / "results.json", staging / "bench_results.json")
    (staging / "README.md").write_text(model_card(out))
    publish(staging, ASSETS)
    summary = {"assets": str(ASSETS), "bytes": total}
    tmp = fresh_tmp(out, "ship")
    write_json(tmp / "stage.json", {"fingerprint": ship_fingerprint(cfg, args.seed, out), "summary": summary})
    publish(tmp, out / "ship")
    return summary


# ---------------------------------------------------------------------------------------------
# stage registry: name -> (builder, fingerprint), in build order; each builder writes
# OUTDIR/<name>/ atomically and returns a summary dict.

STAGES = {
    "tokenizer": (build_tokenizer, lambda cfg, seed, out: tokenizer_fingerprint(cfg, seed)),
    "target": (build_target, target_fingerprint),
    "draft": (build_draft, draft_fingerprint),
    "draft2": (build_draft2, draft2_fingerprint),  # opt-in: not in the default --stages
    "exittrain": (build_exittrain, exittrain_fingerprint),
    "bench": (build_bench, bench_fingerprint),
    "ship": (build_ship, ship_fingerprint),
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/tiny-code"), help="output dir (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, init and data order (default: 0)")
    p.add_argument("--stages", default="tokenizer,target,draft,exittrain,bench",
                   help="comma-separated stages to run, in order (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny vocab, model and budget (tests, smoke runs)")
    p.add_argument("--force", action="store_true", help="rebuild the selected stages even when complete")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default: cuda if present")
    p.add_argument("--max-files", type=int, help="use N evenly spaced stdlib files (default: all; --quick: 24)")
    p.add_argument("--max-steps", type=int,
                   help="stop the target, draft or exittrain stage after N updates, checkpointed; a later run resumes")
    p.add_argument("--from-assets", action="store_true",
                   help="take the target and draft stages from the packaged pair (draft-base/: the drafter "
                        "before ExitTrain) instead of training them; needs a complete tokenizer stage equal "
                        "to the packaged tokenizer")
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if not stages or unknown:
        p.error(f"argument --stages: unknown stage(s) {unknown or args.stages!r}; known: {', '.join(STAGES)}")
    args.stages = [s for s in STAGES if s in stages]  # registry order: later stages read earlier ones
    if args.threads is None or args.threads < 1:
        p.error(f"argument --threads: must be >= 1, got {args.threads}")
    if args.max_files is not None and args.max_files < 2:
        p.error(f"argument --max-files: must be >= 2 (one held-out file plus training), got {args.max_files}")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"argument --max-steps: must be >= 1, got {args.max_steps}")
    if args.seed < 0:
        p.error(f"argument --seed: must be >= 0, got {args.seed}")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"argument --out: {args.out} exists and is not a directory")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            p.error("argument --device: cuda requested but torch.cuda.is_available() is False")
    if args.from_assets:  # the packaged pair is the full, seed-0 build
        if args.quick or args.max_files is not None:
            p.error("argument --from-assets: the packaged pair is a full build; not with --quick or --max-files")
        if args.seed != 0:
            p.error(f"argument --from-assets: the packaged pair was built with seed 0, not {args.seed}")
        if args.force and {"target", "draft"} & set(args.stages):
            p.error("argument --from-assets: --force would retrain the adopted target/draft stages; "
                    "leave them out of --stages")
    cfg = QUICK if args.quick else FULL
    if args.max_files is not None:
        cfg = dataclasses.replace(cfg, max_files=args.max_files)
    return args, cfg


def adopt_assets(args, cfg: Config, out: Path) -> None:
    """--from-assets: make the target and draft stages hold the packaged target and drafter
    before ExitTrain (``draft-base/``; ``draft/`` in a package that predates it), stamped with the
    fingerprints a seed-0 build of the full config gives them. A stage already complete must hold
    the packaged weights. Raises UsageExit naming --from-assets."""
    if stage_record(out, "tokenizer") is None:
        raise UsageExit(f"argument --from-assets: needs {out / 'tokenizer'}; run the tokenizer stage first")
    if sha256_file(out / "tokenizer" / "tokenizer.json") != sha256_file(ASSETS / "target" / "tokenizer.json"):
        raise UsageExit(f"argument --from-assets: {out / 'tokenizer' / 'tokenizer.json'} differs from the packaged "
                        "tokenizer; the packaged pair was built from another tokenizer stage")
    base = ASSETS / "draft-base" if (ASSETS / "draft-base").is_dir() else ASSETS / "draft"
    if "exittrain" in json.loads((base / "metrics.json").read_text()):
        raise UsageExit(f"argument --from-assets: {base} is an ExitTrain drafter, not the draft stage's")
    for stage, src, fingerprint in (("target", ASSETS / "target", target_fingerprint),
                                    ("draft", base, draft_fingerprint)):
        if stage_record(out, stage) is not None:
            if sha256_file(out / stage / "model.safetensors") != sha256_file(src / "model.safetensors"):
                raise UsageExit(f"argument --from-assets: {out / stage} is not the packaged {src.name}/; "
                                "choose another --out")
            continue
        tmp = fresh_tmp(out, stage)
        for f in src.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        summary = {k: v for k, v in json.loads((src / "metrics.json").read_text()).items() if k != "heldout"}
        summary["adopted_from"] = str(src)
        # both fingerprints read earlier stages only (tokenizer; target), never this one
        write_json(tmp / "stage.json", {"fingerprint": fingerprint(cfg, 0, out), "summary": summary})
        publish(tmp, out / stage)
        print(f"{stage}: adopted from {src}")


def main(argv: list[str] | None = None) -> dict[str, dict | None]:
    """Run the selected stages; returns each stage's summary. Bad arguments: one line on stderr and
    SystemExit with status 2."""
    try:
        return _main(argv)
    except UsageExit as e:
        print(f"build_tiny_code.py: error: {e}", file=sys.stderr, flush=True)
        raise


def _main(argv: list[str] | None) -> dict[str, dict | None]:
    args, cfg = parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' pool; read on first use
    import torch
    torch.set_num_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    # complete stages that the selected ones read must come from this config and seed too (a
    # --quick folder must not be continued, or shipped, by a full-size command)
    order = list(STAGES)
    for name in order[:max(order.index(n) for n in args.stages)]:
        rec = stage_record(out, name)
        if name not in args.stages and rec is not None and rec["fingerprint"] != STAGES[name][1](cfg, args.seed, out):
            raise UsageExit(f"argument --out: {out / name} was built with another config or seed (--quick, "
                            "--max-files, --seed); give the same ones or choose another --out")

    results: dict[str, tuple[str, float, dict | None]] = {}
    for name in args.stages:
        build, fingerprint = STAGES[name]
        if args.from_assets and name != "tokenizer":
            adopt_assets(args, cfg, out)  # after the tokenizer stage, which it checks
        if args.force:
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.rmtree(out / f"{name}.work", ignore_errors=True)
        rec = stage_record(out, name)
        if rec is not None:
            try:
                now = fingerprint(cfg, args.seed, out)
            except FileNotFoundError as e:  # a stage this one was built from is gone
                raise UsageExit(f"argument --stages: '{name}' in {out} was built from {e.filename}, which is "
                                "missing; rebuild that stage or choose another --out") from None
            if rec["fingerprint"] != now:
                raise UsageExit(f"argument --out: {out / name} was built with another config "
                                 f"or seed; pass --force to rebuild it or choose another --out")
            results[name] = ("skipped (complete)", 0.0, rec["summary"])
            continue
        t0 = time.perf_counter()
        summary = build(args, cfg, out)
        results[name] = ("built" if summary else "interrupted", time.perf_counter() - t0, summary)
        if summary is None:
            break  # later stages need this one
    if args.from_assets and args.stages == ["tokenizer"]:
        adopt_assets(args, cfg, out)

    print(f"\n{'stage':<10} {'status':<19} {'wall':>8}  measured")
    for name, (status, wall, s) in results.items():
        print(f"{name:<10} {status:<19} {wall:>7.1f}s  " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in (s or {}).items() if k not in ("fp32_sha256", "torch")))
    return {name: s for name, (_, _, s) in results.items()}


if __name__ == "__main__":
    main()
