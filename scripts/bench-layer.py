#!/usr/bin/env python3
"""Where one chunk's time goes on a shape's attention layer, op by op, side by side in one
process: attention over a prefix (MLX's fused path on the bare arrays, and as the walk feeds it:
the 8-bit store read, the taps added, the concatenation), the layer's projections (the 4-bit
weight multiplied quantized and dequantized), and the head and loss (quantized, dequantized).

    scripts/bench-layer.py [--shape llama3-8b] [--chunk 2048] [--prefixes 0 30720 61440]
                           [--repeats 3] [--small]

Each row: median seconds of `--repeats` after a warm-up, and the peak over what was allocated
before the call. `--small` shrinks the shape to check the script on a CPU.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import mlx.nn as nn
from lib import bench

from mlxwalk.ops import products
from mlxwalk.walk import loss as walk_loss
from mlxwalk.walk.arch import Head

DTYPE = mx.bfloat16


def rand(*shape) -> mx.array:
    return (mx.random.normal(shape) * 0.5).astype(DTYPE)


def row(name: str, fn, repeats: int) -> None:
    s, _, over = bench.timed(lambda: mx.eval(fn()), repeats)
    print(f"| {name} | {s * 1e3:.2f} | {over / 1024:.2f} |", flush=True)


def attention_rows(cfg: dict, chunk: int, prefix: int, repeats: int) -> None:
    h, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    scale = d**-0.5
    q, k, v, do = rand(1, h, chunk, d), rand(1, hkv, chunk, d), rand(1, hkv, chunk, d), None
    do = rand(1, h, chunk, d)
    pk, pv = rand(1, hkv, prefix, d), rand(1, hkv, prefix, d)
    store = [mx.quantize(a, group_size=64, bits=8) for a in (pk, pv)] if prefix else []
    taps = [mx.zeros((1, hkv, prefix, d), DTYPE) for _ in range(2)]
    kk, vv = (
        (mx.concatenate([pk, k], axis=2), mx.concatenate([pv, v], axis=2)) if prefix else (k, v)
    )
    mx.eval(q, k, v, do, kk, vv, store, taps)

    def sdpa(q, kk, vv):
        return mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask="causal")

    def bare(q, kk, vv):
        return (sdpa(q, kk, vv) * do).astype(mx.float32).sum()

    def fed(q, k, v, tk, tv):
        # as ChunkKV.update_and_fetch: the store read, the taps added, the chunk's K/V appended
        sk = mx.dequantize(*store[0], group_size=64, bits=8).astype(DTYPE) + tk
        sv = mx.dequantize(*store[1], group_size=64, bits=8).astype(DTYPE) + tv
        kk = mx.concatenate([sk, k], axis=2)
        vv = mx.concatenate([sv, v], axis=2)
        return (sdpa(q, kk, vv) * do).astype(mx.float32).sum()

    tag = f"prefix {prefix}"
    row(f"attention forward, bare ({tag})", lambda: sdpa(q, kk, vv), repeats)
    row(
        f"attention forward+backward, bare ({tag})",
        lambda: mx.grad(bare, (0, 1, 2))(q, kk, vv),
        repeats,
    )
    if prefix:
        row(
            f"attention forward+backward, as the walk feeds it ({tag})",
            lambda: mx.grad(fed, (0, 1, 2, 3, 4))(q, k, v, *taps),
            repeats,
        )


def projections(cfg: dict, bits: int) -> list[nn.Module]:
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hkv, d, h = cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_attention_heads"]
    shapes = [(hid, h * d), (hid, hkv * d), (hid, hkv * d), (h * d, hid)]
    shapes += [(hid, inter), (hid, inter), (inter, hid)]
    layers = []
    for fan_in, fan_out in shapes:
        lin = nn.Linear(fan_in, fan_out, bias=False)
        lin.weight = rand(fan_out, fan_in) * (fan_in**-0.5)
        layers.append(nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits))
    mx.eval([m.parameters() for m in layers])
    return layers


def projection_rows(cfg: dict, chunk: int, bits: int, repeats: int) -> None:
    layers = projections(cfg, bits)
    xs = [rand(1, chunk, m.weight.shape[1] * 32 // bits) for m in layers]
    mx.eval(xs)

    def run(xs):
        return sum((m(x).astype(mx.float32) ** 2).sum() for m, x in zip(layers, xs))

    for kind in ("quantized", "dequantized"):
        cls = products.DequantizedLinear if kind == "dequantized" else nn.QuantizedLinear
        for m in layers:
            m.__class__ = cls
        row(f"a layer's 7 projections forward, {kind}", lambda: run(xs), repeats)
        row(f"a layer's 7 projections forward+backward, {kind}", lambda: mx.grad(run)(xs), repeats)
    for m in layers:
        m.__class__ = nn.QuantizedLinear


def head_rows(cfg: dict, chunk: int, bits: int, repeats: int) -> None:
    hid, vocab = cfg["hidden_size"], cfg["vocab_size"]
    lin = nn.Linear(hid, vocab, bias=False)
    lin.weight = rand(vocab, hid) * (hid**-0.5)
    lm = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits)
    h = rand(1, chunk, hid)
    y = mx.random.randint(0, vocab, (1, chunk))
    w = mx.ones((1, chunk))
    mx.eval(lm.parameters(), h, y, w)
    for kind in ("quantized", "dequantized"):
        lm.__class__ = products.DequantizedLinear if kind == "dequantized" else nn.QuantizedLinear
        head = Head(None, lm, lm, lambda x: x)
        loss = lambda h, head=head: walk_loss.head_loss(head, h, y, w, float(chunk))  # noqa: E731
        row(f"head and loss forward+backward, {kind}", lambda loss=loss: mx.grad(loss)(h), repeats)
    lm.__class__ = nn.QuantizedLinear


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(bench.SHAPES))
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 30720, 61440])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    cfg = dict(bench.SHAPES[a.shape])
    if a.small:
        cfg.update(bench.SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    print(
        f"# {a.shape}{' (small)' if a.small else ''}, chunk {a.chunk}, {a.bits}-bit base, "
        f"mlx {mx.__version__} on {mx.default_device()}"
    )
    print("| op | ms | peak over inputs GiB |\n|---|---:|---:|")
    head_rows(cfg, a.chunk, a.bits, a.repeats)
    projection_rows(cfg, a.chunk, a.bits, a.repeats)
    for prefix in a.prefixes:
        attention_rows(cfg, a.chunk, prefix, a.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
