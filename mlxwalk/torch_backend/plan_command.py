"""`mlxwalk plan --backend torch`: the exact walk's plan for a transformers model. Without a
memory budget, from its config alone (the weights are not read): chunks, the checkpoint stride a
host budget allows, and the memory the walk holds beside one chunk's graph. With one (GPU memory),
the model is loaded on the GPU with its adapter and one chunk's graph measured there: the
estimate, where the store and accumulators go, and the verdict."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError, OutOfMemory
from ..plan import mib, plan_window
from ..walk.window import Window
from .model import footprint
from .walk import DTYPES, mib_bytes, torch_store


def meta_model(folder):
    """The model built on torch's meta device: shapes and dtypes, no memory, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def run(args, echo=print) -> int:
    from .train import model_folder

    if args.cache_type not in (*DTYPES, "auto"):
        raise ConfigError(
            f"--cache-type {args.cache_type}: the torch backend stores K/V as {', '.join(DTYPES)}"
        )
    if args.memory_budget_mib is not None:
        return measured(args, echo)
    model = meta_model(model_folder(args.model))
    foot = footprint(model)
    store = DTYPES.get(torch_store(args.cache_type)) or model.dtype
    store_bytes = store.itemsize
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    echo(
        f"model {args.model} ({model.config.model_type}, torch backend), window {args.window}, "
        f"chunk {args.chunk}, horizon {args.horizon or 'the whole window'}, "
        f"K/V store {str(store).removeprefix('torch.')}"
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


def measured(args, echo=print) -> int:
    """The plan under a memory budget: the walk's admission on the model, on the GPU."""
    from .model import add_lora, load
    from .train import DEFAULT_KEYS, model_folder
    from .walk import ExactWalk, TorchWalkConfig

    if not torch.cuda.is_available():
        raise ConfigError(
            "--memory-budget-mib counts CUDA memory, and there is no CUDA device here"
        )
    layers = None if args.num_layers == -1 else args.num_layers
    model = add_lora(
        load(model_folder(args.model), dtype=torch.bfloat16, device="cuda"),
        rank=args.rank,
        layers=layers,
        keys=DEFAULT_KEYS,
    )
    config = TorchWalkConfig.from_fields(args, store_dtype=torch_store(args.cache_type))
    echo(
        f"model {args.model} ({model.config.model_type}, torch backend, CUDA), window "
        f"{args.window}, chunk {args.chunk}, horizon {args.horizon or 'the whole window'}, "
        f"K/V store {args.cache_type}, memory budget {mib(mib_bytes(args.memory_budget_mib))}"
    )
    ones = np.ones(args.window)
    try:
        walk = ExactWalk(model, Window.of(ones, ones, ones), config)
    except OutOfMemory as e:
        echo(f"verdict: does not fit: {e}")
        return 1
    echo(f"  {len(walk.plan.chunks)} chunks, checkpoint stride {walk.plan.stride}")
    for line in walk.estimate.lines():
        echo(line)
    cut = [c.index for c in walk.plan.chunks if walk.narrowed_taps(c) < c.start - c.grad_from]
    if cut:
        echo(
            f"verdict: fits with a narrowed horizon: chunks {cut[0]} to {cut[-1]} narrow theirs "
            "(the forward still sees the whole window, the gradient is no longer exact)"
        )
    else:
        echo("verdict: fits")
    return 0
