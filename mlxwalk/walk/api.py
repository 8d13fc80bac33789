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
    """The window's loss, decoded chunk by chunk with no gradient (for evaluation).

    Args:
        model: an mlx-lm model (any dtype; quantized or not).
        window: the window's ids (int32, length n) and weights (float32, length n).
        config: the walk's settings; its chunk sets how many positions decode at once.
        layout: the model's arch.Layout, when the caller has it (else read here).

    Returns:
        sum(w * CE) / sum(w) over the window's n positions, a Python float.
    """
    runner = ChunkRunner(model, window, config, layout)
    return float(sum(v.item() for v in _decoded(runner)))


def _decoded(runner: ChunkRunner) -> list[mx.array]:
    """Each labelled chunk's loss share, the window decoded chunk by chunk with no gradient."""
    window, model = runner.window, runner.model
    chunks = cut(window.labels, runner.config.chunk, runner.config.follow_runs)
    losses: list = []
    with walking(model, runner.config.products):
        runner.new_store(chunks[-1].end)
        state = runner.zero_state()
        for chunk in chunks:
            state = runner.decode(chunk, state, losses=losses)
    return losses


@first_use
def target_scores(model: nn.Module, window: Window, config: WalkConfig, layout=None) -> list:
    """Each target column's summed log-probability, decoded chunk by chunk with no gradient.

    Args:
        model, config, layout: as window_loss's.
        window: a window of several targets a position (Window.of_targets), its weights the
            positions each column scores (e.g. 1 at a one-token answer, 0 elsewhere).

    Returns:
        [sum_p w[p, t] * log p(targets[p, t]) for each column t], Python floats.
    """
    runner = ChunkRunner(model, window, config, layout)
    runner.per_target = True
    per_column = sum(_decoded(runner)) * -window.total  # (T,): shares of sum(|w|)
    return per_column.tolist()


@first_use
def one_graph(model: nn.Module, window: Window, products: str = "auto") -> tuple[mx.array, dict]:
    """The reference: the whole window as one graph, no cache, its quantized products as the
    walk's (ops.products).

    Args:
        model: an mlx-lm model with trainable parameters (LoRA layers).
        window: the window's ids (int32, length n) and weights (float32, length n).
        products: "auto", "quantized" or "dequantized": how a quantized layer multiplies.

    Returns:
        (loss, grads): the loss sum(w * CE) / sum(w), a scalar array (float32), and its gradient,
        a tree shaped as `model.trainable_parameters()` (each array its parameter's shape and
        dtype). Both unevaluated.
    """
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
    cache_type: str = "auto",
    horizon: int = 0,
    recompute: bool = False,
    host_budget_mib: float | None = None,
    memory_budget_mib: float | None = None,
    accumulator_dtype: str = "auto",
    attention: str = "auto",
    keep_inputs: str = "auto",
    products: str = "auto",
    head_products: str = "auto",
) -> tuple[float, dict]:
    """The window's loss sum(w * CE) / sum(w) and its gradient in `model.trainable_parameters()`.

    walk="exact" walks the window in chunks and equals "one-graph" to rounding; "plain" returns the
    sum of its per-chunk gradients at the unchanged adapter.

    Args:
        model: an mlx-lm model with trainable parameters (LoRA layers).
        inputs: token ids, shape (n,) or (1, n), integers (NumPy, list or mx.array).
        targets: the next token at each position, shape as `inputs`.
        weights: each position's weight in the loss, shape as `inputs`, real, >= 0, not all 0
            (0: context only).
        chunk: positions per chunk (>= 1); the walk's memory grows with it.
        walk: "exact", "plain" or "one-graph" (the reference).
        cache_type, horizon, recompute, host_budget_mib, memory_budget_mib, accumulator_dtype,
        attention, keep_inputs, products, head_products: WalkConfig's fields (walk/config.py
            says each).

    Returns:
        (loss, grads): the loss as a Python float and its gradient, a tree shaped as
        `model.trainable_parameters()` (each array its parameter's shape and dtype), evaluated.

    Raises:
        ConfigError for an unknown walk or setting or a frozen model; DataError for a window
        with no labelled position or lengths that differ; OutOfMemory when a memory budget
        cannot hold the walk (before any array of the window exists).
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
        head_products=head_products,
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

    Args:
        model: an mlx-lm model with trainable parameters (LoRA layers).
        optimizer: an mlx.optimizers optimizer; it updates `model` in place.
        window: the window's ids (int32, length n) and weights (float32, length n).
        config: the walk's settings (WalkConfig, checked).
        walk: "exact" (one step) or "plain" (a step per labelled chunk).
        on_chunk: told (phase "decode" or "train", chunks done, chunks) after each chunk.

    Returns:
        The walk, whose `loss` holds the window's loss (at the adapter it started from).
    """

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
    """The exact walk's gradient of one window, checked finite (NonFinite otherwise), for a
    caller that steps on several windows at once.

    Args:
        model: an mlx-lm model with trainable parameters.
        window: the window's ids (int32, length n) and weights (float32, length n).
        config: the walk's settings (WalkConfig).
        on_chunk: told (phase "decode" or "train", chunks done, chunks) after each chunk.
        layout: the model's arch.Layout, when the caller has it.

    Returns:
        (walk, grads): the ExactWalk with its `loss` (a float) set, and the gradient of the
        window's loss, a tree shaped as `model.trainable_parameters()`.
    """
    runner = ExactWalk(model, window, config, layout)
    runner.on_chunk = on_chunk
    loss, grads = runner.run()
    check_finite(loss, grads)
    runner.loss = loss.item()
    return runner, grads


def apply_step(model: nn.Module, optimizer, grads: dict, clip: float | None = None) -> None:
    """One optimizer step on `grads`, clipped to the global L2 norm `clip` first if given.

    Args:
        model: the model whose trainable parameters step.
        optimizer: an mlx.optimizers optimizer.
        grads: a tree shaped as `model.trainable_parameters()`.
        clip: the largest global L2 norm the step may take, or None.
    """
    if clip is not None:
        grads, _ = optim.clip_grad_norm(grads, clip)
    optimizer.update(model, grads)
