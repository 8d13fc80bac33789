"""A chunk's gradient one layer at a time (the walk's recompute).

A forward with no gradient records each decoder layer's input (taps.recording), or the inputs
kept from the chunk's decode are replayed (taps.replaying, no layer run); the loss is
differentiated in the last layer's output; then each layer, last to first, is run again and
differentiated alone, at the gradient of its output plus its surrogate, and evaluated before the
next. Only one layer's graph ever exists, so the peak is one layer's graph on every backend: a
single graph with checkpointed layers is one evaluation, whose freed buffers MLX's CUDA backend
reclaims only as the GPU catches up. (Evaluating inside a VJP under `mx.grad` instead would keep
every layer's forward graph alive.)
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..ops import products
from .arch import Head
from .loss import head_loss, sliced_loss_and_grad
from .taps import Layers


def gradient(
    model: nn.Module,
    head: Head,
    caches: list,
    x,
    y,
    w,
    total: float,
    scored: bool,
    kept=None,
    sink: Callable[[int, list], None] | None = None,
    layers: Layers | None = None,
):
    """(loss share, gradient in the model's trainable parameters, per cache its taps' gradient),
    as `mx.value_and_grad` of the chunk's objective would give them. With `kept` (each layer's
    input from the chunk's decode, and the last layer's output), no layer runs forward first;
    with `kept` = [the stem's output] (the first trained layer's input), no stem layer does.
    With `sink`, each cache's taps' gradient goes to `sink(cache index, gradient)` as soon as its
    layer is differentiated (and that cache is done with), not into the list returned: a chunk
    then never holds more than one layer's."""
    for c in caches:
        c.bind(c.inputs())
    layers = layers or caches[0].layers  # the walk's (every cache carries it)
    # a whole decode's list holds at least one input and the last output: one array is the stem's
    stem_output = kept[0] if kept is not None and len(kept) == 1 else None
    replay = kept is not None and stem_output is None
    with layers.replaying(kept) if replay else layers.recording(stem_output) as calls:
        head.body(x, caches)
    names = {id(m): name for name, m in model.named_modules()}
    by_name: dict[str, mx.array] = {}

    def collect(module: nn.Module, grads: dict) -> None:
        by_name.update((f"{names[id(module)]}.{k}", g) for k, g in tree_flatten(grads))

    def head_objective(params, h):
        head.module.update(params)
        return head_loss(head, head.norm(h), y, w, total)

    last = calls[-1].out
    if scored and type(head.module) is products.SlicedLinear:  # frozen: no head gradient
        normed, norm_vjp = head.norm(last), lambda d: mx.vjp(head.norm, [last], [d])[1][0]
        loss, dn = sliced_loss_and_grad(head.module, normed, y, w, total)
        dy = norm_vjp(dn)
        mx.eval(loss, dy)
    elif scored:
        params = head.module.trainable_parameters()
        loss, (g_head, dy) = mx.value_and_grad(head_objective, argnums=(0, 1))(params, last)
        mx.eval(loss, g_head, dy)
        collect(head.module, g_head)
    else:
        loss, dy = mx.array(0.0), mx.zeros_like(last)
    index = {id(c): i for i, c in enumerate(caches)}
    g_inputs: list = [[] for _ in caches]

    def done(i: int, g_taps: list) -> None:  # a differentiated layer's taps, once it has run
        layers.settle()
        if sink is None:
            g_inputs[i] = g_taps
        else:
            sink(i, g_taps)

    ran = None  # the layer in flight: its taps go to the sink once the next one's graph is built
    for call in reversed(calls):
        differentiate = mx.grad(call.objective, argnums=(0, 1, 2))
        g_params, dy, g_taps = differentiate(
            call.layer.trainable_parameters(), call.x, call.cache.inputs(), dy
        )
        if ran is not None:
            done(*ran)
            ran = None  # its taps' gradient is the sink's now: not held through this layer
        layers.timed("backward", call.cache, [g_params, dy, g_taps])
        ran = (index[id(call.cache)], g_taps)
        collect(call.layer, g_params)
    if ran is not None:
        done(*ran)
    grads = tree_map_with_path(lambda path, _: by_name[path], model.trainable_parameters())
    return loss, grads, g_inputs
