"""The torch walk's attention: a chunk's queries against the prefix and its own keys, causal with
the diagonal at the bottom right (query i of a chunk at `start` sees keys up to start + i), in
torch with no mask materialised: on CUDA with half-precision inputs FlashAttention's op
(lower-right causal, grouped-query heads read in place); elsewhere SDPA's other backends.

Routing on CUDA with half-precision inputs follows ROUTES, measured per (head dim, dtype) by
scripts/h200-torch-attention.py: "sdpa-flash" (FlashAttention's op, the default for a case not
in the table), "sdpa" (SDPA's dispatcher, K/V repeated per group) or "kernels" (the project's
tensor-core kernels, attention_kernels.py, after their one-time self-check; SDPA's FlashAttention
op where it fails). MLXWALK_KERNELS=on or check routes to the kernels wherever they apply,
measured or not (on: a failed self-check raises); off never does.

It is registered with transformers as the attention implementation "mlxwalk" and takes no mask
from it (transformers then builds none): a window is one sequence, so causality is all the
mask there is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from . import nvrtc

NAME = "mlxwalk"
ROUTE_NAMES = ("sdpa-flash", "sdpa", "kernels")
# (head dim, dtype) -> route, for CUDA half-precision inputs, by scripts/h200-torch-attention.py
# (H100, bf16, one call; docs/BENCHMARKS.md): FlashAttention's op is the fastest at S = 16K and
# 64K at both head dims and both head shapes (d 256, 27B heads, 64K: 80 ms against the kernels'
# 105 and cuDNN's 104); the kernels hold half its memory (1.0 against 2.0 GiB there) but are
# 1.3-1.5x slower, so they are routed nowhere by time (MLXWALK_KERNELS=on sends them).
ROUTES: dict[tuple[int, str], str] = {
    (256, "bfloat16"): "sdpa-flash",
    (128, "bfloat16"): "sdpa-flash",
}


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
    how = route(query, key, value, dropout)
    if how == "kernels":
        from . import attention_kernels

        return attention_kernels.attention(query, key, value, scaling), None
    if how == "sdpa-flash":
        return _flash(query, key, value, scaling), None
    return _sdpa(query, key, value, scaling), None


def route(query, key, value, dropout: float = 0.0) -> str:
    """The route of a call: ROUTES' for its (head dim, dtype) where FlashAttention's op applies
    (the kernels only where they pass their self-check), else "sdpa"."""
    if not (_on_gpu(query) and _flash_applies(query, key, dropout)):
        return "sdpa"
    how = nvrtc.mode()
    dtype = str(query.dtype).rsplit(".", 1)[-1]
    wanted = ROUTES.get((query.shape[-1], dtype), "sdpa-flash")
    if how in ("on", "check") or (wanted == "kernels" and how == "auto"):
        from . import attention_kernels  # (only here: its launch tables import MLX)

        if attention_kernels.usable(query, key, value):
            return "kernels"
    return "sdpa" if wanted == "sdpa" else "sdpa-flash"


def _on_gpu(query) -> bool:
    return query.is_cuda


def _flash(query, key, value, scaling):
    """FlashAttention's own op: is_causal is lower-right there, and it takes the kv heads as
    they are (no copy of the prefix per query head); (B, q, H, D)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        query,
        key,
        value,
        0.0,
        is_causal=True,
        return_debug_mask=False,
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
    )[0]
    return out.transpose(1, 2).contiguous()


def _sdpa(query, key, value, scaling):
    """SDPA's dispatcher, lower-right causal, K/V repeated per group; (B, q, H, D)."""
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
    return out.transpose(1, 2).contiguous()  # (B, q, H, D)


def _flash_applies(query, key, dropout: float) -> bool:
    return (
        query.dtype in (torch.float16, torch.bfloat16)
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
