"""MLX's mechanics for the training loop (run.py) and its step (step.py): an mlx-lm model with
mlx-lm's LoRA layers, the walks of mlxwalk/walk, MLX's optimizer as optimizer_spec.py describes
it, its distributed group (ranks.py), its safetensors checkpoints."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
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
from ..walk.store import check_cache_type
from . import adapters, models
from .files import load_safetensors, save_safetensors
from .framework import Admission, Framework, Loaded
from .optimizer_spec import OptimizerSpec
from .ranks import Ranks
from .step import Stepped


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
    est = budget.estimate(
        model, layout, unmeasured, walk.plan, walk.config.cache_type, skipped=walk.states_from()
    )
    if walk.keep != "off" and not est.inputs:
        est = replace(est, inputs=walk.inputs_bytes(walk.plan))
    if memory.bytes is None or est.total <= memory.bytes:
        return
    if est.weights + est.adapter > memory.bytes:
        what = "a lower --rank, fewer --num-layers or a smaller model would be needed"
    else:
        what = budget.what_fits(layout, walk.config.cache_type)
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
    ranks_kind = Ranks
    # hears what a window's walk changed to fit the memory budget, each change once (the
    # drop-in, which admits no window before its first; `mlxwalk train` says its largest's)
    echo_choices = None

    @classmethod
    def around(cls, model, optimizer, ranks: Ranks) -> MLXFramework:
        """The mechanics around a model and optimizer made elsewhere (mlx-lm's drop-in)."""
        fw = cls(ranks)
        fw.model, fw.optimizer, fw.layout = model, optimizer, arch.inspect(model)
        fw.echo_choices = print if ranks.leader else None
        return fw

    def tell(self, given_up: list) -> None:
        """What a window's walk changed to fit the budget that no window said before."""
        said = self.__dict__.setdefault("said_choices", set())
        new = [c.said() for c in given_up if c.said() not in said]
        if self.echo_choices is not None and new:
            lines = ["to fit the memory budget:", *(f"  {line}" for line in new)]
            self.echo_choices("\n".join(lines), flush=True)
        said.update(new)

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

    def adapt(self, cfg, spec: OptimizerSpec) -> None:
        mx.random.seed(cfg.seed)
        adapters.apply(self.model, cfg.lora())
        self.optimizer = build_optimizer(spec)
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
        store = budget.store_bytes(self.layout, walk.plan.computed, walk.config.cache_type)
        est = walk.estimate
        if est is None:
            fits_machine(self.model, self.layout, walk, cfg)
            return Admission(walk.plan, store)
        return Admission(walk.plan, est.store, est.total, est.graph, walk.given_up)

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

    def step_window(self, window, cfg: WindowStep, seed: int, error=None) -> Stepped:
        """One window (this rank's; None where it failed before, with `error`) stepped as the
        loop steps: the plain walk alone, the exact walk's gradient combined over the ranks."""
        if cfg.walk == "plain":
            return self.step_plain(window, cfg, seed, None)
        slots = [None] * self.ranks.size
        slots[self.ranks.rank] = window
        return self.step(slots, cfg, seed - self.ranks.rank, None, error=error)

    def zeros(self) -> dict:
        return tree_map(mx.zeros_like, self.model.trainable_parameters())

    def gradient(self, window, cfg, seed: int, on_chunk) -> tuple[float, dict, int]:
        window = Window.of(window.inputs, window.targets, window.weights)
        walk, grads = exact_gradient(
            self.model, window, cfg.walk_config(seed=seed), on_chunk, self.layout
        )
        self.tell(walk.given_up)
        return walk.loss, grads, getattr(walk, "horizon_used", cfg.horizon)

    def accumulate(self, acc: dict, grads: dict, scale: float) -> dict:
        acc = tree_map(lambda a, g: a + g * scale, acc, grads)
        mx.eval(acc)
        return acc

    def apply(self, grads: dict, whole: float | None, clip: float | None) -> None:
        if whole is not None:  # (the reduction's sums are float32)
            params = self.model.trainable_parameters()
            grads = tree_map(lambda g, p: (g / whole).astype(p.dtype), grads, params)
        apply_step(self.model, self.optimizer, grads, clip)
        mx.eval(self.model.parameters(), self.optimizer.state)

    def walk_plain(self, window, cfg, seed: int, on_chunk) -> tuple[float, int]:
        window = Window.of(window.inputs, window.targets, window.weights)
        walk = train_window(
            self.model,
            self.optimizer,
            window,
            cfg.walk_config(seed=seed),
            "plain",
            on_chunk=on_chunk,
            layout=self.layout,
            clip=cfg.grad_clip,
        )
        return walk.loss, getattr(walk, "horizon_used", cfg.horizon)

    def window_loss(self, example, cfg, reference: bool = False) -> float:
        from ..preference.dpo import adapter_off

        window = Window.of(example.inputs, example.targets, example.weights)
        with adapter_off(self.model) if reference else nullcontext():
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

    def resume_lr(self, spec: OptimizerSpec) -> float | None:
        """The checkpoint's state holds the learning rate it trained with: --lr from here on."""
        if spec.scheduled:  # the schedule goes on from the saved step
            return None
        was = float(self.optimizer.learning_rate)
        self.optimizer.learning_rate = spec.lr
        return None if math.isclose(was, spec.lr, rel_tol=1e-6) else was
