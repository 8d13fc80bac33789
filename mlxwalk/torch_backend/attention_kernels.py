"""Chunk attention on the project's tensor-core CUDA kernels (metal_kernels/attention/*_tc.cu),
driven by torch: FlashAttention-2's forward, dQ and dK/dV passes, compiled by NVRTC and launched
on torch's stream (nvrtc.py), with the launches MLX makes (metal_kernels/attention/tc_calls.py).

Contract (walk_attention's): query (B, H, q, D), key and value (B, Hkv, S, D), S >= q, float16 or
bfloat16 alike, lower-right causal (query i sees keys up to S - q + i); (B, q, H, D) in query's
dtype. Onto the kernels' contract: the chunk's own k, v are the last q rows of key and value
(copied: the kernels take them contiguous), and the whole of key and value is the store, read in
place, start = S - q: the kernels read only its rows [0, start). The forward keeps the output and
the log-sum-exp (B, H, q) float32; the backward passes delta = rowsum(dO * O) (float32, from the
output in query's dtype, as the MLX side) and grad_from = 0, so dkdv's rows are the prefix's then
the chunk's own: dK and dV of key and value, row for row.

Routing (`usable`, what attention.py calls where its table routes to "kernels", or under
MLXWALK_KERNELS=on or check): on CUDA, for shapes the kernels take (`takes`), after a one-time
self-check per (head dim, dtype, device) against SDPA's math path in float32 (output and the
three gradients, relative L2 within TOLERANCE, on a small case with a prefix and grouped heads).
A failure prints one line naming the kernel and the route stays off for the process; under
MLXWALK_KERNELS=on it raises instead; off: never the kernels. `run` launches a call and can be
replaced (the tests run the CUDA bodies on the CPU emulator through it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from metal_kernels.attention import blocks, tc_calls
from metal_kernels.sources import dtype_name

from . import nvrtc
from .nvrtc import KernelFailure, compile_unit, mode, relative_error

HALVES = (torch.float16, torch.bfloat16)
# Relative L2 against float32 math (seen on the emulator: 2.4e-3 bfloat16, 3.4e-4 float16, 6x and
# 10x below these): the kernels round P and dS to the dtype before their second
# products (the MLX side's bars); a wrong kernel is off by order one.
TOLERANCE = {"float16": 4e-3, "bfloat16": 1.5e-2}
WRITER = {"out": "forward_tc", "dq": "dq_tc", "dk": "dkdv_tc", "dv": "dkdv_tc"}
Runner = Callable[[tc_calls.Call, list[torch.Tensor]], list[torch.Tensor]]

_compiled: dict[tuple, object] = {}
GATE = nvrtc.Gate("attention", "SDPA")  # cases (head dim, dtype, device)


def unit(call: tc_calls.Call, input_dtypes: list) -> str:
    """The NVRTC unit of a call: inputs, then params (int32) and scale (float32)."""
    dtypes = [*map(dtype_name, input_dtypes), "int32", "float32"]
    return nvrtc.unit(call.spec, dtypes, len(call.output_shapes), call.template)


def kernel(call: tc_calls.Call, input_dtypes: list, device: torch.device):
    """The compiled kernel for a call, cached per (kernel, template, input dtypes, device)."""
    names = tuple(dtype_name(d) for d in input_dtypes)
    key = (call.spec.name, tuple(call.template), names, device.index)
    source = lambda: unit(call, list(names))  # noqa: E731
    return nvrtc.cached(_compiled, key, call.spec, source, device, call.shared_memory, compile_unit)


def cuda_run(call: tc_calls.Call, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Launch a call on the inputs' device: params and scale appended, float32 outputs."""
    device = inputs[0].device
    fn = kernel(call, [x.dtype for x in inputs], device)
    params = torch.tensor(call.params, dtype=torch.int32, device=device)
    scale = torch.tensor([call.scale], dtype=torch.float32, device=device)
    outs = [torch.empty(s, dtype=torch.float32, device=device) for s in call.output_shapes]
    args = [*inputs, params, scale, *outs]
    nvrtc.launch(fn, call.grid, call.threadgroup, args, call.shared_memory, device)
    return outs


def takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """The shapes and dtypes the kernels take: one half dtype, a head dim of blocks.CUDA,
    query heads a multiple of K/V heads, S >= q, one batch."""
    b, h, n, dim = query.shape
    return (
        query.dtype in HALVES
        and key.dtype == value.dtype == query.dtype
        and dim in blocks.CUDA_DIMS
        and key.shape == value.shape
        and key.shape[0] == b
        and key.shape[-1] == dim
        and h % key.shape[1] == 0
        and key.shape[2] >= n
    )


def _parts(query, key, value):
    """(q, the chunk's own k and v, the store key and value, start), contiguous."""
    start = key.shape[2] - query.shape[2]
    own = [x[:, :, start:].contiguous() for x in (key, value)]  # (B, Hkv, q, D)
    return query.contiguous(), *own, key.contiguous(), value.contiguous(), start


def _names(q, pk) -> tuple[str, str]:
    """The template's T and S: the queries' dtype and the store's, by name."""
    return dtype_name(q.dtype), dtype_name(pk.dtype)


def _store(q, k, v, pk, pv) -> list:
    """The kernels' inputs up to the store's (tc_calls.STORE): a float store, passed again in the
    place of the scales and biases of an 8-bit one (template G = 0; this route takes no 8-bit
    store: the torch walk refuses a q8 cache)."""
    return [q, k, v, pk, pv, pk, pk, pv, pv]


def forward(query, key, value, scale: float, run: Runner = cuda_run):
    """(out (B, H, q, D) float32, lse (B, H, q) float32)."""
    q, k, v, pk, pv, start = _parts(query, key, value)
    s = tc_calls.Sizes.of(q.shape, k.shape, pk.shape, start, start)
    out, lse = run(tc_calls.forward_call(s, *_names(q, pk), scale), _store(q, k, v, pk, pv))
    return out, lse


def backward(query, key, value, scale: float, out, lse, d_out, run: Runner = cuda_run):
    """(dq (B, H, q, D), dk, dv (B, Hkv, S, D)), float32; `out` in query's dtype, `d_out`
    (B, H, q, D)."""
    q, k, v, pk, pv, start = _parts(query, key, value)
    d_out = d_out.to(q.dtype).contiguous()
    delta = (d_out.float() * out.float()).sum(-1)  # (B, H, q)
    s = tc_calls.Sizes.of(q.shape, k.shape, pk.shape, start, 0)
    dq_call, dkdv_call = tc_calls.backward_calls(s, *_names(q, pk), scale)
    inputs = _store(q, k, v, pk, pv) + [d_out, lse, delta]
    (dq,) = run(dq_call, inputs)
    dk, dv = run(dkdv_call, inputs)
    rows = key.shape[2]  # the prefix's rows, then the chunk's own
    return dq, dk[:, :, :rows], dv[:, :, :rows]


class _Kernels(torch.autograd.Function):
    """The kernels' forward (out, lse kept) and backward."""

    @staticmethod
    def forward(ctx, query, key, value, scale, run):
        out, lse = forward(query, key, value, scale, run)
        out = out.to(query.dtype)  # (B, H, q, D)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale, ctx.run = scale, run
        return out.transpose(1, 2).contiguous()  # (B, q, H, D)

    @staticmethod
    def backward(ctx, d_out):
        query, key, value, out, lse = ctx.saved_tensors
        d = d_out.transpose(1, 2)  # (B, H, q, D)
        dq, dk, dv = backward(query, key, value, ctx.scale, out, lse, d, ctx.run)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None


def attention(query, key, value, scale: float | None = None, run: Runner = cuda_run):
    """Lower-right causal attention on the kernels, differentiable: (B, q, H, D)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _Kernels.apply(query, key, value, scale, run)


def reference(query, key, value, scale: float | None = None) -> torch.Tensor:
    """The same on SDPA's math path: (B, q, H, D) in query's dtype (K/V repeated per group)."""
    groups = query.shape[1] // key.shape[1]
    key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))  # (B, H, S, D)
    mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
    mask = mask.tril(key.shape[2] - query.shape[2])  # lower-right causal
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def case(dtype, dim: int, device, n: int = 40, prefix: int = 70, heads=(4, 2), seed: int = 0):
    """(query, key, value, cotangent) of a small case, seeded: n queries over prefix + n keys."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, hkv = heads
    x = [torch.randn(1, h, n, dim, generator=g)]
    x += [torch.randn(1, hkv, prefix + n, dim, generator=g) for _ in range(2)]
    x.append(torch.randn(1, n, h, dim, generator=g))
    return [a.to(device=device, dtype=dtype) for a in x]


def compare(dtype, dim: int, device, run: Runner = cuda_run, **sizes) -> dict[str, float]:
    """Relative errors of out, dq, dk, dv: the kernels against the math path in float32 on the
    same (rounded) inputs."""
    query, key, value, cot = case(dtype, dim, device, **sizes)
    got, want = {}, {}
    for fn, into, t in ((lambda *a: attention(*a, run=run), got, dtype), (reference, want, None)):
        x = [a.detach().to(t or torch.float32).requires_grad_() for a in (query, key, value)]
        out = fn(*x)
        grads = torch.autograd.grad(out, x, cot.to(out.dtype))
        into.update(zip(("out", "dq", "dk", "dv"), (out, *grads)))
    return {name: relative_error(got[name], want[name]) for name in got}


def self_check(dtype, dim: int, device, run: Runner = cuda_run) -> str | None:
    """Why the kernels cannot serve (dim, dtype) on `device`, naming the kernel (None: they can)."""
    try:
        with torch.enable_grad():  # (the walk's decode asks first, under no_grad)
            errors = compare(dtype, dim, device, run)
    except KernelFailure as e:
        return str(e)
    except Exception as e:  # a launch failure, NVRTC missing: SDPA still works
        return f"attention/forward_tc: failed to run ({nvrtc.first_error(e)})"
    worst = max(errors, key=errors.get)
    limit = TOLERANCE[dtype_name(dtype)]
    if not errors[worst] <= limit:  # (NaN fails)
        return (
            f"attention/{WRITER[worst]}: {worst} disagrees with SDPA's math "
            f"(relative error {errors[worst]:.1e} > {limit:.0e})"
        )
    return None


def on_cuda(x: torch.Tensor) -> bool:
    """Whether the kernels could run where `x` is (the tests route CPU tensors through it)."""
    return x.is_cuda


def usable(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether this call can run on the kernels: CUDA, shapes they take, the switch not off, and
    its case's self-check passed (run here the first time)."""
    if mode() == "off" or not on_cuda(query) or GATE.failed is not None:
        return False
    if not takes(query, key, value):
        return False
    case_ = (query.shape[-1], dtype_name(query.dtype), query.device.index)
    where = f"(CUDA, head dim {case_[0]}, {case_[1]})"
    return GATE.admits(case_, where, lambda: self_check(query.dtype, query.shape[-1], query.device))
