"""The buffer count (walk/buffers.py) against the arrays a real walk holds, and the 27B shape's
count at 67,584 tokens against Metal's resource limit.

The walk is instrumented: when a reverse chunk's graph returns (the moment every held part is at
its most), the arrays its objects hold are counted by identity (the model's parameters, the
optimizer's state, the store, the accumulators, the checkpoints, the kept inputs, the chunk's
gradients); each layer evaluation's graph is exported (`mx.export_to_dot`) and the arrays it
computes counted.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from mlxwalk.plan import plan_window
from mlxwalk.training import adapters
from mlxwalk.walk import ExactWalk, WalkConfig, Window, arch, buffers
from mlxwalk.walk.taps import ChunkKV
from scripts.lib import bench


def hybrid(config: dict, trained: int, lazy: bool = False) -> nn.Module:
    """A qwen3_5 model of `config`, 4-bit (mlx-lm's quantization), LoRA on its last `trained`
    layers; `lazy`: its arrays never evaluated (the 27B shape, counted without its memory)."""
    family = importlib.import_module("mlx_lm.models.qwen3_5")
    mx.random.seed(0)
    model = family.Model(family.ModelArgs.from_dict(config))
    nn.quantize(
        model,
        group_size=64,
        bits=4,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
    )
    adapters.apply(model, adapters.LoraConfig(rank=8, num_layers=trained))
    if not lazy:
        mx.eval(model.parameters())
    return model


TINY = {
    **bench.SHAPES["qwen3_5-27b"],
    **bench.SMALL,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}


def _flat(tree, out: list) -> list:
    if isinstance(tree, mx.array):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _flat(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _flat(v, out)
    return out


def computed(arrays, dot: Path) -> int:
    """Arrays an evaluation of `arrays` computes: its graph's nodes less its inputs."""
    flat = _flat(arrays, [])
    if not flat:
        return 0
    mx.export_to_dot(str(dot), *flat)
    text = dot.read_text()
    nodes = set(re.findall(r'^\{ (?:rank=\w+; )?"(\w+)"; \}', text, re.M))
    inputs = set(re.findall(r'^\{ rank=source; "(\w+)"; \}', text, re.M))
    return len(nodes - inputs)


def instrumented(model, window: int, config: WalkConfig, dot: Path, chunks: int | None = None):
    """(the most arrays the walk's objects held when a chunk's graph returned, the most arrays
    one chunk's graph held: its recorded inputs and the layer evaluation that computes the most,
    that most per layer kind, the walk); `chunks`: the reverse pass stops after that many."""
    ids = np.random.default_rng(0).integers(0, 512, window + 1)
    walk = ExactWalk(model, Window.of(ids[:-1], ids[1:], np.ones(window)), config)
    optimizer = optim.Adam(learning_rate=1e-5)
    optimizer.init(model.trainable_parameters())
    most = {"held": 0, "layer": 0}
    kinds: dict[str, int] = {}
    graph, timed = walk.graph, walk.layers.timed

    def counted_graph(chunk, caches, sink=None):
        sunk = []  # the recurrent layers' state gradients, held by the walk until the chunk ends

        def seen(i: int, g: list) -> None:
            if not isinstance(caches[i], ChunkKV):
                sunk.append(g)
            sink(i, g)

        loss, g_params, g_inputs = graph(chunk, caches, seen)
        acc = walk.acc
        parts = [model.parameters(), optimizer.state, walk.store.arrays(), acc.keys, acc.values]
        parts += [acc.state, acc.grads, walk.checkpoints, walk.kept, g_params, g_inputs, sunk]
        held = {id(a): a for a in _flat(parts, []) if a.size > 0}
        most["held"] = max(most["held"], len(held))
        return loss, g_params, g_inputs

    def counted_layer(what, cache, arrays):
        if what == "backward":
            kind = "attention" if isinstance(cache, ChunkKV) else "recurrent"
            kinds[kind] = max(kinds.get(kind, 0), computed(arrays, dot))
            most["layer"] = max(most["layer"], kinds[kind])
        return timed(what, cache, arrays)

    walk.graph, walk.layers.timed = counted_graph, counted_layer
    walk.run(chunks)
    recorded = len(walk.layout.kinds) - walk.stem + 1  # each trained layer's input, the output
    return most["held"], most["layer"] + recorded, kinds, walk


CASES = [  # (window, chunk, keep inputs, cache type, host budget MiB); the first in the fast suite
    (512, 128, "stem", "bfloat16", None),
    pytest.param(1024, 128, "on", "bfloat16", None, marks=pytest.mark.slow),
    # a host budget that lengthens the checkpoint stride
    pytest.param(1536, 256, "stem", "q8", 3.3, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("window,chunk,keep,cache,host", CASES)
def test_count_equals_the_walk(tmp_path, window, chunk, keep, cache, host):
    model = hybrid(TINY, trained=3)
    config = WalkConfig(
        chunk=chunk,
        recompute=True,
        keep_inputs=keep,
        cache_type=cache,
        products="quantized",
        host_budget_mib=host,
    )
    held, graph, _, walk = instrumented(model, window, config, tmp_path / "graph.dot")
    assert walk.stem == 5 and (host is None or walk.plan.stride > 1)
    count = buffers.count(model, walk.layout, walk.plan, cache, walk.stem, walk.keep)
    assert count.held == held, (count, held)
    # the graph's bound holds, within 1% of the measured graph
    assert graph <= count.graph <= 1.01 * graph, (graph, count.graph)


@pytest.mark.parametrize(
    "window,chunk",
    [(1024, 256)] + [pytest.param(*c, marks=pytest.mark.slow) for c in ((2048, 512), (4608, 512))],
)
def test_layer_graphs(tmp_path, window, chunk):
    """Each kind's layer graph against its formula, at 1-4 prefix tiles and 4-8 delta blocks:
    the first reverse chunk, which reads the longest prefix."""
    model = hybrid(TINY, trained=3)
    config = WalkConfig(
        chunk=chunk,
        recompute=True,
        keep_inputs="stem",
        cache_type="bfloat16",  # a float32 store reads its tiles with fewer casts: fewer arrays
        products="quantized",
    )
    _, _, kinds, _ = instrumented(model, window, config, tmp_path / "graph.dot", chunks=1)
    for kind, measured in kinds.items():
        bound = buffers.layer_bound(kind, chunk, window - chunk)
        assert measured <= bound <= 1.01 * measured, (kind, measured, bound)
    assert set(kinds) == {"attention", "recurrent"}


def test_27b_shape_far_below_metal_limit():
    """Qwen3.5-27B-shaped, 4-bit, bf16 store, 67,584 tokens in chunks of 2,048, the stem's output
    kept (the H200 run of docs/BENCHMARKS.md), every checkpoint kept (stride 1: the most)."""
    model = hybrid(bench.SHAPES["qwen3_5-27b"], trained=16, lazy=True)
    layout, stem = arch.inspect(model), arch.stem(model)
    plan = plan_window([1.0] * 67584, 2048, layout.footprint(stem), follow_runs=False)
    count = buffers.count(model, layout, plan, "bfloat16", stem, "stem")
    assert stem == 48 and len(plan.chunks) == 33
    assert count.weights > 64 * 3 * 7  # every layer's seven or more quantized linears, 3 arrays
    assert count.total < buffers.LIMIT / 10, count
    print(count, count.line())


def test_count_grows_with_the_window():
    """Checkpoints and kept inputs are per chunk: the count is linear in the chunks."""
    model = hybrid(TINY, trained=3)
    layout, stem = arch.inspect(model), arch.stem(model)

    def total(n: int, keep: str = "stem") -> int:
        plan = plan_window([1.0] * n, 128, layout.footprint(stem), follow_runs=False)
        return buffers.count(model, layout, plan, "bfloat16", stem, keep, graph=0).total

    shapes = zip(layout.recurrent, layout.state_shapes)
    trained = sum(len(s) for i, s in shapes if i >= stem)
    # a checkpoint (the trained layers' states: the stem's output is kept), a kept input
    assert total(1280) - total(640) == 5 * (trained + 1)
    # no inputs kept: every recurrent layer's state is held
    assert total(1280, "off") - total(640, "off") == 5 * sum(len(s) for s in layout.state_shapes)
    assert sum(1 for _ in tree_flatten(model.parameters())) > 0
