"""The exact and plain walks over one window for a transformers model with a PEFT adapter: the
MLX walk's phases (mlxwalk/walk/exact.py) on the shared plan (mlxwalk/plan.py).

  1. decode_forward: every chunk but the last, with no gradient, writes its K/V into the store
     and hands its exit states on; the states entering every stride-th chunk are kept.
  2. reverse: every needed chunk, last to first, is a graph whose leaves are the adapter, the
     tapped prefix K/V on [grad_from, start) and the entry states; its objective is its share of
     the loss plus <own K/V, adjoint> + <exit states, adjoint>, the adjoints being what later
     chunks sent back. torch sums the adapter's gradient in `.grad` across chunks; the taps'
     gradients go to the K/V accumulators, the entry states' to the state adjoint.
  3. the caller steps once on the summed gradient.
The adapter must not change between the start of decode_forward and the end of reverse.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from ..plan import Footprint, cut, plan_window
from ..walk.config import Window
from .cache import Store, WalkCache
from .model import footprint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TorchWalkConfig:
    chunk: int
    horizon: int = 0  # 0 = the whole window
    store_dtype: str | None = None  # the K/V store (None: the model's dtype)
    accumulators: str = "device"  # where the K/V gradient accumulators live: device or host
    host_budget_mib: float | None = None
    follow_runs: bool = True


def weighted_loss(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, total: float
) -> torch.Tensor:
    """sum(w * CE) / total in float32; logits (1, n, vocab), targets and weights (n,)."""
    ce = torch.nn.functional.cross_entropy(logits[0].float(), targets, reduction="none")
    return (ce * weights).sum() / total


LOSS_BLOCK = 1024  # positions whose logits are alive at once in a chunk's graph


def head_loss(
    head, h: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, total: float
) -> torch.Tensor:
    """weighted_loss of head(h), LOSS_BLOCK positions at a time, each block checkpointed: a
    chunk's logits (positions x vocabulary, its largest tensor for a large vocabulary) are never
    all alive, forward or backward, for the price of one more output projection."""

    def block(hb, tb, wb):
        return weighted_loss(head(hb), tb, wb, total)

    n = h.shape[1]
    if n <= LOSS_BLOCK:
        return block(h, targets, weights)
    parts = [
        checkpoint(
            block,
            h[:, i : i + LOSS_BLOCK],
            targets[i : i + LOSS_BLOCK],
            weights[i : i + LOSS_BLOCK],
            use_reentrant=False,
        )
        for i in range(0, n, LOSS_BLOCK)
    ]
    return torch.stack(parts).sum()


class Walk:
    """What both walks share: the window on the model's device, one chunk's forward."""

    def walking(self):
        """The model in eval mode for the walk, put back after: no dropout (the decode and a
        chunk's graph must compute the same K/V and states), and no gradient checkpointing of
        transformers' (which drops the cache from a layer in training mode)."""
        return _EvalMode(self.model)

    def __init__(self, model, window: Window, config: TorchWalkConfig):
        self.model, self.window, self.config = model, window, config
        self.device = next(model.parameters()).device
        self.ids = torch.as_tensor(window.inputs, dtype=torch.long, device=self.device)
        self.targets = torch.as_tensor(window.targets, dtype=torch.long, device=self.device)
        self.weights = torch.as_tensor(window.weights, dtype=torch.float32, device=self.device)
        self.footprint: Footprint = footprint(model)
        self.store: Store | None = None
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder, self.head = lm.get_decoder(), lm.get_output_embeddings()
        self.on_chunk: Callable[[str, int, int], None] | None = None

    def new_store(self, positions: int) -> None:
        dtype = DTYPES[self.config.store_dtype] if self.config.store_dtype else None
        self.store = Store(positions, dtype, self.device)

    def hidden(self, start: int, end: int, cache: WalkCache) -> torch.Tensor:
        """The decoder's last hidden states (1, end - start, hidden) against the cache."""
        positions = torch.arange(start, end, device=self.device)[None]
        out = self.decoder(
            input_ids=self.ids[None, start:end], position_ids=positions, cache=cache, use_cache=True
        )
        return out.last_hidden_state

    def decode(self, start: int, end: int, states: dict, write: bool = True) -> dict:
        """One chunk with no gradient (and no output head): its K/V into the store; its exit
        states."""
        with torch.no_grad():
            cache = WalkCache(self.store, start, end, states, write=write)
            self.hidden(start, end, cache)
        return {n: {k: x.detach() for k, x in s.items()} for n, s in cache.exit.items()}

    def chunk_loss(self, start: int, end: int, cache: WalkCache) -> torch.Tensor:
        """The chunk's share of the window's loss, as a graph."""
        h = self.hidden(start, end, cache)
        return head_loss(
            self.head, h, self.targets[start:end], self.weights[start:end], self.window.total
        )

    def loss_only(self) -> float:
        """The window's loss, chunk by chunk with no gradient (evaluation)."""
        chunks = cut(self.window.weights.tolist(), self.config.chunk, self.config.follow_runs)
        self.new_store(chunks[-1].end)
        loss, states = 0.0, {}
        with torch.no_grad(), self.walking():
            for chunk in chunks:
                cache = WalkCache(self.store, chunk.start, chunk.end, states)
                h = self.hidden(chunk.start, chunk.end, cache)
                if chunk.labelled:
                    s, e = chunk.start, chunk.end
                    loss += float(
                        head_loss(
                            self.head, h, self.targets[s:e], self.weights[s:e], self.window.total
                        )
                    )
                states = cache.exit
        return loss

    def tick(self, phase: str, done: int, total: int) -> None:
        if self.on_chunk is not None:
            self.on_chunk(phase, done, total)


class _EvalMode:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Accumulators:
    """The K/V gradient of every computed position (float32), on the device or in pinned host
    memory, and the adjoint of the states entering the chunk trained last."""

    def __init__(self, store: Store, where: str, device: torch.device):
        host = where == "host"
        self.device = device
        self.kv = {
            n: tuple(
                torch.zeros(
                    x.shape,
                    dtype=torch.float32,
                    device="cpu" if host else device,
                    pin_memory=host and device.type == "cuda",
                )
                for x in kv
            )
            for n, kv in store.kv.items()
        }
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def adjoint(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(x[:, :, start:end].to(self.device, non_blocking=True) for x in self.kv[layer])

    def add(self, layer: int, start: int, grads: tuple[torch.Tensor, torch.Tensor]) -> None:
        for acc, g in zip(self.kv[layer], grads):
            if g is not None:
                acc[:, :, start : start + g.shape[2]] += g.to(acc.device, torch.float32)

    def bytes(self) -> int:
        return sum(x.numel() * x.element_size() for kv in self.kv.values() for x in kv)


class ExactWalk(Walk):
    """One window's exact walk; the plan comes before any tensor of the window."""

    def __init__(self, model, window: Window, config: TorchWalkConfig):
        super().__init__(model, window, config)
        host = None if config.host_budget_mib is None else int(config.host_budget_mib * 2**20)
        self.plan = plan_window(
            window.weights.tolist(),
            config.chunk,
            self.footprint,
            horizon=config.horizon,
            host_budget=host,
            follow_runs=config.follow_runs,
        )
        self.checkpoints: dict[int, dict] = {}

    def run(self) -> float:
        """The window's loss; the adapter's gradient is in its parameters' `.grad`. The phases'
        seconds go to `seconds`, what the GPU held after the decode to `memory`; the store, the
        accumulators and the checkpoints are let go before it returns."""
        with self.walking():
            start = _now(self.device)
            self.decode_forward()
            decoded = _now(self.device)
            self.memory = {"after decode": _allocated(self.device)}
            loss = self.reverse()
        self.seconds = {"decode": decoded - start, "reverse": _now(self.device) - decoded}
        self.accumulator_bytes = self.acc.bytes()
        self.store = self.acc = None
        self.checkpoints = {}
        return loss

    def decode_forward(self) -> None:
        self.new_store(self.plan.computed)
        self.checkpoints, states = {}, {}
        chunks = self.plan.chunks
        for chunk in chunks:
            if self.plan.checkpointed(chunk.index):
                self.checkpoints[chunk.index] = states
            if chunk is not chunks[-1]:  # no later chunk reads the last one's K/V or state
                states = self.decode(chunk.start, chunk.end, states)
            self.tick("decode", chunk.index + 1, len(chunks))

    def entry_states(self, index: int) -> dict:
        """The states entering chunk `index`: its checkpoint, or decoded from the nearest one."""
        if not self.footprint.recurrent:
            return {}
        first = index - index % self.plan.stride
        states = self.checkpoints[first] if first > 0 else {}
        for c in self.plan.chunks[first:index]:
            states = self.decode(c.start, c.end, states, write=False)
        return states

    def reverse(self) -> float:
        self.acc = Accumulators(self.store, self.config.accumulators, self.device)
        self.memory["accumulators"] = _allocated(self.device)
        loss = 0.0
        order = self.plan.reverse()
        for done, chunk in enumerate(order, 1):
            loss += self.train_chunk(chunk)
            self.tick("train", done, len(order))
        return loss

    def train_chunk(self, chunk) -> float:
        s, e, gf = chunk.start, chunk.end, chunk.grad_from
        cache = WalkCache(
            self.store,
            s,
            e,
            self.entry_states(chunk.index),
            train=True,
            grad_from=gf,
            tap_states=chunk.index > 0,
        )
        loss = self.chunk_loss(s, e, cache)
        objective = loss
        for layer, own in cache.own.items():  # what later chunks sent back to this chunk's K/V
            if layer in self.acc.kv:  # (a window of one chunk decodes nothing)
                for x, adj in zip(own, self.acc.adjoint(layer, s, e)):
                    objective = objective + (x.float() * adj).sum()
        for layer, adj in self.acc.states.items():
            for key, a in adj.items():
                objective = objective + (cache.exit[layer][key].float() * a).sum()
        objective.backward()
        for layer, taps in cache.taps.items():
            self.acc.add(layer, gf, tuple(t.grad for t in taps))
        self.acc.states = {
            n: {k: x.grad.float() for k, x in st.items() if x.grad is not None}
            for n, st in cache.entry.items()
        }
        return float(loss.detach())


class PlainWalk(Walk):
    """Chunk by chunk, the prefix as constants, the gradient cut at every chunk boundary; with
    `step`, one step per labelled chunk (the chunk is then re-decoded under the new adapter)."""

    def run(self, step: Callable[[], None] | None = None) -> float:
        chunks = cut(self.window.weights.tolist(), self.config.chunk, self.config.follow_runs)
        with self.walking():
            loss = self._run(chunks, step)
        self.store = None
        return loss

    def _run(self, chunks, step) -> float:
        self.new_store(chunks[-1].end)
        loss, states = 0.0, {}
        for chunk in chunks:
            if chunk.labelled:
                cache = WalkCache(
                    self.store, chunk.start, chunk.end, states, train=True, grad_from=chunk.start
                )
                chunk_loss = self.chunk_loss(chunk.start, chunk.end, cache)
                chunk_loss.backward()
                loss += float(chunk_loss.detach())
                if step is not None:
                    step()
            if chunk is not chunks[-1]:
                states = self.decode(chunk.start, chunk.end, states)
            self.tick("train", chunk.index + 1, len(chunks))
        return loss


def one_graph(model, window: Window) -> float:
    """The reference: the whole window as one graph, no cache; the gradient in `.grad`."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(window.inputs, dtype=torch.long, device=device)[None]
    logits = model(input_ids=ids, use_cache=False).logits
    loss = weighted_loss(
        logits,
        torch.as_tensor(window.targets, dtype=torch.long, device=device),
        torch.as_tensor(window.weights, device=device),
        window.total,
    )
    loss.backward()
    return float(loss.detach())


def gradients(model) -> dict[str, np.ndarray]:
    """The trainable parameters' `.grad`, by name, as float32 arrays (zeros where none came)."""
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu().numpy()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def window_gradient(
    model, inputs, targets, weights, *, walk: str = "exact", **config
) -> tuple[float, dict[str, np.ndarray]]:
    """The window's loss and the adapter's gradient by one walk (as mlxwalk.walk's)."""
    window = Window.of(inputs, targets, weights)
    model.zero_grad(set_to_none=True)
    if walk == "one-graph":
        loss = one_graph(model, window)
    else:
        runner = (ExactWalk if walk == "exact" else PlainWalk)(
            model, window, TorchWalkConfig(**config)
        )
        loss = runner.run()
    return loss, gradients(model)


def train_window(
    model,
    optimizer,
    window: Window,
    config: TorchWalkConfig,
    walk: str = "exact",
    clip: float | None = None,
) -> Walk:
    """One window: the exact walk steps once on the window's gradient, the plain walk once per
    labelled chunk. A refusal (the plan, bad input) comes before any step; a non-finite loss or
    gradient raises before the step that would apply it. Returns the walk, its `loss` set."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in grads):
            raise FloatingPointError("a non-finite gradient; no step taken")
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    optimizer.zero_grad(set_to_none=True)
    if walk == "exact":
        runner = ExactWalk(model, window, config)
        runner.loss = runner.run()
        if not np.isfinite(runner.loss):
            raise FloatingPointError(f"the window's loss is {runner.loss}; no step taken")
        step()
    elif walk == "plain":
        runner = PlainWalk(model, window, config)
        runner.loss = runner.run(step=step)
    else:
        raise ValueError(f"walk {walk!r} cannot train; choose exact or plain")
    return runner
