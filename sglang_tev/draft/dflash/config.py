"""DFlash drafter configuration: :class:`DFlashConfig` (parse / write the z-lab ``config.json``,
check it against a target) and :func:`build_target_layer_ids` (z-lab's default feature layers).

The key tables and single-value checks live in :mod:`.config_keys`. Every error is a
``ValueError`` naming the offending key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..dflash2 import DFLASH2_ARCHITECTURES
from .config_keys import (
    _CONSUMED_KEYS,
    _DFLASH2_FIELDS,
    _DFLASH_CONFIG_KEYS,
    _DFLASH_CONFIG_NEUTRAL,
    _NEUTRAL_VALUES,
    _PASSTHROUGH_KEYS,
    _check_int,
    _check_neutral,
    _parse_dflash2_fields,
    _parse_rope_theta,
)

__all__ = ["ARCHITECTURE", "DFlashConfig", "build_target_layer_ids"]

ARCHITECTURE = "DFlashDraftModel"


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
