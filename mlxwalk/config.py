"""`mlxwalk train`'s options as one dataclass, each value typed and range-checked, and every
refusal naming the flag at fault."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from . import adapters, data, tiny
from .plan import PlanError
from .store import check_cache_type
from .walk import WalkConfig

OPTIMIZERS = ("adam", "adamw", "sgd")
ON_NAN = ("stop", "skip")
KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


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
        raise PlanError(f"{name} must be {what}, got {given!r}")
    return value


def at_least(name: str, value, least, what: str = "") -> None:
    if value is not None and value < least:
        raise PlanError(f"{flag(name)} must be at least {least}{what}, got {value}")


def positive(name: str, value) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise PlanError(f"{flag(name)} must be a positive, finite number, got {value}")


def layers(num_layers: int) -> None:
    if num_layers == 0 or num_layers < -1:
        raise PlanError(f"--num-layers must be at least 1 (or -1 for all), got {num_layers}")


def choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise PlanError(f"{flag(name)} {value!r} is unknown; choose {' or '.join(allowed)}")


@dataclass
class TrainConfig:
    model: str = tiny.DEFAULT_MODEL
    data: str | None = None  # a folder with train.jsonl (and valid.jsonl); None = bundled sample
    walk: str = "exact"
    window: int | None = None  # None: the longest example, rounded up to the chunk
    chunk: int = 512
    horizon: int = 0
    cache_type: str = "float32"
    host_budget_mib: float | None = None
    memory_budget_mib: float | None = None
    recompute: bool = False
    epochs: int = 3
    iters: int | None = None  # stop after this many windows (mlx-lm's --iters)
    lr: float = 1e-4
    optimizer: str = "adam"
    rank: int = 8
    scale: float = 20.0
    dropout: float = 0.0
    num_layers: int = 16
    targets: list[str] | None = None
    seed: int = 0
    adapter_path: str | None = None  # None: runs/<model>-<time>
    save_every: int = 0  # windows between checkpoints; 0 = at each epoch's end only
    resume: bool = False
    overwrite: bool = False  # replace another run in adapter_path
    on_nan: str = "stop"  # a NaN or infinite loss or gradient: stop, or skip the window
    val_split: float = 0.1  # used only when the data has no valid.jsonl
    fit: str = "left"
    mask_prompt: bool = True
    follow_runs: bool = False  # chunks may cross turns: a chat's short turns make small chunks
    progress: bool = True

    def check(self) -> TrainConfig:
        for f in fields(self):  # a YAML file gives strings for some numbers ("1e-5") or worse
            setattr(self, f.name, coerce(f.name, getattr(self, f.name), str(f.type)))
        if self.walk not in ("exact", "plain"):
            raise PlanError(f"walk {self.walk!r} cannot train; choose exact or plain")
        choice("optimizer", self.optimizer, OPTIMIZERS)
        choice("fit", self.fit, data.FITS)
        choice("on_nan", self.on_nan, ON_NAN)
        for name in ("epochs", "chunk", "window", "iters", "rank"):
            at_least(name, getattr(self, name), 1)
        at_least("horizon", self.horizon, 0, " (0 = the whole window)")
        at_least("seed", self.seed, 0)
        at_least("save_every", self.save_every, 0, " (0 = at each epoch's end)")
        layers(self.num_layers)
        for name in ("lr", "scale", "host_budget_mib", "memory_budget_mib"):
            positive(name, getattr(self, name))
        if not 0 <= self.dropout < 1:
            raise PlanError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.val_split < 1:
            raise PlanError(f"--val-split must be in [0, 1), got {self.val_split}")
        if self.targets is not None and not all(t.strip() for t in self.targets):
            raise PlanError("--targets must name module keys such as self_attn.q_proj")
        if self.resume and self.overwrite:
            raise PlanError("--resume continues the run in the adapter path, --overwrite replaces "
                            "it: give one")  # fmt: skip
        check_cache_type(self.cache_type)
        return self

    def lora(self) -> adapters.LoraConfig:
        return adapters.LoraConfig(
            self.rank, self.scale, self.dropout, self.num_layers, self.targets
        )

    def walk_config(self, seed: int | None = None) -> WalkConfig:
        return WalkConfig(
            chunk=self.chunk,
            horizon=self.horizon,
            cache_type=self.cache_type,
            recompute=self.recompute,
            host_budget_mib=self.host_budget_mib,
            memory_budget_mib=self.memory_budget_mib,
            seed=seed,
            follow_runs=self.follow_runs,
        ).check()
