"""Which gated delta rule and which causal convolution a transformers hybrid (Qwen3.5,
Qwen3-Next) runs under the torch walk.

transformers' gated delta-net layers call their modeling module's `torch_chunk_gated_delta_rule`
(flash-linear-attention's `chunk_gated_delta_rule` when that package imports, else a torch
reference that keeps every chunk's intermediates for the backward), and for a one-position chunk
with a state `torch_recurrent_gated_delta_rule`. `route` points those names (for every model of
that family in the process: they are the modeling module's) at one of:
  mlxwalk       mlxwalk's chunked torch op (delta.py): a recomputing backward, float32 state;
                on CUDA the chunked CUDA kernels where they take the shapes and pass their
                self-check (delta_kernels.py; MLXWALK_KERNELS=off keeps the ops)
  fla           flash-linear-attention's Triton kernels, when installed, not refused by this
                GPU and Triton (`fla_refusal`), and its self-check (forward and backward
                against mlxwalk's op on a small case, on this device) passes; otherwise the
                route falls back to mlxwalk's op and says why
  transformers  whatever transformers chose, untouched
The layer's own code is unchanged: it hands (B, T, heads, dim) inputs, the decay in log space,
and a state of (B, value heads, key dim, value dim).

The convolution ahead of the rule: the layers call their module's `causal_conv1d_forward`, which
reads the conv state from the cache and calls the module's `causal_conv1d_fn` (a chunk) or
`causal_conv1d_update` (one cached token, in place). transformers binds both, at import, to the
causal-conv1d package's kernels on CUDA where the package imports, else to a depthwise conv and
silu in torch. Module globals are what the layers read (with the `kernels` package installed,
transformers' own wrappers there dispatch to per-layer copies of themselves; a name bound to
another function is called as it is). `route_conv` points `causal_conv1d_fn` at one of:
  causal-conv1d  the package's kernel, when it imports and its self-check (forward and backward
                 against the torch conv on a small case, on this device) passes; otherwise the
                 torch conv, said in one line
  torch          the depthwise conv and silu in torch, the layer's nn.Conv1d weights as they are
  auto           causal-conv1d where it works, else torch (silent where it is not installed)
`causal_conv1d_update` always runs in torch: the package's has no backward, and the walk never
calls it (its cache keeps one-position chunks on `update_conv_state`); only decoding reaches it.
"""

from __future__ import annotations

import re
import sys

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import delta_kernels

ROUTES = ("mlxwalk", "fla", "transformers")
CONV_ROUTES = ("auto", "causal-conv1d", "torch")
FLA_HOPPER_TRITON = "3.7.1"  # the first Triton under which fla's backward runs on compute 9.x
_NAME = "torch_chunk_gated_delta_rule"
_ONE = "torch_recurrent_gated_delta_rule"  # what the layers call for a one-position chunk
_original: dict[str, object] = {}  # module -> transformers' own rule
_checked: dict[str, str | None] = {}  # device type -> why fla cannot run there (None: it can)
_conv_checked: dict[str, str | None] = {}  # device type -> why causal-conv1d cannot run there
_said: set[str] = set()  # the lines already said on stderr


def _say(line: str) -> None:
    """One line on stderr, once per process."""
    if line not in _said:
        _said.add(line)
        print(f"mlxwalk: {line}", file=sys.stderr)


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative error (Frobenius) over pairs of tensors."""
    pairs = [(a.detach(), b.detach()) for a, b in zip(got, want)]
    return max(float((a - b).norm() / (b.norm() + 1e-30)) for a, b in pairs)


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


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


def _version(text: str) -> tuple[int, ...]:
    """A release's leading numbers: "3.6.0+git1a2b" -> (3, 6, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def _older(version: str, than: str) -> bool:
    """version < than: as PEP 440 versions where packaging reads them, else leading numbers."""
    try:
        from packaging.version import Version

        return Version(version) < Version(than)
    except (ImportError, ValueError):  # no packaging, or a version it cannot read
        return _version(version) < _version(than)


def fla_refusal(capability: tuple[int, int], triton_version: str) -> str | None:
    """Why flash-linear-attention's backward refuses this GPU under this Triton (None: it does
    not): on Hopper (compute capability 9.x) it needs Triton FLA_HOPPER_TRITON or later."""
    major, minor = capability
    if major != 9 or not _older(triton_version, FLA_HOPPER_TRITON):
        return None
    return (
        f"flash-linear-attention's backward refuses compute capability {major}.{minor} under "
        f"Triton {triton_version} (it needs Triton {FLA_HOPPER_TRITON} or later there)"
    )


def _gpu_refusal(device: torch.device) -> str | None:
    """fla_refusal for a CUDA device, from torch and the installed Triton."""
    if device.type != "cuda":
        return None
    try:
        import triton
    except ImportError:
        return None  # fla's own import says what is missing
    return fla_refusal(torch.cuda.get_device_capability(device), triton.__version__)


def fla_problem(device: torch.device) -> str | None:
    """Why flash-linear-attention cannot serve the walk on `device` (None: it can): not
    installed, refused by this GPU and Triton (`fla_refusal`, known before any kernel runs), or
    its forward and backward disagree with mlxwalk's op on a small case."""
    if device.type in _checked:
        return _checked[device.type]
    why = None
    try:
        import fla  # noqa: F401

        if (why := _gpu_refusal(device)) is not None:
            _checked[device.type] = why
            return why

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
        worst = _worst(*outs)
        if worst > 1e-3:
            why = f"it disagrees with mlxwalk's op (relative error {worst:.1e})"
    except ImportError:
        why = "flash-linear-attention is not installed"
    except Exception as e:  # a kernel that refuses this GPU or this Triton
        why = _first_line(e)
    _checked[device.type] = why
    return why


def _activated(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ConfigError(f"the causal convolution's activation {activation!r} is not silu")


def torch_conv(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` contract in torch: x (B, C, T), weight (C, K), bias (C,)
    -> (B, C, T) in x's dtype; position t sees t-K+1..t (zeros before the start)."""
    if seq_idx is not None:
        raise ConfigError("packed sequences (seq_idx) need the causal-conv1d route")
    k = weight.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (k - 1, 0))  # (B, C, K-1+T)
    y = F.conv1d(x, weight.unsqueeze(1), bias, groups=weight.shape[0])  # (B, C, T)
    return _activated(y, activation).to(hidden_states.dtype)


def torch_conv_update(
    hidden_states: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' `causal_conv1d_update` contract in torch: x (B, C, T) after the state
    (B, C, S), S >= K-1; the state takes the last S inputs in place."""
    t, k = hidden_states.shape[-1], weight.shape[-1]
    full = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)  # (B, C, S+T)
    conv_state.copy_(full[..., -conv_state.shape[-1] :])
    y = F.conv1d(full[..., -(k - 1 + t) :], weight.unsqueeze(1), bias, groups=weight.shape[0])
    return _activated(y, activation).to(hidden_states.dtype)


def package_conv(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    seq_idx: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """torch_conv's contract over the causal-conv1d package's kernel."""
    from causal_conv1d import causal_conv1d_fn

    packed = {} if seq_idx is None else {"seq_idx": seq_idx}
    x = hidden_states.to(weight.dtype)
    y = causal_conv1d_fn(x, weight, bias, activation=activation, **packed)
    return y.to(hidden_states.dtype)


def conv_problem(device: torch.device) -> str | None:
    """Why the causal-conv1d package cannot serve the walk on `device` (None: it can): not
    installed, failing, or its forward and backward disagree with the torch conv."""
    if device.type in _conv_checked:
        return _conv_checked[device.type]
    why = None
    try:
        import causal_conv1d  # noqa: F401

        gen = torch.Generator().manual_seed(0)
        # (B, C, T) with channels innermost in memory, as the layer hands it over
        x = torch.randn(2, 100, 64, generator=gen).to(device).transpose(1, 2)
        w = 0.5 * torch.randn(64, 4, generator=gen).to(device)
        cot = torch.randn(2, 64, 100, generator=gen).to(device)
        outs = []
        for conv in (package_conv, torch_conv):
            xs, ws = x.detach().clone().requires_grad_(), w.clone().requires_grad_()
            y = conv(xs, ws, None, activation="silu")
            (y * cot).sum().backward()
            outs.append([y, xs.grad, ws.grad])
        worst = _worst(*outs)
        if worst > 1e-4:
            why = f"causal-conv1d disagrees with the torch conv (relative error {worst:.1e})"
    except ModuleNotFoundError as e:  # the package, or something it needs
        missing = (e.name or "").startswith("causal_conv1d")
        why = "causal-conv1d is not installed" if missing else f"causal-conv1d: {_first_line(e)}"
    except Exception as e:  # a build for another GPU or torch, a refused layout
        why = f"causal-conv1d: {_first_line(e)}"
    _conv_checked[device.type] = why
    return why


def _layer_modules(model) -> set[str]:
    """The modeling modules of the model's gated delta-net layers."""
    return {type(m).__module__ for m in model.modules() if hasattr(m, "A_log")}


def route_conv(model, how: str = "auto") -> str:
    """Point the model's gated delta-net layers at a causal convolution; returns the route
    taken ("causal-conv1d" or "torch"; "none" for a model without such layers)."""
    if how not in CONV_ROUTES:
        raise ConfigError(f"conv route {how!r} is unknown; choose one of {', '.join(CONV_ROUTES)}")
    modules = [sys.modules[n] for n in _layer_modules(model)]
    modules = [m for m in modules if hasattr(m, "causal_conv1d_fn")]
    if not modules:
        return "none"
    if how != "torch":
        why = conv_problem(next(model.parameters()).device)
        quiet = how == "auto" and why == "causal-conv1d is not installed"
        if why is not None and not quiet:
            _say(f"the causal convolution runs in torch: {why}")
        how = "torch" if why is not None else "causal-conv1d"
    for m in modules:
        m.causal_conv1d_fn = package_conv if how == "causal-conv1d" else torch_conv
        m.causal_conv1d_update = torch_conv_update
    return how


def route(model, how: str = "mlxwalk", conv: str | None = "auto") -> str:
    """Point the model's gated delta-net layers at a rule, and (unless `conv` is None) at a
    causal convolution through `route_conv`; returns the delta rule's route taken."""
    if how not in ROUTES:
        raise ValueError(f"delta rule route {how!r} is unknown; choose one of {', '.join(ROUTES)}")
    if conv is not None:
        route_conv(model, conv)
    modules = _layer_modules(model)
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
        _say(f"the delta rule runs on mlxwalk's torch op: {why}")
        how = "mlxwalk"
    rule = fla_rule if how == "fla" else mlxwalk_rule
    for name in modules:
        setattr(sys.modules[name], _NAME, rule)
        # one position: flash-linear-attention's fused recurrent kernel has no backward
        setattr(sys.modules[name], _ONE, mlxwalk_rule)
    return how
