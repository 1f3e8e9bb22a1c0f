"""TEV settings for SGLang: read from existing server args and ``SGLANG_TEV_*`` variables.

SGLang 0.5.23 has no plugin-owned CLI flags (``ServerArgs`` is a fixed msgspec struct), so TEV
rides on existing fields (``../shared/notes/sglang-0.5.23-internals.md`` §1.5)::

    --speculative-num-draft-tokens  N = B + 1   tree size: the root plus a budget of B drafted nodes
    --speculative-dflash-block-size K           drafter block (default: the drafter's config)
    --speculative-num-steps         D           max tree depth (default K - 1; 1 <= D <= K - 1)
    SGLANG_TEV_VERIFIER             tev | predraw | sequential   (default tev)
    SGLANG_TEV_TOPK                 k           per-depth list width of DDTree (default B)
    SGLANG_TEV_DFLASH2_MODE         lattice | marginal   DFlash2 drafters only (default: lattice
                                                when the checkpoint has a selector; ``srt/dflash2.py``)
    SGLANG_TEV_BUDGET               fixed | auto (default fixed; ``srt/budget.py``)

The variables are declared and parsed in :mod:`sglang_tev.env` (``docs/env.md``).

This module does not import sglang: :func:`resolve_server_args` works on any object with the
``ServerArgs`` attribute names, in particular the ``_ForeignDefaults`` stand-in SGLang hands to a
plugin's ``handle_server_args``, where plain attribute writes to real fields become resolution
declarations (writes to non-fields are dropped, so nothing else is stored there).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from .. import env as _env
from .graph_tiers import tier_sizes
from .kv_headroom import overlap_reserve_need

__all__ = [
    "TevSettings",
    "VERIFIERS",
    "SUPPORTED_ATTENTION_BACKENDS",
    "CPU_ATTENTION_BACKEND",
    "SUPPORTED_DEVICE_BACKENDS",
    "DECODE_GRAPH_BACKENDS",
    "RAGGED_VERIFY_BACKENDS",
    "verify_layout_for",
    "MAX_TREE_SIZE",
    "DEFAULT_TREE_SIZE",
    "read_env",
    "DFLASH2_MODES",
    "read_dflash2_mode",
    "validate_server_args",
    "resolve_server_args",
    "settings_from_server_args",
]

logger = logging.getLogger(__name__)


SUPPORTED_ATTENTION_BACKENDS = ("triton", "flashinfer")
"""CUDA backends that apply ``spec_info.custom_mask`` on TARGET_VERIFY, eager and in the target's
captured verify graph (captured with the mask by ``graphs``; notes §1.3). Triton is the default:
its replay copies the mask into the static ``verify_mask`` buffer without a host sync
(``triton_backend.py:592-653``). FlashInfer is accepted: a wrapper captured with a mask is
re-planned with the live mask at every replay (``plan()`` packs it into ``custom_mask_buf``,
``flashinfer_backend.py:2395-2413``; a mask-less plan on it raises, ``:2332-2345``), at the cost of
about three blocking device-to-host reads per replay (``:874-879``; the sync-free
``fast_prefill_plan`` is for mask-less DFLASH verifies only, ``:860-885``). FA3 ignores the mask
unless ``speculative_eagle_topk > 1`` (``flashattention_backend.py:223``) and then reads it in its
own cascade layout; it is refused rather than silently verifying a tree with a causal mask."""

RAGGED_VERIFY_BACKENDS = ("tev_cpu", "flashinfer")
"""Backends whose eager TARGET_VERIFY takes SGLang's ``RaggedVerifyLayout`` with a custom mask
(per-request verify lengths in one forward): this project's CPU backend (tested), and FlashInfer,
whose verify plan reads the layout's ``qo_indptr`` and per-request mask segments from the verify
input (``DFlashVerifyInput.generate_attn_arg_prefill``, ``dflash_info.py:135-215``; not run on a
GPU here). Triton builds a uniform ``qo_indptr`` from the verify width (``triton_backend.py:1007-1057``):
there ``SGLANG_TEV_BUDGET=auto-ragged`` keeps one width per round for the batch."""


_RAGGED_VERIFY_CLASSES = ("TorchCPUAttnBackend", "FlashInferAttnBackend")  # the backends' classes, by name


def verify_layout_for(attn_backend) -> str:
    """``"ragged"`` when the target's attention backend object (SGLang's ``model_runner.attn_backend``;
    a hybrid one's prefill and decode backends both) is one of :data:`RAGGED_VERIFY_BACKENDS`
    (each request's tree verified at its own size), else ``"padded"`` (one width per round for the
    batch). Read from the object, not the server args: a worker's copy of them may not carry the
    backend the plugin resolved."""
    parts = [getattr(attn_backend, "prefill_backend", None), getattr(attn_backend, "decode_backend", None)]
    parts = [p for p in parts if p is not None] or [attn_backend]
    return "ragged" if all(type(p).__name__ in _RAGGED_VERIFY_CLASSES for p in parts) else "padded"


DECODE_GRAPH_BACKENDS = {"cuda": ("full", "breakable", "disabled"), "cpu": ("disabled",)}
"""``--device`` -> the ``--cuda-graph-backend-decode`` values TEV accepts there. On CUDA both
capture backends run SGLang's ``DecodeCudaGraphRunner``, whose target verify capture carries the
tree mask for TEV (``graphs``); the default (SGLang's: full) is kept. On CPU SGLang has no graph
runner for speculative decoding (``CPUGraphRunner`` asserts a non-speculative algorithm,
``cpu_graph_runner.py:663-664``), so TEV's decode graphs stay off there."""

CPU_ATTENTION_BACKEND = "tev_cpu"
"""The one backend TEV accepts with ``--device cpu``: this project's pure-torch reference backend
(``sglang_tev.srt.cpu_attention``, registered by the plugin), which applies the tree mask."""

SUPPORTED_DEVICE_BACKENDS = {"cuda": SUPPORTED_ATTENTION_BACKENDS, "cpu": (CPU_ATTENTION_BACKEND,)}
"""``--device`` -> attention backends TEV accepts there (the first is chosen when none is given)."""


_UNSERVED = {
    "enable_custom_logit_processor": "a custom logit processor sees one row per tree node with the committed "
    "history only, so its output along a tree path is not what plain decoding would compute",
    "enable_return_hidden_states": "TEV does not return the target's hidden states of the accepted path",
    "return_hidden_states_mode": "TEV does not return the target's hidden states of the accepted path",
    "enable_lora": "the DFlash drafter and the tree verify forward run without LoRA adapters",
    "lora_paths": "the DFlash drafter and the tree verify forward run without LoRA adapters",
}


def _combinations() -> str:
    return "; ".join(f"--device {d} with --attention-backend {' or '.join(b)}" for d, b in SUPPORTED_DEVICE_BACKENDS.items())

from ..spec import SERVED_VERIFIERS as VERIFIERS  # noqa: E402  (SGLANG_TEV_VERIFIER's choices)
from ..spec import SGLANG_MAX_TREE_SIZE as MAX_TREE_SIZE  # noqa: E402  (N <= 1024: SGLang's tree kernels)

DEFAULT_TREE_SIZE = 65
"""N when ``--speculative-num-draft-tokens`` is not given: a budget of B = 64 drafted nodes."""

ENV_VERIFIER = _env.VERIFIER
ENV_TOPK = _env.TOPK
ENV_DFLASH2_MODE = _env.DFLASH2_MODE
ENV_BUDGET = _env.BUDGET
ENV_GRAPH_TREE_SIZES = _env.GRAPH_TREE_SIZES

DFLASH2_MODES = _env.DFLASH2_MODES
"""Draft modes of a DFlash2 drafter (``SGLANG_TEV_DFLASH2_MODE``): the selector lattice into a
lattice tree, or the transformed full-vocabulary marginals into DDTree (selector ignored)."""


@dataclass(frozen=True)
class TevSettings:
    """Resolved TEV settings of one server.

    Attributes:
        tree_size: N = B + 1 nodes per request (root included); ``speculative_num_draft_tokens``.
        block_size: K, the drafter's block (root + K - 1 mask slots); ``speculative_dflash_block_size``.
        max_depth: D, deepest drafted node, 1 <= D <= K - 1; ``speculative_num_steps``.
        topk: k, per-depth list width of the DDTree builder.
        verifier: one of :data:`VERIFIERS`.
        budget_mode: ``fixed`` (N - 1 nodes every round), ``auto`` (one width per round for the
            batch, at most N - 1, from the planner) or ``auto-ragged`` (``auto``, each request's
            tree cut to its own size where the attention backend takes ragged verifies);
            ``SGLANG_TEV_BUDGET``.
    """

    tree_size: int
    block_size: int
    max_depth: int
    topk: int
    verifier: str
    budget_mode: str = "auto"

    @property
    def budget(self) -> int:
        """B = N - 1, drafted (non-root) nodes per tree."""
        return self.tree_size - 1


def _as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"TEV: {name} must be an integer, got {value!r}")
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"TEV: {name} must be an integer, got {value!r}") from None
    if isinstance(value, float) and out != value:
        raise ValueError(f"TEV: {name} must be an integer, got {value!r}")
    return out


def read_env(environ: Optional[Mapping[str, str]] = None) -> tuple[str, Optional[int]]:
    """Read ``SGLANG_TEV_VERIFIER`` and ``SGLANG_TEV_TOPK``.

    Returns:
        (verifier, topk or None when unset).
    Raises:
        :class:`~sglang_tev.env.EnvError` (a ValueError) naming the variable: a verifier outside
        :data:`VERIFIERS`, a top-k that is not an integer >= 1 (parsed by :mod:`sglang_tev.env`).
    """
    return _env.get(ENV_VERIFIER, environ), _env.get(ENV_TOPK, environ)


def read_dflash2_mode(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Read ``SGLANG_TEV_DFLASH2_MODE``.

    Returns:
        One of :data:`DFLASH2_MODES`, or None when unset or empty (the drafter decides:
        ``srt/dflash2.resolve_draft_serving``).
    Raises:
        :class:`~sglang_tev.env.EnvError` (a ValueError) naming the variable for any other value.
    """
    return _env.get(ENV_DFLASH2_MODE, environ)


def _backends(sa) -> tuple[Optional[str], Optional[str]]:
    """(prefill, decode) attention backends, split fields falling back to ``attention_backend``."""
    base = getattr(sa, "attention_backend", None)
    prefill = getattr(sa, "prefill_attention_backend", None) or base
    decode = getattr(sa, "decode_attention_backend", None) or base
    return prefill, decode


def _raw(sa, name: str):
    """The operator's raw input for ``name`` (None when SGLang has not snapshotted it)."""
    raw = getattr(sa, "_raw_input", None)
    return raw.get(name) if isinstance(raw, dict) else getattr(sa, name, None)


def _device_kind(sa) -> str:
    """``cuda`` or ``cpu`` from ``--device`` (unset = cuda, SGLang's default on a GPU machine).

    Raises:
        ValueError naming ``--device`` and the accepted device/backend combinations otherwise.
    """
    device = getattr(sa, "device", None)
    kind = "cuda" if device is None else str(device).split(":")[0]
    if kind not in SUPPORTED_DEVICE_BACKENDS:
        raise ValueError(f"TEV: --device {device!r} is not supported; accepted: {_combinations()}")
    return kind


def validate_server_args(sa, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse combinations TEV does not support, one clear ValueError each.

    Runs as the algorithm's ``validate_server_args`` (before :func:`resolve_server_args`) on the
    stand-in SGLang passes; reads only.

    Raises:
        ValueError naming the flag or variable: an ``SGLANG_TEV_*`` name that :mod:`sglang_tev.env`
        does not know (the closest known one suggested); a bad ``SGLANG_TEV_*`` value (``SGLANG_TEV_DFLASH2_MODE``
        included; the drafter's DFlash2 features are checked when the worker loads it,
        ``srt/dflash2.resolve_draft_serving``); a device other than
        ``cuda`` / ``cpu``; ``--device cpu`` without ``SGLANG_USE_CPU_ENGINE=1``; ``--pp-size`` != 1; attention data parallelism; PD disaggregation; no ``--speculative-draft-model-path``;
        a tree size N outside [2, 1024]; an explicitly chosen attention backend (target prefill /
        decode or draft) that the device does not pair with in :data:`SUPPORTED_DEVICE_BACKENDS`
        (the message lists the accepted combinations); a ``--cuda-graph-backend-decode`` outside
        :data:`DECODE_GRAPH_BACKENDS` for the device (on CPU: anything but disabled) and
        ``--enable-torch-compile`` on CPU (both would ask SGLang's CPU graph runner, which has no
        speculative path); ``--speculative-eagle-topk`` other than 1;
        ``--speculative-draft-window-size`` (compact draft cache); rejection sampling or block
        verification (TEV is its own exact verifier); accept thresholds other than 1; custom logit
        processors, hidden-state return and LoRA (``--enable-custom-logit-processor``,
        ``--enable-return-hidden-states`` / ``--return-hidden-states-mode``, ``--enable-lora`` /
        ``--lora-paths``). Per-request options are checked at admission (``admission``).
    """
    _env.check_environment(environ)  # an unknown SGLANG_TEV_* name (a typo) stops the launch here
    read_env(environ)
    read_dflash2_mode(environ)
    _env.get(ENV_BUDGET, environ)  # a bad SGLANG_TEV_BUDGET is refused here, before any write
    requested = _env.get(ENV_GRAPH_TREE_SIZES, environ)
    device_kind = _device_kind(sa)
    if int(getattr(sa, "pp_size", 1) or 1) != 1:
        raise ValueError(f"TEV: --pp-size must be 1, got {sa.pp_size}")
    if int(getattr(sa, "attn_dp_size", 1) or 1) > 1 or bool(getattr(sa, "enable_dp_attention", False)):
        raise ValueError("TEV: attention data parallelism (--attn-dp-size > 1 / --enable-dp-attention) is not supported")
    mode = getattr(sa, "disaggregation_mode", None)
    if mode not in (None, "null"):
        raise ValueError(f"TEV: --disaggregation-mode {mode!r} (prefill/decode disaggregation) is not supported")
    if getattr(sa, "speculative_draft_model_path", None) is None:
        raise ValueError("TEV: --speculative-draft-model-path is required (a DFlash drafter)")
    n = getattr(sa, "speculative_num_draft_tokens", None)
    if n is not None:
        n = _as_int("--speculative-num-draft-tokens", n)
        if not 2 <= n <= MAX_TREE_SIZE:
            raise ValueError(
                f"TEV: --speculative-num-draft-tokens is the tree size N = B + 1 and must be in [2, {MAX_TREE_SIZE}], got {n}"
            )
    if requested:  # a tier above N is refused on every device, before any write
        tier_sizes(DEFAULT_TREE_SIZE if n is None else n, requested)
    accepted = SUPPORTED_DEVICE_BACKENDS[device_kind]
    for flag, name in (
        ("--attention-backend", "attention_backend"),
        ("--prefill-attention-backend", "prefill_attention_backend"),
        ("--decode-attention-backend", "decode_attention_backend"),
        ("--speculative-draft-attention-backend", "speculative_draft_attention_backend"),
    ):
        explicit = _raw(sa, name)
        if explicit is not None and explicit not in accepted:
            raise ValueError(
                f"TEV: {flag} {explicit!r} on --device {device_kind}: TEV needs a backend that applies the tree mask "
                f"on target verify (eager and in a captured CUDA graph); accepted: {_combinations()}"
            )
    graph = _raw(sa, "cuda_graph_backend_decode")
    if graph is not None and str(graph) not in DECODE_GRAPH_BACKENDS[device_kind]:
        raise ValueError(
            f"TEV: --cuda-graph-backend-decode {graph!r} on --device {device_kind}: accepted there: "
            f"{', '.join(DECODE_GRAPH_BACKENDS[device_kind])}"
            + (" (SGLang has no CPU graph runner for speculative decoding, cpu_graph_runner.py:663)" if device_kind == "cpu" else "")
        )
    if device_kind == "cpu" and bool(_raw(sa, "enable_torch_compile")):
        raise ValueError(
            "TEV: --enable-torch-compile on --device cpu would capture SGLang's CPU graph runner, which has no "
            "speculative path (cpu_graph_runner.py:663); leave it off"
        )
    env = os.environ if environ is None else environ
    if device_kind == "cpu" and env.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        raise ValueError(
            "TEV: --device cpu runs on SGLang's CPU engine: set SGLANG_USE_CPU_ENGINE=1, with sgl-kernel's CPU build "
            "installed (it needs a CPU with AVX-512/AMX; see docs/sglang.md, 'SGLang on a CPU')"
        )
    for flag, name, off in (
        ("--enable-custom-logit-processor", "enable_custom_logit_processor", (None, False)),
        ("--enable-return-hidden-states", "enable_return_hidden_states", (None, False)),
        ("--return-hidden-states-mode", "return_hidden_states_mode", (None, "none", "disabled")),
        ("--enable-lora", "enable_lora", (None, False)),
        ("--lora-paths", "lora_paths", (None, [], (), {})),
    ):
        value = _raw(sa, name)
        if value not in off:
            raise ValueError(
                f"TEV: {flag} is not supported: {_UNSERVED[name]}; serve these requests without speculative decoding"
            )
    topk = getattr(sa, "speculative_eagle_topk", None)
    if topk is not None and int(topk) != 1:
        raise ValueError(f"TEV: --speculative-eagle-topk must be 1 or unset (SGLANG_TEV_TOPK sets the DDTree width), got {topk}")
    if getattr(sa, "speculative_draft_window_size", None) is not None:
        raise ValueError("TEV: --speculative-draft-window-size (compact draft KV cache) is not supported")
    if bool(getattr(sa, "speculative_use_rejection_sampling", False)):
        raise ValueError("TEV: --speculative-use-rejection-sampling does not apply; TEV is its own exact verifier")
    if bool(getattr(sa, "speculative_use_block_verification", False)):
        raise ValueError("TEV: --speculative-use-block-verification does not apply; TEV is its own exact verifier")
    for flag, name in (
        ("--speculative-accept-threshold-single", "speculative_accept_threshold_single"),
        ("--speculative-accept-threshold-acc", "speculative_accept_threshold_acc"),
    ):
        val = getattr(sa, name, 1.0)
        if val is not None and float(val) != 1.0:
            raise ValueError(f"TEV: {flag} must be 1.0 (exact verification), got {val}")


def _smallest_overlap_tree(block_size: int, max_depth: int) -> int:
    """The smallest tree size N whose KV reserve covers a lagging step (overlap stays on)."""
    n = 2
    while overlap_reserve_need(n, block_size, max_depth) > 2 * n:
        n += 1
    return n


def resolve_server_args(
    sa,
    read_draft_block_size: Optional[Callable[[object], Optional[int]]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> TevSettings:
    """Resolve TEV's settings with plain field writes on ``sa`` and check the derived limits.

    Writes (each only where needed): ``speculative_num_draft_tokens`` (default 65),
    ``speculative_dflash_block_size`` (the drafter's), ``speculative_num_steps`` (K - 1),
    ``speculative_eagle_topk`` = 1, ``attention_backend`` = triton (``tev_cpu`` on
    ``--device cpu``) when the automatic choice does not apply tree masks, ``speculative_draft_attention_backend``,
    ``disable_overlap_schedule`` = True only when overlap scheduling's KV reserve is too small
    for the tree (``max(N, K) + min(D, N - 1) + 1 > 2N``, see
    :func:`~sglang_tev.srt.kv_headroom.overlap_reserve_need`; logged), the decode phase of
    ``cuda_graph_config`` = disabled on ``--device cpu``, and on CUDA under ``SGLANG_TEV_BUDGET=auto-ragged``
    or ``auto`` with ``SGLANG_TEV_GRAPH_TREE_SIZES=off`` (logged; see
    :data:`DECODE_GRAPH_BACKENDS`: otherwise SGLang's choice, full by default, is kept and TEV's
    target verify and draft forwards replay CUDA graphs, ``graphs``; under ``auto`` one target tier
    per tree size, ``graph_tiers``),
    ``max_running_requests`` = 48 when unset (as DFLASH).
    Overlap scheduling otherwise stays as the operator set it (on by default, as in SGLang).

    Args:
        sa: ``ServerArgs``-like object (SGLang's stand-in in production).
        read_draft_block_size: ``fn(sa) -> int | None``, the drafter config's block size; used
            when ``--speculative-dflash-block-size`` is unset.
        environ: environment mapping (default ``os.environ``).
    Returns:
        :class:`TevSettings`.
    Raises:
        ValueError naming the flag: block size < 2 or unknown; depth outside [1, K - 1] (depth
        >= block size); a block larger than twice the tree (SGLang reserves 2N KV slots per
        decode step and the draft block writes K of them); a top-k < 1;
        ``SGLANG_TEV_GRAPH_TREE_SIZES`` with a size above N; all
        :func:`validate_server_args` cases.
    """
    validate_server_args(sa, environ)
    verifier, topk = read_env(environ)

    n = sa.speculative_num_draft_tokens
    if n is None:
        n = DEFAULT_TREE_SIZE
        sa.speculative_num_draft_tokens = n
    n = int(n)

    k = sa.speculative_dflash_block_size
    if k is None:
        k = read_draft_block_size(sa) if read_draft_block_size is not None else None
        if k is None:
            raise ValueError(
                "TEV: the drafter's block size is unknown (no block_size in its config); pass --speculative-dflash-block-size"
            )
        sa.speculative_dflash_block_size = int(k)
    k = _as_int("--speculative-dflash-block-size", k)
    if k < 2:
        raise ValueError(f"TEV: --speculative-dflash-block-size must be >= 2 (root + at least one draft slot), got {k}")
    if k > 2 * n:
        raise ValueError(
            f"TEV: --speculative-dflash-block-size {k} exceeds 2 x the tree size N = {n}: SGLang reserves 2N KV slots "
            f"per request and step, and the draft block writes {k}; raise --speculative-num-draft-tokens to >= {(k + 1) // 2}"
        )

    d = sa.speculative_num_steps
    if d is None:
        d = k - 1
        sa.speculative_num_steps = d
    d = _as_int("--speculative-num-steps", d)
    if not 1 <= d <= k - 1:
        raise ValueError(
            f"TEV: --speculative-num-steps is the max tree depth and must be in [1, block size - 1 = {k - 1}], got {d}"
        )
    if topk is None:
        topk = n - 1
    if sa.speculative_eagle_topk is None:
        sa.speculative_eagle_topk = 1

    accepted = SUPPORTED_DEVICE_BACKENDS[_device_kind(sa)]
    prefill, decode = _backends(sa)
    if decode not in accepted or prefill not in accepted:
        # only automatic choices reach here (explicit ones were refused above)
        if prefill is not None or decode is not None:
            logger.warning("TEV: attention backend %s/%s does not apply tree masks; using %s", prefill, decode, accepted[0])
        sa.attention_backend = accepted[0]
        if sa.prefill_attention_backend not in (None, *accepted):
            sa.prefill_attention_backend = accepted[0]
        if sa.decode_attention_backend not in (None, *accepted):
            sa.decode_attention_backend = accepted[0]
    if sa.speculative_draft_attention_backend is None:
        # the drafter runs TARGET_VERIFY on its own runner; use the target's prefill backend
        sa.speculative_draft_attention_backend = _backends(sa)[0]

    need = overlap_reserve_need(n, k, d)
    if not sa.disable_overlap_schedule and need > 2 * n:
        # the reservation is made from a committed length one step behind the worker's
        logger.warning(
            "TEV: overlap scheduling disabled for N=%d, K=%d, D=%d: a step may write max(N, K) + min(D, N - 1) + 1 "
            "= %d KV slots past the scheduler's lagging committed length but SGLang reserves 2N = %d; to keep "
            "overlap on, use --speculative-num-draft-tokens >= %d, or a smaller --speculative-num-steps (D) or "
            "--speculative-dflash-block-size (K)",
            n, k, d, need, 2 * n, _smallest_overlap_tree(k, d),
        )
        sa.disable_overlap_schedule = True
    budget_mode = _env.get(ENV_BUDGET, environ)
    requested = _env.get(ENV_GRAPH_TREE_SIZES, environ)  # checked against N by validate_server_args
    cg = getattr(sa, "cuda_graph_config", None)
    if cg is not None and dataclasses.is_dataclass(cg) and getattr(cg.decode, "backend", "disabled") != "disabled":
        if _device_kind(sa) == "cpu":
            logger.info("TEV: decode graphs off on --device cpu (SGLang has no CPU graph runner for speculative decoding)")
            sa.cuda_graph_config = dataclasses.replace(cg, decode=dataclasses.replace(cg.decode, backend="disabled"))
        elif budget_mode != "fixed":
            # the verify width changes every round: auto replays one graph tier per width (graph_tiers);
            # auto-ragged's per-request sizes have no graph (module doc there), nor auto with the tiers off
            if budget_mode == "auto" and requested != ():
                if bool(getattr(sa, "enable_two_batch_overlap", False)) or bool(getattr(sa, "enable_pdmux", False)):
                    # both re-wrap the backends per runner (graph_tiers.wanted_tier_sizes): SGLang's graphs at N only
                    logger.warning("TEV: %s=auto with two-batch overlap or PD multiplexing captures no graph tiers: "
                                   "rounds below N = %d run eagerly", ENV_BUDGET, n)
                else:
                    logger.info("TEV: %s=auto captures target verify graphs at tree sizes %s (%s)", ENV_BUDGET,
                                ", ".join(map(str, tier_sizes(n, requested))), ENV_GRAPH_TREE_SIZES)
            else:
                why = "per-request tree sizes have no CUDA graph" if budget_mode == "auto-ragged" else f"{ENV_GRAPH_TREE_SIZES}=off"
                logger.warning("TEV: %s=%s runs the decode eagerly (%s)", ENV_BUDGET, budget_mode, why)
                sa.cuda_graph_config = dataclasses.replace(cg, decode=dataclasses.replace(cg.decode, backend="disabled"))
    if sa.max_running_requests is None:
        sa.max_running_requests = 48
    return TevSettings(tree_size=n, block_size=k, max_depth=d, topk=topk, verifier=verifier, budget_mode=budget_mode)


def settings_from_server_args(sa, environ: Optional[Mapping[str, str]] = None) -> TevSettings:
    """Rebuild :class:`TevSettings` from already-resolved args (a worker process; no writes).

    Raises:
        ValueError if the args were not resolved by :func:`resolve_server_args` (block size unset).
    """
    verifier, topk = read_env(environ)
    n, k, d = sa.speculative_num_draft_tokens, sa.speculative_dflash_block_size, sa.speculative_num_steps
    if n is None or k is None or d is None:
        raise ValueError("TEV: server args were not resolved (tree size, block size or depth unset)")
    n, k, d = int(n), int(k), int(d)
    return TevSettings(tree_size=n, block_size=k, max_depth=d, topk=topk if topk is not None else n - 1, verifier=verifier,
                       budget_mode=_env.get(ENV_BUDGET, environ))
