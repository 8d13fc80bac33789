"""What the Metal chunked delta-rule kernels move and multiply, from their design: device bytes
read and written, 8x8x8 simdgroup products and threadgroup barriers, per kernel and shape; the
same loops and bounds as the bodies (blocks.py's shapes). tests/test_delta_chunked.py checks
every number against the CPU harness's counters at small shapes.

The bound on the walked operands (`walked_bound_bytes`): the chunk operands a kernel stages in
threadgroup memory (K, V, w, Q; h and dh in output and grads) are read from device memory a fixed
number of times, never once per simdgroup:
  prepare       K: 1 + R times per (key head, chunk) (R = value heads per key head; the Gram
                matrix, then w per value head; R where all of K is staged at once, KS = DK),
                V: once per value head;
  states        K and w: once per threadgroup, DV / BV times per (value head, chunk);
  output        K: once per (key head, chunk), shared by its value heads; h_c and v_new once
                per value head;
  states_back   Q, K and w: once per threadgroup, DV / BV times per (value head, chunk);
  grads         Q and K: once per value head per key block (each element R times), v_new once
                per value head per key block (dP and its own rows from one staging), h and dh
                once;
  prepare_back  K: twice per value head (dT and dX, then M K), V, dw and du: once.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import blocks

CHUNK = blocks.CHUNK
TRI = 36 * 64  # floats in a chunk matrix's packed lower tiles


@dataclass(frozen=True)
class Shape:
    batch: int
    length: int
    key_heads: int
    value_heads: int
    dim: int  # DK = DV
    dtype: mx.Dtype

    @property
    def chunks(self) -> int:
        return -(-self.length // CHUNK)

    @property
    def groups(self) -> int:  # value heads per key head
        return self.value_heads // self.key_heads

    def valid(self, c: int) -> int:
        return min(CHUNK, self.length - c * CHUNK)


@dataclass(frozen=True)
class Traffic:
    device_read_bytes: int
    device_write_bytes: int
    mma: int  # 8x8x8 products, counted once per simdgroup
    barriers: int  # threadgroup barriers, counted once per threadgroup
    walked_bytes: int  # the part of the reads that is the staged chunk operands (above)
    walked_bound_bytes: int  # what that part may be at most

    @property
    def flops(self) -> int:
        return 2 * 512 * self.mma


def traffic(kernel: str, s: Shape, keep: bool = False) -> Traffic:
    """`keep`: prepare writes T for the backward."""
    g = blocks.metal(kernel, s.dim, s.dtype)
    if kernel == "prepare":
        return _prepare(s, g, keep)
    return {
        "states": _states,
        "output": _output,
        "states_back": _states_back,
        "grads": _grads,
        "prepare_back": _prepare_back,
    }[kernel](s, g)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _params(threads: int, named: int = 4) -> int:
    """Each thread loads the params its kernel names (L, HK, HV, N; prepare_back also KB)."""
    return threads * named * 4


def _prepare(s: Shape, g, keep: bool) -> Traffic:
    d, t, r, ks = s.dim, s.dtype.size, s.groups, g["KS"]
    resident = ks == d  # all of K staged for the Gram: the first value head's w finds it there
    k_reads = 1 + r - (1 if resident else 0)
    merges = 24 + 80  # the two merge levels' products (see prepare.metal)
    reads = writes = walked = bound = 0
    for c in range(s.chunks):
        v = s.valid(c)
        reads += _params(g.threads) + r * 2 * v * 4  # log_g, beta
        walked += k_reads * v * d * t + r * v * d * t  # K, V
        bound += (1 + r) * v * d * t + r * v * d * t
        writes += r * (CHUNK * 4 + 2 * CHUNK * d * 4 + (CHUNK * CHUNK * 4 if keep else 0))
    per_chunk_mma = 36 * d // 8 + r * (merges + 2 * 36 * d // 8)
    per_chunk_bar = 2 * d // ks + r * (1 + 1 + 2 + 4 + 2 * d // ks + 2 * d // ks)
    return _total(s, s.key_heads, reads, writes, per_chunk_mma, per_chunk_bar, walked, bound)


def _total(s, heads, reads, writes, mma_chunk, bar_chunk, walked, bound, groups=None) -> Traffic:
    """Per-chunk sums (reads, writes, walked, bound: over the chunks already) times the
    (batch, head) pairs; products and barriers per chunk times chunks and pairs (`groups`:
    threadgroups per (batch, head, chunk) instead of one)."""
    n = s.batch * heads
    per = groups or 1
    return Traffic(
        (reads + walked) * n,
        writes * n,
        mma_chunk * s.chunks * n * per,
        bar_chunk * s.chunks * n * per,
        walked * n,
        bound * n,
    )


def _states(s: Shape, g) -> Traffic:
    d, t, bv, sl, sgs = s.dim, s.dtype.size, g["BV"], g["SL"], g.simdgroups
    blocks_ = d // bv
    reads = blocks_ * (_params(g.threads) + bv * d * 4)  # params, the state's block
    writes = blocks_ * bv * d * 4  # the final state's block
    walked = bound = 0
    for c in range(s.chunks):
        v = s.valid(c)
        reads += blocks_ * (CHUNK * bv * 4 + CHUNK * 4)  # u's columns, cum
        walked += blocks_ * (CHUNK * d * 4 + v * d * t)  # w, K
        writes += blocks_ * (bv * d * 4 + CHUNK * bv * 4)  # h, v_new
    bound = walked
    mma = sgs * 16 * d // 8
    bar = 4 * d // sl
    return _total(s, s.value_heads, reads, writes, mma, bar, walked, bound, blocks_)


def _output(s: Shape, g) -> Traffic:
    d, t, r, ks, sv = s.dim, s.dtype.size, s.groups, g["KS"], g["SV"]
    reads = writes = walked = 0
    for c in range(s.chunks):
        v = s.valid(c)
        reads += _params(g.threads) + v * d * t + r * CHUNK * 4  # params, Q, cum
        walked += v * d * t + r * (d * d * 4 + CHUNK * d * 4)  # K; h_c, v_new per value head
        writes += r * v * d * 4
    mma = 36 * d // 8 + r * (d // 8) * (8 * d // 8 + 36)
    bar = 2 * d // ks + r * (1 + 2 * d // sv)
    return _total(s, s.key_heads, reads, writes, mma, bar, walked, walked)


def _states_back(s: Shape, g) -> Traffic:
    d, t, bv, sl, sgs = s.dim, s.dtype.size, g["BV"], g["SL"], g.simdgroups
    blocks_ = d // bv
    reads = blocks_ * (_params(g.threads) + bv * d * 4)  # params, d_final's block
    writes = blocks_ * bv * d * 4  # d_state's block
    walked = 0
    for c in range(s.chunks):
        v = s.valid(c)
        reads += blocks_ * (v * bv * t + CHUNK * 4)  # dO's columns, cum
        walked += blocks_ * (2 * v * d * t + CHUNK * d * 4)  # Q, K, w
        writes += blocks_ * (bv * d * 4 + CHUNK * bv * 4)  # dh, dv_new
    kt = d // 8
    mma = 36 * kt + sgs * (24 * kt + 36)
    bar = 4 * d // sl + 1
    return _total(s, s.value_heads, reads, writes, mma, bar, walked, walked, blocks_)


def _grads(s: Shape, g) -> Traffic:
    d, t, r, kb, sk, sv = s.dim, s.dtype.size, s.groups, g["KB"], g["SK"], g["SV"]
    nkb = d // kb
    reads = writes = walked = bound = 0
    for c in range(s.chunks):
        v = s.valid(c)
        reads += nkb * _params(g.threads)
        for h in range(r):
            # cum; dO once (dP and dq from one read); dv_new; dq and dk summed in place
            reads += nkb * (CHUNK * 4 + v * d * t + CHUNK * d * 4)
            reads += (2 * v * d * 4) if h > 0 else 0
            walked += nkb * CHUNK * d * 4 + 2 * d * d * 4 + 2 * v * d * t  # v_new; h, dh; Q, K
            writes += CHUNK * d * 4 + 2 * v * d * 4 + nkb * CHUNK * 4  # dw, dq, dk, dcum
    bound = walked
    kbt = kb // 8
    mma = r * (36 * d // 8 + 8 * 3 * kbt * d // 8 + 72 * kbt)
    bar = r * (2 * d // sv + 2 * kb // sk + 2)
    return _total(s, s.key_heads, reads, writes, mma, bar, walked, bound, nkb)


def _prepare_back(s: Shape, g) -> Traffic:
    d, t, r, sl = s.dim, s.dtype.size, s.groups, g["SL"]
    nkb = d // blocks.metal("grads", d, s.dtype)["KB"]
    reads = writes = walked = 0
    for c in range(s.chunks):
        v = s.valid(c)
        reads += _params(g.threads, 5) + v * d * 4  # params, dk_in
        reads += r * (CHUNK * 4 + v * 4 + nkb * CHUNK * 4 + TRI * 4)  # cum, beta, dcum, T
        walked += r * (2 * v * d * t + v * d * t + 2 * CHUNK * d * 4)  # K twice, V, dw, du
        writes += v * d * 4 + r * (v * d * 4 + 2 * v * 4)  # dk, dv, dlog_g, dbeta
    mma = r * (72 * 2 * d // 8 + 120 + 120 + 72 * d // 8)
    bar = r * (1 + 2 * 2 * d // sl + 1 + 1 + 2 * d // sl + 1 + 1)
    return _total(s, s.key_heads, reads, writes, mma, bar, walked, walked)
