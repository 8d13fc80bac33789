"""What the one training loop (run.py) needs from a framework: its mechanics, and nothing of the
loop. MLX's are `MLXFramework` (mlx_framework.py); torch's `TorchFramework`
(torch_backend/train.py). No array library here: the loop sees plain numbers and folders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..plan import Plan


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


@dataclass
class Stepped:
    """One optimizer step, as the loop sees it: each window's loss and the horizon it used (0: as
    asked), or a non-finite step (not taken; `error` says why)."""

    losses: np.ndarray
    horizons: np.ndarray
    finite: bool = True
    error: BaseException | None = None
    reduce_seconds: float = 0.0  # in the ranks' reduction, the wait for the slowest included
    weights: np.ndarray | None = None  # each window's labelled weight, where known


class Framework:
    """A framework's mechanics for one run (each method says what the loop relies on)."""

    name = "mlx"
    adapter_files: tuple[str, ...] = ()  # what `save_adapter` writes into a folder
    ranks = None  # training.ranks.Ranks or a subclass

    @staticmethod
    def ranks_class():
        """The class of this framework's group of processes (training.ranks.Ranks or one of its
        subclasses), whose `init()` makes the launch's."""
        raise NotImplementedError

    def model_folder(self, model: str) -> Path:
        """The model's local folder (nothing loaded yet)."""
        raise NotImplementedError

    def refuse(self, cfg) -> None:
        """Options this framework does not take, refused by name before anything is touched."""

    def load(self, cfg) -> Loaded:
        raise NotImplementedError

    def adapt(self, cfg, steps: int) -> None:
        """The adapter on the model (seeded) and the optimizer with its schedule over `steps`."""
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

    def step(self, examples: list, cfg, seed: int, on_chunk) -> Stepped:
        """One optimizer step over `examples` (this rank walks its share; the ranks reduce once),
        taken unless some window's loss or gradient is not finite. Window i is seeded
        `seed + i` (dropout)."""
        raise NotImplementedError

    def step_plain(self, example, cfg, seed: int, on_chunk) -> Stepped:
        """One window by the plain walk, a step per labelled chunk (one process)."""
        raise NotImplementedError

    def window_loss(self, example, cfg) -> float:
        """A validation window's loss, with no gradient and the model in eval mode."""
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

    def resume_lr(self, cfg) -> float | None:
        """On resume without a schedule: the learning rate is --lr from here on; returns the one
        the checkpoint held (None where a schedule goes on from the saved step)."""
        return None

    def report(self) -> dict:
        """What the run's report adds for this framework."""
        return {}
