"""test-walk-exact --backend torch: the table's rows (mlxwalk/exactness.py's) run through the
torch walk, on a transformers model with a PEFT adapter: (1) the exact and plain walks, (1b) a
bfloat16 K/V store, (1c) the store and accumulators in host memory, (2), (3) and (4). The
adapter starts at a random nonzero point, so every LoRA gradient is nonzero.
"""

from __future__ import annotations

import numpy as np
import torch

from ..exactness import ExactnessTable, Setting, print_tables
from ..walk.window import Window
from . import model as models
from .walk import (
    ExactWalk,
    PlainWalk,
    TorchWalkConfig,
    gradients,
    train_window,
    window_gradient,
)

STORES = ("float32", "bfloat16")  # the K/V stores this table walks with


class Table(ExactnessTable):
    """The rows for one model on one window, on torch."""

    store_name = "K/V store"

    def __init__(self, model, name: str, window: int = 256, n_chunks: int = 4):
        self.model = model
        kinds = models.layer_kinds(model)
        self.layers, self.recurrent = len(kinds), bool(models.footprint(model).recurrent)
        super().__init__(name, models.text_config(model).vocab_size, window, n_chunks)

    def header(self) -> str:
        kinds = models.layer_kinds(self.model)
        device = next(self.model.parameters()).device
        return (
            f"{self.name} (torch {torch.__version__} on {device}, "
            f"{models.text_config(self.model).model_type}, {len(kinds)} layers: "
            f"{kinds.count('attention')} attention, {kinds.count('recurrent')} recurrent), "
            f"window {self.n}, chunk {self.chunk}"
        )

    def offers(self, setting: Setting) -> bool:
        # the torch walk has no attention paths, bfloat16 accumulators, recompute or sliced head
        return (
            setting.store in STORES
            and setting.accumulators == "float32"
            and setting.attention == "auto"
            and not setting.recompute
            and not setting.upper_half
            and setting.head == "auto"
        )

    def walked(self, setting: Setting, weights: np.ndarray, chunk: int, ids: tuple) -> tuple:
        config = {"chunk": chunk}  # one-graph reads no config
        if setting.store != "float32":
            config["store_dtype"] = setting.store
        if setting.placement == "host":
            config.update(accumulators="host", store="host")
        return window_gradient(self.model, *ids, weights, walk=setting.walk, **config)

    def reference_loss(self, ids: tuple, weights: np.ndarray) -> float:
        window = Window.of(*ids, weights)
        with self.model.disable_adapter(), torch.no_grad():  # PEFT's: the model it adapts
            return PlainWalk(self.model, window, TorchWalkConfig(self.chunk)).loss_only()

    def planned(self, host_budget_mib: float | None, run: bool = True):
        window = Window.of(self.x, self.y, np.ones(self.n))
        walk = ExactWalk(
            self.model, window, TorchWalkConfig(self.chunk, host_budget_mib=host_budget_mib)
        )
        if not run:
            return walk.plan, None
        self.model.zero_grad(set_to_none=True)
        walk.run()
        return walk.plan, gradients(self.model)

    def params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def adapter(self) -> list[torch.Tensor]:
        return [p.detach().cpu() for p in self.params()]

    def train(self, host_budget_mib: float) -> None:
        window = Window.of(self.x, self.y, np.ones(self.n))
        config = TorchWalkConfig(chunk=self.chunk, host_budget_mib=host_budget_mib)
        train_window(self.model, torch.optim.SGD(self.params(), lr=0.1), window, config)


def run(chosen: list[tuple[str, str]], as_json: bool = False, echo=print, device=None) -> bool:
    """Every row on every (name, transformers folder), float32; True when every row is OK.
    On CUDA, TF32 is off for the run (the exact bar is float32's; cuDNN's convolutions, the
    hybrids' causal conv among them, would otherwise take TF32)."""

    def tables():
        for name, folder in chosen:
            model = models.add_lora(models.load(folder, device=device), rank=8, seed=0)
            yield Table(model, name)

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        return print_tables(tables(), "test-walk-exact --backend torch", as_json, echo)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = before
