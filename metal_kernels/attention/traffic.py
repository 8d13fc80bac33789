"""What the Metal chunk-attention kernels move and multiply, from their design: device bytes read
and written, 8x8x8 simdgroup products and threadgroup barriers, per kernel and shape. The same
loops and bounds as the bodies (`blocks.py`'s shapes); tests/test_kernels.py checks every number
against the CPU harness's counters at small shapes, scripts/roofline-attention.py uses them at
the benchmark's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import blocks

# Scalars every thread loads once: the params it names (4 bytes each) and the scale.
_SCALARS = {"forward": 7 * 4, "dq": 7 * 4, "dkdv": 8 * 4}


@dataclass(frozen=True)
class Shape:
    """One chunk: `chunk` queries of `heads` query heads over a prefix of `start` keys (the
    store's, `grad_from` onwards tapped) and the chunk's own keys, `kv_heads` K/V heads."""

    batch: int
    heads: int
    kv_heads: int
    chunk: int
    start: int
    grad_from: int
    dim: int
    dtype: mx.Dtype
    store: mx.Dtype

    @property
    def taps(self) -> int:
        return self.start - self.grad_from


@dataclass(frozen=True)
class Traffic:
    device_read_bytes: int
    device_write_bytes: int
    mma: int  # 8x8x8 products, counted once per simdgroup
    barriers: int  # threadgroup barriers, counted once per threadgroup
    kv_read_bytes: int  # the part of the reads that is the walked side: K/V, or Q/dO (dkdv)
    kv_bound_bytes: int  # what that part may be at most: each element once per owned block

    @property
    def flops(self) -> int:
        return 2 * 512 * self.mma


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def traffic(kernel: str, s: Shape) -> Traffic:
    g = blocks.metal(kernel, s.dim, s.dtype)
    t, st, d = s.dtype.size, s.store.size, s.dim
    if kernel in ("forward", "dq"):
        return _query_side(kernel, s, g, t, st, d)
    return _key_side(s, g, t, st, d)


def _query_side(kernel, s, g, t, st, d) -> Traffic:
    """forward, dq: a threadgroup per BQ query rows of a head; the keys walked in blocks of BK
    through one buffer (K, then V; dq: V, then K), with 4 barriers a block (dq split: 5, the
    partial S posted before the partners sum it)."""
    heads = s.batch * s.heads
    groups = _ceil(s.chunk, g.rows)
    staged = 1 if kernel == "forward" else 2  # Q (and dO)
    # dq: lse and delta, by each of the 4 lanes of a row in each of its `split` simdgroups
    per_row = 0 if kernel == "forward" else g.split * 4 * 2 * 4
    steps = 4 if kernel == "forward" or g.split == 1 else 5  # barriers per key block
    reads = kv = mma = barriers = 0
    for blk in range(groups):
        q0 = blk * g.rows
        rows = min(g.rows, s.chunk - q0)
        own = min(q0 + g.rows, s.chunk)  # own keys the group's last row sees
        kv += 2 * d * (s.start * st + own * t)
        reads += g.threads * _SCALARS[kernel] + rows * (staged * d * t + per_row)
        barriers += steps * _ceil(s.start + own, g.walk)
        for r0 in range(q0, q0 + g.rows, 8):  # its groups of `split` simdgroups: key tiles
            if r0 < s.chunk:
                tiles = _ceil(s.start + min(r0 + 8, s.chunk), 8)
                mma += (2 if kernel == "forward" else 3) * (d // 8) * tiles
    writes = s.chunk * d * 4 + (s.chunk * 4 if kernel == "forward" else 0)
    bound = _ceil(s.chunk, g.rows) * 2 * d * (s.start * st + s.chunk * t)
    return Traffic(
        (reads + kv) * heads,
        writes * heads,
        mma * heads,
        barriers * heads,
        kv * heads,
        bound * heads,
    )


def _key_side(s, g, t, st, d) -> Traffic:
    """dkdv: a threadgroup per BK key rows (taps, then own) of a kv head; every query of its
    grouped heads walked in blocks of BQ."""
    keys = s.taps + s.chunk
    r = s.heads // s.kv_heads
    reads = walked = mma = barriers = 0
    steps = 3 if g.split > 1 else 2  # barriers per query block: staged, partial sums, read
    for blk in range(_ceil(keys, g.rows)):
        c0 = blk * g.rows
        first = max(0, c0 - s.taps)  # the first query that sees one of the group's keys
        rows = min(g.rows, keys - c0)
        taps = max(0, min(rows, s.taps - c0))
        reads += g.threads * _SCALARS["dkdv"] + 2 * d * (taps * st + (rows - taps) * t)
        walked += r * (s.chunk - first) * (2 * d * t + 2 * 4)  # Q, dO rows; lse, delta
        barriers += r * steps * _ceil(s.chunk - first, g.walk)
        for k0 in range(c0, min(c0 + g.rows, keys), 8):  # a group of `split` simdgroups
            own = max(0, k0 - s.taps)  # the first query that sees one of these keys
            tiles = _ceil(s.chunk - first, 8) - (own - first) // 8
            mma += r * 4 * (d // 8) * tiles
    heads = s.batch * s.kv_heads
    writes = 2 * keys * d * 4
    bound = r * _ceil(keys, g.rows) * s.chunk * (2 * d * t + 2 * 4)
    return Traffic(
        (reads + walked) * heads,
        writes * heads,
        mma * heads,
        barriers * heads,
        walked * heads,
        bound * heads,
    )
