"""What the one training loop (run.py) and its step (step.py) need from a framework: its
mechanics, and nothing of the loop. MLX's are `MLXFramework` (mlx_framework.py); torch's
`TorchFramework` (torch_backend/train.py). No array library here: the loop sees plain numbers and
folders."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import NonFinite
from ..plan import Plan
from .objective import TOKENS
from .step import Stepped, take_step


@dataclass
class Loaded:
    """What the loop needs of a loaded model."""

    tokenizer: object
    vocab: int
    limit: int | None  # the model's maximum positions, if it states them
    fingerprint: str  # its weights, short (runfolder.identity)
    path: Path  # its folder
    described: str  # for the run's first line: "qwen2", "torch 2.11 on cuda:0"


@dataclass
class Admission:
    """The exact walk's plan for the run's largest window and, under a memory budget, what it will
    hold (bytes; None without a budget, when nothing is probed)."""

    plan: Plan
    store: int
    total: int | None = None
    graph: int | None = None
    given_up: list = field(default_factory=list)  # what the budget changed (walk/choices.Choice)

    def lines(self) -> list[str]:
        """What the budget changed, as the run says it at its start."""
        if not self.given_up:
            return []
        return ["to fit the memory budget:", *(f"  {c.said()}" for c in self.given_up)]


class Framework:
    """A framework's mechanics for one run (each method says what the loop relies on)."""

    name = "mlx"
    adapter_files: tuple[str, ...] = ()  # what `save_adapter` writes into a folder
    ranks_kind = None  # the class of its group of processes (training.ranks.Ranks or a subclass)

    def __init__(self, ranks=None):
        self.ranks = ranks or self.ranks_kind(None)

    def model_folder(self, model: str) -> Path:
        """The model's local folder (nothing loaded yet)."""
        raise NotImplementedError

    def refuse(self, cfg) -> None:
        """Options this framework does not take, refused by name before anything is touched."""

    def load(self, cfg) -> Loaded:
        raise NotImplementedError

    def adapt(self, cfg, spec) -> None:
        """The adapter on the model (seeded) and the optimizer with its schedule, as `spec` (an
        optimizer_spec.OptimizerSpec) describes them."""
        raise NotImplementedError

    def budget(self, cfg, echo):
        """The run's config with the memory budget this framework keeps by default, said."""
        return cfg

    def admit(self, cfg, example) -> Admission | None:
        """The exact walk's plan (and estimate under a budget) for `example`: a refusal here,
        before any step."""
        raise NotImplementedError

    def snapshot(self):
        """The adapter and optimizer state as they are now."""
        raise NotImplementedError

    def restore(self, snap) -> None:
        raise NotImplementedError

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return 0

    def step(self, items: list, cfg, seed: int, on_chunk, objective=TOKENS, error=None) -> Stepped:
        """One optimizer step over `items` through `objective` (step.py: this rank walks its
        share; the ranks reduce once), taken unless some loss or gradient is not finite."""
        return take_step(self, items, cfg, seed, on_chunk, objective, error)

    # The step's mechanics (step.py): a gradient is whatever the framework sums in.
    def zeros(self):
        """A zero gradient sum over the adapter's parameters."""
        raise NotImplementedError

    def gradient(self, window, cfg, seed: int, on_chunk) -> tuple[float, object, int]:
        """The exact walk's gradient of `window`'s mean loss: (loss, gradient, horizon used);
        NonFinite when either is not finite."""
        raise NotImplementedError

    def accumulate(self, acc, grads, scale: float):
        """`acc` + `scale` x `grads`."""
        raise NotImplementedError

    def apply(self, grads, whole: float | None, clip: float | None) -> None:
        """The optimizer's update on `grads` / `whole` (None: as they are), clipped first to
        the global L2 norm `clip` if given; the schedule moves on."""
        raise NotImplementedError

    def step_plain(self, window, cfg, seed: int, on_chunk) -> Stepped:
        """One window by the plain walk, a step per labelled chunk (one process; token
        cross-entropy only)."""
        try:
            loss, used = self.walk_plain(window, cfg, seed, on_chunk)
        except NonFinite as e:
            return Stepped(np.zeros(1), np.zeros(1), False, e)
        horizon = np.array([used if used != cfg.horizon else 0])
        return Stepped(np.array([loss]), horizon, weights=np.array([float(window.weights.sum())]))

    def walk_plain(self, window, cfg, seed: int, on_chunk) -> tuple[float, int]:
        """The plain walk's steps on `window`: (its loss, the horizon it used); NonFinite before
        a step that is not finite."""
        raise NotImplementedError

    def window_loss(self, example, cfg, reference: bool = False) -> float:
        """A window's mean loss with no gradient (validation: the model in eval mode);
        `reference`: with the adapter off, the model it adapts (DPO's reference)."""
        raise NotImplementedError

    def train_mode(self, on: bool) -> None:
        pass

    def write_check(self, path: Path) -> None:
        """A small file written at `path` by the calls that write checkpoints."""
        path.write_bytes(b"check")

    def save_adapter(self, folder: Path, cfg) -> None:
        """The adapter in the framework's format, each file written whole."""
        raise NotImplementedError

    def save_state(self, folder: Path, cfg) -> None:
        """A checkpoint's tensors (the adapter and the optimizer's state) into a fresh folder."""
        raise NotImplementedError

    def load_state(self, folder: Path) -> None:
        """A checkpoint's tensors back, strictly (a refusal naming the folder otherwise)."""
        raise NotImplementedError

    def resume_lr(self, spec) -> float | None:
        """On resume without a schedule: the learning rate is the spec's from here on; returns
        the one the checkpoint held (None where a schedule goes on from the saved step)."""
        return None

    def report(self) -> dict:
        """What the run's report adds for this framework."""
        return {}
