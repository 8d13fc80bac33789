"""The torch walk's attention: a chunk's queries against the prefix and its own keys, causal with
the diagonal at the bottom right (query i of a chunk at `start` sees keys up to start + i), in
torch with no mask materialised: on CUDA with half-precision inputs FlashAttention's op
(lower-right causal, grouped-query heads read in place); elsewhere SDPA's other backends.

It is registered with transformers as the attention implementation "mlxwalk" and takes no mask
from it (transformers then builds none): a window is one sequence, so causality is all the
mask there is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

NAME = "mlxwalk"


def walk_attention(
    module,
    query,
    key,
    value,
    attention_mask=None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window=None,
    **kwargs,
):
    """query (B, H, q, D), key and value (B, Hkv, S, D) with S >= q; (B, q, H, D), None."""
    if sliding_window:
        raise ValueError("the torch walk does not take sliding-window attention layers")
    if _flash_applies(query, key, dropout):
        # FlashAttention's own op: is_causal is lower-right there, and it takes the kv heads
        # as they are (no copy of the prefix per query head)
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query,
            key,
            value,
            0.0,
            is_causal=True,
            return_debug_mask=False,
            scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        )[0]
        return out.transpose(1, 2).contiguous(), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # FlashAttention's lower-right path takes equal head counts
        key = key.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        value = value.repeat_interleave(groups, dim=1)
    q, s = query.shape[2], key.shape[2]
    if q == s:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(q, s), scale=scaling
        )
    return out.transpose(1, 2).contiguous(), None  # (B, q, H, D)


def _flash_applies(query, key, dropout: float) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and not dropout
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and query.shape[1] % key.shape[1] == 0
    )


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, walk_attention)


def use(model) -> None:
    """Route the model's attention layers through walk_attention."""
    register()
    model.set_attn_implementation(NAME)
