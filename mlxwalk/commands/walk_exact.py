"""`mlxwalk test-walk-exact`: the walk's gradient against its reference, row by row, on any
model. The rows are mlxwalk/exactness.py's (for both backends); this module runs them on MLX
(`Table`) and holds the command's arguments; `--backend torch` runs torch_backend/exactness.py.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_map

from ..exactness import ExactnessTable, Setting, print_tables
from ..ops.products import head_swapped, vocab_slice
from ..preference.dpo import adapter_off
from ..walk import (
    ExactWalk,
    WalkConfig,
    Window,
    arch,
    train_window,
    window_gradient,
    window_loss,
)
from ..walk.store import q8_fits
from . import torch_module

# Setting.recompute as window_gradient's keep_inputs
KEEP_INPUTS = {"": "auto", "inputs": "on", "recorded": "off", "stem": "stem"}
HEAD_SLICE = 96  # row (1d)'s vocabulary slice: 320 rows in 4 slices, the last short


def prepare(model: nn.Module, seed: int = 0, rank: int = 8) -> nn.Module:
    """LoRA on every layer, at a random nonzero point."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(seed)
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": rank, "scale": 20.0, "dropout": 0.0})
    model.update(
        tree_map(lambda p: 0.005 * mx.random.normal(p.shape), model.trainable_parameters())
    )
    mx.eval(model.parameters())
    return model


@contextmanager
def upper_layers_only(model: nn.Module, first: int) -> Iterator[None]:
    """Within the block, only the adapters of layers `first` and above train (mlx-lm's
    --num-layers): the walk's stem (arch.stem) is the layers beneath."""
    frozen = [layer for layer in model.layers[:first]]
    names = [[k for k, _ in tree_flatten(layer.trainable_parameters())] for layer in frozen]
    for layer in frozen:
        layer.freeze()
    try:
        yield
    finally:
        for layer, keys in zip(frozen, names):
            for key in keys:
                path, leaf = key.rsplit(".", 1)
                dict(layer.named_modules())[path].unfreeze(keys=[leaf], recurse=False)


class Table(ExactnessTable):
    """The rows for one model on one window, on MLX."""

    store_name = "cache"

    def __init__(self, model: nn.Module, name: str, window: int = 256, n_chunks: int = 4):
        self.model, self.layout = model, arch.inspect(model)
        self.layers, self.recurrent = len(self.layout.kinds), bool(self.layout.recurrent)
        super().__init__(name, self.layout.vocab, window, n_chunks)

    def header(self) -> str:
        lay = self.layout
        return (
            f"{self.name} ({lay.model_type}, {len(lay.kinds)} layers: {len(lay.attention)} "
            f"attention, {len(lay.recurrent)} recurrent), window {self.n}, chunk {self.chunk}"
        )

    def offers(self, setting: Setting) -> bool | str:
        if setting.placement != "device":  # the torch walk's placement
            return False
        if setting.store == "q8" and not q8_fits(self.layout.head_dims):
            return f"head dimension {', '.join(map(str, self.layout.head_dims))}"
        if setting.head == "sliced" and not head_swapped(self.model, "dequantized"):
            return "a tied or unquantized head"
        return True

    def walked(self, setting: Setting, weights: np.ndarray, chunk: int, ids: tuple):
        upper = upper_layers_only(self.model, self.layers // 2) if setting.upper_half else None
        # a bundled head's few hundred rows in several slices, as a real vocabulary's are
        rows = vocab_slice(HEAD_SLICE) if setting.head == "sliced" else None
        with upper or nullcontext(), rows or nullcontext():
            loss, grads = window_gradient(
                self.model,
                *ids,
                weights,
                chunk=chunk,
                walk=setting.walk,
                cache_type=setting.store,
                accumulator_dtype=setting.accumulators,
                attention=setting.attention,
                recompute=bool(setting.recompute),
                keep_inputs=KEEP_INPUTS[setting.recompute],
                head_products=setting.head,
            )
            return float(loss), grads

    def reference_loss(self, ids: tuple, weights: np.ndarray) -> float:
        with adapter_off(self.model):
            return float(window_loss(self.model, Window.of(*ids, weights), WalkConfig(self.chunk)))

    def planned(self, host_budget_mib: float | None, run: bool = True):
        window = Window.of(self.x, self.y, np.ones(self.n))
        walk = ExactWalk(
            self.model, window, WalkConfig(self.chunk, host_budget_mib=host_budget_mib)
        )
        if not run:
            return walk.plan, None
        loss, grads = walk.run()
        mx.eval(loss, grads)
        return walk.plan, grads

    def adapter(self):
        return self.model.trainable_parameters()

    def train(self, host_budget_mib: float) -> None:
        window = Window.of(self.x, self.y, np.ones(self.n))
        config = WalkConfig(chunk=self.chunk, host_budget_mib=host_budget_mib)
        train_window(self.model, optim.SGD(learning_rate=0.1), window, config)


def table(models: list[tuple[str, str]], as_json: bool = False, echo=print) -> bool:
    """Run every row on every (name, path); print the table; True when every row is OK."""
    from ..training import models as loading

    def tables():
        for name, path in models:
            model, _ = loading.load(path, tokenizer=False)
            yield Table(prepare(model), name)

    return print_tables(tables(), "test-walk-exact", as_json, echo, kernels_line)


def kernels_line() -> str:
    """Which kernels ran (the cases routed to one: attention, the delta rule's scans)."""
    from ..ops import routing

    ran = [str(case) for case, ok in routing.verdicts().items() if ok]
    off = [str(case) for case, ok in routing.verdicts().items() if not ok]
    line = "kernels: " + ("; ".join(ran) if ran else f"none ({routing.why_none()})")
    line += f"; ops path after a failed self-check: {'; '.join(off)}" if off else ""
    return line + (f"\n{TF32}" if tf32() else "")


TF32 = (
    "note: MLX's CUDA backend runs float32 products in TF32 unless MLX_ENABLE_TF32=0, and the "
    "exact rows' bar (2e-5) needs float32: rerun with MLX_ENABLE_TF32=0 (in TF32 they read "
    "about 4e-3)"
)


def tf32() -> bool:
    """Whether this run's float32 products may be TF32 (CUDA, MLX_ENABLE_TF32 not 0)."""
    return mx.cuda.is_available() and os.environ.get("MLX_ENABLE_TF32", "1") != "0"


HELP = "the walk's gradient against one graph, row by row"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="a model folder or hub id (default: every bundled model)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument(
        "--backend",
        choices=("mlx", "torch"),
        default="mlx",
        help="torch: transformers + PEFT through the torch walk (extra [torch])",
    )
    p.add_argument("--device", help="torch's device for --backend torch (default: the CPU)")


def run(args: argparse.Namespace) -> int:
    from .. import tiny

    if args.backend == "torch":
        exactness, model = torch_module("exactness"), torch_module("model")
        names = [args.model] if args.model else list(tiny.MODELS)
        bundled = {**tiny.MODELS, **tiny.FAMILIES}
        chosen = [(n, str(model.tiny_folder(n) if n in bundled else n)) for n in names]
        return 0 if exactness.run(chosen, as_json=args.json, device=args.device) else 1
    from ..training import models

    if args.model:
        chosen = [(args.model, str(models.resolve(args.model)))]
    else:
        chosen = [(name, str(tiny.path(name))) for name in tiny.MODELS]
    return 0 if table(chosen, as_json=args.json) else 1
