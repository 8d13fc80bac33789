"""The gated delta rule on the chunked CUDA kernels (metal_kernels/delta/*.cu), driven by torch.

Design. MLX runs these kernels through `mx.fast.cuda_kernel`; here torch compiles the same text
with NVRTC at run time and launches it on torch's current stream (nvrtc.py, shared with the
attention kernels' driver). Everything but the launch is shared with the MLX side, without
importing MLX: the kernels' specs, the sizes, each launch's grid, block, template, dynamic shared
memory, params and output shapes (metal_kernels/delta/pipeline.py, from blocks.py's CUDA table),
and the kernel text (nvrtc.unit: the same `mlx::core::cu` kernel, its headers mma.cuh and
tiles.cuh). A compiled kernel is cached per (kernel, template, input dtypes, device).
`forward` and `backward` are chunked.py's, buffer for buffer (prepare, states, output; the
backward recomputes prepare and states, then states_back, grads, prepare_back); `run` launches a
call and can be replaced (the tests run the CUDA bodies on the CPU emulator through it).

Routing (`gated_delta`, what recurrent.py's mlxwalk route calls): on CUDA, for shapes and dtypes
the kernels take (pipeline.takes: dk = dv in blocks.CUDA_DIMS, value heads a multiple of key heads,
q, k, v of one floating dtype; v is taken in q's dtype, as the ops compute it), the kernels run
after a one-time self-check per (dk, dtype, device) against delta.gated_delta_chunked: forward,
final state and all six gradients on a small random case, relative L2 within TOLERANCE (float32
with TF32 off). A failure (NVRTC missing, a compile error, a mismatch) prints one line naming the
kernel and the reason, and the torch ops serve the rest of the process. MLXWALK_KERNELS (the MLX
side's switch): auto (default) and check as said, off: the ops always, on: a failure raises.
On the CPU nothing changes: the ops run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from metal_kernels.delta import pipeline
from metal_kernels.sources import dtype_name

from . import delta, nvrtc
from .nvrtc import (  # noqa: F401 (the tests and scripts read them here)
    MODES,
    PRELUDE,
    KernelFailure,
    compile_unit,
    current_context,
    include_dirs,
    mode,
    relative_error,
)

# Relative L2 of each output against the ops, per routed dtype: float32 computes as the ops do
# (in another order); the half paths round y and the gradients to the dtype (the MLX side's).
TOLERANCE = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 4e-2}
# Which kernel writes each compared output last: a mismatch is named by it.
WRITER = {
    "y": "output",
    "final state": "states",
    "dq": "grads",
    "dk": "prepare_back",
    "dv": "prepare_back",
    "dlog_g": "prepare_back",
    "dbeta": "prepare_back",
    "dstate": "states_back",
}
Runner = Callable[[pipeline.Call, list[torch.Tensor]], list[torch.Tensor]]

_compiled: dict[tuple, object] = {}
_params: dict[tuple, torch.Tensor] = {}
GATE = nvrtc.Gate("the delta rule", "the torch ops")  # cases (dk, dtype, device)


def unit(call: pipeline.Call, input_dtypes: list) -> str:
    """The NVRTC translation unit of a call: PRELUDE, then cuda_source's rendering (the kernel's
    headers and its `mlx::core::cu` function, named as the spec), inputs then params (int32)."""
    return nvrtc.unit(call.spec, [*input_dtypes, "int32"], len(call.output_shapes), call.template)


def kernel(call: pipeline.Call, input_dtypes: list, device: torch.device):
    """The compiled kernel for a call, cached per (kernel, template, input dtypes, device)."""
    names = tuple(dtype_name(d) for d in input_dtypes)
    template = tuple((k, dtype_name(v) if k == "T" else v) for k, v in call.template)
    key = (call.spec.name, template, names, device.index)
    return nvrtc.cached(
        _compiled,
        key,
        call.spec,
        lambda: unit(call, list(names)),
        device,
        call.shared_memory,
        compile_unit,  # (this module's name: the tests replace it)
    )


def cuda_run(call: pipeline.Call, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Launch a call on the inputs' device: float32 outputs of the call's shapes (uninitialised,
    as MLX's), params appended as an int32 buffer, the grid in blocks (the call's in threads)."""
    device = inputs[0].device
    fn = kernel(call, [x.dtype for x in inputs], device)
    key = (tuple(call.params), device.index)
    if key not in _params:
        _params[key] = torch.tensor(call.params, dtype=torch.int32, device=device)
    outs = [torch.empty(s, dtype=torch.float32, device=device) for s in call.output_shapes]
    args = [*inputs, _params[key], *outs]
    nvrtc.launch(fn, call.grid, call.threadgroup, args, call.shared_memory, device)
    return outs


def _call(kernel: str, s: pipeline.Sizes, dtype, keep: bool = True, key_blocks=None):
    return pipeline.call(kernel, s, dtype_name(dtype), "cuda", keep, key_blocks)


def _checked(q, k, v, log_g, beta, state) -> tuple[pipeline.Sizes, list[torch.Tensor]]:
    s = pipeline.Sizes.of(q, v)
    if not (k.dtype == v.dtype == q.dtype and dtype_name(q.dtype) in pipeline.FLOATS):
        raise ValueError(f"q, k, v must share a floating dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    if s.value_heads % s.key_heads or k.shape != q.shape or s.dk != s.dv:
        raise ValueError(
            f"shapes the kernels do not take: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    floats = [x.float().contiguous() for x in (log_g, beta, state)]
    return s, [q.contiguous(), k.contiguous(), v.contiguous(), *floats]


def forward(q, k, v, log_g, beta, state, run: Runner = cuda_run):
    """(y, final_state): y (B, L, HV, DV) in q's dtype, the final state (B, HV, DV, DK) float32,
    as chunked.forward: prepare (without T), states, output."""
    s, (q, k, v, log_g, beta, state) = _checked(q, k, v, log_g, beta, state)
    t = q.dtype
    cum, w, u, _ = run(_call("prepare", s, t, keep=False), [k, v, log_g, beta])
    h, v_new, final = run(_call("states", s, t), [k, w, u, cum, state])
    (y,) = run(_call("output", s, t), [q, k, cum, h, v_new])
    return y.to(q.dtype), final


def backward(q, k, v, log_g, beta, state, dy, dstate, run: Runner = cuda_run):
    """(dq, dk, dv, dlog_g, dbeta, dstate), each in its input's dtype, as chunked.backward:
    prepare (with T) and states recomputed, then states_back, grads, prepare_back."""
    dtypes = [x.dtype for x in (q, k, v, log_g, beta, state)]
    s, (q, k, v, log_g, beta, state) = _checked(q, k, v, log_g, beta, state)
    t = q.dtype
    dy, dstate = dy.to(t).contiguous(), dstate.float().contiguous()
    cum, w, u, tri = run(_call("prepare", s, t, keep=True), [k, v, log_g, beta])
    h, v_new, _ = run(_call("states", s, t), [k, w, u, cum, state])
    dh, dv_new, d_state = run(_call("states_back", s, t), [q, k, w, cum, dy, dstate])
    dq, dk, dw, dcum = run(_call("grads", s, t), [q, k, cum, h, v_new, dh, dv_new, dy])
    dk, dv, dlog_g, dbeta = run(
        _call("prepare_back", s, t, key_blocks=dcum.shape[2]),
        [k, v, beta, cum, tri, dw, dv_new, dk, dcum],
    )
    grads = (dq, dk, dv, dlog_g, dbeta, d_state)
    return tuple(g.to(dt) for g, dt in zip(grads, dtypes))


class _Kernels(torch.autograd.Function):
    """The kernels' forward, and their backward from the inputs alone (nothing else kept)."""

    @staticmethod
    def forward(ctx, q, k, v, log_g, beta, state, run):
        ctx.save_for_backward(q, k, v, log_g, beta, state)
        ctx.run = run
        return forward(q, k, v, log_g, beta, state, run)

    @staticmethod
    def backward(ctx, dy, dstate):
        return (*backward(*ctx.saved_tensors, dy, dstate, ctx.run), None)


def kernels_op(q, k, v, log_g, beta, state, run: Runner = cuda_run):
    """The gated delta rule on the kernels, differentiable; (y, final state)."""
    return _Kernels.apply(q, k, v, log_g, beta, state, run)


def layer(dtype: torch.dtype, hk: int, hv: int, dim: int, t: int, device, seed: int = 0):
    """A gated delta-net layer's inputs (q, k unit rows, q scaled by dim^-1/2, as a Qwen3.5 layer
    feeds them; a non-zero state) and cotangents, seeded; q, k, v and dy in `dtype`."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def normal(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device)

    q = torch.nn.functional.normalize(normal(1, t, hk, dim), dim=-1) * dim**-0.5
    k = torch.nn.functional.normalize(normal(1, t, hk, dim), dim=-1)
    v = normal(1, t, hv, dim)
    log_g = -(0.001 + 0.7 * torch.rand(1, t, hv, generator=g)).to(device)
    beta = torch.sigmoid(normal(1, t, hv))
    state = normal(1, hv, dim, dim, scale=0.3)
    x = [q.to(dtype), k.to(dtype), v.to(dtype), log_g, beta, state]
    return x, [normal(1, t, hv, dim).to(dtype), normal(1, hv, dim, dim)]


def through(fn, x: list[torch.Tensor], cots: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """y, the final state and the six gradients of `fn` at x for cotangents `cots`."""
    x = [a.detach().clone().requires_grad_() for a in x]
    y, s = fn(*x)
    grads = torch.autograd.grad((y, s), x, cots)
    names = ("y", "final state", "dq", "dk", "dv", "dlog_g", "dbeta", "dstate")
    return dict(zip(names, (y, s, *grads)))


def compare(dtype, dim: int, device, run: Runner = cuda_run, t: int = 150) -> dict[str, float]:
    """Each output's relative error, kernels against delta.gated_delta_chunked (float32 on the
    same inputs), on two chunks and a part, 2 key and 4 value heads; TF32 off."""
    x, cots = layer(dtype, 2, 4, dim, t, device)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        got = through(lambda *a: kernels_op(*a, run=run), x, cots)
        up = [a.float() for a in x]
        want = through(delta.gated_delta_chunked, up, [c.float() for c in cots])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return {name: relative_error(got[name], want[name]) for name in got}


def self_check(dtype, dim: int, device, run: Runner = cuda_run) -> str | None:
    """Why the kernels cannot serve (dim, dtype) on `device`, naming the kernel (None: they can)."""
    try:
        with torch.enable_grad():  # (the walk's decode asks first, under no_grad)
            errors = compare(dtype, dim, device, run)
    except KernelFailure as e:
        return str(e)
    except Exception as e:  # a launch failure, NVRTC missing: the ops still work
        return f"delta/chunked: failed to run ({nvrtc.first_error(e)})"
    worst = max(errors, key=errors.get)
    limit = TOLERANCE[dtype_name(dtype)]
    if not errors[worst] <= limit:  # (NaN fails)
        return (
            f"delta/{WRITER[worst]}: {worst} disagrees with the ops "
            f"(relative error {errors[worst]:.1e} > {limit:.0e})"
        )
    return None


def on_cuda(x: torch.Tensor) -> bool:
    """Whether the kernels could run where `x` is (the tests route CPU tensors through it)."""
    return x.is_cuda


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this call runs on the kernels: CUDA, shapes and dtypes they take, the switch not
    off, and its case's self-check passed (run here the first time)."""
    if mode() == "off" or not on_cuda(q) or GATE.failed is not None:
        return False
    if not pipeline.takes(q.shape, k.shape, v.shape, (q.dtype, k.dtype, v.dtype), "cuda"):
        return False
    case = (q.shape[-1], dtype_name(q.dtype), q.device.index)
    where = f"(CUDA, dk {case[0]}, {case[1]})"
    return GATE.admits(case, where, lambda: self_check(q.dtype, q.shape[-1], q.device))


def gated_delta(q, k, v, log_g, beta, state):
    """The gated delta rule, routed: the kernels where `usable`, else delta.gated_delta (the
    torch ops, recomputing backward); (y in q's dtype, final state float32). v goes to the
    kernels in q's dtype: the ops compute in float32 whatever v's dtype."""
    if on_cuda(q) and mode() != "off" and GATE.failed is None:
        vq = v.to(q.dtype)
        if usable(q, k, vq):
            return kernels_op(q, k, vq, log_g, beta, state)
    return delta.gated_delta(q, k, v, log_g, beta, state)
