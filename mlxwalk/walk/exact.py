"""The exact walk over one window (see docs/DESIGN.md):
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
"""

from __future__ import annotations

import logging
from dataclasses import replace

import mlx.core as mx
import numpy as np
from mlx import nn

from ..plan import MIB, Chunk, OutOfMemory, plan_window
from . import budget
from . import probe as probes
from .accum import ACCUMULATOR_DTYPES, Accumulators
from .config import WalkConfig, Window
from .runner import ChunkRunner, State, walking
from .taps import release

log = logging.getLogger("mlxwalk")


class ExactWalk(ChunkRunner):
    """One window's exact walk; the plan (and any refusal) comes before any array."""

    def __init__(self, model: nn.Module, window: Window, config: WalkConfig, layout=None):
        super().__init__(model, window, config, layout)
        self.plan = self.make_plan(self.config.host_budget)
        self.checkpoints: dict[int, State] = {}
        self.kept: dict[int, list[mx.array]] = {}  # per decoded chunk, its layers' inputs
        self.keep = (
            self.config.recompute and self.head is not None and (self.config.keep_inputs != "off")
        )
        self.horizon_used = self.config.horizon  # narrowed per chunk if the memory budget asks
        self.estimate = self.admit()
        if self.config.strict_exact:
            self.refuse_narrowing()

    def make_plan(self, host_budget: int | None):
        return plan_window(
            self.window.labels,
            self.config.chunk,
            self.layout.footprint(self.stem),
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
        self.acts = probe(self.model, self.config, reach=self.plan.chunks[-1].start)
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
        if self.keep and self.config.keep_inputs == "auto" and est.total > device:
            self.keep = False  # auto: the inputs are kept only where they fit with the rest
            est = self.measure(self.plan)
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
        inputs = budget.inputs_bytes(self.layout, plan, self.stem) if self.keep else 0
        resident = max(0, mx.get_active_memory() - est.weights - est.adapter)
        return replace(est, resident=resident, inputs=inputs)

    def held(self) -> int:
        """What this walk holds besides a chunk's graph: its store, accumulators, checkpoints and
        kept inputs (the probe subtracts them from its walks' peaks)."""
        est = budget.estimate(
            self.model,
            self.layout,
            budget.Activations(self.plan.chunk, 0, 0),
            self.plan,
            self.config.cache_type,
        )
        inputs = budget.inputs_bytes(self.layout, self.plan, self.stem) if self.keep else 0
        return est.store + est.accumulators + est.checkpoints + inputs

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
                chunk.index,
                taps,
                self.config.device_budget / MIB,
                narrowed,
            )
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
        budget_bytes = self.config.device_budget
        return budget.narrowed(
            taps, size, lambda t: rest + self.graph_bytes(t, chunk.start) <= budget_bytes
        )

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

    def run(self, chunks: int | None = None) -> tuple[mx.array, dict]:
        """The window's loss and gradient. `chunks`: the reverse pass stops after that many
        chunks (the memory probe: its first chunk, the one reading the longest prefix, holds the
        walk's largest graph)."""
        limit = None
        # On the CPU and Metal, MLX's scheduler waits for work to finish past its memory limit.
        # On CUDA the limit only makes its allocator return cached buffers through the stream's
        # asynchronous frees, which a 27B walk at 64K turned into an out-of-memory error on an
        # H200 (docs/BENCHMARKS.md): there the estimate and the horizon alone keep the budget.
        if self.estimate is not None and not mx.cuda.is_available():
            limit = mx.set_memory_limit(self.config.device_budget)
        try:
            with walking(self.model):
                self.decode_forward()
                return self.reverse(chunks)
        finally:
            self.kept = {}  # a chunk the reverse pass did not need leaves its inputs here
            if limit is not None:
                mx.set_memory_limit(limit)

    def kept_inputs(self, chunk: Chunk) -> list[mx.array] | None:
        return self.kept.get(chunk.index)

    def decode_forward(self) -> None:
        self._new_store(self.plan.computed)
        self.checkpoints = {}
        state = self.zero_state()
        chunks = self.plan.chunks
        for chunk in chunks:
            if self.plan.checkpointed(chunk.index):
                self.checkpoints[chunk.index] = state
            # The last chunk's K/V and exit state are read by no later chunk: not decoded.
            if chunk is not chunks[-1] and self.keep:
                with self.layers.keeping() as kept:
                    state = self.decode(chunk, state)
                mx.eval(kept)
                self.kept[chunk.index] = kept
            elif chunk is not chunks[-1]:
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

    def reverse(self, chunks: int | None = None) -> tuple[mx.array, dict]:
        lay = self.layout
        tapped = [i >= self.stem for i in lay.attention]
        acc = Accumulators(
            list(lay.kv_shapes), self.plan.computed, self.config.accumulator_dtype, tapped
        )
        loss = mx.array(0.0)
        order = self.plan.reverse()[:chunks]
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
        kinds, sunk = self.layout.kinds, {}
        slot = {layer: a for a, layer in enumerate(self.layout.attention)}

        def sink(i: int, g: list) -> None:
            release([caches[i]])  # its adjoint slice too, so the update reuses the buffer
            if kinds[i] == "attention" and g:
                acc.add_kv(gf, [g if a == slot[i] else None for a in range(len(slot))])
            else:
                sunk[i] = g

        loss, g_params, g_inputs = self.graph(chunk, caches, sink)
        mx.eval(loss, g_params, g_inputs)
        release(caches)  # the adjoint slices too, so the updates below reuse the buffers
        self.kept.pop(chunk.index, None)  # trained: its inputs are read no more
        g_inputs = [sunk.get(i, g) for i, g in enumerate(g_inputs)]
        kv = [g or None for kind, g in zip(kinds, g_inputs) if kind == "attention"]
        acc.add_kv(gf, kv)
        states = [g for kind, g in zip(kinds, g_inputs) if kind == "recurrent"]
        acc.state = states if chunk.index > 0 and states else None
        acc.add_grads(g_params)
        mx.eval(acc.arrays())
        return loss


def probe(model, config: WalkConfig, reach: int | None = None, echo=None) -> budget.Activations:
    """One chunk's graph on this model (probe.py), measured by exact walks of its own with the
    run's chunk, recompute, attention path, store type and kept inputs, over at most `reach`
    positions of prefix (None: as far as the probe goes)."""
    keep = "on" if config.recompute and config.keep_inputs != "off" else "off"
    base = WalkConfig(
        chunk=config.chunk,
        recompute=config.recompute,
        attention=config.attention,
        cache_type=config.cache_type,
        keep_inputs=keep,
    )

    def peak(ids: np.ndarray, n: int, horizon: int) -> int:
        window = Window.of(ids[:n], ids[1 : n + 1], np.ones(n))
        walk = ExactWalk(model, window, replace(base, horizon=horizon))
        return budget.live_peak(lambda: walk.run(chunks=1)) - walk.held()

    reach = probes.prefix_for(config.chunk, 1 << 62) if reach is None else reach
    return probes.cached(model, config, reach, peak, echo)
