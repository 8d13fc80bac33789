"""The exact walk over one window on MLX: the algorithm is mlxwalk/walking.py's (decode the
window forward into the K/V store, then train it chunk by chunk in reverse, narrowing a chunk's
horizon only where the memory budget asks); here are its MLX mechanics: the plan and its
admission under a memory budget (the probe, a longer checkpoint stride, kept inputs left out),
the store, the caches and taps of a chunk's graph, the K/V gradient accumulators."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
from mlx import nn

from ..ops.products import head_swapped
from ..plan import MIB, Chunk, OutOfMemory, plan_window
from ..walking import ExactAlgorithm
from . import budget
from . import probe as probes
from .accum import ACCUMULATOR_DTYPES, Accumulators
from .config import DECODE_RUN, WalkConfig, Window
from .runner import ChunkRunner, State, walking
from .taps import release


class ExactWalk(ChunkRunner, ExactAlgorithm):
    """One window's exact walk; the plan (and any refusal) comes before any array."""

    def __init__(self, model: nn.Module, window: Window, config: WalkConfig, layout=None):
        super().__init__(model, window, config, layout)
        self.plan = self.make_plan(self.config.host_budget)
        self.checkpoints: dict[int, State] = {}
        self.kept: dict[int, list[mx.array]] = {}  # per decoded chunk, its layers' inputs
        self.keep = self.keep_mode()  # "all", "stem" or "off": which layer inputs are kept
        # an untied quantized head's products: auto is dequantized until a budget says otherwise
        # ("as is": no head the walk would dequantize)
        swappable = head_swapped(model, self.config.products)
        auto = "dequantized" if swappable else "as is"
        self.head_products = {"auto": auto}.get(c := self.config.head_products, c)
        self.horizon_used = self.config.horizon  # narrowed per chunk if the memory budget asks
        self.remedies = (
            "raise --memory-budget-mib, or give --recompute or a smaller --cache-type or --chunk"
        )
        self.estimate = self.admit()
        if self.config.strict_exact:
            self.refuse_narrowing()

    def keep_mode(self) -> str:
        """Kept inputs serve recompute's layer-by-layer reverse pass: every trained layer's
        ("all", for on and auto) or only the stem's output ("stem", where there is a stem)."""
        wanted = self.config.keep_inputs
        if not self.config.recompute or self.head is None or wanted == "off":
            return "off"
        if wanted == "stem":
            return "stem" if self.stem else "off"
        return "all"

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
        reach = self.plan.chunks[-1].start
        self.acts = probe(self.model, self.probed(), reach=reach)
        est = self.measure(self.plan)
        auto_head = self.config.head_products == "auto" and self.head_products == "dequantized"
        if auto_head and est.total > device:
            # auto: the head's dequantized copy is the first thing given up (its gain is the
            # smallest: 1 s of the 8B-shaped window's 20, docs/BENCHMARKS.md)
            self.head_products = "quantized"
            self.acts = probe(self.model, self.probed(), reach=reach)
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
        # auto: every layer's inputs where they fit with the rest, else the stem's output alone
        fallbacks = ["stem", "off"] if self.stem else ["off"]
        while self.config.keep_inputs == "auto" and self.keep != "off" and est.total > device:
            self.keep = fallbacks.pop(0)
            est = self.measure(self.plan)
            least = replace(est, graph=least.graph)
        budget.admit(least, device, budget.what_fits(self.layout, self.config.cache_type))
        return est

    def probed(self) -> WalkConfig:
        """The config a probe measures: the run's, with the head's products as this walk has
        them."""
        head = "auto" if self.head_products == "as is" else self.head_products
        return replace(self.config, head_products=head)

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
        inputs = self.inputs_bytes(plan)
        resident = max(0, mx.get_active_memory() - est.weights - est.adapter)
        return replace(est, resident=resident, inputs=inputs)

    def inputs_bytes(self, plan) -> int:
        if self.keep == "off":
            return 0
        return budget.inputs_bytes(self.layout, plan, self.stem, stem_only=self.keep == "stem")

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
        inputs = self.inputs_bytes(self.plan)
        return est.store + est.accumulators + est.checkpoints + inputs

    def graph_bytes(self, taps: int, prefix: int) -> int:
        return budget.graph_bytes(self.acts, self.layout.footprint(), taps, prefix)

    # --- the mechanics the shared algorithm (mlxwalk/walking.py) runs on ---------------------

    @property
    def recurrent(self) -> bool:
        return self.layout.recurrent

    @property
    def budget_mib(self) -> float | None:
        return None if self.estimate is None else self.config.device_budget / MIB

    def fits(self, chunk: Chunk, taps: int) -> bool:
        rest = self.estimate.total - self.estimate.graph
        return rest + self.graph_bytes(taps, chunk.start) <= self.config.device_budget

    def run(self, chunks: int | None = None) -> tuple[mx.array, dict]:
        """The window's loss and gradient. `chunks`: the reverse pass stops after that many
        chunks (the memory probe)."""
        limit = None
        # On the CPU and Metal, MLX's scheduler waits for work to finish past its memory limit.
        # On CUDA the limit only makes its allocator return cached buffers through the stream's
        # asynchronous frees, which a 27B walk at 64K turned into an out-of-memory error on an
        # H200 (docs/BENCHMARKS.md): there the estimate and the horizon alone keep the budget.
        if self.estimate is not None and not mx.cuda.is_available():
            limit = mx.set_memory_limit(self.config.device_budget)
        try:
            return self.walk(chunks)
        finally:
            self.kept = {}  # a chunk the reverse pass did not need leaves its inputs here
            if limit is not None:
                mx.set_memory_limit(limit)

    def walking(self):
        return walking(self.model, self.config.products, self.head_products == "dequantized")

    def new_store(self, positions: int) -> None:
        self._new_store(positions)

    def kept_inputs(self, chunk: Chunk) -> list[mx.array] | None:
        return self.kept.get(chunk.index)

    def run_chunks(self) -> int:
        """Whole chunks in `config.decode_run` positions (see WalkConfig); one with dropout,
        whose masks are drawn per chunk."""
        run = self.config.decode_run
        if run is None:  # where attention is fused: CUDA at half precision (cuDNN)
            fused = mx.cuda.is_available() and self.layout.dtype in (mx.float16, mx.bfloat16)
            run = DECODE_RUN if fused else 0
        if self.seed is not None:
            return 1
        return max(1, run // self.plan.chunk)

    def decode_run(self, run: list[Chunk], state: State) -> State:
        """The run's chunks as one span through the model: its K/V written, each chunk's kept
        inputs sliced from the span's."""
        if len(run) == 1:
            return self.decode_chunk(run[0], state)
        span = replace(run[0], end=run[-1].end, weight=sum(c.weight for c in run))
        if self.keep == "off":
            return self.decode(span, state)
        with self.layers.keeping(stem_only=self.keep == "stem") as kept:
            state = self.decode(span, state)
        mx.eval(kept)
        for c in run:
            a, b = c.start - span.start, c.end - span.start
            # (1, span, hidden) -> (1, chunk, hidden); a frozen layer keeps None
            self.kept[c.index] = [None if x is None else x[:, a:b] for x in kept]
        return state

    def decode_chunk(self, chunk: Chunk, state: State) -> State:
        """With kept inputs, each layer's input of the chunk is kept for its reverse step."""
        if self.keep == "off":
            return self.decode(chunk, state)
        with self.layers.keeping(stem_only=self.keep == "stem") as kept:
            state = self.decode(chunk, state)
        mx.eval(kept)
        self.kept[chunk.index] = kept
        return state

    def start_reverse(self) -> None:
        lay = self.layout
        tapped = [i >= self.stem for i in lay.attention]
        self.acc = Accumulators(
            list(lay.kv_shapes), self.plan.computed, self.config.accumulator_dtype, tapped
        )

    def finish_reverse(self, loss) -> tuple[mx.array, dict]:
        loss = mx.array(0.0) if loss is None else loss
        mx.eval(loss)
        return loss, self.acc.grads

    def train_chunk(self, chunk: Chunk, entry: State, gf: int) -> mx.array:
        acc = self.acc
        caches = self.caches(chunk, entry, grad_from=gf, tap_state=chunk.index > 0, acc=acc)
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
    base = WalkConfig(
        chunk=config.chunk,
        recompute=config.recompute,
        attention=config.attention,
        cache_type=config.cache_type,
        products=config.products,
        head_products=config.head_products,
        decode_run=config.decode_run,
        keep_inputs=probes.kept_for(config),
    )

    def peak(ids: np.ndarray, n: int, horizon: int) -> int:
        window = Window.of(ids[:n], ids[1 : n + 1], np.ones(n))
        walk = ExactWalk(model, window, replace(base, horizon=horizon))
        return budget.live_peak(lambda: walk.run(chunks=1)) - walk.held()

    reach = probes.prefix_for(config.chunk, 1 << 62) if reach is None else reach
    try:
        return probes.cached(model, config, reach, peak, echo)
    except RuntimeError as e:  # the device's own allocation failed: the probe's walk is the run's
        if not probes.out_of_device_memory(e):
            raise
        mx.clear_cache()
        raise OutOfMemory(
            f"device memory: measuring one chunk's graph over a prefix of "
            f"{probes.prefix_for(config.chunk, reach):,} positions ran out of the device's memory "
            "(the probe walks the window as the run does); a shorter window, a smaller chunk or "
            "an 8-bit K/V store would need less"
        ) from None
