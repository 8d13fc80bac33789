"""A chunk's loss: sum(w * CE) / sum(w) over the window, from logits or from hidden states."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from ..ops import products
from . import arch
from .algorithm import loss_blocks


def weighted_loss(
    logits: mx.array, targets: mx.array, weights: mx.array, total: float, per_target=False
):
    """sum(w * CE) / total, in float32. Targets and weights (1, n), or (1, n, T) for T targets a
    position (Window.of_targets); `per_target`: the (T,) sums, one a target column, for scoring.

    On a GPU, MLX's fused cross-entropy reads the logits in their own dtype and accumulates in
    float32: no float32 copy of the chunk's logits (chunk x vocabulary) and a gradient in their
    dtype. The CPU has no fused kernel (its fallback reduces in the logits' dtype), so there the
    logits are cast first."""
    if targets.ndim == logits.ndim:  # several targets a position
        lse = mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)  # (1, n, 1)
        ce = lse - mx.take_along_axis(logits, targets, axis=-1).astype(mx.float32)  # (1, n, T)
    elif mx.default_device() == mx.gpu:
        ce = mx.fast.cross_entropy(logits, targets)
    else:
        ce = nn.losses.cross_entropy(logits.astype(mx.float32), targets, reduction="none")
    return reduce(ce * weights, per_target) / total


def reduce(terms: mx.array, per_target: bool) -> mx.array:
    """The weighted terms summed: a scalar, or per target column (T,)."""
    if not per_target:
        return terms.sum()
    return terms.sum(axis=(0, 1)) if terms.ndim == 3 else terms.sum()[None]  # (T,)


def head_loss(
    head: arch.Head, h: mx.array, targets, weights, total: float, per_target=False
) -> mx.array:
    """weighted_loss of the logits `head.project(h)`, in the blocks of algorithm.loss_blocks,
    each checkpointed: the chunk's logits are never all alive, in the forward or in the backward.
    A dequantized head is dequantized once for all of them (ops.products.held); a sliced one a
    slice of its vocabulary at a time (sliced_cross_entropy)."""
    blocks = loss_blocks(h.shape[1])
    if type(head.module) is products.SlicedLinear:
        return (
            sum(
                reduce(
                    sliced_cross_entropy(head.module, h[:, b], targets[:, b]) * weights[:, b],
                    per_target,
                )
                for b in blocks
            )
            / total
        )
    project = products.held(head.module, head.project)
    if len(blocks) == 1:
        return weighted_loss(project(h), targets, weights, total, per_target)

    def block_loss(b: slice) -> mx.array:
        def loss(params, hb):  # targets and weights are constants: closed over
            head.module.update(params)  # a checkpoint takes closed-over arrays as constants
            return weighted_loss(project(hb), targets[:, b], weights[:, b], total, per_target)

        return mx.checkpoint(loss)(head.module.trainable_parameters(), h[:, b])

    return sum(block_loss(b) for b in blocks)


def sliced_cross_entropy(head: products.SlicedLinear, h: mx.array, targets: mx.array) -> mx.array:
    """Cross-entropy (float32) of the logits `head(h)`, h (1, n, hidden) and targets (1, n) or
    (1, n, T), from the head's vocabulary slices: each slice's logsumexp and target logits in a
    checkpoint of its own, so one slice's dequantized rows and logits are alive at a time, in the
    forward and in the backward (which computes each slice's product again, as the blocks'
    checkpoints do). The same products as the whole head's: only the rounding of the sums
    differs."""
    several = targets.ndim == 3
    columns = targets if several else targets[..., None]  # (1, n, T)

    def scores(s: slice):
        def part(h):  # targets are constants: closed over
            logits = head.logits(h, s).astype(mx.float32)  # (1, n, rows of s)
            inside = (columns >= s.start) & (columns < s.stop)  # (1, n, T)
            at = mx.clip(columns - s.start, 0, logits.shape[-1] - 1)  # (1, n, T)
            picked = mx.take_along_axis(logits, at, axis=-1)  # (1, n, T)
            lse = mx.logsumexp(logits, axis=-1, keepdims=True)  # (1, n, 1)
            # one output: nothing outside the slice reads its logits
            return mx.stack([mx.broadcast_to(lse, picked.shape), mx.where(inside, picked, 0.0)])

        return mx.checkpoint(part)(h)  # (2, 1, n, T)

    parts = mx.stack([scores(s) for s in head.vocab_slices()], axis=1)  # (2, slices, 1, n, T)
    ce = mx.logsumexp(parts[0], axis=0) - parts[1].sum(axis=0)  # (1, n, T)
    return ce if several else ce[..., 0]


def sliced_loss_and_grad(
    head: products.SlicedLinear, h: mx.array, targets, weights, total: float
) -> tuple[mx.array, mx.array]:
    """head_loss of a sliced head and its gradient in h, outside any transformation, one slice
    evaluated at a time: its logsumexp and target logits first, then, with the window's
    logsumexp known, its share of the gradient (its product computed again). A graph of all the
    slices, even checkpointed, holds them all at once on a GPU, where buffers come back only
    once the graph has run: on an H100 it peaked at 14.67 GiB over its inputs for the 27B
    shape's head at a chunk of 2,048, against 2.88 for the held head (docs/BENCHMARKS.md). Here
    one slice's rows and logits are alive at a time. The head's parameters take no gradient (a
    quantized head is frozen). h (1, n, hidden); targets and weights (1, n) or (1, n, T)."""
    several = targets.ndim == 3
    columns = targets if several else targets[..., None]  # (1, n, T)
    w = weights if several else weights[..., None]  # (1, n, T)

    def part(h: mx.array, s: slice) -> tuple[mx.array, mx.array]:
        logits = head.logits(h, s).astype(mx.float32)  # (1, n, rows of s)
        inside = (columns >= s.start) & (columns < s.stop)  # (1, n, T)
        at = mx.clip(columns - s.start, 0, logits.shape[-1] - 1)  # (1, n, T)
        picked = mx.where(inside, mx.take_along_axis(logits, at, axis=-1), 0.0)  # (1, n, T)
        return mx.logsumexp(logits, axis=-1, keepdims=True), picked  # (1, n, 1), (1, n, T)

    slices = head.vocab_slices()
    lse_s, picked = [], mx.zeros(columns.shape, mx.float32)
    for s in slices:
        a, b = part(h, s)
        picked = picked + b
        lse_s.append(a)
        mx.eval(a, picked)  # this slice's logits go before the next slice's come
    lse = mx.logsumexp(mx.stack(lse_s), axis=0)  # (1, n, 1)
    loss = ((lse - picked) * w).sum() / total
    d_ce = w / total  # (1, n, T)
    d_lse, d_picked = d_ce.sum(axis=-1, keepdims=True), -d_ce  # (1, n, 1), (1, n, T)
    dh = mx.zeros(h.shape, mx.float32)
    for s, a in zip(slices, lse_s):
        share = d_lse * mx.exp(a - lse)  # d lse / d a: the slice's share of the softmax
        _, (g,) = mx.vjp(lambda x, s=s: part(x, s), [h], [share, d_picked])
        dh = dh + g.astype(mx.float32)  # (1, n, hidden)
        mx.eval(dh)
    return loss, dh.astype(h.dtype)
