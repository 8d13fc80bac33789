"""A layer's cached prefix as chunk attention reads it: tile by tile (the twin) or in place
(the kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metal_kernels.attention import Q8


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
