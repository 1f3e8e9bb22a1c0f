"""SGLang plugin entry point: ``sglang.srt.plugins`` → ``tev = "sglang_tev.srt.plugin:register"``.

SGLang's ``load_plugins()`` calls :func:`register` once in every process it starts (launcher,
scheduler, DP controller, detokenizer). It registers ``--speculative-algorithm TEV``; the
``--attention-backend tev_cpu`` choice (``cpu_attention``), with SGLang's CPU engine or when asked
for (:func:`wants_cpu_attention`); and ``HookRegistry`` hooks: request admission and the penalizer
state the per-node penalties read (``admission``), the per-round ``meta_info`` lists
(``meta_info``), the ``req_to_token`` row headroom
(``kv_headroom``), and the tree mask in the target's captured verify graph (``graphs``). The
worker module (heavy: the DFlash V2 worker) is imported only when the scheduler asks for the
worker class.
"""

from __future__ import annotations

import os

from .. import env as _env

__all__ = ["register", "ALGORITHM_NAME", "ENV_REFERENCE_ATTENTION", "wants_cpu_attention"]

ALGORITHM_NAME = "TEV"

ENV_REFERENCE_ATTENTION = _env.REFERENCE_ATTENTION
"""Set to ``1`` to register ``--attention-backend tev_cpu`` on a GPU machine too (a reference for
checking a mask layout against FlashInfer or Triton)."""


def wants_cpu_attention(environ=None) -> bool:
    """Whether the plugin registers ``tev_cpu``: with SGLang's CPU engine
    (``SGLANG_USE_CPU_ENGINE=1``, what ``--device cpu`` needs; SGLang reads it the same way,
    ``srt/platforms/__init__.py:50``) or when asked for with ``SGLANG_TEV_REFERENCE_ATTENTION=1``."""
    env = os.environ if environ is None else environ
    return env.get("SGLANG_USE_CPU_ENGINE", "0") == "1" or _env.get(ENV_REFERENCE_ATTENTION, env)


def register() -> None:
    """Register ``TEV`` with ``SpeculativeAlgorithm``; idempotent (a second call does nothing).

    Raises:
        ImportError when sglang is not installed (``pip install "sglang-tev[sglang]"``).
    """
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM_NAME) is not None:
        return
    # Unknown SGLANG_TEV_* names are refused by validate_server_args (the launch) and the worker,
    # not here: SGLang's load_plugins logs and swallows what register raises, which would leave
    # TEV unregistered and the launch failing on an unknown algorithm instead.
    from .admission import install_admission_hook
    from .algo import TevAlgo
    from .config import CPU_ATTENTION_BACKEND, validate_server_args
    from .cpu_attention import register_cpu_attention
    from .graphs import install_graph_hooks
    from .kv_headroom import install_row_headroom_hook
    from .meta_info import install_meta_info_hooks

    # req_to_token rows long enough for a decode step at the context edge (kv_headroom)
    install_row_headroom_hook()

    # decode CUDA graphs: the target's verify graph is captured with the tree mask (SGLang's
    # DFLASH-family capture leaves it out), the warm-up dummy states TEV's widths (graphs)
    install_graph_hooks()

    # per-request admission checks, and the penalizer state TEV's per-node penalties read
    # (admission: the hook on SamplingBatchInfo.copy_for_forward)
    install_admission_hook()

    # per-round meta_info lists complete on long and streamed requests (meta_info: SGLang slices
    # customized_info per output token; the round values are kept token-aligned, then compacted)
    install_meta_info_hooks()

    # --attention-backend tev_cpu: the pure-torch backend TEV uses with --device cpu; only where it
    # can be asked for (a GPU server's choices and attention registry stay SGLang's own)
    if wants_cpu_attention():
        register_cpu_attention(CPU_ATTENTION_BACKEND)

    # supports_overlap gates SGLang's deprecated-V1 warning and its overlap check
    # (spec_registry.py:137-150): the worker is on the V2 schema (a DFlashWorkerV2) and runs with
    # overlap scheduling on; TEV's resolution turns it off only where the KV reserve cannot cover
    # a lagging step (config.resolve_server_args, kv_headroom.overlap_reserve_need)
    @SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=TevAlgo,
    )
    def _worker_class(server_args):
        from .worker import TEVWorker

        return TEVWorker
