"""Stand-ins that let SGLang 0.5.23's real Engine run on a CPU without CUDA (tests only).

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) expects ``sgl_kernel``'s CPU build (which needs
AVX-512/AMX) and has a few CUDA-only calls on the DFlash path. This module replaces exactly those,
nothing else; SGLang's scheduler, tokenizer manager, detokenizer, model runner, memory pools, radix
cache and sampling run as installed. Each stand-in names the SGLang line it serves (paths inside
the installed ``sglang`` package, version 0.5.23). Facts: ``../shared/notes/sglang-0.5.23-on-cpu.md``.

It is loaded in EVERY SGLang process: the scheduler and detokenizer are spawned, so the parent's
monkeypatches do not reach them. ``pythonpath/sitecustomize.py`` beside this module calls :func:`install` at
interpreter start when ``SGLANG_TEV_CPU_HARNESS=1``; put that ``pythonpath`` folder on ``PYTHONPATH``
(:func:`harness_env` returns such an environment). Installed files are never edited.

The attention backend is not here: it is a product module, ``sglang_tev.srt.cpu_attention``
(``--attention-backend tev_cpu``, a pure-torch backend that applies tree masks), registered by the
plugin in every SGLang process. So is the DFlash drafter's CPU fallback for its fused q/k-norm +
RoPE kernel (``sglang_tev.srt.worker``), which TEV needs on any CPU; the patch below serves
SGLang's own DFLASH worker, the reference these tests compare with.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

from sglang_tev import env as tev_env

ENV_FLAG = tev_env.CPU_HARNESS
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pythonpath")  # sitecustomize.py
_installed = False


# ---------------------------------------------------------------------- sgl_kernel's CPU ops
def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """Stand-in for sgl_kernel's op behind ``MHATokenToKVPool.move_kv_cache``.

    Serves ``sglang/kernels/ops/kvcache/cache_move.py:191`` (``copy_all_layer_kv_cache_func`` on
    CPU), reached from ``srt/mem_cache/memory_pool.py`` ``move_kv_cache`` (TEV's commit moves the
    accepted path's KV to the front of each window) and its warm-up at ``memory_pool.py:2420``.

    Args:
        data_ptrs: int64 [L]: raw address of each K/V buffer (every layer, K and V).
        strides: int64 [L]: bytes per token row of each buffer.
        tgt_loc, src_loc: int [n] token slots; row ``tgt_loc[i]`` takes row ``src_loc[i]``.
    Every source row is read before any row is written, so overlapping in-place moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).cpu()
    tgt = tgt_loc.to(torch.int64).cpu()
    rows = int(max(int(src.max()), int(tgt.max()))) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        view = torch.frombuffer(buf, dtype=torch.uint8).view(rows, int(stride))
        view[tgt] = view[src].clone()


def _windows(req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor, pool_len: int, op: str):
    """(pool row, start, end, slice of the packed per-request layout) per request, in order.

    A window that ends past the row (``end > pool_len``) raises ``IndexError`` naming the op and
    the numbers: SGLang's Triton kernels (``srt/mem_cache/allocation.py:690-722``,
    ``kernels/ops/speculative/cache_locs.py:499-531``) mask their stores and loads with ``end`` only, not
    with the row length, so on CUDA such a window would run into the next request's row."""
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(e) - int(s)
        if int(e) > pool_len:
            raise IndexError(
                f"{op}: req_to_token row {int(r)} window [{int(s)}, {int(e)}) ends past the row length "
                f"{pool_len} (sglang_tev/testing/sglang_cpu/harness.py stand-in)"
            )
        yield int(r), int(s), int(e), slice(pos, pos + n)
        pos += n


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Stand-in: ``req_to_token[r, start:end] = out_cache_loc[packed]`` per request, in order.

    Serves ``srt/mem_cache/allocation.py:746`` (``assign_req_to_token_pool_func`` on CPU), called
    by ``srt/speculative/dflash_info_v2.py:197`` (``prepare_for_decode``) and by extend allocation.
    """
    pool_len = int(req_to_token.shape[1])
    for r, s, e, packed in _windows(req_pool_indices, start_offset, end_offset, pool_len, "assign_req_to_token_pool_cpu"):
        req_to_token[r, s:e] = out_cache_loc[packed].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    *rest,
) -> None:
    """Stand-in: ``out_cache_loc[packed] = req_to_token[r, start:end]`` per request, in order.

    Serves ``sglang/kernels/ops/speculative/cache_locs.py`` (``assign_extend_cache_locs_func``'s
    CPU branch), which the DFlash draft block and TEV's tree window use to find their KV slots.
    """
    pool_len = int(req_to_token.shape[1])
    for r, s, e, packed in _windows(req_pool_indices, start_offset, end_offset, pool_len, "assign_extend_cache_locs_cpu"):
        out_cache_loc[packed] = req_to_token[r, s:e].to(out_cache_loc.dtype)


_M32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _rotl32((k * 0xCC9E2D51) & _M32, 15)
    k = (k * 0x1B873593) & _M32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """Stand-in for ``torch.ops.sgl_kernel.murmur_hash32_cpu``: the torch twin of SGLang's Triton
    ``murmur_hash32_kernel`` (``sglang/kernels/ops/sampling/murmur_hash.py:52-102``: seed low /
    high word, position, column mixed in that order, length 16, fmix32).

    Serves ``murmur_hash.py:115``, called by ``srt/layers/sampler.py:958`` (``multinomial_with_seed``):
    SGLang's seeded sampling under deterministic inference (per-request ``sampling_seed``).

    Args:
        seed: uint64/int64 [n]; positions: int [n]; col_indices: int [m].
    Returns:
        uint32 [n, m]. int64 arithmetic masked to 32 bits (products wrap modulo 2^64, which keeps
        the low 32 bits exact).
    """
    s = seed.to(torch.int64).view(-1, 1)
    h = torch.zeros_like(s)
    h = _murmur3_mix(h, s & _M32)
    h = _murmur3_mix(h, (s >> 32) & _M32)
    h = _murmur3_mix(h, positions.to(torch.int64).view(-1, 1) & _M32)
    h = _murmur3_mix(h, col_indices.to(torch.int64).view(1, -1) & _M32)
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


_op_library = None


def _register_torch_ops() -> None:
    """``torch.ops.sgl_kernel.*`` ops SGLang calls on CPU (the real ones live in sgl_kernel's CPU
    build): ``murmur_hash32_cpu`` (above)."""
    global _op_library
    if _op_library is not None or hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return
    _op_library = torch.library.Library("sgl_kernel", "FRAGMENT")
    _op_library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    _op_library.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")


_IMPLEMENTED = {
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
}


class _StandInKernelModule(types.ModuleType):
    """``sgl_kernel`` (or a submodule): the three ops above; any other name is a callable that
    raises naming itself, so an unexpected kernel on the tested path fails loudly, never silently."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _IMPLEMENTED:
            return _IMPLEMENTED[name]

        def _missing(*args, **kwargs):
            raise RuntimeError(
                f"{self.__name__}.{name} has no CPU stand-in (sglang_tev/testing/sglang_cpu/harness.py); "
                "the test took a path that needs sgl_kernel"
            )

        _missing.__name__ = name
        return _missing


class _KernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: ``sgl_kernel`` resolves to :class:`_StandInKernelModule`; its submodules do not
    import (ImportError), so SGLang's own fallbacks for them apply (e.g. the mock scalar types at
    ``srt/layers/quantization/utils.py:26-43``).

    Serves ``kernels/ops/kvcache/cache_move.py:10`` and ``srt/mem_cache/allocation.py:46`` (imports
    at import time) and every other ``from sgl_kernel import ...``: the installed CUDA wheel does
    not load without ``libcuda.so.1``.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname.startswith("sgl_kernel."):
            raise ImportError(f"{fullname}: no CPU stand-in (sglang_tev/testing/sglang_cpu/harness.py)", name=fullname)
        return None

    def create_module(self, spec):
        mod = _StandInKernelModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0+tev-cpu-stand-in"
        return mod

    def exec_module(self, module):
        return None


# ---------------------------------------------------------------------- SGLang CPU gaps
class PostImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a named module is imported (the module is found as usual). Two
    finders may patch one module: each asks the others, and one already asking answers None."""

    def __init__(self, patches):
        self.patches = dict(patches)
        self._finding = set()

    def find_spec(self, fullname, path=None, target=None):
        patch = self.patches.get(fullname)
        if patch is None or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding.discard(fullname)
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module, _orig=orig_exec, _patch=patch):
            _orig(module)
            _patch(module)

        spec.loader = _PatchedLoader(loader, exec_module)
        return spec


class _PatchedLoader(importlib.abc.Loader):
    def __init__(self, loader, exec_module):
        self._loader = loader
        self._exec = exec_module

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._exec(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _patch_speculative_hook(mod) -> None:
    """``srt/arg_groups/speculative_hook.py:291-301`` (``_handle_dflash``) refuses DFLASH-family
    algorithms unless the device is cuda/npu/xpu; on ``--device cpu`` the check is answered yes
    (the rest of ``_handle_dflash`` runs unchanged).

    The answer comes from a platform that calls itself out-of-tree for the duration of the call,
    so ``_resolve_dflash_draft_attention_backend`` (``speculative_hook.py:886-987``, called from
    ``_handle_dflash`` at line 436) asks that platform too: which draft backends it supports
    (lines 897-900) and, when the target's backend is not one of them, which one to fall back to
    (lines 904-922). Both are answered as the in-tree branch answers them, except for the
    fallback: the in-tree one is FlashInfer (lines 923-928), which is CUDA-only, so on a CPU it is
    ``tev_cpu``, the one draft backend that runs here."""
    orig = mod._handle_dflash

    class _CpuCanDflash:
        def __init__(self, real):
            self._real = real

        def is_out_of_tree(self):
            return True

        def supports_speculative_algorithm(self, algorithm):
            return True

        def supports_speculative_draft_attention_backend(self, algorithm, backend):
            # the in-tree rule, speculative_hook.py:901: any name in the draft choices
            from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

            return backend in DRAFT_ATTENTION_BACKEND_CHOICES

        def get_default_speculative_draft_attention_backend(self, algorithm):
            return "tev_cpu"

        def __getattr__(self, name):
            return getattr(self._real, name)

    def _handle_dflash(server_args):
        if str(mod.resolving_view(server_args).device) != "cpu":
            return orig(server_args)
        real = mod.current_platform
        mod.current_platform = _CpuCanDflash(real)
        try:
            return orig(server_args)
        finally:
            mod.current_platform = real

    mod._handle_dflash = _handle_dflash


def _patch_dflash_model(mod) -> None:
    """``srt/models/dflash.py:383-388`` runs the Triton kernel ``table_qk_norm_rope_`` in bf16
    without a CPU guard; the flag set at ``dflash.py:283`` is turned off after construction, which
    selects the unfused torch path of the same computation."""
    cls = mod.DFlashAttention
    orig_init = cls.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        self.use_table_qk_norm_rope = False

    cls.__init__ = __init__

    # ``srt/models/dflash.py:66-70`` (``_radix_topk``, the DFlash2 selector's candidate top-k via
    # ``candidate_topk`` -> ``compute_candidates``, :1293-1302) calls FlashInfer's top-k whenever
    # flashinfer imports, without a device guard; this machine has the CUDA wheel, whose top-k
    # raises "device must be a cuda device" on CPU tensors. CPU tensors take SGLang's own fallback
    # branch of the same function (``torch.topk(scores, k, dim=-1)``, line 70); CUDA tensors keep
    # the original.
    radix_topk = mod._radix_topk

    def _radix_topk(scores, k):
        if scores.device.type == "cpu":
            return torch.topk(scores, k, dim=-1)
        return radix_topk(scores, k)

    mod._radix_topk = _radix_topk


def _patch_record_stream() -> None:
    """``srt/speculative/dflash_worker_v2.py:2481`` calls ``Tensor.record_stream`` on the batch's
    ``seq_lens``, which raises for CPU tensors; on CPU there are no streams to record, so it is a
    no-op there (CUDA tensors keep torch's method)."""
    orig = torch.Tensor.record_stream
    if getattr(orig, "_tev_cpu", False):
        return

    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None
        return orig(self, stream)

    record_stream._tev_cpu = True
    torch.Tensor.record_stream = record_stream


def _patch_choices(mod) -> None:
    """``srt/arg_groups/overrides.py:1092-1120`` (``_deterministic_attention_backend``) refuses
    ``--enable-deterministic-inference`` with any backend outside
    ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES`` (``choices.py:113``). Deterministic mode is what
    carries a request's ``sampling_seed`` into ``SamplingBatchInfo`` (``sampling_batch_info.py:157``),
    which the seeded-sampling tests need; ``tev_cpu`` is added to that list here, in the tests
    only: the backend makes no batch-invariance claim."""
    if "tev_cpu" not in mod.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        mod.add_deterministic_attention_backend_choices(["tev_cpu"])


def _patch_model_runner(mod) -> None:
    """``srt/model_executor/model_runner.py:842-846`` (``maybe_enable_batch_invariant_mode``) turns
    on SGLang's batch-invariant CUDA/XPU kernels under deterministic inference and raises on a CPU
    (``utils/common.py:628``). On a CPU runner it is skipped: these tests use deterministic mode
    for its per-request ``sampling_seed`` (SGLang's seeded multinomial and TEV's seeded
    uniforms), not for batch invariance."""
    cls = mod.ModelRunner
    orig = cls.maybe_enable_batch_invariant_mode

    def maybe_enable_batch_invariant_mode(self):
        if torch.device(self.device).type == "cpu":
            return None
        return orig(self)

    cls.maybe_enable_batch_invariant_mode = maybe_enable_batch_invariant_mode


def _patch_pynccl_wrapper(mod) -> None:
    """``srt/distributed/device_communicators/pynccl.py:73-79`` builds a PyNccl communicator for
    every TP group of size > 1 and disables it only when ``NCCLLibrary`` cannot be loaded ("e.g.
    in a non-GPU environment"). With this machine's CUDA build of torch, ``find_nccl_library``
    (``pynccl_wrapper.py:39-65``) names ``libnccl.so.2``, which loads, and the constructor then
    fails at ``pynccl.py:116`` (``torch.cuda.device(cpu)``: "Expected a cuda device, but got:
    cpu"). On a CPU-only torch build the same function raises ``ValueError`` (no
    ``torch.version.cuda``, line 63) and PyNccl is disabled; the harness answers as that build
    does, so TP groups on ``--device cpu`` all-reduce through torch.distributed (gloo), SGLang's
    own CPU path. CUDA processes are not affected (the harness runs only on CPU engines)."""
    orig = mod.find_nccl_library

    def find_nccl_library():
        if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
            raise ValueError("NCCL only supports CUDA, ROCm and MUSA backends.")
        return orig()

    mod.find_nccl_library = find_nccl_library


def install() -> None:
    """Install every stand-in in this process; idempotent. Sets ``SGLANG_USE_CPU_ENGINE=1``."""
    global _installed
    if _installed:
        return
    _installed = True
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if "sgl_kernel" not in sys.modules:
        sys.meta_path.insert(0, _KernelFinder())
    sys.meta_path.insert(
        0,
        PostImport(
            {
                "sglang.srt.arg_groups.speculative_hook": _patch_speculative_hook,
                "sglang.srt.models.dflash": _patch_dflash_model,
                "sglang.srt.arg_groups.choices": _patch_choices,
                "sglang.srt.model_executor.model_runner": _patch_model_runner,
                "sglang.srt.distributed.device_communicators.pynccl_wrapper": _patch_pynccl_wrapper,
            }
        ),
    )
    _patch_record_stream()
    _register_torch_ops()


def harness_env(base=None) -> dict:
    """A copy of ``base`` (default ``os.environ``) that installs the harness in every process
    started with it: ``SGLANG_TEV_CPU_HARNESS=1``, ``SGLANG_USE_CPU_ENGINE=1`` and the
    ``pythonpath`` folder beside this module first on ``PYTHONPATH`` (for ``sitecustomize``)."""
    env = dict(os.environ if base is None else base)
    env[ENV_FLAG] = "1"
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [SITE_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
