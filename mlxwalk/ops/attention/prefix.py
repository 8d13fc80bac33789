"""A layer's cached prefix as chunk attention reads it: tile by tile (the twin) or in place
(the kernels); and the 8-bit store's format, which both read (walk/store.py writes it)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metal_kernels.attention import Q8

from ...plan import Q_GROUPS

Q_BITS = 8


def group_size(dim: int) -> int:
    """The 8-bit store's group along a head of `dim`: 64, or 32 where 64 does not divide it."""
    return next(g for g in reversed(Q_GROUPS[:2]) if dim % g == 0)


def quantize(x: mx.array, dtype: mx.Dtype) -> list[mx.array]:
    """(..., n, D) -> mx.quantize's triple: (..., n, D / 4) uint32, scales and biases (..., n,
    D / g) in `dtype` (the model's)."""
    return list(mx.quantize(x.astype(dtype), group_size=group_size(x.shape[-1]), bits=Q_BITS))


def dequantize(triple, dtype: mx.Dtype) -> mx.array:
    """mx.quantize's triple (..., n, D / 4) -> (..., n, D) in `dtype`."""
    wq, scales, biases = triple
    dim = wq.shape[-1] * 32 // Q_BITS
    x = mx.dequantize(wq, scales, biases, group_size=group_size(dim), bits=Q_BITS)
    return x.astype(dtype)


@dataclass(frozen=True)
class Prefix:
    """One attention layer's cached K/V on [0, end), read tile by tile from the store."""

    store: object  # store.KVStore
    layer: int
    end: int
    dtype: mx.Dtype

    def read(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        return self.store.read(self.layer, start, end, self.dtype)

    def in_place(self) -> tuple[mx.array, mx.array] | tuple[Q8, Q8]:
        """The layer's whole store arrays (B, H, window, D), which the kernels read in place: a
        float store's, or an 8-bit store's `mx.quantize` triples as `Q8` (the kernels dequantize
        each element as they read it, so the chunk's graph holds no dequantized prefix)."""
        keys, values = self.store.keys[self.layer], self.store.values[self.layer]
        if self.store.cache_type == "q8":
            return Q8(*keys), Q8(*values)
        return keys, values
