"""The exact walk over one window on MLX: the algorithm is algorithm.py's `ExactAlgorithm`
(decode the window forward into the K/V store, then train it chunk by chunk in reverse, narrowing
a chunk's horizon only where the memory budget asks), its admission under a memory budget
admission.py's; here are its MLX mechanics: the store, the kept inputs, the caches and taps of a
chunk's graph, the K/V gradient accumulators."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
from mlx import nn

from ..plan import MIB, Chunk
from . import admission
from .accum import Accumulators
from .activations import Activations
from .algorithm import ExactAlgorithm
from .config import DECODE_RUN, WalkConfig
from .runner import ChunkRunner, State, walking
from .taps import release
from .window import Window


class ExactWalk(ChunkRunner, admission.Admission, ExactAlgorithm):
    """One window's exact walk; the plan (and any refusal) comes before any array.

    Args:
        model: an mlx-lm model with trainable parameters (LoRA layers), any dtype, quantized or
            not; attention and gated delta-net layers (walk/arch.py says which it reads).
        window: the window's ids (int32, length n) and weights (float32, length n).
        config: the walk's settings (WalkConfig): chunk, horizon, cache type, budgets, ...
        layout: the model's arch.Layout, when the caller has it (else read here).
        graphs: one chunk's graph as measured before on this model at these settings
            (admission.Graphs; None: measured here under a memory budget, or the probe's cache).

    Raises:
        OutOfMemory when the memory budget cannot hold the walk, ConfigError for a setting the
        model cannot take, both before any array of the window exists.
    """

    def __init__(
        self,
        model: nn.Module,
        window: Window,
        config: WalkConfig,
        layout=None,
        graphs: admission.Graphs | None = None,
    ):
        super().__init__(model, window, config, layout)
        self.graphs = graphs
        self.keep = self.keep_mode()  # "all", "stem" or "off": which layer inputs are kept
        self.plan = self.make_plan(self.config.host_budget)
        self.checkpoints: dict[int, State] = {}
        self.kept: dict[int, list[mx.array]] = {}  # per decoded chunk, its layers' inputs
        self.head_products = self.head_mode()  # "dequantized", "sliced", "quantized" or "as is"
        self.horizon_used = self.config.horizon  # narrowed per chunk if the memory budget asks
        self.remedies = (
            "raise --memory-budget-mib, or give --recompute or a smaller --cache-type or --chunk"
        )
        self.estimate = self.admit()
        if self.config.strict_exact:
            self.refuse_narrowing()

    # --- the mechanics the shared algorithm (algorithm.py) runs on ---------------------------

    @property
    def recurrent(self) -> bool:
        return self.layout.recurrent

    @property
    def budget_mib(self) -> float | None:
        return None if self.estimate is None else self.config.device_budget / MIB

    def fits(self, chunk: Chunk, taps: int) -> bool:
        rest = self.estimate.reversing - self.estimate.graph
        return rest + self.graph_bytes(taps, chunk.start) <= self.config.device_budget

    def run(self, chunks: int | None = None) -> tuple[mx.array, dict]:
        """The window's loss and gradient.

        Args:
            chunks: the reverse pass stops after that many chunks (the memory probe); None: all.

        Returns:
            (loss, grads): sum(w * CE) / sum(w), a scalar array (float32), and its gradient, a
            tree shaped as `model.trainable_parameters()`; equal to `one_graph`'s to rounding.
        """
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
        return walking(self.model, self.config.products, self.head_products)

    def kept_inputs(self, chunk: Chunk) -> list[mx.array] | None:
        return self.kept.get(chunk.index)

    def run_chunks(self) -> int:
        """Whole chunks the decode runs at once: under a memory budget as the admission
        measured them (`decode_width`), else as `unbudgeted_run` says; one with dropout, whose
        masks are drawn per chunk."""
        if self.seed is not None:
            return 1
        run = self.run_width if self.estimate is not None else self.unbudgeted_run()
        return max(1, run // self.plan.chunk)

    def unbudgeted_run(self) -> int:
        """`config.decode_run`, or by default DECODE_RUN where attention is fused (CUDA at half
        precision: cuDNN), else 0 (chunk by chunk)."""
        run = self.config.decode_run
        if run is None:
            fused = mx.cuda.is_available() and self.layout.dtype in (mx.float16, mx.bfloat16)
            run = DECODE_RUN if fused else 0
        return run

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

    def skips_stem(self) -> bool:
        return bool(self.states_from())

    def drop_stem_store(self) -> None:
        """The stem's attention layers' K/V go once the decode is done: the reverse pass runs
        no stem layer (each chunk starts from its kept stem output), so none reads them. Their
        buffers go back to the system, not to MLX's cache, which would keep them counted."""
        for a, layer in enumerate(self.layout.attention):
            if layer < self.stem:
                self.store.keys[a] = self.store.values[a] = None
        mx.clear_cache()

    def to_hold(self, state: State) -> State:
        """The trained layers' states alone where the stem's output is kept: the reverse pass
        re-decodes from there (`redecode`) and never reads a stem layer's state."""
        start = self.states_from()
        if not start or state is None:
            return state
        return [None if i < start else s for i, s in zip(self.layout.recurrent, state)]

    def redecode(self, chunk: Chunk, state: State) -> State:
        """A chunk decoded again for its exit state: from its kept stem output through the
        trained layers alone, where it is kept (a quarter of the 27B shape's layers)."""
        if not self.states_from():
            return self.decode(chunk, state, write=False)
        kept = self.kept[chunk.index]
        stem_output = kept[0] if self.keep == "stem" else kept[self.stem]
        with self.layers.resuming(stem_output):
            return self.to_hold(self.decode(chunk, state, write=False))

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


def probe(model, config: WalkConfig, reach: int | None = None, echo=None) -> Activations:
    """One chunk's graph on this model, measured by exact walks of its own (admission.probe)."""
    return admission.probe(ExactWalk, model, config, reach, echo)
