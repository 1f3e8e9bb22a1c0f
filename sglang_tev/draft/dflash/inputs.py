"""What the drafter is fed besides its block: the target's context features
(:func:`extract_context_features`) and, in training, the attention mask over many blocks
(:func:`block_train_mask`).

Letters: b batch, T tokens, S sequence length, K block size, H hidden size,
n = len(target_layer_ids) (or the number of blocks, in :func:`block_train_mask`).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["extract_context_features", "block_train_mask"]


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
