"""The target model as the runtime's forwards call it: its cache keyword, its attention layout and
mask format, its limits (positions, vocabulary, layers) and one forward over a static cache."""

from __future__ import annotations

import torch

from .masks import attention_layout, attention_mask_format
from ..compat import cache_kwarg_name

__all__ = ["TargetModel"]


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

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, masks, cache, hidden_states: bool, **kwargs):
        """``module(ids, position_ids=positions, attention_mask=masks, <cache_kw>=cache,
        use_cache=True, output_hidden_states=hidden_states, **kwargs)``; K/V go into ``cache``."""
        return self.module(ids, position_ids=positions, attention_mask=masks, **{self.cache_kw: cache}, use_cache=True,
                           output_hidden_states=hidden_states, **kwargs)

    def sync(self) -> None:
        """Wait for the device (CUDA only; CPU work is done when a call returns)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
