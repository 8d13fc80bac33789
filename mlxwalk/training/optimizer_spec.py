"""The optimizer of `mlxwalk train`, described once for both backends: the learning rate of each
step and the update rule. Plain Python: `mlx_framework.make_optimizer` builds MLX's optimizer from
it and `torch_backend/train.make_optimizer` torch's, and tests/test_optimizer_spec.py holds both
to it step by step.

MLX is the reference, because the mlx-lm drop-in must train as `mlx_lm.lora` does:

- the schedule is mlx-lm's `build_schedule` (its warmup joined to the decay by MLX's
  `join_schedules`): update 0 takes 0, the warmup rises linearly to the peak at update `warmup`,
  the peak holds one more update, and the decay runs over `max(steps - warmup - 1, 1)` updates,
  reaching 0 at the run's last update without a warmup (one update after it with one);
- the update is MLX's: Adam and AdamW without bias correction, `m / (sqrt(v) + eps)`; AdamW's
  weight decay (0.01 unless given) shrinks the parameter by `1 - lr * weight_decay` before the
  Adam update; SGD (no momentum) adds `weight_decay * p` to the gradient (0 unless given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NAMES = ("adam", "adamw", "sgd")
SCHEDULES = ("cosine_decay", "linear_schedule")  # or None: constant after any warmup
DEFAULT_DECAY = {"adam": 0.0, "adamw": 0.01, "sgd": 0.0}  # MLX's defaults


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: its learning rate at each update (`lr_at`) and its update rule (`update`)."""

    name: str  # adam, adamw or sgd
    lr: float  # the peak
    schedule: str | None = None  # cosine_decay, linear_schedule, or None (constant)
    warmup: int = 0  # updates rising from 0 to the peak
    decay_steps: int = 1  # updates the schedule decays over, after the warmup
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    bias_correction: bool = False
    weight_decay: float = 0.0

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"optimizer {self.name!r}: one of {', '.join(NAMES)}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: one of {', '.join(SCHEDULES)} or None")
        if self.warmup < 0 or self.decay_steps < 1:
            raise ValueError(f"warmup {self.warmup} >= 0 and decay_steps {self.decay_steps} >= 1")

    @classmethod
    def of(cls, cfg, steps: int) -> OptimizerSpec:
        """A run's optimizer (`--optimizer`, `--lr`, `--lr-schedule`, `--warmup`,
        `--weight-decay`) over its `steps` updates, as `mlx_lm.lora` builds it."""
        decay = cfg.weight_decay
        return cls(
            name=cfg.optimizer,
            lr=float(cfg.lr),
            schedule=cfg.lr_schedule,
            warmup=int(cfg.warmup),
            decay_steps=max(steps - cfg.warmup - 1, 1),
            weight_decay=DEFAULT_DECAY[cfg.optimizer] if decay is None else float(decay),
        )

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate changes from update to update."""
        return self.schedule is not None or self.warmup > 0

    def factor(self, step: int) -> float:
        """The learning rate of update `step` (0 the first) as a fraction of the peak."""
        if self.warmup and step <= self.warmup:  # join_schedules' boundary is warmup + 1
            return step / self.warmup
        s = min(step - self.warmup - 1 if self.warmup else step, self.decay_steps)
        if self.schedule == "cosine_decay":
            return 0.5 * (1.0 + math.cos(math.pi / self.decay_steps * s))
        if self.schedule == "linear_schedule":
            return 1.0 - s / self.decay_steps
        return 1.0

    def lr_at(self, step: int) -> float:
        """The learning rate of update `step` (0 the first)."""
        return self.lr * self.factor(step)

    def update(self, p: float, g: float, state: dict, step: int) -> float:
        """Update `step` (0 the first) of one scalar parameter `p` by its gradient `g`, in
        float64: the rule each backend implements on its tensors. `state` holds the moments
        (start it empty)."""
        lr = self.lr_at(step)
        if self.name == "sgd":
            return p - lr * (g + self.weight_decay * p)
        if self.name == "adamw":
            p = p * (1 - lr * self.weight_decay)
        b1, b2 = self.betas
        m = state["m"] = b1 * state.get("m", 0.0) + (1 - b1) * g
        v = state["v"] = b2 * state.get("v", 0.0) + (1 - b2) * g * g
        if self.bias_correction:
            t = step + 1
            return p - lr / (1 - b1**t) * m / (math.sqrt(v) / math.sqrt(1 - b2**t) + self.eps)
        return p - lr * m / (math.sqrt(v) + self.eps)
