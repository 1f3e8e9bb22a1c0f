"""DFlash block-diffusion drafter: z-lab checkpoint layout, context-only KV cache, per-depth logits.

Implements the draft model of z-lab/dflash ``dflash/model.py`` (``DFlashDraftModel``,
``Qwen3DFlashAttention``, ``dflash_generate``; commit 44947fb), read for the math only:

* a stack of Qwen3 pre-norm blocks (RMSNorm, attention with per-head q/k RMSNorm and RoPE,
  SiLU-gated MLP) and a final ``norm``; no token embedding and no LM head (the target's are used);
* context features = concat of the target's HF ``hidden_states[id + 1]`` for ``id`` in
  ``target_layer_ids`` -> ``fc`` -> ``hidden_norm``; they enter every draft layer only as extra
  keys/values (through that layer's ``k_proj``/``v_proj``/``k_norm``), never as queries or MLP input;
* one block ``[root, MASK x (K-1)]`` at absolute positions ``root_pos .. root_pos + K - 1``;
  attention inside the block is bidirectional and every block query sees all context K/V;
* draft row ``j`` (0-based) of the output is the marginal q_{j+1} of depth ``j + 1``, at position
  ``root_pos + j + 1`` (DESIGN §3, "Positions and lengths").

Letters: b batch, K block size, T context tokens, H hidden size, V vocabulary,
n = len(target_layer_ids).

Modules (each name below is re-exported here; import from ``sglang_tev.draft.dflash``):

* :mod:`.config` — :class:`DFlashConfig` (``config.json`` parse / write / check against a
  target), :func:`build_target_layer_ids`, ``ARCHITECTURE``; :mod:`.config_keys` — the key
  tables and value checks it parses with;
* :mod:`.layers` — :func:`rms_norm`, :class:`RMSNorm`, RoPE, :class:`DFlashAttention`,
  :class:`DFlashMLP`, :class:`DFlashDecoderLayer`;
* :mod:`.cache` — :class:`DFlashDraftCache`, the context-only K/V cache;
* :mod:`.inputs` — :func:`extract_context_features`, :func:`block_train_mask`;
* :mod:`.model` — :class:`DFlashDraftModel` and its forward paths;
* :mod:`.io` — the checkpoint files (``CONFIG_NAME``, ``WEIGHTS_NAME``,
  :func:`is_dflash_checkpoint`, read / atomic write).

Imports go one way: ``config`` reads ``config_keys``; ``layers`` and ``io`` read ``config``;
``model`` reads ``config``, ``layers``, ``cache``, ``inputs`` and ``io``; ``cache`` and ``inputs``
need only torch. Outside the package only :mod:`sglang_tev.draft.dflash2` and
:mod:`sglang_tev.atomic` (nothing from ``sglang_tev.hf`` / ``srt`` / ``train`` / ``cli``).
"""

from __future__ import annotations

from .cache import DFlashDraftCache
from .config import ARCHITECTURE, DFlashConfig, build_target_layer_ids
from .inputs import block_train_mask, extract_context_features
from .io import CONFIG_NAME, WEIGHTS_NAME, is_dflash_checkpoint
from .layers import DFlashAttention, DFlashDecoderLayer, DFlashMLP, RMSNorm, rms_norm
from .model import DFlashDraftModel

__all__ = [
    "DFlashConfig",
    "DFlashDraftCache",
    "DFlashDraftModel",
    "build_target_layer_ids",
    "extract_context_features",
    "block_train_mask",
    "is_dflash_checkpoint",
    # also public (the layers, for the static runner and tests; the checkpoint file names)
    "rms_norm",
    "RMSNorm",
    "DFlashAttention",
    "DFlashMLP",
    "DFlashDecoderLayer",
    "ARCHITECTURE",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
]
