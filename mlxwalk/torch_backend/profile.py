"""Where a torch walk's time goes, by layer kind: torch's profiler over one call, each op's own
time (on the GPU: its kernels'; on the CPU: its own CPU time) charged to a kind.

Forward (the decode and each chunk's graph): an op belongs to the innermost labelled range it
ran in; `labelled` opens one per module of a kind (forward hooks) and one around the delta rule
and the causal convolution (their modeling-module functions, wrapped for the call). Backward:
autograd records each node's evaluation with the sequence number of the forward op that made
it, so a backward op is charged to the kind of that forward op. What falls in no range (the
embedding, the loss, the K/V store's copies and cotangent accumulators, the optimizer) is
"other"; kernels whose launching op the profiler could not name are "unlinked", so the kinds
sum to the kernels' total.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import record_function

from . import recurrent

TAG = "mlxwalk.kind:"
KINDS = ("attention", "delta-net", "delta rule", "conv", "mlp", "head", "other", "unlinked")


def kind_of(name: str, module: torch.nn.Module) -> str | None:
    """The layer kind a module's forward is charged to (None: its parent's)."""
    leaf = name.rsplit(".", 1)[-1]
    if hasattr(module, "A_log"):  # transformers' gated delta-net layers
        return "delta-net"
    if leaf == "conv1d":
        return "conv"
    if leaf in ("self_attn", "attn"):
        return "attention"
    if leaf == "mlp":
        return "mlp"
    if leaf == "lm_head":
        return "head"
    return None


@contextmanager
def labelled(model: torch.nn.Module) -> Iterator[None]:
    """Label the model's layer kinds (and its delta rule) for the profiler while inside."""
    handles = []
    for name, module in model.named_modules():
        kind = kind_of(name, module)
        if kind is None:
            continue
        ranges: list = []

        def enter(mod, args, kind=kind, ranges=ranges):
            ranges.append(record_function(TAG + kind).__enter__())

        def leave(mod, args, out, ranges=ranges):
            ranges.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    rules = _wrap_rules(model)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for module, name, rule in rules:
            setattr(module, name, rule)


# modeling-module functions the layers call by name, and the kind each is charged to
FUNCTIONS = {
    recurrent._NAME: "delta rule",
    recurrent._ONE: "delta rule",
    "causal_conv1d_forward": "conv",
    "causal_conv1d_fn": "conv",
}


def _wrap_rules(model: torch.nn.Module) -> list[tuple]:
    """Wrap the modeling modules' delta-rule and convolution functions in a labelled range."""
    names = {type(m).__module__ for m in model.modules() if hasattr(m, "A_log")}
    wrapped = []
    for name in names:
        module = sys.modules[name]
        for attr, kind in FUNCTIONS.items():
            if not hasattr(module, attr):
                continue
            rule = getattr(module, attr)

            def labelled_rule(*args, _rule=rule, _tag=TAG + kind, **kwargs):
                with record_function(_tag):
                    return _rule(*args, **kwargs)

            setattr(module, attr, labelled_rule)
            wrapped.append((module, attr, rule))
    return wrapped


@dataclass
class Profile:
    """Milliseconds per kind, forward and backward; `device`: what the times are of."""

    device: str
    forward: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    backward: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    kernels: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def total(self) -> float:
        return sum(self.forward.values()) + sum(self.backward.values())

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(kind, forward ms, backward ms, share of the total) for each kind that took time."""
        total = self.total or 1.0
        out = []
        for kind in KINDS:
            f, b = self.forward.get(kind, 0.0), self.backward.get(kind, 0.0)
            if f or b:
                out.append((kind, f, b, (f + b) / total))
        return out

    def table(self) -> str:
        fwd, bwd = sum(self.forward.values()), sum(self.backward.values())
        lines = [f"| kind ({self.device} time) | forward ms | backward ms | share |"]
        lines.append("|---|---:|---:|---:|")
        lines += [f"| {k} | {f:.1f} | {b:.1f} | {s:.1%} |" for k, f, b, s in self.rows()]
        lines.append(f"| all | {fwd:.1f} | {bwd:.1f} | |")
        return "\n".join(lines)


def _own_time(event, on_gpu: bool) -> float:
    """An event's own time in microseconds: its kernels' on the GPU, its CPU time elsewhere."""
    if on_gpu:
        return float(getattr(event, "self_device_time_total", 0) or 0)
    return float(event.self_cpu_time_total or 0)


def _enclosing(event) -> tuple[str | None, object]:
    """(innermost labelled kind, innermost autograd evaluation) among the event's ancestors."""
    kind, node, e = None, None, event
    while e is not None:
        if kind is None and e.name.startswith(TAG):
            kind = e.name.removeprefix(TAG)
        if node is None and e.name.startswith("autograd::engine::evaluate_function"):
            node = e
        e = e.cpu_parent
    return kind, node


def attribute(events, on_gpu: bool) -> Profile:
    """Charge each event's own time to a kind (the module docstring says how)."""
    prof = Profile("GPU kernel" if on_gpu else "CPU")
    made_by: dict[tuple[int, int], str] = {}  # (thread, sequence number) -> kind
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    for e in cpu:
        kind, node = _enclosing(e)
        if node is None and kind is not None and e.sequence_nr >= 0:
            made_by.setdefault((e.thread, e.sequence_nr), kind)
    for e in cpu:
        own = _own_time(e, on_gpu)
        if not own or e.name.startswith(TAG):
            continue
        kind, node = _enclosing(e)
        if node is not None:
            kind = made_by.get((node.fwd_thread, node.sequence_nr), "other")
            prof.backward[kind] += own / 1e3
        else:
            prof.forward[kind or "other"] += own / 1e3
    if on_gpu:
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CPU:
                prof.kernels[e.name] += e.self_device_time_total / 1e3
        unlinked = sum(prof.kernels.values()) - prof.total
        if unlinked > 1e-3:
            prof.forward["unlinked"] += unlinked
    return prof


def profile(model: torch.nn.Module, fn: Callable[[], object]) -> Profile:
    """Run fn() once under torch's profiler with the model's kinds labelled."""
    on_gpu = next(model.parameters()).is_cuda
    acts = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with labelled(model), torch.profiler.profile(activities=acts) as prof:
        fn()
        if on_gpu:
            torch.cuda.synchronize()
    return attribute(prof.events(), on_gpu)
