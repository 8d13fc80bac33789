"""`mlxwalk train`'s options as one dataclass, each value typed and range-checked, and every
refusal naming the flag at fault."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from .. import tiny
from ..errors import ConfigError
from ..plan import check_cache_type
from . import data

if TYPE_CHECKING:
    from ..walk import WalkConfig
    from . import adapters

OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULES = ("cosine_decay", "linear_schedule")
ON_NAN = ("stop", "skip")
KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
# --seed: numpy's legacy range. MLX's mx.random.seed takes up to 2**64 - 1, but the run derives
# seeds from it (the seed plus the window's number, times a million and the chunk's for dropout),
# which must stay within that too.
SEED_LIMIT = 2**32 - 1
PATHS = ("model", "data", "adapter_path")  # flags naming a place: an empty one is refused


def not_empty(name: str, value) -> None:
    """A path flag given as "" (an unset shell variable) is refused, not read as absent."""
    if isinstance(value, str) and not value.strip():
        raise ConfigError(
            f"{flag(name)} is empty (an unset shell variable?); give it a value or leave it out"
        )


def seed_range(value) -> None:
    if value is not None and not 0 <= value <= SEED_LIMIT:
        raise ConfigError(f"--seed must be between 0 and {SEED_LIMIT} (2^32 - 1), got {value}")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def coerce(name: str, value, kind: str):
    """`value` as the field's type (annotations read as text), or a one-line refusal."""
    base = kind.split("|")[0].strip()
    if value is None and "None" in kind:
        return None
    ok, given = True, value
    if base == "bool":
        ok = isinstance(value, bool)
    elif base == "int":
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base == "float":
        try:
            value = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            value = None
        ok = value is not None
    elif base == "str":
        ok = isinstance(value, str)
    elif base.startswith("list"):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    if not ok:
        what = KINDS.get(base, "a list of strings")
        raise ConfigError(f"{name} must be {what}, got {given!r}")
    return value


def at_least(name: str, value, least, what: str = "") -> None:
    if value is not None and value < least:
        raise ConfigError(f"{flag(name)} must be at least {least}{what}, got {value}")


def positive(name: str, value) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag(name)} must be a positive, finite number, got {value}")


def layers(num_layers: int) -> None:
    if num_layers == 0 or num_layers < -1:
        raise ConfigError(f"--num-layers must be at least 1 (or -1 for all), got {num_layers}")


def choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{flag(name)} {value!r} is unknown; choose {' or '.join(allowed)}")


PAIRED = ("dpo", "simpo")  # objectives over preference pairs
OBJECTIVES = ("tokens", *PAIRED)


def objective(name: str, beta: float, gamma: float, walk: str) -> None:
    """--objective and its numbers (mlxwalk train's and the drop-in's)."""
    choice("objective", name, OBJECTIVES)
    positive("beta", beta)
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ConfigError(f"--gamma must be a finite number of at least 0, got {gamma}")
    if walk == "plain" and name in PAIRED:
        raise ConfigError(
            f"--objective {name}: the plain walk steps once per chunk, before a pair's weight "
            f"(known once both its windows are walked) exists; {name} takes the exact walk"
        )


def option(default, help: str, **kw):
    """A field of TrainConfig: its default and its help, read by every place that shows it (the
    `mlxwalk train` and `mlxwalk plan` flags, the YAML keys, the report)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    model: str = option(
        tiny.DEFAULT_MODEL,
        "a model folder, a bundled model, or a hub id in the local cache",
        plan=True,
    )
    data: str | None = option(
        None, "a folder with train.jsonl and optionally valid.jsonl (default: a sample)"
    )
    walk: str = option("exact", "exact (one step per window) or plain (one step per chunk)")
    objective: str = option(
        "tokens",
        "tokens (cross-entropy on the labelled tokens), dpo (preference pairs: prompt, chosen, "
        "rejected, in mlx-lm-lora's formats; the reference is the model with the adapter off) "
        "or simpo (the same pairs, length-normalized rewards, no reference)",
    )
    beta: float = option(
        0.1, "the rewards' scale, DPO's and SimPO's beta (DPO's: how far from the reference)"
    )
    gamma: float = option(0.5, "SimPO's target reward margin")
    window: int | None = option(
        None,
        "positions per window (default: the longest example, rounded up to the chunk)",
        plan="positions the planned window holds (required)",
    )
    chunk: int = option(512, "positions per chunk", plan=True)
    horizon: int = option(
        0, "prefix positions each chunk sends gradient to (0 = the whole window)", plan=True
    )
    cache_type: str = option(
        "auto",
        "K/V store: auto (lossless: the model's K/V precision where that is float16 or bfloat16, "
        "else float32; 8-bit only where --memory-budget-mib needs it), float32, float16, "
        "bfloat16 or q8",
        plan=True,
    )
    accumulator_dtype: str = option(
        "auto",
        "K/V gradient accumulators: auto (float32; bfloat16 only where --memory-budget-mib "
        "needs it), float32 or bfloat16",
        plan=True,
    )
    min_chunk: int | None = option(
        None,
        "the smallest chunk --memory-budget-mib may halve --chunk to (default 256); equal to "
        "--chunk, the chunk is held",
        plan=True,
    )
    host_budget_mib: float | None = option(None, "accumulators + checkpoints", plan=True)
    memory_budget_mib: float | None = option(
        None, "all the run holds in MLX's memory: refused or held to it", plan=True
    )
    recompute: bool = option(False, "activation checkpointing inside each chunk's graph", plan=True)
    keep_inputs: str = option(
        "auto",
        "with --recompute, each layer's input kept from the decode "
        "(no recorded forward): auto (when it fits the memory budget, else the "
        "stem's output alone when that fits), on, stem (the frozen stem's output "
        "alone: the stem's layers don't run again) or off",
        plan=True,
    )
    strict_exact: bool = option(
        False, "refuse a window the memory budget fits only with a narrowed horizon (not exact)"
    )
    epochs: int = option(3, "passes over the training windows")
    iters: int | None = option(None, "stop after this many windows")
    windows_per_step: int = option(
        1,
        "windows one optimizer step combines, per rank (the exact walk; the mean over their "
        "labelled tokens); with --objective dpo or simpo, pairs (the mean over the pairs)",
    )
    lr: float = option(1e-4, "learning rate (the peak, with a schedule)")
    lr_schedule: str | None = option(
        None, "none (constant), cosine_decay or linear_schedule (to 0 at the run's last step)"
    )
    warmup: int = option(0, "steps of linear warmup from 0 to --lr")
    grad_clip: float | None = option(None, "clip each step's gradient to this global L2 norm")
    optimizer: str = option("adam", "adam, adamw or sgd")
    weight_decay: float | None = option(None, "the optimizer's weight decay (adamw, sgd)")
    rank: int = option(8, "LoRA rank", plan=True)
    scale: float = option(20.0, "LoRA scale")
    dropout: float = option(0.0, "LoRA dropout")
    num_layers: int = option(16, "layers (from the last) that get adapters; -1 = all", plan=True)
    targets: list[str] | None = option(
        None, "module keys within a layer to adapt (default: mlx-lm's choice)"
    )
    seed: int = option(0, "random seed: the adapter's start, the data order, dropout")
    adapter_path: str | None = option(
        None, "folder for the adapter, checkpoints and report (default: runs/<model>-<time>)"
    )
    save_every: int = option(0, "windows between checkpoints (0 = each epoch's end)")
    steps_per_eval: int = option(0, "windows between evaluations (0 = each epoch's end only)")
    resume: bool = option(False, "continue the run in the adapter path from its newest checkpoint")
    overwrite: bool = option(False, "replace another run in the adapter path")
    on_nan: str = option("stop", "a NaN or infinite loss or gradient: stop, or skip the window")
    val_split: float = option(0.1, "fraction of train.jsonl held out when there is no valid.jsonl")
    fit: str = option(
        "left", "an over-long example keeps its left part, or its start and end (middle)"
    )
    mask_prompt: bool = option(True, "prompts and other turns are context, not labels", flag=False)
    follow_runs: bool = option(False, "no chunk crosses a change of label (the plan's strict rule)")
    progress: bool = option(True, "a progress bar per window", flag=False)
    backend: str = option(
        "mlx",
        "mlx, or torch: a local transformers folder trained with PEFT "
        "through the torch walk (extra [torch]; CUDA when present)",
        plan=True,
    )

    def check(self) -> TrainConfig:
        for f in fields(self):  # a YAML file gives strings for some numbers ("1e-5") or worse
            setattr(self, f.name, coerce(f.name, getattr(self, f.name), str(f.type)))
        if self.walk not in ("exact", "plain"):
            raise ConfigError(f"walk {self.walk!r} cannot train; choose exact or plain")
        objective(self.objective, self.beta, self.gamma, self.walk)
        choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.lr_schedule is not None:
            choice("lr_schedule", self.lr_schedule, SCHEDULES)
        choice("fit", self.fit, data.FITS)
        choice("on_nan", self.on_nan, ON_NAN)
        choice("backend", self.backend, ("mlx", "torch"))
        choice("accumulator_dtype", self.accumulator_dtype, ("auto", "float32", "bfloat16"))
        for name in ("epochs", "chunk", "window", "iters", "rank", "windows_per_step", "min_chunk"):
            at_least(name, getattr(self, name), 1)
        at_least("horizon", self.horizon, 0, " (0 = the whole window)")
        seed_range(self.seed)
        for name in PATHS:
            not_empty(name, getattr(self, name))
        at_least("save_every", self.save_every, 0, " (0 = at each epoch's end)")
        at_least("steps_per_eval", self.steps_per_eval, 0, " (0 = at each epoch's end)")
        at_least("warmup", self.warmup, 0)
        layers(self.num_layers)
        for name in ("lr", "scale", "host_budget_mib", "memory_budget_mib", "grad_clip"):
            positive(name, getattr(self, name))
        if self.weight_decay is not None and not 0 <= self.weight_decay < 1:
            raise ConfigError(f"--weight-decay must be in [0, 1), got {self.weight_decay}")
        if self.weight_decay and self.optimizer == "adam":
            raise ConfigError("--weight-decay: adam has none; use --optimizer adamw")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.val_split < 1:
            raise ConfigError(f"--val-split must be in [0, 1), got {self.val_split}")
        if self.targets is not None and not all(t.strip() for t in self.targets):
            raise ConfigError("--targets must name module keys such as self_attn.q_proj")
        if self.resume and self.overwrite:
            raise ConfigError(
                "--resume continues the run in the adapter path, --overwrite replaces it: give one"
            )
        if self.walk == "plain" and self.windows_per_step > 1:
            raise ConfigError(
                "--windows-per-step: the plain walk steps once per chunk; combining "
                "windows takes the exact walk"
            )
        check_cache_type(self.cache_type)
        return self

    # MLX's forms of the run's settings, imported where its framework asks for them: the loop
    # and this config stay free of array libraries.
    def lora(self) -> adapters.LoraConfig:
        from . import adapters

        return adapters.LoraConfig(
            self.rank, self.scale, self.dropout, self.num_layers, self.targets
        )

    def walk_config(self, seed: int | None = None) -> WalkConfig:
        from ..walk import WalkConfig

        return WalkConfig.from_fields(self, seed=seed).check()


def from_fields(kind, source, **given):
    """A `kind` (a dataclass) of `source`'s attributes named as its fields, then `given`."""
    names = [f.name for f in fields(kind) if hasattr(source, f.name)]
    return kind(**{**{name: getattr(source, name) for name in names}, **given})
