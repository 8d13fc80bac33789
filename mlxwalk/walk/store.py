"""The K/V store: every attention layer's K/V for one window, at the cache's precision.

The forward decode writes each chunk's post-RoPE K/V here; the reverse pass reads the prefix back
as its taps. With a float16, bfloat16 or 8-bit store the prefix is read at that precision and its
gradient is applied straight-through to the full-precision K/V of the chunk that made it.
The 8-bit format is mlx-lm's quantized cache: `mx.quantize` triples, 8 bits, groups of 64 (32
where the head dim is an odd multiple of 32). The attention kernels read it in place
(ops/attention/prefix.py: `Prefix.in_place`, metal_kernels/attention's `Q8`), each element
dequantized as it is read; the ops twin dequantizes it tile by tile.
"""

from __future__ import annotations

import mlx.core as mx

from ..ops.attention.prefix import Q_BITS, dequantize, group_size, quantize
from ..plan import CACHE_TYPES, Q_GROUPS, check_cache_type, q8_fits  # noqa: F401  (re-exported)

_FLOAT = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def element_bytes(cache_type: str, dim: int, dtype: mx.Dtype) -> float:
    """Bytes per stored element, including the 8-bit format's scales and biases."""
    if cache_type == "q8":
        return 1 + 2 * dtype.size / group_size(dim)  # a scale and a bias per group
    return _FLOAT[cache_type].size


class KVStore:
    def __init__(
        self, shapes: list[tuple[int, int, int]], positions: int, cache_type: str, dtype: mx.Dtype
    ):
        self.cache_type = check_cache_type(cache_type)
        if cache_type not in CACHE_TYPES:  # "auto" is resolved before any store (choices.py)
            raise ValueError(f"a K/V store of {cache_type!r}: resolve it first")
        self.dtype = dtype  # the model's K/V dtype: 8-bit scales and biases are kept in it
        self.keys = [self._empty(h, positions, dk) for h, dk, _ in shapes]
        self.values = [self._empty(h, positions, dv) for h, _, dv in shapes]
        mx.eval(self.arrays())

    def _empty(self, heads: int, n: int, dim: int):
        if self.cache_type != "q8":
            return mx.zeros((1, heads, n, dim), _FLOAT[self.cache_type])
        g = group_size(dim)
        return [
            mx.zeros((1, heads, n, dim * Q_BITS // 32), mx.uint32),
            mx.zeros((1, heads, n, dim // g), self.dtype),
            mx.zeros((1, heads, n, dim // g), self.dtype),
        ]

    def arrays(self) -> list:
        return [self.keys, self.values]

    def write(self, layer: int, start: int, k: mx.array, v: mx.array) -> None:
        end = start + k.shape[2]
        self.keys[layer] = self._put(self.keys[layer], start, end, k)
        self.values[layer] = self._put(self.values[layer], start, end, v)

    def _put(self, dst, start: int, end: int, x: mx.array):
        if self.cache_type != "q8":
            dst[..., start:end, :] = x.astype(dst.dtype)
            return dst
        for d, p in zip(dst, quantize(x, self.dtype)):
            d[..., start:end, :] = p
        return dst

    def read(self, layer: int, start: int, end: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        return (
            self._get(self.keys[layer], start, end, dtype),
            self._get(self.values[layer], start, end, dtype),
        )

    def _get(self, src, start: int, end: int, dtype: mx.Dtype) -> mx.array:
        if self.cache_type != "q8":
            return src[..., start:end, :].astype(dtype)
        return dequantize([a[..., start:end, :] for a in src], dtype)
