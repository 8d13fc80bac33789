"""A quantized base's products at a chunk's size: the weight dequantized, then multiplied.

`mx.quantized_matmul` reads the packed weight as it multiplies, which is what generation's few
rows want: the weight's bytes are the cost. A chunk has thousands of rows, where the cost is the
arithmetic, and there MLX's CUDA and CPU products are several times slower than a bf16 product
of the dequantized weight (scripts/bench-qmm.py, docs/BENCHMARKS.md). So within the walk each
decoder layer's affine-quantized projection dequantizes its weight for the product, one
projection at a time, and its input's gradient dequantizes it again in the backward rather than
keep it: the transient is one projection's weight at the activations' width, and nothing the
graph holds grows. The same weights, the same products: only the rounding of the sum differs.

An untied lm head (vocabulary x hidden) is swapped too where `head` says how. Its logits
are computed in blocks, each checkpointed (walk.loss.head_loss): a product per block, forward,
recomputed and transposed, each dequantizing the whole head (1 GiB in bf16 at Llama-3-8B's
128,256 x 4,096) would hold several of those at once. So `held(head, project)` dequantizes it
once and returns the projection with that copy bound in, which every block's forward, recompute
and gradient call (a checkpointed block runs its Python again when the backward is built, so the
copy must travel in the function, not in a context): the head and loss hold one dequantized head
beside the logits of one block. Where that copy does not fit (2.4 GiB at the 27B shape's
248,320 x 5,120), a `SlicedLinear` head's loss dequantizes it a slice of the vocabulary at a
time, each slice's product checkpointed. A tied head (the embedding read as a linear layer) keeps
MLX's product.

On Metal, MLX's quantized products are tiled for the matrix units and were not measured here:
`auto` keeps them there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache

import mlx.core as mx
from mlx import nn

PRODUCTS = ("auto", "quantized", "dequantized")
HEAD_PRODUCTS = ("auto", "quantized", "dequantized", "sliced")  # an untied lm head's (WalkConfig)
# An untied head's rows its sliced loss dequantizes at once (walk/loss.py sliced_cross_entropy):
# 320 MiB in bf16 at Qwen3.5-27B's hidden 5,120, where the whole head (248,320 rows) is 2.4 GiB.
VOCAB_SLICE = 32_768


def resolve(products: str) -> str:
    """`auto`: dequantized on CUDA and the CPU (measured faster there), quantized on Metal."""
    if products != "auto":
        return products
    return "quantized" if mx.metal.is_available() else "dequantized"


@cache
def dequantized_matmul(group_size: int, bits: int):
    """x @ dequantize(w).T as a custom function whose VJP dequantizes again for x's gradient
    (the weight is frozen: its cotangents are zeros, never evaluated)."""

    @mx.custom_function
    def product(x, w, scales, biases):
        # x (..., in) @ (in, out) -> (..., out)
        return x @ mx.dequantize(w, scales, biases, group_size, bits).T

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        # dy (..., out) @ (out, in) -> (..., in)
        dx = cotangent @ mx.dequantize(w, scales, biases, group_size, bits)
        return dx.astype(x.dtype), mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)

    return product


class DequantizedLinear(nn.QuantizedLinear):
    """An affine-quantized linear layer whose product is `dequantized_matmul`."""

    def dequantized(self) -> mx.array:
        w = self["weight"]
        return mx.dequantize(w, self["scales"], self["biases"], self.group_size, self.bits)

    def __call__(self, x):
        product = dequantized_matmul(self.group_size, self.bits)
        return self.biased(product(x, self["weight"], self["scales"], self["biases"]))

    def biased(self, y: mx.array) -> mx.array:
        return y + self["bias"] if "bias" in self else y


class SlicedLinear(DequantizedLinear):
    """An untied affine-quantized head whose loss dequantizes VOCAB_SLICE rows at a time
    (walk.loss.sliced_cross_entropy): the dequantized product's speed with one slice of the head
    alive, where MLX's quantized product took an 8B-shaped head's loss 3.2x as long as the held
    copy (52.8 against 16.7 ms a chunk) and the 27B shape's copy did not fit 32 GiB
    (docs/BENCHMARKS.md)."""

    def vocab_slices(self) -> list[slice]:
        rows, n = self["weight"].shape[0], VOCAB_SLICE
        return [slice(a, min(a + n, rows)) for a in range(0, rows, n)]

    def logits(self, h: mx.array, s: slice) -> mx.array:
        """h (..., in) -> (..., rows of s): the head's rows `s`, dequantized for this product."""
        w, scales, biases = self["weight"][s], self["scales"][s], self["biases"][s]
        y = h @ mx.dequantize(w, scales, biases, self.group_size, self.bits).T
        return y + self["bias"][s] if "bias" in self else y


@contextmanager
def vocab_slice(rows: int) -> Iterator[None]:
    """Within the block, a sliced head's slices have `rows` rows (test-walk-exact's row (1d) cuts
    a bundled model's few hundred into several)."""
    global VOCAB_SLICE
    before, VOCAB_SLICE = VOCAB_SLICE, rows
    try:
        yield
    finally:
        VOCAB_SLICE = before


HEAD_CLASSES = {"dequantized": DequantizedLinear, "sliced": SlicedLinear}


def held(module: nn.Module, project: Callable[[mx.array], mx.array]):
    """`project` (the module's product), or for a DequantizedLinear a product with one
    dequantization of its weight bound in (lazy: the graphs built with it hold it until they are
    evaluated; it is a constant there, its gradient never formed)."""
    if type(module) is not DequantizedLinear:  # a sliced head is never held whole
        return project
    w = module.dequantized()
    return lambda x: module.biased(x @ w.T)  # (..., in) @ (in, out)


def _lm_head(model: nn.Module) -> nn.Module | None:
    return getattr(getattr(model, "language_model", model), "lm_head", None)


def head_swapped(model: nn.Module, products: str = "auto") -> bool:
    """Whether `dequantized_products(model, products)` would dequantize an lm head: an untied,
    affine-quantized one, and products that resolve to dequantized."""
    head = _lm_head(model)
    return resolve(products) == "dequantized" and head is not None and _affine(head)


def _affine(m: nn.Module) -> bool:
    return (
        type(m) is nn.QuantizedLinear and getattr(m, "mode", "affine") == "affine" and "biases" in m
    )


@contextmanager
def dequantized_products(
    model: nn.Module, products: str = "auto", head: str = "dequantized"
) -> Iterator[int]:
    """Within the block, the decoder layers' affine-quantized projections (and an untied lm head,
    if `head` is "dequantized" or "sliced": HEAD_CLASSES) multiply by their dequantized weight
    (when `products` resolves to "dequantized"); yields how many do."""
    if resolve(products) != "dequantized":
        yield 0
        return
    layers = getattr(model, "layers", None) or []
    inner = [m for layer in layers for _, m in layer.named_modules() if _affine(m)]
    swapped = [(m, DequantizedLinear) for m in inner]
    if head in HEAD_CLASSES and head_swapped(model, products):
        swapped.append((_lm_head(model), HEAD_CLASSES[head]))
    try:
        for m, cls in swapped:
            m.__class__ = cls
        yield len(swapped)
    finally:
        for m, _ in swapped:
            m.__class__ = nn.QuantizedLinear
