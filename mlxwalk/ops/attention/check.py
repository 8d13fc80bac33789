"""The kernels against their twin: MLXWALK_KERNELS=check's wrappers, the self-check's small case,
and the cases the tests and the device check compare (errors against a float32 reference)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metal_kernels.attention import Q8

from .. import routing
from ..routing import AttentionCase as Case
from . import kernel, twin
from .prefix import Prefix, dequantize, quantize

relative_error = routing.relative_error


def _compare(name: str, q, k, got, want, prefix) -> None:
    arrays = prefix.in_place() if prefix is not None else None
    case = routing.attention_case(q, k, arrays[0].dtype if arrays is not None else None)
    routing.compare(got, want, case, name)


def checked_forward(q, k, v, prefix, grad_from, scale, tile):
    """Both paths, compared; the twin's result goes on (a mismatch turns the kernel off)."""
    out, lse = twin.forward(q, k, v, prefix, grad_from, scale, tile)
    got, _ = kernel.forward(q, k, v, prefix, grad_from, scale, tile)
    _compare("attention/forward", q, k, [got], [out], prefix)
    return out, lse


def checked_backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out):
    want = twin.backward(q, k, v, prefix, grad_from, scale, tile, out, lse, d_out)
    k_out, k_lse = kernel.forward(q, k, v, prefix, grad_from, scale, tile)
    got = kernel.backward(q, k, v, prefix, grad_from, scale, tile, k_out, k_lse, d_out)
    _compare("attention/dq, attention/dkdv", q, k, got, want, prefix)
    return want


class Store:
    """One layer's K/V store in a float format, shaped as walk.store.KVStore holds it."""

    def __init__(self, keys: mx.array, values: mx.array, dtype: mx.Dtype = mx.float32):
        self.cache_type = str(dtype).removeprefix("mlx.core.")
        self.keys, self.values = [keys.astype(dtype)], [values.astype(dtype)]

    def read(self, layer: int, start: int, end: int, dtype: mx.Dtype):
        return tuple(a[layer][..., start:end, :].astype(dtype) for a in (self.keys, self.values))


class Q8Store(Store):
    """One layer's K/V in the walk's 8-bit store (as walk.store.KVStore holds it: mx.quantize's
    triples, scales and biases in `dtype`, the model's)."""

    def __init__(self, keys: mx.array, values: mx.array, dtype: mx.Dtype):
        self.cache_type = "q8"
        self.keys, self.values = [quantize(keys, dtype)], [quantize(values, dtype)]

    def read(self, layer: int, start: int, end: int, dtype: mx.Dtype):
        return tuple(
            dequantize([x[..., start:end, :] for x in a[layer]], dtype)
            for a in (self.keys, self.values)
        )


def _store(keys: mx.array, values: mx.array, store: mx.Dtype, dtype: mx.Dtype, up: bool):
    """The inputs' store: `store` a float dtype or Q8.dtype (8-bit, scales in `dtype`); `up`: a
    float32 one holding the same values (an 8-bit store's as mx.dequantize gives them)."""
    if store != Q8.dtype:
        return Store(keys, values, mx.float32 if up else store)
    q8 = Q8Store(keys, values, dtype)
    if not up:
        return q8
    n = keys.shape[2]
    return Store(*q8.read(0, 0, n, mx.float32), mx.float32)


@dataclass(frozen=True)
class Sizes:
    kv_heads: int = 2
    chunk: int = 48
    start: int = 80  # the prefix's length
    grad_from: int = 30  # the taps cover [grad_from, start)


OUTPUTS = ("out", "dq", "dk", "dv", "dtap_k", "dtap_v")


def inputs(case: Case, sizes: Sizes, store: mx.Dtype, up: bool = False) -> dict:
    """One chunk's attention inputs, seeded; `up`: their float32 copies (the reference's);
    `store`: the store's dtype, Q8.dtype for the 8-bit store (the reference's prefix then holds
    its dequantized values)."""
    rng = np.random.default_rng(0)
    hkv, n, start = sizes.kv_heads, sizes.chunk, sizes.start
    dtype = mx.float32 if up else case.dtype

    def normal(*shape):
        x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(case.dtype)
        return x.astype(dtype)

    d = case.head_dim
    q = normal(1, hkv * case.gqa, n, d)
    k, v, d_out = normal(1, hkv, n, d), normal(1, hkv, n, d), normal(*q.shape)
    keys, values = normal(1, hkv, start + n, d), normal(1, hkv, start + n, d)
    prefix = Prefix(_store(keys, values, store, case.dtype, up), 0, start, dtype)
    return {
        "q": q,
        "k": k,
        "v": v,
        "prefix": prefix,
        "grad_from": sizes.grad_from,
        "scale": case.head_dim**-0.5,
        "d_out": d_out,
    }


def through(path: str, x: dict) -> dict:
    """Every output of the attention and its VJP through `path` ("kernel" or "twin")."""
    impl = kernel if path == "kernel" else twin
    args = (x["q"], x["k"], x["v"], x["prefix"], x["grad_from"], x["scale"], twin.TILE)
    out, lse = impl.forward(*args)
    grads = impl.backward(*args, out, lse, x["d_out"])
    return dict(zip(OUTPUTS, [out, *grads]))


def run(case: Case, sizes: Sizes, store: mx.Dtype, path: str, up: bool = False) -> dict:
    return through(path, inputs(case, sizes, store, up))


def errors(case: Case, sizes: Sizes = Sizes(), store: mx.Dtype | None = None) -> dict:
    """{output: (the kernel's error, the twin's error)}, both against the float32 twin on the
    same inputs (the twin's own error is 0 in float32)."""
    store = store or case.dtype
    ref = run(case, sizes, store, "twin", up=True)
    got = run(case, sizes, store, "kernel")
    own = run(case, sizes, store, "twin")
    return {k: (relative_error(got[k], ref[k]), relative_error(own[k], ref[k])) for k in ref}


def kernel_vs_twin(case: Case) -> dict[str, float]:
    """The self-check: the kernels against the twin on a small case, in the case's dtype."""
    store = case.store or case.dtype  # the instantiation the walk will call
    got = run(case, Sizes(), store, "kernel")
    want = run(case, Sizes(), store, "twin")
    e = {k: relative_error(got[k], want[k]) for k in want}
    return {
        "attention/forward": e["out"],
        "attention/dq": e["dq"],
        "attention/dkdv": max(e["dk"], e["dv"], e["dtap_k"], e["dtap_v"]),
    }


def race(case: Case, size: tuple[int, int]) -> tuple[float, float]:
    """Seconds for one chunk's attention forward and backward, kernel then twin (the median of
    three after a warm-up): `size[0]` queries over a prefix of `size[1]`, every key tapped, the
    prefix in the store's dtype, as the walk calls it (the instantiation timed is the one run)."""
    store = case.store or case.dtype
    x = inputs(case, Sizes(chunk=size[0], start=size[1], grad_from=0), store)
    mx.eval(x["q"], x["k"], x["v"], x["d_out"], x["prefix"].store.keys, x["prefix"].store.values)
    kernel_s, twin_s = (
        routing.seconds(lambda p=p: mx.eval(list(through(p, x).values())))
        for p in ("kernel", "twin")
    )
    return kernel_s, twin_s
