"""Run configuration of ``python -m sglang_tev.train``: schema, YAML loading, ``key=value`` overrides.

A run config is a YAML mapping (DESIGN §6). Every key is validated here, before any model is
loaded: an unknown key, a value of the wrong type or out of range raises :class:`ConfigError`
naming the dotted key (``loss.exit.mode``, ``draft.num_hidden_layers``, ...). Overrides are
``dotted.key=value`` strings whose value is parsed as a YAML scalar/flow value
(``lr=3e-4``, ``loss_decay_gamma=null``, ``draft.target_layer_ids=[1,3]``).

The schema is the tree of frozen dataclasses below; ``docs/training.md`` lists every key.
Packaged recipes (``recipes/*.yaml``, :func:`load_recipe`) are the settings of the project's own
runs, read by the scripts that run them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from ..paths import creatable_dir_problem
from ..spec import MAX_BUDGET

__all__ = ["ConfigError", "TrainConfig", "DraftArchConfig", "LossConfig", "ExitLossConfig", "SelectorLossConfig", "RolloutConfig",
           "load_config", "parse_overrides", "config_to_dict", "schema_default", "RECIPES", "load_recipe"]


class ConfigError(ValueError):
    """A run-config problem; ``key`` is the dotted key at fault (``""`` for the whole config)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config key {key!r}: {message}" if key else f"config: {message}")


# -- range checks (field metadata "check": value -> error message or None) ----------------------

def _ge(lo):
    return lambda v: None if v >= lo else f"must be >= {lo}, got {v!r}"


def _gt(lo):
    return lambda v: None if v > lo else f"must be > {lo}, got {v!r}"


def _in01(v):
    return None if 0.0 <= v <= 1.0 else f"must be in [0, 1], got {v!r}"


def _in01_open(v):
    return None if 0.0 <= v < 1.0 else f"must be in [0, 1), got {v!r}"


def _nonempty(v):
    return None if v.strip() else "must be a non-empty string"


def _device(v):
    if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
        return None
    return f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {v!r}"


def _f(default: Any = dataclasses.MISSING, *, check=None, key: str | None = None,
       factory=None, doc: str = ""):
    meta = {"check": check, "key": key, "doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DraftArchConfig:
    """Architecture of a freshly initialised drafter (``draft:``; ignored with ``draft_init``).

    ``None`` fields take the target's value (hidden size is always the target's: the drafter
    reads the target's embeddings and LM head). ``target_layer_ids`` None: z-lab's default
    (:func:`sglang_tev.draft.dflash.build_target_layer_ids`). ``mask_token_id`` None: the target
    tokenizer's ``mask_token_id``. ``block_size`` None: the top-level ``block_size`` (or 16).
    """

    num_hidden_layers: int = _f(1, check=_ge(1))
    intermediate_size: int | None = _f(None, check=_ge(1))
    block_size: int | None = _f(None, check=_ge(2))
    target_layer_ids: list[int] | None = _f(None)
    mask_token_id: int | None = _f(None, check=_ge(0))
    num_attention_heads: int | None = _f(None, check=_ge(1))
    num_key_value_heads: int | None = _f(None, check=_ge(1))
    head_dim: int | None = _f(None, check=_ge(2))
    init_std: float = _f(0.02, check=_gt(0.0), doc="std of the normal init of Linear weights")
    # DFlash2: checked by DFlashConfig (the same rules as loading a checkpoint)
    architecture: Literal["DFlashDraftModel", "DFlash2DraftModel"] = _f(
        "DFlashDraftModel", doc="DFlash2DraftModel: grouped conv, logit transform, candidate selector")
    conv_kernel_size: int | None = _f(None, check=_ge(1), doc="DFlash2 conv taps (with conv_group_size)")
    conv_group_size: int | None = _f(None, check=_ge(1), doc="DFlash2 conv channels per group; divides hidden")
    selector_rank: int | None = _f(None, check=_ge(1), doc="DFlash2 selector codebook rank (with selector_top_k)")
    selector_top_k: int | None = _f(None, check=_ge(1), doc="DFlash2 selector candidates per slot")
    output_multiplier: float = _f(1.0, check=_gt(0.0), doc="DFlash2 draft logits x this ...")
    final_logit_softcapping: float | None = _f(None, check=_gt(0.0), doc="... then c * tanh(logits / c)")


@dataclass(frozen=True)
class SelectorLossConfig:
    """DFlash2's candidate-selector term (``loss += weight * L_sel``; only for a drafter with a
    selector, ignored otherwise): a k-way CE of the selector's scores over the slot's top-k
    candidates after the TRUE predecessor token (teacher-forced; SpecForge PR #772,
    ``dflash2_selector_loss_alpha``). ``labels``: ``data`` (the label token; SpecForge) or
    ``target`` (the frozen target's law restricted to the candidates: the distillation analogue).
    ``gold`` (data labels): ``strict`` (slots whose label is not a candidate carry no selector loss,
    SpecForge's current rule) or ``insert`` (the label replaces the last candidate, PR #772's
    first rule). Slot weights: the dense terms' ``keep · decay``; own denominator.
    """

    weight: float = _f(1.0, check=_ge(0.0))
    labels: Literal["data", "target"] = _f("data")
    gold: Literal["strict", "insert"] = _f("strict")


@dataclass(frozen=True)
class ExitLossConfig:
    """ExitTrain's tree term (DESIGN §6, paper Eq. 14-15): ``loss += lambda * L_exit``.

    ``mode``: ``none`` (dense loss only), ``exit`` (weights w(v) = P(v)·rho(v), the paper),
    ``prefix`` (the paper's reachability control: P(v) rescaled to the exit weights' total),
    ``reach`` (plain P(v): the reference recipes' ``P_tgt``) or ``exit_depth``
    (P(v)·rho(v)·depth(v): the reference code's ``exit`` option). ``lambda``: λ_exit (the paper
    states no value; 0.1 is the reference recipes'). ``temperature``: of the target law the
    weights are computed from (1.0 as the reference code; the paper does not state it; < 1e-5:
    the greedy one-hot law). ``budget``: the inference tree budget B the trees are built with (paper: 64).
    ``include_horizon_leaves``: keep the nodes at the maximum draft depth (the paper's default).
    ``anchors_per_forward``: anchors whose trees share one target tree forward (null: as many as
    keep the mask under 256 MiB).
    """

    mode: Literal["none", "exit", "prefix", "reach", "exit_depth"] = _f("none")
    lambda_: float = _f(0.1, key="lambda", check=_ge(0.0))
    temperature: float = _f(1.0, check=_ge(0.0))
    budget: int = _f(64, check=lambda v: None if 1 <= v <= MAX_BUDGET else f"must be in [1, {MAX_BUDGET}] "
                                                                           f"(the runtime's largest budget), got {v!r}")
    include_horizon_leaves: bool = _f(True)
    anchors_per_forward: int | None = _f(None, check=_ge(1))
    tree: Literal["auto", "marginal", "lattice"] = _f(
        "auto", doc="the trees of the term: auto = the selector lattice for a DFlash2 drafter with a "
                    "selector (the draft log-q of a node is its lattice transition), else marginal (DDTree)")


@dataclass(frozen=True)
class RolloutConfig:
    """Online target rollouts (``rollout:``): the frozen target answers the prompts once, the
    responses are cached as jsonl and trained on with a response-only loss (paper App. D).

    ``prompts``: jsonl with ``messages`` (a chat ending in a user turn) or ``prompt`` (text) per
    line. ``cache``: the responses (null: ``<output_dir>/rollouts.jsonl``); an existing cache made
    with the same settings is reused and a partial one is completed. Sampling as plain decoding:
    ``temperature`` (0 = greedy), ``top_k`` (0 = off), ``top_p``.
    """

    prompts: str = _f(check=_nonempty)
    cache: str | None = _f(None, check=_nonempty)
    max_new_tokens: int = _f(256, check=_ge(1))
    temperature: float = _f(1.0, check=_ge(0.0))
    top_k: int = _f(0, check=_ge(0))
    top_p: float = _f(1.0, check=lambda v: None if 0.0 < v <= 1.0 else f"must be in (0, 1], got {v!r}")
    batch_size: int = _f(16, check=_ge(1))
    limit: int | None = _f(None, check=_ge(1), doc="use the first N usable prompts")
    chat_template: bool = _f(True, doc="render `prompt` rows with the tokenizer's chat template when it has one")
    seed: int = _f(0, check=_ge(0))


@dataclass(frozen=True)
class LossConfig:
    token_weight: float = _f(1.0, check=_ge(0.0), doc="weight of the CE on the data tokens")
    distill_weight: float = _f(0.0, check=_ge(0.0),
                               doc="weight of the soft-target CE against the frozen target's own "
                                   "next-token distribution at each label position")
    exit: ExitLossConfig = _f(factory=ExitLossConfig)
    selector: SelectorLossConfig = _f(factory=SelectorLossConfig)


@dataclass(frozen=True)
class TrainConfig:
    """One training run (DESIGN §6). Required: ``target``, ``output_dir``, ``max_steps`` and
    exactly one of ``data`` / ``rollout``.

    Units: steps are optimizer updates; ``seq_len``/``block_size`` are tokens; ``batch_size`` is
    sequences per rank per step (the global batch, batch_size x world size, is what a resume on
    another world size must keep); ``num_anchors`` is blocks per sequence (upper bound);
    ``lr`` is the peak learning rate.
    """

    target: str = _f(check=_nonempty, doc="HF causal LM directory (frozen)")
    output_dir: str = _f(check=_nonempty)
    max_steps: int = _f(check=_ge(1))
    data: str | None = _f(None, check=_nonempty, doc=".npy token ids or .jsonl with text / messages "
                                                    "(exactly one of data and rollout)")
    draft_init: str | None = _f(None, doc="z-lab drafter directory to warm start from")
    draft: DraftArchConfig | None = _f(None)
    eval_data: str | None = _f(None)
    seq_len: int = _f(512, check=_ge(2))
    batch_size: int = _f(4, check=_ge(1))
    num_anchors: int = _f(64, check=_ge(1))
    block_size: int | None = _f(None, check=_ge(2), doc="None: the drafter's block size")
    loss_decay_gamma: float | None = _f(None, check=_gt(0.0))
    lr: float = _f(6e-4, check=_gt(0.0))
    min_lr_ratio: float = _f(0.1, check=_in01)
    weight_decay: float = _f(0.0, check=_ge(0.0))
    betas: list[float] = _f(factory=lambda: [0.9, 0.95])
    warmup_ratio: float | None = _f(None, check=_in01_open,
                                   doc="linear warmup as a share of max_steps (null: 0.04, unless warmup_steps is set)")
    warmup_steps: int | None = _f(None, check=_ge(0))
    grad_clip: float | None = _f(1.0, check=_gt(0.0))
    seed: int = _f(0, check=_ge(0))
    threads: int | None = _f(None, check=_ge(1))
    allow_thread_change: bool = _f(False)
    save_every: int = _f(100, check=_ge(1))
    keep_checkpoints: int = _f(2, check=_ge(1))
    eval_every: int = _f(0, check=_ge(0))
    eval_windows: int = _f(32, check=_ge(1))
    eval_stride: int = _f(4, check=_ge(1))
    eval_budget: int | None = _f(64, check=lambda v: None if 0 <= v <= MAX_BUDGET else f"must be in [0, {MAX_BUDGET}], got {v!r}",
                                 doc="DDTree budget of the evaluation's expected block length 1 + C_p (null: off)")
    eval_temperatures: list[float] = _f(factory=lambda: [0.0, 1.0],
                                        doc="target temperatures of the evaluation's 1 + C_p")
    log_every: int = _f(1, check=_ge(1))
    dtype: Literal["auto", "float32", "bfloat16"] = _f("auto")
    device: str = _f("auto", check=_device)
    export_dtype: Literal["float32", "bfloat16"] | None = _f(None)
    resume: str = _f("auto", check=_nonempty, doc="'auto', 'never' or a checkpoint directory")
    stop_at_step: int | None = _f(None, check=_ge(1))
    progress: bool = _f(True)
    tensorboard: bool = _f(True)
    loss: LossConfig = _f(factory=LossConfig)
    rollout: RolloutConfig | None = _f(None)

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        if self.warmup_ratio is not None and self.warmup_steps is not None:
            raise ConfigError("warmup_steps", "set warmup_ratio or warmup_steps, not both")
        if self.draft_init is not None and self.draft is not None:
            raise ConfigError("draft", "set draft_init (warm start) or draft (fresh init), not both")
        if (self.data is None) == (self.rollout is None):
            raise ConfigError("data", "set exactly one of data (a token / text file) and rollout "
                                      "(target responses to prompts)" +
                              ("; neither is set" if self.data is None else "; both are set"))
        if self.draft is not None and self.draft.target_layer_ids is not None:
            if not self.draft.target_layer_ids or any(i < 0 for i in self.draft.target_layer_ids):
                raise ConfigError("draft.target_layer_ids",
                                  f"must be a non-empty list of ints >= 0, got "
                                  f"{self.draft.target_layer_ids!r}")
        if any(t < 0 for t in self.eval_temperatures):
            raise ConfigError("eval_temperatures", f"must be numbers >= 0, got {self.eval_temperatures!r}")
        if self.loss.token_weight == 0 and self.loss.distill_weight == 0:
            raise ConfigError("loss", "token_weight and distill_weight are both 0: nothing to train")
        if os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise ConfigError("output_dir", f"{self.output_dir!r} exists and is not a directory")
        problem = creatable_dir_problem(self.output_dir)  # before any data is read or tokenized
        if problem is not None:
            raise ConfigError("output_dir", problem)
        if self.resume not in ("auto", "never") and not os.path.isdir(self.resume):
            raise ConfigError("resume", f"must be 'auto', 'never' or a checkpoint directory; "
                                        f"{self.resume!r} is not a directory")

    # -- derived values ---------------------------------------------------------------------
    @property
    def warmup(self) -> int:
        """Warmup length in steps (``warmup_steps``, else ``round(warmup_ratio * max_steps)``,
        default ratio 0.04 as SpecForge's DFlash recipe)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        ratio = 0.04 if self.warmup_ratio is None else self.warmup_ratio
        return int(round(ratio * self.max_steps))


# -- generic dataclass <- dict with validation ----------------------------------------------------

def _key_of(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str) -> Any:
    """Check ``value`` against type ``tp``; returns the (possibly converted) value."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(key, f"must be {_type_name(tp)}, got null")
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError:
                if len([x for x in args if x is not type(None)]) == 1:
                    raise
        raise ConfigError(key, f"must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"must be one of {list(args)}, got {value!r}")
    if origin is list:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ConfigError(key, f"must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            return int(value)  # 1e4 written in YAML
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, f"must be a number, got {value!r}") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(key, f"must be a finite number, got {value!r}")
            return float(value)
        raise ConfigError(key, f"must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise ConfigError(key, f"must be a string, got {value!r}")
    raise TypeError(f"unsupported schema type {tp!r} for {key}")  # a bug in the schema


def _build(cls, data: Mapping[str, Any], prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {_key_of(f): f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        raise ConfigError(f"{prefix}{k}", f"unknown key (known under {prefix.rstrip('.') or 'the top level'}: "
                                          f"{', '.join(sorted(fields))})")
    kwargs = {}
    for k, f in fields.items():
        key = f"{prefix}{k}"
        if k not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(key, "is required")
            continue
        value = _coerce(data[k], hints[f.name], key)
        check = f.metadata.get("check")
        if check is not None and value is not None:
            msg = check(value)
            if msg:
                raise ConfigError(key, msg)
        kwargs[f.name] = value
    return cls(**kwargs)


def config_to_dict(cfg) -> dict[str, Any]:
    """Plain nested dict of a config dataclass, with YAML key names (``loss.exit.lambda``)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[_key_of(f)] = config_to_dict(v) if dataclasses.is_dataclass(v) else \
            (list(v) if isinstance(v, (list, tuple)) else v)
    return out


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=null"]`` -> ``{"a": {"b": 1}, "c": None}`` (values parsed as YAML).

    Raises :class:`ConfigError` for an item without ``=`` or with an empty key, or a value that
    is not valid YAML.
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError("", f"override {item!r} must be key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise ConfigError(key, f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(key, f"value {raw!r} is not valid YAML ({e})") from None
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(parts[:i + 1]), "is set to a scalar and used as a mapping")
            node = nxt
        node[parts[-1]] = value
    return out


def _merge(base: dict, upd: Mapping, prefix: str = "") -> dict:
    out = dict(base)
    for k, v in upd.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v, f"{prefix}{k}.")
        else:
            out[k] = v
    return out


def load_config(source: str | os.PathLike | Mapping[str, Any] | TrainConfig | None = None,
                overrides: Sequence[str] | Mapping[str, Any] = ()) -> TrainConfig:
    """Build a validated :class:`TrainConfig`.

    Parameters
    ----------
    source : a YAML file path, a mapping, a ``TrainConfig`` (re-validated with the overrides), or
        None (every required key then comes from ``overrides``).
    overrides : ``["dotted.key=value", ...]`` or a nested mapping, merged over ``source``.

    Raises :class:`ConfigError` (a ``ValueError``) naming the key; ``FileNotFoundError`` for a
    missing config file.
    """
    if source is None:
        data: dict = {}
    elif isinstance(source, TrainConfig):
        data = config_to_dict(source)
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"config: no file at {os.fspath(path)!r}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError("", f"{path} is not valid YAML ({e})") from None
        if not isinstance(data, Mapping):
            raise ConfigError("", f"{path} must hold a mapping, got {type(data).__name__}")
    upd = parse_overrides(overrides) if not isinstance(overrides, Mapping) else overrides
    return _build(TrainConfig, _merge(data, upd))


def schema_default(dotted: str) -> Any:
    """The schema default of a dotted config key (``loss.exit.temperature`` -> 1.0); a sentinel
    object (equal to nothing) for a required or unknown key."""
    cls, parts = TrainConfig, dotted.split(".")
    for i, part in enumerate(parts):
        f = next((f for f in dataclasses.fields(cls) if _key_of(f) == part), None)
        if f is None:
            return object()
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            return object()
        if i == len(parts) - 1:
            return value
        if not dataclasses.is_dataclass(value):
            return object()
        cls = type(value)
    return object()


# Packaged recipes: YAML files under sglang_tev/train/recipes/ (package data).
RECIPES = Path(__file__).resolve().parent / "recipes"


def load_recipe(name: str) -> dict:
    """The packaged recipe ``recipes/<name>.yaml`` as a mapping (a recipe is read by the scripts
    that run it: ``scripts/build_tiny_code.py``, ``benchmarks/exittrain_experiment.py``).
    Raises ``FileNotFoundError`` naming the known recipes."""
    path = RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise FileNotFoundError(f"recipe: no packaged recipe {name!r} (known: {', '.join(known) or 'none'})")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, Mapping):
        raise ConfigError("", f"{path} must hold a mapping, got {type(data).__name__}")
    return data
