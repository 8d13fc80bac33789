"""What the exact walk's admission gives up to fit a memory budget, and in which order: exact
measures first (stride, kept inputs, a smaller chunk), then bfloat16 accumulators, then an 8-bit
store, then the refusal; the floor before any probe; explicit settings never changed. Most tests
give the admission a graph of known size (`graph_of`, no probe walks): the choice is arithmetic
on the model's layout. One walks for real, on the chosen settings, against its budget."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxwalk.plan import MIB, OutOfMemory
from mlxwalk.training.watch import BUDGET_MARGIN
from mlxwalk.walk import ExactWalk, WalkConfig, Window, admission, choices, one_graph

N, CHUNK, FLOOR = 2048, 512, 128
ROW = 20 * 1024  # the fake graph's bytes per row of a chunk
TAP = 2.0  # and per tapped prefix position, in units of its K/V at float32


def window(n, seed=0):
    ids = np.random.default_rng(seed).integers(0, 256, n + 1)
    return Window.of(ids[:-1], ids[1:], np.ones(n))


@pytest.fixture
def probes(monkeypatch):
    """Each admission's graph, linear in the chunk as the estimate assumes, and the settings of
    every probe the admission would have walked."""
    seen = []

    def graph_of(self, reach):
        seen.append((self.config.chunk, self.config.cache_type, self.config.accumulator_dtype))
        return admission.Activations(self.config.chunk, ROW * self.config.chunk, TAP, 0.0)

    monkeypatch.setattr(admission.Admission, "measured_graph", graph_of)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)  # no other arrays: exact tiers
    return seen


def walk(model, budget_mib, n=N, **settings):
    config = WalkConfig(chunk=CHUNK, memory_budget_mib=budget_mib, min_chunk=FLOOR)
    for name, value in settings.items():
        setattr(config, name, value)
    return ExactWalk(model, window(n), config)


def need(model, chunk, store="float32", acc="float32") -> int:
    """The memory of a walk held at `chunk`, `store` and `acc`, at its full horizon."""
    held = dict(chunk=chunk, min_chunk=chunk, cache_type=store, accumulator_dtype=acc)
    return walk(model, 1e9, **held).estimate.total


def given_up(w) -> dict:
    return {c.setting: c.chosen for c in w.given_up}


@pytest.fixture
def tiers(measured, probes):
    """Each setting's memory on tiny-qwen2 (no stride or kept inputs to give up there)."""
    m = measured["qwen2"]
    t = {c: need(m, c) for c in (512, 256, 128)}
    t |= {("bf16", c): need(m, c, acc="bfloat16") for c in (512, 256, 128)}
    t |= {("q8", c): need(m, c, store="q8", acc="bfloat16") for c in (512, 256, 128)}
    t["q8"] = t[("q8", FLOOR)]
    q8 = walk(m, 1e9, chunk=FLOOR, min_chunk=FLOOR, cache_type="q8", accumulator_dtype="bfloat16")
    t["q8 floor"] = q8.estimate.total - q8.estimate.graph  # all but a chunk's graph
    assert t["q8"] < t[("bf16", 128)] < t[128] < t[256] < t[512]  # the fake graph's order
    probes.clear()
    return t


def largest(t: dict, tier: str, budget: float) -> dict:
    """The chunk change expected at `tier`: the largest chunk whose need fits `budget`."""
    chunk = max(c for c in (512, 256, 128) if t[(tier, c)] <= budget)
    return {} if chunk == CHUNK else {"chunk": chunk}


def test_each_budget_takes_exactly_its_choices_in_order(measured, probes, tiers):
    m, t = measured["qwen2"], tiers
    assert given_up(walk(m, t[512] / MIB)) == {}
    assert given_up(walk(m, (t[512] + t[256]) / 2 / MIB)) == {"chunk": 256}
    assert given_up(walk(m, (t[256] + t[128]) / 2 / MIB)) == {"chunk": FLOOR}
    # short of every exact chunk: bfloat16 accumulators, at the largest chunk they fit with
    bf16 = (t[128] + t[("bf16", 128)]) / 2
    w = walk(m, bf16 / MIB)
    assert given_up(w) == {"accumulators": "bfloat16"} | largest(t, "bf16", bf16)
    # short of those too: the 8-bit store besides, again at the largest chunk that fits
    q8 = (t[("bf16", 128)] + t["q8"]) / 2
    w = walk(m, q8 / MIB)
    chosen = largest(t, "q8", q8)
    assert given_up(w) == {"accumulators": "bfloat16", "K/V store": "q8"} | chosen
    assert (w.config.chunk, w.config.cache_type) == (chosen.get("chunk", CHUNK), "q8")
    assert w.estimate.total <= w.config.device_budget
    # short of one chunk of taps with both: refused (after the probes: the floor fits)
    counted = "device memory: the walk needs .* one chunk's graph [0-9.]+ MiB"
    with pytest.raises(OutOfMemory, match=counted):
        walk(m, (t["q8 floor"] + ROW * FLOOR / 2) / MIB)


def test_explicit_settings_are_never_changed(measured, probes, tiers):
    m, t = measured["qwen2"], tiers
    budget = (t[512] + t[("bf16", 512)]) / 2 / MIB  # auto would take bfloat16 accumulators
    held = dict(cache_type="float32", accumulator_dtype="float32", min_chunk=CHUNK)
    w = walk(m, budget, **held)
    assert given_up(w) == {} and (w.config.chunk, w.config.cache_type) == (CHUNK, "float32")
    assert w.config.accumulator_dtype == "float32"
    assert w.estimate.total > w.config.device_budget  # so its late chunks narrow instead
    w = walk(m, budget, accumulator_dtype="float32", min_chunk=CHUNK)  # the store still auto
    assert given_up(w) == {"K/V store": "q8"} and w.config.accumulator_dtype == "float32"


def test_strict_exact_refuses_the_lossy_choices_by_name(measured, probes, tiers):
    m, t = measured["qwen2"], tiers
    w = walk(m, (t[256] + t[128]) / 2 / MIB, strict_exact=True)  # a smaller chunk is exact
    assert given_up(w) == {"chunk": FLOOR}
    with pytest.raises(OutOfMemory, match="only with bfloat16 accumulators and an 8-bit K/V"):
        walk(m, (t[("bf16", 128)] + t["q8"]) / 2 / MIB, strict_exact=True)


def test_the_floor_takes_its_choices_and_refuses_before_any_probe(measured, probes, tiers):
    m, t = measured["qwen2"], tiers
    w = walk(m, 1e9)
    floor = w.estimate.total - w.estimate.graph
    acc = w.estimate.accumulators  # bfloat16 halves them
    probes.clear()
    with pytest.raises(OutOfMemory, match="one chunk's graph not counted"):
        walk(m, (t["q8 floor"] - MIB) / MIB)  # short even with both lossy choices' floor
    assert probes == []  # refused in arithmetic: no probe walked the window
    walk(m, (floor - acc / 4) / MIB)  # the lossless floor is over: bfloat16 before any probe
    assert probes[0] == (CHUNK, "float32", "bfloat16"), probes
    probes.clear()
    with pytest.raises(OutOfMemory, match="--strict-exact"):
        walk(m, (floor - acc / 4) / MIB, strict_exact=True)
    assert probes == []


def test_a_bfloat16_model_gets_a_bfloat16_store_without_a_budget(qwen2):
    qwen2.set_dtype(mx.bfloat16)
    w = ExactWalk(qwen2, window(256), WalkConfig(chunk=128))
    assert (w.config.cache_type, w.config.accumulator_dtype) == ("bfloat16", "float32")
    assert w.given_up == []
    assert choices.lossless_store("float32") == choices.lossless_store("int8") == "float32"


def test_just_under_the_exact_fit_a_hybrid_gives_up_only_exact_measures(measured, probes):
    """The hybrid with --recompute: a longer stride or fewer kept inputs, not the chunk."""
    m = measured["hybrid"]
    full = walk(m, 1e9, recompute=True, chunk=256)
    est = full.estimate
    assert est.checkpoints and est.inputs
    w = walk(m, (est.total - min(est.checkpoints, est.inputs) / 2) / MIB, recompute=True, chunk=256)
    assert given_up(w) and set(given_up(w)) <= {"checkpoint stride", "kept inputs"}, given_up(w)
    assert w.estimate.total <= w.config.device_budget


def relative(a: dict, b: dict) -> float:
    fa, fb = dict(tree_flatten(a)), dict(tree_flatten(b))
    num = sum(float(mx.sum((fa[k] - fb[k]) ** 2)) for k in fa)
    return (num / sum(float(mx.sum(fb[k] ** 2)) for k in fb)) ** 0.5


def test_the_chosen_walk_runs_within_its_budget_and_a_smaller_chunk_stays_exact(measured):
    """Real probes: a budget a smaller chunk meets (exact: the one graph's gradient to float32
    rounding) and one that takes bfloat16 accumulators and the 8-bit store; each run's peak
    within the budget."""
    m, n = measured["qwen2"], 1024

    def config(chunk, **held) -> WalkConfig:
        return WalkConfig(chunk=chunk, min_chunk=held.pop("min_chunk", chunk), **held)

    def need(chunk, cache_type="float32", accumulator_dtype="float32") -> int:
        held = dict(cache_type=cache_type, accumulator_dtype=accumulator_dtype)
        config_ = config(chunk, memory_budget_mib=1e9, **held)
        return ExactWalk(m, window(n), config_).estimate.total

    exact = (need(128) + need(64)) / 2
    lossy = (need(32, accumulator_dtype="bfloat16") + need(32, "q8", "bfloat16")) / 2
    for cap, chosen in [(exact, (64, "float32", "float32")), (lossy, (32, "q8", "bfloat16"))]:
        w = ExactWalk(m, window(n), config(128, min_chunk=32, memory_budget_mib=cap / MIB))
        assert (w.config.chunk, w.config.cache_type, w.config.accumulator_dtype) == chosen
        mx.clear_cache()
        mx.reset_peak_memory()
        loss, grads = w.run()
        assert mx.get_peak_memory() <= cap * (1 + BUDGET_MARGIN), mx.get_peak_memory() / MIB
        if chosen[1] == "float32":
            _, reference = one_graph(m, window(n))
            assert relative(grads, reference) < 1e-5
            del reference
        del w, loss, grads  # the next budget's admission counts what is still alive
        mx.clear_cache()


def test_mlxwalk_plan_shows_what_the_budget_gave_up(measured, probes, tiers):
    from mlxwalk.commands.plan import report

    t, said = tiers, []
    budget = (t[("bf16", 128)] + t["q8"]) / 2 / MIB
    config = WalkConfig(chunk=CHUNK, min_chunk=FLOOR, memory_budget_mib=budget)
    assert report(measured["qwen2"], "tiny-qwen2", N, config, said.append)
    text = "\n".join(said)
    assert "to fit the memory budget:\n" in text and "verdict: fits" in text
    assert "K/V store q8 (not float32): lossy" in text
    assert "accumulators bfloat16 (not float32): lossy" in text


def test_the_run_says_and_records_what_its_largest_window_gave_up():
    from mlxwalk.training.framework import Admission

    given = [choices.Choice("chunk", 2048, 1024), choices.Choice("K/V store", "bfloat16", "q8")]
    admitted = Admission(None, 0, 1, 1, given)
    assert admitted.lines() == [
        "to fit the memory budget:",
        "  chunk 1024 (not 2048): exact; more, smaller chunks take longer",
        "  K/V store q8 (not bfloat16): lossy: the prefix is read back at 8 bits "
        "(test-walk-exact row 1b)",
    ]
    assert [c.as_dict()["lossy"] for c in given] == [False, True]


def test_the_drop_in_says_each_change_once(capsys):
    from mlxwalk.training.mlx_framework import MLXFramework

    fw = MLXFramework.__new__(MLXFramework)  # its mechanics only: no model here
    fw.echo_choices = print
    fw.tell([choices.Choice("chunk", 512, 256)])
    fw.tell([choices.Choice("chunk", 512, 256), choices.Choice("accumulators", "x", "bfloat16")])
    out = capsys.readouterr().out
    assert out.count("chunk 256 (not 512)") == 1 and out.count("accumulators bfloat16") == 1
    assert out.count("to fit the memory budget:") == 2


def hybrid_walk(model, budget_mib, **settings):
    """The tiny hybrid at 4,096 positions in chunks of 256, recompute on, the chunk held."""
    config = WalkConfig(chunk=256, min_chunk=256, recompute=True, memory_budget_mib=budget_mib)
    for name, value in settings.items():
        setattr(config, name, value)
    return ExactWalk(model, window(4096), config)


def budgets_between(model) -> list[float]:
    """Budgets from 0.6 to 1.0 of the walk with every input kept, and the least where that walk
    fits (at its longest stride: with a few slots, the binomial schedule re-decodes little)."""
    full = hybrid_walk(model, 1e9, keep_inputs="on", **LOSSLESS).estimate.total / MIB
    lo, hi = 0.6 * full, full
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        try:
            fits = hybrid_walk(model, mid, keep_inputs="on", **LOSSLESS).estimate.total <= mid * MIB
        except OutOfMemory:
            fits = False
        lo, hi = (lo, mid) if fits else (mid, hi)
    return list(np.linspace(0.6 * full, full, 25)) + [hi]


LOSSLESS = dict(cache_type="float32", accumulator_dtype="float32")


def test_auto_kept_inputs_take_the_fit_that_forwards_the_fewest_layers_again(measured, probes):
    """Kept inputs against a longer checkpoint stride: of the kept inputs that fit (each at its
    shortest stride), auto takes the one whose reverse pass forwards the fewest layers again,
    not the first that fits: where every layer's kept input needs a long stride, none kept at
    stride 1 is cheaper."""
    m = measured["hybrid"]
    chosen_over_first = 0
    for b in budgets_between(m):
        auto = hybrid_walk(m, b, keep_inputs="auto", **LOSSLESS)
        if auto.estimate.total > b * MIB:
            continue
        fits = []
        for keep in ("on", "off"):
            try:
                w = hybrid_walk(m, b, keep_inputs=keep, **LOSSLESS)
            except OutOfMemory:  # its floor alone is past the budget
                continue
            if w.estimate.total <= b * MIB:
                fits.append((w.forwards_again(), w.keep))
        assert auto.forwards_again() == min(fits)[0], (b, auto.keep, fits)
        chosen_over_first += auto.keep == "off" and ("all" in [k for _, k in fits])
    assert chosen_over_first, "no budget where every layer's kept input fit, but at a cost"


def test_an_exact_fit_past_the_affordable_forwards_gives_way_to_a_lossy_one(
    measured, probes, monkeypatch
):
    """An exact fit that forwards more layers again than AFFORDABLE windows' decode takes the
    lossy choices auto allows where they cut it (and says so); an affordable one stays exact."""
    m = measured["hybrid"]
    cut = 0
    for b in budgets_between(m):
        w = hybrid_walk(m, b, keep_inputs="auto")
        monkeypatch.setattr(admission, "AFFORDABLE", 1e9)  # no limit: exact first, as before
        first = hybrid_walk(m, b, keep_inputs="auto")
        monkeypatch.setattr(admission, "AFFORDABLE", 2.0)
        if first.estimate.total > b * MIB:
            continue
        exact = not any(c.lossy for c in first.given_up)
        if exact and first.forwards_again() <= first.affordable():
            assert w.given_up == first.given_up, b
            continue
        assert w.forwards_again() <= first.forwards_again(), b
        if w.forwards_again() < first.forwards_again():
            cut += 1
            assert any(c.lossy for c in w.given_up), b
    assert cut, "no budget where a lossy choice cut the forwards again"


def test_plan_says_what_the_reverse_pass_forwards_again(measured, probes):
    """`mlxwalk plan` counts the layers forwarded again: none kept, every chunk's layers run
    forward once more (one window's decode); every input kept at stride 1, nothing said."""
    from mlxwalk.commands.plan import report

    m = measured["hybrid"]
    for keep, said in (("off", "1.0 windows' decode more"), ("on", None)):
        lines = []
        config = WalkConfig(chunk=256, recompute=True, keep_inputs=keep, memory_budget_mib=1e9)
        assert report(m, "tiny-qwen3_5", 4096, config, lines.append)
        again = [x for x in lines if "forwards" in x]
        assert again[0].endswith(said) if said else not again, lines
