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
  prepare      KS: columns of K (then V) staged per step; the whole of K where it fits, so the
               Gram matrix and the first value head's w read it once.
  states       BV: value columns a threadgroup (a state block DK x BV in registers, DK / 4
               floats a lane); SL: columns of w and K staged per step.
  output       KS: columns of K staged per step (scores computed once per key head); SV: rows of
               the state h_c and columns of v_new staged per step.
  states_back  BV, SL as states's (Q and K, then W, staged as float32 beside P's packed tiles).
  grads        KB: key columns a threadgroup (its dq, dk, dw accumulators: 3 KB / 32 floats a
               lane); SK: columns of Q and K staged per step; SV: rows of h and dh (and columns of
               v_new for dP) staged per step.
  prepare_back SL: columns of K and dW (V and dU) staged per step, as float32, beside T and
               dT T^T (then dA) as packed tiles.

CUDA entries go under names of their own (`CUDA...`), added by the CUDA kernels' author.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

THREADGROUP_MEMORY = 32768  # bytes a threadgroup may use on Apple GPUs
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

# (kernel, head dim, "half" | "float") -> shape. Bytes in each reason are threadgroup memory.
METAL: dict[tuple[str, int, str], MetalBlocks] = {
    ("prepare", 64, "half"): _m(
        8,
        f"{_ROWS}; all of K, 64 rows of 144 B, + A/T 9 KiB + gates "
        "= 18.8 KiB: one staging of K serves the Gram and the first value head's w",
        KS=64,
    ),
    ("prepare", 128, "half"): _m(
        8,
        f"{_ROWS}; all of K, 64 rows of 272 B, + A/T 9 KiB + "
        "gates = 26.8 KiB: one staging serves the Gram and the first value head's w",
        KS=128,
    ),
    ("prepare", 64, "float"): _m(
        8, f"{_ROWS}; all of K, 64 rows of 272 B, + A/T 9 KiB + gates = 26.8 KiB", KS=64
    ),
    ("prepare", 128, "float"): _m(
        8, f"{_ROWS}; half of K a step (64 rows of 272 B): all of it would take 33 KiB alone", KS=64
    ),
    ("states", 64, "half"): _m(
        4,
        f"{_SCAN}; w 64 x 64 floats + K 64 x 64 halves a step, 26.3 KiB: two steps a chunk",
        BV=32,
        SL=64,
    ),
    ("states", 128, "half"): _m(
        4,
        f"{_SCAN}; w 64 x 64 floats + K 64 x 64 halves a step, 26.3 KiB; S^T 32 floats a lane",
        BV=32,
        SL=64,
    ),
    ("states", 64, "float"): _m(
        4,
        f"{_SCAN}; w and K 64 x 32 floats a step, 18.3 KiB (64 columns of both would take 34 KiB)",
        BV=32,
        SL=32,
    ),
    ("states", 128, "float"): _m(
        4, f"{_SCAN}; w and K 64 x 32 floats a step, 18.3 KiB; S^T 32 floats a lane", BV=32, SL=32
    ),
    ("output", 64, "half"): _m(
        8,
        f"{_ROWS}; K 9 KiB + h 32 rows 8.5 KiB + v_new 32 columns "
        "9 KiB = 26.8 KiB; Q 16 floats a lane",
        KS=64,
        SV=32,
    ),
    ("output", 128, "half"): _m(
        8,
        f"{_ROWS}; K 17 KiB + h 16 rows 8.3 KiB + v_new 16 columns "
        "5 KiB = 30.5 KiB; Q 32 floats a lane",
        KS=128,
        SV=16,
    ),
    ("output", 64, "float"): _m(
        8,
        f"{_ROWS}; K 17 KiB + h 16 rows 4.3 KiB + v_new 16 columns 5 KiB = 26.5 KiB",
        KS=64,
        SV=16,
    ),
    ("output", 128, "float"): _m(
        8,
        f"{_ROWS}; half of K 17 KiB + h 16 rows 8.3 KiB + v_new 16 columns 5 KiB = 30.5 KiB",
        KS=64,
        SV=16,
    ),
    ("states_back", 64, "half"): _m(
        4,
        f"{_SCAN}; Q, K (then w) 64 x 32 floats a step + P 9 KiB "
        "= 27.3 KiB; dS^T 16, dO 16, dv 16 floats a lane",
        BV=32,
        SL=32,
    ),
    ("states_back", 128, "half"): _m(
        4, f"{_SCAN}; as at 64: 27.3 KiB; dS^T 32 floats a lane", BV=32, SL=32
    ),
    ("states_back", 64, "float"): _m(
        4, f"{_SCAN}; staged as float32 whatever the dtype: 27.3 KiB", BV=32, SL=32
    ),
    ("states_back", 128, "float"): _m(4, f"{_SCAN}; 27.3 KiB", BV=32, SL=32),
    ("grads", 64, "half"): _m(
        8,
        f"{_ROWS}; all 64 key columns (dq, dk, dw 48 floats a lane); Q, "
        "K 32 columns 10 KiB + h, dh 8 rows 4.3 KiB + v_new 8 columns 3 KiB "
        "+ dP 9 KiB = 26.8 KiB",
        KB=64,
        SK=32,
        SV=8,
    ),
    ("grads", 128, "half"): _m(
        8,
        f"{_ROWS}; 64 key columns a threadgroup (all 128: 96 floats "
        "a lane), dP recomputed by both; memory as at 64",
        KB=64,
        SK=32,
        SV=8,
    ),
    ("grads", 64, "float"): _m(
        8, f"{_ROWS}; Q, K 16 columns 10 KiB, the rest as for half: 26.8 KiB", KB=64, SK=16, SV=8
    ),
    ("grads", 128, "float"): _m(
        8,
        f"{_ROWS}; 64 key columns a threadgroup, Q, K 16 columns a step: 26.8 KiB",
        KB=64,
        SK=16,
        SV=8,
    ),
    ("prepare_back", 64, "half"): _m(
        8,
        f"{_ROWS}; K/dW (V/dU) 64 x 16 floats a step 10 KiB + T "
        "and dT T^T 18 KiB + gates 1 KiB = 29 KiB (32 columns: "
        "37 KiB)",
        SL=16,
    ),
    ("prepare_back", 128, "half"): _m(8, f"{_ROWS}; as at 64: 29 KiB; dk 32 floats a lane", SL=16),
    ("prepare_back", 64, "float"): _m(
        8, f"{_ROWS}; staged as float32 whatever the dtype: 29 KiB", SL=16
    ),
    ("prepare_back", 128, "float"): _m(8, f"{_ROWS}; 29 KiB", SL=16),
}

METAL_DIMS = tuple(sorted({dim for _, dim, _ in METAL}))


def width(dtype: mx.Dtype) -> str:
    return "float" if dtype == mx.float32 else "half"


def metal(kernel: str, dim: int, dtype: mx.Dtype) -> MetalBlocks:
    return METAL[(kernel, dim, width(dtype))]


def metal_threadgroup_bytes(kernel: str, dim: int, dtype: mx.Dtype) -> int:
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
    # prepare_back: K or V, dW or dU, T, dT T^T then dA, cum, beta, dcum, dbeta
    return 2 * CHUNK * (g["SL"] + 4) * 4 + 2 * tri + 4 * CHUNK * 4
