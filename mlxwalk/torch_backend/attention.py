"""The torch walk's attention: a chunk's queries against the prefix and its own keys, causal with
the diagonal at the bottom right (query i of a chunk at `start` sees keys up to start + i), in
torch's SDPA with no mask materialised. On CUDA with half-precision inputs that is
FlashAttention's kernel (torch's lower-right causal variant); elsewhere SDPA's other backends.

It is registered with transformers as the attention implementation "mlxwalk" and takes no mask
from it (transformers then builds none): a window is one sequence, so causality is all the
mask there is.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

NAME = "mlxwalk"


def walk_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                   scaling: float | None = None, sliding_window=None, **kwargs):  # fmt: skip
    """query (B, H, q, D), key and value (B, Hkv, S, D) with S >= q; (B, q, H, D), None."""
    if sliding_window:
        raise ValueError("the torch walk does not take sliding-window attention layers")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # FlashAttention's lower-right path takes equal head counts
        key = key.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        value = value.repeat_interleave(groups, dim=1)
    q, s = query.shape[2], key.shape[2]
    if q == s:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q, s),
                                             scale=scaling)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # (B, q, H, D)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, walk_attention)


def use(model) -> None:
    """Route the model's attention layers through walk_attention."""
    register()
    model.set_attn_implementation(NAME)
