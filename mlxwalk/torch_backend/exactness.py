"""test-walk-exact --backend torch: the torch walk's gradient against one graph, row by row, on
a transformers model with a PEFT adapter (the bars are mlxwalk/grading.py's, the MLX side's
rows mlxwalk/commands/test_walk_exact.py's):
  (1)  every position labelled, 4 chunks: the exact walk and the plain walk vs one graph
  (1b) a bfloat16 K/V store vs the float32 one graph
  (1c) the K/V store and gradient accumulators in host memory vs on the device
  (2)  context then reply, 4 chunks vs one chunk per run
  (3)  a host budget of 1 byte is refused, naming host memory, and the adapter is untouched
  (4)  recurrent models: a host budget of 3/4 of the checkpoints forces a stride > 1, holds
       fewer bytes and gives the same gradient
The adapter starts at a random nonzero point, so every LoRA gradient is nonzero.
"""

from __future__ import annotations

import numpy as np
import torch

from ..grading import (
    BARS,
    BFLOAT16_STORE,
    EXACT,
    TELLS_APART,
    Row,
    compare,
    compared_row,
    print_tables,
    refusal_row,
)
from ..plan import MIB, OutOfMemory
from ..walk.config import Window
from . import model as models
from .walk import ExactWalk, TorchWalkConfig, gradients, train_window, window_gradient


class Table:
    """The rows for one model on one window."""

    def __init__(self, model, name: str, window: int = 256, n_chunks: int = 4):
        self.model, self.name = model, name
        self.n, self.chunk = window, window // n_chunks
        rng = np.random.default_rng(0)
        ids = rng.integers(0, models.text_config(model).vocab_size, window + 1)
        self.x, self.y = ids[:-1], ids[1:]
        self.rows: list[Row] = []

    def grad(self, weights, **kw) -> dict:
        return window_gradient(self.model, self.x, self.y, weights, **kw)[1]

    def compared(self, row: str, what: str, bar: str, walk, reference) -> None:
        self.rows.append(compared_row(self.name, row, what, bar, walk, reference))

    def run(self) -> list[Row]:
        every = np.ones(self.n)
        reply = np.r_[np.zeros(self.n // 2), np.ones(self.n - self.n // 2)]
        k, c = self.n // self.chunk, self.chunk
        one = self.grad(every, walk="one-graph")
        exact = self.grad(every, chunk=c)
        self.compared(
            "(1)",
            f"every position labelled, {k} chunks: exact vs one graph",
            EXACT,
            lambda: exact,
            lambda: one,
        )
        self.compared(
            "(1)",
            f"every position labelled, {k} chunks: plain vs one graph",
            TELLS_APART,
            lambda: self.grad(every, chunk=c, walk="plain"),
            lambda: one,
        )
        self.compared(
            "(1b)",
            "bfloat16 K/V store: exact vs float32 one graph",
            BFLOAT16_STORE,
            lambda: self.grad(every, chunk=c, store_dtype="bfloat16"),
            lambda: one,
        )
        self.compared(
            "(1c)",
            "K/V store and accumulators in host memory vs device",
            EXACT,
            lambda: self.grad(every, chunk=c, accumulators="host", store="host"),
            lambda: exact,
        )
        self.compared(
            "(2)",
            f"context then reply, {k} chunks vs one chunk per run",
            EXACT,
            lambda: self.grad(reply, chunk=c),
            lambda: self.grad(reply, chunk=self.n),
        )
        self.rows.append(self.refusal(every))
        if models.footprint(self.model).recurrent:
            self.strided(every)
        return self.rows

    def refusal(self, weights) -> Row:
        params = [p for p in self.model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        config = TorchWalkConfig(chunk=self.chunk, host_budget_mib=1 / MIB)
        optimizer = torch.optim.SGD(params, lr=0.1)
        try:
            train_window(self.model, optimizer, Window.of(self.x, self.y, weights), config)
            message = ""
        except OutOfMemory as e:
            message = str(e)
        untouched = all(torch.equal(a, p) for a, p in zip(before, params))
        return refusal_row(self.name, message, untouched)

    def strided(self, weights) -> None:
        window = Window.of(self.x, self.y, weights)
        free = ExactWalk(self.model, window, TorchWalkConfig(chunk=self.chunk)).plan
        budget = free.accumulator_bytes + free.checkpoint_bytes * 3 / 4
        walk = ExactWalk(
            self.model, window, TorchWalkConfig(self.chunk, host_budget_mib=budget / MIB)
        )
        self.model.zero_grad(set_to_none=True)
        walk.run()
        walked, plan = gradients(self.model), walk.plan
        c, e = compare(walked, self.grad(weights, chunk=self.chunk))
        fewer = plan.stride > 1 and plan.host_bytes < free.host_bytes
        what = (
            f"3/4 checkpoint budget: stride {plan.stride}, "
            f"{plan.host_bytes / MIB:.2f} vs {free.host_bytes / MIB:.2f} MiB"
        )
        self.rows.append(Row(self.name, "(4)", what, EXACT, BARS[EXACT](c, e) and fewer, c, e))


def header(name: str, model, table: Table) -> str:
    kinds = models.layer_kinds(model)
    device = next(model.parameters()).device
    return (
        f"{name} (torch {torch.__version__} on {device}, "
        f"{models.text_config(model).model_type}, {len(kinds)} layers: "
        f"{kinds.count('attention')} attention, {kinds.count('recurrent')} recurrent), "
        f"window {table.n}, chunk {table.chunk}"
    )


def run(chosen: list[tuple[str, str]], as_json: bool = False, echo=print, device=None) -> bool:
    """Every row on every (name, transformers folder), float32; True when every row is OK.
    On CUDA, TF32 is off for the run (the exact bar is float32's; cuDNN's convolutions, the
    hybrids' causal conv among them, would otherwise take TF32)."""

    def tables():
        for name, folder in chosen:
            model = models.add_lora(models.load(folder, device=device), rank=8, seed=0)
            table = Table(model, name)
            yield header(name, model, table), table.run()

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        return print_tables(tables(), "test-walk-exact --backend torch", as_json, echo)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = before
