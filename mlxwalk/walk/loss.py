"""A chunk's loss: sum(w * CE) / sum(w) over the window, from logits or from hidden states."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from ..ops import products
from . import arch
from .algorithm import loss_blocks


def weighted_loss(logits: mx.array, targets: mx.array, weights: mx.array, total: float):
    """sum(w * CE) / total, in float32.

    On a GPU, MLX's fused cross-entropy reads the logits in their own dtype and accumulates in
    float32: no float32 copy of the chunk's logits (chunk x vocabulary) and a gradient in their
    dtype. The CPU has no fused kernel (its fallback reduces in the logits' dtype), so there the
    logits are cast first."""
    if mx.default_device() == mx.gpu:
        ce = mx.fast.cross_entropy(logits, targets)
    else:
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="none")
    return (ce * weights).sum() / total


def head_loss(head: arch.Head, h: mx.array, targets, weights, total: float) -> mx.array:
    """weighted_loss of the logits `head.project(h)`, in the blocks of algorithm.loss_blocks,
    each checkpointed: the chunk's logits are never all alive, in the forward or in the backward.
    A dequantized head is dequantized once for all of them (ops.products.held)."""
    project = products.held(head.module, head.project)
    blocks = loss_blocks(h.shape[1])
    if len(blocks) == 1:
        return weighted_loss(project(h), targets, weights, total)

    def block_loss(b: slice) -> mx.array:
        def loss(params, hb):  # targets and weights are constants: closed over
            head.module.update(params)  # a checkpoint takes closed-over arrays as constants
            return weighted_loss(project(hb), targets[:, b], weights[:, b], total)

        return mx.checkpoint(loss)(head.module.trainable_parameters(), h[:, b])

    return sum(block_loss(b) for b in blocks)
