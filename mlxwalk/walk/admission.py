"""An exact walk's admission under its memory budget, settled before any array of the window: what
it gives up to fit, exact measures first (the head's dequantized copy, a longer checkpoint stride,
kept inputs, a smaller chunk), then lossy ones where "auto" allows them (bfloat16 accumulators, an
8-bit K/V store), then a narrowed horizon or the refusal (budget.py) where even one chunk of taps
would not fit. What the walk holds before any graph is checked first, without measuring a chunk's
graph (the probe, probe.py, trains the last chunk of a window of its own). `Admission` is the MLX
exact walk's (walk/exact.py), on its model, layout and config; `Graphs` one chunk's graph measured
once and handed to many admissions of one model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from ..ops.products import head_swapped
from ..plan import MIB, OutOfMemory, Plan, plan_window, q8_fits
from . import arch, budget, choices
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
# The lossy choices "auto" allows under a memory budget, in the order they are taken (the
# accumulators first: they change no chunk's graph, so no probe measures again).
LOSSY_STEPS = (("accumulator_dtype", "bfloat16"), ("cache_type", "q8"))
# An exact fit that forwards more layers again than this many whole windows' decode (a long
# checkpoint stride, the stem forwarded again) gives way to the lossy choices, the cheapest fit
# kept where none is affordable: the 27B-shaped window under 21 GiB fitted exactly only at chunk
# 256 with no checkpoint, 132 windows' decode again (docs/BENCHMARKS.md).
AFFORDABLE = 2.0
# a decode run's memory where measuring it ran out of the device's: more than any budget
OUT_OF_DEVICE = 1 << 62
LOSSY_SAID = {"accumulator_dtype": "bfloat16 accumulators", "cache_type": "an 8-bit K/V store"}


@dataclass
class Graphs:
    """One chunk's graph, measured once per setting that shapes it and that an admission changes
    between its probes (the head's products, the chunk, the store) and reused by every admission
    handed it: for a caller that admits one model under many budgets or windows (`mlxwalk plan`,
    `--macs`, scripts/mac-table.py), where the probe's own cache measures again for each window
    that reaches further. Measured over a prefix of `reach` positions (the longest any of those
    admissions reads; a longer one is extrapolated from it, as every estimate is), or given."""

    reach: int
    # (head products, chunk, store) -> graph; a graph given under its head products alone
    # serves every store, and other chunks scaled from it (Activations.at)
    measured: dict[tuple | str, Activations] = field(default_factory=dict)
    echo: Callable[[str], None] | None = None  # hears each of the probe's walks

    def of(self, walk: type, model, config: WalkConfig) -> Activations:
        head = config.head_products
        if head in self.measured:
            return self.measured[head].at(config.chunk)
        key = (head, config.chunk, config.cache_type)
        if key not in self.measured:
            self.measured[key] = probe(walk, model, config, self.reach, self.echo)
        return self.measured[key]


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

    def states_from(self) -> int:
        """The first layer whose recurrent state the reverse pass reads: with the stem's output
        kept, a re-decode starts there and the stem's states are never held (0: every layer's)."""
        return self.stem if self.keep in ("all", "stem") else 0

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
            self.layout.footprint(self.stem, self.states_from()),
            horizon=self.config.horizon,
            host_budget=host_budget,
            accumulator_element_bytes=ACCUMULATOR_DTYPES[self.config.accumulator_dtype].size,
            follow_runs=self.config.follow_runs,
        )

    def admit(self) -> budget.Estimate | None:
        """With a memory budget: the walk's memory, or a refusal before any array of the window.
        The floor (all but a chunk's graph) first, taking the lossy choices it needs before any
        probe; then, exact measures first, the largest chunk that fits at the full horizon; else
        the smallest chunk, narrowed or refused. `self.config` becomes the settings chosen and
        `self.given_up` says what changed."""
        self.given_up: list[choices.Choice] = []
        device = self.config.device_budget
        if device is None:
            return None
        before = self.settings()
        self.measured: dict[tuple, Activations] = {}
        steps = self.lossy_steps()
        taken = self.take_for_floor(device, steps)
        est, least = self.search(device, steps[taken:])
        budget.admit(least, device, budget.what_fits(self.layout, self.config.cache_type))
        self.given_up = self.changes(before)
        self.refuse_lossy()
        self.run_width, run = self.decode_width(est, device)
        return replace(est, run=run)

    def decode_width(self, est: budget.Estimate, device: int) -> tuple[int, int]:
        """(positions, bytes): the run the decode takes under the budget and its own memory.
        The run it takes without one (`unbudgeted_run`), shortened while that run's memory,
        measured at the longest prefix a run of it reads, does not fit beside all the decode
        holds at its end; (0, 0) (chunk by chunk) where no run of two chunks does. Unmeasured,
        the 27B-shaped window's runs of 8,192 positions peaked at 35.57 GiB under 32 on an
        H100 (docs/BENCHMARKS.md)."""
        if self.seed is not None:
            return 0, 0  # dropout draws its masks per chunk
        chunk, chunks = self.config.chunk, self.plan.chunks
        decoded = chunks if self.skips_stem() else chunks[:-1]
        # no run is longer than the schedule lets one be (a recurrent checkpoint starts one)
        longest = max((len(r) for r in self.decode_runs(decoded, len(chunks))), default=0)
        width = min(self.unbudgeted_run() // chunk, longest) * chunk
        end = decoded[-1].end if decoded else 0  # the decode's last position
        room = device - est.decoding
        while width >= 2 * chunk:
            prefix = max(0, end - width) // chunk * chunk
            run = self.run_bytes(width, prefix)
            if run <= room:
                return width, run
            # the next width tried: half, or less where the measured bytes per position say
            # so (a run's fixed part makes that an underestimate of what fits, never over)
            width = min(width // 2, int(max(room, 0) * width / max(run, 1))) // chunk * chunk
        return 0, 0

    def run_bytes(self, width: int, prefix: int) -> int:
        """One decode run's own memory at this walk's settings (`run_probe`)."""
        kept = {"all": "on", "stem": "stem", "off": "off"}[self.keep]
        config = replace(self.probed(), keep_inputs=kept)
        return run_probe(type(self), self.model, config, width, prefix)

    def settings(self) -> dict[str, object]:
        """The settings the admission may change, as a Choice names them."""
        return {
            "chunk": self.config.chunk,
            "checkpoint stride": self.make_plan(self.config.host_budget).stride,
            "kept inputs": self.keep_mode(),
            "head products": self.head_mode(),
            "accumulators": self.config.accumulator_dtype,
            "K/V store": self.config.cache_type,
        }

    def changes(self, before: dict[str, object]) -> list[choices.Choice]:
        """What the admission changed; the stride against the one the chosen chunk would have
        without the budget (a smaller chunk alone has more chunks, not a longer stride)."""
        after = {
            "chunk": self.config.chunk,
            "checkpoint stride": self.plan.stride,
            "kept inputs": self.keep,
            "head products": self.head_products,
            "accumulators": self.config.accumulator_dtype,
            "K/V store": self.config.cache_type,
        }
        before = {**before, "checkpoint stride": self.make_plan(self.config.host_budget).stride}
        return [choices.Choice(k, before[k], v) for k, v in after.items() if before[k] != v]

    def lossy_steps(self) -> list[tuple[str, str]]:
        """The lossy choices this walk may take: where "auto" was asked, in LOSSY_STEPS' order
        (q8 only where the model's head dims allow it)."""
        q8 = q8_fits(self.layout.head_dims)
        return [
            (name, value)
            for name, value in LOSSY_STEPS
            if getattr(self.asked, name) == "auto"
            and getattr(self.config, name) != value
            and (name != "cache_type" or q8)
        ]

    def take(self, step: tuple[str, str]) -> None:
        name, value = step
        self.config = replace(self.config, **{name: value})

    def take_for_floor(self, device: int, steps: list[tuple[str, str]]) -> int:
        """What the walk holds before any graph (the weights, the adapter, the store, the
        accumulators, the checkpoints unless a longer stride can shrink them, kept inputs unless
        auto can give them up) against the budget, without measuring a chunk's graph: the lossy
        choices it needs taken, in order; refused at once where even all of them fall short.
        Returns how many were taken."""
        taken = 0
        while self.floor().total > device and taken < len(steps):
            self.take(steps[taken])
            taken += 1
        budget.admit(self.floor(), device, budget.what_fits(self.layout, self.config.cache_type))
        self.refuse_lossy()
        return taken

    def floor(self) -> budget.Estimate:
        self.plan = self.make_plan(self.config.host_budget)
        self.acts = Activations(self.config.chunk, 0.0, 0.0)
        est = self.measure(self.plan)
        if self.layout.recurrent and self.config.host_budget is None:
            est = replace(est, checkpoints=0)
        if self.config.keep_inputs == "auto":
            est = replace(est, inputs=0)
        return est

    def search(self, device: int, steps: list[tuple[str, str]]):
        """(estimate, estimate at one chunk of taps): at the asked chunk with the head's copy
        given up if it does not fit, then for no lossy choice and for each in turn the largest
        chunk down to the floor that fits at the full horizon with its layers forwarded again
        affordable; where none is, the fit that forwards the fewest; where none fits, the
        smallest chunk with every choice (its late chunks narrowed, or refused)."""
        asked = self.config.chunk
        est, least = self.settled_at(asked, device, probe_it=True)
        auto_head = self.config.head_products == "auto" and self.head_products == "dequantized"
        if auto_head and est.total > device:
            # auto: the head's whole dequantized copy is the first thing given up (its gain
            # over the sliced head is the smallest: a few dequantizations a chunk). Sliced only
            # layer by layer (recompute), where each slice is evaluated alone; a chunk's one
            # graph holds every slice at once on a GPU (14.67 GiB on an H100 at the 27B head)
            self.head_products = "sliced" if self.config.recompute else "quantized"
            est, least = self.settled_at(asked, device, probe_it=True)
        costly = []  # (layer forwards again, the walk as settled) that fit past AFFORDABLE
        for taken in range(len(steps) + 1):
            if taken:
                self.take(steps[taken - 1])
            for found in self.fitting(asked, device):
                if self.forwards_again() <= self.affordable():
                    return found
                costly.append((self.forwards_again(), self.settled(), found))
        if costly:  # none affordable: the cheapest
            _, settled, found = min(costly, key=lambda c: c[0])
            self.config, self.plan, self.keep, self.acts = settled
            return found
        return self.settled_at(choices.chunk_floor(self.asked), device, probe_it=True)

    def settled(self) -> tuple:
        return self.config, self.plan, self.keep, self.acts

    def affordable(self) -> int:
        """The layer forwards again (`forwards_again`) an exact fit may cost before a lossy
        choice is taken to cut them: AFFORDABLE whole windows' decode through every layer."""
        return int(AFFORDABLE * self.one_window())

    def one_window(self) -> int:
        """Layer forwards over one chunk in one whole window's decode through every layer."""
        return len(self.layout.kinds) * len(self.plan.chunks)

    def windows_again(self) -> float:
        """`forwards_again` in whole windows' decode."""
        return self.forwards_again() / self.one_window()

    def fitting(self, asked: int, device: int):
        """Each chunk from `asked`, halving down to the floor, whose walk fits at the full
        horizon, largest first: estimated from the nearest graph measured, then confirmed by a
        probe at it (the search goes on from that measurement where it does not). A smaller
        chunk that fits with fewer layers forwarded again can be affordable where a larger one
        is not (its checkpoints fit at a shorter stride)."""
        least_chunk, chunk = choices.chunk_floor(self.asked), asked
        while chunk >= least_chunk:
            est, least = self.settled_at(chunk, device, probe_it=False)
            if est.total <= device:
                est, least = self.settled_at(chunk, device, probe_it=True)
                if est.total <= device:
                    yield est, least
            chunk //= 2

    def settled_at(self, chunk: int, device: int, probe_it: bool):
        """The walk at `chunk`: its graph measured (`probe_it`, or where measured before) or
        estimated from the nearest measured one, then its exact measures settled."""
        self.config = replace(self.config, chunk=chunk)
        self.plan = self.make_plan(self.config.host_budget)
        self.acts = self.graph_at(self.plan.chunks[-1].start, probe_it)
        return self.settle(device)

    def graph_at(self, reach: int, probe_it: bool) -> Activations:
        """One chunk's graph at this walk's settings: measured before, or measured now
        (`probe_it`), or scaled from the one measured at the nearest chunk (the same store's
        where there is one)."""
        key = (self.config.chunk, self.config.cache_type, self.head_products)
        if key in self.measured:
            return self.measured[key]
        known = [(k, a) for k, a in self.measured.items() if k[2] == self.head_products]
        if probe_it or not known:
            self.measured[key] = self.measured_graph(reach)
            return self.measured[key]
        chunk = self.config.chunk
        same = [(k, a) for k, a in known if k[1] == self.config.cache_type] or known
        _, nearest = min(same, key=lambda ka: (abs(ka[0][0] - chunk), -ka[0][0]))
        return nearest.at(chunk)

    def settle(self, device: int) -> tuple[budget.Estimate, budget.Estimate]:
        """The exact measures at this chunk, store and accumulators: for the kept inputs asked
        (with auto: every layer's, the stem's output alone, none), the shortest checkpoint stride
        that fits (room for the full horizon's graph, else for one chunk of taps), unless a host
        budget sizes them; of those that fit, the one that forwards the fewest layers again
        (`forwards_again`). Where none fits, the last."""
        first = self.keep_mode()
        rest = {"all": ["stem", "off"] if self.stem else ["off"], "stem": ["off"], "off": []}
        options = [first] + (rest[first] if self.config.keep_inputs == "auto" else [])
        tried = []
        for keep in options:
            self.keep = keep
            est = self.strided(device)
            tried.append((est.total <= device, self.forwards_again(), keep, self.plan, est))
            if tried[-1][:2] == (True, 0):  # nothing forwarded again: nothing cheaper
                break
        fitting = [t for t in tried if t[0]]
        _, _, self.keep, self.plan, est = min(fitting, key=lambda t: t[1]) if fitting else tried[-1]
        return est, replace(est, graph=self.least_graph())

    def least_graph(self) -> int:
        """The last chunk's graph with one chunk of taps (the fewest there are)."""
        last = self.plan.chunks[-1]
        return self.graph_bytes(min(self.plan.chunk, last.start - last.grad_from), last.start)

    def strided(self, device: int) -> budget.Estimate:
        """The estimate at the shortest checkpoint stride that fits beside the full horizon's
        graph, else beside one chunk of taps (recurrent layers, no host budget)."""
        self.plan = self.make_plan(self.config.host_budget)
        est = self.measure(self.plan)
        if est.total > device and self.layout.recurrent and self.config.host_budget is None:
            for graph in (est.graph, self.least_graph()):
                # the host's room in the reverse pass, and the checkpoints' in the decode
                room = min(
                    device - (est.reversing - est.host - est.graph + graph),
                    device - (est.decoding - est.checkpoints) + est.accumulators,
                )
                try:  # fewer checkpoints, the states between them re-decoded in reverse
                    self.plan = self.make_plan(max(room, 0))
                except OutOfMemory:
                    continue
                est = self.measure(self.plan)
                break
        return est

    def forwards_again(self) -> int:
        """Layer forwards over one chunk that the reverse pass runs beyond one graph per chunk:
        the entry states re-decoded through every layer by the checkpoint schedule (binomial in
        the slots: checkpoints.py), and the forward that records a chunk's layer inputs where
        they are not kept (the trained layers' with the stem's output kept, every layer's with
        none). The 27B-shaped window at 21 GiB held the stem's output with one checkpoint per 66
        chunks, re-decoding each from the one before it: 4,290 chunks, 33 windows' decode
        (docs/BENCHMARKS.md); the binomial schedule re-decodes 1,169 there."""
        layers = len(self.layout.kinds)
        chunks = self.plan.reverse()
        again = self.plan.decoded_again() * (layers - self.states_from()) if self.recurrent else 0
        if self.config.recompute and self.keep != "all":
            again += len(chunks) * (layers - self.stem if self.keep == "stem" else layers)
        return again

    def refuse_lossy(self) -> None:
        """--strict-exact: a walk that fits only with lossy choices is refused, naming them."""
        lossy = [
            LOSSY_SAID[name]
            for name, value in LOSSY_STEPS
            if getattr(self.asked, name) == "auto" and getattr(self.config, name) == value
        ]
        if self.config.strict_exact and lossy:
            raise OutOfMemory(
                f"the memory budget of {self.config.device_budget / MIB:,.0f} MiB fits this "
                f"window only with {' and '.join(lossy)}, and --strict-exact refuses a gradient "
                f"that is not exact: {self.remedies}"
            )

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

    def measure(self, plan) -> budget.Estimate:
        """The estimate for `plan`, with whatever else MLX holds now beyond the model's weights and
        the adapter's share (arrays the walk can't know of count against the budget too)."""
        est = budget.estimate(
            self.model,
            self.layout,
            self.acts,
            plan,
            self.config.cache_type,
            skipped=self.states_from(),
        )
        inputs = self.inputs_bytes(plan)
        resident = max(0, mx.get_active_memory() - est.weights - est.adapter)
        return replace(est, resident=resident, inputs=inputs)

    def inputs_bytes(self, plan) -> int:
        if self.keep == "off":
            return 0
        return budget.inputs_bytes(
            self.layout, plan, self.stem, self.keep == "stem", last=bool(self.states_from())
        )

    def held(self) -> int:
        """What this walk holds besides a chunk's graph: its store, accumulators, checkpoints and
        kept inputs (the probe subtracts them from its walks' peaks). A filled walk (the probe's)
        holds its store, accumulators and one entry state."""
        est = budget.estimate(
            self.model,
            self.layout,
            Activations(self.plan.chunk, 0, 0),
            self.plan,
            self.config.cache_type,
            # a filled walk decodes nothing, so it keeps no stem output and lets no K/V go
            skipped=0 if self.filled else self.states_from(),
        )
        if self.filled:
            entry = sum(a.nbytes for layer in self.zero_state() or [] for a in layer)
            return est.store + est.accumulators + entry
        inputs = self.inputs_bytes(self.plan)
        return est.store + est.accumulators + est.checkpoints + inputs

    def graph_bytes(self, taps: int, prefix: int) -> int:
        return graph_bytes(self.acts, self.layout.footprint(), taps, prefix)


def probe_config(model, config: WalkConfig, kept) -> tuple[WalkConfig, WalkConfig]:
    """(the run's config as its walk resolves it, the config a probe's walks take): the
    settings that shape a chunk's graph (PROBED), the kept inputs `kept(config)`, no budget."""
    config = choices.lossless(config, choices.dtype_name(arch.inspect(model).dtype))
    shaping = {name: getattr(config, name) for name in PROBED}
    return config, WalkConfig(**shaping, keep_inputs=kept(config))


def probe(
    walk: type, model, config: WalkConfig, reach: int | None = None, echo=None
) -> Activations:
    """One chunk's graph on this model (probe.py), measured by exact walks of its own (`walk`,
    the exact walk's class) with the run's settings that shape a chunk's graph (PROBED) and its
    kept inputs, over at most `reach` positions of prefix (None: as far as the probe goes). An
    "auto" store is measured as the walk resolves it, so both share one cached probe."""
    config, base = probe_config(model, config, probes.kept_for)

    def peak(ids: np.ndarray, n: int, horizon: int) -> int:
        window = Window.of(ids[:n], ids[1 : n + 1], np.ones(n))
        run = walk(model, window, replace(base, horizon=horizon))
        run.filled = True  # a chunk's graph depends on its prefix's length, not its values
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


def run_probe(walk: type, model, config: WalkConfig, width: int, prefix: int) -> int:
    """One decode run's own memory, its kept inputs counted in: `width` positions decoded at
    once (`walk`'s decode_run) after `prefix` positions of a store allocated but not decoded
    (a prefix's length sizes the run's attention, not its values). Cached per probe key and
    width (probe.py)."""
    config, base = probe_config(model, config, lambda c: c.keep_inputs)
    vocab = arch.inspect(model).vocab

    def peak(width: int, prefix: int) -> int:
        n = prefix + width
        ids = np.random.default_rng(0).integers(0, vocab, n + 1)
        run = walk(model, Window.of(ids[:n], ids[1:], np.ones(n)), base)
        run.filled = True
        with run.walking():
            run.new_store(run.plan.computed)
            mx.eval(run.store.arrays())
            chunks = [c for c in run.plan.chunks if c.start >= prefix]
            nbytes = budget.live_peak(lambda: run.decode_run(chunks, run.zero_state()) or [])
        run.kept = {}
        return nbytes

    try:
        return probes.run_cached(model, config, width, prefix, peak)
    except RuntimeError as e:  # the device's own allocation failed: a run this long never fits
        if not probes.out_of_device_memory(e):
            raise
        mx.clear_cache()
        return OUT_OF_DEVICE
