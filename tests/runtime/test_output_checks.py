"""Output folders are checked before any work (sglang_tev/paths.py), by the CLI and the trainer alike."""

import subprocess
import sys

import pytest

from sglang_tev.paths import creatable_dir_problem
from sglang_tev.train.config import ConfigError, load_config


def test_creatable_dir_problem(tmp_path):
    assert creatable_dir_problem(tmp_path / "new" / "deeper") is None
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
    (tmp_path / "f").write_text("x")
    assert "is not a directory" in creatable_dir_problem(tmp_path / "f")
    assert "is not a directory" in creatable_dir_problem(tmp_path / "f" / "sub")
    assert "cannot create folders under /proc" in creatable_dir_problem("/proc/sglang-tev-x")


def _cfg(tmp_path, **over):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "def f(x):\\n    return x\\n"}\n')
    run = tmp_path / "run.yaml"
    run.write_text(f"target: unused-before-load\noutput_dir: {tmp_path / 'out'}\nmax_steps: 2\ndata: {data}\n")
    return run, [f"{k}={v}" for k, v in over.items()]


def test_train_output_dir_is_probed_before_data(tmp_path):
    run, over = _cfg(tmp_path, output_dir="/proc/sglang-tev-x")
    with pytest.raises(ConfigError, match="output_dir.*cannot create folders under /proc"):
        load_config(run, over)
    run, over = _cfg(tmp_path)
    assert load_config(run, over).output_dir == str(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # validating creates nothing


def test_print_config_says_what_a_null_warmup_means(tmp_path):
    run, over = _cfg(tmp_path, max_steps=100)
    out = subprocess.run([sys.executable, "-m", "sglang_tev.train", "--config", str(run), *over, "--print-config"],
                         capture_output=True, text=True, check=True).stdout
    assert "warmup_ratio: null" in out and "-> 4 steps (ratio 0.04 of max_steps)" in out
