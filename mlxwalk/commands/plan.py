"""`mlxwalk plan`: what an exact walk over a window will need, and whether it fits, before any
training. The window is taken fully labelled (the most positions computed)."""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError, OutOfMemory
from ..plan import mib, plan_window
from ..training import adapters
from ..walk import ExactWalk, WalkConfig, Window, admission, arch, budget, choices, machine, macs
from ..walk.store import check_cache_type
from . import torch_module

HELP = "what a walk will need, and whether it fits"


def add_arguments(p) -> None:
    from ..training.options import add_flags

    add_flags(p, plan=True)


def report(model, name: str, window: int, config: WalkConfig, echo=print) -> bool:
    """Print the plan, the estimate and the verdict; True when the walk fits its budgets (and,
    without one, this machine). Nothing here holds a value per position of the window."""
    layout = heading(model, name, window, config, echo)
    config, default = with_default_budget(config, echo)
    labelled = Window.labelled(window)
    try:  # with a memory budget: admission, and what it changes to fit (each probe said)
        reach = plan_window(labelled.labels, config.chunk, layout.footprint()).chunks[-1].start
        walk = ExactWalk(model, labelled, config, layout, admission.Graphs(reach, echo=echo))
    except OutOfMemory as e:
        echo(f"verdict: does not fit: {e}")
        return False
    plan, chosen = walk.plan, walk.config
    echo(
        f"  {len(plan.chunks)} chunks of {plan.chunk}, checkpoint stride {plan.stride}, K/V "
        f"store {chosen.cache_type}, accumulators {chosen.accumulator_dtype}"
    )
    for line in choices.lines(walk.given_up):
        echo(line)
    if again := walk.forwards_again():  # the time a stride or inputs not kept costs
        echo(
            f"  the reverse pass forwards {again:,} layer-chunks again (re-decodes from "
            f"checkpoints, inputs not kept): {walk.windows_again():.1f} windows' decode more"
        )
    if walk.stem:
        echo(
            f"  layers 0-{walk.stem - 1} train nothing and have nothing trainable beneath them: "
            "no taps or accumulators there, and the reverse pass starts above them"
        )
    # Without a budget nothing is probed: the graph's share is measured only when it matters.
    unmeasured = budget.Activations(config.chunk, 0.0, 0.0)
    est = walk.estimate or budget.estimate(
        model, layout, unmeasured, plan, chosen.cache_type, skipped=walk.states_from()
    )
    if walk.keep != "off" and not est.inputs:  # --recompute's layer inputs, kept from the decode
        est = replace(est, inputs=walk.inputs_bytes(plan))
    for line in est.lines():
        echo(line)
    if walk.estimate is None:
        echo("  (one chunk's graph is measured, and counted, under a memory budget)")
    host = config.host_budget
    echo(f"host: {mib(est.host)} needed, budget {mib(host) if host else 'none'}: fits")
    device = config.device_budget
    if device is None:
        return machine_verdict(est.total, echo)
    given = "the GPU's own (no --memory-budget-mib)" if default else "--memory-budget-mib"
    if est.total <= device:
        echo(f"memory: {mib(est.total)} needed, budget {mib(device)} ({given}): fits")
        echo("verdict: fits")
        return True
    echo(
        f"memory: {mib(est.total)} at the full horizon, budget {mib(device)} ({given}): late "
        "chunks narrow their horizon to fit (the forward still sees the whole window, the "
        "gradient is no longer exact)"
    )
    echo("verdict: fits with a narrowed horizon")
    return True


def heading(model, name: str, window: int, config: WalkConfig, echo) -> arch.Layout:
    layout = arch.inspect(model)
    horizon = config.horizon or "the whole window"
    echo(
        f"model {name} ({layout.model_type}: {len(layout.attention)} attention layers, "
        f"{len(layout.recurrent)} recurrent), window {window}, chunk {config.chunk}, "
        f"horizon {horizon}, cache {config.cache_type}"
    )
    return layout


def report_macs(
    model, name: str, window: int, config: WalkConfig, most: int | None = None, echo=print
) -> bool:
    """--macs: per Mac memory size (machine.MACS) at macOS's default GPU working set, how the
    window trains and the longest window that trains exactly; True when one of them trains it
    exactly."""
    heading(model, name, window, config, echo)
    verdicts = macs.survey(model, window, config, most=most, echo=echo)
    for line in macs_table(verdicts, window, most):
        echo(line)
    return any(v.fits == macs.EXACT for v in verdicts)


def macs_table(verdicts: list[macs.Verdict], window: int, most: int | None) -> list[str]:
    """The table of `report_macs`, the smallest Mac that trains the window exactly, and where
    the working sets come from."""

    def said(v: macs.Verdict) -> str:
        if v.fits == macs.EXACT:
            return "trains exactly"
        if v.fits == macs.NARROWED:
            reach = "" if v.horizon is None else f" (down to {v.horizon:,} positions)"
            return f"narrowed horizon{reach}"
        return "does not fit"

    def longest(v: macs.Verdict) -> str:
        if v.largest == 0:
            return "none (not one chunk)"
        return f"{v.largest:,}" + (" (the model's maximum)" if v.largest == most else "")

    head = ("Mac memory", "GPU working set", f"window {window:,}", "longest exact window")
    rows = [
        (f"{v.gb:g} GB", f"{v.budget / machine.GIB:.1f} GiB", said(v), longest(v)) for v in verdicts
    ]
    wide = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    out = [
        "  ".join(
            c.rjust(w) if i < 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, wide))
        ).rstrip()
        for r in [head, *rows]
    ]
    first = next((v for v in verdicts if v.fits == macs.EXACT), None)
    if first is None:
        out.append(f"verdict: no Mac here trains a window of {window:,} exactly")
    else:
        out.append(
            f"verdict: the smallest Mac that trains a window of {window:,} exactly has "
            f"{first.gb:g} GB ({first.budget / machine.GIB:.1f} GiB GPU working set)"
        )
    out.append(
        "working set: macOS's default (about 2/3 of memory up to 36 GB, 3/4 above), an "
        "estimate; `mlxwalk kernels` prints a Mac's own, `sudo sysctl iogpu.wired_limit_mb=N` "
        "raises it (docs/MAC.md)"
    )
    out.append(
        f"one chunk's graph: measured once here ({machine.backend()}) for every size; a Mac's "
        "kernels make a graph of their own size"
    )
    return out


def with_default_budget(config: WalkConfig, echo) -> tuple[WalkConfig, bool]:
    """On a GPU with no memory budget given, the one MLX reports it may use, said."""
    mib_, memory = machine.default_budget_mib(config.memory_budget_mib)
    if memory is None:
        return config, False
    echo(f"memory budget: {memory.said()}, as no --memory-budget-mib is given")
    return replace(config, memory_budget_mib=mib_), True


def machine_verdict(total: int, echo) -> bool:
    """Without a budget: the estimate against what this machine has."""
    memory = machine.memory()
    if memory.bytes is None:
        echo(f"memory: {mib(total)} needed, no budget, this machine's memory unknown")
        echo("verdict: fits no stated budget (give --memory-budget-mib to check one)")
        return True
    fits = total <= memory.bytes
    echo(
        f"memory: {mib(total)} needed, no budget; this machine has {memory.said()}: "
        + ("fits" if fits else "does not fit")
    )
    echo(
        "verdict: fits"
        if fits
        else f"verdict: does not fit this machine: {mib(total)} needed, {mib(memory.bytes)} there"
    )
    return fits


def check(args) -> None:
    """The plan's options (TrainConfig's defaults where not given), range-checked before the
    model loads, each refusal naming its flag."""
    from ..training.config import TrainConfig, at_least, layers, not_empty, positive
    from ..training.options import PlanOptions

    not_empty("model", args.model)
    for defaults in (TrainConfig(), PlanOptions()):
        for name in vars(args):
            if getattr(args, name) is None and hasattr(defaults, name) and name != "window":
                setattr(args, name, getattr(defaults, name))
    if args.window is None:
        raise ConfigError("--window is required: the positions the walk will cover")
    for name in ("window", "chunk", "rank"):
        at_least(name, getattr(args, name), 1)
    at_least("horizon", args.horizon, 0, " (0 = the whole window)")
    layers(args.num_layers)
    for name in ("memory_budget_mib", "host_budget_mib"):
        positive(name, getattr(args, name))
    if args.macs and args.memory_budget_mib is not None:
        raise ConfigError(
            "--macs budgets each Mac by its default GPU working set; --memory-budget-mib gives "
            "one budget: give one or the other"
        )
    check_cache_type(args.cache_type)
    if args.backend not in ("mlx", "torch"):
        raise ConfigError(f"--backend {args.backend!r} is unknown; choose mlx or torch")
    if args.macs and args.backend == "torch":  # refused before torch is imported, or missing
        raise ConfigError("--macs: the torch backend's plan does not survey Mac memory sizes")


def run(args) -> int:
    from ..training import models

    check(args)
    if args.backend == "torch":
        return torch_module("plan_command").run(args)
    model, _ = models.load(args.model, tokenizer=False)
    limit = models.max_positions(model)
    if limit is not None and args.window > limit:
        raise ConfigError(f"--window {args.window} exceeds the model's maximum positions ({limit})")
    check_cache_type(args.cache_type, arch.inspect(model).head_dims)
    adapters.apply(model, adapters.LoraConfig(rank=args.rank, num_layers=args.num_layers))
    config = WalkConfig.from_fields(args, recompute=bool(args.recompute)).check()
    if args.macs:
        return 0 if report_macs(model, args.model, args.window, config, limit) else 1
    return 0 if report(model, args.model, args.window, config) else 1
