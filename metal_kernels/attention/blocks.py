"""Block shapes of the chunk-attention kernels: one table per backend, one entry per (kernel,
head dim, dtype), each with the reason it has that shape.

METAL (the `.metal` bodies on Apple's 8x8 simdgroup matrices). A simdgroup owns 8 rows; the
operands the threadgroup shares are staged once in threadgroup memory (32 KiB a threadgroup on
Apple GPUs) in the inputs' dtype, so float16 and bfloat16 share a shape ("half" below) and
float32 has its own. Staged rows are padded by 16 bytes (`pad` elements) so that the rows of a
block do not start on the same threadgroup-memory bank. `split` simdgroups share 8 rows, each
holding D / split of the head dims, their partial scores summed through threadgroup memory.
Occupancy is estimated as MLX's and metal-benchmarks' figures have it: about 60 KiB of
threadgroup memory a GPU core, so a core holds floor(60 KiB / bytes) threadgroups; the goal is at
least 8 simdgroups a core (ALU use saturates near 24), `simdgroups_per_core` below.
  forward, dq: a threadgroup owns `rows` query rows of one (batch, head) and walks the keys in
    blocks of `walk` through one threadgroup buffer, K then V (dq: V then K), as MLX's steel
    attention does; every K/V block is read from device memory once per threadgroup, so each
    K/V element ceil(L / rows) times per query head. Q (and dQ's dO) staged once, O (dQ) in
    registers as D / 8 / split float tiles a simdgroup.
  dkdv: a threadgroup owns `rows` key rows of one (batch, kv head) and walks every query of its
    grouped heads in blocks of `walk`; every Q/dO block is read once per threadgroup, so each
    Q/dO element at most ceil(keys / rows) times. K, V, dK and dV of a simdgroup's rows stay in
    registers (D / split head dims: 64 floats a lane at every head dim). Q and dO are both read
    by both halves of a step (S^T and dK read Q, dP^T and dV read dO), so they keep two buffers.

CUDA entries, for the tensor-core kernels, go under names of their own (`CUDA...`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

THREADGROUP_MEMORY = 32768  # bytes a threadgroup may use on Apple GPUs
CORE_THREADGROUP_MEMORY = 60 * 1024  # bytes of threadgroup memory a GPU core holds (estimate)
KERNELS = ("forward", "dq", "dkdv")


@dataclass(frozen=True)
class MetalBlocks:
    rows: int  # rows a threadgroup owns: queries (forward, dq) or keys (dkdv), 8 a simdgroup
    walk: int  # rows of the other side staged per step: keys (forward, dq), queries (dkdv)
    pad: int  # elements appended to each staged row
    split: int  # simdgroups per 8 owned rows, each with 1 / split of the head dims
    why: str

    @property
    def simdgroups(self) -> int:
        return self.rows // 8 * self.split

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups


def _m(rows: int, walk: int, pad: int, why: str, split: int = 1) -> MetalBlocks:
    return MetalBlocks(rows, walk, pad, split, why)


# (kernel, head dim, "half" | "float") -> shape. The bytes in each reason are threadgroup memory,
# "a core" the simdgroups a GPU core holds by the estimate above.
METAL: dict[tuple[str, int, str], MetalBlocks] = {
    ("forward", 64, "half"): _m(
        64,
        64,
        8,
        "Q 64 + K/V 64 rows of 144 B: 18 KiB, 8 simdgroups, 24 a core; "
        "64 query rows read K/V half as often as 32 (O 16 floats a lane)",
    ),
    ("forward", 128, "half"): _m(
        64,
        32,
        8,
        "Q 64 + K/V 32 rows of 272 B: 25.5 KiB, 8 simdgroups, 16 a core; "
        "64 rows keep K/V reads at L/64 (O 32 floats a lane)",
    ),
    ("forward", 256, "half"): _m(
        32,
        16,
        8,
        "Q 32 + K/V 16 rows of 528 B: 24.8 KiB, 4 simdgroups, 8 a core; "
        "O is 64 floats a lane at 256: MLX's steel_attention shape (32 x 16)",
    ),
    ("forward", 64, "float"): _m(
        64,
        32,
        4,
        "Q 64 + K/V 32 rows of 272 B: 25.5 KiB, 8 simdgroups, 16 a core; "
        "rows as the half shape, half the keys a step for 4-byte rows",
    ),
    ("forward", 128, "float"): _m(
        32,
        16,
        4,
        "Q 32 + K/V 16 rows of 528 B: 24.8 KiB, 4 simdgroups, 8 a core; "
        "a 64-row Q alone would take 33 KiB",
    ),
    ("forward", 256, "float"): _m(
        16,
        8,
        4,
        "Q 16 + K/V 8 rows of 1,040 B + partial S 1 KiB: 25.4 KiB, 4 "
        "simdgroups (2 per 8 rows, 128 dims each), 8 a core; 32 rows would need 33 KiB for Q",
        split=2,
    ),
    ("dq", 64, "half"): _m(
        64,
        64,
        8,
        "Q, dO 64 + K/V 64 rows of 144 B: 27 KiB, 8 simdgroups, 16 a core; "
        "K/V read L/64 times (dQ 16 floats a lane)",
    ),
    ("dq", 128, "half"): _m(
        32,
        32,
        8,
        "Q, dO 32 + K/V 32 rows of 272 B: 25.5 KiB, 4 simdgroups, 8 a core; "
        "Q and dO both staged: half the forward's query rows",
    ),
    ("dq", 256, "half"): _m(
        16,
        16,
        8,
        "Q, dO 16 + K/V 16 rows of 528 B + partial S, dP 4 KiB: 28.8 KiB, 4 "
        "simdgroups (2 per 8 rows, 128 dims of dQ each), 8 a core; 32 rows "
        "would need 33 KiB for Q and dO alone",
        split=2,
    ),
    ("dq", 64, "float"): _m(
        32,
        32,
        4,
        "Q, dO 32 + K/V 32 rows of 272 B: 25.5 KiB, 4 simdgroups, 8 a core",
    ),
    ("dq", 128, "float"): _m(
        16,
        16,
        4,
        "Q, dO 16 + K/V 16 rows of 528 B + partial S, dP 4 KiB: 28.8 KiB, 4 "
        "simdgroups (2 per 8 rows), 8 a core",
        split=2,
    ),
    ("dq", 256, "float"): _m(
        8,
        8,
        4,
        "Q, dO 8 + K/V 8 rows of 1,040 B + partial S, dP 2 KiB: 26.4 KiB, 4 "
        "simdgroups on 8 rows (64 dims of dQ each), 8 a core",
        split=4,
    ),
    ("dkdv", 64, "half"): _m(
        32,
        32,
        8,
        "K, V, dK, dV in registers (64 floats a lane); Q, dO 32 "
        "rows of 144 B + lse, delta: 9.3 KiB, 4 simdgroups, 24 a core; Q/dO read keys/32 times",
    ),
    ("dkdv", 128, "half"): _m(
        32,
        16,
        8,
        "2 simdgroups per 8 keys (64 dims each); Q, dO 16 rows "
        "of 272 B + partial scores 8 KiB: 16.6 KiB, 8 simdgroups, 24 a core",
        split=2,
    ),
    ("dkdv", 256, "half"): _m(
        16,
        16,
        8,
        "4 simdgroups per 8 keys; Q, dO 16 rows of 528 B + partial scores "
        "8 KiB: 24.6 KiB, 8 simdgroups, 16 a core; 32 keys would need 16 simdgroups",
        split=4,
    ),
    ("dkdv", 64, "float"): _m(
        32,
        32,
        4,
        "Q, dO 32 rows of 272 B + lse, delta: 17.3 KiB, 4 simdgroups, 12 a core",
    ),
    ("dkdv", 128, "float"): _m(
        32,
        16,
        4,
        "Q, dO 16 rows of 528 B + partial scores 8 KiB: 24.6 KiB, 8 simdgroups, 16 a core",
        split=2,
    ),
    ("dkdv", 256, "float"): _m(
        16,
        8,
        4,
        "Q, dO 8 rows of 1,040 B + partial scores 4 KiB: 20.3 KiB, 8 simdgroups, 16 a core",
        split=4,
    ),
}

METAL_DIMS = tuple(sorted({dim for _, dim, _ in METAL}))


def width(dtype: mx.Dtype) -> str:
    """The staging width of a dtype: the kernels stage operands in the inputs' dtype."""
    return "float" if dtype == mx.float32 else "half"


def metal(kernel: str, dim: int, dtype: mx.Dtype) -> MetalBlocks:
    return METAL[(kernel, dim, width(dtype))]


def metal_threadgroup_bytes(kernel: str, dim: int, dtype: mx.Dtype) -> int:
    """Threadgroup memory of a Metal kernel as its body declares it."""
    b = metal(kernel, dim, dtype)
    row = (dim + b.pad) * (4 if width(dtype) == "float" else 2)
    # each simdgroup's partial scores (forward: S; dq: S and dP), one float where unsplit
    partial = b.simdgroups * 8 * b.walk if b.split > 1 else 1
    if kernel == "forward":  # Q, K/V
        return (b.rows + b.walk) * row + partial * 4
    if kernel == "dq":  # Q, dO, V/K
        return (2 * b.rows + b.walk) * row + 2 * partial * 4
    # Q, dO, lse, delta; the partial S^T and dP^T (one float where unsplit)
    partial = 2 * b.simdgroups * 8 * b.walk if b.split > 1 else 1
    return 2 * b.walk * row + (2 * b.walk + partial) * 4


def simdgroups_per_core(kernel: str, dim: int, dtype: mx.Dtype) -> int:
    """The simdgroups a GPU core holds by threadgroup memory alone (CORE_THREADGROUP_MEMORY)."""
    groups = CORE_THREADGROUP_MEMORY // metal_threadgroup_bytes(kernel, dim, dtype)
    return groups * metal(kernel, dim, dtype).simdgroups


# CUDA: the tensor-core kernels (`*_tc.cu`, float16/bfloat16 inputs; float32 stays on the scalar
# `.cu` twins) on an H200 (Hopper, sm_90: 132 SMs, 227 KiB of shared memory a block and 228 KiB
# an SM, 64K 32-bit registers an SM, 255 a thread). A warp owns `mt` m-tiles of 16 rows; the
# block stages the other side in tiles of `walk` rows, double buffered through cp.async, rows
# padded by 16 bytes (8 elements). Reasons below count registers a thread (accumulators are
# float32: a 16 x 8 C fragment is 4 a lane) and shared memory a block. float16 and bfloat16 share
# every shape (same size, same products). The goal is two resident blocks (8 warps) an SM where
# registers allow, enough to cover one block's barrier and cp.async waits with the other's
# products; shared memory and registers then bound everything else.
#   forward, dq: a block owns 16 mt warps rows of one (batch, head) and walks its keys;
#   dkdv: a block owns 16 warps / split key rows of one (batch, kv head) and walks every query of
#     its grouped heads; split = 2 pairs two warps on 16 key rows, each holding half of D of dK
#     and dV (P^T and dS^T swapped through shared memory, no score computed twice).
@dataclass(frozen=True)
class CudaBlocks:
    warps: int  # warps a block
    mt: int  # m-tiles of 16 rows a warp owns (forward, dq; dkdv: 1)
    walk: int  # rows of the other side a tile: keys (forward, dq), queries (dkdv)
    regs: bool  # the first products' A operand in registers (Q; dq: Q and dO; dkdv: K and V)
    split: int  # dkdv: warps sharing 16 key rows, each with D / split of dK and dV
    why: str

    @property
    def rows(self) -> int:
        """Rows a block owns: queries (forward, dq) or keys (dkdv)."""
        return 16 * self.mt * self.warps // self.split

    @property
    def threads(self) -> int:
        return 32 * self.warps


def _c(warps: int, mt: int, walk: int, regs: bool, why: str, split: int = 1) -> CudaBlocks:
    return CudaBlocks(warps, mt, walk, regs, split, why)


# (kernel, head dim) -> shape, for float16 and bfloat16 alike. Registers: a 16-row m-tile's C
# fragments over 8 columns are 4 a lane, so a warp's accumulators over C columns are
# mt * C / 2 a lane (O 32 rows x 128 columns: 128). ptxas figures (sm_90, no spills) are in
# scripts/compile-cuda.py --ptxas.
CUDA: dict[tuple[str, int], CudaBlocks] = {
    ("forward", 64): _c(
        4,
        2,
        64,
        True,
        "128 query rows, 32 a warp: a K/V fragment read from "
        "shared memory feeds 2 m-tiles (half the ldmatrix traffic of 16 rows), "
        "and K/V are read from L2 once per 128 queries; O 64 + S 64 + Q 32 "
        "registers, so Q stays in registers; Q 18 + K/V 2 x 18 KiB = 54 KiB; "
        "~250 registers: 2 blocks an SM (FlashAttention-2: 128 x 128)",
    ),
    ("forward", 128): _c(
        4,
        2,
        32,
        False,
        "128 query rows, 32 a warp, as at 64; O 128 + S 32 "
        "registers (a 64-key tile, S 64, spilled: 255 registers and 88 bytes), "
        "Q read from shared memory each k-step; Q 34 + K/V 2 x 17 KiB = 68 KiB: "
        "2 blocks an SM",
    ),
    ("forward", 256): _c(
        8,
        1,
        64,
        False,
        "128 query rows, 16 a warp (O alone is 128 "
        "registers): 8 warps, so K/V stream from L2 once per 128 queries (64 "
        "rows would read 60 GB a call at the benchmark shape); 64-key tiles (S "
        "32 registers) halve the per-tile barrier and softmax work of 32; Q 66 "
        "+ K/V 2 x 66 KiB = 198 KiB: one block of 8 warps an SM",
    ),
    ("dq", 64): _c(
        4,
        2,
        32,
        False,
        "128 query rows, 32 a warp; dQ 64 + S 32 + dP 32 registers "
        "a tile of 32 keys (64 keys spilled); Q, dO 36 + K/V 2 x 9 KiB = 54 KiB; "
        "~230 registers: 2 blocks an SM",
    ),
    ("dq", 128): _c(
        8,
        1,
        64,
        False,
        "128 query rows, 16 a warp: dQ 64 + S 32 + dP 32 "
        "registers (32 rows a warp: dQ 128, spilled); Q, dO 68 + K/V 2 x 34 KiB = "
        "136 KiB: one block of 8 warps an SM",
    ),
    ("dq", 256): _c(
        8,
        1,
        32,
        False,
        "128 query rows, 16 a warp: dQ alone is 128 registers; "
        "Q, dO 132 + K/V 2 x 33 KiB = 198 KiB: one block of 8 warps an SM",
    ),
    ("dkdv", 64): _c(
        8,
        1,
        64,
        True,
        "128 key rows, 16 a warp, so Q/dO stream from L2 once per "
        "128 keys; dK, dV 32 + S^T, dP^T 32 + K, V 16 registers each (K, V kept "
        "in registers); K, V 36 + Q/dO 2 x 18 KiB + lse, delta = 73 KiB; one block of "
        "8 warps an SM (~235 registers)",
    ),
    ("dkdv", 128): _c(
        8,
        1,
        32,
        False,
        "128 key rows, 16 a warp; dK, dV 64 + S^T, dP^T 16 "
        "registers each, a tile of 32 queries (64 queries spilled); K, V 68 + "
        "Q/dO 2 x 17 KiB = 102 KiB; one block of 8 warps an SM (~245 registers)",
    ),
    ("dkdv", 256): _c(
        8,
        1,
        64,
        False,
        "64 key rows, 2 warps on each 16 (split: one warp cannot "
        "hold dK and dV for 256 columns, 256 registers; paired, each holds 128 "
        "columns, 2 x 64, and scores 32 of the tile's 64 queries over all 256 "
        "dims); K, V 66 + Q/dO 2 x 66 + swap 16 KiB = 215 KiB: one block of 8 "
        "warps an SM",
        split=2,
    ),
}

CUDA_DIMS = tuple(sorted({dim for _, dim in CUDA}))


def cuda_shared_bytes(kernel: str, dim: int, b: CudaBlocks, itemsize: int = 2) -> int:
    """Shared memory of a tensor-core kernel as its body carves it (rows of dim + 8 elements)."""
    row = (dim + 8) * itemsize
    if kernel == "forward":  # Q, K and V twice
        return (b.rows + 4 * b.walk) * row
    if kernel == "dq":  # Q, dO, K and V twice
        return (2 * b.rows + 4 * b.walk) * row
    # K, V; Q, dO, lse and delta twice; the pairs' swapped fragments (split)
    swap = b.warps * 2 * (b.walk // b.split // 16) * 4 * 32 * 4 if b.split > 1 else 0
    return 2 * b.rows * row + 4 * b.walk * row + 4 * b.walk * 4 + swap
