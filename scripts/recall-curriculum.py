#!/usr/bin/env python3
"""Recall at long windows, reached by a curriculum: the fact in a window's first chunk, the
question and its answer in the last, the window growing stage by stage.

scripts/recall.py's task, model and trainers (docs/RECALL.md) at windows of --stages positions in
chunks of --chunk (a stage of 4,096 in chunks of 128 puts the fact 32 chunks before the answer).
Per seed, the --driver trainer (one graph by default: the reference) sets the schedule: it trains
a stage an epoch at a time until its held-out exact-match accuracy reaches --advance, then moves
to the next, longer window; a stage it does not pass within --max-epochs ends its schedule there
(the longest window it learned is the one before). Every other trainer then follows that same
schedule (the same stages, epochs, data, init and learning rate), so the trainers differ only in
how they take the gradient. Per stage: held-out accuracy and answer loss, seconds and peak memory
per window.

--cap-gib: a trainer whose one step at a stage's window peaks over the cap (measured on a
throwaway model first) does not train that stage or any later one; its rows say so. With
`--driver exact` the exact walk sets the schedule, for windows past where one graph fits.

Every trainer's state (weights, Adam's moments, where it is in the schedule) is saved after
each epoch under --out, and part-way through one when the run stops inside it; `--resume`
continues each from there, to the same numbers as a run never stopped (`--stop-after N` stops
after N epochs in all, `--stop-after-windows N` after N windows, as a session's end would). A
driver that did not pass its last stage within --max-epochs, resumed with a larger
--max-epochs, trains that stage on. SIGTERM or Ctrl-C stops a run the same way, after the
window under way.

    scripts/recall-curriculum.py --stages 256 512 1024 2048 4096 --chunk 128 [--seeds 3]
        [--trainers one-graph,exact,plain,peer] [--out runs/recall-curriculum] [--resume]
    scripts/recall-curriculum.py ... --parallel [--stop-after-s 500] [--resume]
        each seed's driver in its own process (`--seed N`, the same --out), then each of its
        followers in its own, then the table; with --stop-after-s each stops before a window
        that would end past the limit (predicted at --margin times its last window's rate)
    scripts/recall-curriculum.py ... --table [--plot docs/recall-curriculum.png]
        the table (and figure) of the saved states, nothing trained
    scripts/recall-curriculum.py ... --stages ... 8192 --driver exact --cap-gib 2 --resume
        a finished run goes on to the added stages, the exact walk setting the schedule where
        one graph's step peaks over the cap
    scripts/recall-curriculum.py --quick           a smoke run of seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("recall_bench", ROOT / "scripts" / "recall.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # its model, steps and evaluation (first: it sets OpenBLAS's
# threads before MLX loads it, so the imports below wait)

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from lib import recall  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from mlxwalk.training import files  # noqa: E402
from mlxwalk.walk import WalkConfig  # noqa: E402

# options that say how this call runs, not what is measured: left out of the JSON's settings
RUN_ONLY = (
    "resume",
    "stop_after",
    "stop_after_s",
    "stop_after_windows",
    "parallel",
    "seed",
    "table",
    "plot",
)
STOPPED = 3  # the exit status of a run stopped by --stop-after
# a window's predicted seconds over the last window's per position: a longer window's attention,
# other processes on the device
MARGIN = 1.5


class Stop(Exception):
    """--stop-after's epochs or --stop-after-s's seconds reached: every state is saved."""


class Budget:
    """What is left before the run stops: --stop-after's epochs, --stop-after-windows' windows and
    --stop-after-s's seconds; a window (or a held-out pass) not started when it would end past
    them, its length predicted from the trainer's last one, per position, times the margin."""

    def __init__(
        self,
        epochs: int | None,
        seconds: float | None,
        margin: float = MARGIN,
        windows: int | None = None,
    ):
        self.epochs, self.windows, self.margin = epochs, windows, margin
        self.deadline = None if seconds is None else time.perf_counter() + seconds
        self.rate: dict[str, float] = {}  # per trainer and seed (and pass): seconds a position
        self.asked = False  # SIGTERM or SIGINT came: stop at the next window

    def ask_to_stop(self, *_) -> None:
        self.asked = True

    def allows(self, who: str, positions: int) -> bool:
        if self.asked or self.epochs == 0 or self.windows == 0:
            return False
        if self.deadline is None:
            return True
        now = time.perf_counter()
        return now < self.deadline and now + self.rate.get(who, 0.0) * positions <= self.deadline

    def timed(self, who: str, positions: int, seconds: float) -> None:
        self.rate[who] = self.margin * seconds / positions

    def window_done(self) -> None:
        if self.windows is not None:
            self.windows -= 1

    def epoch_done(self) -> None:
        if self.epochs is not None:
            self.epochs -= 1

    def resumed(self, who: str, progress: dict, a) -> None:
        """The rate of a trainer's last saved epoch (or part of one), for its first window after
        --resume."""
        part = progress.get("partial")
        if part and part["windows"]:
            window = a.stages[len(progress["stages"])]
            self.rate.setdefault(who, self.margin * part["seconds"] / (window * part["windows"]))
            return
        if progress["epochs"]:
            last, window = progress["epochs"][-1], a.stages[len(progress["stages"])]
        elif progress["stages"]:
            last, window = progress["stages"][-1]["per_epoch"][-1], progress["stages"][-1]["window"]
        else:
            return
        self.rate.setdefault(who, self.margin * last["seconds"] / (window * a.trains[window]))


def stage_data(a, seed: int, stage: int, window: int) -> tuple[dict, dict]:
    """A stage's training and held-out conversations: their own seeds per stage, the held-out
    ones shared by every training seed."""
    chunk = a.chunks[window]  # the fact sits in the first chunk
    train = recall.dataset(1000 * seed + stage, a.trains[window], window, chunk, a.decoys)
    valid = recall.dataset(bench.VALID_SEED + stage, a.valid, window, chunk, a.decoys)
    return train, valid


def learning_rate(a):
    """Warmup to --lr, then constant: a schedule that does not know how long training runs."""
    warm = max(a.warmup, 1)
    return optim.join_schedules(
        [optim.linear_schedule(a.lr / 100, a.lr, warm), optim.linear_schedule(a.lr, a.lr, 1)],
        [warm],
    )


def state_folder(a, trainer: str, seed: int) -> Path:
    """Where one trainer's state on one seed is saved under --out."""
    return Path(a.out) / "state" / f"{trainer}-seed{seed}"


class Trainee:
    """One trainer on one seed: its model, optimizer and step, its place in the schedule and its
    rows, saved and restored as one folder."""

    def __init__(self, a, trainer: str, seed: int):
        self.a, self.trainer, self.seed = a, trainer, seed
        self.folder = state_folder(a, trainer, seed)
        self.model = bench.build_model(seed, a.width, a.layers, rope_theta=a.rope_theta)
        self.optimizer = bench.ClippedAdam(a.clip, learning_rate=learning_rate(a))
        self.optimizer.init(self.model.trainable_parameters())
        self.steps: dict[int, object] = {}  # per chunk length: the step walking in it
        # where it is: stages done (rows), the epochs of the stage under way
        self.progress = {"stages": [], "epochs": [], "partial": None, "done": False, "ended": None}

    def make_step(self, config: WalkConfig):
        """The trainer's step on one window, walking in `config`'s chunks."""
        return bench.make_step(self.trainer, self.model, self.optimizer, config, self.a)

    def step_at(self, window: int):
        """The step of a stage of this window (its chunk: --chunk's for the stage)."""
        chunk = self.a.chunks[window]
        if chunk not in self.steps:
            self.steps[chunk] = self.make_step(WalkConfig(chunk=chunk, follow_runs=False))
        return self.steps[chunk]

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        weights = dict(tree_flatten(self.model.parameters()))
        files.save_safetensors(self.folder / "model.safetensors", weights)
        state = dict(tree_flatten(self.optimizer.state))
        files.save_safetensors(self.folder / "optimizer.safetensors", state)
        files.write_text(self.folder / "progress.json", json.dumps(self.progress, indent=1))

    def restore(self) -> bool:
        if not (self.folder / "progress.json").exists():
            return False
        self.progress = json.loads((self.folder / "progress.json").read_text())
        weights = files.load_safetensors(self.folder / "model.safetensors")
        self.model.load_weights(list(weights.items()))
        state = files.load_safetensors(self.folder / "optimizer.safetensors")
        self.optimizer.state = tree_unflatten(list(state.items()))
        mx.eval(self.model.parameters(), self.optimizer.state)
        return True

    def epoch(self, stage: int, window: int, train: dict, valid: dict, budget: Budget) -> dict:
        """One pass over the stage's conversations in a seeded order, then the held-out scores.
        Before a window or the held-out pass that the budget does not allow, the epoch is saved
        part-way (`partial`) and Stop raised; a resumed one goes on from the next window."""
        p, who = self.progress, f"{self.trainer}/{self.seed}"
        fresh = {"epoch": len(p["epochs"]) + 1, "windows": 0, "loss": 0.0, "seconds": 0.0}
        part = p["partial"] = p.get("partial") or {**fresh, "peak_mib": 0.0}
        order = np.random.default_rng([self.seed, stage, part["epoch"]]).permutation(
            len(train["inputs"])
        )
        mx.reset_peak_memory()
        step = self.step_at(window)
        for i in order[part["windows"] :]:
            if not budget.allows(who, window):
                self.halt(part)
            start = time.perf_counter()
            part["loss"] += step(bench.window_of(train, int(i)))
            seconds = time.perf_counter() - start
            part["seconds"] += seconds
            part["windows"] += 1
            budget.timed(who, window, seconds)
            budget.window_done()
        part["peak_mib"] = max(part["peak_mib"], mx.get_peak_memory() / 2**20)
        held_out = (f"{who} held-out", window * len(valid["inputs"]))
        if not budget.allows(*held_out):
            self.halt(part)
        start = time.perf_counter()
        acc, answer_loss, _ = bench.evaluate(self.model, valid, batch=self.a.eval_batch)
        budget.timed(*held_out, time.perf_counter() - start)
        budget.epoch_done()
        p["partial"] = None
        n = len(order)
        row = {"epoch": part["epoch"], "accuracy": acc, "loss": answer_loss}
        row |= {"seconds": part["seconds"], "s_per_window": part["seconds"] / n}
        row |= {"peak_mib": part["peak_mib"], "train_loss": part["loss"] / n}
        return row

    def halt(self, part: dict) -> None:
        """Save the epoch part-way and stop."""
        part["peak_mib"] = max(part["peak_mib"], mx.get_peak_memory() / 2**20)
        self.save()
        raise Stop


def probe_peak(a, trainer: str, window: int, data: dict) -> float:
    """MiB one step of `trainer` peaks at on a throwaway model, at this window."""
    model = bench.build_model(0, a.width, a.layers, rope_theta=a.rope_theta)
    optimizer = bench.ClippedAdam(a.clip, learning_rate=a.lr)
    step = bench.make_step(trainer, model, optimizer, WalkConfig(chunk=a.chunks[window]), a)
    mx.reset_peak_memory()
    step(bench.window_of(data, 0))
    return mx.get_peak_memory() / 2**20


def train(a, trainee: Trainee, schedule: list[int] | None, budget: Budget) -> list[int]:
    """Train `trainee` from where it stands. `schedule`: the epochs per stage to follow (None:
    it is the driver and makes one). Returns the schedule it followed. `budget`: what is left
    before the run stops (shared by the trainers)."""
    p = trainee.progress
    if p["done"]:
        reopen(a, p, schedule)
    made = [s["epochs"] for s in p["stages"]]
    if p["done"] and not p["ended"] and len(p["stages"]) < len(a.stages):
        p["done"] = False  # it finished a shorter list of stages: on to the longer one's
        last = p["stages"][-1] if p["stages"] else None
        if schedule is None and last and last["accuracy"] < a.advance:  # driving now: its rule
            p["done"], p["ended"] = True, f"did not reach {a.advance} at {last['window']}"
    if p["done"]:  # saved as finished: left as it is (other processes may read it)
        return made
    for stage in range(len(p["stages"]), len(a.stages)):
        if p["done"] or (schedule is not None and stage >= len(schedule)):
            break
        window = a.stages[stage]
        train_set, valid_set = stage_data(a, trainee.seed, stage, window)
        who = f"{trainee.trainer}/{trainee.seed}"
        budget.resumed(who, p, a)
        if a.cap_gib and not p["epochs"] and not p.get("partial"):
            if not budget.allows(who, window):  # no time left: not even the cap's step
                raise Stop
            peak = probe_peak(a, trainee.trainer, window, train_set)
            if peak > a.cap_gib * 1024:
                p["done"], p["ended"] = True, f"over the cap at {window}: {peak:.0f} MiB"
                trainee.save()
                break
        while True:
            row = trainee.epoch(stage, window, train_set, valid_set, budget)
            p["epochs"].append(row)
            epochs = len(p["epochs"])
            print(
                f"  {trainee.trainer} seed {trainee.seed} window {window} epoch {epochs}: "
                f"acc {row['accuracy']:.3f} loss {row['loss']:.3f} "
                f"{row['s_per_window']:.3f} s/window {row['peak_mib']:.0f} MiB",
                flush=True,
            )
            if schedule is not None:
                passed, end = None, epochs >= schedule[stage]
            else:
                passed = row["accuracy"] >= a.advance
                end = passed or epochs >= a.max_epochs
            if end:
                break
            trainee.save()
        p["stages"].append(stage_row(window, p["epochs"], passed))
        made.append(len(p["epochs"]))
        p["epochs"] = []
        if passed is False:  # the driver did not learn this window: the schedule ends here
            p["done"], p["ended"] = True, f"did not reach {a.advance} at {window}"
        trainee.save()
    p["done"] = True
    trainee.save()
    return made


def reopen(a, p: dict, schedule: list[int] | None) -> None:
    """A finished trainer owed more epochs at its last stage trains on there: as the driver, a
    stage it did not pass within the --max-epochs given then, now more; as a follower, a stage
    its driver has since given more epochs."""
    if not p["stages"]:
        return
    last, n = p["stages"][-1], len(p["stages"])
    if schedule is None:
        owed = last["passed"] is False and last["epochs"] < a.max_epochs
    else:
        owed = n <= len(schedule) and last["epochs"] < schedule[n - 1]
    if owed and n <= len(a.stages) and a.stages[n - 1] == last["window"]:
        p["stages"].pop()
        p["epochs"], p["done"], p["ended"] = last["per_epoch"], False, None


def stage_row(window: int, epochs: list[dict], passed: bool | None) -> dict:
    last = epochs[-1]
    return {
        "window": window,
        "epochs": len(epochs),
        "accuracy": last["accuracy"],
        "loss": last["loss"],
        "seconds": sum(e["seconds"] for e in epochs),
        "s_per_window": statistics.fmean(e["s_per_window"] for e in epochs),
        "peak_mib": max(e["peak_mib"] for e in epochs),
        "passed": passed,
        "per_epoch": epochs,
    }


def run(a) -> dict:
    """Per seed: the driver first, then every other trainer on its schedule (with --epochs,
    every trainer on that schedule)."""
    budget = Budget(a.stop_after, a.stop_after_s, a.margin, a.stop_after_windows)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a run killed saves its epoch part-way first
        signal.signal(sig, budget.ask_to_stop)
    print("training; SIGTERM or Ctrl-C stops after the window under way, saved", flush=True)
    runs: dict = {}
    for seed in [a.seed] if a.seed is not None else range(a.seeds):
        order = [a.driver] + [t for t in a.trainers if t != a.driver]
        schedule = a.epochs
        if a.epochs:
            order = a.trainers
        for trainer in order:
            trainee = Trainee(a, trainer, seed)
            if a.resume:
                trainee.restore()
            made = train(a, trainee, schedule, budget)
            schedule = made if schedule is None else schedule
            runs[f"{trainer}/{seed}"] = trainee.progress
    return runs


def summary(a, runs: dict) -> list[dict]:
    """Per stage and trainer: accuracy's mean, spread (std) and range over seeds; answer loss,
    seconds per window and peak memory averaged."""
    rows = []
    for window in a.stages:
        for trainer in a.trainers:
            got = [
                s
                for key, run in runs.items()
                if key.split("/")[0] == trainer
                for s in run.get("stages", [])
                if s["window"] == window
            ]
            if not got:
                continue
            acc = [s["accuracy"] for s in got]
            rows.append(
                {
                    "window": window,
                    "trainer": trainer,
                    "seeds": len(got),
                    "epochs": statistics.fmean(s["epochs"] for s in got),
                    "accuracy": statistics.fmean(acc),
                    "spread": statistics.pstdev(acc),
                    "min": min(acc),
                    "max": max(acc),
                    "loss": statistics.fmean(s["loss"] for s in got),
                    "s_per_window": statistics.fmean(s["s_per_window"] for s in got),
                    "peak_mib": max(s["peak_mib"] for s in got),
                    "seconds": sum(s["seconds"] for s in got),
                }
            )
    return rows


def table(rows: list[dict]) -> str:
    out = [
        "| window | chunks | trainer | seeds | epochs | accuracy | spread | range | answer loss "
        "| s/window | peak MiB | stage s |",
        "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['window']:,} | {r['chunks']} | {r['trainer']} | {r['seeds']} | "
            f"{r['epochs']:.1f} | {r['accuracy']:.3f} | {r['spread']:.3f} | "
            f"{r['min']:.3f}-{r['max']:.3f} | {r['loss']:.3f} | {r['s_per_window']:.3f} | "
            f"{r['peak_mib']:.0f} | {r['seconds']:.0f} |"
        )
    return "\n".join(out)


def endings(runs: dict) -> list[str]:
    """How runs ended early, one line per trainer and reason: "one-graph: over the cap at 8192:
    2581 MiB (seeds 0, 1, 2)"."""
    seeds: dict[str, list[str]] = {}
    for key, progress in runs.items():
        if progress.get("ended"):
            trainer, seed = key.split("/")
            seeds.setdefault(f"{trainer}: {progress['ended']}", []).append(seed)
    return [f"{why} (seeds {', '.join(s)})" for why, s in seeds.items()]


def plot(rows: list[dict], path: str, title: str, notes: list[str] = ()) -> None:
    """Held-out accuracy per stage: each trainer's mean over the seeds that reached the stage,
    the band its range, chance dotted; notes (how runs ended early) written under the curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for trainer in dict.fromkeys(r["trainer"] for r in rows):
        mine = [r for r in rows if r["trainer"] == trainer]
        x = [r["window"] for r in mine]
        seeds = "/".join(str(r["seeds"]) for r in mine)
        ax.plot(x, [r["accuracy"] for r in mine], marker="o", label=f"{trainer} (seeds {seeds})")
        ax.fill_between(x, [r["min"] for r in mine], [r["max"] for r in mine], alpha=0.2)
    ax.axhline(1 / len(recall.CODES), color="gray", linestyle=":", label="chance")
    ax.set_xscale("log", base=2)
    chunks = {r["window"]: r["chunks"] for r in rows}
    ax.set_xticks(list(chunks), [f"{w:,}\n{c}" for w, c in chunks.items()])
    ax.set(
        xlabel="window (positions; chunks)",
        ylabel="held-out exact-match accuracy",
        ylim=(0, 1.02),
        title=title,
    )
    ax.legend(loc="center right", fontsize="small")
    if notes:
        ax.text(0.98, 0.14, "\n".join(notes), transform=ax.transAxes, ha="right", fontsize="small")
    fig.tight_layout()
    files.atomic_write(Path(path), lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def arguments(argv: list[str] | None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--stages", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    stage_options(p, "conversations")
    p.add_argument("--advance", type=float, default=0.9, help="held-out accuracy to move on")
    p.add_argument("--max-epochs", type=int, default=8, help="epochs the driver gives a stage")
    p.add_argument("--driver", default="one-graph", choices=bench.TRAINERS[:2])
    p.add_argument("--trainers", default="one-graph,exact,plain")
    p.add_argument("--seeds", type=int, help="seeds 0 .. N-1, one after another (default 3)")
    p.add_argument("--seed", type=int, help="run this seed only (seeds run side by side)")
    p.add_argument("--valid", type=int, default=256, help="held-out conversations a stage")
    p.add_argument("--decoys", type=float, default=recall.DECOY_RATE)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rope-theta", type=float, default=1e4, help="RoPE's base")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-batch", type=int, default=32)
    p.add_argument("--cap-gib", type=float, help="a trainer whose step peaks over it stops")
    p.add_argument("--out", default="runs/recall-curriculum")
    p.add_argument("--resume", action="store_true", help="continue every trainer from --out")
    p.add_argument(
        "--stop-after",
        type=int,
        help="stop after this many epochs in all (per process with --parallel)",
    )
    p.add_argument(
        "--stop-after-windows",
        type=int,
        help="stop after this many training windows in all, the epoch saved part-way",
    )
    p.add_argument(
        "--stop-after-s",
        type=float,
        help="stop before a window that would end past this many seconds (a call's limit), the "
        "epoch saved part-way",
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="each seed's driver, then each of its followers, in its own process, side by side "
        "(logs: OUT/seedN-TRAINER.log), then the table",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help="--stop-after-s: a window's predicted seconds are the last one's per position "
        "times this (a longer window, other processes on the device)",
    )
    p.add_argument(
        "--table", action="store_true", help="the table of the saved states; nothing trained"
    )
    p.add_argument("--plot", help="write accuracy per stage and trainer to this PNG")
    p.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # --parallel's own
    a = p.parse_args(argv)
    if a.quick:
        a.stages, a.chunk, a.train, a.valid = [128, 256], [32], [6], 6
        a.width, a.layers, a.warmup = 32, 1, 2
    if a.seeds is None:
        a.seeds = 1 if a.quick else 3
    per_stage(p, a)
    a.trainers = a.trainers.split(",")
    if unknown := set(a.trainers) - set(bench.TRAINERS):
        p.error(f"--trainers: unknown {sorted(unknown)}; choose from {', '.join(bench.TRAINERS)}")
    if a.driver not in a.trainers and not a.epochs:
        p.error(f"--driver {a.driver} is not among --trainers")
    if "peer" in a.trainers and (reason := bench.prepare_peer(a)):
        p.error(f"--trainers peer: {reason}")
    if a.parallel and a.seed is not None:
        p.error("--parallel runs every seed: give --seeds, not --seed")
    return a


def stage_options(p: argparse.ArgumentParser, examples: str) -> None:
    """--chunk, --train (`examples` a stage) and --epochs: each one value or one per stage."""
    p.add_argument("--chunk", type=int, nargs="+", default=[128], help="one, or one per stage")
    p.add_argument(
        "--train",
        type=int,
        nargs="+",
        default=[1000],
        help=f"training {examples} a stage: one, or one per stage",
    )
    p.add_argument(
        "--epochs",
        type=int,
        nargs="+",
        help="a fixed schedule (one, or one per stage): every trainer trains these epochs, no "
        "driver; --parallel runs every trainer at once",
    )


def per_stage(p: argparse.ArgumentParser, a) -> None:
    """--chunk, --train and --epochs as one value for every stage or one per stage: `a.chunks`
    and `a.trains` by window, `a.epochs` a list per stage (or None)."""
    given = {"--chunk": a.chunk, "--train": a.train, "--epochs": a.epochs}
    for name, values in given.items():
        if values is not None and len(values) not in (1, len(a.stages)):
            p.error(f"{name}: give one value or one per stage ({len(a.stages)}), not {len(values)}")
        if values is not None and min(values) < 1:
            p.error(f"{name}: every value must be positive")

    def spread(values):
        return values * len(a.stages) if len(values) == 1 else values

    a.chunks = dict(zip(a.stages, spread(a.chunk)))
    a.trains = dict(zip(a.stages, spread(a.train)))
    a.epochs = spread(a.epochs) if a.epochs else None
    if bad := [w for w, c in a.chunks.items() if w % c]:
        p.error(f"--stages: window {bad[0]} is not a multiple of its --chunk ({a.chunks[bad[0]]})")


def chunk_label(a) -> str:
    """--chunk as said in a table's heading: "128", or "32/64/128" per stage."""
    return "/".join(str(c) for c in dict.fromkeys(a.chunks.values()))


def schedule_label(a) -> str:
    """How the epochs per stage were set, as said in a table's heading."""
    if a.epochs:
        return f"a fixed schedule of {a.epochs} epochs"
    return f"driver {a.driver} (advance at {a.advance}, at most {a.max_epochs} epochs a stage)"


def side_by_side(a, argv: list[str]) -> int:
    """--parallel: each seed's driver in its own process (`--seed N --trainers DRIVER`, the same
    --out), then each follower of each finished driver in its own (`--trainers DRIVER,FOLLOWER
    --resume`: the driver's saved schedule, nothing of it retrained), waited for; 0 when every
    process finished, STOPPED when one stopped, 1 when one failed. --stop-after-s counts from
    the start: the followers get what the drivers left."""
    start = time.perf_counter()
    args = [*without([x for x in argv if x != "--parallel"], "--plot"), "--child"]
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if not a.resume:  # a fresh run: no follower may resume an earlier run's state
        for seed, trainer in ((s, t) for s in range(a.seeds) for t in a.trainers):
            shutil.rmtree(state_folder(a, trainer, seed), ignore_errors=True)
    if a.epochs:  # a fixed schedule: every trainer at once, none waits for a driver
        jobs = [(seed, [t]) for seed in range(a.seeds) for t in a.trainers]
        codes = spawn(a, args, jobs, start)
        worst = max({0: 0, STOPPED: 1}.get(code, 2) for code in codes.values())
        return [0, STOPPED, 1][worst]
    codes = spawn(a, args, [(seed, [a.driver]) for seed in range(a.seeds)], start)
    followers = [
        (seed, [a.driver, t])
        for seed in range(a.seeds)
        if codes[(seed, a.driver)] == 0
        for t in a.trainers
        if t != a.driver
    ]
    codes |= spawn(a, [*args, "--resume"], followers, start)
    worst = max({0: 0, STOPPED: 1}.get(code, 2) for code in codes.values())
    return [0, STOPPED, 1][worst]


def without(args: list[str], option: str) -> list[str]:
    """`args` less `option` and its value (`--option V` or `--option=V`)."""
    out, skip = [], False
    for x in args:
        if skip or x.startswith(option + "="):
            skip = False
            continue
        skip = x == option
        if not skip:
            out.append(x)
    return out


def spawn(a, args: list[str], jobs: list[tuple[int, list[str]]], start: float) -> dict:
    """One process per (seed, trainers), side by side, its log OUT/seedS-T.log (T: its last
    trainer); their exit statuses by (seed, T)."""
    import subprocess

    if a.stop_after_s is not None:  # what is left of the limit
        left = a.stop_after_s - (time.perf_counter() - start)
        if left < 1:  # nothing would start: stopped as they stand
            return {(seed, trainers[-1]): STOPPED for seed, trainers in jobs}
        args = [*without(args, "--stop-after-s"), f"--stop-after-s={left:.0f}"]
    procs = {}
    for seed, trainers in jobs:
        name = Path(a.out) / f"seed{seed}-{trainers[-1]}.log"
        log = open(name, "a")  # noqa: SIM115 (closed below); a resumed call appends
        cmd = [
            sys.executable,
            __file__,
            *args,
            "--seed",
            str(seed),
            "--trainers",
            ",".join(trainers),
        ]
        procs[(seed, trainers[-1])] = (
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
            log,
            name,
        )
    codes = {}
    for key, (proc, log, name) in procs.items():
        codes[key] = proc.wait()
        log.close()
        if codes[key] not in (0, STOPPED):
            tail = name.read_text().splitlines()[-5:]
            print(f"{name.name} failed ({codes[key]}):\n" + "\n".join(tail), flush=True)
    return codes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = arguments(argv)
    start = time.perf_counter()
    if a.table:
        return report(a, saved(a), start)
    if a.parallel:
        if (code := side_by_side(a, argv)) != 0:
            print("a seed stopped or failed; --resume continues", flush=True)
            return code
        a.resume = True  # every seed is done: the table from their states
    try:
        runs = run(a)
    except Stop:
        print("stopped (a limit or a signal), every state saved; --resume continues", flush=True)
        return STOPPED
    if a.child:  # one of --parallel's processes: the table and its files are the parent's
        return 0
    return report(a, runs, start)


def saved(a) -> dict:
    """Every trainer's saved progress under --out, finished or not, by "trainer/seed"."""
    runs = {}
    for seed in [a.seed] if a.seed is not None else range(a.seeds):
        for trainer in a.trainers:
            state = state_folder(a, trainer, seed) / "progress.json"
            if state.exists():
                runs[f"{trainer}/{seed}"] = json.loads(state.read_text())
    return runs


def report(a, runs: dict, start: float) -> int:
    """The table over seeds per stage and trainer, how each run ended or where it stands, and
    the JSON of it all."""
    rows = summary(a, runs)
    seeds = sorted({int(key.split("/")[1]) for key in runs})
    for r in rows:
        r["chunks"] = r["window"] // a.chunks[r["window"]]
    print(
        f"\nrecall by curriculum: stages {a.stages}, chunk {chunk_label(a)}, {schedule_label(a)}, "
        f"seeds {seeds}, "
        f"qwen2 {a.layers}x{a.width}, rope base {a.rope_theta:g}, chance "
        f"{1 / len(recall.CODES):.3f}; {time.perf_counter() - start:.0f} s"
    )
    print(table(rows))
    for key, progress in runs.items():
        if progress.get("ended"):
            print(f"{key}: {progress['ended']}")
        elif not progress.get("done") and len(progress["stages"]) < len(a.stages):
            at, part = a.stages[len(progress["stages"])], progress.get("partial")
            done = f"{len(progress['epochs'])} epochs"
            if part and part["windows"]:
                done += f" and {part['windows']} windows of the next"
            print(f"{key}: not finished, at {at} after {done} there")
        elif not progress.get("done"):
            print(f"{key}: every stage trained, not yet marked finished")
    if a.plot and rows:
        cap = f", cap {a.cap_gib:g} GiB" if a.cap_gib else ""
        title = f"recall by curriculum, chunk {chunk_label(a)}{cap}, seeds {seeds}"
        plot(rows, a.plot, title, endings(runs))
        print(f"plot: {a.plot}")
    settings = {k: v for k, v in vars(a).items() if k not in RUN_ONLY}
    out = {"settings": settings, "runs": runs, "summary": rows}
    name = "curriculum.json" if a.seed is None else f"curriculum-seed{a.seed}.json"
    files.write_text(Path(a.out) / name, json.dumps(out, indent=1))
    print(f"JSON: {Path(a.out) / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
