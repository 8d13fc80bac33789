"""A roofline estimate of each Metal kernel launch the walk makes: its FLOPs and device bytes
(the attention and chunked delta kernels' from their `traffic.py` models; the scans' from their
launch shapes), and the seconds they take at a GPU's peak arithmetic or bandwidth, whichever is
slower. A lower bound on a launch's time (no launch beats its roofline), used to check that none
runs long enough for macOS to kill its command buffer as a hung GPU: the rule the kernels keep
is about a second at most on the smallest M-series GPU (split a launch otherwise). `window`
sums a whole exact walk's launches, the base's weight products with them: a lower bound on the
seconds a window takes (docs/MAC.md).

The GPUs' figures are their makers' or public spec sheets' peaks (docs/MAC.md cites them); the
matrix units of an M1-M3 GPU run float16 and bfloat16 at the float32 rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from .attention import blocks as attention_blocks
from .attention import traffic as attention_traffic
from .delta import traffic as delta_traffic

SCAN_CHUNK = 256  # positions per chunk of the delta rule on a GPU (mlxwalk/ops/delta.py)
LIMIT_S = 1.0  # the most one launch may take by its roofline


@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: float  # peak float32 (= float16) arithmetic, 10^12 FLOP/s
    gbps: float  # peak memory bandwidth, 10^9 bytes/s


# The smallest M-series GPU: the M1's 7-core part (8 cores: 2.6 TFLOPS at 1,278 MHz, 128 ALUs a
# core, two FLOPs an FMA; 7 cores: 7/8 of it) on its 128-bit LPDDR4X-4266 (68.25 GB/s).
M1_7CORE = Gpu("Apple M1, 7-core GPU", 7 * 128 * 2 * 1.278e9 / 1e12, 68.25)


# A larger one, for the seconds a window takes on a Mac built for it: the M1 Max's 32-core GPU
# (Apple's figures: 10.4 TFLOPS, 400 GB/s).
M1_MAX = Gpu("Apple M1 Max, 32-core GPU", 10.4, 400.0)


@dataclass(frozen=True)
class Launch:
    kernel: str
    what: str  # the shape it runs at, in words
    flops: float
    bytes: float  # device memory read and written
    grid: int = 1  # threadgroups that never wait on one another: what a split can share out

    def seconds(self, gpu: Gpu) -> float:
        """The roofline: the slower of the arithmetic and the memory traffic at peak."""
        return max(self.flops / (gpu.tflops * 1e12), self.bytes / (gpu.gbps * 1e9))

    def bound(self, gpu: Gpu) -> str:
        compute = self.flops / (gpu.tflops * 1e12)
        return "compute" if compute >= self.bytes / (gpu.gbps * 1e9) else "memory"

    def splits(self, gpu: Gpu, limit: float = LIMIT_S) -> int:
        """Launches over disjoint parts of the grid that would keep each under `limit` (0: the
        grid has too few independent threadgroups to split that far)."""
        n = max(1, math.ceil(self.seconds(gpu) / limit))
        return n if n <= self.grid else 0


def over(launches: list[Launch], gpu: Gpu = M1_7CORE, limit: float = LIMIT_S) -> list[Launch]:
    """The launches whose roofline is past `limit`."""
    return [x for x in launches if x.seconds(gpu) > limit]


def attention(
    heads: int,
    kv_heads: int,
    dim: int,
    chunk: int,
    start: int,
    grad_from: int = 0,
    dtype: mx.Dtype = mx.bfloat16,
    store: mx.Dtype = mx.bfloat16,
) -> list[Launch]:
    """One attention layer's three launches for a chunk of `chunk` queries after `start` cached
    positions, [grad_from, start) tapped (forward; dq and dkdv in its backward)."""
    s = attention_traffic.Shape(1, heads, kv_heads, chunk, start, grad_from, dim, dtype, store)
    what = f"{chunk} queries x {start + chunk} keys, {heads}/{kv_heads} heads, dim {dim}"
    out = []
    for kernel in ("forward", "dq", "dkdv"):
        t = attention_traffic.traffic(kernel, s)
        rows = attention_blocks.metal(kernel, dim, dtype).rows
        # forward, dq: a threadgroup per query block and head; dkdv: per key block and K/V head
        grid = math.ceil(chunk / rows) * heads
        if kernel == "dkdv":
            grid = math.ceil((start - grad_from + chunk) / rows) * kv_heads
        moved = t.device_read_bytes + t.device_write_bytes
        out.append(Launch(f"attention/{kernel}", what, t.flops, moved, grid))
    return out


def delta(
    length: int, key_heads: int, value_heads: int, dim: int, dtype: mx.Dtype = mx.bfloat16
) -> list[Launch]:
    """One gated delta-net layer's chunked kernels over `length` positions (one walk chunk):
    prepare, states, output forward; states_back, grads, prepare_back backward."""
    s = delta_traffic.Shape(1, length, key_heads, value_heads, dim, dtype)
    what = f"{length} positions, {key_heads}/{value_heads} heads, dim {dim}"
    out = []
    for kernel in delta_traffic.blocks.KERNELS:
        t = delta_traffic.traffic(kernel, s, keep=kernel == "prepare")
        out.append(
            Launch(f"delta/{kernel}", what, t.flops, t.device_read_bytes + t.device_write_bytes)
        )
    return out


def scans(length: int, heads: int, dk: int, dv: int, chunk: int = SCAN_CHUNK) -> list[Launch]:
    """The older delta scans (metal_kernels/delta/__init__.py) over `length` positions, one launch
    each way. Per chunk and state row: the output qg s (c x dk), the writes u = u0 - w s
    (c x dk) and the update s += kd^T u (c x dk), two FLOPs a product; every input and output
    float32, each read or written once (the forward keeps every chunk's entry state)."""
    n = -(-length // chunk)
    flops = 3 * 2 * n * chunk * dk * heads * dv
    # u0 or d_out (n, h, c, dv); w, qg, kd (n, h, c, dk); p (n, h, c, c); g_end; two states
    inputs = n * heads * chunk * (dv + 3 * dk + chunk) + n * heads + 2 * heads * dv * dk
    forward = inputs + n * heads * chunk * dv + n * heads * dv * dk  # o, entries
    back = inputs + n * heads * dv * dk + n * heads * chunk * dv  # ds_exit, du
    what = f"{length} positions in chunks of {chunk}, {heads} heads, {dk}x{dv} state"
    return [
        Launch("delta/scan", what, flops, 4 * forward),
        Launch("delta/scan_back", what, flops, 4 * back),
    ]


@dataclass(frozen=True)
class Shape:
    """What the launches depend on, from a model's config (mlx-lm's names)."""

    heads: int
    kv_heads: int
    head_dim: int
    linear_key_heads: int = 0  # 0: no gated delta-net layers
    linear_value_heads: int = 0
    linear_dim: int = 0

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config["num_attention_heads"]
        return cls(
            heads,
            config.get("num_key_value_heads", heads),
            config.get("head_dim") or config["hidden_size"] // heads,
            config.get("linear_num_key_heads", 0),
            config.get("linear_num_value_heads", 0),
            config.get("linear_key_head_dim", 0),
        )


def walk(shape: Shape, window: int, chunk: int, dtype: mx.Dtype = mx.bfloat16) -> list[Launch]:
    """Every kind of launch an exact walk over `window` positions makes, at its largest: the last
    chunk's attention over the whole prefix, tapped from position 0 (the exact walk's horizon;
    the decode's launches read less), and a delta-net layer's launches over one chunk."""
    start = (window - 1) // chunk * chunk  # the last chunk's first position
    out = attention(shape.heads, shape.kv_heads, shape.head_dim, chunk, start, 0, dtype)
    if shape.linear_key_heads:
        k, v, d = shape.linear_key_heads, shape.linear_value_heads, shape.linear_dim
        out += delta(chunk, k, v, d, dtype)
        out += scans(chunk, v, d, d)
    return out


@dataclass(frozen=True)
class Products:
    """A model's weight products per position, layer by layer (multiply-adds, bytes of the
    weights each position's product reads), and the head's."""

    macs: tuple[int, ...]
    bytes: tuple[int, ...]
    head_macs: int
    head_bytes: int


def _dense(what: str, macs: int, moved: int, positions: int, passes: int) -> Launch:
    """A pass's weight products over `positions`, the weights read once per pass (the least
    they can be): a lower bound on those launches together."""
    return Launch(what, f"{positions} positions", passes * 2 * macs * positions, passes * moved)


def window(
    shape: Shape,
    kinds: tuple[str, ...],
    products: Products,
    stem: int,
    length: int,
    chunk: int,
    dtype: mx.Dtype = mx.bfloat16,
) -> list[Launch]:
    """Every launch of an exact walk over a fully labelled window of `length`, identical layers'
    launches summed into one: the decode (every chunk but the last, through every layer), then
    the reverse pass (every chunk, through the layers from `stem` up, recomputed and
    differentiated, and the head's loss); attention over each chunk's whole prefix, tapped from
    position 0. The sum of their seconds is a lower bound on the window's (no launch beats its
    roofline; the adapters' and the norms' work is left out)."""
    attention_layers = [i for i, k in enumerate(kinds) if k == "attention"]
    recurrent_layers = [i for i, k in enumerate(kinds) if k != "attention"]
    out = []
    for start in range(0, length, chunk):
        size = min(chunk, length - start)
        last = start + size >= length
        for phase, layers in (("decode", range(len(kinds))), ("reverse", range(stem, len(kinds)))):
            if phase == "decode" and last:
                continue  # the last chunk is not decoded
            n_attention = sum(1 for i in layers if i in attention_layers)
            n_recurrent = sum(1 for i in layers if i in recurrent_layers)
            macs = sum(products.macs[i] for i in layers)
            moved = sum(products.bytes[i] for i in layers)
            passes = 1 if phase == "decode" else 2  # forward; recomputed forward and backward
            out.append(_dense(f"{phase}/products", macs, moved, size, passes))
            kernels = attention(shape.heads, shape.kv_heads, shape.head_dim, size, start, 0, dtype)
            if phase == "decode":
                kernels = kernels[:1]  # the forward alone
                out.append(_scaled(kernels, n_attention, phase))
            else:
                out.append(_scaled(kernels, n_attention, phase))
                out.append(_dense("reverse/head", products.head_macs, products.head_bytes, size, 2))
            if shape.linear_key_heads and n_recurrent:
                k, v, d = shape.linear_key_heads, shape.linear_value_heads, shape.linear_dim
                ds = delta(size, k, v, d, dtype)
                out.append(_scaled(ds[:3] if phase == "decode" else ds, n_recurrent, phase))
    return [x for x in out if x.flops or x.bytes]


def _scaled(launches: list[Launch], n: int, phase: str) -> Launch:
    """`n` layers' worth of `launches`, as one."""
    flops = n * sum(x.flops for x in launches)
    moved = n * sum(x.bytes for x in launches)
    kind = launches[0].kernel.split("/")[0] if launches else "none"
    return Launch(f"{phase}/{kind}", launches[0].what if launches else "", flops, moved)


def seconds(launches: list[Launch], gpu: Gpu = M1_7CORE) -> float:
    return sum(x.seconds(gpu) for x in launches)


def table(launches: list[Launch], gpu: Gpu = M1_7CORE) -> str:
    lines = [
        f"| launch | shape | GFLOP | MB moved | {gpu.name}: s (roofline) | bound | "
        f"launches for <= {LIMIT_S:g} s |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for x in launches:
        n = x.splits(gpu)
        lines.append(
            f"| {x.kernel} | {x.what} | {x.flops / 1e9:,.1f} | {x.bytes / 1e6:,.1f} | "
            f"{x.seconds(gpu):.3f} | {x.bound(gpu)} | {n if n else 'no split'} |"
        )
    return "\n".join(lines)
