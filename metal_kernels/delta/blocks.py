"""Block shapes of the chunked delta-rule kernels: one table per backend, one entry per (kernel,
head dim, dtype width), each with the reason it has that shape.

METAL (the `.metal` bodies on Apple's 8x8 simdgroup matrices). A chunk is CHUNK = 64 positions,
8 row tiles: the kernels parallel over chunks (prepare, output, grads, prepare_back) give each
simdgroup one row tile, 8 simdgroups (256 threads) a threadgroup; the scans (states,
states_back) give each simdgroup 8 value columns of one head's state, BV / 8 simdgroups. A
threadgroup has 32 KiB of threadgroup memory on Apple GPUs; staged rows are padded by 16 bytes
(4 floats, 8 halves) so that the rows of a block do not start on the same bank. K, V, Q and dO are
staged in the inputs' dtype where a kernel stages them as such ("half": float16 and bfloat16
share a shape), the float32 intermediates (w, u, h, v_new and their gradients) as float32;
lower-triangular chunk matrices (A, T, P, dP) as their 36 packed 8x8 tiles (9 KiB).
Occupancy: a GPU core holds about 60 KB of threadgroup memory (CORE_MEMORY) and its ALUs
saturate near 24 simdgroups; every shape leaves at least MIN_SIMDGROUPS = 8 simdgroups a core
by that estimate (`metal_simdgroups_per_core`), the chunk-parallel kernels 16 or more (two
threadgroups a core: at most 30 KiB each), the scans 12 or 16. Each per-lane tile array is
indexed by constants only (the bodies unroll their fragment loops, and the staged loops that
pick a step's tiles of such an array), so it stays in registers; its size a lane is in the
reasons below.
  prepare      KS: columns of K (then V) staged per step; the whole of K where it fits, so the
               Gram matrix and the first value head's w read it once.
  states       BV: value columns a threadgroup (a state block DK x BV in registers, DK / 4
               floats a lane); SL: columns of w and K staged per step.
  output       KS: columns of K staged per step (scores computed once per key head); SV: rows of
               the state h_c and columns of v_new staged per step.
  states_back  BV, SL as states's (Q and K, then W, staged as float32 beside P's packed tiles).
  grads        KB: key columns a threadgroup (its dq, dk, dw accumulators: 3 KB / 32 floats a
               lane); SK: columns of Q and K staged per step; SV: rows of h and dh and columns of
               v_new (for dP and v_new's own rows) staged per step, one walk over DV for dP and
               the state terms (each dO tile read once).
  prepare_back SL: columns of K and dW (V and dU) staged per step, as float32, beside T and
               dT T^T (then dA) as packed tiles.

CUDA entries go under names of their own (`CUDA...`), added by the CUDA kernels' author.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sources import dtype_name

THREADGROUP_MEMORY = 32768  # bytes a threadgroup may use on Apple GPUs
CORE_MEMORY = 61440  # bytes of threadgroup memory a GPU core holds, about (metal-benchmarks)
MIN_SIMDGROUPS = 8  # resident simdgroups a core each kernel leaves at least, by that estimate
# Positions a chunk, inside the kernels: FLA's 64. Its 8 row tiles give the chunk-parallel
# kernels one per simdgroup; the inverse's 16-row blocks merge twice to it; a C x C matrix's 36
# lower tiles take 9 KiB of threadgroup memory, so A/T, P and dP fit beside the staged operands
# (at 128: 136 tiles, 34 KiB, more than a threadgroup has).
CHUNK = 64
KERNELS = ("prepare", "states", "output", "states_back", "grads", "prepare_back")


@dataclass(frozen=True)
class MetalBlocks:
    simdgroups: int
    template: tuple[tuple[str, int], ...]  # the block template values, in the body's order
    why: str

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups

    def __getitem__(self, name: str) -> int:
        return dict(self.template)[name]


def _m(simdgroups: int, why: str, **template: int) -> MetalBlocks:
    return MetalBlocks(simdgroups, tuple(template.items()), why)


_ROWS = "8 simdgroups, one per row tile of the chunk"
_SCAN = "BV 32: 4 simdgroups of 8 columns, B x HV x DV / 32 threadgroups (128 at 32 heads of 128)"

# (kernel, head dim, "half" | "float") -> shape. Bytes in each reason are threadgroup memory;
# "n a core": the estimate's resident threadgroups (x simdgroups) a GPU core.
METAL: dict[tuple[str, int, str], MetalBlocks] = {
    ("prepare", 64, "half"): _m(
        8,
        f"{_ROWS}; all of K, 64 rows of 144 B, + A/T 9 KiB + gates "
        "= 18.8 KiB (3 a core, 24 simdgroups): one staging of K serves the Gram and the first "
        "value head's w; Gram and T rows 32 floats a lane",
        KS=64,
    ),
    ("prepare", 128, "half"): _m(
        8,
        f"{_ROWS}; all of K, 64 rows of 272 B, + A/T 9 KiB + "
        "gates = 26.8 KiB (2 a core, 16 simdgroups): one staging serves the Gram and the first "
        "value head's w",
        KS=128,
    ),
    ("prepare", 64, "float"): _m(
        8, f"{_ROWS}; all of K, 64 rows of 272 B, + A/T 9 KiB + gates = 26.8 KiB (2 a core)", KS=64
    ),
    ("prepare", 128, "float"): _m(
        8,
        f"{_ROWS}; half of K a step (64 rows of 272 B), 26.8 KiB (2 a core): all of it would "
        "take 33 KiB alone",
        KS=64,
    ),
    ("states", 64, "half"): _m(
        4,
        f"{_SCAN}; w 64 x 32 floats + K 64 x 32 halves a step, 14.3 KiB (4 a core, 16 "
        "simdgroups: a scan is latency-bound, so as many walks resident as fit)",
        BV=32,
        SL=32,
    ),
    ("states", 128, "half"): _m(
        4,
        f"{_SCAN}; w 64 x 32 floats + K 64 x 32 halves a step, 14.3 KiB (4 a core); S^T 32 "
        "+ v_new 16 floats a lane",
        BV=32,
        SL=32,
    ),
    ("states", 64, "float"): _m(
        4,
        f"{_SCAN}; w and K 64 x 32 floats a step, 18.3 KiB (3 a core, 12 simdgroups; 64 "
        "columns of both would take 34 KiB)",
        BV=32,
        SL=32,
    ),
    ("states", 128, "float"): _m(
        4,
        f"{_SCAN}; w and K 64 x 32 floats a step, 18.3 KiB (3 a core); S^T 32 floats a lane",
        BV=32,
        SL=32,
    ),
    ("output", 64, "half"): _m(
        8,
        f"{_ROWS}; K 9 KiB + h 32 rows 8.5 KiB + v_new 32 columns "
        "9 KiB = 26.8 KiB (2 a core, 16 simdgroups); Q 16 + S, P 32 floats a lane",
        KS=64,
        SV=32,
    ),
    ("output", 128, "half"): _m(
        8,
        f"{_ROWS}; half of K a step 9 KiB + h 16 rows 8.3 KiB + v_new 16 columns 5 KiB = "
        "22.5 KiB (2 a core; all of K, 30.5 KiB, left one); Q 32 + S, P 32 floats a lane",
        KS=64,
        SV=16,
    ),
    ("output", 64, "float"): _m(
        8,
        f"{_ROWS}; K 17 KiB + h 16 rows 4.3 KiB + v_new 16 columns 5 KiB = 26.5 KiB (2 a core)",
        KS=64,
        SV=16,
    ),
    ("output", 128, "float"): _m(
        8,
        f"{_ROWS}; a quarter of K a step 9 KiB + h 16 rows 8.3 KiB + v_new 16 columns 5 KiB "
        "= 22.5 KiB (2 a core)",
        KS=32,
        SV=16,
    ),
    ("states_back", 64, "half"): _m(
        4,
        f"{_SCAN}; Q, K (then w) 64 x 16 floats a step + P 9 KiB = 19.3 KiB (3 a core, 12 "
        "simdgroups; 32 columns a step: 27.3 KiB, 2); dS^T 16, dO 16, dv 16, P's 18 floats a "
        "lane",
        BV=32,
        SL=16,
    ),
    ("states_back", 128, "half"): _m(
        4, f"{_SCAN}; as at 64: 19.3 KiB (3 a core); dS^T 32 floats a lane", BV=32, SL=16
    ),
    ("states_back", 64, "float"): _m(
        4,
        f"{_SCAN}; staged as float32 whatever the dtype: 19.3 KiB (3 a core)",
        BV=32,
        SL=16,
    ),
    ("states_back", 128, "float"): _m(4, f"{_SCAN}; 19.3 KiB (3 a core)", BV=32, SL=16),
    ("grads", 64, "half"): _m(
        8,
        f"{_ROWS}; all 64 key columns (dq, dk, dw 48 + dP 16 floats a lane); Q, "
        "K 32 columns 10 KiB + h, dh 8 rows 4.3 KiB + v_new 8 columns 3 KiB "
        "+ dP 9 KiB = 26.8 KiB (2 a core, 16 simdgroups)",
        KB=64,
        SK=32,
        SV=8,
    ),
    ("grads", 128, "half"): _m(
        8,
        f"{_ROWS}; 64 key columns a threadgroup (all 128: 96 floats "
        "a lane), dP recomputed by both; memory as at 64 (2 a core)",
        KB=64,
        SK=32,
        SV=8,
    ),
    ("grads", 64, "float"): _m(
        8,
        f"{_ROWS}; Q, K 16 columns 10 KiB, the rest as for half: 26.8 KiB (2 a core)",
        KB=64,
        SK=16,
        SV=8,
    ),
    ("grads", 128, "float"): _m(
        8,
        f"{_ROWS}; 64 key columns a threadgroup, Q, K 16 columns a step: 26.8 KiB (2 a core)",
        KB=64,
        SK=16,
        SV=8,
    ),
    ("prepare_back", 64, "half"): _m(
        8,
        f"{_ROWS}; K/dW (V/dU) 64 x 16 floats a step 10 KiB + T "
        "and dT T^T 18 KiB + gates 1.3 KiB = 29.3 KiB (2 a core, 16 simdgroups; 32 columns: "
        "37 KiB); dT and M 16 floats a lane each",
        SL=16,
    ),
    ("prepare_back", 128, "half"): _m(
        8, f"{_ROWS}; as at 64: 29.3 KiB (2 a core); dk 32 floats a lane", SL=16
    ),
    ("prepare_back", 64, "float"): _m(
        8, f"{_ROWS}; staged as float32 whatever the dtype: 29.3 KiB (2 a core)", SL=16
    ),
    ("prepare_back", 128, "float"): _m(8, f"{_ROWS}; 29.3 KiB (2 a core)", SL=16),
}

METAL_DIMS = tuple(sorted({dim for _, dim, _ in METAL}))


def width(dtype) -> str:
    """The tables' width of a dtype (MLX's, torch's or its name): float32's, or a half's."""
    return "float" if dtype_name(dtype) == "float32" else "half"


def metal(kernel: str, dim: int, dtype) -> MetalBlocks:
    return METAL[(kernel, dim, width(dtype))]


def metal_threadgroup_bytes(kernel: str, dim: int, dtype) -> int:
    """Threadgroup memory of a Metal kernel as its body declares it (dk = dv = dim)."""
    g = metal(kernel, dim, dtype)
    size = 4 if width(dtype) == "float" else 2
    pad = 16 // size
    tri = 36 * 64 * 4  # packed lower tiles
    if kernel == "prepare":  # K/V columns, A/T, cum, beta, beta gamma
        return CHUNK * (g["KS"] + pad) * size + tri + 3 * CHUNK * 4
    if kernel == "states":  # w, K, cum
        return CHUNK * (g["SL"] + 4) * 4 + CHUNK * (g["SL"] + pad) * size + CHUNK * 4
    if kernel == "output":  # K, h, v_new, cum
        return (
            CHUNK * (g["KS"] + pad) * size
            + g["SV"] * (dim + 4) * 4
            + CHUNK * (g["SV"] + 4) * 4
            + CHUNK * 4
        )
    if kernel == "states_back":  # Q (then w), K, P, cum
        return 2 * CHUNK * (g["SL"] + 4) * 4 + tri + CHUNK * 4
    if kernel == "grads":  # Q, K, h, dh, v_new, dP, cum, dcum, the last row's partials
        return (
            2 * CHUNK * (g["SK"] + pad) * size
            + 2 * g["SV"] * (g["KB"] + 4) * 4
            + CHUNK * (g["SV"] + 4) * 4
            + tri
            + 2 * CHUNK * 4
            + 8 * 4
        )
    # prepare_back: K or V, dW or dU, T, dT T^T then dA, cum, beta, beta gamma, dcum, dbeta
    return 2 * CHUNK * (g["SL"] + 4) * 4 + 2 * tri + 5 * CHUNK * 4


def metal_simdgroups_per_core(kernel: str, dim: int, dtype) -> int:
    """Simdgroups a GPU core keeps resident by the threadgroup-memory estimate: the threadgroups
    that fit in CORE_MEMORY, times the kernel's simdgroups each."""
    per_group = metal_threadgroup_bytes(kernel, dim, dtype)
    return CORE_MEMORY // per_group * metal(kernel, dim, dtype).simdgroups


# CUDA: the tensor-core bodies (`.cu`: mma.sync.m16n8k16 on float16/bfloat16, float32 FMA in the
# same fragment layout for float32 inputs) on an H200 (sm_90: 132 SMs, 227 KiB of shared memory a
# block and 228 KiB an SM, 64K registers an SM, 255 a thread). A warp owns 16 rows: a chunk's
# positions (prepare, output, grads, prepare_back: 4 warps, one per 16 of the chunk's 64 rows) or
# 16 value rows of a head's state (states, states_back: BV / 16 x DKS warps, DKS of them sharing
# 16 rows, each with DK / DKS of its key columns). Operands are staged in
# shared memory as rows padded by 16 bytes: inputs (q, k, v, dy) in their dtype, derived float32
# values (w, h, v_new, T, ...) as hi + lo halves on the half path (tiles.cuh says why), so a
# derived row costs twice an input's. Shared bytes in each reason are at head dim 128, half.
#   prepare      a block per (b, value head, chunk); K, V, A, T and T diag(.)'s parts.
#   states       BV value rows a block (the state 16 x DK / DKS a warp in registers); the
#                chunk's K, w, u and cum double buffered through cp.async, w split once per chunk;
#                a walk is latency-bound (a warp's products a chunk, in sequence, N chunks).
#   output       a block per (b, value head, chunk, BV value columns); Q, K, h_c's BV rows and
#                v_new's BV columns.
#   states_back  as states (the adjoint 16 x DK / DKS a warp); Q, K, w, dO, cum double buffered
#                (STAGES 2), P = Q K^T
#                (.) D and diag(gamma) dO as parts.
#   grads        a block per (b, key head, chunk, KB key columns), walking the key head's value
#                heads (dq, dk summed over them in place, as grads.metal); h then dh's KB columns.
#   prepare_back a block per (b, key head, chunk), walking the value heads (dk summed over
#                them); K, V, T, dw and du as parts, dT then dA T^T-products through C x C parts.
@dataclass(frozen=True)
class CudaBlocks:
    warps: int
    template: tuple[tuple[str, int], ...]  # the block template values (besides T, DK, DV)
    why: str

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def __getitem__(self, name: str) -> int:
        return dict(self.template)[name]


def _c(warps: int, why: str, **template: int) -> CudaBlocks:
    return CudaBlocks(warps, tuple(template.items()), why)


_CHUNK_ROWS = "4 warps, 16 of the chunk's rows each"
# (kernel, head dim, "half" | "float") -> shape.
CUDA: dict[tuple[str, int, str], CudaBlocks] = {
    ("prepare", 64, "half"): _c(
        4, f"{_CHUNK_ROWS}; K, V 9 KiB each + A, T 17 KiB each + parts 18 KiB: 2 blocks an SM"
    ),
    ("prepare", 128, "half"): _c(
        4,
        f"{_CHUNK_ROWS}; K, V 17 KiB each + A, T 17 KiB each + "
        "T diag(.)'s parts 36 KiB = 105 KiB: 2 blocks an SM",
    ),
    ("prepare", 64, "float"): _c(4, f"{_CHUNK_ROWS}; K, V 17 KiB each as float32"),
    ("prepare", 128, "float"): _c(4, f"{_CHUNK_ROWS}; K, V 33 KiB each as float32: 1 block an SM"),
    ("states", 64, "half"): _c(
        4,
        "BV 32 rows, DKS 2 warps on each 16 (32 key columns each): 2 x B x HV blocks, half the "
        "products a chunk of one warp holding all 64 columns; two stages of K, w, u",
        BV=32,
        DKS=2,
    ),
    ("states", 128, "half"): _c(
        4,
        "BV 32 rows, DKS 2 warps on each 16 (64 key columns each, the state 32 floats a lane): "
        "B x HV x 4 blocks (128 at Qwen3.5's 32 value heads, on 132 SMs; BV 64 would fill 64), "
        "160 products a warp a chunk instead of 320 (the walk is latency-bound); K 17 + w 33 + "
        "u 9 KiB a stage, two stages + w's parts 34 + the pairs' partials 16 KiB = 169 KiB",
        BV=32,
        DKS=2,
    ),
    ("states", 64, "float"): _c(4, "BV 32, DKS 2 as half; float32 stages", BV=32, DKS=2),
    ("states", 128, "float"): _c(
        4,
        "BV 32, DKS 2 as half; K 33 + w 33 + u 9 KiB a stage, two stages, + the warps' A rows 33 "
        "+ partials 16 KiB = 200 KiB",
        BV=32,
        DKS=2,
    ),
    ("output", 64, "half"): _c(
        4,
        f"{_CHUNK_ROWS}; BV 64 (all of DV): Q, K 9 KiB each + h, v_new parts 18 KiB each = 54 KiB",
        BV=64,
    ),
    ("output", 128, "half"): _c(
        4,
        f"{_CHUNK_ROWS}; BV 64: Q, K 17 KiB each + h's 64 rows as "
        "parts 34 KiB + v_new's parts 18 KiB = 86 KiB: 2 blocks an SM "
        "(all 128 columns: 140 KiB, one)",
        BV=64,
    ),
    ("output", 64, "float"): _c(4, f"{_CHUNK_ROWS}; BV 64, float32 stages", BV=64),
    ("output", 128, "float"): _c(4, f"{_CHUNK_ROWS}; BV 64, float32 stages", BV=64),
    ("states_back", 64, "half"): _c(
        4, "BV 32, DKS 2 as states; Q, K, w, dO double buffered", BV=32, DKS=2, STAGES=2
    ),
    ("states_back", 128, "half"): _c(
        4,
        "BV 32, DKS 2 as states (~310 products a warp a chunk, P's included, instead of 576); "
        "Q, K 17 + w 33 + "
        "dO 5 KiB a stage, two stages + w's parts 34 + P's 18 + diag(gamma) dO's 10 + the pairs' "
        "partials 16 KiB = 222 KiB: one block an SM",
        BV=32,
        DKS=2,
        STAGES=2,
    ),
    ("states_back", 64, "float"): _c(
        4, "BV 32, DKS 2; float32 stages, two", BV=32, DKS=2, STAGES=2
    ),
    ("states_back", 128, "float"): _c(
        4,
        "BV 32, DKS 2; one float32 stage (Q, K, w 33 KiB each, dO 9): two would take 292 KiB",
        BV=32,
        DKS=2,
        STAGES=1,
    ),
    ("grads", 64, "half"): _c(4, f"{_CHUNK_ROWS}; KB 64 (all of DK)", KB=64),
    ("grads", 128, "half"): _c(
        4,
        f"{_CHUNK_ROWS}; KB 64: Q, K 9 KiB each + dO 17 + v_new's "
        "parts 34 + h's (then dh's) 64 columns as parts 36 KiB = 105 KiB: "
        "2 blocks an SM; dv_new's rows go straight to registers",
        KB=64,
    ),
    ("grads", 64, "float"): _c(4, f"{_CHUNK_ROWS}; KB 64, float32 stages", KB=64),
    ("grads", 128, "float"): _c(4, f"{_CHUNK_ROWS}; KB 64, float32 stages", KB=64),
    ("prepare_back", 64, "half"): _c(
        4, f"{_CHUNK_ROWS}; K, V 9 KiB each + T, dT/M 9 KiB each + dw (then du) 18 KiB, as parts"
    ),
    ("prepare_back", 128, "half"): _c(
        4,
        f"{_CHUNK_ROWS}; K, V 17 KiB each + T's and dT's (then "
        "M's) parts 18 KiB each + dw's (then du's) 34 KiB = 105 "
        "KiB: 2 blocks an SM",
    ),
    ("prepare_back", 64, "float"): _c(4, f"{_CHUNK_ROWS}; float32 stages"),
    ("prepare_back", 128, "float"): _c(4, f"{_CHUNK_ROWS}; float32 stages"),
}

CUDA_DIMS = tuple(sorted({dim for _, dim, _ in CUDA}))


def cuda(kernel: str, dim: int, dtype) -> CudaBlocks:
    return CUDA[(kernel, dim, width(dtype))]


def _region(n: int, itemsize: int) -> int:
    return (n * itemsize + 15) // 16 * 16


def cuda_shared_bytes(kernel: str, dk: int, dv: int, dtype, b: CudaBlocks) -> int:
    """Dynamic shared memory of a CUDA kernel as its body carves it (checked there at compile
    time against the launch's: the template SMEM)."""
    half = width(dtype) == "half"
    size, parts = (2, 2) if half else (4, 1)
    pad = 16 // size
    pk, pv, pct = dk + pad, dv + pad, CHUNK + pad

    def t_rows(n: int, p: int) -> int:  # n rows of p elements of the inputs' dtype
        return _region(n * p, size)

    def f_rows(n: int, p: int) -> int:  # n rows of p floats
        return _region(n * p, 4)

    vec = _region(CHUNK, 4)
    if kernel == "prepare":
        r = max(f_rows(CHUNK, CHUNK + 4), 2 * parts * t_rows(CHUNK, pct))
        return t_rows(CHUNK, pk) + t_rows(CHUNK, pv) + 3 * vec + 2 * f_rows(CHUNK, CHUNK + 4) + r
    if kernel == "states":
        bv, nw, dks = b["BV"], b.warps, b["DKS"]
        stage = t_rows(CHUNK, pk) + f_rows(CHUNK, dk + 4) + f_rows(CHUNK, bv + 4) + vec
        buf = 0 if half else f_rows(16, max(dk, CHUNK) + 4)
        xch = f_rows(16, CHUNK) if dks > 1 else 0
        return 2 * stage + (2 * t_rows(CHUNK, pk) if half else 0) + nw * (buf + xch)
    buf = 0 if half else f_rows(16, CHUNK + 4)  # a warp's A rows (float32 path)
    if kernel == "output":
        bv = b["BV"]
        return (
            2 * t_rows(CHUNK, pk)
            + parts * (t_rows(bv, pk) + t_rows(CHUNK, bv + pad))
            + vec
            + 4 * buf
        )
    if kernel == "states_back":
        bv, nw = b["BV"], b.warps
        stage = 2 * t_rows(CHUNK, pk) + f_rows(CHUNK, dk + 4) + t_rows(CHUNK, bv + pad) + vec
        wide = 0 if half else f_rows(16, max(dk, CHUNK) + 4)
        xch = f_rows(16, CHUNK) if b["DKS"] > 1 else 0
        return (
            b["STAGES"] * stage
            + (2 * t_rows(CHUNK, pk) if half else 0)
            + parts * (t_rows(CHUNK, CHUNK + pad) + t_rows(CHUNK, bv + pad))
            + nw * (wide + xch)
        )
    if kernel == "grads":
        kb = b["KB"]
        wide = 0 if half else f_rows(16, max(dv, CHUNK) + 4)
        return (
            2 * t_rows(CHUNK, kb + pad)
            + t_rows(CHUNK, pv)
            + parts * t_rows(CHUNK, pv)
            + parts * t_rows(dv, kb + pad)
            + 2 * vec
            + _region(8, 4)
            + 4 * wide
        )
    if kernel == "prepare_back":
        return (
            t_rows(CHUNK, pk)
            + t_rows(CHUNK, pv)
            + parts * (2 * t_rows(CHUNK, pct) + t_rows(CHUNK, max(dk, dv) + pad))
            + 4 * vec
            + 4 * buf
        )
    raise ValueError(f"no CUDA kernel delta/{kernel}")
