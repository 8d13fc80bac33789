"""The walks over one window: exact (one step on the whole window's gradient) and plain.

Exact walk (see docs/DESIGN.md):
  1. decode_forward: every chunk but the last (whose K/V no chunk reads), first to last, runs
     with no gradient against the K/V store of the positions before it; its K/V go into the
     store, and (recurrent layers) the state entering every stride-th chunk is kept.
  2. reverse: every needed chunk, last to first, runs as a graph whose inputs are the adapter, the
     prefix K/V on [grad_from, start) and the entry state; its objective is its share of the loss
     plus <own K/V, adjoint> + <exit state, adjoint>, the adjoints being what later chunks sent
     back.
     The gradients go to the adapter's sum, the K/V accumulators and the state adjoint.
  3. the caller takes one optimizer step on the summed gradient.

Invariant: the adapter does not change between the start of decode_forward and the end of
reverse. The reverse pass recomputes each chunk's K/V and exit state and pairs them with adjoints
taken against the stored ones; a step in between would make every surrogate the gradient of a
different function.

Plain walk: chunk by chunk, the prefix as constants, the chunk's loss only; with a step per chunk,
the chunk is then re-decoded under the new adapter so later chunks read what it now produces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn

from . import adapters, arch, budget, layerwise
from .accum import ACCUMULATOR_DTYPES, Accumulators
from .attention import Prefix, tiled_attention
from .delta import fast_recurrence
from .guards import NonFinite, check_finite, check_ids  # noqa: F401  (NonFinite: raised here)
from .loss import head_loss, weighted_loss
from .plan import MIB, Chunk, OutOfMemory, PlanError, cut, plan_window
from .store import KVStore, check_cache_type
from .taps import ChunkKV, ChunkState, eager_layers, release, walk_layers

log = logging.getLogger("mlxwalk")

WALKS = ("exact", "plain", "one-graph")
ATTENTIONS = ("auto", "tiled", "fused")

State = list[list[mx.array]] | None  # per recurrent layer, its state arrays


@dataclass
class WalkConfig:
    chunk: int
    horizon: int = 0  # 0 = the whole window
    cache_type: str = "float32"
    recompute: bool = False  # activation checkpointing inside each chunk's graph
    host_budget_mib: float | None = None
    memory_budget_mib: float | None = None  # all MLX holds while a window trains (budget.py)
    seed: int | None = None  # seeds dropout per chunk, identically in the decode and the graph
    follow_runs: bool = True  # chunks never cross a change of weight (see plan.cut)
    accumulator_dtype: str = "float32"
    attention: str = "auto"  # "tiled" (chunk_attention), "fused" (mlx-lm's), auto: fused on CUDA
    strict_exact: bool = False  # refuse a window the memory budget would narrow the horizon of

    @property
    def tiled(self) -> bool:
        if self.attention == "auto":
            return not mx.cuda.is_available()
        return self.attention == "tiled"

    def check(self) -> WalkConfig:
        if self.chunk < 1:
            raise PlanError(f"chunk must be at least 1, got {self.chunk}")
        if self.horizon < 0:
            raise PlanError(f"horizon must be 0 (the whole window) or positive, got {self.horizon}")
        check_cache_type(self.cache_type)
        if self.attention not in ATTENTIONS:
            raise PlanError(
                f"attention {self.attention!r} is unknown; choose one of {', '.join(ATTENTIONS)}"
            )
        if self.accumulator_dtype not in ACCUMULATOR_DTYPES:
            raise PlanError(
                f"accumulator dtype {self.accumulator_dtype!r} is unknown; "
                f"choose one of {', '.join(ACCUMULATOR_DTYPES)}"
            )
        return self

    @property
    def host_budget(self) -> int | None:
        return None if self.host_budget_mib is None else int(self.host_budget_mib * MIB)

    @property
    def device_budget(self) -> int | None:
        return None if self.memory_budget_mib is None else int(self.memory_budget_mib * MIB)


@dataclass(frozen=True)
class Window:
    inputs: np.ndarray  # int, length n
    targets: np.ndarray  # int, length n
    weights: np.ndarray  # float, length n; 0 = context

    @classmethod
    def of(cls, inputs, targets, weights) -> Window:
        x, y = np.asarray(inputs).reshape(-1), np.asarray(targets).reshape(-1)
        w = np.asarray(weights, dtype=np.float32).reshape(-1)
        if not (len(x) == len(y) == len(w)):
            raise PlanError(
                f"inputs, targets and weights differ in length ({len(x)}, {len(y)}, {len(w)})"
            )
        if (w < 0).any():
            raise PlanError("weights must not be negative")
        if not (w > 0).any():
            raise PlanError("the window has no labelled position (every weight is 0)")
        return cls(x.astype(np.int32), y.astype(np.int32), w)

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def total(self) -> float:
        return float(self.weights.sum())

    def arrays(self, start: int, end: int) -> tuple[mx.array, mx.array, mx.array]:
        return (
            mx.array(self.inputs[start:end])[None],
            mx.array(self.targets[start:end])[None],
            mx.array(self.weights[start:end])[None],
        )


def _zeros(shape: tuple[int, ...]) -> mx.array:
    """Zeros that hold no memory (a broadcast scalar): the taps' values are never read."""
    return mx.broadcast_to(mx.zeros((1,) * len(shape), mx.float32), shape)


@contextmanager
def walking(model: nn.Module, recompute: bool) -> Iterator[None]:
    """The model as the walk runs it: taps through every layer, the chunked delta rule."""
    with walk_layers(model, recompute), fast_recurrence(model), tiled_attention(model):
        yield


class _ChunkRunner:
    """What both walks do with a chunk: build its caches, decode it, run its graph."""

    def __init__(self, model: nn.Module, window: Window, config: WalkConfig, layout=None):
        self.model = model
        self.window = window
        self.config = config.check()
        self.layout = layout or arch.inspect(model)
        check_ids(window, self.layout.vocab)
        check_cache_type(self.config.cache_type, self.layout.head_dims)
        self.head = arch.head(model)
        self.store: KVStore | None = None
        self.seed = self._dropout_seed()
        self.on_chunk: Callable[[str, int, int], None] | None = None  # (phase, done, of)

    def _tick(self, phase: str, done: int, of: int) -> None:
        if self.on_chunk is not None:
            self.on_chunk(phase, done, of)

    def _dropout_seed(self) -> int | None:
        """With dropout, the walk's seed: the configured one, or one drawn for this walk. Refuses
        recompute with dropout: a checkpointed layer would redraw its masks in the backward."""
        if not adapters.dropout(self.model):
            return self.config.seed
        if self.config.recompute:
            raise PlanError(
                "recompute with LoRA dropout > 0 is refused: recomputing a layer would draw new "
                "dropout masks, and the gradient would not be the window's; use one or the other"
            )
        if self.config.seed is not None:
            return self.config.seed
        return int(mx.random.randint(0, 1 << 30, ()).item())

    def _seed(self, chunk: Chunk) -> None:
        """Dropout draws the same masks for a chunk wherever the chunk runs: in its decode, its
        graph and any re-decode from a checkpoint, so the surrogates pair equal K/V and states."""
        if self.seed is not None:
            mx.random.seed(self.seed * 1_000_003 + chunk.index)

    def _new_store(self, positions: int) -> None:
        lay = self.layout
        self.store = KVStore(list(lay.kv_shapes), positions, self.config.cache_type, lay.dtype)

    def zero_state(self) -> State:
        lay = self.layout
        if not lay.recurrent:
            return None
        return [
            [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
            for shapes, dtypes in zip(lay.state_shapes, lay.state_dtypes)
        ]

    def caches(
        self,
        chunk: Chunk,
        entry: State,
        *,
        grad_from: int | None = None,  # None: the prefix is constant
        tap_state: bool = False,
        acc: Accumulators | None = None,
    ) -> list:
        """One cache per layer for `chunk`; taps on [grad_from, start) and, if asked, the state."""
        out, a, r, dtype = [], 0, 0, self.layout.dtype
        s = chunk.start
        for kind in self.layout.kinds:
            if kind == "attention":
                prefix = Prefix(self.store, a, s, dtype) if s > 0 else None
                taps = None
                if grad_from is not None and grad_from < s:
                    h, dk, dv = self.layout.kv_shapes[a]
                    taps = (_zeros((1, h, s - grad_from, dk)), _zeros((1, h, s - grad_from, dv)))
                adjoint = acc.adjoint(a, s, chunk.end) if acc is not None else None
                out.append(ChunkKV(s, prefix, grad_from, taps, adjoint, self.config.tiled))
                a += 1
            else:
                adjoint = acc.state[r] if acc is not None and acc.state is not None else None
                out.append(ChunkState(entry[r], tapped=tap_state, adjoint=adjoint))
                r += 1
        return out

    def run_chunk(self, x, caches: list, y, w, scored: bool) -> mx.array:
        """The model over a chunk through its caches; the chunk's loss share if `scored` (its
        logits in blocks, see head_loss), else 0 and no logits at all."""
        total = self.window.total
        if self.head is None:
            logits = self.model(x, cache=caches)
            return weighted_loss(logits, y, w, total) if scored else mx.array(0.0)
        h = self.head.body(x, caches)
        return head_loss(self.head, h, y, w, total) if scored else mx.array(0.0)

    def graph_by_layer(self, chunk: Chunk, caches: list):
        """`graph` with recompute, one layer at a time (see layerwise.gradient)."""
        x, y, w = self.window.arrays(chunk.start, chunk.end)
        self._seed(chunk)
        scored = chunk.labelled
        return layerwise.gradient(self.model, self.head, caches, x, y, w, self.window.total, scored)

    def decode(self, chunk: Chunk, entry: State, write: bool = True, losses: list | None = None):
        """Run `chunk` with no gradient; write its K/V to the store; return its exit state.
        With `losses`, the chunk's loss share is appended to it."""
        caches = self.caches(chunk, entry)
        x, y, w = self.window.arrays(chunk.start, chunk.end)
        self._seed(chunk)
        scored = losses is not None and chunk.labelled
        # On CUDA a layer at a time (freed buffers return only once the GPU has run the graph)
        with eager_layers() if mx.cuda.is_available() else nullcontext():
            loss = self.run_chunk(x, caches, y, w, scored)  # the logits only if scored
        exit_state = [c.produced() for c in caches if isinstance(c, ChunkState)] or None
        kv = [c.produced() for c in caches if isinstance(c, ChunkKV)] if write else []
        if scored:
            losses.append(loss)
        # Evaluate before writing: the graph reads the store, and a store still referenced by a
        # pending read can't be updated in place (MLX would copy it, a window-sized copy).
        mx.eval(kv, exit_state, losses)
        release(caches)
        for a, (k, v) in enumerate(kv):
            self.store.write(a, chunk.start, k, v)
        mx.eval(self.store.arrays())
        return exit_state

    def graph(self, chunk: Chunk, caches: list):
        """The chunk's loss share plus its surrogates, differentiated in the adapter and taps."""
        if self.config.recompute and self.head is not None:
            return self.graph_by_layer(chunk, caches)
        model = self.model
        x, y, w = self.window.arrays(chunk.start, chunk.end)
        self._seed(chunk)

        def objective(params, inputs):
            model.update(params)
            for c, i in zip(caches, inputs):
                c.bind(i)
            # A context chunk's logits stay out of the graph: it trains through its surrogate.
            loss = self.run_chunk(x, caches, y, w, chunk.labelled)
            return loss + sum(c.surrogate_value for c in caches), loss

        (_, loss), (g_params, g_inputs) = mx.value_and_grad(objective, argnums=(0, 1))(
            model.trainable_parameters(), [c.inputs() for c in caches]
        )
        return loss, g_params, g_inputs


class ExactWalk(_ChunkRunner):
    """One window's exact walk; the plan (and any refusal) comes before any array."""

    def __init__(self, model: nn.Module, window: Window, config: WalkConfig, layout=None):
        super().__init__(model, window, config, layout)
        self.plan = self.make_plan(self.config.host_budget)
        self.checkpoints: dict[int, State] = {}
        self.horizon_used = self.config.horizon  # narrowed per chunk if the memory budget asks
        self.estimate = self.admit()
        if self.config.strict_exact:
            self.refuse_narrowing()

    def make_plan(self, host_budget: int | None):
        return plan_window(
            self.window.weights.tolist(),
            self.config.chunk,
            self.layout.footprint(),
            horizon=self.config.horizon,
            host_budget=host_budget,
            accumulator_element_bytes=ACCUMULATOR_DTYPES[self.config.accumulator_dtype].size,
            follow_runs=self.config.follow_runs,
        )

    def admit(self) -> budget.Estimate | None:
        """With a memory budget: the walk's memory, or a refusal before any array of the window.
        Unless a host budget says otherwise, the checkpoints get what the rest leaves over (a
        longer stride when they would not fit); the walk is refused if even one chunk of taps
        would not fit."""
        device = self.config.device_budget
        if device is None:
            return None
        self.refuse_floor(device)
        self.acts = budget.probe(self.model, self.config.chunk, self.config.recompute,
                                 self.config.attention)  # fmt: skip
        est = self.measure(self.plan)
        last = self.plan.chunks[-1]
        one_chunk = min(self.plan.chunk, last.start - last.grad_from)  # the fewest taps there are
        least = replace(est, graph=self.graph_bytes(one_chunk, self.plan.chunks[-1].start))
        if least.total > device and self.layout.recurrent and self.config.host_budget is None:
            room = device - (least.total - least.host)
            try:  # fewer checkpoints, each re-decoded from the one before it in the reverse pass
                plan = self.make_plan(max(room, 0))
            except OutOfMemory:
                plan = None
            if plan is not None:
                self.plan, est = plan, self.measure(plan)
                least = replace(est, graph=least.graph)
        budget.admit(least, device, budget.what_fits(self.layout, self.config.cache_type))
        return est

    def refuse_floor(self, device: int) -> None:
        """A budget below what the walk holds before any graph (the weights, the adapter, the
        store, the accumulators, and the checkpoints unless a longer stride can shrink them) is
        refused at once, without measuring a chunk's graph."""
        self.acts = budget.Activations(self.config.chunk, 0.0, 0.0)
        floor = self.measure(self.plan)
        if self.layout.recurrent and self.config.host_budget is None:
            floor = replace(floor, checkpoints=0)
        budget.admit(floor, device, budget.what_fits(self.layout, self.config.cache_type))

    def measure(self, plan) -> budget.Estimate:
        """The estimate for `plan`, with whatever else MLX holds now beyond the model's weights and
        the adapter's share (arrays the walk can't know of count against the budget too)."""
        est = budget.estimate(self.model, self.layout, self.acts, plan, self.config.cache_type)
        return replace(est, resident=max(0, mx.get_active_memory() - est.weights - est.adapter))

    def graph_bytes(self, taps: int, prefix: int) -> int:
        return budget.graph_bytes(self.acts, self.layout.footprint(), taps, prefix)

    def grad_from(self, chunk: Chunk) -> int:
        """The chunk's first tapped position: the plan's, or, when the walk would exceed the
        memory budget with this chunk's graph, `narrowed_taps` before it. Only this chunk is
        narrowed; the next window starts from the requested horizon."""
        taps = chunk.start - chunk.grad_from
        narrowed = self.narrowed_taps(chunk)
        if narrowed < taps:
            log.info(
                "chunk %d: its graph with %d tapped positions exceeds the memory budget of "
                "%.1f MiB; horizon narrowed to %d for this chunk",
                chunk.index, taps, self.config.device_budget / MIB, narrowed,
            )  # fmt: skip
            self.horizon_used = (
                narrowed if self.horizon_used == 0 else min(self.horizon_used, narrowed)
            )
        return chunk.start - narrowed

    def narrowed_taps(self, chunk: Chunk) -> int:
        """The tapped positions the chunk's graph fits the memory budget with: the plan's, else
        half of them and again (a multiple of the chunk, never below one chunk)."""
        taps, size = chunk.start - chunk.grad_from, self.plan.chunk
        if self.estimate is None or chunk.start == 0:
            return taps
        rest = self.estimate.total - self.estimate.graph
        fits = lambda t: rest + self.graph_bytes(t, chunk.start) <= self.config.device_budget  # noqa: E731
        narrowed = taps
        while narrowed > size and not fits(narrowed):
            narrowed = max(size, narrowed // 2 // size * size)
        return narrowed

    def refuse_narrowing(self) -> None:
        """--strict-exact: a window whose gradient the budget would cut is refused up front."""
        for chunk in self.plan.chunks:
            taps = chunk.start - chunk.grad_from
            if (narrowed := self.narrowed_taps(chunk)) < taps:
                raise OutOfMemory(
                    f"the memory budget of {self.config.device_budget / MIB:,.0f} MiB fits chunk "
                    f"{chunk.index} only with its horizon narrowed from {taps} to {narrowed} "
                    "positions, and --strict-exact refuses a gradient that is not exact: raise "
                    "--memory-budget-mib, or give --recompute or a smaller --cache-type or "
                    "--chunk"
                )

    def run(self) -> tuple[mx.array, dict]:
        limit = None
        # On the CPU and Metal, MLX's scheduler waits for work to finish past its memory limit.
        # On CUDA the limit only makes its allocator return cached buffers through the stream's
        # asynchronous frees, which a 27B walk at 64K turned into an out-of-memory error on an
        # H200 (docs/BENCHMARKS.md): there the estimate and the horizon alone keep the budget.
        if self.estimate is not None and not mx.cuda.is_available():
            limit = mx.set_memory_limit(self.config.device_budget)
        try:
            with walking(self.model, self.config.recompute):
                self.decode_forward()
                return self.reverse()
        finally:
            if limit is not None:
                mx.set_memory_limit(limit)

    def decode_forward(self) -> None:
        self._new_store(self.plan.computed)
        self.checkpoints = {}
        state = self.zero_state()
        chunks = self.plan.chunks
        for chunk in chunks:
            if self.plan.checkpointed(chunk.index):
                self.checkpoints[chunk.index] = state
            # The last chunk's K/V and exit state are read by no later chunk: not decoded.
            if chunk is not chunks[-1]:
                state = self.decode(chunk, state)
            self._tick("decode", chunk.index + 1, len(chunks))

    def entry_state(self, chunk: Chunk) -> State:
        """The state entering `chunk`: its checkpoint, or decoded forward from the nearest one."""
        if not self.layout.recurrent:
            return None
        first = chunk.index - chunk.index % self.plan.stride
        state = self.checkpoints[first] if first > 0 else self.zero_state()
        for c in self.plan.chunks[first : chunk.index]:
            state = self.decode(c, state, write=False)
        return state

    def reverse(self) -> tuple[mx.array, dict]:
        acc = Accumulators(
            list(self.layout.kv_shapes), self.plan.computed, self.config.accumulator_dtype
        )
        loss = mx.array(0.0)
        order = self.plan.reverse()
        for done, chunk in enumerate(order, 1):
            loss = loss + self.train_chunk(chunk, acc)
            mx.eval(loss)
            self._tick("train", done, len(order))
        return loss, acc.grads

    def train_chunk(self, chunk: Chunk, acc: Accumulators) -> mx.array:
        gf = self.grad_from(chunk)
        caches = self.caches(
            chunk, self.entry_state(chunk), grad_from=gf, tap_state=chunk.index > 0, acc=acc
        )
        loss, g_params, g_inputs = self.graph(chunk, caches)
        mx.eval(loss, g_params, g_inputs)
        release(caches)  # the adjoint slices too, so the updates below reuse the buffers
        kv = [g or None for kind, g in zip(self.layout.kinds, g_inputs) if kind == "attention"]
        acc.add_kv(gf, kv)
        states = [g for kind, g in zip(self.layout.kinds, g_inputs) if kind == "recurrent"]
        acc.state = states if chunk.index > 0 and states else None
        acc.add_grads(g_params)
        mx.eval(acc.arrays())
        return loss


class PlainWalk(_ChunkRunner):
    """Chunk by chunk; the gradient stops at every chunk boundary."""

    def run(self, step: Callable[[dict], None] | None = None) -> tuple[mx.array, dict]:
        """With `step`, one optimizer step per labelled chunk; the result's gradient is the sum of
        the chunks' gradients, each taken at the adapter that chunk saw."""
        chunks = cut(self.window.weights.tolist(), self.config.chunk, self.config.follow_runs)
        loss, grads = mx.array(0.0), None
        with walking(self.model, self.config.recompute):
            self._new_store(chunks[-1].end)
            state = self.zero_state()
            for chunk in chunks:
                if chunk.labelled:
                    caches = self.caches(chunk, state)
                    chunk_loss, g, _ = self.graph(chunk, caches)
                    mx.eval(chunk_loss, g)
                    release(caches)
                    if step is not None:
                        check_finite(chunk_loss, g, f"chunk {chunk.index + 1}'s ")
                        step(g)
                    loss = loss + chunk_loss
                    grads = g if grads is None else _tree_add(grads, g)
                if chunk is not chunks[-1]:  # no later chunk reads the last one's K/V
                    state = self.decode(chunk, state)
                self._tick("train", chunk.index + 1, len(chunks))
        return loss, grads


def window_loss(model: nn.Module, window: Window, config: WalkConfig, layout=None) -> float:
    """The window's loss, decoded chunk by chunk with no gradient (for evaluation)."""
    runner = _ChunkRunner(model, window, config, layout)
    chunks = cut(window.weights.tolist(), runner.config.chunk, runner.config.follow_runs)
    losses: list = []
    with walking(model, False):
        runner._new_store(chunks[-1].end)
        state = runner.zero_state()
        for chunk in chunks:
            state = runner.decode(chunk, state, losses=losses)
    return float(sum(v.item() for v in losses))


def _tree_add(a, b):
    from mlx.utils import tree_map

    return tree_map(mx.add, a, b)


def one_graph(model: nn.Module, window: Window) -> tuple[mx.array, dict]:
    """The reference: the whole window as one graph, no cache."""
    x, y, w = window.arrays(0, len(window))

    def objective(params):
        model.update(params)
        return weighted_loss(model(x), y, w, window.total)

    with fast_recurrence(model):
        return mx.value_and_grad(objective)(model.trainable_parameters())


def window_gradient(
    model: nn.Module,
    inputs,
    targets,
    weights,
    *,
    chunk: int,
    walk: str = "exact",
    cache_type: str = "float32",
    horizon: int = 0,
    recompute: bool = False,
    host_budget_mib: float | None = None,
    memory_budget_mib: float | None = None,
    accumulator_dtype: str = "float32",
    attention: str = "auto",
) -> tuple[float, dict]:
    """The window's loss sum(w * CE) / sum(w) and its gradient in `model.trainable_parameters()`.

    walk="exact" walks the window in chunks and equals "one-graph" to rounding; "plain" returns the
    sum of its per-chunk gradients at the unchanged adapter. Raises ValueError for a window with no
    labelled position, chunk < 1, or lengths that differ.
    """
    if walk not in WALKS:
        raise PlanError(f"walk {walk!r} is unknown; choose one of {', '.join(WALKS)}")
    window = Window.of(inputs, targets, weights)
    config = WalkConfig(
        chunk=chunk,
        horizon=horizon,
        cache_type=cache_type,
        recompute=recompute,
        host_budget_mib=host_budget_mib,
        memory_budget_mib=memory_budget_mib,
        accumulator_dtype=accumulator_dtype,
        attention=attention,
    ).check()
    if walk == "one-graph":
        loss, grads = one_graph(model, window)
    elif walk == "exact":
        loss, grads = ExactWalk(model, window, config).run()
    else:
        loss, grads = PlainWalk(model, window, config).run()
    mx.eval(loss, grads)
    return loss.item(), grads


def train_window(
    model: nn.Module,
    optimizer,
    window: Window,
    config: WalkConfig,
    walk: str = "exact",
    on_chunk: Callable[[str, int, int], None] | None = None,
    layout=None,  # the model's arch.Layout, when the caller has it (else read per window)
    clip: float | None = None,  # each step's gradient clipped to this global L2 norm
):
    """Train on one window: the exact walk takes one step, the plain walk one per labelled chunk.
    A refusal (memory, bad input) is raised before any array of the window exists or any step is
    taken (a memory budget's probe, run once per model and chunk size, comes first); a NaN or
    infinite loss or gradient raises NonFinite before the step that would apply it (the plain
    walk may have stepped on the window's earlier chunks).
    Returns the walk, whose `loss` holds the window's loss (at the adapter it started from)."""

    def step(grads) -> None:
        if clip is not None:
            grads, _ = optim.clip_grad_norm(grads, clip)
        optimizer.update(model, grads)

    if walk == "exact":
        runner = ExactWalk(model, window, config, layout)
        runner.on_chunk = on_chunk
        loss, grads = runner.run()
        check_finite(loss, grads)
        step(grads)
    elif walk == "plain":
        runner = PlainWalk(model, window, config, layout)
        runner.on_chunk = on_chunk
        loss, _ = runner.run(step=step)
    else:
        raise PlanError(f"walk {walk!r} cannot train; choose exact or plain")
    mx.eval(model.parameters(), optimizer.state)
    runner.loss = loss.item()
    return runner
