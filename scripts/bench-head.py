#!/usr/bin/env python3
"""The untied quantized head's loss, forward and backward, by its products side by side in one
process: MLX's quantized product, the head dequantized whole and held, and sliced by its
vocabulary (ops/products.py, walk/loss.py) as one graph and a slice at a time. Median seconds of
`--repeats` after a warm-up, and the peak over the inputs. Default: Qwen3.5-27B's head (248,320
x 5,120, 4-bit) at a chunk of 2,048 positions."""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx import nn

from mlxwalk.ops import products
from mlxwalk.ops.products import DequantizedLinear, SlicedLinear
from mlxwalk.walk.arch import Head
from mlxwalk.walk.loss import head_loss, sliced_loss_and_grad

GIB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=248_320)
    p.add_argument("--hidden", type=int, default=5_120)
    p.add_argument("--chunk", type=int, default=2_048)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--slice", type=int, default=products.VOCAB_SLICE, help="a slice's rows")
    a = p.parse_args()
    mx.random.seed(0)
    w = (0.02 * mx.random.normal((a.vocab, a.hidden))).astype(mx.bfloat16)
    head = nn.QuantizedLinear(a.hidden, a.vocab, bias=False, group_size=64, bits=a.bits)
    head.update(dict(zip(("weight", "scales", "biases"), mx.quantize(w, 64, a.bits))))
    del w
    h = mx.random.normal((1, a.chunk, a.hidden)).astype(mx.bfloat16)
    y = mx.random.randint(0, a.vocab, (1, a.chunk))
    weights = mx.ones((1, a.chunk))
    mx.eval(head.parameters(), h, y, weights)
    with products.vocab_slice(a.slice):
        table(a, head, h, y, weights)
    head.__class__ = nn.QuantizedLinear


def table(a, head, h, y, weights) -> None:
    """Each product's row: the loss, the median milliseconds, the peak over the inputs."""

    def step(eager: bool = False):
        if eager:  # the layer-by-layer walk's: each slice evaluated alone
            return sliced_loss_and_grad(head, h, y, weights, float(a.chunk))

        def loss(h):
            return head_loss(Head(None, head, head, lambda x: x), h, y, weights, float(a.chunk))

        return mx.value_and_grad(loss)(h)

    print(f"# head {a.vocab} x {a.hidden}, {a.bits}-bit, chunk {a.chunk}; {mx.default_device()}")
    print("| head products | loss | ms (median) | peak over inputs GiB |\n|---|---:|---:|---:|")
    for name, cls, eager in (
        ("quantized", nn.QuantizedLinear, False),
        ("dequantized, held", DequantizedLinear, False),
        ("sliced, one graph (no recompute)", SlicedLinear, False),
        ("sliced, a slice at a time (recompute)", SlicedLinear, True),
    ):
        head.__class__ = cls
        loss, _ = step(eager)
        mx.eval(loss)  # warm-up
        times = []
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        for _ in range(a.repeats):
            t = time.perf_counter()
            loss, g = step(eager)
            mx.eval(loss, g)
            mx.synchronize()
            times.append(time.perf_counter() - t)
        peak = (mx.get_peak_memory() - base) / GIB
        med = 1e3 * statistics.median(times)
        print(f"| {name} | {loss.item():.4f} | {med:.2f} | {peak:.2f} |", flush=True)


if __name__ == "__main__":
    main()
