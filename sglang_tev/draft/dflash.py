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
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..atomic import atomic_dir
from .dflash2 import DFLASH2_ARCHITECTURES, CandidateSelector, GroupedCausalConv, SelectorLattice, transform_logits

__all__ = [
    "DFlashConfig",
    "DFlashDraftCache",
    "DFlashDraftModel",
    "build_target_layer_ids",
    "extract_context_features",
    "block_train_mask",
    "is_dflash_checkpoint",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"


def is_dflash_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path/config.json`` describes a DFlash drafter (a ``dflash_config`` block or a
    ``DFlash*`` architecture), e.g. to refuse one where a target model is expected: transformers
    would load it as a Qwen3 causal LM with randomly initialised missing weights. False when
    there is no readable config."""
    try:
        cfg = json.loads((Path(path) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    archs = cfg.get("architectures") or []
    return "dflash_config" in cfg or any(isinstance(a, str) and "DFlash" in a for a in archs)

# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

# Keys read from config.json into DFlashConfig fields.
_CONSUMED_KEYS = frozenset({
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
    "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size", "block_size",
    "num_target_layers", "dflash_config", "layer_types",
})
# Bookkeeping keys with no effect on the drafter's math; kept in `extra` and written back.
# (`sliding_window`/`max_window_layers` only act with sliding layers, which are rejected.)
_PASSTHROUGH_KEYS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "use_cache", "tie_word_embeddings", "auto_map",
    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "sliding_window",
    "max_window_layers",
})
# Keys whose only accepted values are the neutral ones (the behaviour this module implements).
# Anything else changes the math in ways not implemented here, so loading must fail loudly.
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                 "projector_type", "attention_sink_bias", "attention_value_scale")
_NEUTRAL_VALUES: dict[str, tuple] = {
    "hidden_act": ("silu",),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "use_sliding_window": (False, None),
    "is_causal": (False, None),
    "is_encoder_decoder": (False, None),
    "attention_dropout": (0.0, None),
    "input_embedding_scale": (1.0, None),
    "output_multiplier": (1.0, None),
    "final_logit_softcapping": (None, 0.0),
    **{k: (None,) for k in _DFLASH2_KEYS},
}
# Keys also looked up inside `dflash_config` (upstream reads dflash_config first, then top level).
_DFLASH_CONFIG_KEYS = frozenset({"mask_token_id", "target_layer_ids", "block_size",
                                 "num_target_layers", "mask_token"})
_DFLASH_CONFIG_NEUTRAL = ("input_embedding_scale", "output_multiplier",
                          "final_logit_softcapping", "is_causal", *_DFLASH2_KEYS)
# Keys a DFlash2 architecture (DFLASH2_ARCHITECTURES) consumes instead of requiring them neutral.
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                   "output_multiplier", "final_logit_softcapping")


def _parse_dflash2_fields(get) -> dict[str, Any]:
    """DFlash2 fields from ``get(key, default)`` (dflash_config first, then the top level), as
    SGLang's ``parse_dflash_draft_config``: 0/None conv or selector sizes mean absent, a softcap of
    0/None means none. Types are checked strictly (an int, not a bool/str/float)."""
    out: dict[str, Any] = {}
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = get(key, None)
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
            out[key] = None
        else:
            out[key] = _check_int(value, key, 1)
    mult = get("output_multiplier", 1.0)
    if isinstance(mult, bool) or not isinstance(mult, (int, float)):
        raise ValueError(f"config key 'output_multiplier' must be a number > 0, got {mult!r}")
    out["output_multiplier"] = float(mult)
    cap = get("final_logit_softcapping", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
        raise ValueError(f"config key 'final_logit_softcapping' must be a number or null, got {cap!r}")
    out["final_logit_softcapping"] = None if cap is None or cap == 0 else float(cap)
    return out


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers whose outputs feed the drafter (z-lab ``build_target_layer_ids``).

    One draft layer reads ``[num_target_layers // 2]``; otherwise ``n = num_draft_layers`` ids
    spread evenly over ``[1, num_target_layers - 3]``: ``round(1 + i * (L - 4) / (n - 1))``.
    Example: 36 target layers, 5 draft layers -> ``[1, 9, 17, 25, 33]``.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config key {name!r} must be an int >= {minimum}, got {value!r}")
    return value


def _is_neutral(value: Any, allowed: tuple) -> bool:
    for a in allowed:
        if a is None or isinstance(a, bool):
            if value is a:
                return True
        elif isinstance(a, str):
            if value == a:
                return True
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == a:
            return True
    return False


def _check_neutral(key: str, value: Any, where: str = "") -> None:
    if not _is_neutral(value, _NEUTRAL_VALUES[key]):
        raise ValueError(
            f"config key '{where}{key}'={value!r} is not supported by sglang_tev's DFlash drafter "
            f"(only {list(_NEUTRAL_VALUES[key])} is implemented); refusing to load it silently")


def _parse_rope_theta(cfg: Mapping[str, Any]) -> float:
    """rope theta from `rope_parameters` (transformers 5) or `rope_theta` (4.x); default RoPE only."""
    thetas = []
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping):
            raise ValueError(f"config key 'rope_parameters' must be a dict, got {params!r}")
        for key, value in params.items():
            if key == "rope_type" and value == "default":
                continue
            if key == "rope_theta":
                thetas.append(float(value))
                continue
            raise ValueError(f"config key 'rope_parameters.{key}'={value!r} is not supported "
                             "(only default RoPE with rope_theta is implemented)")
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
        if kind != "default" or set(scaling) - {"rope_type", "type", "rope_theta"}:
            raise ValueError(f"config key 'rope_scaling'={scaling!r} is not supported "
                             "(only default RoPE is implemented)")
        if "rope_theta" in scaling:
            thetas.append(float(scaling["rope_theta"]))
    if cfg.get("rope_theta") is not None:
        thetas.append(float(cfg["rope_theta"]))
    if len(set(thetas)) > 1:
        raise ValueError(f"config key 'rope_theta' is inconsistent across rope_theta / "
                         f"rope_parameters / rope_scaling: {thetas}")
    theta = thetas[0] if thetas else 10000.0  # transformers' Qwen3Config default
    if not theta > 0:
        raise ValueError(f"config key 'rope_theta' must be > 0, got {theta}")
    return theta


@dataclass(frozen=True)
class DFlashConfig:
    """Architecture of a z-lab DFlash drafter (``config.json``, DESIGN §4).

    Parse with :meth:`from_dict` / :meth:`from_json_file`; write with :meth:`to_dict`.
    ``block_size`` and ``target_layer_ids``/``mask_token_id``/``num_target_layers`` are read from
    ``dflash_config`` first, then from the top level (dflash_config wins).

    Raises ``ValueError`` naming the key for: a missing required key (dims, ``num_target_layers``,
    ``mask_token_id``), a bad value, ``target_layer_ids`` outside ``[0, num_target_layers)``, and
    every key this module does not implement (sliding-window / non-"full_attention"
    ``layer_types``, ``use_sliding_window: true``, ``is_causal: true``, ``input_embedding_scale``,
    ``output_multiplier``, ``final_logit_softcapping``, DFlash-2 selector/conv/projector keys,
    non-default RoPE, attention/MLP bias, dropout, an activation other than SiLU) unless its value
    is the neutral one, and for any key it does not know.

    DFlash2: with ``architectures`` one of ``DFlash2DraftModel``,
    ``DFlash2BeamDraftModel``, ``MiniMaxDFlash2DraftModel`` (the last two are aliases, as in SGLang
    0.5.23) the keys ``conv_kernel_size`` + ``conv_group_size`` (together; 0/absent = no conv; the
    group size divides ``hidden_size``), ``selector_rank`` + ``selector_top_k`` (together,
    required, as SGLang's ``DFlash2DraftModel``; ``top_k <= vocab_size``), ``output_multiplier``
    (finite, > 0) and ``final_logit_softcapping`` (0/null = off, else > 0) are read from
    ``dflash_config`` or the top level (``ValueError`` when both are given and differ) and
    ``vocab_size`` is required. ``projector_type``, ``attention_sink_bias``,
    ``attention_value_scale``, ``input_embedding_scale`` stay refused. With the v1 architecture
    the DFlash2 keys must be absent or neutral, as before.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int          # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int          # layers of the target the drafter was trained against
    mask_token_id: int              # a row of the TARGET's embedding table
    target_layer_ids: tuple[int, ...]  # feature source: HF hidden_states[id + 1]
    block_size: int = 16            # K: root + (K - 1) masks per draft forward
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    vocab_size: int | None = None   # the target's (padded) vocabulary; informational for v1
    extra: dict = field(default_factory=dict, compare=False)  # passthrough bookkeeping keys
    # DFlash2: only with a DFLASH2_ARCHITECTURES architecture; see docs/runtime.md
    architecture: str = ARCHITECTURE
    conv_kernel_size: int | None = None   # taps of the grouped dynamic causal conv (with group size)
    conv_group_size: int | None = None    # channels per conv group; divides hidden_size
    selector_rank: int | None = None      # r of the selector codebooks (with selector_top_k)
    selector_top_k: int | None = None     # candidates per slot
    output_multiplier: float = 1.0        # draft logits x this (> 0) ...
    final_logit_softcapping: float | None = None  # ... then c * tanh(logits / c)

    @property
    def is_dflash2(self) -> bool:
        """True for a DFlash2 architecture (conv and/or selector, logit transform)."""
        return self.architecture in DFLASH2_ARCHITECTURES

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_target_layers",
                     "max_position_embeddings"):
            _check_int(getattr(self, name), name, 1)
        _check_int(self.block_size, "block_size", 2)
        _check_int(self.mask_token_id, "mask_token_id", 0)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config key 'num_key_value_heads'={self.num_key_value_heads} must "
                             f"divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"config key 'head_dim'={self.head_dim} must be even (RoPE)")
        if not self.target_layer_ids:
            raise ValueError("config key 'target_layer_ids' must be non-empty")
        for i in self.target_layer_ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_target_layers:
                raise ValueError(f"config key 'target_layer_ids' entry {i!r} is outside "
                                 f"[0, num_target_layers={self.num_target_layers})")
        if self.vocab_size is not None:
            _check_int(self.vocab_size, "vocab_size", 1)
            if self.mask_token_id >= self.vocab_size:
                raise ValueError(f"config key 'mask_token_id'={self.mask_token_id} must be < "
                                 f"vocab_size={self.vocab_size}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config key 'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        self._check_dflash2()

    def _check_dflash2(self) -> None:
        """The DFlash2 fields: one ValueError naming the field (DFlash2 rules as SGLang 0.5.23's
        ``parse_dflash_draft_config`` and ``DFlash2DraftModel``, plus what the model needs)."""
        if self.architecture != ARCHITECTURE and self.architecture not in DFLASH2_ARCHITECTURES:
            raise ValueError(f"config key 'architectures'={[self.architecture]!r} is not supported "
                             f"(expected one of {[ARCHITECTURE, *DFLASH2_ARCHITECTURES]})")
        if not self.is_dflash2:
            for key in _DFLASH2_FIELDS:
                value = getattr(self, key)
                neutral = 1.0 if key == "output_multiplier" else None
                if value != neutral:
                    raise ValueError(f"config key {key!r}={value!r} needs a DFlash2 architecture "
                                     f"({list(DFLASH2_ARCHITECTURES)}), not {self.architecture!r}")
            return
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, key)
            if value is not None:
                _check_int(value, key, 1)
        if (self.conv_kernel_size is None) != (self.conv_group_size is None):
            raise ValueError(f"config key 'conv_group_size'={self.conv_group_size!r} and "
                             f"'conv_kernel_size'={self.conv_kernel_size!r} must be set together")
        if self.conv_group_size is not None and self.hidden_size % self.conv_group_size:
            raise ValueError(f"config key 'conv_group_size'={self.conv_group_size} must divide "
                             f"hidden_size={self.hidden_size}")
        if (self.selector_rank is None) != (self.selector_top_k is None):
            raise ValueError(f"config key 'selector_top_k'={self.selector_top_k!r} and "
                             f"'selector_rank'={self.selector_rank!r} must be set together")
        if self.selector_rank is None:
            raise ValueError(f"config key 'architectures'={[self.architecture]!r} needs "
                             "'selector_rank' and 'selector_top_k' (as SGLang's DFlash2DraftModel)")
        if self.vocab_size is None:
            raise ValueError("config key 'vocab_size' is required by a DFlash2 drafter (the "
                             "selector codebooks have one row per token)")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"config key 'selector_top_k'={self.selector_top_k} exceeds "
                             f"vocab_size={self.vocab_size}")
        m = self.output_multiplier
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < float("inf"):
            raise ValueError(f"config key 'output_multiplier' must be a finite number > 0, got {m!r}")
        c = self.final_logit_softcapping
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not 0 < c < float("inf")):
            raise ValueError(f"config key 'final_logit_softcapping' must be null/0 (off) or a "
                             f"finite number > 0, got {c!r}")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "DFlashConfig":
        """Parse a z-lab ``config.json`` dict. Raises ``ValueError`` naming the offending key."""
        if not isinstance(cfg, Mapping):
            raise ValueError(f"cfg must be a mapping, got {type(cfg).__name__}")
        unknown = set(cfg) - _CONSUMED_KEYS - _PASSTHROUGH_KEYS - set(_NEUTRAL_VALUES)
        if unknown:
            raise ValueError(f"config keys {sorted(unknown)} are not known to sglang_tev's DFlash "
                             "drafter; refusing to load them silently")
        arch = cfg.get("architectures")
        if isinstance(arch, (str, bytes)) or (arch is not None and not isinstance(arch, Sequence)):
            raise ValueError(f"config key 'architectures' must be a list, got {arch!r}")
        dflash2 = arch is not None and len(arch) == 1 and arch[0] in DFLASH2_ARCHITECTURES
        own = _DFLASH2_FIELDS if dflash2 else ()  # consumed below instead of required neutral
        for key in _NEUTRAL_VALUES:
            if key in cfg and key not in own:
                _check_neutral(key, cfg[key])
        if arch is not None and list(arch) != [ARCHITECTURE] and not dflash2:
            hint = ("; this looks like a target model, not a DFlash drafter"
                    if any(str(a).endswith("ForCausalLM") for a in arch) else "")
            raise ValueError(f"config key 'architectures'={arch!r} is not supported "
                             f"(expected [{ARCHITECTURE!r}] or one of "
                             f"{[[a] for a in DFLASH2_ARCHITECTURES]}){hint}")
        if cfg.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"config key 'model_type'={cfg['model_type']!r} is not supported "
                             "(expected 'qwen3')")
        dcfg = cfg.get("dflash_config") or {}
        if not isinstance(dcfg, Mapping):
            raise ValueError(f"config key 'dflash_config' must be a dict, got {dcfg!r}")
        for key, value in dcfg.items():
            if key in own:
                if key in cfg and cfg[key] != value:
                    raise ValueError(f"config key 'dflash_config.{key}'={value!r} differs from the "
                                     f"top-level {key!r}={cfg[key]!r}")
            elif key in _DFLASH_CONFIG_NEUTRAL:
                _check_neutral(key, value, where="dflash_config.")
            elif key not in _DFLASH_CONFIG_KEYS:
                raise ValueError(f"config key 'dflash_config.{key}' is not known to sglang_tev's "
                                 "DFlash drafter; refusing to load it silently")

        def get(key: str, default: Any = KeyError) -> Any:
            if key in dcfg:
                return dcfg[key]
            if key in cfg:
                return cfg[key]
            if default is KeyError:
                raise ValueError(f"config key {key!r} is missing (looked in dflash_config and at "
                                 "the top level)")
            return default

        num_layers = _check_int(get("num_hidden_layers"), "num_hidden_layers", 1)
        layer_types = cfg.get("layer_types")
        if layer_types is not None:
            bad = [t for t in layer_types if t != "full_attention"]
            if bad or len(layer_types) != num_layers:
                raise ValueError(f"config key 'layer_types'={list(layer_types)!r} is not supported "
                                 f"(only {num_layers} x 'full_attention' is implemented)")
        num_target_layers = _check_int(get("num_target_layers"), "num_target_layers", 1)
        layer_ids = get("target_layer_ids", None)
        if layer_ids is None:
            layer_ids = build_target_layer_ids(num_target_layers, num_layers)
        if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence):
            raise ValueError(f"config key 'target_layer_ids' must be a list, got {layer_ids!r}")
        extra = {k: v for k, v in cfg.items() if k in _PASSTHROUGH_KEYS}
        if "mask_token" in dcfg:
            extra["dflash_config.mask_token"] = dcfg["mask_token"]
        return cls(
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            num_target_layers=num_target_layers,
            mask_token_id=get("mask_token_id"),
            target_layer_ids=tuple(layer_ids),
            block_size=get("block_size", 16),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=_parse_rope_theta(cfg),
            max_position_embeddings=get("max_position_embeddings", 32768),
            vocab_size=get("vocab_size", None),
            extra=extra,
            architecture=arch[0] if dflash2 else ARCHITECTURE,
            **(_parse_dflash2_fields(get) if dflash2 else {}),
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DFlashConfig":
        """Read and parse ``config.json``; ``ValueError`` on invalid JSON or keys."""
        try:
            cfg = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"path: {path} is not valid JSON ({e})") from e
        return cls.from_dict(cfg)

    def to_dict(self) -> dict[str, Any]:
        """The z-lab ``config.json`` dict (loadable by this class, the z-lab reference and HF)."""
        out = {k: v for k, v in self.extra.items() if not k.startswith("dflash_config.")}
        dcfg = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size}
        if "dflash_config.mask_token" in self.extra:
            dcfg["mask_token"] = self.extra["dflash_config.mask_token"]
        if self.is_dflash2:  # SGLang reads these only from dflash_config; z-lab there first
            for key in _DFLASH2_FIELDS:
                if getattr(self, key) is not None:
                    dcfg[key] = getattr(self, key)
        out.update({
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "block_size": self.block_size,  # top level too: older z-lab code reads only this one
            "num_target_layers": self.num_target_layers,
            "dflash_config": dcfg,
        })
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        return out

    def validate_against_target(self, target_config: Any) -> None:
        """Check that this drafter fits a target model config (HF ``PretrainedConfig`` or dict).

        Uses the target's text config (``get_text_config()``) when it has one. Raises
        ``ValueError`` naming the field when: ``hidden_size`` differs from the target's (block
        embeddings and the LM head are the target's); ``mask_token_id >= `` the target's
        ``vocab_size``; the drafter's ``vocab_size`` (when set) differs from the target's; a
        ``target_layer_ids`` entry is ``>=`` the target's
        ``num_hidden_layers``; ``num_target_layers`` differs from the target's
        ``num_hidden_layers`` (the drafter was trained against another model).
        """
        if hasattr(target_config, "get_text_config"):
            target_config = target_config.get_text_config()

        def tget(key: str) -> int:
            value = (target_config.get(key) if isinstance(target_config, Mapping)
                     else getattr(target_config, key, None))
            if value is None:
                raise ValueError(f"target_config has no {key!r}")
            return int(value)

        t_hidden, t_vocab, t_layers = (tget("hidden_size"), tget("vocab_size"),
                                       tget("num_hidden_layers"))
        if self.hidden_size != t_hidden:
            raise ValueError(f"hidden_size: drafter has {self.hidden_size}, target has {t_hidden}")
        if self.mask_token_id >= t_vocab:
            raise ValueError(f"mask_token_id: {self.mask_token_id} is not a row of the target's "
                             f"embedding (vocab_size {t_vocab})")
        if self.vocab_size is not None and self.vocab_size != t_vocab:
            raise ValueError(f"vocab_size: drafter was trained with {self.vocab_size} tokens, "
                             f"target has {t_vocab}")
        if max(self.target_layer_ids) >= t_layers:
            raise ValueError(f"target_layer_ids: {list(self.target_layer_ids)} reach past the "
                             f"target's {t_layers} layers")
        if self.num_target_layers != t_layers:
            raise ValueError(f"num_target_layers: drafter was trained on {self.num_target_layers} "
                             f"target layers, target has {t_layers}")


# ----------------------------------------------------------------------------------------------
# Features, cache, training mask
# ----------------------------------------------------------------------------------------------

def extract_context_features(hidden_states: Sequence[torch.Tensor],
                             layer_ids: Sequence[int]) -> torch.Tensor:
    """Concat the target's layer outputs the drafter reads (z-lab ``extract_context_feature``).

    Parameters
    ----------
    hidden_states : HF ``output_hidden_states`` tuple, ``len = num_layers + 1``; entry 0 is the
        embedding output, entry ``id + 1`` the output of layer ``id``. Each ``(b, T, H)``.
    layer_ids : target layer ids (``DFlashConfig.target_layer_ids``).

    Returns ``(b, T, n * H)``, in the dtype of ``hidden_states``. ``ValueError`` (argument
    ``layer_ids``) when an id has no entry in ``hidden_states``.
    """
    if not layer_ids or max(layer_ids) + 1 >= len(hidden_states) or min(layer_ids) < 0:
        raise ValueError(f"layer_ids: {list(layer_ids)} do not index a hidden_states tuple of "
                         f"length {len(hidden_states)} (entry id + 1 is read)")
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class DFlashDraftCache:
    """Context-only K/V of the drafter, per layer ``(b, kv_heads, T, head_dim)`` after k_norm + RoPE.

    Holds exactly the context positions fed so far (the block's own K/V are never stored, as
    z-lab ``dflash_generate`` crops them right after the draft forward). Buffers grow by
    doubling, so appending a round's accepted tokens costs no full copy. All rows share one length.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._length = 0

    @property
    def length(self) -> int:
        """Number of cached context positions (tokens)."""
        return self._length

    def __len__(self) -> int:
        return self._length

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions; ``ValueError`` (argument ``n``) unless ``0 <= n <= length``."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._length:
            raise ValueError(f"n: must be an int in [0, {self._length}], got {n!r}")
        self._length = n

    def reset(self) -> None:
        """Drop everything (buffers included)."""
        self.__init__(self.num_layers)

    def layer(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views ``(k, v)`` of layer ``i``, each ``(b, kv_heads, length, head_dim)``; None if empty."""
        if self._length == 0:
            return None, None
        return self._keys[i][:, :, :self._length], self._values[i][:, :, :self._length]

    def extend(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append one ``(k, v)`` per layer, each ``(b, kv_heads, T_new, head_dim)``."""
        if len(kv) != self.num_layers:
            raise ValueError(f"kv: expected {self.num_layers} layers, got {len(kv)}")
        t_new = kv[0][0].shape[2]
        need = self._length + t_new
        for i, (k, v) in enumerate(kv):
            buf_k, buf_v = self._keys[i], self._values[i]
            if buf_k is not None and (buf_k.shape[0] != k.shape[0] or buf_k.shape[1] != k.shape[1]
                                      or buf_k.shape[3] != k.shape[3]):
                raise ValueError(f"cache: holds rows of shape {tuple(buf_k.shape[:2])}+"
                                 f"head_dim {buf_k.shape[3]}, got K of shape {tuple(k.shape)}")
            if buf_k is None or buf_k.shape[2] < need:
                cap = max(need, 2 * (buf_k.shape[2] if buf_k is not None else 0), 64)
                new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
                new_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
                if self._length:
                    new_k[:, :, :self._length] = buf_k[:, :, :self._length]
                    new_v[:, :, :self._length] = buf_v[:, :, :self._length]
                self._keys[i], self._values[i] = buf_k, buf_v = new_k, new_v
            buf_k[:, :, self._length:need] = k
            buf_v[:, :, self._length:need] = v
        self._length = need


def block_train_mask(anchors: torch.Tensor, seq_len: int, block_size: int,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Training attention mask over ``[context S | block_0 | ... | block_{n-1}]`` (SpecForge DFlash).

    Block ``i`` (queries ``i*K .. i*K+K-1``, block tokens ``[x_a, MASK x (K-1)]`` at positions
    ``a .. a+K-1`` with ``a = anchors[:, i]``) sees context positions ``< a`` (strictly: the
    anchor's own target feature does not exist at inference) and its own block bidirectionally;
    other blocks never. A block with ``valid = False`` sees only itself (finite output; exclude
    it from the loss).

    anchors : int64 ``(b, n)``; valid : bool ``(b, n)`` or None.
    Returns bool ``(b, n*K, S + n*K)``, True = may attend (input of :meth:`DFlashDraftModel.forward_train`).
    """
    if anchors.dim() != 2:
        raise ValueError(f"anchors: expected (b, n), got shape {tuple(anchors.shape)}")
    b, n = anchors.shape
    dev = anchors.device
    ctx = torch.arange(seq_len, device=dev) < anchors[..., None]  # [b, n, S]
    if valid is not None:
        ctx = ctx & valid[..., None]
    ctx = ctx.repeat_interleave(block_size, dim=1)  # [b, n*K, S]
    blk = torch.arange(n * block_size, device=dev) // block_size
    own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)  # [b, n*K, n*K]
    return torch.cat([ctx, own], dim=-1)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm of the last dim: normalise in float32, scale by ``weight`` in ``x``'s dtype.
    ``weight`` [d], or [heads, d] over x [..., heads, d] (one scale per head: q_norm and k_norm
    in one call). torch's fused ``rms_norm``: ``x * rsqrt(mean(x^2) + eps)`` in one op instead of
    five (the draft forward is op-bound on CPU); equal to the unfused form on fp32 and bf16."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm (:func:`rms_norm` with a learned ``weight``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rope(positions: torch.Tensor, head_dim: int, theta: float,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(b, T, head_dim)`` for int64 positions ``(b, T)`` (default RoPE, as HF Qwen3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # [b, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, h, T, d]; cos/sin: [b, T, d]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """Non-causal attention of block queries over ``[context K/V | block K/V]``."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        H, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm + RoPE) and V ``(b, kv_heads, T, d)`` of ``x (b, T, H)``; shared by context and block."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past_k: torch.Tensor | None, past_v: torch.Tensor | None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rope(q, cos, sin)  # [b, nh, K, d]
        k, v = self.project_kv(x, cos, sin)  # block K/V: used here, never cached
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # GQA: repeat each kv head for its query heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Qwen3 pre-norm block; with DFlash2's conv (``cfg.conv_kernel_size``) the attention and the
    MLP are each wrapped: ``conv_in(norm(h))`` -> sublayer -> ``conv_out`` (reference
    ``Qwen3DFlashDecoderLayer.forward``). The context K/V path gets no conv."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)
        self.attention_conv = self.mlp_conv = None
        if cfg.conv_kernel_size is not None:
            self.attention_conv = GroupedCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h, cos, sin, past_k, past_v, attn_mask=None, block_len: int | None = None):
        """``block_len``: tokens per block for the conv (None: the whole sequence is one block)."""
        if self.attention_conv is None:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, past_k, past_v, attn_mask)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, delta = self.attention_conv.prepare(self.input_layernorm(h), block_len)
        a = self.self_attn(x, cos, sin, past_k, past_v, attn_mask)
        h = h + self.attention_conv.finish(a, delta, block_len)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h), block_len)
        return h + self.mlp_conv.finish(self.mlp(x), delta, block_len)


def _positions(pos: torch.Tensor, b: int, t: int, name: str, device: torch.device) -> torch.Tensor:
    """Broadcast ``(t,)`` or ``(b, t)`` integer positions to int64 ``(b, t)``."""
    if not isinstance(pos, torch.Tensor) or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor of shape ({t},) or ({b}, {t})")
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[1] != t or pos.shape[0] not in (1, b):
        raise ValueError(f"{name}: expected shape ({t},) or ({b}, {t}), got {tuple(pos.shape)}")
    return pos.to(device=device, dtype=torch.long).expand(b, t)


class DFlashDraftModel(nn.Module):
    """DFlash drafter (z-lab ``DFlashDraftModel``, ``dflash/model.py``) with z-lab tensor names.

    Parameters (exactly the safetensors names): ``layers.{i}.{input_layernorm,
    post_attention_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``fc.weight (H, n*H)``, ``hidden_norm.weight``, ``norm.weight``.

    DFlash2 (``config.is_dflash2``) adds ``layers.{i}.{attention,mlp}_conv.base_kernel
    (2, taps, H)`` and ``layers.{i}.{attention,mlp}_conv.kernel_projection.weight (2*taps*G, H)``
    when ``conv_kernel_size`` is set, and ``candidate_selector.{predecessor,successor}_codebook
    (V, r)`` + ``candidate_selector.hidden_projection.weight (r, H)``
    (:mod:`sglang_tev.draft.dflash2`); its draft logits go through the logit transform.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if config.selector_rank is not None:
            self.candidate_selector = CandidateSelector(H, config.vocab_size, config.selector_rank,
                                                        config.selector_top_k)

    # -- conveniences -------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    def new_cache(self) -> DFlashDraftCache:
        """An empty context cache for this drafter."""
        return DFlashDraftCache(self.config.num_hidden_layers)

    def validate_against_target(self, target_config: Any) -> None:
        """See :meth:`DFlashConfig.validate_against_target`."""
        self.config.validate_against_target(target_config)

    def extract_context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """:func:`extract_context_features` with this drafter's ``target_layer_ids``."""
        return extract_context_features(hidden_states, self.config.target_layer_ids)

    # -- forward paths ------------------------------------------------------------------------
    def _project_context(self, ctx_features: torch.Tensor, ctx_positions: torch.Tensor,
                         b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V ``(b, kv_heads, T, d)`` of ``ctx_features (b, T, n*H)``."""
        n_in = self.fc.in_features
        if ctx_features.dim() != 3 or ctx_features.shape[0] != b or ctx_features.shape[2] != n_in:
            raise ValueError(f"ctx_features: expected ({b}, T, {n_in}), got "
                             f"{tuple(ctx_features.shape)}")
        dtype = self.fc.weight.dtype
        pos = _positions(ctx_positions, b, ctx_features.shape[1], "ctx_positions",
                         ctx_features.device)
        ctx = self.hidden_norm(self.fc(ctx_features.to(dtype)))  # [b, T, H], shared by all layers
        cos, sin = _rope(pos, self.config.head_dim, self.config.rope_theta, dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, ctx_features: torch.Tensor | None, ctx_positions: torch.Tensor | None,
                block_embeds: torch.Tensor, block_positions: torch.Tensor,
                cache: DFlashDraftCache | None = None) -> torch.Tensor:
        """One draft forward over a block, appending the new context to ``cache``.

        Parameters
        ----------
        ctx_features : ``(b, T_new, n*H)`` target features of the context tokens not yet cached
            (:func:`extract_context_features`), or None / ``T_new = 0`` for none.
        ctx_positions : int ``(T_new,)`` or ``(b, T_new)`` absolute positions of those tokens
            (normally ``cache.length + arange(T_new)``); ignored when ``ctx_features`` is None.
        block_embeds : ``(b, K, H)`` target embeddings of the block tokens.
        block_positions : int ``(K,)`` or ``(b, K)`` absolute positions of the block.
        cache : context cache; the new context K/V are appended (it then holds the context
            only), the block K/V are used transiently. None: attend to the new context only.

        Returns ``(b, K, H)`` final-normed hidden states, in the drafter's dtype (inputs are cast
        to it). Raises ``ValueError`` naming the argument on shape mismatches.
        """
        if block_embeds.dim() != 3 or block_embeds.shape[2] != self.config.hidden_size:
            raise ValueError(f"block_embeds: expected (b, K, {self.config.hidden_size}), got "
                             f"{tuple(block_embeds.shape)}")
        b, K, _ = block_embeds.shape
        dtype = self.fc.weight.dtype
        new_kv = None
        if ctx_features is not None and ctx_features.shape[1] > 0:
            new_kv = self._project_context(ctx_features, ctx_positions, b)
        if cache is not None:
            if new_kv is not None:
                cache.extend(new_kv)
            past = [cache.layer(i) for i in range(len(self.layers))]
        else:
            past = new_kv if new_kv is not None else [(None, None)] * len(self.layers)
        pos = _positions(block_positions, b, K, "block_positions", block_embeds.device)
        cos, sin = _rope(pos, self.config.head_dim, self.config.rope_theta, dtype)
        h = block_embeds.to(dtype)
        for layer, (past_k, past_v) in zip(self.layers, past):
            h = layer(h, cos, sin, past_k, past_v, block_len=K)
        return self.norm(h)

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """DFlash2's logit transform (``output_multiplier``, then ``final_logit_softcapping``) on
        draft logits of any shape; the identity for DFlash v1. See
        :func:`sglang_tev.draft.dflash2.transform_logits`."""
        return transform_logits(logits, self.config.output_multiplier, self.config.final_logit_softcapping)

    def draft_logits(self, target_embed: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                     target_lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                     root_tokens: torch.Tensor, root_pos: int | torch.Tensor,
                     new_ctx_features: torch.Tensor | None, cache: DFlashDraftCache | None,
                     block_size: int | None = None) -> torch.Tensor:
        """Per-depth draft logits of one round (z-lab ``dflash_generate`` draft step).

        Builds the block ``[root, MASK x (K-1)]`` at positions ``root_pos .. root_pos + K - 1``,
        embeds it with the target embedding, runs :meth:`forward` (appending
        ``new_ctx_features`` at positions ``root_pos - T_new .. root_pos - 1``) and applies the
        target LM head to slots ``1 .. K-1``.

        Parameters
        ----------
        target_embed : target token embedding (e.g. ``target.model.embed_tokens``).
        target_lm_head : target LM head (e.g. ``target.lm_head``).
        root_tokens : int64 ``(b,)`` the last committed token (not yet seen by the target).
        root_pos : int or int64 ``(b,)`` position of the root (= committed length).
        new_ctx_features : ``(b, T_new, n*H)`` features of the committed tokens not yet in
            ``cache`` (the previous round's accepted path, root included), or None.
        cache : context cache; after the call it holds positions ``[0, root_pos)``.
        block_size : K (default ``config.block_size``); smaller near ``max_new_tokens``.

        Returns float32 ``(b, K-1, V)``: row ``j`` = draft logits of depth ``j + 1`` at
        position ``root_pos + j + 1`` (DFlash2: after :meth:`transform_logits`, on the full
        vocabulary, as z-lab ``compute_logits``). Raises ``ValueError`` naming the argument on bad
        shapes, ``block_size < 2``, or (for an int ``root_pos``) ``cache.length + T_new != root_pos``.
        No host sync. Call under ``torch.inference_mode()`` when no gradient is wanted.
        """
        hidden = self._draft_hidden(target_embed, root_tokens, root_pos, new_ctx_features, cache, block_size)
        return self._head(target_lm_head, hidden)

    def _head(self, target_lm_head, hidden: torch.Tensor) -> torch.Tensor:
        head_w = getattr(target_lm_head, "weight", None)
        if isinstance(head_w, torch.Tensor):
            hidden = hidden.to(head_w.dtype)
        return self.transform_logits(target_lm_head(hidden).float())

    def draft_lattice(self, target_embed: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                      target_lm_head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
                      root_tokens: torch.Tensor, root_pos: int | torch.Tensor,
                      new_ctx_features: torch.Tensor | None, cache: DFlashDraftCache | None,
                      block_size: int | None = None) -> tuple[torch.Tensor, SelectorLattice]:
        """One DFlash2 round's draft: (transformed logits float32 ``(b, K-1, V)``, the selector's
        :class:`~sglang_tev.draft.dflash2.SelectorLattice` over slots 1 .. K-1 with the root as
        slot 0's predecessor). Arguments and errors as :meth:`draft_logits`; also ``ValueError``
        when the drafter has no selector. Reference: z-lab ``dflash_generate`` draft step +
        ``DFlash2DraftModel.propose``."""
        if self.config.selector_rank is None:
            raise ValueError("draft_lattice: this drafter has no candidate selector (DFlash v1)")
        hidden = self._draft_hidden(target_embed, root_tokens, root_pos, new_ctx_features, cache, block_size)
        logits = self._head(target_lm_head, hidden)
        return logits, self.candidate_selector.lattice(hidden, logits, root_tokens)

    def _draft_hidden(self, target_embed, root_tokens, root_pos, new_ctx_features, cache,
                      block_size) -> torch.Tensor:
        """Final-normed hidden states ``(b, K-1, H)`` of slots 1 .. K-1 (see :meth:`draft_logits`)."""
        K = self.config.block_size if block_size is None else block_size
        if isinstance(K, bool) or not isinstance(K, int) or K < 2:
            raise ValueError(f"block_size: must be an int >= 2, got {block_size!r}")
        if root_tokens.dim() != 1 or root_tokens.dtype != torch.long:
            raise ValueError(f"root_tokens: expected int64 (b,), got {root_tokens.dtype} "
                             f"{tuple(root_tokens.shape)}")
        b, dev = root_tokens.shape[0], root_tokens.device
        t_new = 0 if new_ctx_features is None else new_ctx_features.shape[1]
        if isinstance(root_pos, torch.Tensor):
            if root_pos.shape != (b,):
                raise ValueError(f"root_pos: expected an int or shape ({b},), got "
                                 f"{tuple(root_pos.shape)}")
            base = root_pos.to(device=dev, dtype=torch.long)[:, None]
        else:
            cached = cache.length if cache is not None else 0
            if isinstance(root_pos, bool) or not isinstance(root_pos, int) or \
                    root_pos != cached + t_new:
                raise ValueError(f"root_pos: {root_pos!r} must equal the cached context length "
                                 f"({cached}) + new context tokens ({t_new})")
            base = torch.full((1, 1), root_pos, device=dev, dtype=torch.long)
        block_ids = torch.full((b, K), self.config.mask_token_id, device=dev, dtype=torch.long)
        block_ids[:, 0] = root_tokens
        block_pos = base + torch.arange(K, device=dev)  # [b or 1, K]
        ctx_pos = base - t_new + torch.arange(t_new, device=dev)  # [b or 1, T_new]
        hidden = self.forward(new_ctx_features, ctx_pos, target_embed(block_ids), block_pos, cache)
        return hidden[:, 1:]

    def forward_train(self, ctx_features: torch.Tensor, block_embeds: torch.Tensor,
                      block_positions: torch.Tensor, attn_mask: torch.Tensor,
                      ctx_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence training forward: many blocks against one teacher-forced context.

        Parameters
        ----------
        ctx_features : ``(b, S, n*H)`` target features of the whole sequence.
        block_embeds : ``(b, M, H)`` target embeddings of the concatenated blocks
            (``M = n_blocks * K``; block ``i`` = ``[x_a, MASK x (K-1)]`` for its anchor ``a``).
        block_positions : int ``(b, M)`` (block ``i``: ``a .. a + K - 1``).
        attn_mask : bool ``(b or 1, M, S + M)`` (True = attend) or additive float, over keys
            ``[context S | blocks M]``; :func:`block_train_mask` builds the DFlash one.
        ctx_positions : int ``(S,)`` or ``(b, S)``; default ``arange(S)``.

        Returns ``(b, M, H)`` final-normed hidden states (apply the target LM head to slots
        ``1..K-1`` of each block). Differentiable; no cache involved. With DFlash2's conv the
        blocks are ``config.block_size`` tokens each (the conv restarts at each); ``ValueError``
        (argument ``block_embeds``) when ``M`` is not a multiple of it.
        """
        if ctx_features.dim() != 3:
            raise ValueError(f"ctx_features: expected (b, S, n*H), got {tuple(ctx_features.shape)}")
        b, s, _ = ctx_features.shape
        if block_embeds.dim() != 3 or block_embeds.shape[0] != b:
            raise ValueError(f"block_embeds: expected ({b}, M, H), got {tuple(block_embeds.shape)}")
        m = block_embeds.shape[1]
        if self.config.conv_kernel_size is not None and m % self.config.block_size:
            raise ValueError(f"block_embeds: M={m} is not a multiple of block_size="
                             f"{self.config.block_size} (the DFlash2 conv runs per block)")
        if attn_mask.dim() != 3 or attn_mask.shape[0] not in (1, b) or \
                tuple(attn_mask.shape[1:]) != (m, s + m):
            raise ValueError(f"attn_mask: expected ({b} or 1, {m}, {s + m}), got "
                             f"{tuple(attn_mask.shape)}")
        if ctx_positions is None:
            ctx_positions = torch.arange(s, device=ctx_features.device)
        dtype = self.fc.weight.dtype
        ctx_kv = self._project_context(ctx_features, ctx_positions, b)
        pos = _positions(block_positions, b, m, "block_positions", block_embeds.device)
        cos, sin = _rope(pos, self.config.head_dim, self.config.rope_theta, dtype)
        mask = attn_mask[:, None]  # [b, 1, M, S+M]: same mask for every head
        if mask.dtype != torch.bool:
            mask = mask.to(dtype)
        h = block_embeds.to(dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask, block_len=self.config.block_size)
        return self.norm(h)

    # -- checkpoint I/O -----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> "DFlashDraftModel":
        """Load a z-lab layout checkpoint (``config.json`` + ``model.safetensors``).

        ``dtype`` None keeps the stored dtype. Raises ``FileNotFoundError`` (argument ``path``)
        when the directory or either file is missing; ``ValueError`` naming the key/tensor for
        invalid config keys, missing/unexpected/misshapen tensors, or a non-float ``dtype``.
        """
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"dtype: expected a floating torch.dtype or None, got {dtype!r}")
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"path: {root} is not a directory")
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (root / name).is_file():
                raise FileNotFoundError(f"path: {root} has no {name} (z-lab DFlash layout: "
                                        f"{CONFIG_NAME} + a single {WEIGHTS_NAME})")
        config = DFlashConfig.from_json_file(root / CONFIG_NAME)
        state = load_file(str(root / WEIGHTS_NAME), device="cpu")
        with torch.device("meta"):  # no random init of weights that are overwritten anyway
            model = cls(config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{WEIGHTS_NAME}: missing tensors {missing}, unexpected tensors "
                             f"{unexpected}")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"{WEIGHTS_NAME}: tensor {name!r} has shape "
                                 f"{tuple(state[name].shape)}, expected {shape}")
            if not state[name].dtype.is_floating_point:
                raise ValueError(f"{WEIGHTS_NAME}: tensor {name!r} has dtype {state[name].dtype}")
        model.load_state_dict(state, strict=True, assign=True)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        return model.eval()

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` + ``model.safetensors`` (z-lab names) atomically.

        Both files are written to a temporary directory beside ``path`` and renamed into place;
        an existing checkpoint at ``path`` is replaced only after the new one is complete (on
        failure the old one is left intact and the temporary directory removed). Raises
        ``FileNotFoundError`` if the parent directory is missing and ``ValueError`` if ``path`` is
        a file or a directory holding files other than a checkpoint (never deleted).
        """
        dest = Path(path)
        parent = dest.parent
        if not parent.is_dir():
            raise FileNotFoundError(f"path: parent directory {parent} does not exist")
        if dest.exists():
            if not dest.is_dir():
                raise ValueError(f"path: {dest} exists and is not a directory")
            others = sorted(p.name for p in dest.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME))
            if others:
                raise ValueError(f"path: {dest} holds files other than a checkpoint {others}; "
                                 "refusing to replace it")
        cfg = self.config.to_dict()
        cfg["dtype"] = str(self.fc.weight.dtype).removeprefix("torch.")
        cfg.pop("torch_dtype", None)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        with atomic_dir(dest) as tmp:  # files fsynced before the rename publishes them
            save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
