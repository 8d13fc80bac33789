"""Which gated delta rule a transformers hybrid (Qwen3.5, Qwen3-Next) runs under the torch walk.

transformers' gated delta-net layers call their modeling module's `torch_chunk_gated_delta_rule`
(flash-linear-attention's `chunk_gated_delta_rule` when that package imports, else a torch
reference that keeps every chunk's intermediates for the backward), and for a one-position chunk
with a state `torch_recurrent_gated_delta_rule`. `route` points those names (for every model of
that family in the process: they are the modeling module's) at one of:
  mlxwalk       mlxwalk's chunked torch op (delta.py): a recomputing backward, float32 state;
                on CUDA the chunked CUDA kernels where they take the shapes and pass their
                self-check (delta_kernels.py; MLXWALK_KERNELS=off keeps the ops)
  fla           flash-linear-attention's Triton kernels, when installed and its self-check
                (forward and backward against mlxwalk's op on a small case, on this device)
                passes; otherwise the route falls back to mlxwalk's op and says why
  transformers  whatever transformers chose, untouched
The layer's own code is unchanged: it hands (B, T, heads, dim) inputs, the decay in log space,
and a state of (B, value heads, key dim, value dim).
"""

from __future__ import annotations

import sys

import torch

from . import delta_kernels

ROUTES = ("mlxwalk", "fla", "transformers")
_NAME = "torch_chunk_gated_delta_rule"
_ONE = "torch_recurrent_gated_delta_rule"  # what the layers call for a one-position chunk
_original: dict[str, object] = {}  # module -> transformers' own rule
_checked: dict[str, str | None] = {}  # device type -> why fla cannot run there (None: it can)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # as transformers' layers


def mlxwalk_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size: int = 64,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
):
    """transformers' contract over mlxwalk's op: q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g and
    beta (B, T, Hv); state (B, Hv, Dk, Dv). Returns (B, T, Hv, Dv) in v's dtype and the state."""
    q, k = query.float(), key.float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    b, _, _, dk = q.shape
    hv, dv = value.shape[-2:]
    if initial_state is None:
        state = q.new_zeros(b, hv, dv, dk)
    else:
        state = initial_state.float().transpose(-1, -2)  # (B, Hv, Dv, Dk), mlxwalk's layout
    y, s = delta_kernels.gated_delta(q, k, value, g.float(), beta.float(), state)
    return y.to(value.dtype), (s.transpose(-1, -2) if output_final_state else None)


def fla_rule(query, key, value, g, beta, chunk_size: int = 64, **kwargs):
    """transformers' contract (mlxwalk_rule's arguments) over flash-linear-attention's kernel,
    which takes the initial state, the final state's return and the l2 norm as they come."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    passed = ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
    given = {k: kwargs[k] for k in passed if k in kwargs}
    return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, **given)


def fla_problem(device: torch.device) -> str | None:
    """Why flash-linear-attention cannot serve the walk on `device` (None: it can): not
    installed, or its forward and backward disagree with mlxwalk's op on a small case."""
    if device.type in _checked:
        return _checked[device.type]
    why = None
    try:
        import fla  # noqa: F401

        gen = torch.Generator().manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen).to(device)

        xs = [
            rnd(1, 200, 2, 64),
            rnd(1, 200, 2, 64),
            rnd(1, 200, 4, 64),
            -torch.rand(1, 200, 4, generator=gen).to(device) * 0.5,
            torch.rand(1, 200, 4, generator=gen).to(device),
            0.1 * rnd(1, 4, 64, 64),
        ]
        outs = []
        for rule in (fla_rule, mlxwalk_rule):
            leaves = [x.clone().requires_grad_() for x in xs]
            y, s = rule(
                *leaves[:5],
                initial_state=leaves[5],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            (y.square().sum() + s.sum()).backward()
            outs.append([y, s] + [x.grad for x in leaves])
        worst = max(float((a - b).norm() / (b.norm() + 1e-30)) for a, b in zip(*outs))
        if worst > 1e-3:
            why = f"it disagrees with mlxwalk's op (relative error {worst:.1e})"
    except ImportError:
        why = "flash-linear-attention is not installed"
    except Exception as e:  # a kernel that refuses this GPU or this Triton
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    _checked[device.type] = why
    return why


def route(model, how: str = "mlxwalk") -> str:
    """Point the model's gated delta-net layers at a rule; returns the route taken."""
    if how not in ROUTES:
        raise ValueError(f"delta rule route {how!r} is unknown; choose one of {', '.join(ROUTES)}")
    modules = {type(m).__module__ for m in model.modules() if hasattr(m, "A_log")}
    for name in modules:
        _original.setdefault(name, getattr(sys.modules[name], _NAME))
        _original.setdefault(name + ":one", getattr(sys.modules[name], _ONE))
    if not modules:
        return "none"
    if how == "transformers":
        for name in modules:
            setattr(sys.modules[name], _NAME, _original[name])
            setattr(sys.modules[name], _ONE, _original[name + ":one"])
        return how
    device = next(model.parameters()).device
    if how == "fla" and (why := fla_problem(device)) is not None:
        print(f"mlxwalk: the delta rule runs on mlxwalk's torch op: {why}", file=sys.stderr)
        how = "mlxwalk"
    rule = fla_rule if how == "fla" else mlxwalk_rule
    for name in modules:
        setattr(sys.modules[name], _NAME, rule)
        # one position: flash-linear-attention's fused recurrent kernel has no backward
        setattr(sys.modules[name], _ONE, mlxwalk_rule)
    return how
