"""How the delta-rule scan kernels are called.

The chunked gated delta rule (mlxwalk/ops/delta/chunk.py) is parallel over its chunks but for the
state they carry; these two kernels are that sequential part, one launch each way instead of
several per chunk:
  scan:      forward; every chunk's output, the state entering every chunk, the final state;
  scan_back: the reverse scan; the adjoint of the state leaving every chunk, du per chunk, and
             the initial state's adjoint.
A simdgroup (warp) owns one row of a head's state: rows never meet in the recurrence. All
inputs and outputs are float32 (the op computes its chunk factors in float32).

The whole op, forward and backward, on the matrix units is another set of kernels beside these
(prepare, states, output, states_back, grads, prepare_back): `chunked.py` runs them,
`blocks.py` holds their block shapes, `traffic.py` what they move. MLX is imported by the
launch builders only: this package's plain parts (blocks.py, pipeline.py) import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..sources import Spec

if TYPE_CHECKING:
    from ..build import Launch

ROWS = 4  # state rows (simdgroups of 32 threads) per threadgroup
MAX_CHUNK = 256  # threadgroup memory: two floats per position per row, and the row
FACTORS = ("w", "qg", "p", "kd", "g_end")
SCAN = Spec("delta/scan", ("u0", *FACTORS, "s0", "params"), ("o", "entries", "s_out"))
SCAN_BACK = Spec(
    "delta/scan_back", (*FACTORS, "d_out", "ds_in", "params"), ("ds_exit", "du", "ds0")
)


def supports(dk: int, chunk: int) -> bool:
    return dk % 32 == 0 and dk <= 256 and chunk <= MAX_CHUNK


def _grid(rows: int) -> dict:
    groups = -(-rows // ROWS)
    return {"grid": (groups * 32 * ROWS, 1, 1), "threadgroup": (32 * ROWS, 1, 1)}


def scan_launch(u0, w, qg, p, kd, g_end, s0, keep: bool = True) -> Launch:
    """u0 (N, H, C, DV); w, qg, kd (N, H, C, DK); p (N, H, C, C); g_end (N, H); s0 (H, DV, DK).
    `keep`: write the state entering every chunk (else that output is a placeholder)."""
    import mlx.core as mx

    from ..build import Launch

    n, h, c, dv = u0.shape
    dk = w.shape[-1]
    params = mx.array([n, h, dv], mx.int32)
    inputs = [x.astype(mx.float32) for x in (u0, w, qg, p, kd, g_end, s0)] + [params]
    shapes = [(n, h, c, dv), (n, h, dv, dk) if keep else (1,), (h, dv, dk)]
    template = [("C", c), ("DK", dk), ("ROWS", ROWS), ("KEEP", keep)]
    return Launch(SCAN, inputs, shapes, [mx.float32] * 3, template=template, **_grid(h * dv))


def scan_back_launch(w, qg, p, kd, g_end, d_out, ds_in) -> Launch:
    """As scan_launch's, with d_out (N, H, C, DV) and ds_in (H, DV, DK)."""
    import mlx.core as mx

    from ..build import Launch

    n, h, c, dv = d_out.shape
    dk = w.shape[-1]
    params = mx.array([n, h, dv], mx.int32)
    inputs = [x.astype(mx.float32) for x in (w, qg, p, kd, g_end, d_out, ds_in)] + [params]
    shapes = [(n, h, dv, dk), (n, h, c, dv), (h, dv, dk)]
    template = [("C", c), ("DK", dk), ("ROWS", ROWS)]
    return Launch(SCAN_BACK, inputs, shapes, [mx.float32] * 3, template=template, **_grid(h * dv))
