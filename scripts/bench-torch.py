#!/usr/bin/env python3
"""The torch walk against transformers + PEFT with gradient checkpointing, side by side in one
process: tokens/s and peak GPU memory of a full training step (gradient and optimizer update) on
one window, random bf16 weights of a realistic shape, LoRA r8 on the last 16 layers.

    scripts/bench-torch.py attention [--windows 8192 16384 65536]   Qwen2.5-0.5B shape
    scripts/bench-torch.py hybrid [--windows 4096 16384 65536]      Qwen3.5-like ~0.8B hybrid
        [--kinds peft exact exact-host exact-budget] [--memory-budget-gib 16] [--chunk 4096]
        [--delta-rule mlxwalk] [--conv auto] [--small]
    (also as scripts/bench-walk.py --backend torch ...)

peft: transformers + PEFT, one graph, gradient checkpointing, transformers' SDPA and (hybrid)
its torch delta rule; exact: the exact walk, chunk by chunk, K/V store in bf16, accumulators on
the GPU; exact-host: the same with the K/V gradient accumulators in pinned host memory;
exact-budget: under --memory-budget-gib, the store and accumulators placed by the walk's budget
(the probe of one chunk's graph runs once, before the warm-up). Every kind runs the --conv
route's causal convolution (auto: causal-conv1d's kernel where it works, else torch).
`--small` shrinks every shape to check the script on a CPU.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import numpy as np
import torch

from mlxwalk.plan import PlanError
from mlxwalk.shapes import SHAPES, SMALL
from mlxwalk.torch_backend import attention, recurrent
from mlxwalk.torch_backend import model as models
from mlxwalk.torch_backend.walk import TorchWalkConfig, train_window, weighted_loss
from mlxwalk.walk.window import Window

GIB = 1 << 30
SHAPE = {"attention": "qwen2-0.5b", "hybrid": "qwen3_5-0.8b"}
MEMORY = ("after decode", "accumulators", "estimate")
KEYS = ("q_proj", "v_proj", "in_proj_qkv", "in_proj_z")


def build(which: str, small: bool, device: str):
    """A random bf16 transformers model of the shape, with LoRA r8 on its last 16 layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES[SHAPE[which]])
    kind = cfg.pop("model_type")
    if small:
        cfg.update(SMALL, num_attention_heads=4)
        if kind == "qwen3_5":
            cfg.update(
                head_dim=64,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=64,
                linear_value_head_dim=64,
            )
    kind = "qwen3_5_text" if kind == "qwen3_5" else kind
    attention.register()
    config = AutoConfig.for_model(kind, **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = models.add_lora(
        model, rank=8, alpha=16, layers=min(16, config.num_hidden_layers), keys=KEYS, seed=0
    )
    return model


def window(n: int, vocab: int) -> Window:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, n + 1)
    return Window.of(ids[:-1], ids[1:], np.ones(n))


def peft_step(model, win: Window, optimizer) -> float:
    """transformers + PEFT's own step: the window as one graph, checkpointed by layer."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(win.inputs, dtype=torch.long, device=device)[None]
    targets = torch.as_tensor(win.targets, dtype=torch.long, device=device)
    weights = torch.as_tensor(win.weights, device=device)
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = weighted_loss(logits, targets, weights, win.total)
    del logits
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def set_kind(model, kind: str, delta_rule: str, conv: str = "auto") -> None:
    base = model.get_base_model()
    if kind == "peft":
        base.set_attn_implementation("sdpa")
        recurrent.route(base, "transformers", conv=conv)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    else:
        base.set_attn_implementation(attention.NAME)
        recurrent.route(base, delta_rule, conv=conv)
        model.gradient_checkpointing_disable()
        model.eval()  # no dropout either way; eval keeps transformers off its training-only paths


def measure(
    model,
    kind: str,
    n: int,
    chunk: int,
    delta_rule: str,
    repeats: int,
    budget_gib: float,
    conv: str = "auto",
) -> dict:
    set_kind(model, kind, delta_rule, conv)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    win = window(n, models.text_config(model).vocab_size)
    config = TorchWalkConfig(
        chunk=chunk,
        store_dtype="bfloat16",
        accumulators="host" if kind == "exact-host" else "device",
        memory_budget_mib=budget_gib * 1024 if kind == "exact-budget" else None,
    )
    cuda = torch.cuda.is_available()
    host, phases = 0, {}

    def step():
        nonlocal host
        if kind == "peft":
            return peft_step(model, win, optimizer)
        walk = train_window(model, optimizer, win, config)
        placed = walk.config
        host = walk.accumulator_bytes * (placed.accumulators == "host")
        host += walk.store_bytes * (placed.store == "host")
        if walk.estimate is not None:
            phases["store on"], phases["accumulators on"] = placed.store, placed.accumulators
            phases["horizon used"] = walk.horizon_used or "whole"
            phases["estimate"] = walk.estimate.gpu / GIB
        phases.update(walk.seconds)
        phases.update({k: v / GIB for k, v in walk.memory.items()})
        return walk.loss

    times = []
    for i in range(repeats + 1):  # the first is the warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
    return dict(
        kind=kind,
        window=n,
        seconds=seconds,
        tps=n / seconds,
        peak=peak,
        host=host / GIB,
        loss=loss,
        phases=", ".join(
            f"{k} {v}"
            if isinstance(v, str) or k == "horizon used"
            else f"{k} {v:.2f} {'GiB' if k in MEMORY else 's'}"
            for k, v in phases.items()
        ),
    )


def attention_op(n: int, chunk: int, heads: int = 14, kv_heads: int = 2, dim: int = 64) -> None:
    """The walk's attention call at the window's last chunk (its queries over every key, lower
    right causal) against the one graph's (the whole window, causal), forward and backward, and
    whether FlashAttention takes the walk's call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    def timed(fn, *xs) -> float:
        xs = [x.requires_grad_() for x in xs]
        for i in range(4):
            if i == 1:
                torch.cuda.synchronize()
                start = time.perf_counter()
            out = fn(*xs)
            out[0].sum().backward() if isinstance(out, tuple) else out.sum().backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 3

    k, v = rnd(1, kv_heads, n, dim), rnd(1, kv_heads, n, dim)
    q = rnd(1, heads, chunk, dim)
    walk = timed(lambda q, k, v: attention.walk_attention(None, q, k, v), q, k, v)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash = timed(lambda q, k, v: attention.walk_attention(None, q, k, v), q, k, v)
        flash = f"{flash * 1e3:.1f} ms"
    except RuntimeError as e:
        flash = f"refused ({str(e).splitlines()[0][:80]})"
    r = heads // kv_heads
    kr, vr = k.repeat_interleave(r, 1).detach(), v.repeat_interleave(r, 1).detach()
    scale = dim**-0.5

    def direct(q, k, v):  # FlashAttention's lower-right causal op, no copies around it
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=scale
        )[0]

    kernel = timed(direct, q.detach(), kr, vr)
    try:
        gqa = f"{timed(direct, q.detach(), k.detach(), v.detach()) * 1e3:.1f} ms"
        got = direct(q.detach(), k.detach(), v.detach())
        want = direct(q.detach(), kr, vr)
        gqa += f" (max difference {float((got - want).abs().max()):.1e})"
    except RuntimeError as e:
        gqa = f"refused ({str(e).splitlines()[0][:80]})"
    print(f"the kernel alone on repeated K/V {kernel * 1e3:.1f} ms; on the kv heads: {gqa}")
    full_q = rnd(1, heads, n, dim)
    full = timed(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        full_q,
        k,
        v,
    )
    n_chunks = n // chunk
    print(
        f"attention fwd+bwd, {heads}/{kv_heads} heads, dim {dim}: the walk's last chunk "
        f"({chunk} over {n:,}) {walk * 1e3:.1f} ms (FlashAttention only: {flash}); one graph "
        f"causal over {n:,}: {full * 1e3:.1f} ms, about {full / n_chunks * 2 * 1e3:.1f} ms "
        f"per chunk of the same work"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("which", choices=sorted(SHAPE))
    p.add_argument("--windows", type=int, nargs="+")
    p.add_argument("--kinds", nargs="+", default=["peft", "exact"])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--delta-rule", default="mlxwalk", choices=recurrent.ROUTES)
    p.add_argument("--conv", default="auto", choices=recurrent.CONV_ROUTES)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--small", action="store_true")
    p.add_argument(
        "--memory-budget-gib",
        type=float,
        nargs="+",
        default=[16.0],
        help="exact-budget: a row for each",
    )
    p.add_argument("--attention-op", action="store_true", help="time the attention call only")
    a = p.parse_args()
    windows = a.windows or (
        [8192, 16384, 65536] if a.which == "attention" else [4096, 16384, 65536]
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.attention_op:
        for n in windows:
            attention_op(n, a.chunk)
        return 0
    model = build(a.which, a.small, device)
    conv = recurrent.route_conv(model.get_base_model(), a.conv)  # the one taken, said once
    n_params = sum(p.numel() for p in model.parameters())
    where = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    print(
        f"{SHAPE[a.which]}{' (small)' if a.small else ''}: {n_params / 1e9:.2f}B parameters, "
        f"bf16, torch {torch.__version__} on {where}; chunk {a.chunk}, delta rule "
        f"{a.delta_rule}, conv {conv}; median of {a.repeats} after a warm-up",
        flush=True,
    )
    print("| window | step | seconds | tokens/s | peak GPU GiB | pinned host GiB | loss | phases |")
    print("|---:|---|---:|---:|---:|---:|---:|---|", flush=True)
    for n in windows:
        budgets = {k: a.memory_budget_gib if k == "exact-budget" else [0.0] for k in a.kinds}
        for kind, budget in [(k, b) for k in a.kinds for b in budgets[k]]:
            label = f"{kind} {budget:g} GiB" if kind == "exact-budget" else kind
            try:
                r = measure(model, kind, n, a.chunk, a.delta_rule, a.repeats, budget, a.conv)
                print(
                    f"| {n:,} | {label} | {r['seconds']:.2f} | {r['tps']:,.0f} | "
                    f"{r['peak']:.1f} | {r['host']:.2f} | {r['loss']:.4f} | {r['phases']} |",
                    flush=True,
                )
            except torch.OutOfMemoryError:
                print(f"| {n:,} | {label} | out of memory | | | | |", flush=True)
            except PlanError as e:
                print(f"| {n:,} | {label} | refused: {e} | | | | |", flush=True)
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
