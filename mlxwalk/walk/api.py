"""The walk's public entry points: a window's loss, its gradient (by either walk or as one graph,
the reference), and one training step on it."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn
from mlx.utils import tree_flatten

from .._blas import first_use
from ..errors import ConfigError
from ..ops.delta import fast_recurrence
from ..ops.products import dequantized_products
from ..plan import cut
from .config import WALKS, WalkConfig
from .exact import ExactWalk
from .guards import NonFinite, check_finite  # noqa: F401  (NonFinite: raised from here)
from .loss import weighted_loss
from .plain import PlainWalk
from .runner import ChunkRunner, walking, window_arrays
from .window import Window


@first_use
def window_loss(model: nn.Module, window: Window, config: WalkConfig, layout=None) -> float:
    """The window's loss, decoded chunk by chunk with no gradient (for evaluation)."""
    runner = ChunkRunner(model, window, config, layout)
    chunks = cut(window.labels, runner.config.chunk, runner.config.follow_runs)
    losses: list = []
    with walking(model, runner.config.products):
        runner.new_store(chunks[-1].end)
        state = runner.zero_state()
        for chunk in chunks:
            state = runner.decode(chunk, state, losses=losses)
    return float(sum(v.item() for v in losses))


@first_use
def one_graph(model: nn.Module, window: Window, products: str = "auto") -> tuple[mx.array, dict]:
    """The reference: the whole window as one graph, no cache, its quantized products as the
    walk's (ops.products)."""
    x, y, w = window_arrays(window, 0, len(window))

    def objective(params):
        model.update(params)
        return weighted_loss(model(x), y, w, window.total)

    with fast_recurrence(model), dequantized_products(model, products):
        return mx.value_and_grad(objective)(model.trainable_parameters())


@first_use
def window_gradient(
    model: nn.Module,
    inputs,
    targets,
    weights,
    *,
    chunk: int,
    walk: str = "exact",
    cache_type: str = "float32",
    horizon: int = 0,
    recompute: bool = False,
    host_budget_mib: float | None = None,
    memory_budget_mib: float | None = None,
    accumulator_dtype: str = "float32",
    attention: str = "auto",
    keep_inputs: str = "auto",
    products: str = "auto",
) -> tuple[float, dict]:
    """The window's loss sum(w * CE) / sum(w) and its gradient in `model.trainable_parameters()`.

    walk="exact" walks the window in chunks and equals "one-graph" to rounding; "plain" returns the
    sum of its per-chunk gradients at the unchanged adapter. Raises ValueError for a window with no
    labelled position, chunk < 1, or lengths that differ.
    """
    if walk not in WALKS:
        raise ConfigError(f"walk {walk!r} is unknown; choose one of {', '.join(WALKS)}")
    check_trainable(model)
    window = Window.of(inputs, targets, weights)
    config = WalkConfig(
        chunk=chunk,
        horizon=horizon,
        cache_type=cache_type,
        recompute=recompute,
        host_budget_mib=host_budget_mib,
        memory_budget_mib=memory_budget_mib,
        accumulator_dtype=accumulator_dtype,
        attention=attention,
        keep_inputs=keep_inputs,
        products=products,
    ).check()
    if walk == "one-graph":
        loss, grads = one_graph(model, window, products)
    elif walk == "exact":
        loss, grads = ExactWalk(model, window, config).run()
    else:
        loss, grads = PlainWalk(model, window, config).run()
    mx.eval(loss, grads)
    return loss.item(), grads


@first_use
def train_window(
    model: nn.Module,
    optimizer,
    window: Window,
    config: WalkConfig,
    walk: str = "exact",
    on_chunk: Callable[[str, int, int], None] | None = None,
    layout=None,  # the model's arch.Layout, when the caller has it (else read per window)
    clip: float | None = None,  # each step's gradient clipped to this global L2 norm
):
    """Train on one window: the exact walk takes one step, the plain walk one per labelled chunk.
    A refusal (memory, bad input) is raised before any array of the window exists or any step is
    taken (a memory budget's probe, run once per model and chunk size, comes first); a NaN or
    infinite loss or gradient raises NonFinite before the step that would apply it (the plain
    walk may have stepped on the window's earlier chunks).
    Returns the walk, whose `loss` holds the window's loss (at the adapter it started from)."""

    check_trainable(model)

    def step(grads) -> None:
        apply_step(model, optimizer, grads, clip)

    if walk == "exact":
        runner, grads = exact_gradient(model, window, config, on_chunk, layout)
        step(grads)
    elif walk == "plain":
        runner = PlainWalk(model, window, config, layout)
        runner.on_chunk = on_chunk
        loss, _ = runner.run(step=step)
        runner.loss = loss.item()
    else:
        raise ConfigError(f"walk {walk!r} cannot train; choose exact or plain")
    mx.eval(model.parameters(), optimizer.state)
    return runner


def check_trainable(model: nn.Module) -> None:
    """The gradient is taken in the model's trainable parameters: a frozen model has none."""
    if not tree_flatten(model.trainable_parameters()):
        raise ConfigError(
            "model has no trainable parameters (it is frozen): add LoRA layers (mlx-lm's "
            "linear_to_lora_layers) or unfreeze the parameters to train"
        )


@first_use
def exact_gradient(model, window: Window, config: WalkConfig, on_chunk=None, layout=None):
    """The exact walk's gradient of one window, checked finite (NonFinite otherwise); the walk
    is returned with its `loss` set, for a caller that steps on several windows at once."""
    runner = ExactWalk(model, window, config, layout)
    runner.on_chunk = on_chunk
    loss, grads = runner.run()
    check_finite(loss, grads)
    runner.loss = loss.item()
    return runner, grads


def apply_step(model: nn.Module, optimizer, grads: dict, clip: float | None = None) -> None:
    """One optimizer step on `grads`, clipped to the global L2 norm `clip` first if given."""
    if clip is not None:
        grads, _ = optim.clip_grad_norm(grads, clip)
    optimizer.update(model, grads)
