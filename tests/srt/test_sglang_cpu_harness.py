"""The CPU harness's stand-ins for sgl_kernel ops (sglang_tev/testing/sglang_cpu/harness.py) against
independent computations: the KV move is on TEV's correctness path, the hash on seeded sampling's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang_tev.testing.sglang_cpu import harness as H
from sglang_tev.testing.sglang_cpu.hosts import require_sglang

pytestmark = pytest.mark.slow  # minutes here: scripts/run_tests.sh --fast leaves it out


def test_kv_copy_moves_rows_in_place_reading_every_source_first():
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randn(40, 2, 8, generator=g).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float32)]
    before = [b.clone() for b in bufs]
    # overlapping move: 7 <- 9, then 5 <- 7 (a row-by-row copy would read the new row 7)
    src = torch.tensor([9, 7, 3, 20])
    tgt = torch.tensor([7, 5, 4, 21])
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    H.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(bufs, before):
        want = old.clone()
        want[tgt] = old[src]
        assert torch.equal(b, want)


def test_token_pool_ops_match_a_loop():
    req_to_token = torch.full((4, 16), -1, dtype=torch.int32)
    idx, start, end = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([6, 2])
    locs = torch.tensor([10, 11, 12, 20, 21])
    H.assign_req_to_token_pool_cpu(idx, req_to_token, start, end, locs, 16)
    assert req_to_token[2, 3:6].tolist() == [10, 11, 12] and req_to_token[0, 0:2].tolist() == [20, 21]
    out = torch.empty(5, dtype=torch.int64)
    H.assign_extend_cache_locs_cpu(idx, req_to_token, start, end, out, 16)
    assert out.tolist() == [10, 11, 12, 20, 21]
    # a window past the row raises (SGLang's Triton kernels would run into the next row)
    with pytest.raises(IndexError, match=r"row 2 window \[14, 17\) ends past the row length 16"):
        H.assign_req_to_token_pool_cpu(torch.tensor([2]), req_to_token, torch.tensor([14]), torch.tensor([17]), locs[:3], 16)
    with pytest.raises(IndexError, match="assign_extend_cache_locs_cpu"):
        H.assign_extend_cache_locs_cpu(torch.tensor([2]), req_to_token, torch.tensor([14]), torch.tensor([17]), out[:3], 16)


def test_missing_kernel_raises_naming_itself():
    mod = H._StandInKernelModule("sgl_kernel")
    with pytest.raises(RuntimeError, match="sgl_kernel.fused_thing has no CPU stand-in"):
        mod.fused_thing(1)


def test_murmur_hash_equals_sglangs_triton_kernel():
    """The torch twin of SGLang's seeded-sampling hash equals SGLang's own Triton kernel run
    under the Triton interpreter (a subprocess: the flag must be set before import)."""
    require_sglang()
    code = f"""
import torch
from sglang_tev.testing.sglang_cpu import harness as H
from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32_kernel
seed = torch.tensor([0, 10001, 2**40 + 7, 2**63 - 5], dtype=torch.uint64)
pos = torch.tensor([0, 5, 100, 2**31 - 1])
col = torch.arange(70)
out = torch.empty((4, 70), dtype=torch.uint32)
murmur_hash32_kernel[(4, 2)](seed, pos, col, out, 4, 70, BLOCK_SIZE=64)
got = H.murmur_hash32_cpu(seed, pos, col)
assert got.dtype == torch.uint32
assert torch.equal(got.to(torch.int64), out.to(torch.int64))
H._register_torch_ops()
assert torch.equal(torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed, pos, col).to(torch.int64), out.to(torch.int64))
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_two_post_import_patches_of_one_module_both_run(tmp_path, monkeypatch):
    """Two finders patching one module (the step trace's and a CPU-gap patch of SGLang's model
    runner): each finds the module through the other, and both patches run, in finder order."""
    (tmp_path / "tev_two_patches_mod.py").write_text("ran = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = H.PostImport({"tev_two_patches_mod": lambda m: m.ran.append("first")})
    second = H.PostImport({"tev_two_patches_mod": lambda m: m.ran.append("second")})
    monkeypatch.setattr(sys, "meta_path", [first, second] + sys.meta_path)
    monkeypatch.delitem(sys.modules, "tev_two_patches_mod", raising=False)
    import tev_two_patches_mod

    assert tev_two_patches_mod.ran == ["second", "first"]  # the outer finder wraps the inner one's loader
    assert first._finding == second._finding == set()
    sys.modules.pop("tev_two_patches_mod", None)
