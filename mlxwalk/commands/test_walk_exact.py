"""test-walk-exact: the walk's gradient against its reference, row by row, on any model.

Rows (numbered after the reference system's acceptance test):
  (1)  every position labelled, 4 chunks: the exact walk and the plain walk vs one graph
  (1a) the exact walk through each attention path (tiled chunk_attention, mlx-lm's fused)
  (1b) the exact walk with float16, bfloat16 and 8-bit caches vs the float32 one graph
  (1c) bfloat16 K/V gradient accumulators vs float32 ones
  (2)  context then reply, 4 chunks vs one chunk per run
  (3)  a host budget of 1 byte is refused, naming host memory, and the adapter is untouched
  (4)  recurrent models: a host budget of 3/4 of the per-chunk checkpoints forces a stride > 1,
       holds fewer bytes and gives the same gradient
  (7)  recompute (each layer's graph alone, from its input kept from the decode) vs not
  (7b) recompute from a recorded forward (no inputs kept) vs not
  (8)  LoRA on the upper half of the layers only, recompute: exact vs one graph
  (8b) the same, the output of the frozen layers beneath (the stem) kept
The adapter is moved to a random nonzero point first, so every LoRA gradient is nonzero.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten, tree_map

from ..grading import (
    BARS,
    BFLOAT16_ACCUMULATORS,
    BFLOAT16_STORE,
    EXACT,
    FLOAT16_STORE,
    Q8_STORE,
    TELLS_APART,
    Row,
    compare,
    compared_row,
    flat,
    print_tables,
    refusal_row,
)
from ..plan import MIB, OutOfMemory
from ..walk import ExactWalk, WalkConfig, Window, arch, train_window, window_gradient
from ..walk.store import q8_fits
from . import torch_module

ATTENTION = {"tiled": "chunk_attention", "fused": "mlx-lm's"}
CACHE_BARS = {"float16": FLOAT16_STORE, "bfloat16": BFLOAT16_STORE, "q8": Q8_STORE}


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


class Table:
    """The rows for one model on one window."""

    def __init__(self, model: nn.Module, name: str, window: int = 256, n_chunks: int = 4):
        self.model, self.name = model, name
        self.layout = arch.inspect(model)
        self.n, self.chunk = window, window // n_chunks
        rng = np.random.default_rng(0)
        ids = rng.integers(0, self.layout.vocab, window + 1)  # ids the model has
        self.x, self.y = ids[:-1], ids[1:]
        self.rows: list[Row] = []

    def grad(self, weights, **kw):
        return window_gradient(self.model, self.x, self.y, weights, **kw)[1]

    def add(self, row: str, what: str, bar: str, grads, reference) -> None:
        self.rows.append(compared_row(self.name, row, what, bar, lambda: grads, lambda: reference))

    def compared(self, row: str, what: str, bar: str, walk, reference) -> None:
        self.rows.append(compared_row(self.name, row, what, bar, walk, reference))

    def run(self) -> list[Row]:
        every = np.ones(self.n)
        one = self.grad(every, chunk=self.n, walk="one-graph")
        exact = self.grad(every, chunk=self.chunk)
        self.walks(every, one, exact)
        self.caches(every, one, exact)
        self.reply()
        self.rows.append(self.refusal(every))
        if self.layout.recurrent:
            self.strided(every)
        self.recomputed(every, exact)
        return self.rows

    def walks(self, every, one, exact) -> None:
        """(1), (1a): the exact walk through each attention path vs one graph; the plain walk
        told apart from it."""
        k = self.n // self.chunk
        self.add(
            "(1)", f"every position labelled, {k} chunks: exact vs one graph", EXACT, exact, one
        )
        for attention in ("tiled", "fused"):
            self.compared(
                "(1a)",
                f"{attention} attention ({ATTENTION[attention]}): exact vs one graph",
                EXACT,
                lambda a=attention: self.grad(every, chunk=self.chunk, attention=a),
                lambda: one,
            )
        self.compared(
            "(1)",
            f"every position labelled, {k} chunks: plain vs one graph",
            TELLS_APART,
            lambda: self.grad(every, chunk=self.chunk, walk="plain"),
            lambda: one,
        )

    def caches(self, every, one, exact) -> None:
        """(1b), (1c): narrower caches and accumulators, each against float32."""
        for cache, bar in CACHE_BARS.items():
            what = f"{cache} cache: exact vs float32 one graph"
            if cache == "q8" and not q8_fits(self.layout.head_dims):
                dims = ", ".join(map(str, self.layout.head_dims))
                detail = f"not offered: head dimension {dims}"
                self.rows.append(Row(self.name, "(1b)", what, bar, True, detail=detail))
                continue
            self.compared(
                "(1b)",
                what,
                bar,
                lambda c=cache: self.grad(every, chunk=self.chunk, cache_type=c),
                lambda: one,
            )
        self.compared(
            "(1c)",
            "bfloat16 accumulators vs float32",
            BFLOAT16_ACCUMULATORS,
            lambda: self.grad(every, chunk=self.chunk, accumulator_dtype="bfloat16"),
            lambda: exact,
        )

    def reply(self) -> None:
        """(2): only the second half labelled, chunked vs one chunk per run."""
        reply = np.r_[np.zeros(self.n // 2), np.ones(self.n - self.n // 2)]
        self.compared(
            "(2)",
            f"context then reply, {self.n // self.chunk} chunks vs one chunk per run",
            EXACT,
            lambda: self.grad(reply, chunk=self.chunk),
            lambda: self.grad(reply, chunk=self.n),
        )

    def recomputed(self, every, exact) -> None:
        """(7), (7b), (8), (8b): each layer's graph rebuilt in the backward, from kept inputs or
        a recorded forward; with only the upper layers' adapters training, from the stem's
        output."""

        def recompute(keep: str):
            return lambda: self.grad(every, chunk=self.chunk, recompute=True, keep_inputs=keep)

        def one():
            return self.grad(every, chunk=self.n, walk="one-graph")

        self.compared(
            "(7)", "recompute, layer inputs kept, vs not", EXACT, recompute("on"), lambda: exact
        )
        self.compared(
            "(7b)", "recompute, a recorded forward, vs not", EXACT, recompute("off"), lambda: exact
        )
        half = len(self.layout.kinds) // 2
        with upper_layers_only(self.model, half):
            what = f"LoRA on layers {half}+ only, recompute: exact vs one graph"
            self.compared("(8)", what, EXACT, recompute("on"), one)
            what = "the same, the stem's output kept: exact vs one graph"
            self.compared("(8b)", what, EXACT, recompute("stem"), one)

    def refusal(self, weights) -> Row:
        before = flat(self.model.trainable_parameters())
        config = WalkConfig(chunk=self.chunk, host_budget_mib=1 / MIB)
        try:
            train_window(
                self.model, optim.SGD(learning_rate=0.1), Window.of(self.x, self.y, weights), config
            )
            message = ""
        except OutOfMemory as e:
            message = str(e)
        untouched = np.array_equal(before, flat(self.model.trainable_parameters()))
        return refusal_row(self.name, message, untouched)

    def strided(self, weights) -> None:
        window = Window.of(self.x, self.y, weights)
        free = ExactWalk(self.model, window, WalkConfig(chunk=self.chunk)).plan
        budget = free.accumulator_bytes + free.checkpoint_bytes * 3 / 4
        config = WalkConfig(chunk=self.chunk, host_budget_mib=budget / MIB)
        walk = ExactWalk(self.model, window, config)
        loss, grads = walk.run()
        mx.eval(loss, grads)
        c, e = compare(grads, self.grad(weights, chunk=self.chunk))
        fewer = walk.plan.stride > 1 and walk.plan.host_bytes < free.host_bytes
        what = (
            f"3/4 checkpoint budget: stride {walk.plan.stride}, "
            f"{walk.plan.host_bytes / MIB:.2f} vs {free.host_bytes / MIB:.2f} MiB"
        )
        self.rows.append(Row(self.name, "(4)", what, EXACT, BARS[EXACT](c, e) and fewer, c, e))


def header(name: str, table: Table) -> str:
    lay = table.layout
    return (
        f"{name} ({lay.model_type}, {len(lay.kinds)} layers: {len(lay.attention)} attention, "
        f"{len(lay.recurrent)} recurrent), window {table.n}, chunk {table.chunk}"
    )


def table(models: list[tuple[str, str]], as_json: bool = False, echo=print) -> bool:
    """Run every row on every (name, path); print the table; True when every row is OK."""
    from ..training import models as loading

    def tables():
        for name, path in models:
            model, _ = loading.load(path, tokenizer=False)
            table = Table(prepare(model), name)
            yield header(name, table), table.run()

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
