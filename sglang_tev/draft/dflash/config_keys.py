"""What a DFlash ``config.json`` may hold, and the checks on single values.

The key tables :meth:`~sglang_tev.draft.dflash.config.DFlashConfig.from_dict` parses against
(keys it reads, bookkeeping keys it keeps and writes back, keys accepted only with their neutral
value, the DFlash2 keys), and the value checks it and the dataclass share: integer ranges,
neutral values, RoPE theta, the DFlash2 fields. Each check raises ``ValueError`` naming the key.
Package-internal (names with a leading underscore); the public names are in
:mod:`sglang_tev.draft.dflash`.
"""

from __future__ import annotations

from typing import Any, Mapping


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
