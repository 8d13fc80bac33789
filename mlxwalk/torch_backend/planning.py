"""`mlxwalk plan --backend torch`: the exact walk's plan for a transformers model, from its
config alone (the weights are not read): chunks, the checkpoint stride a host budget allows, and
the memory the walk holds beside one chunk's graph. One chunk's graph is not measured on this
backend yet, so a memory budget is refused rather than guessed at."""

from __future__ import annotations

import numpy as np
import torch

from ..plan import OutOfMemory, PlanError, mib, plan_window
from .model import footprint
from .walk import DTYPES


def meta_model(folder):
    """The model built on torch's meta device: shapes and dtypes, no memory, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def run(args, echo=print) -> int:
    from .train import model_folder

    if args.memory_budget_mib is not None:
        raise PlanError("--memory-budget-mib is not taken by the torch backend yet")
    if args.cache_type not in DTYPES:
        raise PlanError(
            f"--cache-type {args.cache_type}: the torch backend stores K/V as {', '.join(DTYPES)}"
        )
    model = meta_model(model_folder(args.model))
    foot = footprint(model)
    store_bytes = DTYPES[args.cache_type].itemsize
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    echo(
        f"model {args.model} ({model.config.model_type}, torch backend), window {args.window}, "
        f"chunk {args.chunk}, horizon {args.horizon or 'the whole window'}, "
        f"K/V store {args.cache_type}"
    )
    ones = np.ones(args.window)
    host = None if args.host_budget_mib is None else int(args.host_budget_mib * 2**20)
    try:
        plan = plan_window(ones.tolist(), args.chunk, foot, horizon=args.horizon, host_budget=host)
    except OutOfMemory as e:
        echo(f"verdict: does not fit: {e}")
        return 1
    echo(f"  {len(plan.chunks)} chunks, checkpoint stride {plan.stride}")
    echo(f"  weights (bf16)            {mib(weights)}")
    echo(f"  K/V store                 {mib(plan.computed * foot.kv_width * store_bytes)}")
    echo(f"  K/V accumulators (fp32)   {mib(plan.accumulator_bytes)}  (GPU, or pinned host)")
    echo(f"  recurrent checkpoints     {mib(plan.checkpoint_bytes)}")
    echo("  one chunk's graph         not measured on the torch backend yet")
    echo(
        f"host budget: {mib(plan.host_bytes)} needed (accumulators and checkpoints), budget "
        f"{mib(host) if host else 'none'}: fits"
    )
    echo("verdict: fits (the graph aside)")
    return 0
