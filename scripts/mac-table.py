#!/usr/bin/env python3
"""docs/MAC.md's tables: per Mac memory size, the GPU working set macOS gives by default, and for
three model shapes the largest exact window `mlxwalk plan`'s admission accepts under it (every
chunk at the whole horizon) with the seconds that window takes by the roofline on two Apple GPUs.

    python scripts/mac-table.py            the tables, as docs/MAC.md has them
    python scripts/mac-table.py --probe    measure one chunk's graph for each shape on this
                                           machine (the planner's probe), as JSON

The planner needs one chunk's graph, measured on the model (walk/probe.py); PROBES holds what
`--probe` printed on the H200 (MLX's CUDA backend, docs/h200/mac-probe.log), since a 27B-shaped
model cannot be walked on a CPU. Everything else is computed here from the shapes: the models are
built without evaluating a weight (their arrays' sizes are known, nothing is allocated).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from lib import bench  # noqa: E402
from mlx import nn  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

from metal_kernels import roofline  # noqa: E402
from mlxwalk.errors import OutOfMemory  # noqa: E402
from mlxwalk.plan import MIB  # noqa: E402
from mlxwalk.training import adapters  # noqa: E402
from mlxwalk.walk import ExactWalk, WalkConfig, Window, admission, arch  # noqa: E402
from mlxwalk.walk.activations import Activations  # noqa: E402
from mlxwalk.walk.machine import GIB, MACS, working_set  # noqa: E402

CHUNK = 2048
STEP = 1024  # the windows tried: multiples of this

# (label, bench.SHAPES name, bits of the base: None = bf16)
MODELS = (
    ("Qwen2.5-0.5B-shaped, bf16", "qwen2-0.5b", None),
    ("Llama-3-8B-shaped, 4-bit", "llama3-8b", 4),
    ("Qwen3.5-27B-shaped, 4-bit", "qwen3_5-27b", 4),
)

# One chunk's graph per shape (bytes; per prefix position in K/V widths at float32), as
# `--probe` measured it on the H200 at CONFIG's settings (docs/h200/mac-probe.log).
PROBES: dict[str, dict] = {
    "qwen2-0.5b": dict(chunk=2048, graph=1993147696, tap_factor=0.0, prefix_factor=0.49237331),
    "llama3-8b": dict(chunk=2048, graph=3752199512, tap_factor=0.125, prefix_factor=0.0),
    "qwen3_5-27b": dict(chunk=2048, graph=9966897056, tap_factor=0.03136832, prefix_factor=0.0),
}


def config(budget_mib: float | None = None) -> WalkConfig:
    """The settings of the 27B run in docs/BENCHMARKS.md: chunk 2,048, recompute, the stem's output
    kept, a bf16 store; the head's quantized products (what admission falls back to under a
    tight budget), refusing any window whose horizon the budget would narrow; the chunk held."""
    return WalkConfig(
        chunk=CHUNK,
        min_chunk=CHUNK,
        recompute=True,
        keep_inputs="stem",
        cache_type="bfloat16",
        head_products="quantized",
        memory_budget_mib=budget_mib,
        strict_exact=budget_mib is not None,
    )


def model_of(name: str, bits: int | None, evaluate: bool = False) -> nn.Module:
    """bench.SHAPES[name] in bf16 (quantized to `bits`), LoRA r8 on the last 16 layers, as
    bench.shaped builds it; unevaluated unless `evaluate` (then with bench's random weights)."""
    if evaluate:
        return bench.shaped(name, bits=bits)[0]
    cfg = bench.SHAPES[name]
    family = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = family.Model(family.ModelArgs.from_dict(cfg))
    model.update(tree_map(lambda p: p.astype(mx.bfloat16), model.parameters()))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    adapters.apply(model, adapters.LoraConfig(rank=8, scale=20.0, num_layers=16))
    return model


def products(model: nn.Module, layout) -> roofline.Products:
    """Each decoder layer's weight products per position and the bytes of its frozen weights;
    the head's (the embedding's, when tied)."""

    def macs(module) -> int:
        total = 0
        for _, m in module.named_modules():
            if isinstance(m, nn.QuantizedLinear):
                total += m.weight.shape[0] * m.scales.shape[-1] * m.group_size
            elif isinstance(m, nn.Linear):
                total += m.weight.shape[0] * m.weight.shape[1]
        return total

    def frozen(module) -> int:
        trainable = {id(v) for _, v in tree_flatten(module.trainable_parameters())}
        return sum(v.nbytes for _, v in tree_flatten(module.parameters()) if id(v) not in trainable)

    lm = getattr(model, "language_model", model)
    head = getattr(lm, "lm_head", None) or lm.model.embed_tokens
    layers = lm.model.layers
    return roofline.Products(
        tuple(macs(x) for x in layers),
        tuple(frozen(x) for x in layers),
        layout.vocab * layout.hidden,
        frozen(head),
    )


def fits(model, layout, graphs: admission.Graphs, window: int, budget: int) -> bool:
    """Whether the planner admits `window` under `budget` at the whole horizon, one chunk's graph
    as `graphs` holds it (the measured probe, in place of measuring it here)."""
    try:
        walk = ExactWalk(model, Window.labelled(window), config(budget / MIB), layout, graphs)
    except OutOfMemory:
        return False
    return walk.estimate.total <= budget


def rows(label: str, name: str, bits: int | None) -> list[str]:
    model = model_of(name, bits)
    layout, stem = arch.inspect(model), arch.stem(model)
    # CONFIG's head products are quantized: the one graph its admissions ask for
    graphs = admission.Graphs(0, {"quantized": Activations(**PROBES[name])})
    most = bench.SHAPES[name]["max_position_embeddings"]
    shape = roofline.Shape.of(bench.SHAPES[name])
    weights = products(model, layout)
    out = []
    for gb in MACS:
        budget = working_set(gb)
        n = bench.largest_window(
            lambda w, b=budget: fits(model, layout, graphs, w, b), STEP, most, STEP
        )
        if n <= 0:
            out.append(f"| {gb} GB | {budget / GIB:.1f} | does not fit | - | - |")
            continue
        launches = roofline.window(shape, layout.kinds, weights, stem, n, CHUNK, layout.dtype)
        s = [roofline.seconds(launches, gpu) for gpu in (roofline.M1_7CORE, roofline.M1_MAX)]
        note = " (the model's maximum)" if n == most else ""
        out.append(f"| {gb} GB | {budget / GIB:.1f} | {n:,}{note} | {s[0]:,.0f} | {s[1]:,.0f} |")
    head = [
        f"**{label}** (`python scripts/mac-table.py`)",
        "",
        "| Mac memory | GPU working set GiB (default, estimate) | largest exact window "
        "(estimate) | s/window, M1 7-core GPU (lower bound) | s/window, M1 Max 32-core "
        "(lower bound) |",
        "|---:|---:|---:|---:|---:|",
    ]
    return head + out


def probe() -> dict:
    """One chunk's graph per shape, by the planner's probe on this machine at CONFIG's settings
    over a prefix of two chunks (random weights, as bench.shaped builds them)."""
    out = {}
    for label, name, bits in MODELS:
        model = model_of(name, bits, evaluate=True)
        acts = admission.probe(ExactWalk, model, config(), reach=2 * CHUNK, echo=print)
        out[name] = {k: getattr(acts, k) for k in ("chunk", "graph", "tap_factor")} | {
            "prefix_factor": acts.prefix_factor
        }
        print(label, json.dumps(out[name]), flush=True)
        del model
        mx.clear_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probe", action="store_true", help="measure the graphs here, print JSON")
    a = p.parse_args()
    if a.probe:
        print(json.dumps(probe(), indent=1))
        return
    missing = [name for _, name, _ in MODELS if name not in PROBES]
    if missing:
        raise SystemExit(f"no measured graph for {', '.join(missing)}: run with --probe first")
    for label, name, bits in MODELS:
        print("\n".join(rows(label, name, bits)) + "\n")


if __name__ == "__main__":
    main()
