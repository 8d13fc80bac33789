"""`mlxwalk test-walk-exact`'s table, once for both backends: which walks of one window are
compared with which reference under which bar (grading.py's), and the output. A backend
subclasses `ExactnessTable` with how to run a walk (commands/walk_exact.py on MLX,
torch_backend/exactness.py on torch) and runs the rows it offers. Plain Python and NumPy.

Rows (numbered after the reference system's acceptance test):
  (1)  every position labelled, 4 chunks: the exact walk and the plain walk vs one graph
  (1a) the exact walk through each attention path (tiled chunk_attention, mlx-lm's fused)
  (1b) the exact walk with float16, bfloat16 and 8-bit K/V stores vs the float32 one graph
  (1c) bfloat16 K/V gradient accumulators vs float32 ones; the K/V store and accumulators in
       host memory vs on the device
  (2)  context then reply, 4 chunks vs one chunk per run
  (3)  a host budget of 1 byte is refused, naming host memory, and the adapter is untouched
  (4)  recurrent models: a host budget of 3/4 of the per-chunk checkpoints forces a stride > 1,
       holds fewer bytes and gives the same gradient
  (7)  recompute (each layer's graph alone, from its input kept from the decode) vs not
  (7b) recompute from a recorded forward (no inputs kept) vs not
  (8)  LoRA on the upper half of the layers only, recompute: exact vs one graph
  (8b) the same, the output of the frozen layers beneath (the stem) kept
  (9)  DPO on a pair (the window as the chosen answer's, the same prompt with other answer ids
       as the rejected one's; answers labelled, the reference the adapter off): the exact walk
       and the plain walk vs one graph (preference/rewards.py's weights on both walks)
The adapter is moved to a random nonzero point first, so every LoRA gradient is nonzero.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from .grading import (
    BARS,
    BFLOAT16_ACCUMULATORS,
    BFLOAT16_STORE,
    EXACT,
    FLOAT16_STORE,
    Q8_STORE,
    TELLS_APART,
    compare,
    flat,
)
from .plan import MIB, OutOfMemory
from .preference.rewards import Scores, terms

# Row (9)'s beta, DPO's usual (mlx-lm-lora's default). The pair's weight beta sigmoid(-margin)
# carries the margin's float32 rounding, beta n times the mean loss's (n the answer's tokens):
# at beta 0.5 the torch qwen3_next row read 3.4e-5 with each window's gradient at 1.4e-6.
DPO_BETA = 0.1


@dataclass(frozen=True)
class Setting:
    """One walk of the table's window, in the table's terms; a backend turns it into its
    window_gradient's arguments, or does not offer it."""

    walk: str = "exact"  # exact, plain or one-graph
    labels: str = "every"  # every position labelled, or "reply": the second half only
    whole: bool = False  # one chunk over the window
    store: str = "float32"  # the K/V store: float32, float16, bfloat16, q8
    accumulators: str = "float32"  # the K/V gradient accumulators: float32, bfloat16
    placement: str = "device"  # the K/V store and accumulators: device or host memory
    attention: str = "auto"  # tiled (chunk_attention), fused (mlx-lm's)
    # each layer's graph rebuilt in the backward from: its "inputs" kept from the decode, a
    # "recorded" forward, the "stem"'s output ("": not rebuilt)
    recompute: str = ""
    upper_half: bool = False  # only the upper half of the layers' adapters train
    objective: str = "tokens"  # the window's mean loss, or "dpo": the table's pair's DPO loss
    head: str = "auto"  # an untied quantized head's products: "sliced", its vocabulary in slices


@dataclass(frozen=True)
class Spec:
    """A row: `walk`'s gradient against `reference`'s under `bar`. `what` may name {k} (the
    chunks), {store} (the backend's word for its K/V store) and {half} (the upper half's first
    layer)."""

    row: str
    what: str
    bar: str
    walk: Setting | None = None
    reference: Setting | None = None


EVERY = Setting()
ONE = Setting(walk="one-graph", whole=True)
REFUSAL = Spec("(3)", "host budget of 1 byte", "refused, adapter untouched")
STRIDED = Spec("(4)", "3/4 checkpoint budget: stride {stride}, {held:.2f} vs {free:.2f} MiB", EXACT)
DPO = Setting(labels="reply", objective="dpo")
DPO_ONE = Setting(walk="one-graph", labels="reply", whole=True, objective="dpo")
STORES = {"float16": FLOAT16_STORE, "bfloat16": BFLOAT16_STORE, "q8": Q8_STORE}
ROWS = (
    Spec("(1)", "every position labelled, {k} chunks: exact vs one graph", EXACT, EVERY, ONE),
    *(
        Spec("(1a)", f"{a} attention ({n}): exact vs one graph", EXACT, Setting(attention=a), ONE)
        for a, n in (("tiled", "chunk_attention"), ("fused", "mlx-lm's"))
    ),
    Spec(
        "(1)",
        "every position labelled, {k} chunks: plain vs one graph",
        TELLS_APART,
        Setting(walk="plain"),
        ONE,
    ),
    *(
        Spec("(1b)", f"{s} {{store}}: exact vs float32 one graph", bar, Setting(store=s), ONE)
        for s, bar in STORES.items()
    ),
    Spec(
        "(1c)",
        "bfloat16 accumulators vs float32",
        BFLOAT16_ACCUMULATORS,
        Setting(accumulators="bfloat16"),
        EVERY,
    ),
    Spec(
        "(1c)",
        "K/V store and accumulators in host memory vs device",
        EXACT,
        Setting(placement="host"),
        EVERY,
    ),
    Spec(
        "(1d)",
        "untied head, its vocabulary in slices, recompute: exact vs one graph",
        EXACT,
        Setting(head="sliced", recompute="inputs"),
        ONE,
    ),
    Spec(
        "(2)",
        "context then reply, {k} chunks vs one chunk per run",
        EXACT,
        Setting(labels="reply"),
        Setting(labels="reply", whole=True),
    ),
    REFUSAL,
    STRIDED,
    Spec("(7)", "recompute, layer inputs kept, vs not", EXACT, Setting(recompute="inputs"), EVERY),
    Spec(
        "(7b)", "recompute, a recorded forward, vs not", EXACT, Setting(recompute="recorded"), EVERY
    ),
    Spec(
        "(8)",
        "LoRA on layers {half}+ only, recompute: exact vs one graph",
        EXACT,
        Setting(recompute="inputs", upper_half=True),
        Setting(walk="one-graph", whole=True, upper_half=True),
    ),
    Spec(
        "(8b)",
        "the same, the stem's output kept: exact vs one graph",
        EXACT,
        Setting(recompute="stem", upper_half=True),
        Setting(walk="one-graph", whole=True, upper_half=True),
    ),
    Spec("(9)", "DPO pair, answers labelled, {k} chunks: exact vs one graph", EXACT, DPO, DPO_ONE),
    Spec(
        "(9)",
        "DPO pair, answers labelled: plain vs one graph",
        TELLS_APART,
        Setting(walk="plain", labels="reply", objective="dpo"),
        DPO_ONE,
    ),
)


@dataclass
class Row:
    model: str
    row: str
    what: str
    bar: str
    ok: bool
    cosine: float | None = None
    rel_l2: float | None = None  # |walk - reference| / |reference|
    detail: str = ""

    def line(self) -> str:
        if self.cosine is not None:
            got = f"cosine {self.cosine:.6f}, rel. L2 error {self.rel_l2:.1e}"
        else:
            got = self.detail
        verdict = "OK" if self.ok else "FAILED"
        return f"  {self.row:<5}{self.what:<58}{got:<44}{verdict:<7}[{self.bar}]"


class ExactnessTable:
    """The rows for one model on one window. A backend sets `layers`, `recurrent` and
    `store_name` and supplies the methods below `run`'s helpers: `header`, `offers`, `walked`,
    `planned`, `adapter`, `train`."""

    layers: int  # the model's decoder layers
    recurrent: bool  # whether any is recurrent: row (4)
    store_name: str  # the backend's word for its K/V store, in row (1b)

    def __init__(self, name: str, vocab: int, window: int = 256, n_chunks: int = 4):
        self.name = name
        self.n, self.chunk = window, window // n_chunks
        rng = np.random.default_rng(0)
        ids = rng.integers(0, vocab, window + 1)  # ids the model has
        self.x, self.y = ids[:-1], ids[1:]
        # row (9)'s rejected answer: the same prompt (the first half), other answer ids
        other = np.r_[ids[: window // 2 + 1], rng.integers(0, vocab, window - window // 2)]
        self.rejected = other[:-1], other[1:]
        self.rows: list[Row] = []
        self.grads: dict[Setting, object] = {}  # each setting walked once

    def run(self) -> list[Row]:
        for spec in ROWS:
            if spec is REFUSAL:
                self.rows.append(self.refusal())
            elif spec is STRIDED:
                if self.recurrent:
                    self.rows.append(self.strided())
            elif (row := self.compared(spec)) is not None:
                self.rows.append(row)
        return self.rows

    def gradient(self, setting: Setting):
        if setting not in self.grads:
            weights = np.ones(self.n)
            if setting.labels == "reply":
                weights = np.r_[np.zeros(self.n // 2), np.ones(self.n - self.n // 2)]
            chunk = self.n if setting.whole else self.chunk
            if setting.objective == "dpo":
                self.grads[setting] = self.pair_gradient(setting, weights, chunk)
            else:
                self.grads[setting] = self.walked(setting, weights, chunk, (self.x, self.y))[1]
        return self.grads[setting]

    def pair_gradient(self, setting: Setting, weights: np.ndarray, chunk: int) -> np.ndarray:
        """Row (9): DPO's gradient of the table's pair, flat. Each answer's window walked under
        `setting` for its mean loss's gradient g; the pair's is c (n_c g_c - n_r g_r) with
        c = beta sigmoid(-margin), the margin from those losses and the adapter-off ones."""
        n, sides = float(weights.sum()), [(self.x, self.y), self.rejected]
        reference = Scores(*(-self.reference_loss(ids, weights) * n for ids in sides))
        (loss_c, g_c), (loss_r, g_r) = (self.walked(setting, weights, chunk, i) for i in sides)
        t = terms(Scores(-loss_c * n, -loss_r * n), reference, DPO_BETA)
        return t.weight * n * (flat(g_c) - flat(g_r))

    def compared(self, spec: Spec) -> Row | None:
        """The row, or None where this backend has no such walk; an error is the row's FAILED
        detail, so one row's failure never hides the others."""
        what = spec.what.format(
            k=self.n // self.chunk, store=self.store_name, half=self.layers // 2
        )
        offered = [self.offers(spec.walk), self.offers(spec.reference)]
        if not all(offered):
            return None
        if reason := next((o for o in offered if isinstance(o, str)), None):
            return Row(self.name, spec.row, what, spec.bar, True, detail=f"not offered: {reason}")
        try:
            c, e = compare(self.gradient(spec.walk), self.gradient(spec.reference))
        except (ValueError, RuntimeError, MemoryError) as err:
            detail = "error: " + (str(err).splitlines() or [type(err).__name__])[0][:120]
            return Row(self.name, spec.row, what, spec.bar, False, detail=detail)
        return Row(self.name, spec.row, what, spec.bar, BARS[spec.bar](c, e), c, e)

    def refusal(self) -> Row:
        """(3): a step under a host budget of 1 byte is refused, naming host memory, before it
        touches the adapter."""
        before = flat(self.adapter())
        try:
            self.train(host_budget_mib=1 / MIB)
            message = ""
        except OutOfMemory as e:
            message = str(e)
        untouched = np.array_equal(before, flat(self.adapter()))
        detail = ("refused" if message else "not refused") + (
            ", adapter untouched" if untouched else ", adapter changed"
        )
        ok = "host memory" in message and untouched
        return Row(self.name, REFUSAL.row, REFUSAL.what, REFUSAL.bar, ok, detail=detail)

    def strided(self) -> Row:
        """(4): 3/4 of the checkpoints' bytes forces a stride > 1, fewer bytes, the same
        gradient."""
        free, _ = self.planned(None, run=False)
        budget = free.accumulator_bytes + free.checkpoint_bytes * 3 / 4
        plan, grads = self.planned(budget / MIB)
        c, e = compare(grads, self.gradient(EVERY))
        fewer = plan.stride > 1 and plan.host_bytes < free.host_bytes
        what = STRIDED.what.format(
            stride=plan.stride, held=plan.host_bytes / MIB, free=free.host_bytes / MIB
        )
        return Row(self.name, STRIDED.row, what, EXACT, BARS[EXACT](c, e) and fewer, c, e)

    # What a backend supplies.

    def header(self) -> str:
        """The model's line above its rows."""
        raise NotImplementedError

    def offers(self, setting: Setting) -> bool | str:
        """True: this backend runs the setting; False: it has no such walk (the row is left
        out); a reason: not on this model (the row says so)."""
        raise NotImplementedError

    def walked(self, setting: Setting, weights: np.ndarray, chunk: int, ids: tuple):
        """(mean loss, the adapter's gradient as a tree of arrays) of the walk under `setting`
        of the window `ids` (inputs, targets) with `weights`."""
        raise NotImplementedError

    def reference_loss(self, ids: tuple, weights: np.ndarray) -> float:
        """The window `ids`'s mean loss with the adapter off (row (9)'s DPO reference)."""
        raise NotImplementedError

    def planned(self, host_budget_mib: float | None, run: bool = True):
        """(plan, gradient) of the exact walk under the host budget; run=False: the plan only,
        the gradient None."""
        raise NotImplementedError

    def adapter(self):
        """The adapter's trainable parameters, a tree of arrays NumPy reads."""
        raise NotImplementedError

    def train(self, host_budget_mib: float) -> None:
        """One training step (SGD) on the window, every position labelled, under the budget."""
        raise NotImplementedError


def print_tables(
    tables: Iterable[ExactnessTable],
    title: str,
    as_json: bool = False,
    echo=print,
    footer: Callable[[], str] | None = None,
) -> bool:
    """test-walk-exact's output for either backend: each model's header and rows (`tables`
    yields them lazily: a model loads when its turn comes), or one JSON object; then `footer`
    and the verdict. True when every row is OK."""
    rows: list[Row] = []
    for table in tables:
        table_rows = table.run()
        if not as_json:
            echo(table.header())
        for row in table_rows:
            rows.append(row)
            if not as_json:
                echo(row.line())
    ok = all(r.ok for r in rows)
    if as_json:
        echo(json.dumps({"ok": ok, "rows": [asdict(r) for r in rows]}, indent=2))
        return ok
    if footer is not None:
        echo(footer())
    echo(f"{title}: " + ("every row OK" if ok else "FAILED"))
    return ok
