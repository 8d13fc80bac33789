"""MLX's mechanics for the training loop (run.py): an mlx-lm model with mlx-lm's LoRA layers, the
walks of mlxwalk/walk, MLX's optimizers and schedules, its distributed group (ranks.py), its
safetensors checkpoints."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from ..errors import FolderError
from ..walk import (
    WalkConfig,
    Window,
    apply_step,
    arch,
    exact_gradient,
    machine,
    train_window,
    window_loss,
)
from ..walk.guards import NonFinite
from ..walk.store import check_cache_type
from . import adapters, models
from .files import load_safetensors, save_safetensors
from .framework import Admission, Framework, Loaded, Stepped
from .optimizer_spec import OptimizerSpec
from .ranks import Ranks, StepSum, reduce_step, weighs


def make_optimizer(cfg, steps: int):
    """The run's optimizer over `steps` updates (training/optimizer_spec.py)."""
    return build_optimizer(OptimizerSpec.of(cfg, steps))


def build_optimizer(spec: OptimizerSpec):
    """MLX's optimizer as `spec` describes it: its learning rate constant, or mlx-lm's schedule
    (build_schedule, as mlx_lm.lora builds it), after `warmup` updates rising from 0."""
    from mlx_lm.tuner.utils import build_schedule

    lr = spec.lr
    arguments = {
        "cosine_decay": [spec.lr, spec.decay_steps],
        "linear_schedule": [spec.lr, 0.0, spec.decay_steps],
    }
    if spec.schedule is not None:
        lr = build_schedule(
            {"name": spec.schedule, "arguments": arguments[spec.schedule], "warmup": spec.warmup}
        )
    elif spec.warmup:
        lr = optim.linear_schedule(0.0, spec.lr, spec.warmup)
    if spec.name == "sgd":
        return optim.SGD(learning_rate=lr, weight_decay=spec.weight_decay)
    adam = {"betas": list(spec.betas), "eps": spec.eps, "bias_correction": spec.bias_correction}
    if spec.name == "adamw":
        return optim.AdamW(learning_rate=lr, weight_decay=spec.weight_decay, **adam)
    return optim.Adam(learning_rate=lr, **adam)


@dataclass
class WindowStep:
    """What the loop's step reads of a run's config, for a caller that brings one window at a
    time (the mlx-lm drop-in, the recall benchmark): one window a rank, clipping as asked."""

    base: WalkConfig
    walk: str = "exact"  # or "plain"
    windows_per_step: int = 1
    grad_clip: float | None = None  # mlx-lm's trainer clips none

    @property
    def horizon(self) -> int:
        return self.base.horizon

    def walk_config(self, seed: int | None = None) -> WalkConfig:
        return replace(self.base, seed=seed)


def fits_machine(model, layout, walk, cfg) -> None:
    """Without a memory budget: `mlxwalk plan`'s estimate (one chunk's graph not measured)
    against this machine's memory, refused before the first window when it exceeds it; on the
    CPU an allocation that large would fail in the window, at worst as a segmentation fault."""
    from ..errors import OutOfMemory
    from ..plan import mib
    from ..walk import budget

    memory = machine.memory()
    unmeasured = budget.Activations(cfg.chunk, 0.0, 0.0)
    est = budget.estimate(model, layout, unmeasured, walk.plan, cfg.cache_type)
    if walk.keep != "off" and not est.inputs:
        est = replace(est, inputs=walk.inputs_bytes(walk.plan))
    if memory.bytes is None or est.total <= memory.bytes:
        return
    if est.weights + est.adapter > memory.bytes:
        what = "a lower --rank, fewer --num-layers or a smaller model would be needed"
    else:
        what = budget.what_fits(layout, cfg.cache_type)
    raise OutOfMemory(
        f"memory: the walk needs {mib(est.total)} at least (weights {mib(est.weights)}, adapter "
        f"and optimizer {mib(est.adapter)}, K/V store {mib(est.store)}, accumulators "
        f"{mib(est.accumulators)}, checkpoints {mib(est.checkpoints)}"
        + (f", kept layer inputs {mib(est.inputs)}" if est.inputs else "")
        + f") and no --memory-budget-mib is given, but this machine has {mib(memory.bytes)}; "
        f"{what}"
    )


class MLXFramework(Framework):
    name = "mlx"
    adapter_files = ("adapters.safetensors", "adapter_config.json")

    @staticmethod
    def ranks_class():
        return Ranks

    def __init__(self, ranks: Ranks | None = None):
        self.ranks = ranks or Ranks(None)
        self.nan: NonFinite | None = None  # what this rank's non-finite window said

    @classmethod
    def around(cls, model, optimizer, ranks: Ranks) -> MLXFramework:
        """The mechanics around a model and optimizer made elsewhere (mlx-lm's drop-in)."""
        fw = cls(ranks)
        fw.model, fw.optimizer, fw.layout = model, optimizer, arch.inspect(model)
        return fw

    def model_folder(self, model: str) -> Path:
        return models.resolve(model)

    def load(self, cfg) -> Loaded:
        self.model, tokenizer = models.load(cfg.model)
        fingerprint = models.fingerprint(self.model)
        self.layout = arch.inspect(self.model)
        check_cache_type(cfg.cache_type, self.layout.head_dims)
        path = models.resolve(cfg.model).resolve()
        limit = models.max_positions(self.model)
        return Loaded(
            tokenizer, self.layout.vocab, limit, fingerprint, path, self.layout.model_type
        )

    def adapt(self, cfg, steps: int) -> None:
        mx.random.seed(cfg.seed)
        adapters.apply(self.model, cfg.lora())
        self.optimizer = make_optimizer(cfg, steps)
        self.optimizer.init(self.model.trainable_parameters())

    def budget(self, cfg, echo):
        """On a GPU with no --memory-budget-mib, the exact walk keeps to what MLX reports the
        GPU may use (walk/machine.py), and the run says so."""
        budget_mib, memory = machine.default_budget_mib(cfg.memory_budget_mib)
        if memory is None or cfg.walk != "exact":
            return cfg
        echo(f"memory budget: {memory.said()}, as no --memory-budget-mib is given")
        return replace(cfg, memory_budget_mib=budget_mib)

    def admit(self, cfg, example) -> Admission:
        from ..walk import ExactWalk, budget

        window = Window.of(example.inputs, example.targets, example.weights)
        walk = ExactWalk(self.model, window, cfg.walk_config(), self.layout)
        store = budget.store_bytes(self.layout, walk.plan.computed, cfg.cache_type)
        est = walk.estimate
        if est is None:
            fits_machine(self.model, self.layout, walk, cfg)
            return Admission(walk.plan, store)
        return Admission(walk.plan, est.store, est.total, est.graph)

    def snapshot(self):
        """References do: MLX arrays are immutable."""
        params = tree_map(lambda a: a, self.model.trainable_parameters())
        return params, tree_map(lambda a: a, self.optimizer.state)

    def restore(self, snap) -> None:
        params, state = snap
        self.model.update(params)
        self.optimizer.state = state

    def reset_peak(self) -> None:
        mx.reset_peak_memory()

    def peak(self) -> int:
        return mx.get_peak_memory()

    def step(self, examples: list, cfg, seed: int, on_chunk, error=None) -> Stepped:
        """(`error`: this rank failed before its walk; every rank stops with it.)"""
        part, walked_error = self.walk_share(examples, cfg, seed, on_chunk)
        error = error or walked_error
        walked = time.perf_counter()
        step = reduce_step(self.ranks, part, error)
        reduced = time.perf_counter() - walked
        if not step.finite:
            error, self.nan = self.nan or error, None
            error = error or NonFinite("a NaN or infinite loss or gradient")
            return Stepped(step.losses, step.horizons, False, error, reduced)
        apply_step(self.model, self.optimizer, step.grads, cfg.grad_clip)
        mx.eval(self.model.parameters(), self.optimizer.state)
        return Stepped(step.losses, step.horizons, reduce_seconds=reduced, weights=step.weights)

    def step_window(self, window, cfg: WindowStep, seed: int, error=None) -> Stepped:
        """One window (this rank's; None where it failed before, with `error`) stepped as the
        loop steps: the plain walk alone, the exact walk's gradient combined over the ranks."""
        if cfg.walk == "plain":
            return self.step_plain(window, cfg, seed, None)
        slots = [None] * self.ranks.size
        slots[self.ranks.rank] = window
        return self.step(slots, cfg, seed - self.ranks.rank, None, error)

    def walk_share(self, examples: list, cfg, seed: int, on_chunk):
        """This rank's windows of the step: their gradients, each weighted by its labelled
        weight when the step combines windows. A failure is kept for the step's reduction (one
        process: raised at once); a non-finite window marks the step."""
        slots = len(examples)
        combine = weighs(slots, self.ranks.size)
        part = StepSum(
            tree_map(mx.zeros_like, self.model.trainable_parameters()),
            *(np.zeros(slots, np.float32) for _ in range(3)),
        )
        error = None
        for i in self.ranks.mine(list(range(slots)), cfg.windows_per_step):
            ex = examples[i]
            if ex is None:  # (this rank failed before its walk)
                continue
            window = Window.of(ex.inputs, ex.targets, ex.weights)
            try:
                walk, grads = exact_gradient(
                    self.model, window, cfg.walk_config(seed=seed + i), on_chunk, self.layout
                )
            except NonFinite as e:
                part.finite, error, self.nan = False, None, e
                continue
            except Exception as e:
                if self.ranks.size == 1:
                    raise
                error = e
                break
            w = float(window.total) if combine else 1.0
            part.grads = tree_map(lambda a, g, w=w: a + g * w, part.grads, grads)
            used = getattr(walk, "horizon_used", cfg.horizon)
            part.losses[i], part.weights[i] = walk.loss, window.total
            part.horizons[i] = used if used != cfg.horizon else 0
            mx.eval(part.grads)
        return part, error

    def step_plain(self, example, cfg, seed: int, on_chunk) -> Stepped:
        window = Window.of(example.inputs, example.targets, example.weights)
        try:
            walk = train_window(
                self.model,
                self.optimizer,
                window,
                cfg.walk_config(seed=seed),
                cfg.walk,
                on_chunk=on_chunk,
                layout=self.layout,
                clip=cfg.grad_clip,
            )
        except NonFinite as e:
            return Stepped(np.zeros(1), np.zeros(1), False, e)
        used = getattr(walk, "horizon_used", cfg.horizon)
        horizon = np.array([used if used != cfg.horizon else 0])
        return Stepped(np.array([walk.loss]), horizon, weights=np.array([window.total]))

    def window_loss(self, example, cfg) -> float:
        window = Window.of(example.inputs, example.targets, example.weights)
        return window_loss(self.model, window, cfg.walk_config(), self.layout)

    def train_mode(self, on: bool) -> None:
        self.model.train(on)

    def write_check(self, path: Path) -> None:
        save_safetensors(path, {"check": mx.zeros((1,))})

    def save_adapter(self, folder: Path, cfg) -> None:
        adapters.save(self.model, folder, cfg.lora())

    def save_state(self, folder: Path, cfg) -> None:
        adapters.save(self.model, folder, cfg.lora())
        save_safetensors(folder / "optimizer.safetensors", dict(tree_flatten(self.optimizer.state)))

    def load_state(self, folder: Path) -> None:
        try:
            weights = load_safetensors(folder / "adapters.safetensors")
            moments = load_safetensors(folder / "optimizer.safetensors")
        except (RuntimeError, OSError, ValueError) as e:
            raise FolderError(f"--resume: checkpoint {folder} can't be read ({e})") from None
        adapters.load_strict(self.model, weights, str(folder))
        self.optimizer.state = tree_unflatten(list(moments.items()))
        mx.eval(self.model.parameters(), self.optimizer.state)

    def resume_lr(self, cfg) -> float | None:
        """The checkpoint's state holds the learning rate it trained with: --lr from here on."""
        if cfg.lr_schedule or cfg.warmup:  # the schedule goes on from the saved step
            return None
        was = float(self.optimizer.learning_rate)
        self.optimizer.learning_rate = cfg.lr
        return None if math.isclose(was, cfg.lr, rel_tol=1e-6) else was
