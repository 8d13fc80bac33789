"""The exact and plain walks over one window for a transformers model with a PEFT adapter. Their
algorithms are mlxwalk/walk/algorithm.py's, on the shared plan (mlxwalk/plan.py); here are their
torch mechanics: the store and the caches a chunk reads (cache.py), the K/V gradient
accumulators (on the device or in pinned host memory), a chunk's graph differentiated with
`.backward()` (the adapter's gradient summed in `.grad` across chunks), and under a memory budget
the placement of the store and accumulators (budget.py)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..plan import Footprint, cut, plan_window
from ..walk.activations import Activations, graph_bytes
from ..walk.algorithm import ExactAlgorithm, PlainAlgorithm, loss_blocks
from ..walk.window import Window
from . import budget as budgets
from .cache import Store, WalkCache
from .model import check_transformers, footprint

log = logging.getLogger("mlxwalk")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_store(cache_type: str) -> str | None:
    """--cache-type on torch: "auto" is the model's own dtype (None), which holds its K/V bit for
    bit; the torch walk takes no lossy choice of its own under a budget (it moves the
    accumulators, then the store, to host memory instead)."""
    return None if cache_type == "auto" else cache_type


@dataclass
class TorchWalkConfig:
    chunk: int
    horizon: int = 0  # 0 = the whole window
    store_dtype: str | None = None  # the K/V store (None: the model's dtype)
    store: str = "device"  # where the K/V store lives: device or host
    accumulators: str = "device"  # where the K/V gradient accumulators live: device or host
    host_budget_mib: float | None = None
    strict_exact: bool = False  # refuse a window the memory budget would narrow the horizon of
    # all torch's allocator holds on the GPU while a window trains; under it the accumulators,
    # then the store, go to host memory as needed, then late chunks narrow their horizon
    memory_budget_mib: float | None = None
    follow_runs: bool = True

    @classmethod
    def from_fields(cls, source, **overrides) -> TorchWalkConfig:
        """A config of `source`'s attributes named as its fields (a run's settings, a command's
        arguments), then `overrides`."""
        given = {f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}
        return cls(**{**given, **overrides})


def weighted_loss(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, total: float
) -> torch.Tensor:
    """sum(w * CE) / total in float32; logits (1, n, vocab), targets and weights (n,)."""
    ce = torch.nn.functional.cross_entropy(logits[0].float(), targets, reduction="none")
    return (ce * weights).sum() / total


def head_loss(
    head, h: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, total: float
) -> torch.Tensor:
    """weighted_loss of head(h) (1, n, hidden), in the blocks of algorithm.loss_blocks, each
    checkpointed: the chunk's logits are never all alive, forward or backward."""

    def block(hb, tb, wb):
        return weighted_loss(head(hb), tb, wb, total)

    blocks = loss_blocks(h.shape[1])
    if len(blocks) == 1:
        return block(h, targets, weights)
    parts = [
        checkpoint(block, h[:, b], targets[b], weights[b], use_reentrant=False) for b in blocks
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
        check_transformers()
        if window.targets_per_position != 1:
            raise ConfigError(
                "a window of several targets a position (an answer group) is walked by the MLX "
                "backend only; on torch, walk each answer as a window of its own"
            )
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
        self.store = Store(positions, dtype, self.device, host=self.config.store == "host")

    def hidden(self, start: int, end: int, cache: WalkCache) -> torch.Tensor:
        """The decoder's last hidden states (1, end - start, hidden) against the cache."""
        positions = torch.arange(start, end, device=self.device)[None]
        out = self.decoder(
            input_ids=self.ids[None, start:end], position_ids=positions, cache=cache, use_cache=True
        )
        return out.last_hidden_state

    def decode_span(self, start: int, end: int, states: dict, write: bool = True) -> dict:
        """Positions [start, end) with no gradient (and no output head): their K/V into the
        store; their exit states."""
        with torch.no_grad():
            cache = WalkCache(self.store, start, end, states, write=write)
            self.hidden(start, end, cache)
        return {n: {k: x.detach() for k, x in s.items()} for n, s in cache.exit.items()}

    def zero_state(self) -> dict:
        return {}

    def decode(self, chunk, states: dict, write: bool = True) -> dict:
        return self.decode_span(chunk.start, chunk.end, states, write)

    def chunk_loss(self, start: int, end: int, cache: WalkCache) -> torch.Tensor:
        """The chunk's share of the window's loss, as a graph."""
        h = self.hidden(start, end, cache)
        return head_loss(
            self.head, h, self.targets[start:end], self.weights[start:end], self.window.total
        )

    def loss_only(self) -> float:
        """The window's loss, chunk by chunk with no gradient (evaluation)."""
        chunks = cut(self.window.labels, self.config.chunk, self.config.follow_runs)
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


class _EvalMode:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was)


def mib_bytes(value: float | None) -> int | None:
    return None if value is None else int(value * 2**20)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Accumulators:
    """The K/V gradient of every computed position (float32), and the adjoint of the states
    entering the chunk trained last. On the device, (B, kv heads, positions, head dim) per K and
    V; in host memory (pinned under CUDA), (B, positions, kv heads, head dim), so a chunk's rows
    are one contiguous block: a chunk's taps are added on the GPU (their block copied up, added
    to, copied back) on a side stream, overlapping the next chunk's forward."""

    def __init__(self, store: Store, where: str, device: torch.device):
        self.host = where == "host"
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.host and cuda else None

        def zeros(x: torch.Tensor) -> torch.Tensor:
            if not self.host:
                return torch.zeros(x.shape, dtype=torch.float32, device=device)
            b, heads, n, d = x.shape
            return torch.zeros((b, n, heads, d), dtype=torch.float32, pin_memory=cuda)

        self.kv = {n: tuple(zeros(x) for x in kv) for n, kv in self.device_shaped(store).items()}
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def device_shaped(store: Store) -> dict[int, tuple[torch.Tensor, ...]]:
        """The store's pairs as (B, kv heads, positions, head dim), whichever layout it holds."""
        if not store.host:
            return store.kv
        return {n: tuple(x.transpose(1, 2) for x in kv) for n, kv in store.kv.items()}

    def adjoint(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, ...]:
        """Positions [start, end) as (B, kv heads, n, head dim), on the device."""
        if not self.host:
            return tuple(x[:, :, start:end] for x in self.kv[layer])
        self.wait()
        return tuple(
            x[:, start:end].to(self.device, non_blocking=True).transpose(1, 2)
            for x in self.kv[layer]
        )

    def add(self, layer: int, start: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        for acc, g in zip(self.kv[layer], grads):
            if g is None:
                continue
            end = start + g.shape[2]
            if not self.host:
                acc[:, :, start:end] += g.float()
            elif self.stream is None:  # the CPU: the host is the device
                acc[:, start:end] += g.transpose(1, 2).float()
            else:
                self._add_on_side_stream(acc[:, start:end], g)

    def _add_on_side_stream(self, block: torch.Tensor, g: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            up = block.to(self.device, non_blocking=True)  # (B, n, kv heads, head dim)
            up += g.transpose(1, 2)
            block.copy_(up, non_blocking=True)
        g.record_stream(self.stream)  # not reused by the main stream before the copy is done

    def wait(self) -> None:
        """The main stream waits for the side stream's copies (before reading what they wrote)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def release(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # no copy may still write into memory given back
        self.kv, self.states = {}, {}

    def bytes(self) -> int:
        return sum(x.numel() * x.element_size() for kv in self.kv.values() for x in kv)


class ExactWalk(Walk, ExactAlgorithm):
    """One window's exact walk; the plan, its placement under a memory budget (budget.py) and
    any refusal come before any tensor of the window."""

    def __init__(self, model, window: Window, config: TorchWalkConfig, acts=None):
        super().__init__(model, window, config)
        self.plan = plan_window(
            window.labels,
            config.chunk,
            self.footprint,
            horizon=config.horizon,
            host_budget=mib_bytes(config.host_budget_mib),
            follow_runs=config.follow_runs,
        )
        self.checkpoints: dict[int, dict] = {}
        self.horizon_used = config.horizon  # narrowed per chunk if the memory budget asks
        self.estimate = self.admit(acts)
        if config.strict_exact:
            self.refuse_narrowing()

    def admit(self, acts) -> budgets.Estimate | None:
        """Under a memory budget: one chunk's graph (`acts`, else probed on this model), the
        placement of the store and accumulators, or a refusal."""
        budget = mib_bytes(self.config.memory_budget_mib)
        if budget is None:
            return None
        self.acts = acts or probe(self.model, self.config.chunk, self.config.store_dtype)
        est = budgets.estimate(
            self.model, self.plan, self.acts, self.store_element(), resident=self.resident()
        )
        last = self.plan.chunks[-1]
        fewest = min(self.plan.chunk, last.start - last.grad_from)  # one chunk of taps
        least = replace(
            est, graph=self.graph_bytes(fewest, last.start), taps=self.tap_bytes(fewest)
        )
        asked = (self.config.store, self.config.accumulators)
        first = next(
            p
            for p in budgets.PLACEMENTS
            if all(a != "host" or b == "host" for a, b in zip(asked, p))
        )
        est = budgets.place(est, least, budget, first)
        self.config = replace(self.config, store=est.store_at, accumulators=est.accumulators_at)
        return est

    def store_element(self) -> int:
        dtype = DTYPES[self.config.store_dtype] if self.config.store_dtype else None
        return (dtype or next(self.model.parameters()).dtype).itemsize

    def tap_bytes(self, taps: int) -> int:
        return taps * self.footprint.kv_width * self.store_element()

    def resident(self) -> int:
        """What the allocator holds now beyond the model's parameters and the optimizer's moments
        (the adapter's share counts those)."""
        params = list(self.model.parameters())
        moments = 2 * budgets.tensor_bytes(p for p in params if p.requires_grad)  # Adam's, if any
        return max(0, _allocated(self.device) - budgets.tensor_bytes(params) - moments)

    def graph_bytes(self, taps: int, prefix: int) -> int:
        return graph_bytes(self.acts, self.footprint, taps, prefix)

    # --- the mechanics the shared algorithm (walk/algorithm.py) runs on ----------------------

    @property
    def recurrent(self) -> bool:
        return self.footprint.recurrent

    @property
    def budget_mib(self) -> float | None:
        return None if self.estimate is None else self.config.memory_budget_mib

    def fits(self, chunk, taps: int) -> bool:
        est, budget = self.estimate, mib_bytes(self.config.memory_budget_mib)
        copied = est.store_at == "host"  # the taps come up from host memory into the graph
        rest = est.gpu - est.chunk_graph
        return rest + self.graph_bytes(taps, chunk.start) + copied * self.tap_bytes(taps) <= budget

    def run(self) -> float:
        """The window's loss; the adapter's gradient is in its parameters' `.grad`. The phases'
        seconds go to `seconds`, what the GPU held after the decode to `memory`; the store, the
        accumulators and the checkpoints are let go before it returns."""
        start = _now(self.device)
        loss = self.walk()
        self.seconds = {"decode": self.decoded - start, "reverse": _now(self.device) - self.decoded}
        self.accumulator_bytes, self.store_bytes = self.acc.bytes(), self.store.bytes()
        self.acc.release()
        self.store = self.acc = None
        self.checkpoints = {}
        return loss

    def start_reverse(self) -> None:
        self.decoded = _now(self.device)
        self.memory = {"after decode": _allocated(self.device)}
        self.acc = Accumulators(self.store, self.config.accumulators, self.device)
        self.memory["accumulators"] = _allocated(self.device)

    def finish_reverse(self, loss) -> float:
        return 0.0 if loss is None else loss

    def train_chunk(self, chunk, entry: dict, gf: int) -> float:
        s, e = chunk.start, chunk.end
        cache = WalkCache(
            self.store, s, e, entry, train=True, grad_from=gf, tap_states=chunk.index > 0
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


def probe(model, chunk: int, store_dtype: str | None = None) -> Activations:
    """One chunk's graph on this model (budget.fit), measured by exact walks of its own with
    torch's CUDA peak counter: less the store and accumulators the walk held and the adapter's
    gradient (counted apart). Once per model, chunk, store dtype and adapter."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ConfigError(
            f"--memory-budget-mib counts CUDA memory, and the model is on the {device.type}"
        )
    trainable = [
        (n, tuple(p.shape), p.dtype) for n, p in model.named_parameters() if p.requires_grad
    ]
    key = (id(model), chunk, store_dtype, hash(tuple(trainable)))  # a new adapter: a new graph
    if key in _probes and _probes[key][0]() is model:
        return _probes[key][1]
    grads = budgets.tensor_bytes(p for p in model.parameters() if p.requires_grad)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = np.random.default_rng(0).integers(0, vocab, 3 * chunk + 1)

    def graph(n: int, horizon: int) -> float:
        window = Window.of(ids[:n], ids[1 : n + 1], np.ones(n))
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        walk = ExactWalk(model, window, TorchWalkConfig(chunk, horizon, store_dtype=store_dtype))
        walk.run()
        peak = torch.cuda.max_memory_allocated(device) - base
        model.zero_grad(set_to_none=True)
        return peak - walk.store_bytes - walk.accumulator_bytes - grads

    acts = budgets.fit(chunk, footprint(model).kv_width * 4, graph)
    _probes[key] = (weakref.ref(model), acts)
    return acts


_probes: dict[tuple, tuple] = {}


class PlainWalk(Walk, PlainAlgorithm):
    """Chunk by chunk, the prefix as constants, the gradient cut at every chunk boundary; with
    `step`, one step per labelled chunk (the chunk is then re-decoded under the new adapter)."""

    def run(self, step: Callable[[], None] | None = None) -> float:
        loss = self.walk(step)
        self.store = None
        return loss

    def train_plain(self, chunk, states: dict, step) -> float:
        cache = WalkCache(
            self.store, chunk.start, chunk.end, states, train=True, grad_from=chunk.start
        )
        loss = self.chunk_loss(chunk.start, chunk.end, cache)
        loss.backward()
        share = float(loss.detach())
        if step is not None:
            step()
        return share

    def finish_plain(self, loss) -> float:
        return 0.0 if loss is None else loss


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
