"""The drafter's context-KV writer for every layer at once (``sglang_tev/srt/draft_kv.py``) against
SGLang 0.5.23's own per-layer path (``DFlashAttention.kv_proj_only`` / ``apply_k_norm`` /
``apply_k_rope`` on SGLang's ``RMSNorm`` and ``get_rope``), and SGLang's fused Triton norm + RoPE
(what TEV now runs on CUDA) against the torch stages under the Triton interpreter.

SGLang's layers need its CPU engine flag before import, so the checks run in a subprocess with the
CPU harness installed (as tests/srt/test_sglang_cpu_harness.py does).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang_tev.testing.sglang_cpu.required import require_sglang

require_sglang()

pytestmark = pytest.mark.slow  # a subprocess importing SGLang: ~15 s

SCRIPT = r"""
import types, torch
from sglang_tev.testing.sglang_cpu import harness as H
H.install()
import sglang.srt.models.dflash as sg
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
from sglang_tev.srt.draft_kv import TorchStackedKV, install_context_kv_writer, stacked_kv_refusal

g = torch.Generator().manual_seed(0)
hidden, heads, kvh, d = 96, 4, 2, 32


def layer(rotary_dim=d, bias=False, k_scale=None):
    qkv = torch.nn.Module()
    qkv.weight = torch.nn.Parameter((torch.randn((heads + 2 * kvh) * d, hidden, generator=g) * 0.1).to(torch.bfloat16), requires_grad=False)
    qkv.bias = torch.zeros((heads + 2 * kvh) * d) if bias else None
    qkv.quant_method = UnquantizedLinearMethod()
    norm = RMSNorm(d, eps=1e-6)
    norm.weight.data = (1 + 0.3 * torch.randn(d, generator=g)).to(torch.bfloat16)
    rope = get_rope(d, rotary_dim=rotary_dim, max_position=512, base=10000, is_neox_style=True, dtype=torch.bfloat16)
    attn = types.SimpleNamespace(qkv_proj=qkv, q_size=heads * d, kv_size=kvh * d, v_scale=None, k_norm=norm, head_dim=d,
                                 num_kv_heads=kvh, rotary_emb=rope, attn=types.SimpleNamespace(k_scale=k_scale, v_scale=None))
    return types.SimpleNamespace(self_attn=attn)


A = sg.DFlashAttention
from sglang.kernels.ops.speculative.fused_kv_materialize import _fused_norm_rope_stacked
pos = torch.tensor([0, 1, 5, 9, 100, 200, 511])
x = torch.randn(7, hidden, generator=g).to(torch.bfloat16)
for rd in (d, d // 2):  # full and partial rotary
    layers = [layer(rd), layer(rd), layer(rd)]
    assert stacked_kv_refusal(types.SimpleNamespace(layers=layers)) is None
    st = TorchStackedKV(layers)
    k, v = st.kv(x, pos)
    assert k.shape == v.shape == (3, 7, kvh, d) and k.dtype == torch.bfloat16
    proj = torch.mm(x, st.weight_t).view(7, 3, 2, kvh * d)
    for i, l in enumerate(layers):
        a = l.self_attn
        kr, vr = A.kv_proj_only(a, x)  # SGLang's per-layer GEMM: equal up to the GEMM's blocking
        assert torch.allclose(torch.cat([kr, vr], -1).float(), proj[:, i].reshape(7, -1).float(), atol=1e-2, rtol=1e-2)
        # the norm and RoPE stages: SGLang's own, on the stacked GEMM's K: bit for bit
        kn = A.apply_k_rope(a, pos, A.apply_k_norm(a, proj[:, i, 0].contiguous())).view(7, kvh, d)
        assert torch.equal(k[i], kn), (rd, i, (k[i].float() - kn.float()).abs().max().item())
        assert torch.equal(v[i], proj[:, i, 1].reshape(7, kvh, d))
    seen = []
    st.materialize(ctx_hidden=x, positions=pos.to(torch.int32), write_layer_kv=lambda i, kk, vv: seen.append((i, kk, vv)))
    assert [i for i, _, _ in seen] == [0, 1, 2] and all(torch.equal(kk, k[i]) and torch.equal(vv, v[i]) for i, kk, vv in seen)
    st.materialize(ctx_hidden=x[:0], positions=pos[:0], write_layer_kv=lambda *a: seen.append(a))
    assert len(seen) == 3  # no tokens: no writes
    assert st.kv(x[:0], pos[:0])[0].shape == (3, 0, kvh, d)
    # SGLang's fused Triton norm + RoPE (the CUDA writer) under the interpreter: within one bf16 step
    kt, vt = _fused_norm_rope_stacked(proj.view(7, 3, -1), st.k_norm_weight.view(3, d), st.eps.view(3),
                                      layers[0].self_attn.rotary_emb.cos_sin_cache, pos, kvh, d, rd)
    assert torch.equal(vt, v)
    assert torch.allclose(kt.float(), k.float(), atol=2e-2, rtol=1e-2), (rd, (kt.float() - k.float()).abs().max().item())


# refusals name the layer and the reason; the worker then keeps SGLang's per-layer path
assert "bias" in stacked_kv_refusal(types.SimpleNamespace(layers=[layer(), layer(bias=True)]))
assert stacked_kv_refusal(types.SimpleNamespace(layers=[layer(), layer(k_scale=0.5)])).startswith("layer 1: k_scale")
assert "differ" in stacked_kv_refusal(types.SimpleNamespace(layers=[layer(), layer(d // 2)]))
assert "no layers" in stacked_kv_refusal(types.SimpleNamespace(layers=[]))
from sglang.srt.layers.layernorm import GemmaRMSNorm
gemma = layer()
gemma.self_attn.k_norm = GemmaRMSNorm(d, eps=1e-6)
assert "GemmaRMSNorm" in stacked_kv_refusal(types.SimpleNamespace(layers=[layer(), gemma]))
assert "supports_fused_context_kv" in stacked_kv_refusal(types.SimpleNamespace(layers=[layer()], supports_fused_context_kv=False))

worker = types.SimpleNamespace(draft_model=types.SimpleNamespace(layers=[layer(), layer()]), device="cpu")
assert install_context_kv_writer(worker) == "stacked (torch)"
assert worker._use_fused_kv_materialize and isinstance(worker._fused_kv_helper, TorchStackedKV)
worker = types.SimpleNamespace(draft_model=types.SimpleNamespace(layers=[layer(bias=True)]),
                               _use_fused_kv_materialize=True, _fused_kv_helper=object())
said = install_context_kv_writer(worker)
assert said.startswith("per-layer") and "bias" in said
assert worker._use_fused_kv_materialize is False and worker._fused_kv_helper is None
print("ok")
"""


def test_stacked_context_kv_equals_sglangs_per_layer_path_and_its_triton_kernel():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_smoke_script_requires_the_fused_writer_in_every_tev_mode():
    """``scripts/sglang_smoke.py`` (the GPU check) fails a TEV mode whose worker did not log SGLang's
    fused writer for the drafter's context KV, with graphs or without; other modes are not asked."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts/sglang_smoke.py"
    spec = importlib.util.spec_from_file_location("sglang_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    fused = "stacked (SGLang's fused Triton norm + RoPE)"

    def result(mode, writer, graphs):
        return dict(mode=mode, graphs=graphs, kv_writer=writer, replays={"target": 3 * graphs, "draft": 3 * graphs},
                    tev_head_folded=True, tiers_line="x", budgets_seen=[0, 4], tiers_replayed=[1, 5])

    for mode, graphs in (("TEV", True), ("TEV-eager", False), ("TEV-auto", True), ("TEV-auto-eager", False)):
        assert all(ok for ok, _ in smoke.graph_checks(result(mode, fused, graphs))), mode
        for bad in (None, "stacked (torch)", "per-layer (SGLang's path; ...)"):
            checks = smoke.graph_checks(result(mode, bad, graphs))
            assert [msg for ok, msg in checks if not ok] == [f"drafter context KV: {bad}"], (mode, bad)
    assert all(ok for ok, _ in smoke.graph_checks(result("DFLASH", None, True)))
    assert all(ok for ok, _ in smoke.graph_checks(result("none-eager", None, False)))
