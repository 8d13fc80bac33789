"""A quantized base's products on the dequantized weight (ops/products.py): the product and its
input's gradient equal MLX's quantized product's in float32, only the decoder layers' affine
projections are swapped (and back), and the walk on them equals one graph on MLX's own."""

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx import nn

from mlxwalk import bench, tiny, window_gradient
from mlxwalk.commands.test_walk_exact import prepare
from mlxwalk.grading import compare
from mlxwalk.ops.products import DequantizedLinear, dequantized_matmul, dequantized_products


def rel(a: mx.array, b: mx.array) -> float:
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_the_dequantized_product_and_its_gradient_equal_the_quantized_ones(bits):
    mx.random.seed(bits)
    w, scales, biases = mx.quantize(mx.random.normal((96, 128)), 64, bits)  # float32 scales
    x = mx.random.normal((2, 40, 128))
    dy = mx.random.normal((2, 40, 96))

    def quantized(x):
        return mx.quantized_matmul(x, w, scales, biases, True, 64, bits)

    def dequantized(x):
        return dequantized_matmul(64, bits)(x, w, scales, biases)

    (y_q,), (dx_q,) = mx.vjp(quantized, [x], [dy])
    (y_d,), (dx_d,) = mx.vjp(dequantized, [x], [dy])
    assert rel(y_d, y_q) < 1e-6
    assert rel(dx_d, dx_q) < 1e-6


def test_only_the_decoder_layers_affine_projections_are_swapped_and_then_restored():
    model, _ = bench.shaped("llama3-8b", small=True, bits=4)  # its head is an untied projection
    assert type(model.lm_head) is nn.QuantizedLinear
    in_layers = [m for layer in model.layers for _, m in layer.named_modules()]
    quantized = [m for m in in_layers if isinstance(m, nn.QuantizedLinear)]
    assert quantized
    with dequantized_products(model, "dequantized") as n:
        assert n == len(quantized)
        assert all(type(m) is DequantizedLinear for m in quantized)
        assert type(model.lm_head) is nn.QuantizedLinear  # the head keeps MLX's product
    assert all(type(m) is nn.QuantizedLinear for m in quantized)
    with dequantized_products(model, "quantized") as n:
        assert n == 0


N = 160
IDS = np.random.default_rng(7).integers(0, 256, N + 1)


@pytest.mark.parametrize("name", ["tiny-qwen2-4bit", "tiny-qwen3_5-4bit"])
def test_the_walk_on_dequantized_products_equals_one_graph_on_quantized_ones(name):
    model, _ = mlx_lm.load(str(tiny.path(name)))
    prepare(model)
    w = np.r_[np.zeros(30), np.ones(N - 30)]
    _, one = window_gradient(
        model, IDS[:-1], IDS[1:], w, chunk=N, walk="one-graph", products="quantized"
    )
    _, exact = window_gradient(model, IDS[:-1], IDS[1:], w, chunk=40, products="dequantized")
    cosine, err = compare(exact, one)
    print(f"{name}: exact (dequantized) vs one graph (quantized): relative L2 error {err:.1e}")
    assert cosine >= 0.99999 and err <= 2e-5
