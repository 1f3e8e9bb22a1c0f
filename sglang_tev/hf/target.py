"""The target model as the runtime's forwards call it: its cache keyword, its attention layout and
mask format, its limits (positions, vocabulary, layers) and one forward over a static cache."""

from __future__ import annotations

import threading
import weakref
from typing import Sequence

import torch

from .masks import attention_layout, attention_mask_format
from ..compat import cache_kwarg_name

__all__ = ["TargetModel", "LayerTaps"]


class TargetModel:
    """A transformers causal LM wrapped for the prefill and the tree forwards.

    Args:
        module: the HF model (already in eval mode).

    Attributes:
        module, config, device, layout (:class:`~sglang_tev.hf.masks.AttentionLayout`),
        cache_kw: the KV-cache keyword of its forward (resolved once: signature inspection is not free),
        additive_masks: its attention implementation adds float masks (eager) instead of taking bool
            masks (SDPA).

    Raises:
        ValueError naming ``target``: attention layers the runtime cannot serve
        (:func:`~sglang_tev.hf.masks.attention_layout`).
    """

    def __init__(self, module) -> None:
        self.module = module
        self.config = module.config
        self.cache_kw = cache_kwarg_name(module)
        self.device = next(module.parameters()).device
        self.layout = attention_layout(self.config)
        self.additive_masks = getattr(self.config, "_attn_implementation", "sdpa") == "eager"
        # read per row per round; a transformers 5 config attribute read is slow (~2 us)
        self._max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self._taps: dict[tuple[int, ...], LayerTaps | None] = {}  # by layer ids; None: output_hidden_states

    @property
    def max_positions(self) -> int:
        return self._max_positions

    @property
    def vocab_size(self) -> int:
        return int(self.module.get_output_embeddings().weight.shape[0])

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.module.dtype

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype of additive masks: the model's, float32 for a non-float model."""
        dt = self.module.dtype
        return dt if dt.is_floating_point else torch.float32

    def attention_mask(self, masks):
        """Bool masks (True = attend) in the format its attention implementation takes."""
        return attention_mask_format(masks, self.float_dtype if self.additive_masks else None)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, masks, cache, layer_ids: Sequence[int] | None,
                **kwargs):
        """``module(ids, position_ids=positions, attention_mask=masks, <cache_kw>=cache,
        use_cache=True, **kwargs)``; K/V go into ``cache``.

        Returns:
            ``(output, features)``: the HF output, and the drafter's context features float
            [b, T, len(layer_ids) * hidden] (HF ``hidden_states[i + 1]`` for i in ``layer_ids``,
            concatenated on the last dim, DESIGN §4), or None when ``layer_ids`` is None.

        The features are read by forward hooks on those decoder layers (:class:`LayerTaps`) where
        that gives HF's tensors exactly, else through ``output_hidden_states=True`` (transformers
        5 then runs a hook on every layer and keeps every layer's output: ~0.1 ms of a 5 ms
        batch-1 round on the shipped pair's CPU target)."""
        kw = dict(position_ids=positions, attention_mask=masks, use_cache=True, **{self.cache_kw: cache}, **kwargs)
        if layer_ids is None:
            return self.module(ids, **kw), None
        taps = self._taps.get(tuple(layer_ids), False)
        if taps is False:
            taps = self._taps[tuple(layer_ids)] = LayerTaps.attach(self.module, layer_ids)
        if taps is None:
            out = self.module(ids, output_hidden_states=True, **kw)
            return out, torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        with taps:
            out = self.module(ids, **kw)
            return out, taps.features()

    def sync(self) -> None:
        """Wait for the device (CUDA only; CPU work is done when a call returns)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class LayerTaps:
    """Forward hooks that keep the outputs of a few decoder layers during one forward.

    transformers 5's ``output_hidden_states=True`` hooks every decoder layer and keeps all their
    outputs; the drafter reads two to five of them. These hooks sit on those layers only and
    are off (one attribute read) outside ``with taps:``. The hooks are shared by every
    :class:`TargetModel` over one module (made once per module and layer ids)
    and their state is per thread, so two generators over one module do not see each other's.

    Use :meth:`attach`; it returns None where hooks would not give HF's ``hidden_states[i + 1]``
    exactly, and the caller reads ``output_hidden_states`` instead.
    """

    # per module (weakly: a model dropped takes its taps with it; a deep copy gets its own)
    _by_module: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, layers, layer_ids: Sequence[int]) -> None:
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self._state = threading.local()
        self.modules = {i: layers[i] for i in sorted(set(self.layer_ids))}  # the layers hooked
        for i, layer in self.modules.items():
            layer.register_forward_hook(self._hook(i))

    @classmethod
    def attach(cls, module, layer_ids: Sequence[int]) -> "LayerTaps | None":
        """The taps of ``module``'s layers ``layer_ids`` (made once per module and layer ids), or
        None when hooks cannot stand in for ``output_hidden_states``: the model has no
        ``get_decoder().layers`` of ``num_hidden_layers`` entries, its decoder does not record
        ``hidden_states`` as the output (index 0) of its layers' class alone, or an id is the last
        layer (HF gives the final-normed output there) or outside the layers."""
        get = getattr(module, "get_decoder", None)
        decoder = get() if callable(get) else None
        layers = getattr(decoder, "layers", None)
        n = getattr(getattr(module, "config", None), "num_hidden_layers", None)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) != n:
            return None
        if not layer_ids or not all(isinstance(i, int) and 0 <= i < n - 1 for i in layer_ids):
            return None
        spec = (getattr(decoder, "_can_record_outputs", None) or {}).get("hidden_states")
        cls_ = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
        if cls_ is None or getattr(spec, "index", 0) != 0 or getattr(spec, "layer_name", None) is not None:
            return None
        # HF appends the output of every module of that class in call order: the layers must be all of them
        if not all(type(m) is cls_ for m in layers) or sum(isinstance(m, cls_) for m in decoder.modules()) != n:
            return None
        cache = cls._by_module.setdefault(module, {})
        key = tuple(layer_ids)
        taps = cache.get(key)
        if taps is None or any(layers[i] is not m for i, m in taps.modules.items()):
            taps = cache[key] = cls(layers, key)  # first use, or a layer was replaced since
        return taps

    def _hook(self, i: int):
        state = self._state

        def keep_output(module, args, output):
            got = getattr(state, "got", None)
            if got is not None:  # inside ``with taps:`` in this thread
                got[i] = output[0] if isinstance(output, tuple) else output
        return keep_output

    def __enter__(self) -> "LayerTaps":
        self._state.got = {}
        return self

    def __exit__(self, *exc) -> None:
        self._state.got = None

    def features(self) -> torch.Tensor:
        """The kept outputs concatenated in ``layer_ids`` order: [b, T, len(layer_ids) * hidden].

        Raises:
            RuntimeError: a tapped layer did not run in this forward.
        """
        got = self._state.got
        missing = [i for i in self.layer_ids if i not in got]
        if missing:
            raise RuntimeError(f"target layers {missing} did not run in the forward; cannot read their features")
        return torch.cat([got[i] for i in self.layer_ids], dim=-1)
