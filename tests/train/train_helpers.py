"""What the trainer tests of this folder share: the tiny target's sizes and special tokens, a
small training config (:func:`base_cfg`), the train log without wall-clock fields, and a two-rank
gloo run through torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

V, H, LAYERS, EOS, MASK = 128, 32, 3, 0, 1
REPO = Path(__file__).resolve().parents[2]


def base_cfg(root: Path, out: str, **kw) -> dict:
    cfg = {"target": str(root / "target"), "data": str(root / "train.npy"),
           "output_dir": str(root / out), "max_steps": 8, "seq_len": 32, "batch_size": 2,
           "num_anchors": 6, "block_size": 4, "lr": 3e-3, "threads": 1, "save_every": 2,
           "progress": False, "tensorboard": False,
           "draft": {"num_hidden_layers": 1, "intermediate_size": 48, "mask_token_id": MASK,
                     "target_layer_ids": [0, 2]}}
    cfg.update(kw)
    return cfg


def log_records(out: Path) -> list[dict]:
    """Train-log records without the wall-clock fields."""
    return [{k: v for k, v in json.loads(ln).items() if k != "tokens_per_s" and not k.startswith("ms_")}
            for ln in (out / "train_log.jsonl").read_text().splitlines()]


def torchrun_two_ranks(cfg: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m sglang_tev.train`` on ``cfg`` (gloo, 1 thread each)."""
    import yaml
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "sglang_tev.train", "--config", str(path)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
