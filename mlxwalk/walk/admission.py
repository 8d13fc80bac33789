"""An exact walk's admission under its memory budget, settled before any array of the window:
its plan (a longer checkpoint stride where the checkpoints would not fit), its kept inputs and
its head's products (given up, in that order of gain, where they would not fit), one chunk's graph
measured by the probe (probe.py), and the refusal (budget.py) where even one chunk of taps would
not fit. `Admission` is the MLX exact walk's (walk/exact.py), on its model, layout and config;
`Graphs` one chunk's graph measured once and handed to many admissions of one model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from ..ops.products import head_swapped
from ..plan import OutOfMemory, Plan, plan_window
from . import budget
from . import probe as probes
from .accum import ACCUMULATOR_DTYPES
from .activations import Activations, graph_bytes
from .config import WalkConfig
from .window import Window

# The settings that shape one chunk's graph, which the probe's walks take from the run's; the
# rest (horizon, budgets, seed, accumulators) are the probe's own.
PROBED = (
    "chunk",
    "recompute",
    "attention",
    "cache_type",
    "products",
    "head_products",
    "decode_run",
)


@dataclass
class Graphs:
    """One chunk's graph, measured once per setting of the head's products (the one setting an
    admission changes between its probes) and reused by every admission handed it: for a caller
    that admits one model at one chunk under many budgets or windows (`mlxwalk plan --macs`,
    scripts/mac-table.py), where the probe's own cache measures again for each window that
    reaches further. Measured over a prefix of `reach` positions (the longest any of those
    admissions reads; a longer one is extrapolated from it, as every estimate is), or given."""

    reach: int
    measured: dict[str, Activations] = field(default_factory=dict)  # head products -> graph
    echo: Callable[[str], None] | None = None  # hears each of the probe's walks

    def of(self, walk: type, model, config: WalkConfig) -> Activations:
        head = config.head_products
        if head not in self.measured:
            self.measured[head] = probe(walk, model, config, self.reach, self.echo)
        return self.measured[head]


class Admission:
    """The exact walk's plan, kept inputs (`keep`: "all", "stem" or "off") and head products,
    settled against its budgets; `estimate` its memory (None without a memory budget). `graphs`:
    one chunk's graph measured before (None: the probe measures it, or its cache has it)."""

    graphs: Graphs | None = None

    def keep_mode(self) -> str:
        """Kept inputs serve recompute's layer-by-layer reverse pass: every trained layer's
        ("all", for on and auto) or only the stem's output ("stem", where there is a stem)."""
        wanted = self.config.keep_inputs
        if not self.config.recompute or self.head is None or wanted == "off":
            return "off"
        if wanted == "stem":
            return "stem" if self.stem else "off"
        return "all"

    def head_mode(self) -> str:
        """An untied quantized head's products: auto is dequantized until a budget says
        otherwise ("as is": no head the walk would dequantize)."""
        swappable = head_swapped(self.model, self.config.products)
        auto = "dequantized" if swappable else "as is"
        return {"auto": auto}.get(c := self.config.head_products, c)

    def make_plan(self, host_budget: int | None) -> Plan:
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
        self.acts = self.measured_graph(reach)
        est = self.measure(self.plan)
        auto_head = self.config.head_products == "auto" and self.head_products == "dequantized"
        if auto_head and est.total > device:
            # auto: the head's dequantized copy is the first thing given up (its gain is the
            # smallest: 1 s of the 8B-shaped window's 20, docs/BENCHMARKS.md)
            self.head_products = "quantized"
            self.acts = self.measured_graph(reach)
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

    def measured_graph(self, reach: int) -> Activations:
        """One chunk's graph at this walk's settings: from `graphs` where given, else probed over
        at most `reach` positions of prefix."""
        if self.graphs is not None:
            return self.graphs.of(type(self), self.model, self.probed())
        return probe(type(self), self.model, self.probed(), reach=reach)

    def probed(self) -> WalkConfig:
        """The config a probe measures: the run's, with the head's products as this walk has
        them."""
        head = "auto" if self.head_products == "as is" else self.head_products
        return replace(self.config, head_products=head)

    def refuse_floor(self, device: int) -> None:
        """A budget below what the walk holds before any graph (the weights, the adapter, the
        store, the accumulators, and the checkpoints unless a longer stride can shrink them) is
        refused at once, without measuring a chunk's graph."""
        self.acts = Activations(self.config.chunk, 0.0, 0.0)
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
            Activations(self.plan.chunk, 0, 0),
            self.plan,
            self.config.cache_type,
        )
        inputs = self.inputs_bytes(self.plan)
        return est.store + est.accumulators + est.checkpoints + inputs

    def graph_bytes(self, taps: int, prefix: int) -> int:
        return graph_bytes(self.acts, self.layout.footprint(), taps, prefix)


def probe(
    walk: type, model, config: WalkConfig, reach: int | None = None, echo=None
) -> Activations:
    """One chunk's graph on this model (probe.py), measured by exact walks of its own (`walk`,
    the exact walk's class) with the run's settings that shape a chunk's graph (PROBED) and its
    kept inputs, over at most `reach` positions of prefix (None: as far as the probe goes)."""
    shaping = {name: getattr(config, name) for name in PROBED}
    base = WalkConfig(**shaping, keep_inputs=probes.kept_for(config))

    def peak(ids: np.ndarray, n: int, horizon: int) -> int:
        window = Window.of(ids[:n], ids[1 : n + 1], np.ones(n))
        run = walk(model, window, replace(base, horizon=horizon))
        return budget.live_peak(lambda: run.run(chunks=1)) - run.held()

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
